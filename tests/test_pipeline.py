"""The tf.data input pipeline on converter output: shapes, padding, image_info, flips, RPN targets, order,
each worker's share of the records."""

import io
import math
import os
import re
import shutil

import numpy as np
import pytest
import tensorflow as tf
from PIL import Image, ImageDraw

from mrcnn_tf2.config import Config, ConfigError
from mrcnn_tf2.data import coco_io
from mrcnn_tf2.data.decoder import decode_example
from mrcnn_tf2.data.pipeline import (InputPipeline, crop_instance_masks, evaluation_images, flip_horizontally,
                                     notice_record_sharding, record_problem, worker_records)
from mrcnn_tf2.data.preprocess import decode_image, resize_normalize_pad
from mrcnn_tf2.data.repeat_factors import RepeatFactors
from mrcnn_tf2.model.factory import build_anchors, choose_ops
from mrcnn_tf2.model.pretrained import IMAGENET_MEAN, IMAGENET_STD
from mrcnn_tf2.ops import anchors as anchor_ops
from mrcnn_tf2.ops import fused

IMAGE_SIZE = (128, 192)
MAX_INSTANCES = 24
MASK_SIZE = 16


@pytest.fixture(scope="module")
def records(shapes_records):
    """(train pattern, val pattern, {split: COCO annotations})."""
    return shapes_records["train"], shapes_records["val"], shapes_records["annotations"]


def make_config(augment=False, seed=7):
    config = Config()
    config.data.image_size = IMAGE_SIZE
    config.data.max_num_instances = MAX_INSTANCES
    config.data.gt_mask_size = MASK_SIZE
    config.data.augment_input_data = augment
    config.train.seed = seed
    return config


def training_pipeline(config, rpn_targets=anchor_ops.rpn_targets):
    """The training input of `config`, labelling the anchors a model of it has (as the Trainer gives them)."""
    return InputPipeline(config, training=True, anchors=build_anchors(config), rpn_targets=rpn_targets)


def originals(pattern):
    """{source_id: decoded example as NumPy} for every record matching the pattern."""
    result = {}
    for path in sorted(tf.io.gfile.glob(pattern)):
        for serialized in tf.data.TFRecordDataset(path):
            example = {k: v.numpy() for k, v in decode_example(serialized).items()}
            result[int(example["source_id"])] = example
    return result


def first_batches(pipeline, pattern, count, batch_size=2):
    return [tf.nest.map_structure(lambda t: t.numpy(), b)
            for b in pipeline.dataset(pattern, batch_size).take(count)]


def test_training_batch_shapes_dtypes_and_padding(records):
    train, _, annotations = records
    (batch,) = first_batches(training_pipeline(make_config()), train, 1)
    assert batch["images"].shape == (2, *IMAGE_SIZE, 3) and batch["images"].dtype == np.float32
    assert batch["image_info"].shape == (2, 5)
    assert batch["gt_boxes"].shape == (2, MAX_INSTANCES, 4)
    assert batch["gt_classes"].shape == (2, MAX_INSTANCES) and batch["gt_classes"].dtype == np.int32
    assert batch["gt_masks"].shape == (2, MAX_INSTANCES, MASK_SIZE, MASK_SIZE)
    for level in range(2, 7):
        grid = (IMAGE_SIZE[0] // 2**level, IMAGE_SIZE[1] // 2**level)
        assert batch["rpn_score_targets"][level].shape == (2, *grid, 3)
        assert batch["rpn_box_targets"][level].shape == (2, *grid, 12)
    crowd = {a["id"] for a in annotations["train"]["annotations"] if a["iscrowd"]}
    for i in range(2):
        image_id = int(batch["source_ids"][i])
        solid = [a for a in annotations["train"]["annotations"] if a["image_id"] == image_id and a["id"] not in crowd]
        real = batch["gt_classes"][i] >= 1
        # Crowd regions are dropped; real instances come first, padding after.
        assert real.sum() == min(len(solid), MAX_INSTANCES)
        assert not real[real.sum():].any()
        assert sorted(batch["gt_classes"][i][real]) == sorted(a["category_id"] for a in solid)[:MAX_INSTANCES]
        np.testing.assert_array_equal(batch["gt_boxes"][i][~real], -1.0)
        np.testing.assert_array_equal(batch["gt_masks"][i][~real], -1.0)
        assert ((batch["gt_masks"][i][real] >= 0) & (batch["gt_masks"][i][real] <= 1)).all()
        # Padding of the image beyond the scaled size is zero.
        scaled_h, scaled_w = batch["image_info"][i, :2].astype(int)
        assert not batch["images"][i, scaled_h:].any() and not batch["images"][i, :, scaled_w:].any()
        labels = np.concatenate([batch["rpn_score_targets"][lv][i].ravel() for lv in range(2, 7)])
        positives = (labels == 1).sum()
        # Every ground-truth box forces at least one positive; images without objects get none.
        assert (0 < positives <= 128) == (real.sum() > 0) and (labels >= 0).sum() == 256


def test_image_info_maps_boxes_back_to_the_original_image(records):
    train, _, _ = records
    source = originals(train)
    (batch,) = first_batches(training_pipeline(make_config(augment=False)), train, 1)
    for i in range(2):
        example = source[int(batch["source_ids"][i])]
        scaled_h, scaled_w, inverse_scale, height, width = batch["image_info"][i]
        assert (height, width) == example["image"].shape[:2]
        scale = min(IMAGE_SIZE[0] / height, IMAGE_SIZE[1] / width)
        assert inverse_scale == pytest.approx(1.0 / scale)
        assert (scaled_h, scaled_w) == (round(height * scale), round(width * scale))
        real = batch["gt_classes"][i] >= 1
        expected = example["gt_boxes"][~example["gt_is_crowd"]][:MAX_INSTANCES]
        np.testing.assert_allclose(batch["gt_boxes"][i][real] * inverse_scale, expected, atol=1e-3)


def test_flip_moves_image_boxes_and_masks_together(records):
    train, _, _ = records
    plain = first_batches(training_pipeline(make_config(augment=False)), train, 4)
    augmented = first_batches(training_pipeline(make_config(augment=True)), train, 4)
    flipped_count = 0
    for a, b in zip(plain, augmented):
        np.testing.assert_array_equal(a["source_ids"], b["source_ids"])  # same seed, same order
        for i in range(2):
            scaled_w = int(a["image_info"][i, 1])
            if np.array_equal(a["images"][i], b["images"][i]):
                np.testing.assert_array_equal(a["gt_boxes"][i], b["gt_boxes"][i])
                continue
            flipped_count += 1
            # Resizing then mirroring equals mirroring then resizing up to interpolation rounding.
            np.testing.assert_allclose(b["images"][i, :, :scaled_w], a["images"][i, :, :scaled_w][:, ::-1], atol=1e-3)
            real = a["gt_classes"][i] >= 1
            ymin, xmin, ymax, xmax = a["gt_boxes"][i][real].T
            width = a["image_info"][i, 4] / a["image_info"][i, 2]  # original width in scaled pixels
            np.testing.assert_allclose(b["gt_boxes"][i][real], np.stack([ymin, width - xmax, ymax, width - xmin], 1),
                                       atol=1e-3)
            np.testing.assert_allclose(b["gt_masks"][i][real], a["gt_masks"][i][real][:, :, ::-1], atol=1e-5)
    assert 0 < flipped_count < 8


# Four solid ellipses of distinct colours on black, within these boxes [ymin, xmin, ymax, xmax] in pixels of a
# 96 x 128 image (none overlaps another); object i + 1 is of class i + 1.
ELLIPSES = ((4, 6, 40, 50), (10, 80, 30, 124), (56, 10, 90, 50), (50, 64, 88, 120))
COLOURS = ((255, 0, 0), (0, 255, 0), (0, 0, 255), (255, 255, 255))


def ellipses_record(path):
    """A TFRecord of one 96 x 128 JPEG image holding ELLIPSES in COLOURS, with their boxes and masks."""
    picture = Image.new("RGB", (128, 96))
    masks = []
    for (ymin, xmin, ymax, xmax), colour in zip(ELLIPSES, COLOURS):
        ImageDraw.Draw(picture).ellipse([xmin, ymin, xmax - 1, ymax - 1], fill=colour)
        mask = Image.new("L", (128, 96))
        ImageDraw.Draw(mask).ellipse([xmin, ymin, xmax - 1, ymax - 1], fill=1)
        buffer = io.BytesIO()
        mask.save(buffer, "PNG")
        masks.append(buffer.getvalue())
    boxes = np.array(ELLIPSES, np.float32) / [96, 128, 96, 128]
    encoded = io.BytesIO()
    picture.save(encoded, "JPEG", quality=100, subsampling=0)  # the colours' edges where they are

    def feature(values, kind):
        return tf.train.Feature(**{kind: getattr(tf.train, kind.title().replace("_", ""))(value=values)})

    features = {"image/encoded": feature([encoded.getvalue()], "bytes_list"),
                "image/source_id": feature([b"1"], "bytes_list"), "image/object/mask": feature(masks, "bytes_list"),
                "image/height": feature([96], "int64_list"), "image/width": feature([128], "int64_list"),
                "image/object/class/label": feature(range(1, 5), "int64_list"),
                "image/object/is_crowd": feature([0] * 4, "int64_list")}
    for i, name in enumerate(("ymin", "xmin", "ymax", "xmax")):
        features[f"image/object/bbox/{name}"] = feature(boxes[:, i], "float_list")
    with tf.io.TFRecordWriter(str(path)) as writer:
        writer.write(tf.train.Example(features=tf.train.Features(feature=features)).SerializeToString())


def label_example(labels, crowd):
    """A serialized record holding only what repeat factors read: the objects' categories and crowd flags."""
    int64s = lambda values: tf.train.Feature(int64_list=tf.train.Int64List(value=values))  # noqa: E731
    return tf.train.Example(features=tf.train.Features(feature={
        "image/object/class/label": int64s(labels), "image/object/is_crowd": int64s(crowd)})).SerializeToString()


def test_repeat_factors_repeat_the_images_of_rare_categories_by_the_square_root_rule(tmp_path, records, capsys,
                                                                                     monkeypatch):
    # 20 images: 16 of category 1, 2 of categories 1 and 2, one whose category 3 object is a crowd region (which
    # counts for none), one without objects. At t = 0.5: f(1) = 0.9 -> 1, f(2) = 0.1 -> sqrt(5), f(3) = 0 -> 1.
    frequent, rare, crowd, empty = (label_example([1], [0]), label_example([1, 2], [0, 0]),
                                    label_example([3], [1]), label_example([], []))
    path = str(tmp_path / "labels.tfrecord")
    with tf.io.TFRecordWriter(path) as writer:
        for example in [frequent] * 16 + [rare] * 2 + [crowd, empty]:
            writer.write(example)
    factors = RepeatFactors.from_records([path], 0.5, num_classes=4)
    np.testing.assert_allclose(factors.categories, [1.0, 1.0, math.sqrt(5), 1.0], rtol=1e-6)
    assert factors.num_images == 20 and factors.max_image_factor == pytest.approx(math.sqrt(5))
    assert factors.mean_image_factor == pytest.approx((18 + 2 * math.sqrt(5)) / 20)
    assert factors.describe(0.5).startswith("repeat factor sampling (data.repeat_threshold 0.5): 1 of 3 categories "
                                            "are in fewer than that fraction of the 20 training images")

    def shown(example, copies, seed):
        stream = factors.repeat(tf.data.Dataset.from_tensors(example).repeat(copies), seed)
        return sum(1 for _ in stream)

    assert [shown(example, 50, seed=3) for example in (frequent, crowd, empty)] == [50, 50, 50]
    # sqrt(5) = 2.236 times on average: 2 or 3 each, 3 with probability 0.236 (1000 draws: 3 sigma is 0.04).
    counts = [len(list(factors.repeat(tf.data.Dataset.from_tensors(rare), seed))) for seed in range(40)]
    assert set(counts) == {2, 3}
    assert shown(rare, 1000, seed=5) / 1000 == pytest.approx(math.sqrt(5), abs=0.04)
    assert shown(rare, 1000, seed=5) == shown(rare, 1000, seed=5)  # a seeded run repeats the same

    # In the training input: said once at its start, the records repeated with the run's seed, batches as usual.
    train, _, _ = records
    config = make_config()
    config.data.repeat_threshold = 0.9
    seeds, repeat = [], RepeatFactors.repeat
    monkeypatch.setattr(RepeatFactors, "repeat", lambda self, stream, seed: seeds.append(seed) or repeat(self, stream,
                                                                                                          seed))
    assert len(first_batches(training_pipeline(config), train, 2)) == 2
    assert seeds == [config.train.seed]
    assert "[data] repeat factor sampling (data.repeat_threshold 0.9): " in capsys.readouterr().out


def test_scale_jitter_cuts_the_image_with_its_boxes_and_masks_and_drops_what_it_cuts_off(tmp_path):
    ellipses_record(tmp_path / "train.tfrecord")
    config = make_config(augment=True)
    config.data.image_size = (64, 64)  # the 96 x 128 image fits at scale 0.5, jittered to 0.6 .. 1.5
    config.data.aug_scale_min, config.data.aug_scale_max = 1.2, 3.0
    config.data.gt_mask_size = 16
    batches = first_batches(training_pipeline(config), str(tmp_path / "train.tfrecord"), 24, batch_size=1)
    scales, objects = set(), []
    for batch in batches:
        image = batch["images"][0] * IMAGENET_STD + IMAGENET_MEAN
        scaled_h, scaled_w, inverse_scale = batch["image_info"][0, :3]
        scales.add(round(float(inverse_scale), 4))
        padding = batch["images"][0].copy()
        padding[:int(scaled_h), :int(scaled_w)] = 0
        assert not padding.any()  # the image at the top left, at most the canvas
        classes = batch["gt_classes"][0]
        kept = classes[classes >= 1]
        assert len(set(kept)) == len(kept) and np.all(classes[len(kept):] == -1)
        objects.append(len(kept))
        for label, colour in enumerate(COLOURS, 1):
            shown = np.all(np.abs(image - colour) < 60, axis=-1)
            if label not in kept:  # cut off: at most the blur of an edge shows
                assert shown.sum() <= 2, (label, shown.sum())
                continue
            index = list(classes).index(label)
            rows, cols = np.nonzero(shown)
            ymin, xmin, ymax, xmax = box = batch["gt_boxes"][0, index]
            # The box is around the part shown: the colour's pixels [first, last + 1), up to the edges' blur and
            # an original pixel (the masks' unit).
            np.testing.assert_allclose(box, [rows.min(), cols.min(), rows.max() + 1, cols.max() + 1],
                                       atol=1 + 1 / inverse_scale)
            # The mask is the part shown, in its box: the colour at its cells' centres (but for the bilinear
            # samples within a pixel of the ellipse's edge, which all of a sliver of a few pixels is).
            mask = batch["gt_masks"][0, index]
            centres = (np.arange(16) + 0.5) / 16
            colour_there = shown[np.ix_((ymin + centres * (ymax - ymin)).astype(int),
                                        (xmin + centres * (xmax - xmin)).astype(int))]
            if min(ymax - ymin, xmax - xmin) * inverse_scale >= 6:
                assert np.mean(np.abs(mask - colour_there)) < 0.12, (mask.round(1), colour_there)
            assert mask.max() > 0.5
    assert len(scales) == len(batches)  # a factor of its own for every element
    assert min(objects) < 4 and max(objects) == 4  # some cuts leave objects out, the smaller scales keep all
    # The range is checked.
    config.data.aug_scale_min = 4.0
    with pytest.raises(ConfigError, match=r"data.aug_scale_min: 4.0 exceeds data.aug_scale_max 3.0"):
        config.validate()


def test_seeded_training_is_reproducible(records):
    train, _, _ = records
    first = first_batches(training_pipeline(make_config(augment=True, seed=11)), train, 2)
    second = first_batches(training_pipeline(make_config(augment=True, seed=11)), train, 2)
    for a, b in zip(first, second):
        tf.nest.map_structure(np.testing.assert_array_equal, a, b)


def test_eval_reads_every_record_once_in_order_keeping_the_last_partial_batch(records):
    _, val, annotations = records
    batches = first_batches(InputPipeline(make_config(), training=False), val, 10, batch_size=2)
    assert [len(b["source_ids"]) for b in batches] == [2, 2, 1]
    assert set(batches[0]) == {"images", "image_info", "source_ids"}
    ids = [int(i) for b in batches for i in b["source_ids"]]
    assert sorted(ids) == sorted(image["id"] for image in annotations["val"]["images"])


@pytest.mark.parametrize("max_records", [None, 4])
def test_evaluation_workers_share_the_first_records_of_one_process_by_record(records, max_records):
    train, _, _ = records  # 2 files of 3 records: sharing by record, not by file, even with as many files
    one_process = [int(i) for b in InputPipeline(make_config(), training=False).dataset(train, 2, 0, 1, max_records)
                   for i in b["source_ids"]]
    assert len(one_process) == (6 if max_records is None else max_records)
    shares = [[int(i) for b in InputPipeline(make_config(), training=False).dataset(train, 2, worker, 2, max_records)
               for i in b["source_ids"]] for worker in (0, 1)]
    assert shares == [one_process[0::2], one_process[1::2]]


def source_ids(serialized_records):
    return [int(decode_example(s, include_masks=False)["source_id"]) for s in serialized_records]


def test_at_least_as_many_files_as_workers_give_each_worker_its_own_files(records):
    paths = sorted(tf.io.gfile.glob(records[0]))
    assert len(paths) == 2
    for worker in (0, 1):
        assert source_ids(worker_records(paths, worker, 2, training=False)) == list(originals(paths[worker]))


@pytest.mark.parametrize("split, workers", [("val", 2), ("train", 3)])  # 1 file of 5, 2 files of 3 records
def test_fewer_files_than_workers_give_each_worker_every_nth_record(records, split, workers):
    pattern = {"train": records[0], "val": records[1]}[split]
    paths = sorted(tf.io.gfile.glob(pattern))
    assert len(paths) < workers
    in_file_order = list(originals(pattern))
    for worker in range(workers):
        # Counted across the files in order: disjoint shares that cover the files.
        assert source_ids(worker_records(paths, worker, workers, training=False)) == in_file_order[worker::workers]


def test_training_with_fewer_files_than_workers_reads_only_its_records_and_says_so_once(records, capsys):
    _, val, _ = records  # one file
    notice_record_sharding.cache_clear()  # other tests may have printed it
    in_file_order = list(originals(val))
    for worker in (0, 1, 0):  # worker 0 twice, as training builds its dataset twice
        batches = training_pipeline(make_config()).dataset(val, 1, worker, 2).take(10)
        assert {int(b["source_ids"][0]) for b in batches} == set(in_file_order[worker::2])
    assert capsys.readouterr().out.count("keeps 1 record in 2") == 1


def test_fewer_records_than_workers_is_an_error(tmp_path, records):
    path = str(tmp_path / "one.tfrecord")
    with tf.io.TFRecordWriter(path) as writer:
        writer.write(next(iter(tf.data.TFRecordDataset(tf.io.gfile.glob(records[1])))).numpy())
    with pytest.raises(ValueError, match="fewer records than the 2 workers"):
        training_pipeline(make_config()).dataset(path, 1, 1, 2)


def test_a_worker_whose_files_hold_no_record_is_an_error_on_every_worker(tmp_path, records):
    full, empty = str(tmp_path / "train-0.tfrecord"), str(tmp_path / "train-1.tfrecord")
    with tf.io.TFRecordWriter(full) as writer:
        writer.write(next(iter(tf.data.TFRecordDataset(tf.io.gfile.glob(records[1])))).numpy())
    with tf.io.TFRecordWriter(empty):
        pass
    pattern = str(tmp_path / "train-*.tfrecord")
    training_pipeline(make_config()).dataset(pattern, 1, 0, 1)  # one worker reads both files: a record
    # Two workers read a file each: worker 1 would wait forever for its first record. Both stop, with one message.
    for worker in (0, 1):
        with pytest.raises(ValueError, match=rf"^the 1 file\(s\) that worker 1 of 2 reads hold no record \(first: "
                                             rf"{re.escape(empty)}, matched by"):
            training_pipeline(make_config()).dataset(pattern, 1, worker, 2)
    os.remove(full)
    with pytest.raises(ValueError, match=r"^the 1 file\(s\) hold no record"):
        training_pipeline(make_config()).dataset(pattern, 1, 0, 1)


def test_crop_instance_masks_samples_at_pixel_centres():
    mask = np.zeros((1, 20, 30), np.uint8)
    mask[0, 4:12, 6:22] = 1  # rows 4..11, cols 6..21: box [4, 6, 12, 22] in continuous pixels
    crop = crop_instance_masks(tf.constant(mask), tf.constant([[4.0, 6.0, 12.0, 22.0]]), 8).numpy()
    np.testing.assert_allclose(crop, 1.0)
    # A box twice as wide to the right: cell centres at x = 6 + (j + 0.5) * 4; pixel centres at x + 0.5.
    crop = crop_instance_masks(tf.constant(mask), tf.constant([[4.0, 6.0, 12.0, 38.0]]), 8).numpy()[0]
    xs = 6 + (np.arange(8) + 0.5) * 4 - 0.5  # in index units
    expected = np.clip(np.interp(xs, np.arange(30), mask[0, 8]), 0, 1)
    expected[xs > 29] = 0.0  # beyond the last pixel: extrapolation value
    np.testing.assert_allclose(crop[3], expected, atol=1e-6)


def test_flip_horizontally_is_consistent_with_cropping(rng):
    mask = (rng.random((2, 24, 40)) > 0.5).astype(np.uint8)
    boxes = tf.constant([[2.0, 3.0, 20.0, 17.0], [0.0, 10.0, 24.0, 40.0]])
    image = tf.zeros([24, 40, 3], tf.uint8)
    crops = crop_instance_masks(tf.constant(mask), boxes, 10)
    _, flipped_boxes, flipped_crops = flip_horizontally(image, boxes, crops)
    np.testing.assert_allclose(flipped_boxes.numpy(), [[2.0, 23.0, 20.0, 37.0], [0.0, 0.0, 24.0, 30.0]])
    recropped = crop_instance_masks(tf.constant(mask[:, :, ::-1].copy()), flipped_boxes, 10)
    np.testing.assert_allclose(flipped_crops.numpy(), recropped.numpy(), atol=1e-5)


def test_resize_normalize_pad_keeps_aspect_and_normalises():
    image = tf.fill([100, 50, 3], tf.constant(200, tf.uint8))
    padded, info, scale = resize_normalize_pad(image, IMAGE_SIZE)
    assert float(scale) == pytest.approx(1.28)
    np.testing.assert_allclose(info.numpy(), [128, 64, 1 / 1.28, 100, 50], rtol=1e-6)
    np.testing.assert_allclose(padded[:, :64].numpy(), np.broadcast_to((200 - np.array([123.675, 116.28, 103.53]))
                                                                        / np.array([58.395, 57.12, 57.375]),
                                                                        (128, 64, 3)), rtol=1e-5)
    assert not padded[:, 64:].numpy().any()
    # A strip whose short side would round to no pixel keeps one.
    _, info, _ = resize_normalize_pad(tf.zeros([1, 3000, 3], tf.uint8), IMAGE_SIZE)
    np.testing.assert_allclose(info.numpy(), [1, 192, 3000 / 192, 1, 3000], rtol=1e-6)


def test_decoded_gray_alpha_and_16_bit_pngs_hold_the_pixels_that_pil_images_made_rgb_hold(rng):
    """The SavedModel's serving_bytes (and records of PNGs) decode in the graph; photos and the converter read
    with PIL (`coco_io.to_rgb`): the same file must give the same pixels, exactly."""
    alpha = np.tile(np.arange(256, dtype=np.uint8), (64, 1))[:, :, None]  # every level of alpha, 0 to 255
    rgb = rng.integers(0, 256, (64, 256, 3), dtype=np.uint8)
    deep = rng.integers(0, 65536, (64, 256, 4), dtype=np.uint16)
    for name, pixels in (("RGBA", np.concatenate([rgb, alpha], -1)), ("gray and alpha", np.concatenate(
            [rgb[..., :1], alpha], -1)), ("16-bit gray", deep[..., :1]), ("16-bit RGBA", deep),
            ("RGB", rgb), ("gray", rgb[..., :1])):
        png = tf.io.encode_png(pixels).numpy()
        with Image.open(io.BytesIO(png)) as opened:
            expected = np.asarray(coco_io.to_rgb(opened))
        np.testing.assert_array_equal(decode_image(tf.constant(png)).numpy(), expected, err_msg=name)


def test_preprocessing_of_decoded_bytes_equals_the_pixels_and_the_mean_colour_normalises_to_zero(rng):
    pixels = rng.integers(0, 256, (30, 70, 3), dtype=np.uint8)
    png = tf.io.encode_png(pixels)
    np.testing.assert_array_equal(decode_image(png).numpy(), pixels)
    np.testing.assert_array_equal(decode_image(tf.io.encode_png(pixels[..., :1])).numpy(),
                                  np.repeat(pixels[..., :1], 3, axis=-1))  # grayscale becomes RGB
    padded, info, _ = resize_normalize_pad(decode_image(png), IMAGE_SIZE)
    want, want_info, _ = resize_normalize_pad(tf.constant(pixels), IMAGE_SIZE)
    np.testing.assert_array_equal(padded.numpy(), want.numpy())
    np.testing.assert_array_equal(info.numpy(), want_info.numpy())
    mean = tf.constant(np.broadcast_to(np.float32(IMAGENET_MEAN), (8, 8, 3)))
    np.testing.assert_allclose(resize_normalize_pad(mean, (16, 16))[0].numpy(), 0.0, atol=1e-6)


def test_the_training_input_labels_the_anchors_it_is_given_with_the_function_it_is_given(records):
    train, _, _ = records
    config = make_config()
    with pytest.raises(ValueError, match="anchors"):
        InputPipeline(config, training=True)
    InputPipeline(config, training=False)  # evaluation needs neither
    anchors = build_anchors(config)
    seen = []

    def spy(given, *args, **kwargs):
        seen.append(given)
        return anchor_ops.rpn_targets(given, *args, **kwargs)

    pipeline = InputPipeline(config, training=True, anchors=anchors, rpn_targets=spy)
    pipeline.preprocess_train(tf.constant(0, tf.int64), next(iter(tf.data.TFRecordDataset(tf.io.gfile.glob(train)))))
    assert seen and all(given is anchors for given in seen)


def test_missing_files_name_the_pattern(tmp_path):
    pattern = os.path.join(str(tmp_path), "train-*.tfrecord")
    with pytest.raises(ValueError, match="train-"):
        training_pipeline(make_config()).dataset(pattern, 2)


def test_a_matched_file_that_is_not_a_tfrecord_is_named(tmp_path, records):
    train_pattern = records[0]
    for path in tf.io.gfile.glob(train_pattern):
        shutil.copy(path, tmp_path)
    (tmp_path / "train_warnings.json").write_text('{"skipped_images": []}')
    pattern = os.path.join(str(tmp_path), "train*")
    with pytest.raises(ValueError, match=r"train_warnings\.json .* is not a TFRecord file"):
        InputPipeline(make_config(), training=False).dataset(pattern, 2)
    batch = next(iter(InputPipeline(make_config(), training=False).dataset(os.path.join(str(tmp_path), "train-*"), 2)))
    assert batch["images"].shape[0] == 2


def test_images_without_objects_decode_and_train_as_negatives(records):
    train, _, annotations = records
    empty = [example for example in originals(train).values() if len(example["gt_classes"]) == 0]
    assert empty, "the generated split should hold an image without objects"
    assert empty[0]["gt_masks"].shape == (0, *empty[0]["image"].shape[:2])
    pipeline = training_pipeline(make_config())
    example = pipeline.preprocess_train(tf.constant(0, tf.int64), next(
        s for path in sorted(tf.io.gfile.glob(train)) for s in tf.data.TFRecordDataset(path)
        if int(decode_example(s)["source_id"]) == int(empty[0]["source_id"])))
    assert (example["gt_classes"].numpy() == -1).all()
    labels = np.concatenate([t.numpy().ravel() for t in example["rpn_score_targets"].values()])
    assert (labels == 1).sum() == 0 and (labels == 0).sum() == 256


def test_a_class_label_outside_num_classes_stops_the_input_naming_the_record_and_the_labels(records):
    train, _, _ = records
    config = make_config()
    config.model.num_classes = 4  # the shapes have classes 1 to 5
    pipeline = training_pipeline(config)
    named = 0
    for path in sorted(tf.io.gfile.glob(train)):
        for serialized in tf.data.TFRecordDataset(path):
            example = decode_example(serialized)
            outside = [str(c) for c, crowd in zip(example["gt_classes"].numpy(), example["gt_is_crowd"].numpy())
                       if c >= 4 and not crowd]  # crowd regions are dropped before the check
            if not outside:
                pipeline.preprocess_train(tf.constant(0, tf.int64), serialized)
                continue
            with pytest.raises(tf.errors.InvalidArgumentError) as raised:
                pipeline.preprocess_train(tf.constant(0, tf.int64), serialized)
            assert record_problem(raised.value) == (
                "--num_classes", f"4, but a training record with source_id {int(example['source_id'])} holds class "
                f"labels {', '.join(outside)}: the labels must be 1 to 3 (0 is the background); --num_classes is the "
                "largest category id plus one")
            named += 1
    assert named >= 2
    assert record_problem(tf.errors.InvalidArgumentError(None, None, "another error")) is None


def test_a_record_without_masks_stops_the_input_of_a_mask_model_naming_it(records):
    train, _, _ = records
    serialized = next(s for s in tf.data.TFRecordDataset(sorted(tf.io.gfile.glob(train))[0])
                      if len(decode_example(s)["gt_classes"]) > 0)
    example = tf.train.Example.FromString(serialized.numpy())
    del example.features.feature["image/object/mask"]  # as the converter writes with --noinclude_masks
    decoded = decode_example(serialized)
    with pytest.raises(tf.errors.InvalidArgumentError) as raised:
        training_pipeline(make_config()).preprocess_train(tf.constant(0, tf.int64), example.SerializeToString())
    assert record_problem(raised.value) == (
        "--data_dir", f"training record with source_id {int(decoded['source_id'])} holds "
        f"{len(decoded['gt_classes'])} objects and 0 masks: a model with a mask head trains on their masks (convert "
        "the records without --noinclude_masks, or train boxes alone: --config_override model.include_mask=false)")
    config = make_config()
    config.model.include_mask = False  # a box model trains on them
    features = training_pipeline(config).preprocess_train(tf.constant(0, tf.int64), example.SerializeToString())
    assert "gt_masks" not in features and int((features["gt_classes"] > 0).numpy().sum()) > 0


def test_a_record_of_more_objects_than_max_num_instances_is_named_once(records, capsys):
    train, _, _ = records
    config = make_config()
    config.data.max_num_instances = 2
    counts = {int(sid): int(np.sum(~example["gt_is_crowd"])) for sid, example in originals(train).items()}
    over = {sid: count for sid, count in counts.items() if count > 2}
    assert over and len(over) < len(counts)
    twice = tf.data.TFRecordDataset(sorted(tf.io.gfile.glob(train))).repeat(2).enumerate()
    for _ in twice.map(training_pipeline(config).preprocess_train):  # in tf.data's graph, as in training
        pass
    warned = [line for line in capsys.readouterr().err.splitlines() if line.startswith("[data] warning")]
    assert sorted(warned) == sorted(
        f"[data] warning: training record with source_id {sid} holds {count} objects, more than "
        f"data.max_num_instances (2): the last {count - 2} are left out of its targets, where they count as "
        f"background (--config_override data.max_num_instances={count} keeps them)" for sid, count in over.items())


def test_input_pipeline_with_fused_anchor_targets_equals_twin(records):
    batches = []
    for mode in ("on", "off"):
        config = make_config(augment=True, seed=11)
        config.runtime.custom_ops = mode
        pipeline = training_pipeline(config, choose_ops(config).rpn_targets)
        assert (pipeline.rpn_targets is fused.rpn_targets) == (mode == "on")
        batches.append(first_batches(pipeline, records[0], 2))
    for got, want in zip(*batches):
        tf.nest.map_structure(np.testing.assert_array_equal, got, want)


def test_evaluation_images_are_the_records_ids_names_and_sizes_in_the_evaluations_order(tmp_path):
    def example(source_id, **features):
        feature = {"image/source_id": tf.train.Feature(bytes_list=tf.train.BytesList(value=[str(source_id).encode()]))}
        for key, value in features.items():
            feature[f"image/{key}"] = (tf.train.Feature(bytes_list=tf.train.BytesList(value=[value.encode()]))
                                       if isinstance(value, str) else
                                       tf.train.Feature(int64_list=tf.train.Int64List(value=[value])))
        return tf.train.Example(features=tf.train.Features(feature=feature)).SerializeToString()

    # Two files, read in sorted order; a record of another converter may lack the file name and the size.
    with tf.io.TFRecordWriter(str(tmp_path / "val-1.tfrecord")) as writer:
        writer.write(example(7))
    with tf.io.TFRecordWriter(str(tmp_path / "val-0.tfrecord")) as writer:
        writer.write(example(5, filename="a.jpg", height=4, width=6))
        writer.write(example(3, filename="b.jpg", height=8, width=2))
    pattern = str(tmp_path / "val-*.tfrecord")
    assert evaluation_images(pattern) == {5: ("a.jpg", 4, 6), 3: ("b.jpg", 8, 2), 7: ("", 0, 0)}
    # The first two that an evaluation reads: the files are interleaved, a record of each.
    assert evaluation_images(pattern, max_records=2) == {5: ("a.jpg", 4, 6), 7: ("", 0, 0)}
    # Another conversion of the same images, which the pattern also matches: each would be evaluated twice.
    shutil.copy(tmp_path / "val-0.tfrecord", tmp_path / "val2017-0.tfrecord")
    pattern = str(tmp_path / "val*.tfrecord")
    with pytest.raises(ValueError, match=re.escape(f"file pattern {pattern!r} matches 2 images more than once (image "
                                                   "id 5 in 2 records): it matches the same images twice")):
        evaluation_images(pattern)
