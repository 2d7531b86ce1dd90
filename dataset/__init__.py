"""Dataset tools: the COCO -> TFRecord converter and the synthetic shapes dataset generator."""
