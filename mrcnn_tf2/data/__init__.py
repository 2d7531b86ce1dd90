"""tf.data input pipeline: TFRecord parsing, augmentation, GT mask crops, anchor labels."""
