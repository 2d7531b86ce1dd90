"""COCO metrics, mask pasting and result JSON."""
