"""Tests of dataset/create_coco_tf_record.py: round trip against pycocotools, determinism across worker counts,
the warnings file for each kind of bad annotation, bad images, fatal input errors, colour modes, CLI flags."""

import copy
import glob
import io
import json
import os
import re
import signal
import subprocess
import sys
import time

import numpy as np
import pytest
import tensorflow as tf
from PIL import Image, ImageOps
from pycocotools import mask as mask_utils
from pycocotools.coco import COCO

from dataset import create_coco_tf_record as converter
from dataset.make_shapes_dataset import encode_uncompressed_rle, make_shapes_dataset
from mrcnn_tf2 import status
from mrcnn_tf2.data.coco_io import TRANSPARENT_FILL, encode_jpeg
from tests.support import ROOT, dead_pid, file_size_limit, live_processes, terminations_by_default

# Every key the converter writes, with its type: parsing fails on a missing key, and the raw key set is
# compared separately so that no unexpected key slips in.
FEATURES = {
    "image/encoded": tf.io.FixedLenFeature([], tf.string),
    "image/source_id": tf.io.FixedLenFeature([], tf.string),
    "image/height": tf.io.FixedLenFeature([], tf.int64),
    "image/width": tf.io.FixedLenFeature([], tf.int64),
    "image/filename": tf.io.FixedLenFeature([], tf.string),
    "image/object/bbox/xmin": tf.io.VarLenFeature(tf.float32),
    "image/object/bbox/xmax": tf.io.VarLenFeature(tf.float32),
    "image/object/bbox/ymin": tf.io.VarLenFeature(tf.float32),
    "image/object/bbox/ymax": tf.io.VarLenFeature(tf.float32),
    "image/object/class/label": tf.io.VarLenFeature(tf.int64),
    "image/object/class/text": tf.io.VarLenFeature(tf.string),
    "image/object/area": tf.io.VarLenFeature(tf.float32),
    "image/object/is_crowd": tf.io.VarLenFeature(tf.int64),
}
MASK_FEATURES = {"image/object/mask": tf.io.VarLenFeature(tf.string)}


def read_shards(output_dir, tag, include_masks=True):
    """Parses every record of a tag's shards: {source_id: {key: numpy value}} plus {source_id: shard index}."""
    spec = dict(FEATURES, **MASK_FEATURES) if include_masks else FEATURES
    records, shard_of = {}, {}
    for shard, path in enumerate(sorted(glob.glob(os.path.join(output_dir, f"{tag}-*.tfrecord")))):
        for serialized in tf.data.TFRecordDataset(path):
            keys = set(tf.train.Example.FromString(serialized.numpy()).features.feature)
            assert keys == set(spec)
            parsed = tf.io.parse_single_example(serialized, spec)
            example = {
                key: (tf.sparse.to_dense(value) if isinstance(value, tf.SparseTensor) else value).numpy()
                for key, value in parsed.items()
            }
            source_id = int(example["image/source_id"])
            assert source_id not in records, f"image {source_id} written twice"
            records[source_id] = example
            shard_of[source_id] = shard
    return records, shard_of


def decode_png(data):
    return np.asarray(Image.open(io.BytesIO(data)))


def write_json(path, obj):
    with open(path, "w") as f:
        json.dump(obj, f)
    return str(path)


def write_jpeg(path, height, width, value=(90, 140, 200)):
    Image.fromarray(np.full((height, width, 3), value, np.uint8)).save(path, format="JPEG")


def polygon_box(x0, y0, x1, y1):
    """A rectangle as one COCO polygon over pixel corners: it rasterizes to columns x0..x1-1, rows y0..y1-1."""
    return [float(v) for v in (x0, y0, x1, y0, x1, y1, x0, y1)]


def rasterize(polygons, height, width):
    """pycocotools' rasterization of a COCO polygon list: [height, width] bool."""
    return mask_utils.decode(mask_utils.merge(mask_utils.frPyObjects(polygons, height, width))).astype(bool)


@pytest.fixture(scope="module")
def shapes_split(tmp_path_factory):
    """Generated images and annotations, edited to also hold a compressed RLE and an uncompressed-RLE crowd."""
    root = tmp_path_factory.mktemp("shapes")
    make_shapes_dataset(str(root), num_train=7, num_val=0, seed=1, min_size=64, max_size=96)
    with open(root / "annotations" / "instances_train.json") as f:
        dataset = json.load(f)
    solid = [a for a in dataset["annotations"] if not a["iscrowd"]]
    assert len(solid) >= 3
    height_width = {image["id"]: (image["height"], image["width"]) for image in dataset["images"]}
    for annotation, crowd, compressed in ((solid[0], 1, False), (solid[1], 0, True)):
        mask = rasterize(annotation["segmentation"], *height_width[annotation["image_id"]])
        rle = encode_uncompressed_rle(mask)
        if compressed:
            rle = mask_utils.frPyObjects(rle, *rle["size"])
            rle["counts"] = rle["counts"].decode("ascii")
        annotation.update(segmentation=rle, iscrowd=crowd)
    annotations_file = write_json(root / "annotations" / "instances_mixed.json", dataset)
    return str(root / "train"), annotations_file, dataset


def test_round_trip_matches_pycocotools(shapes_split, tmp_path):
    image_dir, annotations_file, dataset = shapes_split
    summary = converter.convert_coco(image_dir, annotations_file, str(tmp_path), num_shards=3, num_workers=1,
                                     progress=False)
    assert summary.tag == "mixed"
    assert sorted(os.listdir(tmp_path)) == [f"mixed-0000{i}-of-00003.tfrecord" for i in range(3)] + [
        "mixed_warnings.json"
    ]
    records, shard_of = read_shards(str(tmp_path), "mixed")
    images = dataset["images"]
    assert sorted(records) == [image["id"] for image in images]
    assert summary.images_written == len(images) and summary.images_skipped == 0
    assert summary.instances == len(dataset["annotations"]) and summary.warnings == 0

    coco = COCO(annotations_file)
    names = {c["id"]: c["name"].encode() for c in dataset["categories"]}
    assert any(a["iscrowd"] for a in dataset["annotations"])
    for index, image in enumerate(images):
        record = records[image["id"]]
        assert shard_of[image["id"]] == index % 3
        height, width = image["height"], image["width"]
        with open(os.path.join(image_dir, image["file_name"]), "rb") as f:
            assert record["image/encoded"] == f.read()  # an RGB JPEG goes through untouched
        assert (record["image/height"], record["image/width"]) == (height, width)
        assert record["image/filename"] == image["file_name"].encode()
        annotations = coco.loadAnns(coco.getAnnIds(imgIds=image["id"], iscrowd=None))
        boxes = np.array([a["bbox"] for a in annotations], np.float64).reshape(-1, 4)
        xmin, ymin = boxes[:, 0], boxes[:, 1]
        xmax, ymax = xmin + boxes[:, 2], ymin + boxes[:, 3]
        for key, expected in (("xmin", xmin / width), ("ymin", ymin / height), ("xmax", xmax / width),
                              ("ymax", ymax / height)):
            np.testing.assert_allclose(record[f"image/object/bbox/{key}"], expected, atol=1e-6)
        np.testing.assert_array_equal(record["image/object/class/label"], [a["category_id"] for a in annotations])
        assert list(record["image/object/class/text"]) == [names[a["category_id"]] for a in annotations]
        np.testing.assert_allclose(record["image/object/area"], [a["area"] for a in annotations], rtol=1e-6)
        np.testing.assert_array_equal(record["image/object/is_crowd"], [a["iscrowd"] for a in annotations])
        assert len(record["image/object/mask"]) == len(annotations)
        for png, annotation in zip(record["image/object/mask"], annotations):
            mask = decode_png(png)
            assert mask.shape == (height, width) and set(np.unique(mask)) <= {0, 1}
            expected = coco.annToMask(annotation).astype(bool)
            iou = np.logical_and(mask, expected).sum() / np.logical_or(mask, expected).sum()
            assert iou >= 0.99

    with open(summary.warnings_path) as f:
        report = json.load(f)
    assert report["images"] == {} and set(report["counts"].values()) == {0}
    assert report["actions"] == converter.WARNING_ACTIONS


def test_output_is_identical_for_any_number_of_workers(shapes_split, tmp_path):
    image_dir, annotations_file, _ = shapes_split
    outputs = []
    for workers in (1, 2):
        output_dir = tmp_path / f"workers{workers}"
        converter.convert_coco(image_dir, annotations_file, str(output_dir), num_shards=2, num_workers=workers,
                               progress=False)
        outputs.append({name: (output_dir / name).read_bytes() for name in sorted(os.listdir(output_dir))})
    assert list(outputs[0]) == list(outputs[1]) and len(outputs[0]) == 3
    assert outputs[0] == outputs[1]


@pytest.fixture
def broken_split(tmp_path):
    """Two 48x64 images and annotations with one instance of each kind of problem (ids say which)."""
    image_dir = tmp_path / "images"
    image_dir.mkdir()
    write_jpeg(image_dir / "a.jpg", 48, 64)
    write_jpeg(image_dir / "b.jpg", 48, 64)
    good = [polygon_box(10, 10, 20, 20)]
    compressed = mask_utils.encode(np.asfortranarray(np.pad(np.ones((4, 5), np.uint8), ((30, 14), (40, 19)))))
    broken_rle = {"size": [48, 64], "counts": [3, 4, 5]}  # covers 12 pixels of 48 * 64
    annotations = [
        dict(id=1, category_id=1, bbox=[10, 10, 10, 10], segmentation=good),  # fine
        dict(id=2, category_id=2, bbox=[50, 40, 30, 20], segmentation=[polygon_box(50, 40, 64, 48)]),  # clipped
        dict(id=3, category_id=1, bbox=[100, 100, 10, 10], segmentation=good),  # entirely outside
        dict(id=4, category_id=1, bbox=[10, 10, 0, 10], segmentation=good),  # zero width
        dict(id=5, category_id=1, bbox=[10, 10, 10, 10], segmentation=good, area=0),  # zero area
        dict(id=6, category_id=1, bbox=[0, 0, 8, 8], segmentation=[polygon_box(30, 30, 40, 40)]),  # mask elsewhere
        dict(id=7, category_id=2, bbox=[10, 10, 10, 10], segmentation=[[1, 2, 3, 4], *good]),  # a short one
        dict(id=8, category_id=2, bbox=[10, 10, 10, 10], segmentation=[[1, 2, 3, 4]]),  # only short polygons
        dict(id=9, category_id=99, bbox=[10, 10, 10, 10], segmentation=good),  # unknown category
        dict(id=10, category_id=0, bbox=[10, 10, 10, 10], segmentation=good),  # background id
        dict(id=11, category_id=1, bbox=[10, 10, 10, 10], segmentation=broken_rle),
        dict(id=12, category_id=2, bbox=[40, 30, 5, 4], iscrowd=1,
             segmentation={"size": [48, 64], "counts": compressed["counts"].decode("ascii")}),  # fine crowd
        dict(id=13, category_id=1, bbox=[10, 10, 10, 10]),  # no segmentation
        dict(id=14, category_id=1, bbox=[10, 10, 10, 10], segmentation=[polygon_box(-30, -30, -20, -20)]),
        dict(id=15, category_id=1, bbox=[10, 10, 10, 10], segmentation=[[1, 2, 3, 4, 5]]),  # odd length
        dict(id=16, category_id=1, bbox=[10, 10, 10, 10], segmentation=good, image_id=77),  # no such image
        dict(id=17, category_id=1, bbox=[5, 5, 10, 10], segmentation=[polygon_box(5, 5, 15, 15)], image_id=2),
    ]
    for annotation in annotations:
        annotation.setdefault("image_id", 1)
    dataset = {
        "images": [
            {"id": 1, "file_name": "a.jpg", "height": 48, "width": 64},
            {"id": 2, "file_name": "b.jpg", "height": 40, "width": 40},  # the file is 48 x 64
        ],
        "annotations": annotations,
        "categories": [{"id": 1, "name": "one"}, {"id": 2, "name": "two"}],
    }
    return str(image_dir), write_json(tmp_path / "broken.json", dataset)


def test_warnings_file_lists_each_problem_with_its_action(broken_split, tmp_path):
    image_dir, annotations_file = broken_split
    output_dir = str(tmp_path / "out")
    summary = converter.convert_coco(image_dir, annotations_file, output_dir, num_shards=1, num_workers=1,
                                     progress=False)
    with open(os.path.join(output_dir, "broken_warnings.json")) as f:
        report = json.load(f)
    assert report["images"] == {
        "1": {
            "box_clipped": [2],
            "box_outside_image": [3],
            "non_positive_size": [4, 5],
            "mask_outside_box": [6],
            "polygon_too_few_points": [7, 8],
            "unknown_category": [9],
            "category_id_zero": [10],
            "bad_segmentation": [11, 15],
            "missing_segmentation": [13],
            "empty_mask": [14],
        },
        "2": {"image_size_mismatch": "the file is 48x64 (height x width), the JSON says 40x40"},
        "77": {"unknown_image": [16]},
    }
    assert report["actions"] == converter.WARNING_ACTIONS
    assert "dropped" in report["actions"]["unknown_category"] and "kept" in report["actions"]["box_clipped"]
    expected_counts = dict.fromkeys(converter.WARNING_ACTIONS, 0)
    for kinds in report["images"].values():
        for kind, value in kinds.items():
            expected_counts[kind] += 1 if isinstance(value, str) else len(value)
    assert report["counts"] == expected_counts and summary.warnings == sum(expected_counts.values()) == 15

    records, _ = read_shards(output_dir, "broken")
    kept = records[1]
    # Kept: 1, 2 (clipped), 6 (box as given), 7 (its good polygon only), 12 (compressed RLE crowd).
    np.testing.assert_array_equal(kept["image/object/class/label"], [1, 2, 1, 2, 2])
    np.testing.assert_array_equal(kept["image/object/is_crowd"], [0, 0, 0, 0, 1])
    np.testing.assert_allclose(kept["image/object/bbox/xmax"][:3], [20 / 64, 1.0, 8 / 64])
    np.testing.assert_allclose(kept["image/object/bbox/ymax"][:3], [20 / 48, 1.0, 8 / 48])
    expected_first = np.zeros((48, 64), np.uint8)
    expected_first[10:20, 10:20] = 1
    np.testing.assert_array_equal(decode_png(kept["image/object/mask"][3]), expected_first)
    expected_crowd = np.zeros((48, 64), np.uint8)
    expected_crowd[30:34, 40:45] = 1
    np.testing.assert_array_equal(decode_png(kept["image/object/mask"][4]), expected_crowd)
    resized = records[2]  # the file's size wins over the JSON's
    assert (resized["image/height"], resized["image/width"]) == (48, 64)
    np.testing.assert_allclose(resized["image/object/bbox/xmax"], [15 / 64])
    assert summary.images_written == 2 and summary.instances == 6


def test_missing_and_truncated_images_are_skipped_and_listed(tmp_path):
    image_dir = tmp_path / "images"
    image_dir.mkdir()
    write_jpeg(image_dir / "good.jpg", 32, 40)
    rng = np.random.default_rng(0)
    Image.fromarray(rng.integers(0, 255, (64, 64, 3), dtype=np.uint8)).save(image_dir / "full.jpg")
    data = (image_dir / "full.jpg").read_bytes()
    (image_dir / "truncated.jpg").write_bytes(data[: len(data) // 2])
    (image_dir / "garbage.jpg").write_bytes(b"not an image at all")
    names = ["good.jpg", "missing.jpg", "truncated.jpg", "garbage.jpg"]
    dataset = {
        "images": [{"id": i + 1, "file_name": name, "height": 32, "width": 40} for i, name in enumerate(names)],
        "annotations": [{"id": i + 1, "image_id": i + 1, "category_id": 1, "bbox": [1, 1, 5, 5],
                         "segmentation": [polygon_box(1, 1, 6, 6)]} for i in range(4)],
        "categories": [{"id": 1, "name": "thing"}],
    }
    annotations_file = write_json(tmp_path / "instances_val.json", dataset)
    output_dir = str(tmp_path / "out")
    summary = converter.convert_coco(str(image_dir), annotations_file, output_dir, num_shards=2, num_workers=1,
                                     progress=False)
    records, _ = read_shards(output_dir, "val")
    assert sorted(records) == [1]
    assert (summary.images_written, summary.images_skipped, summary.instances) == (1, 3, 1)
    with open(summary.warnings_path) as f:
        report = json.load(f)
    assert set(report["images"]) == {"2", "3", "4"}
    listed = report["images"]
    assert listed["2"].keys() == {"missing_image"} and "missing.jpg" in listed["2"]["missing_image"]
    assert listed["3"].keys() == {"unreadable_image"} and "truncated" in listed["3"]["unreadable_image"]
    assert listed["4"].keys() == {"unreadable_image"}
    assert report["counts"]["missing_image"] == 1 and report["counts"]["unreadable_image"] == 2


VALID = {
    "images": [{"id": 1, "file_name": "a.jpg", "height": 8, "width": 8}],
    "annotations": [
        {"id": 1, "image_id": 1, "category_id": 1, "bbox": [1, 1, 2, 2]},
        {"id": 2, "image_id": 1, "category_id": 1, "bbox": [1, 1, 2, 2]},
    ],
    "categories": [{"id": 1, "name": "thing"}],
}


def without(path, key):
    """VALID with `key` removed from the entry at `path` (a tuple of keys and indices)."""
    dataset = copy.deepcopy(VALID)
    entry = dataset
    for step in path:
        entry = entry[step]
    del entry[key]
    return dataset


def replaced(path, key, value):
    dataset = copy.deepcopy(VALID)
    entry = dataset
    for step in path:
        entry = entry[step]
    entry[key] = value
    return dataset


def numbered_from_zero(used):
    """VALID with its category numbered 0, which `used` of its 2 annotations keep."""
    dataset = replaced(("categories", 0), "id", 0)
    for annotation in dataset["annotations"][:used]:
        annotation["category_id"] = 0
    return dataset


@pytest.mark.parametrize(
    "content, expected",
    [
        ('{"images": [', ["invalid JSON"]),
        ("[1, 2]", ["top level must be a JSON object"]),
        (without((), "categories"), ["'categories'"]),
        (without(("annotations", 1), "bbox"), ["annotations[1]", "'bbox'"]),
        (without(("images", 0), "file_name"), ["images[0]", "'file_name'"]),
        (without(("categories", 0), "name"), ["categories[0]", "'name'"]),
        (replaced(("annotations", 0), "bbox", [1, 2, 3]), ["annotations[0]['bbox']", "4 finite numbers"]),
        (replaced(("images", 0), "height", "8"), ["images[0]['height']", "positive integer"]),
        (replaced(("annotations", 1), "iscrowd", 2), ["annotations[1]['iscrowd']", "0 or 1"]),
        (replaced(("annotations", 1), "id", 1), ["annotations[1]['id']", "repeats annotations[0]"]),
        (replaced((), "images", {}), ["'images' must be a list"]),
        (numbered_from_zero(used=2), ["categories[0] ('thing') has id 0, which 2 annotations use: id 0 is Mask "
                                      "R-CNN's background class", "number the categories from 1"]),
    ],
)
def test_bad_annotation_file_stops_with_exit_2_and_writes_nothing(tmp_path, capsys, content, expected):
    image_dir = tmp_path / "images"
    image_dir.mkdir()
    write_jpeg(image_dir / "a.jpg", 8, 8)
    annotations_file = tmp_path / "instances_train.json"
    annotations_file.write_text(content if isinstance(content, str) else json.dumps(content))
    output_dir = tmp_path / "out"
    output_dir.mkdir()
    argv = ["--image_dir", str(image_dir), "--annotations_file", str(annotations_file), "--output_dir",
            str(output_dir), "--num_workers", "1"]
    assert converter.main(argv) == status.BAD_INPUT == 2
    message = capsys.readouterr().err
    for part in [str(annotations_file)] + expected:
        assert part in message
    assert os.listdir(output_dir) == []


def test_a_category_numbered_0_that_no_annotation_uses_converts(tmp_path):
    # As some exporters write a data set's name as category 0 above its classes 1, 2, ...
    dataset = copy.deepcopy(VALID)
    dataset["categories"].insert(0, {"id": 0, "name": "my data set"})
    (tmp_path / "images").mkdir()
    write_jpeg(tmp_path / "images" / "a.jpg", 8, 8)
    summary = converter.convert_coco(str(tmp_path / "images"), write_json(tmp_path / "instances_val.json", dataset),
                                     str(tmp_path / "out"), num_workers=1, include_masks=False, progress=False)
    assert (summary.images_written, summary.instances) == (1, 2)


def test_a_missing_image_dir_or_a_file_for_a_directory_is_an_error(tmp_path):
    annotations_file = write_json(tmp_path / "instances_val.json", VALID)
    with pytest.raises(converter.BadInputError, match="nowhere: the image directory does not exist"):
        converter.convert_coco(str(tmp_path / "nowhere"), annotations_file, str(tmp_path / "out"), progress=False)
    assert not (tmp_path / "out").exists()
    with pytest.raises(converter.BadInputError, match="instances_val.json: the image directory is a file"):
        converter.convert_coco(annotations_file, annotations_file, str(tmp_path / "out"), progress=False)
    (tmp_path / "images").mkdir()
    with pytest.raises(converter.BadInputError, match="instances_val.json: the output directory is a file"):
        converter.convert_coco(str(tmp_path / "images"), annotations_file, annotations_file, progress=False)


def test_more_shards_than_images_is_an_error_that_writes_nothing(tmp_path):
    annotations_file = write_json(tmp_path / "instances_val.json", VALID)
    (tmp_path / "images").mkdir()
    images = len(VALID["images"])
    # Empty shards would leave a training worker without records.
    with pytest.raises(converter.BadInputError, match=f"num_shards {images + 1} exceeds the {images} images of "
                                                      f".*instances_val.json: shards would be empty"):
        converter.convert_coco(str(tmp_path / "images"), annotations_file, str(tmp_path / "out"),
                               num_shards=images + 1, progress=False)
    assert not (tmp_path / "out").exists()


def test_a_conversion_that_writes_no_image_exits_2_naming_the_first_missing_file(tmp_path, capsys):
    """A wrong --image_dir (every file_name missing) stops with one line and no shard; the right one converts
    the 3 images into one shard, the default count for 3 images."""
    image_dir = tmp_path / "images"
    image_dir.mkdir()
    names = ["a.jpg", "b.jpg", "c.jpg"]
    for name in names:
        write_jpeg(image_dir / name, 8, 8)
    dataset = {"images": [{"id": i + 1, "file_name": n, "height": 8, "width": 8} for i, n in enumerate(names)],
               "annotations": [], "categories": [{"id": 1, "name": "thing"}]}
    annotations_file = write_json(tmp_path / "instances_train.json", dataset)
    output_dir = tmp_path / "out"
    argv = ["--annotations_file", annotations_file, "--output_dir", str(output_dir), "--num_workers", "1"]
    assert converter.main(["--image_dir", str(tmp_path), *argv]) == status.BAD_INPUT
    (line,) = [text for text in capsys.readouterr().err.splitlines() if "error" in text]  # under the progress bar
    for part in ("no image written", "3 of 3", str(tmp_path / "a.jpg"), f"--image_dir ({tmp_path})", annotations_file):
        assert part in line, (part, line)
    assert os.listdir(output_dir) == []
    assert converter.main(["--image_dir", str(image_dir), *argv]) == status.OK
    assert sorted(os.listdir(output_dir)) == ["train-00000-of-00001.tfrecord", "train_warnings.json"]


# Budget: 3000 small images to write, then a conversion by two worker processes stopped midway.
@pytest.mark.timeout(180, method="thread")  # a hang would be in the pool's locks, beyond the signal timeout
@pytest.mark.slow
def test_a_sigterm_to_the_whole_process_group_stops_the_workers_and_the_conversion_cleanly(tmp_path):
    # SLURM's scancel and systemd send SIGTERM to every process of a job: the workers die holding the pool's
    # queues, and multiprocessing.Pool's stop then waited forever.
    image_dir = tmp_path / "images"
    image_dir.mkdir()
    for index in range(3000):
        write_jpeg(image_dir / f"{index}.jpg", 32, 32, value=(index % 256, 90, 200))
    annotations_file = write_json(tmp_path / "instances_train.json", {
        "images": [{"id": i + 1, "file_name": f"{i}.jpg", "height": 32, "width": 32} for i in range(3000)],
        "annotations": [], "categories": [{"id": 1, "name": "thing"}]})
    process = subprocess.Popen(
        [sys.executable, "dataset/create_coco_tf_record.py", "--image_dir", image_dir, "--annotations_file",
         annotations_file, "--output_dir", tmp_path / "out", "--num_workers", "2", "--noinclude_masks"],
        cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, start_new_session=True)
    shown = ""
    while not re.search(r"\b([1-9]\d{2,3})/3000\b", shown):  # a progress line: the workers are converting
        line = process.stderr.readline()
        assert line, f"the conversion ended first: {shown[-2000:]}"
        shown += line.replace("\r", "\n")
    os.killpg(process.pid, signal.SIGTERM)
    err = process.communicate(timeout=60)[1]
    assert process.returncode == 128 + signal.SIGTERM, err[-2000:]
    assert err.strip().splitlines()[-1] == "create_coco_tf_record.py: stopped by SIGTERM"
    assert os.listdir(tmp_path / "out") == []  # no shard, no temporary
    deadline = time.time() + 10  # no worker left behind, once those that are ending have ended
    while live_processes(group=process.pid) and time.time() < deadline:
        time.sleep(0.1)
    assert live_processes(group=process.pid) == []


def test_worker_failure_leaves_no_shard_or_temporary(tmp_path, monkeypatch):
    image_dir = tmp_path / "images"
    image_dir.mkdir()
    write_jpeg(image_dir / "a.jpg", 8, 8)
    dataset = copy.deepcopy(VALID)
    dataset["images"].append({"id": 2, "file_name": "a.jpg", "height": 8, "width": 8})
    annotations_file = write_json(tmp_path / "instances_val.json", dataset)
    real = converter.convert_image

    def failing_on_second(image, *args):
        if image["id"] == 2:
            raise RuntimeError("worker crashed")
        return real(image, *args)

    monkeypatch.setattr(converter, "convert_image", failing_on_second)
    output_dir = tmp_path / "out"
    with pytest.raises(RuntimeError, match="worker crashed"):
        converter.convert_coco(str(image_dir), annotations_file, str(output_dir), num_shards=2, num_workers=1,
                               progress=False)
    assert os.listdir(output_dir) == []


def test_colour_modes_become_rgb_jpeg_of_the_same_size(tmp_path):
    image_dir = tmp_path / "images"
    image_dir.mkdir()
    height, width = 24, 40
    gray = np.full((height, width), 100, np.uint8)
    Image.fromarray(gray).save(image_dir / "gray.jpg")
    cmyk = Image.new("CMYK", (width, height), (10, 200, 30, 0))
    cmyk.save(image_dir / "cmyk.jpg")
    rgba = np.zeros((height, width, 4), np.uint8)
    rgba[:, : width // 2] = (200, 50, 20, 255)  # left half opaque, right half transparent
    rgba[:, width // 2 :] = (255, 255, 255, 0)
    Image.fromarray(rgba).save(image_dir / "rgba.png")
    colours = np.array([(0, 0, 255), (255, 0, 0), (0, 255, 0), (255, 255, 0)], np.uint8)
    indices = np.tile(np.arange(width, dtype=np.uint8) // 10, (height, 1))  # 10 px wide stripes of each colour
    palette = Image.fromarray(indices).convert("P")
    palette.putpalette(colours.ravel().tolist() + [0] * (256 - len(colours)) * 3)
    palette.save(image_dir / "palette.png", transparency=3)  # the yellow stripe is transparent
    write_jpeg(image_dir / "rgb.jpg", height, width)
    deep = np.tile(np.arange(width, dtype=np.uint16) * 1500 + 255, (height, 1))  # 16-bit gray, low bytes of 255
    Image.fromarray(deep).save(image_dir / "gray16.png")
    Image.fromarray(deep.astype(np.float32)).save(image_dir / "float.tif")  # no 8-bit reading: skipped
    names = ["gray.jpg", "cmyk.jpg", "rgba.png", "palette.png", "rgb.jpg", "gray16.png", "float.tif"]
    dataset = {
        "images": [{"id": i + 1, "file_name": n, "height": height, "width": width} for i, n in enumerate(names)],
        "annotations": [],
        "categories": [{"id": 1, "name": "thing"}],
    }
    annotations_file = write_json(tmp_path / "instances_val.json", dataset)
    output_dir = str(tmp_path / "out")
    summary = converter.convert_coco(str(image_dir), annotations_file, output_dir, num_shards=1, num_workers=1,
                                     progress=False)
    records, _ = read_shards(output_dir, "val")
    assert sorted(records) == [1, 2, 3, 4, 5, 6]
    with open(summary.warnings_path) as f:
        assert "PIL mode F (32-bit float pixels)" in json.load(f)["images"]["7"]["unreadable_image"]
    decoded = {}
    for image in dataset["images"][:6]:
        encoded = records[image["id"]]["image/encoded"]
        with Image.open(io.BytesIO(encoded)) as pil:
            assert (pil.format, pil.mode, pil.size) == ("JPEG", "RGB", (width, height)), image["file_name"]
        pixels = tf.io.decode_jpeg(encoded, channels=0).numpy()  # channels=0: as many as the JPEG holds
        assert pixels.shape == (height, width, 3)
        decoded[image["file_name"]] = pixels.astype(np.int32)
    tolerance = 6  # JPEG round trip of a flat colour
    assert np.abs(decoded["gray.jpg"] - 100).max() <= tolerance
    assert np.abs(decoded["cmyk.jpg"] - np.asarray(cmyk.convert("RGB"), np.int32)).max() <= tolerance
    # Lossless sources: the RGB pixels they must become are known exactly, so must be the JPEG bytes.
    flattened = np.zeros((height, width, 3), np.uint8)
    flattened[:] = TRANSPARENT_FILL  # transparent pixels become the fill, as inference's photos do
    flattened[:, : width // 2] = (200, 50, 20)
    assert records[3]["image/encoded"] == encode_jpeg(Image.fromarray(flattened))
    expected_palette = np.where(indices[..., None] == 3, TRANSPARENT_FILL, colours[indices]).astype(np.uint8)
    assert records[4]["image/encoded"] == encode_jpeg(Image.fromarray(expected_palette))
    assert records[5]["image/encoded"] == (image_dir / "rgb.jpg").read_bytes()
    # 16-bit gray: its high byte (not 255 everywhere, as PIL's own convert() would make it).
    high_byte = np.repeat((deep >> 8).astype(np.uint8)[..., None], 3, axis=-1)
    assert records[6]["image/encoded"] == encode_jpeg(Image.fromarray(high_byte))


def test_a_photo_annotated_upright_is_turned_by_its_exif_orientation(tmp_path):
    """A JSON that gives the quarter-turned size of a photo with EXIF orientation 6 was made on the upright photo:
    its pixels are turned, its annotations kept. The stored size, a half turn (3) or a square photo: as stored."""
    image_dir = tmp_path / "images"
    image_dir.mkdir()
    stored = np.random.default_rng(0).integers(0, 256, (24, 40, 3), np.uint8)  # height 24, width 40
    for name, orientation, side in (("quarter.jpg", 6, None), ("half.jpg", 3, None), ("square.jpg", 6, 24)):
        exif = Image.Exif()
        exif[converter.EXIF_ORIENTATION] = orientation
        Image.fromarray(stored[:, :side]).save(image_dir / name, exif=exif, quality=95)
    Image.fromarray(stored).save(image_dir / "plain.jpg", quality=95)  # no orientation
    # Image 1 has the upright size; 2 (the same file), 3 and 4 their stored sizes; 5 is a plain size mismatch.
    entries = [("quarter.jpg", 40, 24), ("quarter.jpg", 24, 40), ("half.jpg", 24, 40), ("square.jpg", 24, 24),
               ("plain.jpg", 40, 24)]
    dataset = {
        "images": [{"id": i + 1, "file_name": name, "height": height, "width": width}
                   for i, (name, height, width) in enumerate(entries)],
        # A box in the upright photo's lower half (y 30-36 of its 40 rows): outside the stored pixels' 24.
        "annotations": [{"id": 1, "image_id": 1, "category_id": 1, "bbox": [2, 30, 10, 6],
                         "segmentation": [polygon_box(2, 30, 12, 36)]}],
        "categories": [{"id": 1, "name": "thing"}],
    }
    annotations_file = write_json(tmp_path / "instances_val.json", dataset)
    summary = converter.convert_coco(str(image_dir), annotations_file, str(tmp_path / "out"), num_shards=1,
                                     num_workers=1, progress=False)
    records, _ = read_shards(str(tmp_path / "out"), "val")
    with open(summary.warnings_path) as f:
        listed = json.load(f)["images"]
    assert listed == {"1": {"exif_upright": "the file's pixels are 24x40 (height x width) with EXIF orientation 6, "
                                            "the JSON says 40x24: turned upright"},
                      "5": {"image_size_mismatch": "the file is 24x40 (height x width), the JSON says 40x24"}}
    with Image.open(image_dir / "quarter.jpg") as opened:
        upright = ImageOps.exif_transpose(opened)
        assert records[1]["image/encoded"] == encode_jpeg(upright.convert("RGB"))
    assert (records[1]["image/height"], records[1]["image/width"]) == (40, 24)
    np.testing.assert_allclose([records[1]["image/object/bbox/ymin"][0], records[1]["image/object/bbox/ymax"][0]],
                               [30 / 40, 36 / 40])
    for image_id, name in ((2, "quarter.jpg"), (3, "half.jpg"), (4, "square.jpg"), (5, "plain.jpg")):  # as stored
        assert records[image_id]["image/encoded"] == (image_dir / name).read_bytes()


def test_a_conversion_stopped_by_sigterm_removes_its_temporary_shards(tmp_path, monkeypatch, capsys):
    image_dir = tmp_path / "images"
    image_dir.mkdir()
    for name in ("a.jpg", "b.jpg", "c.jpg"):
        write_jpeg(image_dir / name, 16, 16)
    annotations_file = write_json(tmp_path / "instances_train.json", {
        "images": [{"id": i, "file_name": n, "height": 16, "width": 16} for i, n in enumerate("abc", 1)],
        "annotations": [], "categories": [{"id": 1, "name": "thing"}]})
    convert, converted = converter.convert_image, []

    def signalled_at_the_second_image(*args):
        converted.append(args)
        if len(converted) == 2:  # the first image's record is in its temporary shard by now
            os.kill(os.getpid(), signal.SIGTERM)
        return convert(*args)

    monkeypatch.setattr(converter, "convert_image", signalled_at_the_second_image)
    argv = ["--image_dir", image_dir, "--annotations_file", annotations_file, "--output_dir", tmp_path / "out",
            "--noinclude_masks", "--num_shards", "2", "--num_workers", "1"]
    with terminations_by_default():
        assert converter.main([str(arg) for arg in argv]) == 128 + signal.SIGTERM
    assert capsys.readouterr().err.splitlines()[-1] == "create_coco_tf_record.py: stopped by SIGTERM"
    assert len(converted) == 2 and os.listdir(tmp_path / "out") == []


def test_a_conversion_that_fills_the_disk_is_one_line_and_leaves_no_shard(tmp_path, monkeypatch, capsys):
    image_dir = tmp_path / "images"
    image_dir.mkdir()
    noise = np.random.default_rng(0).integers(0, 256, (128, 128, 3), np.uint8)
    Image.fromarray(noise).save(image_dir / "0.jpg")  # about 10 KB
    for i in range(1, 40):
        os.link(image_dir / "0.jpg", image_dir / f"{i}.jpg")
    annotations_file = write_json(tmp_path / "instances_train.json", {
        "images": [{"id": i, "file_name": f"{i}.jpg", "height": 128, "width": 128} for i in range(40)],
        "annotations": [], "categories": [{"id": 1, "name": "thing"}]})
    argv = ["--image_dir", image_dir, "--annotations_file", annotations_file, "--output_dir", tmp_path / "out",
            "--noinclude_masks", "--num_shards", "2", "--num_workers", "1"]
    # Each shard needs 200 KB: the writes fail midway, with records still in the writers' buffers.
    with file_size_limit(100_000):
        assert converter.main([str(arg) for arg in argv]) == status.FAILURE
    err = capsys.readouterr().err.splitlines()
    assert re.fullmatch(r"create_coco_tf_record.py: error: a file could not be written \(File too large: "
                        rf"{tmp_path}/out/train-0000[01]-of-00002.tfrecord.tmp-\d+\)", err[-1]), err
    assert os.listdir(tmp_path / "out") == []

    class FullDisk(tf.io.TFRecordWriter):
        """As TensorFlow's writers are on a full disk (seen on a tmpfs): the write that finds it full fails, and
        so does each writer's close, which flushes the records it holds."""

        def __init__(self, path):
            super().__init__(path)
            self.path, self.count = path, 0

        def write(self, record):
            self.count += 1
            if self.count > 5:
                raise tf.errors.ResourceExhaustedError(None, None, f"{self.path}; No space left on device")
            super().write(record)

        def close(self):
            super().close()
            raise tf.errors.ResourceExhaustedError(None, None, f"{self.path}; No space left on device")

    monkeypatch.setattr(tf.io, "TFRecordWriter", FullDisk)
    assert converter.main([str(arg) for arg in argv]) == status.FAILURE
    assert re.fullmatch(r"create_coco_tf_record.py: error: a file could not be written \(No space left on device: "
                        rf"{tmp_path}/out/train-00000-of-00002.tfrecord.tmp-\d+\)",
                        capsys.readouterr().err.splitlines()[-1])
    assert os.listdir(tmp_path / "out") == []
    monkeypatch.undo()
    # With room, the same command converts, and names the temporary shard a conversion killed outright left.
    left = tmp_path / "out" / f"train-00000-of-00002.tfrecord.tmp-{dead_pid()}"
    left.write_bytes(b"")
    assert converter.main([str(arg) for arg in argv]) == status.OK
    assert capsys.readouterr().err.splitlines()[-1] == (
        f"note: 1 temporary file(s) that a killed process left beside the output ({left}; 0.0 MiB in all): "
        "delete them")


def test_without_masks_and_skip_empty(tmp_path):
    image_dir = tmp_path / "images"
    image_dir.mkdir()
    for name in ("a.jpg", "b.jpg", "c.jpg"):
        write_jpeg(image_dir / name, 16, 16)
    dataset = {
        "images": [{"id": i, "file_name": n, "height": 16, "width": 16} for i, n in ((1, "a.jpg"), (2, "b.jpg"),
                                                                                        (3, "c.jpg"))],
        "annotations": [
            {"id": 1, "image_id": 1, "category_id": 1, "bbox": [1, 1, 4, 4]},  # no segmentation: fine
            {"id": 2, "image_id": 3, "category_id": 1, "bbox": [1, 1, 4, 4], "iscrowd": 1},  # a crowd only
        ],
        "categories": [{"id": 1, "name": "thing"}],
    }
    annotations_file = write_json(tmp_path / "instances_train.json", dataset)
    output_dir = str(tmp_path / "out")
    argv = ["--image_dir", str(image_dir), "--annotations_file", annotations_file, "--output_dir", output_dir,
            "--noinclude_masks", "--num_shards", "2", "--num_workers", "1"]
    assert converter.main(argv) == 0
    records, _ = read_shards(output_dir, "train", include_masks=False)
    assert sorted(records) == [1, 2, 3]  # the empty image 2 is a negative
    np.testing.assert_allclose(records[1]["image/object/area"], [16.0])  # no 'area', no mask: the box's
    assert len(records[2]["image/object/class/label"]) == 0

    summary = converter.convert_coco(str(image_dir), annotations_file, output_dir, tag="kept", num_shards=1,
                                     include_masks=False, num_workers=1, skip_empty=True, progress=False)
    records, _ = read_shards(output_dir, "kept", include_masks=False)
    assert sorted(records) == [1]
    assert (summary.images_written, summary.images_skipped, summary.images_empty_skipped) == (1, 0, 2)


def test_flags_and_defaults():
    parser = converter.build_parser()
    required = ["--image_dir", "i", "--annotations_file", "a.json", "--output_dir", "o"]
    assert parser.parse_args(required).include_masks is True
    assert parser.parse_args(required + ["--include_masks"]).include_masks is True
    assert parser.parse_args(required + ["--noinclude_masks"]).include_masks is False
    with pytest.raises(SystemExit):
        parser.parse_args(required + ["--include_masks", "--noinclude_masks"])
    assert converter.default_tag("/data/annotations/instances_val2017.json") == "val2017"
    assert converter.default_tag("instances_train.json") == "train"
    assert converter.default_tag("my_labels.json") == "my_labels"
    # NVIDIA's counts for COCO, one shard per 64 images below them, never more shards than images.
    assert converter.default_num_shards("train2017", 118287) == 256
    assert converter.default_num_shards("val2017", 5000) == 32
    assert [converter.default_num_shards("train", n) for n in (0, 3, 64, 65, 640)] == [1, 1, 1, 2, 10]


def test_compressed_rle_counts_match_pycocotools(rng):
    for _ in range(20):
        mask = rng.random(tuple(rng.integers(1, 30, size=2))) < rng.uniform(0.1, 0.9)
        counts = mask_utils.encode(np.asfortranarray(mask.astype(np.uint8)))["counts"].decode("ascii")
        assert converter.compressed_rle_counts(counts) == encode_uncompressed_rle(mask)["counts"]
    assert converter.compressed_rle_counts("a") is None  # a value whose continuation bit runs off the end
    assert converter.compressed_rle_counts("0 ") is None  # a character outside the code range


def test_paths_starting_with_a_tilde_are_under_the_home_directory(tmp_path, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path))
    args = converter.build_parser().parse_args(["--image_dir", "~/images", "--annotations_file", "~/a.json",
                                                "--output_dir", "~/records"])
    assert (args.image_dir, args.annotations_file, args.output_dir) == (
        f"{tmp_path}/images", f"{tmp_path}/a.json", f"{tmp_path}/records")
