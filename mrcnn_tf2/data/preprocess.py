"""Image preprocessing, the one home of the arithmetic that turns an image into the model's input.

The input pipeline (training and evaluation), `main.py infer` and the exported SavedModel's signatures all
ask the run's `Preprocessor` (which calls these functions), so that a picture gives the same model input,
hence the same detections, whichever way it comes in. Each step is also a function of its own:

  decode_image   encoded JPEG / PNG / BMP / GIF bytes -> [h, w, 3] uint8 RGB (JPEG optionally as PIL does;
                 gray and alpha made RGB as `coco_io.to_rgb` makes them: `flatten`)
  resize         [h, w, 3] -> [h', w', 3] float32, the largest aspect-preserving size that fits (H, W), or
                 torchvision's Mask R-CNN rule (shorter side to min_size, longer side at most max_size)
  scale_and_crop training's scale jitter: the rule's scale times a factor, cut to at most (H, W)
  normalize      ImageNet mean and standard deviation (0..255 scale), per RGB channel
  pad            zeros at the bottom and right, to (H, W)

A normalised zero is the ImageNet mean colour, so the padding looks like a mean-coloured border to the
model. This module reads no config and draws nothing.

Glossary: h x w the image's size, H x W = image_size (the model's input size).
"""

import tensorflow as tf

from mrcnn_tf2.data.coco_io import TRANSPARENT_FILL
# The normalisation the ImageNet-pretrained backbone expects (that module checks converted checkpoints too).
from mrcnn_tf2.model.pretrained import IMAGENET_MEAN, IMAGENET_STD


def decode_image(encoded, dct_method=""):
    """Encoded image bytes (scalar tf.string: JPEG, PNG, BMP or GIF, first frame) -> [h, w, 3] uint8 RGB.

    Grayscale becomes RGB (16-bit its high byte) and alpha is composited over coco_io.TRANSPARENT_FILL
    (`flatten`), as `coco_io.to_rgb` makes PIL images RGB; EXIF orientation is ignored.

    Args:
      encoded: scalar tf.string.
      dct_method: tf.io.decode_jpeg's inverse DCT, used for JPEG only: "" TensorFlow's default (today
        libjpeg's fast integer transform, a few levels off other decoders), "INTEGER_FAST" or
        "INTEGER_ACCURATE", libjpeg's ISLOW transform, the one PIL decodes with: the pixels then equal
        ``PIL.Image.open(...).convert("RGB")``'s (torchvision's reference scripts load images with PIL).
    """
    methods = ("", "INTEGER_FAST", "INTEGER_ACCURATE")
    if dct_method not in methods:
        raise ValueError(f"dct_method must be one of {methods}, got {dct_method!r}.")

    def decode_any():
        return flatten(tf.io.decode_image(encoded, channels=0, dtype=tf.uint8, expand_animations=False))

    if not dct_method:
        return decode_any()
    # tf.io.decode_image has no dct_method: JPEG goes to decode_jpeg, everything else keeps decode_image.
    return tf.cond(tf.io.is_jpeg(encoded),
                   lambda: tf.io.decode_jpeg(encoded, channels=3, dct_method=dct_method),
                   decode_any)


def flatten(image):
    """[h, w, C] uint8 of gray, gray and alpha, RGB or RGBA (C = 1 to 4) -> [h, w, 3] uint8 RGB: gray repeated,
    alpha composited over coco_io.TRANSPARENT_FILL, rounded to the nearest level as PIL's alpha_composite over
    an opaque colour rounds (the same pixels as `coco_io.to_rgb`'s)."""
    channels = tf.shape(image)[-1]
    color = tf.cond(channels < 3, lambda: tf.tile(image[..., :1], [1, 1, 3]), lambda: image[..., :3])

    def composited():
        alpha = tf.cast(image[..., -1:], tf.int32)
        mixed = tf.cast(color, tf.int32) * alpha + tf.constant(TRANSPARENT_FILL, tf.int32) * (255 - alpha)
        return tf.cast((mixed + 127) // 255, tf.uint8)

    return tf.ensure_shape(tf.cond(channels % 2 == 0, composited, lambda: color), [None, None, 3])


def resize(image, image_size, min_size=None, max_size=1333):
    """Aspect-preserving bilinear resize (half-pixel centres, no antialiasing) by one of two rules.

    min_size None: the largest size that fits image_size, scale = min(H / h, W / w), sides rounded to the
    nearest pixel (at least 1, capped at H, W); tf.image.resize.

    min_size an int: torchvision's Mask R-CNN rule (GeneralizedRCNNTransform at evaluation): scale = min(min_size /
    shorter side, max_size / longer side) in float64, sides floor(side * scale) in float64 (F.interpolate with
    scale_factor and recompute_scale_factor=True; at least 1, where torchvision's would be 0 and it fails), so that
    h' x w' equals torchvision's for every size it takes, quirks included (a shorter side of 97 comes out as 799
    under min_size 800, since 97 * (800 / 97) < 800 in float64). So h' / h and w' / w can each differ slightly from
    scale; torchvision maps boxes between the two images per axis, by h' / h and w' / w in float32 (and back by
    h / h', w / w'), not by scale. The pixels are F.interpolate(align_corners=False)'s to float32 rounding (within 1e-4
    on the 0..255 scale). The resized image must fit image_size: otherwise an InvalidArgumentError names both sizes
    (a portrait 640x480 image becomes 1066x800 under min_size 800, which an 800x1333 image_size cannot hold;
    1344x1344 holds either orientation).

    Args:
      image: [h, w, 3] uint8 or float RGB.
      image_size: (H, W).
      min_size: None, or a positive int, the target of the shorter side.
      max_size: positive int, the cap on the longer side (with an int min_size only).

    Returns:
      (resized [h', w', 3] float32 with h' <= H and w' <= W, image_info [5] float32
       [h', w', 1 / scale, h, w], scale scalar float32: h' / h and w' / w up to rounding to whole pixels).
    """
    original = tf.cast(tf.shape(image)[:2], tf.float32)
    image = tf.cast(image, tf.float32)
    if min_size is None:
        target = tf.constant(image_size, tf.float32)
        scale = rule_scale(tf.shape(image)[:2], image_size)
        # Rounding could exceed the target by a pixel on the side that does not bind the scale, and leave no
        # pixel on the short side of a strip (1 x 3000 on a 128 x 128 canvas).
        scaled = tf.clip_by_value(tf.round(original * scale), 1.0, target)
        resized = tf.image.resize(image, tf.cast(scaled, tf.int32), method="bilinear")
        image_info = tf.concat([scaled, [1.0 / scale], original], axis=0)
        return resized, image_info, scale

    sides = tf.cast(tf.shape(image)[:2], tf.float64)
    scale64 = rule_scale(tf.shape(image)[:2], image_size, min_size, max_size)
    # At least one pixel per side: torchvision fails on a strip whose short side floors to 0 (1 x 2000).
    scaled = tf.maximum(tf.cast(tf.floor(sides * scale64), tf.int32), 1)
    target = tf.constant(image_size, tf.int32)
    rule = f"torchvision's resize rule (min_size {min_size}, max_size {max_size})"
    check = tf.debugging.Assert(tf.reduce_all(scaled <= target), [tf.strings.format(
        rule + " resizes the {} image to {}, which does not fit image_size {}", [tf.shape(image)[:2], scaled, target])])
    with tf.control_dependencies([check]):
        scaled = tf.identity(scaled)

    def taps(in_size, out_size):
        """ATen's bilinear taps along one axis: [out_size] lower and upper source pixels and their weights.

        The source coordinate scale * (i + 0.5) - 0.5, scale = in / out in float32, is rounded once, as
        ATen's fused multiply-add rounds it (the float64 product is exact, and so is the difference where
        it is not negative, i.e. not clamped to 0). tf.image.resize rounds it twice: a coordinate a
        float32 step off moves a pixel by up to about 1e-2 (0..255 scale) next to sharp edges.
        """
        ratio = tf.cast(tf.cast(in_size, tf.float32) / tf.cast(out_size, tf.float32), tf.float64)
        centres = tf.range(out_size, dtype=tf.float64) + 0.5
        source = tf.cast(tf.maximum(ratio * centres - 0.5, 0.0), tf.float32)
        low = tf.minimum(tf.cast(source, tf.int32), in_size - 1)
        frac = tf.clip_by_value(source - tf.cast(low, tf.float32), 0.0, 1.0)
        return low, tf.minimum(low + 1, in_size - 1), 1.0 - frac, frac

    # Along x, then along y, as ATen's separable kernel.
    shape = tf.shape(image)
    left, right, w_left, w_right = taps(shape[1], scaled[1])
    resized = tf.gather(image, left, axis=1) * w_left[:, None] + tf.gather(image, right, axis=1) * w_right[:, None]
    top, bottom, w_top, w_bottom = taps(shape[0], scaled[0])
    resized = tf.gather(resized, top) * w_top[:, None, None] + tf.gather(resized, bottom) * w_bottom[:, None, None]
    image_info = tf.concat([tf.cast(scaled, tf.float32), tf.cast([1.0 / scale64], tf.float32), original], axis=0)
    return resized, image_info, tf.cast(scale64, tf.float32)


def rule_scale(shape, image_size, min_size=None, max_size=1333):
    """`resize`'s scale of an image of `shape` [2] int32 (h, w): float32 min(H / h, W / w) when min_size is None,
    else float64 torchvision's min(min_size / shorter side, max_size / longer side)."""
    if min_size is None:
        return tf.reduce_min(tf.constant(image_size, tf.float32) / tf.cast(shape, tf.float32))
    for name, value in (("min_size", min_size), ("max_size", max_size)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be a positive int, got {value!r}.")
    # Python float arithmetic, as torchvision computes the scale and F.interpolate the output size: every
    # operation is a correctly rounded float64 one, hence the same bits here.
    sides = tf.cast(shape, tf.float64)
    return tf.minimum(min_size / tf.reduce_min(sides), max_size / tf.reduce_max(sides))


def scale_and_crop(image, image_size, factor, position, min_size=None, max_size=1333):
    """Scale jitter for training: the image resized by `resize`'s rule scale times `factor`, then cut to at most
    (H, W) where it is larger (TF Model Garden's aug_scale_min / aug_scale_max augmentation).

    Bilinear with half-pixel centres (tf.image.resize), sides rounded to the nearest pixel, at least 1.

    Args:
      image: [h, w, 3] uint8 or float RGB.
      image_size: (H, W).
      factor: scalar float32 > 0, the jitter's multiple of the rule's scale.
      position: [2] float32 in [0, 1], where the cut lies along each axis's excess (0 top / left, 1 bottom /
        right); unused along an axis that fits.
      min_size, max_size: `resize`'s rule.

    Returns:
      (image [h', w', 3] float32 with h' <= H and w' <= W, image_info [5] float32 [h', w', 1 / scale, h, w],
       scale scalar float32: model pixels per original pixel, window [4] float32 [ymin, xmin, ymax, xmax]:
       the original image's part that the output shows, in its pixels).
    """
    shape = tf.shape(image)[:2]
    original = tf.cast(shape, tf.float32)
    scale = tf.cast(rule_scale(shape, image_size, min_size, max_size), tf.float32) * factor
    scaled = tf.maximum(tf.cast(tf.round(original * scale), tf.int32), 1)
    resized = tf.image.resize(tf.cast(image, tf.float32), scaled, method="bilinear")
    target = tf.constant(image_size, tf.int32)
    cut = tf.minimum(scaled, target)
    start = tf.cast(tf.floor(position * tf.cast(scaled - cut, tf.float32)), tf.int32)
    resized = tf.slice(resized, tf.concat([start, [0]], 0), tf.concat([cut, [3]], 0))
    window = tf.concat([tf.cast(start, tf.float32), tf.cast(start + cut, tf.float32)], 0) / scale
    image_info = tf.concat([tf.cast(cut, tf.float32), [1.0 / scale], original], axis=0)
    return resized, image_info, scale, window


def normalize(image):
    """[..., 3] float32 RGB on the 0..255 scale -> (image - IMAGENET_MEAN) / IMAGENET_STD, same shape."""
    return (image - IMAGENET_MEAN) / IMAGENET_STD


def pad(image, image_size):
    """[h', w', C] with h' <= H, w' <= W -> [H, W, C], zeros at the bottom and right."""
    return tf.image.pad_to_bounding_box(image, 0, 0, image_size[0], image_size[1])


def resize_normalize_pad(image, image_size, min_size=None, max_size=1333):
    """The model input of one image on the canvas: `resize` (by its rule), `normalize`, `pad`.

    Args:
      image: [h, w, 3] uint8 RGB.
      image_size: (H, W) of the output.
      min_size, max_size: `resize`'s rule.

    Returns:
      (image [H, W, 3] float32 normalised and padded, image_info [5] float32
       [scaled_h, scaled_w, 1 / scale, h, w], scale scalar float32: multiplying a box in original-image
       pixels by it gives the box in the model input's pixels).
    """
    resized, image_info, scale = resize(image, image_size, min_size, max_size)
    return pad(normalize(resized), image_size), image_info, scale


class Preprocessor:
    """A run's preprocessing, bound to its data settings: the one object the input pipeline, `main.py infer`
    and the exported model ask to decode, resize, normalise and pad.

    Two padding conventions: a fixed canvas (data.image_size, every batch the same shape) or, with
    data.pad_to_multiple, each evaluation or inference batch padded to its largest image rounded up to that
    multiple (torchvision's size_divisible). Training always uses the canvas: its RPN targets are labelled
    per image in the input pipeline, before batching.
    """

    def __init__(self, data):
        """data: a mrcnn_tf2.config.DataConfig (image_size, resize_min_size, resize_max_size,
        pad_to_multiple, jpeg_dct_method)."""
        self.image_size = tuple(int(v) for v in data.image_size)
        self.min_size = data.resize_min_size
        self.max_size = data.resize_max_size
        self.pad_to_multiple = data.pad_to_multiple
        self.dct_method = data.jpeg_dct_method

    def decode(self, encoded):
        """Encoded image bytes (scalar tf.string) -> [h, w, 3] uint8 RGB (`decode_image`)."""
        return decode_image(encoded, self.dct_method)

    def resize_normalize(self, image):
        """[h, w, 3] uint8 RGB -> (image [h', w', 3] float32 normalised, image_info [5], scale) (`resize`)."""
        resized, image_info, scale = resize(image, self.image_size, self.min_size, self.max_size)
        return normalize(resized), image_info, scale

    def training_example(self, image):
        """[h, w, 3] uint8 -> (image [H, W, 3] on the canvas, image_info [5], scale)."""
        return resize_normalize_pad(image, self.image_size, self.min_size, self.max_size)

    def scale_and_crop(self, image, factor, position):
        """Training's scale jitter under this run's resize rule: `scale_and_crop`'s (image [h', w', 3] float32
        unnormalised, image_info [5], scale, window [4]); `normalize_pad` puts the image on the canvas."""
        return scale_and_crop(image, self.image_size, factor, position, self.min_size, self.max_size)

    def normalize_pad(self, image):
        """[h', w', 3] float32 resized RGB (0..255) -> [H, W, 3] normalised on the canvas."""
        return pad(normalize(image), self.image_size)

    def example(self, image):
        """[h, w, 3] uint8 -> (image, image_info [5], scale) for evaluation or inference: on the canvas
        [H, W, 3], or [h', w', 3] unpadded when batches are padded to their own size (`pad_batch`)."""
        if self.pad_to_multiple is None:
            return self.training_example(image)
        return self.resize_normalize(image)

    def pad_batch(self, images, image_info):
        """The model input of a batch of examples stacked with zero padding to any common size.

        Args:
          images: [B, h, w, 3] float32, each example at the top left, zeros elsewhere (on the canvas, or
            padded to the batch's largest example).
          image_info: [B, 5] float32, the examples' image_info ([:, 0:2] their resized sizes).

        Returns:
          [B, H, W, 3]: unchanged on the canvas; with pad_to_multiple, cut or zero-padded to the largest
          resized size rounded up to the multiple.
        """
        if self.pad_to_multiple is None:
            return images
        multiple = self.pad_to_multiple
        largest = tf.cast(tf.reduce_max(image_info[:, 0:2], axis=0), tf.int32)
        height, width = tf.unstack((largest + multiple - 1) // multiple * multiple)
        images = images[:, :height, :width]
        return tf.image.pad_to_bounding_box(images, 0, 0, height, width)
