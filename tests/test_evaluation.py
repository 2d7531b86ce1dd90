"""COCO evaluation: detections -> COCO results against NumPy oracles, COCOeval scores of perfect, mislabelled,
unknown-class and empty detections on non-contiguous category ids, and `main.py eval` end to end."""

import contextlib
import io
import json
import math
import os
import re
import shutil
import signal
import warnings

import numpy as np
import pytest
from pycocotools import mask as mask_utils
from pycocotools.coco import COCO

import main
from mrcnn_tf2.arguments import config_for_path, parse
from mrcnn_tf2.config import ConfigError
from mrcnn_tf2.evaluation import coco_metrics
from tests.support import SMALL_FLAGS, TRAINED_STEPS

# Non-contiguous COCO category ids: class id == category id, classes 2, 4-6 and 0 are not categories.
CATEGORY_IDS = (1, 3, 7)
MASK_SIDE = 28
# Detection slots per image; slots past num_detections hold valid-looking junk that must be ignored.
SLOTS = 5


def ellipse_mask(hw, cy, cx, ry, rx):
    yy, xx = np.mgrid[0:hw[0], 0:hw[1]] + 0.5
    return (((yy - cy) / ry) ** 2 + ((xx - cx) / rx) ** 2 <= 1.0).astype(np.uint8)


def rectangle_mask(hw, top, left, bottom, right):
    mask = np.zeros(hw, np.uint8)
    mask[top:bottom, left:right] = 1
    return mask


# (height, width) and instances (category id, full-image mask) of each image: small (< 32**2 px), medium
# and large objects so that every area range is defined, at most one instance per category and image so
# that perfect detections also reach AR1 = 1.
IMAGES = {
    11: ((120, 160), [(1, ellipse_mask((120, 160), 40, 50, 30, 40)),
                      (7, rectangle_mask((120, 160), 90, 120, 110, 140))]),
    12: ((150, 130), [(3, ellipse_mask((150, 130), 75, 65, 60, 55)),
                      (1, rectangle_mask((150, 130), 5, 5, 19, 27))]),
    13: ((90, 100), [(7, ellipse_mask((90, 100), 45, 60, 25, 30))]),
}


def bbox_of(mask):
    """Tight [x, y, w, h] of a mask's pixels (pixel (r, c) covers [c, c + 1] x [r, r + 1])."""
    rows, cols = np.nonzero(mask)
    return [float(cols.min()), float(rows.min()),
            float(cols.max() + 1 - cols.min()), float(rows.max() + 1 - rows.min())]


def ground_truth():
    """The pycocotools COCO object of IMAGES."""
    dataset = {"images": [], "annotations": [], "categories": [{"id": c, "name": f"c{c}"} for c in CATEGORY_IDS]}
    for image_id, ((height, width), instances) in IMAGES.items():
        dataset["images"].append({"id": image_id, "height": height, "width": width})
        for category, mask in instances:
            rle = mask_utils.encode(np.asfortranarray(mask))
            dataset["annotations"].append({
                "id": len(dataset["annotations"]) + 1, "image_id": image_id, "category_id": category,
                "segmentation": {"size": list(rle["size"]), "counts": rle["counts"].decode("ascii")},
                "area": float(mask.sum()), "bbox": bbox_of(mask), "iscrowd": 0})
    coco = COCO()
    coco.dataset = dataset
    with contextlib.redirect_stdout(io.StringIO()):
        coco.createIndex()
    return coco


def box_crop(mask, box, side=MASK_SIDE, subsamples=4):
    """[side, side] mask crop of a box: each cell averages the image mask at subsamples**2 points in it."""
    ymin, xmin, ymax, xmax = box
    offsets = (np.arange(side * subsamples) + 0.5) / (side * subsamples)
    rows = np.clip(np.floor(ymin + offsets * (ymax - ymin)).astype(int), 0, mask.shape[0] - 1)
    cols = np.clip(np.floor(xmin + offsets * (xmax - xmin)).astype(int), 0, mask.shape[1] - 1)
    points = mask[rows][:, cols].astype(np.float32)
    return points.reshape(side, subsamples, side, subsamples).mean(axis=(1, 3))


def perfect_predictions(image_ids=tuple(IMAGES)):
    """A predict_step-like batch whose detections are the ground truth of `image_ids`, junk in spare slots."""
    batch = len(image_ids)
    out = {"detection_boxes": np.full((batch, SLOTS, 4), 5.0, np.float32),
           "detection_scores": np.full((batch, SLOTS), 0.99, np.float32),
           "detection_classes": np.ones((batch, SLOTS), np.int32),
           "detection_masks": np.ones((batch, SLOTS, MASK_SIDE, MASK_SIDE), np.float32),
           "num_detections": np.zeros(batch, np.int32),
           "image_info": np.zeros((batch, 5), np.float32),
           "source_ids": np.array(image_ids, np.int64)}
    out["detection_boxes"][:, :, 2:] = 30.0
    for b, image_id in enumerate(image_ids):
        (height, width), instances = IMAGES[image_id]
        out["image_info"][b] = [height * 2, width * 2, 0.5, height, width]  # only [3:5] matters here
        out["num_detections"][b] = len(instances)
        for d, (category, mask) in enumerate(instances):
            x, y, w, h = bbox_of(mask)
            box = [y, x, y + h, x + w]
            out["detection_boxes"][b, d] = box
            out["detection_scores"][b, d] = 0.9 - 0.1 * d
            out["detection_classes"][b, d] = category
            out["detection_masks"][b, d] = box_crop(mask, box)
    return out


def num_instances(image_ids=tuple(IMAGES)):
    return sum(len(IMAGES[i][1]) for i in image_ids)


@pytest.fixture(scope="module")
def coco_gt():
    return ground_truth()


def test_perfect_detections_score_one_for_boxes_and_nearly_one_for_masks(coco_gt):
    results = coco_metrics.detections_to_coco(perfect_predictions(), CATEGORY_IDS)
    assert len(results) == num_instances()  # junk past num_detections is not reported
    assert {r["category_id"] for r in results} == set(CATEGORY_IDS)  # identity mapping, ids kept
    metrics = coco_metrics.evaluate(coco_gt, results, IMAGES)
    assert len(metrics) == 2 * (12 + len(CATEGORY_IDS))  # the table's statistics, then each category's AP
    assert [key for key in metrics if "AP-" in key] == [f"{t}/AP-c{c}" for t in ("bbox", "segm") for c in CATEGORY_IDS]
    for name in coco_metrics.STAT_NAMES:
        assert metrics[f"bbox/{name}"] == pytest.approx(1.0), name
    # The 28x28 crops lose a little of the outline when pasted back (mask IoUs 0.987 to 1 here), which
    # stays above COCO's strictest IoU threshold 0.95: segm AP measures 1.0.
    ious = [mask_utils.iou([result["segmentation"]], [mask_utils.encode(np.asfortranarray(mask))], [0])[0, 0]
            for result, (_, mask) in zip(results, (i for _, instances in IMAGES.values() for i in instances))]
    assert min(ious) >= 0.98
    assert all(0.95 <= metrics[f"segm/{name}"] <= 1.0 for name in coco_metrics.STAT_NAMES)
    table = coco_metrics.format_table(metrics)
    lines = table.splitlines()
    assert lines[0].split() == ["metric", "bbox", "segm"]
    assert [line.split()[0] for line in lines[1:]] == list(coco_metrics.STAT_NAMES)
    assert lines[1].split()[1] == "1.000" and lines[1].split()[2] == f"{metrics['segm/AP']:.3f}"


def test_detection_labelled_with_another_category_is_a_miss(coco_gt):
    predictions = perfect_predictions()
    # Image 11's two instances (categories 1 and 7) swap labels: both become false positives.
    predictions["detection_classes"][0, :2] = predictions["detection_classes"][0, 1::-1]
    metrics = coco_metrics.evaluate(coco_gt, coco_metrics.detections_to_coco(predictions, CATEGORY_IDS), IMAGES)
    # Category 1 finds 1 of 2 instances at precision 1/2 after a false positive ranked first; category 3
    # is perfect; category 7 finds 1 of 2 ranked below a false positive: AP = mean(0.5, 1, 0.5) with
    # COCO's 101-point interpolated precision (1/2 up to recall 0.5, 0 beyond).
    assert metrics["bbox/AP50"] == pytest.approx((51 / 101 * 0.5 + 1.0 + 51 / 101 * 0.5) / 3, abs=1e-6)
    # The boxes are exact, so every IoU threshold scores alike: each category's AP is its AP50 above, and the AP
    # is their mean.
    assert [metrics[f"bbox/AP-c{c}"] for c in CATEGORY_IDS] == pytest.approx([51 / 101 * 0.5, 1.0, 51 / 101 * 0.5])
    assert metrics["bbox/AP"] == pytest.approx(np.mean([metrics[f"bbox/AP-c{c}"] for c in CATEGORY_IDS]), abs=1e-12)
    lines = coco_metrics.format_category_table(metrics).splitlines()
    assert [line.split() for line in lines] == [["category", "bbox", "segm"]] + [
        [f"c{c}", f"{metrics[f'bbox/AP-c{c}']:.3f}", f"{metrics[f'segm/AP-c{c}']:.3f}"] for c in CATEGORY_IDS]


def test_mask_results_take_their_area_from_the_mask(coco_gt):
    predictions = perfect_predictions()
    # A false positive of category 1 in image 12, ranked first: a medium box (60 x 60 px) holding a
    # small mask (about 10 x 10 px) away from every instance.
    predictions["num_detections"][1] = 3
    predictions["detection_boxes"][1, 2] = [60, 60, 120, 120]
    predictions["detection_scores"][1, 2] = 0.95
    predictions["detection_classes"][1, 2] = 1
    predictions["detection_masks"][1, 2] = 0.0
    predictions["detection_masks"][1, 2, :5, :5] = 1.0
    metrics = coco_metrics.evaluate(coco_gt, coco_metrics.detections_to_coco(predictions, CATEGORY_IDS), IMAGES)
    # Small range, category 1 (one small instance, in image 12): as a box the false positive is medium and
    # ignored; as a mask it is small and ranks above the hit, precision 1/2. Category 7's small instance
    # is found alone, category 3 has no small instance.
    assert metrics["bbox/APs"] == pytest.approx(1.0)
    assert metrics["segm/APs"] == pytest.approx((0.5 + 1.0) / 2)


def test_unknown_class_ids_are_dropped_with_a_warning(coco_gt):
    predictions = perfect_predictions()
    # Image 13 gains two detections within num_detections: class 2 (no such category) and 0 (empty slot).
    predictions["num_detections"][2] = 3
    predictions["detection_classes"][2, 1:3] = [2, 0]
    with pytest.warns(UserWarning, match=r"dropped 2 detections"):
        results = coco_metrics.detections_to_coco(predictions, CATEGORY_IDS)
    assert len(results) == num_instances()
    assert {r["category_id"] for r in results} <= set(CATEGORY_IDS)
    assert coco_metrics.evaluate(coco_gt, results, IMAGES)["bbox/AP"] == pytest.approx(1.0)


def test_only_the_given_images_are_evaluated(coco_gt):
    results = coco_metrics.detections_to_coco(perfect_predictions((11, 12)), CATEGORY_IDS)
    assert coco_metrics.evaluate(coco_gt, results, [11, 12])["bbox/AP"] == pytest.approx(1.0)
    # Image 13 evaluated without detections: its one category-7 instance is missed (recall 1/2 for 7).
    both = coco_metrics.evaluate(coco_gt, results, [11, 12, 13])
    assert both["bbox/AP"] == pytest.approx((1.0 + 1.0 + 51 / 101) / 3, abs=1e-6)
    assert [both[f"bbox/AP-c{c}"] for c in CATEGORY_IDS] == pytest.approx([1.0, 1.0, 51 / 101])
    with pytest.raises(ValueError, match="image_ids"):
        coco_metrics.evaluate(coco_gt, results, [11])  # results of image 12 lie outside the set
    # Category 3 has no instance in images 11 and 13: its AP is undefined, and left out of the mean.
    results = coco_metrics.detections_to_coco(perfect_predictions((11, 13)), CATEGORY_IDS)
    apart = coco_metrics.evaluate(coco_gt, results, [11, 13], iou_types=("bbox",))
    assert [apart[f"bbox/AP-c{c}"] for c in CATEGORY_IDS] == [pytest.approx(1.0), -1.0, pytest.approx(1.0)]
    assert apart["bbox/AP"] == pytest.approx(1.0)
    assert coco_metrics.format_category_table(apart).splitlines() == ["category      bbox", "c1           1.000",
                                                                      "c3             n/a", "c7           1.000"]
    # Two categories of one name are told apart by their ids.
    twins = ground_truth()
    twins.cats[7]["name"] = "c1"
    named = coco_metrics.evaluate(twins, results, [11, 13], iou_types=("bbox",))
    assert [key for key in named if "AP-" in key] == ["bbox/AP-c1 (1)", "bbox/AP-c3", "bbox/AP-c1 (7)"]


def test_empty_detections_give_zeros(coco_gt):
    predictions = perfect_predictions()
    predictions["num_detections"][:] = 0
    results = coco_metrics.detections_to_coco(predictions, CATEGORY_IDS)
    assert results == []
    metrics = coco_metrics.evaluate(coco_gt, results, IMAGES)
    # Every area range has ground truth here, so every statistic is defined: all are 0.
    assert metrics == {f"{t}/{name}": 0.0 for t in ("bbox", "segm")
                       for name in (*coco_metrics.STAT_NAMES, *(f"AP-c{c}" for c in CATEGORY_IDS))}
    assert coco_metrics.evaluate(coco_gt, [], [13])["bbox/APs"] == -1.0  # image 13 has no small object
    assert "n/a" in coco_metrics.format_table(coco_metrics.evaluate(coco_gt, [], [13]))


def test_results_match_a_numpy_oracle(rng):
    height, width = 37, 52
    count = 4
    boxes = np.zeros((1, SLOTS, 4), np.float32)
    # Fractional boxes, the last one reaching past the bottom-right corner.
    top_left = rng.uniform(0, 20, size=(count, 2))
    sizes = rng.uniform(3, 25, size=(count, 2))
    boxes[0, :count] = np.concatenate([top_left, top_left + sizes], axis=1)
    boxes[0, count - 1] = [20.3, 30.6, 45.0, 60.2]
    masks = np.zeros((1, SLOTS, MASK_SIDE, MASK_SIDE), np.float32)
    masks[0, :count] = np.array([1.0, 0.5, 0.49, 0.9])[:, None, None]  # 0.5 is foreground, 0.49 is not
    scores = rng.uniform(size=(1, SLOTS)).astype(np.float32)
    predictions = {"detection_boxes": boxes, "detection_scores": scores,
                   "detection_classes": np.full((1, SLOTS), 7, np.int32), "detection_masks": masks,
                   "num_detections": np.array([count]), "image_info": np.array([[74, 104, 0.5, height, width]]),
                   "source_ids": np.array([42])}
    results = coco_metrics.detections_to_coco(predictions, CATEGORY_IDS)
    assert len(results) == count
    for d, result in enumerate(results):
        ymin, xmin, ymax, xmax = boxes[0, d].astype(np.float64)
        clipped = [min(xmin, width), min(ymin, height), min(xmax, width), min(ymax, height)]
        assert result["image_id"] == 42 and result["category_id"] == 7
        assert result["score"] == pytest.approx(scores[0, d])
        np.testing.assert_allclose(result["bbox"], [clipped[0], clipped[1], clipped[2] - clipped[0],
                                                    clipped[3] - clipped[1]], atol=1e-4)
        assert isinstance(result["segmentation"]["counts"], str)
        assert result["segmentation"]["size"] == [height, width]
        decoded = mask_utils.decode({"size": [height, width], "counts": result["segmentation"]["counts"].encode()})
        # A constant mask pastes to the pixels whose centres lie in the half-open box (or to nothing).
        expected = np.zeros((height, width), np.uint8)
        if masks[0, d, 0, 0] >= 0.5:
            for r in range(height):
                for c in range(width):
                    expected[r, c] = ymin <= r + 0.5 < ymax and xmin <= c + 0.5 < xmax
        np.testing.assert_array_equal(decoded, expected, err_msg=f"detection {d}")
    assert json.loads(json.dumps(results)) == results  # JSON-ready as it is


def test_without_masks_results_have_no_segmentation_and_score_boxes_only(coco_gt):
    predictions = perfect_predictions()
    del predictions["detection_masks"]
    results = coco_metrics.detections_to_coco(predictions, CATEGORY_IDS)
    assert all("segmentation" not in r for r in results)
    metrics = coco_metrics.evaluate(coco_gt, results, IMAGES, iou_types=("bbox",))
    assert set(metrics) == {f"bbox/{name}" for name in (*coco_metrics.STAT_NAMES, *(f"AP-c{c}" for c in CATEGORY_IDS))}
    assert coco_metrics.format_table(metrics).splitlines()[0].split() == ["metric", "bbox"]
    with pytest.raises(ValueError, match="segmentation"):
        coco_metrics.evaluate(coco_gt, results, IMAGES)


def test_bad_arguments_raise_value_errors(coco_gt):
    with pytest.raises(ValueError, match="image_ids is empty"):
        coco_metrics.evaluate(coco_gt, [], [])
    with pytest.raises(ValueError, match="image_ids .* annotations do not have: \\[99\\]"):
        coco_metrics.evaluate(coco_gt, [], [11, 99])
    with pytest.raises(ValueError, match="iou_types"):
        coco_metrics.evaluate(coco_gt, [], [11], iou_types=("keypoints",))
    predictions = perfect_predictions()
    del predictions["num_detections"]
    with pytest.raises(ValueError, match="num_detections"):
        coco_metrics.detections_to_coco(predictions, CATEGORY_IDS)
    predictions = perfect_predictions()
    predictions["num_detections"][0] = SLOTS + 1
    with pytest.raises(ValueError, match="num_detections"):
        coco_metrics.detections_to_coco(predictions, CATEGORY_IDS)
    with pytest.raises(ValueError, match="metrics"):
        coco_metrics.format_table({})


def test_an_annotation_file_that_is_not_coco_json_is_a_config_error_naming_it(tmp_path):
    for name, content, detail in (("broken.json", "{bad", "Expecting property name"),
                                  ("list.json", "[]", "annotation file format <class 'list'> not supported"),
                                  ("no_id.json", json.dumps({"images": [{"file_name": "a.jpg"}]}), "no 'id' key")):
        (tmp_path / name).write_text(content)
        with pytest.raises(ConfigError, match=re.escape(f"--eval_file: {tmp_path / name} is not a COCO annotation "
                                                        f"file: ") + f".*{re.escape(detail)}"):
            coco_metrics.load_annotations(str(tmp_path / name))
    with pytest.raises(ConfigError, match=re.escape(f"--eval_file: {tmp_path / 'none.json'} cannot be read: ")):
        coco_metrics.load_annotations(str(tmp_path / "none.json"))


def test_an_annotation_file_of_other_images_is_refused_and_entries_that_differ_are_named():
    coco_gt = ground_truth()  # its own: entries change below
    for image_id, image in coco_gt.imgs.items():
        image["file_name"] = f"val/{image_id:06d}.jpg"
    # The records' file names without the folder (a converter may keep either): the same images.
    images = {i: (f"{i:06d}.jpg", image["height"], image["width"]) for i, image in coco_gt.imgs.items()}
    check = coco_metrics.check_record_images
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        check(coco_gt, images, "val.json")
        check(coco_gt, {i: ("", 0, 0) for i in images}, "val.json")  # records without name or size: not compared
    first, *others = sorted(images)
    name, height, width = images[first]
    with pytest.warns(UserWarning, match=re.escape(
            f"1 of {len(images)} validation images have another size in the annotation file than in the records "
            f"(image id {first} is {height + 1}x{width}, height x width, in the records and {height}x{width} in "
            "the annotations)")):
        check(coco_gt, {**images, first: (name, height + 1, width)}, "val.json")
    with pytest.warns(UserWarning, match=re.escape(
            f"1 of {len(images)} validation images have another file name in the annotation file than in the records "
            f"(image id {first} is 'x.jpg' in the validation records and 'val/{first:06d}.jpg' in val.json)")):
        check(coco_gt, {**images, first: ("x.jpg", height, width)}, "val.json")
    # Every name differs: the annotations of other images under the same ids.
    with pytest.raises(ConfigError, match=re.escape(
            f"--eval_file: val.json is the annotation file of other images: image id {first} is "
            f"'train_{first:06d}.jpg' in the validation records and 'val/{first:06d}.jpg' in val.json, and each of "
            f"the {len(images)} file names differs")):
        check(coco_gt, {i: (f"train_{i:06d}.jpg", h, w) for i, (_, h, w) in images.items()}, "val.json")
    with pytest.raises(ConfigError, match=re.escape(
            f"--eval_file: val.json has no entry for 2 of the {len(images) + 2} validation images (ids 1001, 1002): "
            "it is not the annotation file of the validation records")):
        check(coco_gt, {**images, 1001: ("a.jpg", 4, 4), 1002: ("b.jpg", 4, 4)}, "val.json")
    # Entries without a size or a file name are not compared.
    del coco_gt.imgs[first]["height"], coco_gt.imgs[first]["file_name"]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        check(coco_gt, {**images, first: ("x.jpg", height + 1, width)}, "val.json")
    assert others  # a comparison of more than one image


@pytest.mark.slow
def test_main_eval_end_to_end(tmp_path, trained_model, shapes_records, capsys):
    model_dir = tmp_path / "model"
    shutil.copytree(trained_model, model_dir)
    # 3 of the 5 validation images in batches of 2: the second batch is cut to one image.
    assert main.main(["eval", "--model_dir", str(model_dir), "--data_dir", shapes_records["data_dir"],
                      "--eval_file", shapes_records["val_json"], "--eval_samples", "3"]) == 0
    out = capsys.readouterr().out
    assert "AP50" in out and "3 images" in out
    with open(model_dir / "eval_results.json") as f:
        record = json.load(f)
    metrics = record["metrics"]
    names = [category["name"] for category in shapes_records["annotations"]["val"]["categories"]]
    assert set(metrics) == {f"{t}/{name}" for t in ("bbox", "segm")
                            for name in (*coco_metrics.STAT_NAMES, *(f"AP-{c}" for c in names))}
    # The table of each category's AP follows the statistics', one row per category.
    table = out[out.index("category "):].splitlines()
    assert [line.split()[0] for line in table[1:1 + len(names)]] == names
    assert all(math.isfinite(v) and -1.0 <= v <= 1.0 for v in metrics.values())
    assert record["num_images"] == 3 and record["step"] == TRAINED_STEPS and record["averaged_weights"] is False
    assert "[model] weights:" not in out  # the last step's, said only of an average
    assert record["checkpoint"].endswith(f"ckpt-{TRAINED_STEPS}")
    assert set(record["time_s"]) >= {"model", "pasting", "cocoeval"}
    breakdown = next(line for line in out.splitlines() if line.startswith("[eval] 3 images"))
    assert all(f"{name} " in breakdown for name in ("model", "pasting", "cocoeval"))
    with open(model_dir / "detections.json") as f:
        detections = json.load(f)
    val_ids = sorted(image["id"] for image in shapes_records["annotations"]["val"]["images"])
    assert len(detections) == record["num_detections"] <= 3 * 10
    assert {d["image_id"] for d in detections} <= set(val_ids[:3])  # files are read in order
    assert all(isinstance(d["segmentation"]["counts"], str) for d in detections)
    assert not [name for name in os.listdir(model_dir) if ".tmp" in name]

    # An annotation entry of another size than its image in the records is named on stderr (all of them
    # differing means the file is of other images); the evaluation goes on.
    with open(shapes_records["val_json"]) as f:
        other = json.load(f)
    first = min(other["images"], key=lambda image: image["id"])
    first["height"] += 1
    (tmp_path / "other.json").write_text(json.dumps(other))
    with pytest.warns(UserWarning, match=re.escape(
            f"1 of 3 validation images have another size in the annotation file than in the records (image id "
            f"{first['id']} is {first['height'] - 1}x{first['width']}, height x width, in the records")):
        assert main.main(["eval", "--model_dir", str(model_dir), "--data_dir", shapes_records["data_dir"],
                          "--eval_file", str(tmp_path / "other.json"), "--eval_samples", "3"]) == 0

    # The training split's annotations (the same ids, 1 to 5): refused before the model runs, nothing written.
    os.remove(model_dir / "eval_results.json")
    capsys.readouterr()
    train_json = shapes_records["val_json"].replace("instances_val.json", "instances_train.json")
    assert main.main(["eval", "--model_dir", str(model_dir), "--data_dir", shapes_records["data_dir"],
                      "--eval_file", train_json]) == 2
    captured = capsys.readouterr()
    assert captured.err.startswith(f"[eval] error: --eval_file: {train_json} is the annotation file of other images: "
                                   "image id 1 is 'val_000001.jpg' in the validation records and 'train_000001.jpg'")
    assert "[model]" not in captured.out and not (model_dir / "eval_results.json").exists()


def test_checkpoint_evaluates_one_of_the_model_directorys_checkpoints_by_prefix_or_step(tmp_path, trained_model,
                                                                                        shapes_records, capsys):
    model_dir = tmp_path / "model"
    shutil.copytree(trained_model, model_dir)
    prefix = str(model_dir / "ckpt-2")
    # A prefix alone: its directory is the model directory, whose config.json gives the rest.
    assert main.main(["eval", "--checkpoint", prefix, "--data_dir", shapes_records["data_dir"],
                      "--eval_file", shapes_records["val_json"], "--eval_samples", "1"]) == 0
    record = json.loads((model_dir / "eval_results.json").read_text())
    assert record["step"] == 2 and record["checkpoint"] == prefix
    _, by_step = parse(["infer", "--model_dir", str(model_dir), "--checkpoint", "3"])
    assert by_step.infer.resolved_checkpoint(by_step.runtime.model_dir) == str(model_dir / "ckpt-3")
    assert config_for_path(prefix).infer.checkpoint == prefix  # Predictor(prefix)
    assert parse(["infer", "--model_dir", str(model_dir)])[1].infer.resolved_checkpoint(str(model_dir)) is None

    capsys.readouterr()
    for argv, message in (
            (["eval", "--model_dir", str(model_dir), "--checkpoint", "7"],
             f"--checkpoint: {model_dir}/ckpt-7 is not a checkpoint (no {model_dir}/ckpt-7.index); the checkpoints "
             f"of --model_dir {model_dir}: steps 1 2 3 4"),
            (["train", "--checkpoint", prefix], "--checkpoint: eval, infer and export read it; training resumes"),
            (["infer", "--checkpoint", prefix, "--exported", str(model_dir / "model.onnx")],
             f"--checkpoint: {prefix} and --exported {model_dir / 'model.onnx'} name two models: give one")):
        assert main.main(argv) == 2
        assert message in capsys.readouterr().err


def test_a_signal_on_any_rank_stops_every_ranks_evaluation_once_the_shares_are_in(trained_model, shapes_records):
    from mrcnn_tf2.arguments import parse
    from mrcnn_tf2.runtime.distributed import World
    from mrcnn_tf2.runtime.evaluate import EvaluationStopped, annotations_of, run_evaluation
    from mrcnn_tf2.runtime.predictor import open_backend

    class TwoRanks:
        """Horovod's object collectives as rank 0 of two sees them; rank 1 got `signum` while predicting."""

        def __init__(self, signum):
            self.signum, self.gathered = signum, []

        def broadcast_object(self, obj, root_rank):
            return obj

        def allgather_object(self, obj):
            self.gathered.append(obj)
            return [obj, ([], [], 0, self.signum)]

    _, config = parse(["eval", "--model_dir", str(trained_model), "--data_dir", shapes_records["data_dir"],
                       "--eval_file", shapes_records["val_json"], "--eval_samples", "4", "--eval_batch_size", "1"])
    backend, coco_gt = open_backend(config), annotations_of(config)
    signalled = TwoRanks(signal.SIGTERM)
    with pytest.raises(EvaluationStopped) as stopped:
        run_evaluation(backend, config, coco_gt, world=World(2, 0, hvd=signalled))
    # Rank 0 had no signal: it predicted its whole share (every second image) before it learnt of the stop.
    assert stopped.value.signum == signal.SIGTERM
    assert sorted(signalled.gathered[0][1]) == sorted(coco_gt.getImgIds())[:4:2]
    # Its own signal: it stops before its next batch, and the other rank's share decides nothing.
    asked = []
    with pytest.raises(EvaluationStopped) as stopped:
        run_evaluation(backend, config, coco_gt, world=World(2, 0, hvd=TwoRanks(0)),
                       stopping=lambda: asked.append(1) or signal.SIGINT)
    assert stopped.value.signum == signal.SIGINT and asked == [1]
    quiet = TwoRanks(0)
    evaluation = run_evaluation(backend, config, coco_gt, world=World(2, 0, hvd=quiet), stopping=lambda: 0)
    assert evaluation.num_images == 2 and quiet.gathered[0][3] == 0


def test_main_eval_without_checkpoint_or_annotations_exits_2(tmp_path, shapes_records, capsys):
    data = ["--data_dir", shapes_records["data_dir"], "--model_dir", str(tmp_path / "empty_run")]
    assert main.main(["eval", *data, *SMALL_FLAGS, "--eval_file", shapes_records["val_json"]]) == 2
    err = capsys.readouterr().err
    assert "no checkpoint" in err and str(tmp_path / "empty_run") in err
    assert main.main(["eval", *data, *SMALL_FLAGS]) == 2
    assert "--eval_file is required" in capsys.readouterr().err


def test_the_best_evaluation_s_checkpoint_is_kept_as_a_model_directory_of_its_own(tmp_path, monkeypatch):
    import tensorflow as tf

    from mrcnn_tf2.runtime.evaluate import BEST_DIR, BEST_FILE, keep_best

    value = tf.Variable(0.0)
    manager = tf.train.CheckpointManager(tf.train.Checkpoint(value=value), str(tmp_path), max_to_keep=1)
    (tmp_path / "config.json").write_text('{"run": 1}')
    recorded, kept = {}, []
    # The metric of steps 1..5; only the newest checkpoint stays in the model directory.
    for step, ap in enumerate((0.2, 0.5, 0.4, 0.5, 0.6), 1):
        value.assign(float(step))
        manager.save(checkpoint_number=step)
        metrics = {"bbox/AP": ap, "segm/AP": 1.0 - ap}
        kept.append(keep_best(str(tmp_path), "bbox/AP", step, metrics, recorded))
        recorded[str(step)] = metrics
        best = tmp_path / BEST_DIR
        step_kept = json.loads((best / BEST_FILE).read_text())["step"]
        # The best so far (step 4 ties step 2: the earlier stays), readable after its original is gone.
        assert step_kept == {1: 1, 2: 2, 3: 2, 4: 2, 5: 5}[step]
        assert tf.train.latest_checkpoint(str(best)) == str(best / f"ckpt-{step_kept}")
        tf.train.Checkpoint(value=value).read(str(best / f"ckpt-{step_kept}")).assert_existing_objects_matched()
        assert value.numpy() == step_kept
    assert [path is not None for path in kept] == [True, True, False, False, True]
    assert sorted(os.listdir(tmp_path / BEST_DIR)) == ["best.json", "checkpoint", "ckpt-5.data-00000-of-00001",
                                                       "ckpt-5.index", "config.json"]
    assert (tmp_path / BEST_DIR / "config.json").read_text() == '{"run": 1}'
    assert json.loads((tmp_path / BEST_DIR / BEST_FILE).read_text()) == {
        "step": 5, "metric": "bbox/AP", "value": 0.6, "metrics": {"bbox/AP": 0.6, "segm/AP": 0.4}}
    # Another statistic decides alone; none keeps nothing.
    assert keep_best(str(tmp_path), "segm/AP", 5, recorded["5"], recorded) is None  # 0.4 < step 1's 0.8
    assert keep_best(str(tmp_path), None, 5, recorded["5"], recorded) is None
    assert not [name for name in os.listdir(tmp_path) if ".tmp" in name or ".old" in name]
    # What else is in it stays (an export or inference outputs of the best model so far).
    (tmp_path / BEST_DIR / "inference").mkdir()
    # Where files cannot be hard-linked (another file system), they are copied.
    def no_link(source, target):
        raise OSError(18, "Invalid cross-device link")

    monkeypatch.setattr(os, "link", no_link)
    value.assign(6.0)
    manager.save(checkpoint_number=6)
    assert keep_best(str(tmp_path), "bbox/AP", 6, {"bbox/AP": 0.9}, recorded) == str(tmp_path / BEST_DIR / "ckpt-6")
    value.assign(0.0)
    tf.train.Checkpoint(value=value).read(str(tmp_path / BEST_DIR / "ckpt-6")).assert_existing_objects_matched()
    assert value.numpy() == 6.0
    assert sorted(os.listdir(tmp_path / BEST_DIR)) == ["best.json", "checkpoint", "ckpt-6.data-00000-of-00001",
                                                       "ckpt-6.index", "config.json", "inference"]
