"""tf.data input pipeline: TFRecord parsing, augmentation, GT mask crops, anchor labels; and the dataset
scripts' file output (coco_io, without TensorFlow)."""
