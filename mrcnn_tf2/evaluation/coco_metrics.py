"""COCO evaluation of model detections: result dicts, COCOeval statistics, a printable table.

Input detections are the model's `predict_step` outputs (see `mrcnn_tf2.model.mask_rcnn.MaskRCNN`):
boxes [ymin, xmin, ymax, xmax] float32 in pixels of the ORIGINAL image, continuous coordinates (width =
xmax - xmin), masks [D, R, R] probabilities relative to their box (pixel-centre convention of
`mrcnn_tf2.ops.masks`). COCO results use boxes [x, y, width, height] and masks as compressed RLE.

Category ids: the TFRecord converter keeps the annotation file's category ids as labels, so a training
class id is its COCO category id (identity mapping). Class ids that are not categories of the annotation
file (never learned, or the empty slot 0) cannot be scored and are dropped with a warning.

This module is NumPy and pycocotools only; nothing here runs in TensorFlow.
"""

import contextlib
import io
import os
import warnings

import numpy as np
from pycocotools.coco import COCO
from pycocotools.cocoeval import COCOeval

from mrcnn_tf2.config import COCO_IOU_TYPES, COCO_STATISTICS, ConfigError
from mrcnn_tf2.ops.masks import encode_pasted_masks

# The 12 statistics of COCOeval.summarize(), in its order, and its iou types (the config names them too).
STAT_NAMES = COCO_STATISTICS
IOU_TYPES = COCO_IOU_TYPES
# Opens the statistic's name of one category's AP: 'bbox/AP-circle'.
CATEGORY_AP = "AP-"
# Predicted mask probabilities at or above this are foreground (as in Mask R-CNN).
MASK_THRESHOLD = 0.5


def metric_key(iou_type, stat):
    """The metrics-dict key of one statistic, e.g. ('bbox', 'AP') -> 'bbox/AP'."""
    return f"{iou_type}/{stat}"


def detections_to_coco(predictions, category_ids):
    """COCO result dicts of a batch of detections, keeping the first num_detections of each image.

    Args:
      predictions: dict of NumPy arrays or tensors, as `MaskRCNN.predict_step` returns them:
        detection_boxes [B, D, 4] float (original-image pixels, [ymin, xmin, ymax, xmax]),
        detection_scores [B, D] float, detection_classes [B, D] int (class id = COCO category id),
        num_detections [B] int, image_info [B, 5] float ([3:5] = original height, width),
        source_ids [B] int (COCO image ids), and optionally detection_masks [B, D, R, R] float
        probabilities (without it the results have no segmentation).
      category_ids: iterable of the annotation file's category ids.

    Returns:
      list of dicts {image_id: int, category_id: int, bbox: [x, y, w, h] floats (clipped to the
      image), score: float, segmentation: {size: [h, w], counts: str}} (segmentation only with masks),
      in image then detection order. Detections of a class id outside `category_ids` are dropped; a
      UserWarning says how many.
    """
    results, dropped = convert_detections(predictions, category_ids)
    warn_dropped(dropped, category_ids)
    return results


def convert_detections(predictions, category_ids, encode=encode_pasted_masks):
    """`detections_to_coco` without the warning: returns (results, number of dropped detections).

    `encode` is `encode_pasted_masks` or its fused twin `ops.fused.encode_pasted_masks` (same signature
    and results).
    """
    required = ("detection_boxes", "detection_scores", "detection_classes", "num_detections", "image_info",
                "source_ids")
    missing = [key for key in required if key not in predictions]
    if missing:
        raise ValueError(f"predictions lacks {', '.join(missing)}; it must hold the predict_step outputs.")
    known = np.array(sorted(int(c) for c in category_ids), np.int64)
    boxes = np.asarray(predictions["detection_boxes"], np.float32)
    scores = np.asarray(predictions["detection_scores"], np.float32)
    classes = np.asarray(predictions["detection_classes"]).astype(np.int64)
    counts = np.asarray(predictions["num_detections"]).astype(np.int64)
    image_info = np.asarray(predictions["image_info"], np.float32)
    image_ids = np.asarray(predictions["source_ids"]).astype(np.int64)
    masks = predictions.get("detection_masks")
    masks = None if masks is None else np.asarray(masks, np.float32)
    if boxes.ndim != 3 or boxes.shape[-1] != 4:
        raise ValueError(f"detection_boxes must be [B, D, 4], got shape {boxes.shape}.")
    if np.any(counts < 0) or np.any(counts > boxes.shape[1]):
        raise ValueError(f"num_detections must lie in [0, {boxes.shape[1]}], got {counts.tolist()}.")

    results, dropped = [], 0
    for b in range(boxes.shape[0]):
        count = counts[b]
        keep = np.isin(classes[b, :count], known)
        dropped += int(count - keep.sum())
        height, width = (int(round(v)) for v in image_info[b, 3:5])
        image_boxes = boxes[b, :count][keep]
        segmentations = None
        if masks is not None:
            segmentations = encode(masks[b, :count][keep], image_boxes, (height, width), MASK_THRESHOLD)
        ymin, xmin, ymax, xmax = np.split(image_boxes, 4, axis=1)
        # The generator clips to the resized image, which can map back a fraction of a pixel outside.
        ymin, ymax = np.clip(ymin, 0, height), np.clip(ymax, 0, height)
        xmin, xmax = np.clip(xmin, 0, width), np.clip(xmax, 0, width)
        xywh = np.concatenate([xmin, ymin, xmax - xmin, ymax - ymin], axis=1).tolist()
        for i, (bbox, score, category) in enumerate(zip(xywh, scores[b, :count][keep], classes[b, :count][keep])):
            result = {"image_id": int(image_ids[b]), "category_id": int(category), "bbox": bbox,
                      "score": float(score)}
            if segmentations is not None:
                rle = segmentations[i]
                # JSON needs text: pycocotools returns the compressed counts as ASCII bytes.
                result["segmentation"] = {"size": [int(v) for v in rle["size"]],
                                          "counts": rle["counts"].decode("ascii")}
            results.append(result)
    return results, dropped


def warn_dropped(dropped, category_ids):
    """Warns (UserWarning) when `dropped` > 0 detections had a class id outside `category_ids`."""
    if dropped:
        warnings.warn(
            f"dropped {dropped} detections whose class id is not a category of the annotation file "
            f"(categories {sorted(int(c) for c in category_ids)}): the model predicts classes the "
            f"evaluation set does not define; check --num_classes and --eval_file", stacklevel=3)


def load_annotations(path):
    """The pycocotools COCO object of the annotation JSON file `path` (--eval_file), loaded without
    pycocotools' console chatter. Raises ConfigError naming --eval_file and `path` when the file cannot be read,
    is not JSON, or is not a COCO annotation object (one whose images, annotations and categories have ids)."""
    try:
        with contextlib.redirect_stdout(io.StringIO()):
            return COCO(path)
    except OSError as err:
        raise ConfigError("--eval_file", f"{path} cannot be read: {err.strerror or err}") from None
    except (ValueError, AssertionError, KeyError, TypeError, AttributeError) as err:  # JSONDecodeError: a ValueError
        detail = f"no {err} key in an entry" if isinstance(err, KeyError) else str(err) or type(err).__name__
        raise ConfigError("--eval_file", f"{path} is not a COCO annotation file: {detail}") from None


def check_record_images(coco_gt, images, eval_file):
    """Checks, before any image is evaluated, that `coco_gt` (the annotation file `eval_file`) is of the images
    of the validation records.

    images: {image id: (file name, height, width)} of the records (`pipeline.evaluation_images`; "" and 0 where a
    record lacks them, which are then not compared; nor are entries without file_name, height or width).

    Raises ConfigError naming --eval_file when it lacks some of the ids, or when every file name compared differs
    from the record's (the annotations of other images under the same ids: every AP would be scored against
    other objects). Warns (UserWarning) when the file names of only some differ, and when
    sizes differ (the converter keeps an image whose JSON size is wrong: its image_size_mismatch warning).
    """
    missing = sorted(set(images) - set(coco_gt.imgs))
    if missing:
        raise ConfigError("--eval_file", f"{eval_file} has no entry for {len(missing)} of the {len(images)} "
                          f"validation images (ids {', '.join(map(str, missing[:5]))}"
                          f"{', ...' if len(missing) > 5 else ''}): it is not the annotation file of the validation "
                          "records")
    compared, other_names, other_sizes = 0, [], []
    for image_id, (name, height, width) in sorted(images.items()):
        entry = coco_gt.imgs[image_id]
        if name and entry.get("file_name"):
            compared += 1
            if os.path.basename(name) != os.path.basename(entry["file_name"]):
                other_names.append((image_id, name, entry["file_name"]))
        if height and "height" in entry and "width" in entry and (entry["height"], entry["width"]) != (height, width):
            other_sizes.append((image_id, (height, width), (entry["height"], entry["width"])))
    if other_names:
        image_id, name, annotated = other_names[0]
        found = f"image id {image_id} is {name!r} in the validation records and {annotated!r} in {eval_file}"
        if len(other_names) == compared:
            raise ConfigError("--eval_file", f"{eval_file} is the annotation file of other images: {found}, and "
                              f"each of the {compared} file names differs")
        warnings.warn(f"{len(other_names)} of {compared} validation images have another file name in the annotation "
                      f"file than in the records ({found}): their APs are scored against another image's objects",
                      stacklevel=3)
    if other_sizes:
        image_id, (height, width), (annotated_height, annotated_width) = other_sizes[0]
        warnings.warn(
            f"{len(other_sizes)} of {len(images)} validation images have another size in the annotation file than in "
            f"the records (image id {image_id} is {height}x{width}, height x width, in the records and "
            f"{annotated_height}x{annotated_width} in the annotations): if all do, --eval_file is the annotation "
            "file of other images", stacklevel=3)


def evaluate(coco_gt, results, image_ids, iou_types=IOU_TYPES):
    """COCOeval statistics of `results` over the images `image_ids` only.

    Args:
      coco_gt: pycocotools COCO object of the ground truth.
      results: list of COCO result dicts (`detections_to_coco`); entries need a segmentation for "segm".
        Not modified.
      image_ids: iterable of the evaluated image ids (images without detections count as misses).
      iou_types: subset of ("bbox", "segm").

    Returns:
      dict {'<iou_type>/<stat>': float} for each iou type and each of STAT_NAMES (12 per type), then each
      category's AP, '<iou_type>/AP-<category name>' (`_category_aps`). COCO's conventions hold: values in
      [0, 1], and -1 where a statistic is undefined (no ground truth in its area range, or of its category).
      Empty `results` give 0 for every defined statistic (no crash).

    Raises:
      ValueError: no image ids, unknown image ids or iou types, or results for images outside image_ids.
    """
    image_ids = sorted({int(i) for i in image_ids})
    if not image_ids:
        raise ValueError("image_ids is empty: there is nothing to evaluate.")
    unknown = sorted(set(image_ids) - set(coco_gt.getImgIds()))
    if unknown:
        raise ValueError(f"image_ids holds ids that the annotations do not have: {unknown[:10]}.")
    bad_types = [t for t in iou_types if t not in IOU_TYPES]
    if bad_types or not iou_types:
        raise ValueError(f"iou_types must be a non-empty subset of {IOU_TYPES}, got {tuple(iou_types)}.")
    outside = sorted({r["image_id"] for r in results} - set(image_ids))
    if outside:
        raise ValueError(f"results hold detections of images not in image_ids: {outside[:10]}.")
    metrics = {}
    for iou_type in iou_types:
        if iou_type == "segm" and any("segmentation" not in r for r in results):
            raise ValueError("results lack 'segmentation': 'segm' needs mask detections.")
        # loadRes adds fields to its input, and it takes a result's area from its bbox when one is
        # present: box results go without masks, mask results without boxes (area = mask area).
        dropped_field = "segmentation" if iou_type == "bbox" else "bbox"
        dt = [{k: v for k, v in r.items() if k != dropped_field} for r in results]
        with contextlib.redirect_stdout(io.StringIO()):
            coco_dt = coco_gt.loadRes(dt) if dt else _empty_results(coco_gt)
            evaluator = COCOeval(coco_gt, coco_dt, iou_type)
            evaluator.params.imgIds = image_ids
            evaluator.evaluate()
            evaluator.accumulate()
            evaluator.summarize()
        metrics.update({metric_key(iou_type, name): float(v) for name, v in zip(STAT_NAMES, evaluator.stats)})
        metrics.update(_category_aps(evaluator, iou_type))
    return metrics


def _category_aps(evaluator, iou_type):
    """{'<iou_type>/AP-<category name>': AP} of an accumulated COCOeval, one per category (detectron2's keys):
    precision averaged over IoU 0.50:0.95 and recall, all areas, 100 detections per image; -1 for a category
    without ground truth in the evaluated images. The AP of the table is their mean over the defined ones.
    A name that several categories share is followed by each one's id: 'AP-car (3)'."""
    precision = evaluator.eval["precision"][:, :, :, 0, -1]  # [IoUs, recalls, categories]: area all, 100
    cats = evaluator.cocoGt.cats
    names = [cats[category]["name"] for category in evaluator.params.catIds]
    aps = {}
    for k, (category, name) in enumerate(zip(evaluator.params.catIds, names)):
        defined = precision[:, :, k][precision[:, :, k] > -1]
        label = name if names.count(name) == 1 else f"{name} ({category})"
        aps[metric_key(iou_type, f"{CATEGORY_AP}{label}")] = float(defined.mean()) if defined.size else -1.0
    return aps


def _empty_results(coco_gt):
    """A result COCO object without detections (loadRes cannot make one from an empty list)."""
    empty = COCO()
    empty.dataset = {"images": list(coco_gt.dataset["images"]), "categories": list(coco_gt.dataset["categories"]),
                     "annotations": []}
    empty.createIndex()
    return empty


def format_table(metrics):
    """A printable table of a metrics dict from `evaluate`: one row per statistic, one column per iou type.

    Returns:
      str, e.g.
        metric     bbox    segm
        AP        0.372   0.339
        ...
      Undefined statistics (-1) print as 'n/a'; iou types absent from `metrics` are left out.
    """
    iou_types = [t for t in IOU_TYPES if metric_key(t, STAT_NAMES[0]) in metrics]
    if not iou_types:
        raise ValueError(f"metrics holds no {IOU_TYPES} statistics (keys like 'bbox/AP'), got {sorted(metrics)}.")
    lines = ["metric  " + "".join(f"{t:>8}" for t in iou_types)]
    for name in STAT_NAMES:
        values = [metrics[metric_key(t, name)] for t in iou_types]
        lines.append(f"{name:<8}" + "".join(_number(v) for v in values))
    return "\n".join(lines)


def format_category_table(metrics):
    """A printable table of the per-category APs of a metrics dict from `evaluate`: one row per category in the
    annotation file's id order, one column per iou type ('n/a' for a category without ground truth), e.g.
        category      bbox    segm
        circle       0.588   0.640
    """
    iou_types = [t for t in IOU_TYPES if metric_key(t, STAT_NAMES[0]) in metrics]
    opening = metric_key(iou_types[0], CATEGORY_AP)
    names = [key[len(opening):] for key in metrics if key.startswith(opening)]
    width = max([len("category")] + [len(name) for name in names]) + 2
    lines = [f"{'category':<{width}}" + "".join(f"{t:>8}" for t in iou_types)]
    for name in names:
        lines.append(f"{name:<{width}}" + "".join(_number(metrics[metric_key(t, CATEGORY_AP + name)])
                                                  for t in iou_types))
    return "\n".join(lines)


def _number(value):
    """A statistic in a table's 8-character column: 'n/a' where COCO leaves it undefined (-1)."""
    return f"{value:8.3f}" if value >= 0 else f"{'n/a':>8}"
