"""File output shared by the dataset scripts (dataset/): atomic writes and the one JPEG encoding they both use.

It lives in the package, which they import, because they are scripts: they cannot import each other
without editing sys.path. It imports neither TensorFlow nor the rest of the package.

A file written here appears under its final name only once it is complete: it is written to
`<path>.tmp` beside the destination, then renamed over it (a rename within one directory is atomic), so
an interrupted run never leaves a file that looks finished. This module knows nothing about COCO
semantics or TFRecords and must not grow to.
"""

import io
import json
import os

from PIL import Image

# Suffix of a file still being written; never matched by the `train*.tfrecord` style patterns readers use.
TEMPORARY_SUFFIX = ".tmp"
# Quality of every JPEG the scripts encode: high enough that re-encoding costs no visible detail.
JPEG_QUALITY = 95


def temporary_path(path: str) -> str:
    """The name `path` is written under until it is complete."""
    return path + TEMPORARY_SUFFIX


def write_bytes_atomically(path: str, data: bytes) -> None:
    """Writes `data` to `path` through a temporary file and a rename."""
    staging = temporary_path(path)
    try:
        with open(staging, "wb") as f:
            f.write(data)
        os.replace(staging, path)
    except BaseException:
        if os.path.exists(staging):
            os.remove(staging)
        raise


def write_json_atomically(path: str, obj, indent=None) -> None:
    """Writes `obj` as JSON to `path` (UTF-8, keys in insertion order) through a temporary file.

    indent=None writes compact JSON (annotation files with polygons grow several-fold when indented).
    """
    separators = (",", ":") if indent is None else (",", ": ")
    write_bytes_atomically(path, json.dumps(obj, indent=indent, separators=separators).encode("utf-8"))


def encode_jpeg(image: Image.Image) -> bytes:
    """Encodes an RGB PIL image as baseline JPEG bytes at JPEG_QUALITY (deterministic for the same pixels)."""
    if image.mode != "RGB":
        raise ValueError(f"encode_jpeg expects an RGB image, got mode {image.mode!r}")
    buffer = io.BytesIO()
    image.save(buffer, format="JPEG", quality=JPEG_QUALITY)
    return buffer.getvalue()
