"""Converts a COCO-format dataset (images + instances JSON) into sharded TFRecords for training and evaluation.

    python dataset/create_coco_tf_record.py --image_dir D/val \\
        --annotations_file D/annotations/instances_val.json --output_dir records \\
        [--tag val] [--num_shards N] [--noinclude_masks] [--num_workers 8] [--skip_empty]

Output, in --output_dir:
  <tag>-00000-of-<num_shards>.tfrecord ...  one tf.train.Example per image; image i of the JSON's 'images' list
                                            goes to shard i % num_shards. Each shard is written under
                                            a temporary name (`mrcnn_tf2.files`) and renamed only when
                                            the whole run succeeded.
  <tag>_warnings.json                       every problem found and the action taken (below), with the shards.

The tag defaults to the annotation file's name without `instances_` and `.json` (instances_val2017.json ->
val2017); the shard count to one per IMAGES_PER_SHARD (64) images, at most 256 when the tag contains 'train',
else 32 (NVIDIA's counts, which COCO reaches: 256 train2017 and 32 val2017 shards). Masks are included by
default; `--noinclude_masks` leaves them out and then ignores the 'segmentation' field entirely (no segmentation
check runs). The output does not depend on --num_workers: workers only decode and check images, and the main
process writes their results in the order of the JSON, so the same input gives byte-identical shards.

Example features (NVIDIA's names): image/encoded (JPEG bytes: the file itself when it is an RGB JPEG, otherwise
the image converted to RGB by `mrcnn_tf2.data.coco_io.to_rgb`, as inference reads photos, and encoded: 16-bit
gray keeps its high byte, alpha is composited over the ImageNet mean colour; turned upright first in the one case
of the exif_upright warning below), image/source_id (str(image id), bytes), image/height, image/width (int64, of
the image written), image/filename, image/object/bbox/{xmin,xmax,ymin,ymax} (float, normalized to [0, 1] by its
width and height), image/object/class/label (int64, the annotation file's
category id), image/object/class/text (category name), image/object/area (float: the annotation's 'area', else
the mask's pixel count, else the box's), image/object/is_crowd (int64), image/object/mask (with masks: one PNG
per instance, full image size, one channel, values 0/1, rasterized by pycocotools from polygons, uncompressed or
compressed RLE). Crowd annotations are kept with is_crowd=1; the training pipeline drops them.

Bad input. Problems with the structure of the JSON stop the run before anything is written, with a message
naming the file, the entry and the key, and exit status 2: invalid JSON; a missing or mistyped top-level
'images', 'annotations' or 'categories'; an entry without one of its required keys (images: id, file_name,
height, width; annotations: id, image_id, category_id, bbox; categories: id, name) or with a value of the wrong
type (also for the optional 'iscrowd' and 'area'); duplicate ids within one list; a category numbered 0 (the
background class) that annotations use (one no annotation uses is left alone). A missing --image_dir is also
an error, and so is a conversion that would write no image (every image missing, unreadable, or left out by
--skip_empty): it exits 2 naming the first skipped file, and leaves no shard. A worker failing later removes
every temporary shard before the error propagates.

Problems with individual images and annotations are recorded in <tag>_warnings.json, keyed by image id and
then by kind: annotation kinds list annotation ids, image kinds give a message. The file repeats WARNING_ACTIONS
under "actions" and counts each kind under "counts". Kinds and actions:
  missing_image            image skipped (no such file)
  unreadable_image         image skipped (truncated, not decodable, or of 32-bit pixels, which have no 8-bit
                           RGB reading)
  exif_upright             image turned upright by its EXIF orientation (a quarter turn) and re-encoded: the
                           JSON gives the upright image's height and width, so its annotations are taken in the
                           upright image's pixels, as a labelling tool that showed the photo upright made them
  image_size_mismatch      image kept; the file's height and width replace the JSON's (boxes and polygons are
                           taken as they are, in the file's pixels)
  unknown_image            annotation dropped (its image_id is not in 'images'; listed under that image_id)
  category_id_zero         annotation dropped (category ids start at 1: 0 is the background class)
  unknown_category         annotation dropped (category_id not in 'categories')
  non_positive_size        annotation dropped (box width or height <= 0, or 'area' <= 0)
  box_outside_image        annotation dropped (no part of the box is inside the image)
  box_clipped              box clipped to the image; annotation kept
  missing_segmentation     annotation dropped (no or an empty 'segmentation'; with masks only)
  bad_segmentation         annotation dropped (not a list of polygons nor an RLE of the image's size, an
                           odd number of polygon coordinates, or RLE counts that do not cover the image)
  polygon_too_few_points   polygons with fewer than 3 points dropped; the annotation dropped when none remains
  empty_mask               annotation dropped (the mask has no pixel inside the image)
  mask_outside_box         box and annotation kept as they are; the mask's pixel extent exceeds the (clipped)
                           box by more than MASK_BOX_TOLERANCE pixels on some side
The checks run in this order and the first that drops an annotation ends its checks. Images whose annotations
were all dropped are kept as negatives, unless --skip_empty, which skips every image left without a non-crowd
instance (not a warning: counted in the summary line).

This module converts data only: of the package it imports mrcnn_tf2.data.coco_io, mrcnn_tf2.files and
mrcnn_tf2.status alone, and TensorFlow is imported only by the process that writes the shards (workers
decode and check images with Pillow and pycocotools).
"""

import argparse
import concurrent.futures
import contextlib
import glob
import io
import json
import math
import multiprocessing
import os
import signal
import sys
from dataclasses import dataclass, field
from functools import partial

from PIL import Image, ImageOps
from pycocotools import mask as mask_utils
from tqdm import tqdm

from mrcnn_tf2 import files, status
from mrcnn_tf2.cli import import_tensorflow
from mrcnn_tf2.data.coco_io import encode_jpeg, to_rgb

SHARD_NAME = "{tag}-{index:05d}-of-{count:05d}.tfrecord"
WARNINGS_NAME = "{tag}_warnings.json"
# Default shard count: one per IMAGES_PER_SHARD images, up to NVIDIA's counts for COCO (256 train, 32 val).
# The reader gives each worker its own files and reads CYCLE_LENGTH (8) of them at once
# (mrcnn_tf2/data/pipeline.py): 256 files serve 32 GPUs, which a data set of 16384 images or more (COCO's
# 118k) gets. A smaller one gets fewer, fuller files rather than empty ones (3 images: 1 file); with fewer
# files than workers the reader splits the records among them instead.
IMAGES_PER_SHARD = 64
DEFAULT_TRAIN_SHARDS, DEFAULT_OTHER_SHARDS = 256, 32
MAX_SHARDS = 99999  # five digits in the shard names
# Pixels a mask may reach beyond its box before it is reported: rasterizing a polygon whose box was computed
# from its float vertices can touch the pixel just outside.
MASK_BOX_TOLERANCE = 1.0
# Fewest coordinates of a polygon: three (x, y) points.
MIN_POLYGON_COORDINATES = 6
BACKGROUND_CATEGORY_ID = 0

WARNING_ACTIONS = {
    "missing_image": "image skipped (no such file)",
    "unreadable_image": "image skipped (truncated, not decodable, or of pixels with no 8-bit RGB reading)",
    "exif_upright": "image turned upright by its EXIF orientation, whose height and width the JSON gives",
    "image_size_mismatch": "image kept; the file's height and width replace the JSON's",
    "unknown_image": "annotation dropped (its image_id is not in 'images')",
    "category_id_zero": "annotation dropped (category ids start at 1: 0 is the background class)",
    "unknown_category": "annotation dropped (category_id not in 'categories')",
    "non_positive_size": "annotation dropped (box width or height <= 0, or area <= 0)",
    "box_outside_image": "annotation dropped (no part of the box is inside the image)",
    "box_clipped": "box clipped to the image; annotation kept",
    "missing_segmentation": "annotation dropped (no or an empty segmentation)",
    "bad_segmentation": "annotation dropped (malformed polygons or RLE, or an RLE of another size than the image)",
    "polygon_too_few_points": "polygons with fewer than 3 points dropped; annotation dropped when none remains",
    "empty_mask": "annotation dropped (the mask has no pixel inside the image)",
    "mask_outside_box": (
        f"box and annotation kept; the mask exceeds the box by more than {MASK_BOX_TOLERANCE:g} px"
    ),
}
# Kinds that concern a whole image (their value is a message); the others list annotation ids.
IMAGE_WARNINGS = ("missing_image", "unreadable_image", "exif_upright", "image_size_mismatch")
# The EXIF tag of the orientation, and its values that turn the image a quarter (mirrored or not), swapping its
# height and width: only then can the JSON's size tell which pixels its annotations were made on.
EXIF_ORIENTATION, QUARTER_TURNS = 0x0112, (5, 6, 7, 8)


class BadInputError(ValueError):
    """The inputs cannot be converted; nothing is left written."""


# ----------------------------------------------------------------------------------------------------
# Validation of the annotation file


def _is_int(value):
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value):
    return (isinstance(value, (int, float)) and not isinstance(value, bool)) and math.isfinite(value)


# Required keys of each list's entries, with the check of the value and what the check means.
REQUIRED_KEYS = {
    "images": (
        ("id", _is_int, "an integer"),
        ("file_name", lambda v: isinstance(v, str) and v != "", "a non-empty string"),
        ("height", lambda v: _is_int(v) and v > 0, "a positive integer"),
        ("width", lambda v: _is_int(v) and v > 0, "a positive integer"),
    ),
    "annotations": (
        ("id", _is_int, "an integer"),
        ("image_id", _is_int, "an integer"),
        ("category_id", _is_int, "an integer"),
        (
            "bbox",
            lambda v: isinstance(v, list) and len(v) == 4 and all(_is_number(x) for x in v),
            "a list of 4 finite numbers [x, y, width, height]",
        ),
    ),
    "categories": (("id", _is_int, "an integer"), ("name", lambda v: isinstance(v, str), "a string")),
}
OPTIONAL_KEYS = {
    "annotations": (
        ("iscrowd", lambda v: v in (0, 1), "0 or 1"),
        ("area", _is_number, "a finite number"),
    ),
}


def load_annotations(path):
    """Reads and validates a COCO instances file.

    Args:
      path: the JSON file.

    Returns:
      the parsed dict (its 'images', 'annotations' and 'categories' checked as the module docstring says).

    Raises:
      BadInputError naming the file, the entry index and the key.
    """
    try:
        with open(path, "rb") as f:
            dataset = json.load(f)
    except OSError as error:
        raise BadInputError(f"{path}: cannot read the annotation file: {error.strerror}") from error
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        raise BadInputError(f"{path}: invalid JSON: {error}") from error
    if not isinstance(dataset, dict):
        raise BadInputError(f"{path}: the top level must be a JSON object, got {type(dataset).__name__}")
    for key, required in REQUIRED_KEYS.items():
        if key not in dataset:
            raise BadInputError(f"{path}: no key '{key}' at the top level")
        entries = dataset[key]
        if not isinstance(entries, list):
            raise BadInputError(f"{path}: '{key}' must be a list, got {type(entries).__name__}")
        first_index_of = {}
        for index, entry in enumerate(entries):
            where = f"{key}[{index}]"
            if not isinstance(entry, dict):
                raise BadInputError(f"{path}: {where} must be an object, got {type(entry).__name__}")
            for name, check, meaning in required:
                if name not in entry:
                    raise BadInputError(f"{path}: {where} has no key '{name}'")
                if not check(entry[name]):
                    raise BadInputError(f"{path}: {where}['{name}'] must be {meaning}, got {entry[name]!r}")
            for name, check, meaning in OPTIONAL_KEYS.get(key, ()):
                if name in entry and not check(entry[name]):
                    raise BadInputError(f"{path}: {where}['{name}'] must be {meaning}, got {entry[name]!r}")
            previous = first_index_of.setdefault(entry["id"], index)
            if previous != index:
                raise BadInputError(f"{path}: {where}['id'] = {entry['id']} repeats {key}[{previous}]['id']")
    # A stray annotation of category 0 is dropped with a warning; a whole class numbered 0 would be dropped
    # with it (files from tools that number categories from 0), which is no dataset's intent.
    background = [index for index, category in enumerate(dataset["categories"])
                  if category["id"] == BACKGROUND_CATEGORY_ID]
    used = sum(annotation["category_id"] == BACKGROUND_CATEGORY_ID for annotation in dataset["annotations"])
    if background and used:
        category = dataset["categories"][background[0]]
        raise BadInputError(f"{path}: categories[{background[0]}] ({category.get('name', '')!r}) has id "
                            f"{BACKGROUND_CATEGORY_ID}, which {used} annotations use: id {BACKGROUND_CATEGORY_ID} is "
                            "Mask R-CNN's background class, whose objects would all be dropped; number the "
                            "categories from 1 (and their annotations' category_id)")
    return dataset


# ----------------------------------------------------------------------------------------------------
# One image: read, check, rasterize (runs in the worker processes)


@dataclass
class ImageResult:
    """What a worker hands back for one image.

    encoded is None when the image is skipped. The per-instance lists are parallel, one entry per kept
    annotation: boxes as (xmin, ymin, xmax, ymax) normalized to [0, 1]; masks as PNG bytes (empty without masks).
    warnings maps a kind to the annotation ids it concerns, or, for IMAGE_WARNINGS, to a message.
    """

    image_id: int
    file_name: str
    encoded: bytes = None
    height: int = 0
    width: int = 0
    boxes: list = field(default_factory=list)
    labels: list = field(default_factory=list)
    texts: list = field(default_factory=list)
    areas: list = field(default_factory=list)
    is_crowd: list = field(default_factory=list)
    masks: list = field(default_factory=list)
    warnings: dict = field(default_factory=dict)


def compressed_rle_counts(text):
    """Run lengths of a COCO compressed RLE string, or None when the string is malformed.

    The decoding is pycocotools' (rleFrString); it is redone here because pycocotools trusts the string and
    overruns its buffer on one that ends early or whose runs exceed the image.

    Args:
      text: str, the 'counts' of a compressed RLE.

    Returns:
      list of ints (may contain negatives for a corrupt string), or None.
    """
    counts, position = [], 0
    while position < len(text):
        value, shift, more = 0, 0, True
        while more:
            if position == len(text):
                return None
            code = ord(text[position]) - 48
            if not 0 <= code < 64:
                return None
            value |= (code & 0x1F) << shift
            more = code & 0x20
            position += 1
            shift += 5
            if not more and code & 0x10:
                value |= -1 << shift
        if len(counts) > 2:
            value += counts[-2]
        counts.append(value)
    return counts


def _segmentation_rle(segmentation, height, width):
    """The pycocotools RLE of one annotation's segmentation.

    Returns:
      (RLE dict, or None when the annotation must be dropped; list of warning kinds).
    """
    if segmentation is None or (isinstance(segmentation, (list, dict)) and not segmentation):
        return None, ["missing_segmentation"]
    if isinstance(segmentation, list):
        polygons, kinds = [], []
        for polygon in segmentation:
            if not isinstance(polygon, list) or not all(_is_number(v) for v in polygon) or len(polygon) % 2:
                return None, ["bad_segmentation"]
            if len(polygon) < MIN_POLYGON_COORDINATES:
                kinds = ["polygon_too_few_points"]
            else:
                polygons.append([float(v) for v in polygon])
        if not polygons:
            return None, kinds
        return mask_utils.merge(mask_utils.frPyObjects(polygons, height, width)), kinds
    if isinstance(segmentation, dict) and segmentation.get("size") == [height, width]:
        counts = segmentation.get("counts")
        if isinstance(counts, list) and all(_is_int(c) and c >= 0 for c in counts):
            if sum(counts) != height * width:
                return None, ["bad_segmentation"]
            return mask_utils.frPyObjects(segmentation, height, width), []
        if isinstance(counts, str):
            runs = compressed_rle_counts(counts)
            if runs is not None and min(runs, default=0) >= 0 and sum(runs) == height * width:
                return {"size": [height, width], "counts": counts.encode("ascii")}, []
    return None, ["bad_segmentation"]


def _encode_png(mask):
    """[H, W] uint8 {0, 1} -> PNG bytes, one channel."""
    buffer = io.BytesIO()
    Image.fromarray(mask).save(buffer, format="PNG")
    return buffer.getvalue()


def _check_annotation(annotation, height, width, categories, include_masks, result):
    """Checks one annotation of an image and, unless it is dropped, appends its instance to `result`.

    Args:
      annotation: the JSON entry (validated by load_annotations).
      height, width: the image file's size.
      categories: dict category id -> name.
      include_masks: rasterize and check the segmentation.
      result: the image's ImageResult, extended in place.

    Returns:
      list of the warning kinds raised by this annotation (in WARNING_ACTIONS order).
    """
    category_id = annotation["category_id"]
    if category_id == BACKGROUND_CATEGORY_ID:
        return ["category_id_zero"]
    if category_id not in categories:
        return ["unknown_category"]
    x, y, w, h = (float(v) for v in annotation["bbox"])
    area = annotation.get("area")
    if w <= 0 or h <= 0 or (area is not None and area <= 0):
        return ["non_positive_size"]
    xmin, ymin, xmax, ymax = max(x, 0.0), max(y, 0.0), min(x + w, float(width)), min(y + h, float(height))
    if xmax <= xmin or ymax <= ymin:
        return ["box_outside_image"]
    kinds = ["box_clipped"] if (xmin, ymin, xmax, ymax) != (x, y, x + w, y + h) else []
    if include_masks:
        rle, segmentation_kinds = _segmentation_rle(annotation.get("segmentation"), height, width)
        kinds += segmentation_kinds
        if rle is None:
            return kinds
        pixels = float(mask_utils.area(rle))
        if pixels == 0:
            return kinds + ["empty_mask"]
        mask_x, mask_y, mask_w, mask_h = mask_utils.toBbox(rle).tolist()
        if (
            mask_x < xmin - MASK_BOX_TOLERANCE
            or mask_y < ymin - MASK_BOX_TOLERANCE
            or mask_x + mask_w > xmax + MASK_BOX_TOLERANCE
            or mask_y + mask_h > ymax + MASK_BOX_TOLERANCE
        ):
            kinds.append("mask_outside_box")
        result.masks.append(_encode_png(mask_utils.decode(rle)))
        area = pixels if area is None else area
    result.boxes.append((xmin / width, ymin / height, xmax / width, ymax / height))
    result.labels.append(category_id)
    result.texts.append(categories[category_id].encode("utf-8"))
    result.areas.append(float(w * h if area is None else area))
    result.is_crowd.append(int(annotation.get("iscrowd", 0)))
    return kinds


def convert_image(image, annotations, image_dir, categories, include_masks):
    """Reads one image, checks its annotations and rasterizes its masks.

    Args:
      image: its 'images' entry.
      annotations: its 'annotations' entries, in file order.
      image_dir: directory the file_name is relative to.
      categories: dict category id -> name.
      include_masks: produce and check masks.

    Returns:
      ImageResult (encoded None when the image is skipped).
    """
    result = ImageResult(image_id=image["id"], file_name=image["file_name"])
    path = os.path.join(image_dir, image["file_name"])
    try:
        with open(path, "rb") as f:
            data = f.read()
    except FileNotFoundError:
        result.warnings["missing_image"] = f"{path}: no such file"
        return result
    except OSError as error:
        result.warnings["unreadable_image"] = f"{path}: {error.strerror}"
        return result
    try:
        decoded = Image.open(io.BytesIO(data))
        decoded.load()  # decodes every byte now: a truncated file fails here, not in training
        stored = decoded.size
        orientation = decoded.getexif().get(EXIF_ORIENTATION)
        # COCO's annotations are in the stored pixels; a JSON that gives the size turned a quarter, as the EXIF
        # orientation turns it, was made on the upright photo.
        upright = (orientation in QUARTER_TURNS and (image["width"], image["height"]) == stored[::-1]
                   and stored[0] != stored[1])
        if upright:
            decoded = ImageOps.exif_transpose(decoded)
        is_rgb_jpeg = not upright and decoded.format == "JPEG" and decoded.mode == "RGB"
        encoded = data if is_rgb_jpeg else encode_jpeg(to_rgb(decoded))
    except (OSError, SyntaxError, ValueError, Image.DecompressionBombError) as error:
        result.warnings["unreadable_image"] = f"{path}: {error}"
        return result
    if upright:
        result.warnings["exif_upright"] = (
            f"the file's pixels are {stored[1]}x{stored[0]} (height x width) with EXIF orientation {orientation}, "
            f"the JSON says {image['height']}x{image['width']}: turned upright"
        )
    width, height = decoded.size
    if (height, width) != (image["height"], image["width"]):
        result.warnings["image_size_mismatch"] = (
            f"the file is {height}x{width} (height x width), the JSON says {image['height']}x{image['width']}"
        )
    result.encoded = encoded
    result.height, result.width = height, width
    annotation_warnings = {}
    for annotation in annotations:
        for kind in _check_annotation(annotation, height, width, categories, include_masks, result):
            annotation_warnings.setdefault(kind, []).append(annotation["id"])
    for kind in WARNING_ACTIONS:  # a fixed order of kinds keeps the warnings file easy to compare
        if kind in annotation_warnings:
            result.warnings[kind] = annotation_warnings[kind]
    return result


# ----------------------------------------------------------------------------------------------------
# Writing


def default_tag(annotations_file):
    """instances_val2017.json -> val2017; other names lose only their extension."""
    name = os.path.splitext(os.path.basename(annotations_file))[0]
    return name[len("instances_") :] if name.startswith("instances_") and name != "instances_" else name


def default_num_shards(tag, num_images):
    """The shards of `num_images` images without --num_shards: one per IMAGES_PER_SHARD (at least one), at
    most DEFAULT_TRAIN_SHARDS for a tag containing 'train', else DEFAULT_OTHER_SHARDS."""
    most = DEFAULT_TRAIN_SHARDS if "train" in tag else DEFAULT_OTHER_SHARDS
    return min(most, max(1, math.ceil(num_images / IMAGES_PER_SHARD)))


def _serialize_example(result, include_masks, train):
    """One ImageResult -> serialized tf.train.Example bytes (`train` is the tf.train module)."""

    def ints(values):
        return train.Feature(int64_list=train.Int64List(value=values))

    def floats(values):
        return train.Feature(float_list=train.FloatList(value=values))

    def strings(values):
        return train.Feature(bytes_list=train.BytesList(value=values))

    xmin, ymin, xmax, ymax = (list(column) for column in zip(*result.boxes)) if result.boxes else ([],) * 4
    feature = {
        "image/encoded": strings([result.encoded]),
        "image/source_id": strings([str(result.image_id).encode("utf-8")]),
        "image/height": ints([result.height]),
        "image/width": ints([result.width]),
        "image/filename": strings([result.file_name.encode("utf-8")]),
        "image/object/bbox/xmin": floats(xmin),
        "image/object/bbox/xmax": floats(xmax),
        "image/object/bbox/ymin": floats(ymin),
        "image/object/bbox/ymax": floats(ymax),
        "image/object/class/label": ints(result.labels),
        "image/object/class/text": strings(result.texts),
        "image/object/area": floats(result.areas),
        "image/object/is_crowd": ints(result.is_crowd),
    }
    if include_masks:
        feature["image/object/mask"] = strings(result.masks)
    # deterministic=True orders the feature map, so equal inputs give equal bytes.
    return train.Example(features=train.Features(feature=feature)).SerializeToString(deterministic=True)


def _convert_task(task, image_dir, categories, include_masks):
    """convert_image on an (image entry, its annotations) pair: the one-argument form a pool maps."""
    image, annotations = task
    return convert_image(image, annotations, image_dir, categories, include_masks)


def _results(tasks, worker, num_workers):
    """ImageResults in task order, computed in-process (num_workers <= 1) or by a pool of spawned processes."""
    if num_workers <= 1:
        yield from map(worker, tasks)
        return
    # Spawned, not forked: the parent may run TensorFlow's threads, whose locks a fork would copy. Ctrl-C reaches
    # the workers too (one process group): they leave it to the parent, which stops them and removes the
    # temporary shards, rather than each printing a KeyboardInterrupt traceback. A worker ended by a signal to
    # the whole group (SLURM's scancel, systemd) breaks the executor, which stops the others; a
    # multiprocessing.Pool instead waited forever for the queue lock such a worker held.
    pool = concurrent.futures.ProcessPoolExecutor(num_workers, mp_context=multiprocessing.get_context("spawn"),
                                                  initializer=signal.signal, initargs=(signal.SIGINT, signal.SIG_IGN))
    try:
        yield from pool.map(worker, tasks, chunksize=max(1, min(16, len(tasks) // (4 * num_workers))))
    finally:
        pool.shutdown(cancel_futures=True)  # a stop: the images not begun are dropped, not converted first


@dataclass
class ConversionSummary:
    """Counts and paths of one conversion."""

    tag: str
    shard_paths: list
    warnings_path: str
    images_written: int = 0
    images_skipped: int = 0
    images_empty_skipped: int = 0
    instances: int = 0
    crowd_instances: int = 0
    warnings: int = 0

    def line(self):
        empty = f", {self.images_empty_skipped} empty ones skipped" if self.images_empty_skipped else ""
        return (
            f"{self.tag}: {self.images_written} images written, {self.images_skipped} skipped{empty}; "
            f"{self.instances} instances ({self.crowd_instances} crowd); {self.warnings} warnings in "
            f"{self.warnings_path}; {len(self.shard_paths)} shards"
        )


def _default_num_workers():
    """The CPUs this process may run on."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


def _group_annotations(dataset):
    """(per image id, its annotations in file order; per unknown image id, the ids of its annotations)."""
    by_image = {image["id"]: [] for image in dataset["images"]}
    orphans = {}
    for annotation in dataset["annotations"]:
        if annotation["image_id"] in by_image:
            by_image[annotation["image_id"]].append(annotation)
        else:
            orphans.setdefault(annotation["image_id"], []).append(annotation["id"])
    return by_image, orphans


def _warnings_report(annotations_file, image_dir, warnings):
    """The content of <tag>_warnings.json: actions, counts per kind, and warnings per image id."""
    counts = dict.fromkeys(WARNING_ACTIONS, 0)
    for kinds in warnings.values():
        for kind, value in kinds.items():
            counts[kind] += 1 if kind in IMAGE_WARNINGS else len(value)
    return {
        "annotations_file": annotations_file,
        "image_dir": image_dir,
        "actions": WARNING_ACTIONS,
        "counts": counts,
        "images": {str(image_id): kinds for image_id, kinds in warnings.items()},
    }


def convert_coco(
    image_dir,
    annotations_file,
    output_dir,
    tag=None,
    num_shards=None,
    include_masks=True,
    num_workers=None,
    skip_empty=False,
    progress=True,
):
    """Converts one COCO split into sharded TFRecords and a warnings file (see the module docstring).

    Args:
      image_dir: directory holding the images (file_name is relative to it).
      annotations_file: COCO instances JSON.
      output_dir: destination, created if needed.
      tag: shard name prefix; None derives it from the annotation file's name (default_tag).
      num_shards: number of shards, 1..MAX_SHARDS and at most the number of images; None:
        default_num_shards(tag, number of images).
      include_masks: write image/object/mask and check segmentations.
      num_workers: processes decoding images; None: the CPUs available; 1: no extra process.
      skip_empty: leave out images without any non-crowd instance (after the checks).
      progress: show a progress bar.

    Returns:
      ConversionSummary.

    Raises:
      BadInputError: invalid annotation file, missing image_dir, bad arguments, or no image to write;
        nothing is written.
    """
    tag = default_tag(annotations_file) if tag is None else tag
    if not tag or os.sep in tag:
        raise BadInputError(f"tag must be a non-empty file name prefix, got {tag!r}")
    if num_shards is not None and not 1 <= num_shards <= MAX_SHARDS:
        raise BadInputError(f"num_shards must be in 1..{MAX_SHARDS}, got {num_shards}")
    num_workers = _default_num_workers() if num_workers is None else num_workers
    if num_workers < 1:
        raise BadInputError(f"num_workers must be >= 1, got {num_workers}")
    dataset = load_annotations(annotations_file)
    if not os.path.isdir(image_dir):
        raise BadInputError(f"{image_dir}: the image directory "
                            f"{'is a file' if os.path.exists(image_dir) else 'does not exist'}")
    if os.path.exists(output_dir) and not os.path.isdir(output_dir):
        raise BadInputError(f"{output_dir}: the output directory is a file")
    if num_shards is None:
        num_shards = default_num_shards(tag, len(dataset["images"]))
    elif num_shards > max(1, len(dataset["images"])):
        # An empty shard leaves the training worker that reads it without records.
        raise BadInputError(f"num_shards {num_shards} exceeds the {len(dataset['images'])} images of "
                            f"{annotations_file}: shards would be empty")

    by_image, orphans = _group_annotations(dataset)
    categories = {category["id"]: category["name"] for category in dataset["categories"]}
    tasks = [(image, by_image[image["id"]]) for image in dataset["images"]]
    worker = partial(_convert_task, image_dir=image_dir, categories=categories, include_masks=include_masks)
    shard_paths = [
        os.path.join(output_dir, SHARD_NAME.format(tag=tag, index=i, count=num_shards)) for i in range(num_shards)
    ]
    summary = ConversionSummary(tag, shard_paths, os.path.join(output_dir, WARNINGS_NAME.format(tag=tag)))
    warnings = {}

    tf = import_tensorflow()  # only here: worker processes import this module and never need TensorFlow

    os.makedirs(output_dir, exist_ok=True)
    writers, finished = [], False
    try:
        writers = [tf.io.TFRecordWriter(files.temporary_path(path)) for path in shard_paths]
        results = _results(tasks, worker, min(num_workers, max(len(tasks), 1)))
        progress_bar = tqdm(results, total=len(tasks), unit="img", desc=tag, disable=not progress)
        for index, result in enumerate(progress_bar):
            if result.warnings:
                warnings[result.image_id] = result.warnings
            if result.encoded is None:
                summary.images_skipped += 1
                continue
            if skip_empty and not any(crowd == 0 for crowd in result.is_crowd):
                summary.images_empty_skipped += 1
                continue
            writers[index % num_shards].write(_serialize_example(result, include_masks, tf.train))
            summary.images_written += 1
            summary.instances += len(result.labels)
            summary.crowd_instances += sum(result.is_crowd)
        if summary.images_written == 0:
            raise BadInputError(_no_image_message(annotations_file, image_dir, len(tasks), warnings))
        for image_id, annotation_ids in orphans.items():
            warnings.setdefault(image_id, {})["unknown_image"] = annotation_ids
        for writer in writers:
            writer.close()
        report = _warnings_report(annotations_file, image_dir, warnings)
        summary.warnings = sum(report["counts"].values())
        files.write_json(summary.warnings_path, report, indent=1)
        for path in shard_paths:
            files.commit(files.temporary_path(path), path)
        finished = True
    finally:
        if not finished:
            for writer in writers:
                # Closing flushes: on the full disk that ended the conversion it fails too, and the shards
                # must still go.
                with contextlib.suppress(Exception):
                    writer.close()
            for path in shard_paths:
                files.remove(files.temporary_path(path))
    _note_stale_shards(output_dir, tag, shard_paths)
    return summary


def _no_image_message(annotations_file, image_dir, num_images, warnings):
    """Why a conversion of `num_images` images wrote none, in one line: the images skipped with the first one's
    warning (missing files first: the likely cause is --image_dir) and what to do; `warnings` as convert_coco's."""
    for kind, problem, fix in (
            ("missing_image", "missing", f"; the file_name values of {annotations_file} are relative to --image_dir "
                                         f"({image_dir}): give the directory that holds them"),
            ("unreadable_image", "unreadable", "")):
        found = [kinds[kind] for kinds in warnings.values() if kind in kinds]
        if found:
            more = ", ..." if len(found) > 1 else ""
            return f"no image written: {problem} images: {len(found)} of {num_images} ({found[0]}{more}){fix}"
    if num_images == 0:
        return f"no image written: {annotations_file} lists no images"
    return f"no image written: --skip_empty left out all {num_images} images (none has a non-crowd instance)"


def _note_stale_shards(output_dir, tag, shard_paths):
    """Says on stderr when shards of the same tag from another run (another shard count) sit beside ours, and
    when a conversion that was killed left its temporary shards (`files.abandoned`)."""
    pattern = os.path.join(glob.escape(output_dir), f"{glob.escape(tag)}-[0-9][0-9][0-9][0-9][0-9]-of-*.tfrecord")
    stale = sorted(set(glob.glob(pattern)) - set(shard_paths))
    if stale:
        print(
            f"note: {output_dir} also holds {len(stale)} other '{tag}' shards (e.g. {os.path.basename(stale[0])}) "
            f"from an earlier run; a file pattern such as '{tag}*.tfrecord' reads them too",
            file=sys.stderr,
        )
    abandoned = files.abandoned_note(pattern)
    if abandoned:
        print(f"note: {abandoned}", file=sys.stderr)


def build_parser():
    """The command line (see the module docstring)."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    # A leading ~ is the home directory, also where no shell expanded it (a quoted path, a job spec).
    parser.add_argument("--image_dir", required=True, type=os.path.expanduser, help="directory of the images")
    parser.add_argument("--annotations_file", required=True, type=os.path.expanduser, help="COCO instances JSON")
    parser.add_argument("--output_dir", required=True, type=os.path.expanduser,
                        help="where the shards and <tag>_warnings.json go")
    parser.add_argument("--tag", help="shard name prefix (default: from the annotation file, e.g. val2017)")
    parser.add_argument(
        "--num_shards", type=int, help=f"shards (default: one per {IMAGES_PER_SHARD} images, at most "
        f"{DEFAULT_TRAIN_SHARDS} if the tag contains 'train', else {DEFAULT_OTHER_SHARDS})"
    )
    masks = parser.add_mutually_exclusive_group()
    masks.add_argument(
        "--include_masks", dest="include_masks", action="store_true", default=True,
        help="write instance masks (the default)",
    )
    masks.add_argument(
        "--noinclude_masks", dest="include_masks", action="store_false",
        help="leave masks out and ignore the 'segmentation' field",
    )
    parser.add_argument("--num_workers", type=int, help="image decoding processes (default: the CPUs available)")
    parser.add_argument(
        "--skip_empty", action="store_true", help="skip images without a non-crowd object (default: keep them)"
    )
    return parser


def main(argv=None):
    """Command-line entry; returns the exit status (`mrcnn_tf2.status`): OK, BAD_INPUT when the inputs cannot
    be converted, or that of the signal that stopped it (Ctrl-C, SIGTERM, SIGHUP; `status.run_stoppable`: the
    temporary shards are removed first)."""
    args = build_parser().parse_args(argv)
    return status.run_stoppable(lambda: _convert(args), os.path.basename(__file__))


def _convert(args):
    """main's conversion of the parsed `args`; returns the exit status."""
    try:
        summary = convert_coco(
            args.image_dir,
            args.annotations_file,
            args.output_dir,
            tag=args.tag,
            num_shards=args.num_shards,
            include_masks=args.include_masks,
            num_workers=args.num_workers,
            skip_empty=args.skip_empty,
        )
    except BadInputError as error:
        print(f"error: {error}", file=sys.stderr)
        return status.BAD_INPUT
    print(summary.line())
    return status.OK


if __name__ == "__main__":
    sys.exit(main())
