"""tf.data input pipeline: TFRecord parsing, image preprocessing, augmentation, GT mask crops, anchor labels; and
the dataset scripts' JPEG encoding (coco_io, without TensorFlow)."""
