"""PIL images in and out, shared by the dataset scripts (dataset/) and inference: the one conversion of an image
of any mode to RGB, so that training's records and inference's photos hold the same pixels for the same file, and
the one JPEG encoding, so that both scripts write the same bytes for the same pixels.

It lives in the package, which they import, because they are scripts: they cannot import each other
without editing sys.path. Their files are written atomically by `mrcnn_tf2.files`. It imports neither
TensorFlow nor the rest of the package (the converter's worker processes import it), and knows nothing about
COCO semantics or TFRecords.
"""

import io

import numpy as np
from PIL import Image

# Quality of every JPEG the scripts encode: high enough that re-encoding costs no visible detail.
JPEG_QUALITY = 95
# What transparent pixels become: model.pretrained.IMAGENET_MEAN rounded, which normalises to 0 as the
# padding does (tests/test_infer_export.py holds the two together).
TRANSPARENT_FILL = (124, 116, 104)
# Modes with alpha (premultiplied included), flattened over TRANSPARENT_FILL.
_ALPHA_MODES = ("RGBA", "RGBa", "LA", "La", "PA")
# One channel of 16 bits: PIL's convert() would clip it to 255, so its high byte is taken instead, as
# PIL reads 16-bit RGB and as tf.io.decode_png(dtype=tf.uint8) reduces 16 bits.
_GRAY_16_BIT_MODES = ("I;16", "I;16L", "I;16B", "I;16N")


def to_rgb(image: Image.Image) -> Image.Image:
    """A PIL image of any mode with an 8-bit RGB reading -> an RGB PIL image of the same size.

    Grayscale (8 or 16 bits) becomes gray RGB, a palette its colours; transparency (an alpha channel, or a
    palette's or a gray image's transparent colour) is composited over TRANSPARENT_FILL. Raises ValueError naming
    the mode for pixels of 32-bit integers or floats (modes I and F), whose range no file states.
    """
    if image.mode in _GRAY_16_BIT_MODES:
        image = Image.fromarray((np.asarray(image) >> 8).astype(np.uint8), "L")
    elif image.mode in ("I", "F"):
        raise ValueError(f"PIL mode {image.mode} (32-bit {'integer' if image.mode == 'I' else 'float'} pixels) has "
                         "no 8-bit reading: save the image with 8 or 16 bits per channel")
    if image.mode == "P" or "transparency" in image.info:
        image = image.convert("RGBA")  # a palette or a transparent colour may carry alpha
    if image.mode in _ALPHA_MODES:
        background = Image.new("RGBA", image.size, TRANSPARENT_FILL + (255,))
        return Image.alpha_composite(background, image.convert("RGBA")).convert("RGB")
    return image.convert("RGB")


def encode_jpeg(image: Image.Image) -> bytes:
    """Encodes an RGB PIL image as baseline JPEG bytes at JPEG_QUALITY (deterministic for the same pixels)."""
    if image.mode != "RGB":
        raise ValueError(f"encode_jpeg expects an RGB image, got mode {image.mode!r}")
    buffer = io.BytesIO()
    image.save(buffer, format="JPEG", quality=JPEG_QUALITY)
    return buffer.getvalue()
