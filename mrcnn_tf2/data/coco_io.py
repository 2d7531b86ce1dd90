"""The one JPEG encoding the dataset scripts (dataset/) share, so that both write the same bytes for the same pixels.

It lives in the package, which they import, because they are scripts: they cannot import each other
without editing sys.path. Their files are written atomically by `mrcnn_tf2.files`. It imports neither
TensorFlow nor the rest of the package, and knows nothing about COCO semantics or TFRecords.
"""

import io

from PIL import Image

# Quality of every JPEG the scripts encode: high enough that re-encoding costs no visible detail.
JPEG_QUALITY = 95


def encode_jpeg(image: Image.Image) -> bytes:
    """Encodes an RGB PIL image as baseline JPEG bytes at JPEG_QUALITY (deterministic for the same pixels)."""
    if image.mode != "RGB":
        raise ValueError(f"encode_jpeg expects an RGB image, got mode {image.mode!r}")
    buffer = io.BytesIO()
    image.save(buffer, format="JPEG", quality=JPEG_QUALITY)
    return buffer.getvalue()
