"""TensorFlow 2 / Keras 3 Mask R-CNN (ResNet-FPN) for instance segmentation."""
