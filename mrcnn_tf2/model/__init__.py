"""The Keras Mask R-CNN model and its parts."""
