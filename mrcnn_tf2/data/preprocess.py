"""Image preprocessing, the one home of the arithmetic that turns an image into the model's input.

The input pipeline (training and evaluation), `main.py infer` and the exported SavedModel's signatures all
call `resize_normalize_pad`, so that a picture gives the same model input, hence the same detections,
whichever way it comes in. Each step is also a function of its own:

  decode_image   encoded JPEG / PNG / BMP / GIF bytes -> [h, w, 3] uint8 RGB
  resize         [h, w, 3] -> [h', w', 3] float32, the largest aspect-preserving size that fits (H, W)
  normalize      ImageNet mean and standard deviation (0..255 scale), per RGB channel
  pad            zeros at the bottom and right, to (H, W)

A normalised zero is the ImageNet mean colour, so the padding looks like a mean-coloured border to the
model. This module reads no config and draws nothing.

Glossary: h x w the image's size, H x W = image_size (the model's input size).
"""

import tensorflow as tf

# The normalisation the ImageNet-pretrained backbone expects (that module checks converted checkpoints too).
from mrcnn_tf2.model.pretrained import IMAGENET_MEAN, IMAGENET_STD


def decode_image(encoded):
    """Encoded image bytes (scalar tf.string: JPEG, PNG, BMP or GIF, first frame) -> [h, w, 3] uint8 RGB.

    Grayscale becomes RGB and alpha is dropped; EXIF orientation is ignored.
    """
    return tf.io.decode_image(encoded, channels=3, dtype=tf.uint8, expand_animations=False)


def resize(image, image_size):
    """Aspect-preserving bilinear resize of `image` to the largest size that fits `image_size`.

    Args:
      image: [h, w, 3] uint8 or float RGB.
      image_size: (H, W).

    Returns:
      (resized [h', w', 3] float32 with h' <= H and w' <= W, image_info [5] float32
       [h', w', 1 / scale, h, w], scale scalar float32 = h' / h, about w' / w).
    """
    original = tf.cast(tf.shape(image)[:2], tf.float32)
    target = tf.constant(image_size, tf.float32)
    scale = tf.reduce_min(target / original)
    # Rounding could exceed the target by a pixel on the side that does not bind the scale.
    scaled = tf.minimum(tf.round(original * scale), target)
    resized = tf.image.resize(tf.cast(image, tf.float32), tf.cast(scaled, tf.int32), method="bilinear")
    image_info = tf.concat([scaled, [1.0 / scale], original], axis=0)
    return resized, image_info, scale


def normalize(image):
    """[..., 3] float32 RGB on the 0..255 scale -> (image - IMAGENET_MEAN) / IMAGENET_STD, same shape."""
    return (image - IMAGENET_MEAN) / IMAGENET_STD


def pad(image, image_size):
    """[h', w', C] with h' <= H, w' <= W -> [H, W, C], zeros at the bottom and right."""
    return tf.image.pad_to_bounding_box(image, 0, 0, image_size[0], image_size[1])


def resize_normalize_pad(image, image_size):
    """The model input of one image: `resize`, `normalize`, `pad`.

    Args:
      image: [h, w, 3] uint8 RGB.
      image_size: (H, W) of the output.

    Returns:
      (image [H, W, 3] float32 normalised and padded, image_info [5] float32
       [scaled_h, scaled_w, 1 / scale, h, w], scale scalar float32: multiplying a box in original-image
       pixels by it gives the box in the model input's pixels).
    """
    resized, image_info, scale = resize(image, image_size)
    return pad(normalize(resized), image_size), image_info, scale
