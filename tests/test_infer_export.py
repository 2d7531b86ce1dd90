"""`main.py infer` and `main.py export`: photo decoding (grayscale, 16 bits, alpha, EXIF, arrays), drawing (at
the original size, small images upscaled), label maps, runs on photos with a corrupt file among them and on the
validation TFRecords, the inference benchmark, and the SavedModel: round trip in a fresh process and
`saved_model_cli run`, both equal to in-process inference.

The model is a ResNet-18 at 128x128 with freshly initialised weights saved as a checkpoint: its class
scores are near uniform, so every image gets its full quota of detections to compare and draw.
"""

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import textwrap
import time

import numpy as np
import pytest
import tensorflow as tf
from PIL import Image

import main
from mrcnn_tf2.arguments import parse
from mrcnn_tf2.config import ConfigError
from mrcnn_tf2.data import coco_io
from mrcnn_tf2.data.preprocess import Preprocessor
from mrcnn_tf2.evaluation import visualize
from mrcnn_tf2.model.pretrained import IMAGENET_MEAN
from mrcnn_tf2.runtime import export, infer, predictor
from mrcnn_tf2.runtime.predictor import load_model, predict_batch, predict_function, same_shape_batches
from tests.support import ROOT, SMALL_FLAGS, box_font, detect_traces, file_size_limit, main_py

# EXIF tag of the orientation, and the value meaning "rotate 90 degrees clockwise to view".
EXIF_ORIENTATION, ROTATE_90_CW = 0x0112, 6


def config_for(mode, *flags):
    return parse([mode, *SMALL_FLAGS, *flags])[1]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    """A model_dir holding a checkpoint (step 0) of a freshly initialised model of SMALL_FLAGS."""
    directory = str(tmp_path_factory.mktemp("initial_model"))
    loaded = load_model(config_for("infer", "--model_dir", directory), require_checkpoint=False)
    checkpoint = tf.train.Checkpoint(model=loaded.model, step=tf.Variable(0, dtype=tf.int64))
    tf.train.CheckpointManager(checkpoint, directory, max_to_keep=1).save(checkpoint_number=0)
    return directory


@pytest.fixture(scope="module")
def photo(shapes_records):
    """[h, w, 3] uint8 RGB of a generated validation image (a JPEG on disk)."""
    images_dir = os.path.join(os.path.dirname(os.path.dirname(shapes_records["val_json"])), "val")
    path = os.path.join(images_dir, sorted(os.listdir(images_dir))[1])
    return np.asarray(Image.open(path).convert("RGB"))


def save_with_orientation(image, path, orientation):
    exif = Image.Exif()
    exif[EXIF_ORIENTATION] = orientation
    image.save(path, exif=exif)


# -- reading photos -------------------------------------------------------------------------------------------


def test_read_image_makes_grayscale_rgb_composites_alpha_and_applies_exif(tmp_path, photo):
    rgb = Image.fromarray(photo)
    height, width = photo.shape[:2]

    rgb.convert("L").save(tmp_path / "gray.png")
    gray = predictor.read_image(tmp_path / "gray.png")
    assert gray.shape == (height, width, 3) and gray.dtype == np.uint8
    np.testing.assert_array_equal(gray[..., 0], np.asarray(rgb.convert("L")))
    assert (gray[..., 0] == gray[..., 1]).all() and (gray[..., 1] == gray[..., 2]).all()

    # Left half transparent, right half opaque: transparency becomes the fill, opaque pixels stay.
    rgba = np.concatenate([photo, np.full((height, width, 1), 255, np.uint8)], axis=-1)
    rgba[:, : width // 2, 3] = 0
    Image.fromarray(rgba).save(tmp_path / "rgba.png")
    composited = predictor.read_image(tmp_path / "rgba.png")
    assert (composited[:, : width // 2] == coco_io.TRANSPARENT_FILL).all()
    np.testing.assert_array_equal(composited[:, width // 2:], photo[:, width // 2:])
    Image.fromarray(rgba).convert("LA").save(tmp_path / "la.png")
    assert (predictor.read_image(tmp_path / "la.png")[:, : width // 2] == coco_io.TRANSPARENT_FILL).all()
    palette = rgb.convert("P")
    palette.info["transparency"] = int(np.asarray(palette)[0, 0])  # the top-left pixel's colour
    palette.save(tmp_path / "palette.png")
    assert (predictor.read_image(tmp_path / "palette.png")[0, 0] == coco_io.TRANSPARENT_FILL).all()

    # Orientation 6: the stored pixels are shown rotated 90 degrees clockwise.
    save_with_orientation(rgb, tmp_path / "rotated.png", ROTATE_90_CW)
    np.testing.assert_array_equal(predictor.read_image(tmp_path / "rotated.png"), np.rot90(photo, k=-1))
    save_with_orientation(rgb, tmp_path / "rotated.jpg", ROTATE_90_CW)
    assert predictor.read_image(tmp_path / "rotated.jpg").shape == (width, height, 3)


def test_read_image_takes_16_bit_gray_pil_images_and_arrays_and_refuses_what_it_would_guess(tmp_path, photo):
    # 16-bit gray keeps its high byte (PIL's own convert would clip every pixel to 255), in PNG and TIFF.
    gray = np.asarray(Image.fromarray(photo).convert("L"))
    deep = gray.astype(np.uint16) * 256 + 255  # low bytes that must not round up
    Image.fromarray(deep).save(tmp_path / "deep.png")
    Image.fromarray(deep).save(tmp_path / "deep.tif")
    for name in ("deep.png", "deep.tif"):
        assert Image.open(tmp_path / name).mode == "I;16"
        np.testing.assert_array_equal(predictor.read_image(tmp_path / name), np.stack([gray] * 3, -1))
    # 32-bit integer or float pixels have no 8-bit reading: refused, naming the mode.
    for array, mode in ((deep.astype(np.int32), "I"), (gray.astype(np.float32), "F")):
        Image.fromarray(array).save(tmp_path / f"{mode}.tif")
        with pytest.raises(ValueError, match=f"PIL mode {mode} "):
            predictor.read_image(tmp_path / f"{mode}.tif")

    # A PIL image reads as its file does (EXIF orientation included); arrays of uint8 gray and RGBA as their PNGs.
    save_with_orientation(Image.fromarray(photo), tmp_path / "rotated.png", ROTATE_90_CW)
    with Image.open(tmp_path / "rotated.png") as opened:
        np.testing.assert_array_equal(predictor.read_image(opened), np.rot90(photo, k=-1))
    assert predictor.read_image(photo) is photo
    np.testing.assert_array_equal(predictor.read_image(gray), np.stack([gray] * 3, -1))
    np.testing.assert_array_equal(predictor.read_image(gray[..., None]), np.stack([gray] * 3, -1))
    rgba = np.concatenate([photo, np.zeros(photo.shape[:2] + (1,), np.uint8)], axis=-1)
    assert (predictor.read_image(rgba) == coco_io.TRANSPARENT_FILL).all()
    for array in (photo / 255.0, photo.astype(np.uint16) * 257, photo.transpose(2, 0, 1), photo[:0]):
        with pytest.raises(ValueError, match=re.escape(f"got {array.dtype} of shape {list(array.shape)}")):
            predictor.read_image(array)
    # The fill is the mean the input normalisation subtracts, so that transparent pixels normalise to 0.
    assert coco_io.TRANSPARENT_FILL == tuple(round(v) for v in IMAGENET_MEAN)


def test_list_image_files_takes_a_file_a_folder_or_a_glob(tmp_path):
    for name in ("b.png", "a.JPG", "c.jpeg", "e.tif", "f.WebP", "g.bmp", "notes.txt"):
        (tmp_path / name).write_bytes(b"x")
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "d.png").write_bytes(b"x")
    expected = [str(tmp_path / name) for name in ("a.JPG", "b.png", "c.jpeg", "e.tif", "f.WebP", "g.bmp")]
    assert infer.list_image_files(str(tmp_path)) == expected  # not recursive, images only
    assert infer.list_image_files(str(tmp_path / "*")) == expected
    assert infer.list_image_files(str(tmp_path / "notes.txt")) == [str(tmp_path / "notes.txt")]  # named: read
    assert infer.list_image_files(str(tmp_path / "none-*.png")) == []


# -- class names and drawing ----------------------------------------------------------------------------------


def test_label_map_names_the_classes_and_bad_files_name_themselves(tmp_path, shapes_records):
    label_map = tmp_path / "labels.json"
    label_map.write_text(json.dumps({"1": "disc", "3": "tri"}))
    config = config_for("infer", "--label_map", str(label_map))
    assert predictor.category_names(config) == {1: "disc", 2: "2", 3: "tri", 4: "4", 5: "5"}
    # With --eval_file: its categories only, its names where the label map has none.
    with open(shapes_records["val_json"]) as f:
        categories = {c["id"]: c["name"] for c in json.load(f)["categories"]}
    config = config_for("infer", "--label_map", str(label_map), "--eval_file", shapes_records["val_json"])
    assert predictor.category_names(config) == {**categories, 1: "disc", 3: "tri"}
    for content in ("[1, 2]", '{"one": "disc"}', '{"0": "background"}', "{not json"):
        label_map.write_text(content)
        with pytest.raises(ValueError, match=f"--label_map {label_map}"):
            predictor.category_names(config_for("infer", "--label_map", str(label_map)))


def test_names_fall_back_to_the_model_directorys_label_map_after_the_flags(tmp_path, shapes_records):
    (tmp_path / predictor.LABEL_MAP_FILE).write_text(json.dumps({"1": "saved disc", "3": "saved tri"}))
    config = config_for("infer", "--model_dir", str(tmp_path))
    assert predictor.category_names(config) == {1: "saved disc", 2: "2", 3: "saved tri", 4: "4", 5: "5"}
    # --label_map wins; so do --eval_file's categories.
    flag_map = tmp_path / "labels.json"
    flag_map.write_text(json.dumps({"1": "disc"}))
    config = config_for("infer", "--model_dir", str(tmp_path), "--label_map", str(flag_map))
    assert predictor.category_names(config) == {1: "disc", 2: "2", 3: "3", 4: "4", 5: "5"}
    with open(shapes_records["val_json"]) as f:
        categories = {c["id"]: c["name"] for c in json.load(f)["categories"]}
    config = config_for("infer", "--model_dir", str(tmp_path), "--eval_file", shapes_records["val_json"])
    assert predictor.category_names(config) == categories


def test_drawing_changes_the_image_where_objects_are_and_only_above_the_threshold():
    image = np.full((80, 100, 3), 90, np.uint8)
    boxes = np.array([[20, 30, 60, 70], [5, 5, 15, 15]], np.float32)
    masks = np.zeros((2, 28, 28), np.float32)
    masks[0, 7:21, 7:21] = 0.9  # the middle half of the first box
    masks[1] = 1.0
    drawn = visualize.draw_detections(image, boxes, np.array([1, 2]), np.array([0.9, 0.2]), masks,
                                      {1: "disc"}, score_threshold=0.5)
    # Upscaled so that the shorter side is MIN_DRAWN_SIDE: 6.4x; the regions below are in pixels of `image`.
    k = visualize.MIN_DRAWN_SIDE / 80
    assert drawn.shape == (512, 640, 3) and drawn.dtype == np.uint8

    def at(rows, cols):
        return (slice(int(rows.start * k), int(rows.stop * k)), slice(int(cols.start * k), int(cols.stop * k)))

    changed = np.any(drawn != 90, axis=-1)  # the upscaled uniform image is uniform
    assert changed[at(slice(35, 45), slice(45, 55))].all()  # the mask's centre
    assert changed[int(20 * k):int(60 * k), int(30 * k)].any()  # the box outline
    assert changed[int(60 * k) - 1, int(30 * k):int(70 * k)].any()
    assert changed[at(slice(5, 20), slice(30, 60))].any()  # the label above the box
    assert not changed[int(65 * k):, :].any() and not changed[int(25 * k):, int(80 * k):].any()  # far from it all
    assert not changed[at(slice(8, 13), slice(8, 13))].any()  # the second detection scores below the threshold
    # Without masks only the outline and label are drawn: the box's centre stays as it was.
    boxes_only = visualize.draw_detections(image, boxes, np.array([1, 2]), np.array([0.9, 0.2]), None, {}, 0.5)
    assert (boxes_only[at(slice(35, 45), slice(45, 55))] == 90).all() and (boxes_only != 90).any()


@pytest.mark.parametrize("height, width, drawn", [
    (128, 128, (512, 512)),  # the demo's images: 4x
    (100, 150, (512, 768)),  # the shorter side reaches the minimum, the aspect ratio is kept
    (700, 300, (1195, 512)),
    (600, 900, (600, 900)),  # large enough: the original size
    (100, 1600, (256, 4096)),  # upscaled until the longer side reaches MAX_UPSCALED_SIDE
    (1, 3000, (1, 4096)),  # a strip: at 512x, 512 x 1.5 million pixels
    (5000, 2, (5000, 2)),  # already longer than MAX_UPSCALED_SIDE: the original size
])
def test_pictures_are_drawn_at_the_original_size_or_upscaled_to_the_minimum_side(height, width, drawn):
    image = np.full((height, width, 3), 90, np.uint8)
    picture = visualize.draw_detections(image, np.zeros((0, 4)), np.zeros(0), np.zeros(0), None, {}, 0.5)
    assert picture.shape == (*drawn, 3) == (*visualize.drawn_size(height, width), 3)
    assert (picture == 90).all()


def box_outline_columns(picture, row, background=90):
    """The columns of `row` that differ from the background."""
    return np.flatnonzero(np.any(picture[row] != background, axis=-1))


@pytest.mark.parametrize("side, scale", [(128, 4), (1024, 1)])
def test_boxes_land_where_the_objects_are_and_lines_scale_with_the_picture(side, scale):
    # A box [ymin, xmin, ymax, xmax] in pixels of the image; the picture is `scale` times larger.
    box = np.array([[side * 0.25, side * 0.125, side * 0.75, side * 0.625]], np.float32)
    image = np.full((side, side, 3), 90, np.uint8)
    picture = visualize.draw_detections(image, box, np.array([1]), np.array([0.9]), None, {}, 0.5)
    assert picture.shape == (side * scale, side * scale, 3)
    ymin, xmin, ymax, xmax = (box[0] * scale).astype(int)
    # Halfway down the box, only its left and right edges are drawn, each line_width pixels wide inwards.
    line_width = visualize.BOX_WIDTH * max(1, side * scale // visualize.MIN_DRAWN_SIDE)
    columns = box_outline_columns(picture, (ymin + ymax) // 2)
    expected = list(range(xmin, xmin + line_width)) + list(range(xmax - line_width + 1, xmax + 1))
    assert columns.tolist() == expected
    # The top edge lies on ymin, the label just above it (its glyphs about 0.7 of the font size tall, scaled
    # with the picture), nothing below the box.
    assert np.all(picture[ymin:ymin + line_width, xmin + 100:xmax] != 90)
    label_rows = np.flatnonzero(np.any(picture[:ymin, xmin:xmax] != 90, axis=(1, 2)))
    font_size = visualize.FONT_SIZE * side * scale / visualize.MIN_DRAWN_SIDE
    assert len(label_rows) and font_size * 0.4 <= ymin - label_rows.min() <= font_size
    assert not np.any(picture[ymax + 1:] != 90)


# -- main.py infer --------------------------------------------------------------------------------------------


@pytest.fixture
def photo_folder(tmp_path, photo):
    """Photos of the kinds users have, and one corrupt JPEG among them."""
    folder = tmp_path / "photos"
    folder.mkdir()
    rgb = Image.fromarray(photo)
    rgb.save(folder / "colour.jpg")
    rgb.convert("L").save(folder / "gray.png")
    rgb.convert("RGBA").save(folder / "alpha.png")
    save_with_orientation(rgb, folder / "rotated.jpg", ROTATE_90_CW)
    (folder / "corrupt.jpg").write_bytes(b"\xff\xd8\xff\xe0 this is not a JPEG")
    return folder


def test_infer_on_photos_skips_a_corrupt_file_and_writes_predictions_and_pictures(
        tmp_path, model_dir, photo_folder, photo, capsys):
    output_dir = tmp_path / "out"
    font = box_font(tmp_path / "boxes.ttf", "abcdefghijklmnopqrstuvwxyz0123456789.é")
    (tmp_path / "labels.json").write_text(json.dumps({"1": "étoile", "2": "круг", "3": "disc"}), encoding="utf-8")
    status = main.main(["infer", *SMALL_FLAGS, "--model_dir", model_dir, "--input", str(photo_folder),
                        "--output_dir", str(output_dir), "--visualize", "--visualize_score_threshold", "0",
                        "--label_map", str(tmp_path / "labels.json"), "--visualize_font", font])
    captured = capsys.readouterr()
    assert status == 0, captured.err
    assert f"cannot read {photo_folder / 'corrupt.jpg'}" in captured.err
    assert (f"[infer] warning: {font} has no glyph for characters of 1 class name: 'круг' (круг); they draw as "
            "boxes: --visualize_font FILE names a font that has them") in captured.err
    assert "1 unreadable files skipped" in captured.out
    with open(output_dir / "images.json") as f:
        images = {os.path.basename(image["file_name"]): image for image in json.load(f)}
    height, width = photo.shape[:2]
    assert set(images) == {"alpha.png", "colour.jpg", "gray.png", "rotated.jpg"}
    assert (images["rotated.jpg"]["height"], images["rotated.jpg"]["width"]) == (width, height)  # upright
    with open(output_dir / "predictions.json") as f:
        predictions = json.load(f)
    ids = {image["id"]: image for image in images.values()}
    assert {p["image_id"] for p in predictions} == set(ids)  # every image has detections
    for p in predictions:
        image = ids[p["image_id"]]
        assert p["segmentation"]["size"] == [image["height"], image["width"]]
        assert 1 <= p["category_id"] <= 5 and 0 <= p["score"] <= 1
    for name in images:
        picture = np.asarray(Image.open(output_dir / (os.path.splitext(name)[0] + ".png")))
        # At the original size, upscaled to a legible size (the generated photos are small).
        assert picture.shape == (*visualize.drawn_size(images[name]["height"], images[name]["width"]), 3)
        assert min(picture.shape[:2]) == visualize.MIN_DRAWN_SIDE
    original = Image.open(photo_folder / "colour.jpg").convert("RGB")
    assert (np.asarray(Image.open(output_dir / "colour.png")) != np.asarray(
        original.resize(visualize.drawn_size(height, width)[::-1], Image.Resampling.BILINEAR))).any()
    assert not [name for name in os.listdir(output_dir) if ".tmp" in name]


def test_labels_are_drawn_in_the_font_given_and_the_characters_a_font_lacks_are_found(tmp_path):
    font = box_font(tmp_path / "boxes.ttf", "abcdefghijklmnopqrstuvwxyz0123456789.é")
    builtin, boxes = visualize.label_font(None, 16), visualize.label_font(font, 16)
    assert visualize.missing_glyphs("étoile 0.90", builtin) == "é"  # Pillow's font: ASCII only
    assert visualize.missing_glyphs("étoile 0.90", boxes) == ""
    assert visualize.missing_glyphs("круг и 狗 Z", boxes) == "круги狗Z"  # each once, in order
    image = np.full((64, 64, 3), 255, np.uint8)
    ink = {}
    for path in (None, font):
        picture = visualize.draw_detections(image, np.array([[40.0, 8.0, 60.0, 56.0]]), np.array([1]),
                                            np.array([0.9]), None, {1: "étoile"}, 0.5, path)
        ink[path] = int((picture[:40 * 8] == 0).all(axis=-1).sum())  # the black text above the box
    assert ink[font] > 3 * ink[None] > 0  # solid boxes for letters: the font given drew the label


def test_infer_exits_2_when_no_image_can_be_read(tmp_path, model_dir, photo_folder, capsys):
    output_dir = tmp_path / "out"
    status = main.main(["infer", *SMALL_FLAGS, "--model_dir", model_dir, "--input",
                        str(photo_folder / "corrupt.jpg"), "--output_dir", str(output_dir)])
    err = capsys.readouterr().err
    assert status == 2 and "corrupt.jpg" in err and "no image could be read" in err
    assert not (output_dir / "predictions.json").exists()
    assert main.main(["infer", *SMALL_FLAGS, "--model_dir", model_dir, "--input", str(tmp_path / "none")]) == 2
    assert "--input" in capsys.readouterr().err


def test_infer_on_validation_records_uses_their_image_ids(tmp_path, model_dir, shapes_records, capsys):
    status = main.main(["infer", *SMALL_FLAGS, "--model_dir", model_dir, "--data_dir", shapes_records["data_dir"],
                        "--eval_file", shapes_records["val_json"], "--eval_samples", "3"])
    assert status == 0, capsys.readouterr().err
    output_dir = os.path.join(model_dir, "inference")  # the default
    with open(os.path.join(output_dir, "images.json")) as f:
        images = json.load(f)
    val = sorted(shapes_records["annotations"]["val"]["images"], key=lambda image: image["id"])
    assert [(i["id"], i["height"], i["width"]) for i in images] == [(i["id"], i["height"], i["width"])
                                                                      for i in val[:3]]
    with open(os.path.join(output_dir, "predictions.json")) as f:
        assert {p["image_id"] for p in json.load(f)} <= {i["id"] for i in val[:3]}


def test_infer_benchmark_prints_throughput_and_latency(shapes_records, capsys):
    status = main.main(["infer", *SMALL_FLAGS, "--benchmark", "--use_synthetic_data", "--benchmark_steps", "3",
                        "--data_dir", shapes_records["data_dir"], "--model_dir", "/nonexistent/model_dir"])
    captured = capsys.readouterr()
    assert status == 0, captured.err
    assert "freshly initialised" in captured.err
    lines = captured.out.splitlines()
    throughput = [line for line in lines if line.startswith("inference throughput:")]
    assert len(throughput) == 1 and throughput[0].endswith(" img/s")
    record = json.loads(next(line for line in lines if line.startswith('{"benchmark"')))
    assert record["benchmark"] == "inference" and record["steps"] == 3 and record["batch_size"] == 2
    assert float(throughput[0].split()[2]) == pytest.approx(record["throughput_img_per_s"], rel=1e-3)
    latency = record["latency_s"]
    assert 0 < latency["p50"] <= latency["p90"] <= latency["p95"] <= latency["p99"]


# -- main.py export -------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def exported(model_dir, tmp_path_factory):
    """The SavedModel's export directory for the round-trip tests, written with two traces of the model: the
    canvas's static shape (serving_default and serving_bytes share it) and serving_preprocessed's any shape."""
    export_dir = str(tmp_path_factory.mktemp("export") / "saved_model")
    with detect_traces() as traces:
        assert export.run(config_for("export", "--model_dir", model_dir, "--export_dir", export_dir)) == 0
    assert len(traces) == 2
    return export_dir


@pytest.fixture(scope="module")
def in_process(model_dir, photo):
    """In-process inference (as `main.py infer` runs it) on `photo`, with the pure-TF ops the export uses."""
    config = config_for("infer", "--model_dir", model_dir, "--custom_ops", "off")
    predict = predict_function(load_model(config).model, fixed_weights=True)
    ((_, batch),) = predictor.photo_batches([predictor.Photo(1, "photo", photo)], Preprocessor(config.data), 1)
    return predict_batch(predict, batch, config.eval.eval_batch_size)


OUTPUT_KEYS = ("detection_boxes", "detection_scores", "detection_classes", "detection_masks", "num_detections",
               "image_info")


def assert_same_detections(outputs, expected):
    assert int(expected["num_detections"][0]) > 0  # there is something to compare
    for key in OUTPUT_KEYS:
        np.testing.assert_allclose(outputs[key], expected[key], rtol=1e-4, atol=1e-4, err_msg=key)


def test_a_loaded_model_predicts_on_its_checkpoints_weights_and_training_evaluation_on_the_current_ones(
        model_dir, photo):
    """load_model's predict function (fixed_weights) prepares the convs' kernels from the checkpoint's weights
    when traced and keeps them; the one a model in training is evaluated with (ModelBackend's default, as
    TrainingEvaluator makes it) reads the weights in every call."""
    config = config_for("infer", "--model_dir", model_dir)
    loaded = load_model(config)
    fixed = predict_function(loaded.model, fixed_weights=True)
    training = predictor.ModelBackend(loaded.model, config, loaded.ops.mask_encoder, "the model in training").predict
    ((_, batch),) = predictor.photo_batches([predictor.Photo(1, "photo", photo)], Preprocessor(config.data), 1)
    before = predict_batch(fixed, batch, config.eval.eval_batch_size)
    assert_same_detections(predict_batch(training, batch, config.eval.eval_batch_size), before)
    for variable in loaded.model.backbone.trainable_variables:  # every conv's kernel and batch norm
        variable.assign(variable * 1.5)
    for key, value in predict_batch(fixed, batch, config.eval.eval_batch_size).items():
        np.testing.assert_array_equal(value, before[key], err_msg=key)
    changed = predict_batch(training, batch, config.eval.eval_batch_size)
    assert not np.allclose(changed["detection_scores"], before["detection_scores"], rtol=1e-3, atol=1e-3)


# Runs in a fresh interpreter that imports TensorFlow only: neither this package nor its op library.
FRESH_PROCESS = textwrap.dedent("""
    import sys
    import numpy as np
    import tensorflow as tf
    export_dir, image_path, png_path, out_path = sys.argv[1:]
    loaded = tf.saved_model.load(export_dir)
    image = np.load(image_path)
    outputs = {"images": loaded.signatures["serving_default"](images=tf.constant(image)),
               "bytes": loaded.signatures["serving_bytes"](
                   image_bytes=tf.constant([open(png_path, "rb").read()] * 2))}
    np.savez(out_path, **{f"{kind}/{key}": value.numpy() for kind, result in outputs.items()
                          for key, value in result.items()})
    # Loading would have failed on an op that stock TensorFlow lacks; the package was never imported.
    assert not [name for name in sys.modules if name.startswith("mrcnn_tf2")]
""")


# The two tests of the module's export on one worker: it and the in-process detections are made once.
@pytest.mark.xdist_group("saved_model")
@pytest.mark.timeout(300)  # exports, then two fresh processes load the SavedModel
@pytest.mark.onednn  # the exported graph holds the batch-of-one routes that oneDNN takes
def test_saved_model_runs_in_a_fresh_process_and_equals_in_process_inference(tmp_path, exported, in_process, photo):
    np.save(tmp_path / "image.npy", photo[None])
    Image.fromarray(photo).save(tmp_path / "image.png")  # lossless: the same pixels after decoding
    result = subprocess.run([sys.executable, "-c", FRESH_PROCESS, exported, str(tmp_path / "image.npy"),
                             str(tmp_path / "image.png"), str(tmp_path / "out.npz")],
                            capture_output=True, text=True, timeout=300, cwd=str(tmp_path))
    assert result.returncode == 0, result.stderr[-3000:]
    outputs = np.load(tmp_path / "out.npz")
    assert_same_detections({key: outputs[f"images/{key}"] for key in OUTPUT_KEYS}, in_process)
    for index in range(2):  # a batch of two encoded images: each equals the uint8 path
        assert_same_detections({key: outputs[f"bytes/{key}"][index:index + 1] for key in OUTPUT_KEYS}, in_process)


@pytest.mark.xdist_group("saved_model")
def test_saved_model_cli_runs_the_serving_signature(tmp_path, exported, in_process, photo):
    np.save(tmp_path / "image.npy", photo[None])
    cli = shutil.which("saved_model_cli", path=os.path.dirname(sys.executable))
    assert cli, f"saved_model_cli is not installed next to {sys.executable}"
    result = subprocess.run([cli, "run", "--dir", exported, "--tag_set", "serve", "--signature_def",
                             "serving_default", "--inputs", f"images={tmp_path / 'image.npy'}",
                             "--outdir", str(tmp_path / "cli")], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    assert_same_detections({key: np.load(tmp_path / "cli" / f"{key}.npy") for key in OUTPUT_KEYS}, in_process)


def test_export_replaces_only_an_earlier_export_and_refuses_any_other_directory(model_dir, exported, tmp_path,
                                                                                  capsys):
    export.check_export_dir(str(tmp_path / "new"))  # new, empty, or an earlier export: taken
    (tmp_path / "empty").mkdir()
    export.check_export_dir(str(tmp_path / "empty"))
    export.check_export_dir(exported)
    # The model directory itself, a folder holding it, or a file: refused before the model loads, nothing lost
    # (a copy of the model directory, so that a regression deletes nothing that other tests read).
    runs = tmp_path / "runs"
    shutil.copytree(model_dir, runs / "model")
    model = str(runs / "model")
    (tmp_path / "notes.txt").write_text("mine")
    before = sorted(os.listdir(model))
    for target, problem in ((model, "exists and is not an earlier export"),
                            (str(runs), "exists and is not an earlier export"),
                            (str(tmp_path / "notes.txt"), "is a file, not a directory")):
        assert export.run(config_for("export", "--model_dir", model, "--export_dir", target)) == 2
        assert f"[export] error: --export_dir: {target} {problem}" in capsys.readouterr().err
    assert sorted(os.listdir(model)) == before and (tmp_path / "notes.txt").read_text() == "mine"
    # An export's artefacts without its config.json are not taken for an export.
    shutil.copytree(exported, tmp_path / "artefacts", ignore=shutil.ignore_patterns("config.json"))
    with pytest.raises(ConfigError, match="is not an earlier export"):
        export.check_export_dir(str(tmp_path / "artefacts"))


# Budget: an export process (the small model) stopped once its temporary directory appears.
@pytest.mark.timeout(360)
@pytest.mark.slow
def test_an_export_stopped_by_sigterm_removes_its_temporary_directory(model_dir, tmp_path):
    export_dir = tmp_path / "export"
    process = subprocess.Popen(main_py("export", "--model_dir", model_dir, "--export_dir", export_dir, *SMALL_FLAGS),
                               cwd=ROOT,
                               stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    start = time.time()
    while not list(tmp_path.glob("export.tmp-*")):
        assert process.poll() is None and time.time() < start + 240, \
            f"exit status {process.poll()} after {time.time() - start:.1f} s, before the temporary directory " \
            f"appeared: {process.stderr.read()[-3000:]}"
        time.sleep(0.05)
    signalled = time.time()
    process.send_signal(signal.SIGTERM)
    err = process.communicate(timeout=120)[1]  # a signal TensorFlow swallowed waits for the commit
    assert process.returncode == 128 + signal.SIGTERM, \
        f"exit status {process.returncode}, signalled {signalled - start:.1f} s after the start and ended " \
        f"{time.time() - signalled:.1f} s later: {err[-3000:]}"
    assert err.splitlines()[-1] == "main.py: stopped by SIGTERM"
    assert os.listdir(tmp_path) == []  # neither the export nor its temporary directory


def test_an_export_that_fills_the_disk_is_one_line_and_leaves_nothing(model_dir, tmp_path, capsys):
    export_dir = tmp_path / "export"
    with file_size_limit(1 << 20):  # the SavedModel's variables are larger
        assert main.main(["export", "--model_dir", model_dir, "--export_dir", str(export_dir), *SMALL_FLAGS]) == 1
    assert re.fullmatch(rf"main.py: error: a file could not be written \(File too large: {export_dir}.tmp-\d+/\S+\)",
                        capsys.readouterr().err.splitlines()[-1])
    assert os.listdir(tmp_path) == []


def test_export_without_a_checkpoint_exits_2_and_writes_nothing(tmp_path, capsys):
    status = export.run(config_for("export", "--model_dir", str(tmp_path / "untrained")))
    assert status == 2 and "no checkpoint" in capsys.readouterr().err
    assert not (tmp_path / "untrained").exists()


# -- batches padded to their own size (data.pad_to_multiple, the torchvision presets) ------------------------

# Shorter side 96, longer at most 128, batches padded to a multiple of 32: photos of other shapes pad differently.
OWN_SIZE_FLAGS = ["--config_override", "data.pad_to_multiple=32", "--config_override", "data.resize_min_size=96",
                  "--config_override", "data.resize_max_size=128"]


@pytest.fixture(scope="module")
def mixed_photos(photo, tmp_path_factory):
    """A folder of PNGs of three padded shapes: landscape, portrait (turned) and square, then landscape again."""
    folder = tmp_path_factory.mktemp("mixed_photos")
    height, width = photo.shape[:2]
    wide = np.asarray(Image.fromarray(photo).resize((150, 100)))
    shapes = [wide, np.rot90(wide).copy(), photo[:min(height, width), :min(height, width)], wide[:, ::-1].copy()]
    for i, image in enumerate(shapes):
        Image.fromarray(image).save(folder / f"photo_{i}.png")
    return str(folder)


def test_same_shape_batches_group_by_shape_keep_order_and_bound_what_waits():
    items = ["a1", "b1", "a2", "c1", "b2", "a3", "c2"]
    shape = lambda item: item[0]  # noqa: E731
    assert list(same_shape_batches(items, 2, shape, held=4)) == [["a1", "a2"], ["b1", "b2"], ["c1", "c2"], ["a3"]]
    # At most held x batch_size wait: then the largest group leaves, partial.
    assert list(same_shape_batches(["a1", "b1", "c1", "a2", "b2"], 4, shape, held=1)) == [["a1", "a2"], ["b1", "b2"],
                                                                                          ["c1"]]
    assert list(same_shape_batches(["a1", "a2", "a3"], 2, shape)) == [["a1", "a2"], ["a3"]]  # one shape: in order


def test_with_batches_padded_to_their_own_size_a_photos_detections_do_not_depend_on_its_batch_mates(
        tmp_path, model_dir, mixed_photos):
    predictions = {}
    for batch_size in (4, 1):
        output_dir = tmp_path / f"batch{batch_size}"
        assert main.main(["infer", *SMALL_FLAGS, *OWN_SIZE_FLAGS, "--model_dir", model_dir, "--input", mixed_photos,
                          "--eval_batch_size", str(batch_size), "--output_dir", str(output_dir)]) == 0
        predictions[batch_size] = json.loads((output_dir / infer.PREDICTIONS_FILE).read_text())
    together, alone = predictions[4], predictions[1]
    assert [r["image_id"] for r in together] == [r["image_id"] for r in alone]
    assert {r["image_id"] for r in alone} == {1, 2, 3, 4} and len(alone) == 4 * 10  # the full quota each
    for mine, theirs in zip(together, alone):
        assert mine["category_id"] == theirs["category_id"]
        # A batch of 4 and a batch of 1 block the convolutions' sums differently, so float32 rounds them apart:
        # a few 1e-6 of a box's coordinates (tens to hundreds of pixels), more than an absolute 1e-4 alone allows.
        np.testing.assert_allclose(mine["bbox"] + [mine["score"]], theirs["bbox"] + [theirs["score"]],
                                   rtol=1e-5, atol=1e-4)


def test_loading_traces_the_one_function_that_batches_of_every_padded_size_take(model_dir):
    """load_model traces evaluation's function without running it; batches padded to their own size, of any
    height and width, all take that trace."""
    loaded = load_model(config_for("infer", *OWN_SIZE_FLAGS, "--model_dir", model_dir, "--eval_batch_size", "1"))
    predict = predict_function(loaded.model, fixed_weights=True)
    assert predict.experimental_get_tracing_count() == 1
    for height, width in ((64, 96), (96, 64), (128, 128)):
        outputs = predict_batch(predict, {"images": tf.zeros([1, height, width, 3]),
                                          "image_info": tf.constant([[height, width, 1.0, height, width]]),
                                          "source_ids": tf.constant([7], tf.int64)})
        assert outputs["source_ids"].tolist() == [7]
    assert predict.experimental_get_tracing_count() == 1


@pytest.mark.timeout(300)  # exports and loads a SavedModel
def test_serving_bytes_runs_each_image_alone_when_batches_pad_to_their_own_size(tmp_path, model_dir, mixed_photos):
    export_dir = str(tmp_path / "saved_model")
    assert export.run(config_for("export", *OWN_SIZE_FLAGS, "--model_dir", model_dir, "--export_dir", export_dir)) == 0
    serve = tf.saved_model.load(export_dir).signatures["serving_bytes"]
    encoded = [open(os.path.join(mixed_photos, f"photo_{i}.png"), "rb").read() for i in range(3)]
    together = serve(image_bytes=tf.constant(encoded))
    for i, image in enumerate(encoded):
        alone = serve(image_bytes=tf.constant([image]))
        assert_same_detections({key: together[key].numpy()[i:i + 1] for key in OUTPUT_KEYS},
                               {key: alone[key].numpy() for key in OUTPUT_KEYS})
