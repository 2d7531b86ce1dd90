"""`main.py infer`: detections of the newest checkpoint on the validation TFRecords or on photos, as COCO
results and, with --visualize, pictures; `main.py infer --benchmark`: inference throughput and latency.

Images come from the validation TFRecords (at most eval.eval_samples, in file order, ids = COCO image ids)
or, with --input, from an image file, a folder (its image files by IMAGE_EXTENSIONS, not recursive) or a glob
(its image files), in sorted order with ids 1, 2, ... (an unreadable file's id stays unused). Photos are decoded
with PIL, turned upright by their EXIF orientation and made RGB as the converter makes them (`coco_io.to_rgb`:
16-bit gray its high byte, transparency composited over the ImageNet mean colour, which the normalisation maps
to 0 like the padding); then every image is
resized, normalised and padded by `mrcnn_tf2.data.preprocess`, as the input pipeline does. A file that
cannot be read is reported on stderr by name and skipped. With data.pad_to_multiple (the torchvision
presets) a batch holds only images of one padded shape, so an image's detections are those it gets alone.

Outputs in infer.output_dir (default <model_dir>/inference), each written atomically (`mrcnn_tf2.files`);
predictions.json is written last, so that its presence means a complete run:
  images.json        [{id, file_name, height, width}] of the images read (file_name: the --input path,
                     or the record's image id for TFRecords)
  predictions.json   COCO results [{image_id, category_id, bbox [x, y, w, h], score, segmentation (RLE)}]
                     in original-image pixels, masks pasted at 0.5, as `main.py eval` writes them
  <name>.png         with --visualize: the image at its original size, scaled up when small, with its masks,
                     boxes, class names and scores (detections scoring >= infer.visualize_score_threshold;
                     `mrcnn_tf2.evaluation.visualize`); <name> is the file's stem (the image id for
                     TFRecords), with _<id> appended where two images would share a name
Class ids are the category ids (see `coco_metrics`): with --eval_file only its categories are kept.
Names in the pictures come from --label_map (a JSON object {"category id": "name"}), else from
--eval_file's categories, else from <model_dir>/label_map.json (weights/convert_torchvision.py writes COCO's
names there), else are the ids.

Exit status (`mrcnn_tf2.status`): OK when at least one image was processed (failures are on stderr),
BAD_INPUT when none could be, or when the checkpoint, --input or --label_map is unusable.
"""

import glob
import os
import sys
import time

import tensorflow as tf
from PIL import Image

from mrcnn_tf2 import files, status
from mrcnn_tf2.console import say
from mrcnn_tf2.data.decoder import decode_example
from mrcnn_tf2.data.pipeline import InputPipeline, unconverted
from mrcnn_tf2.evaluation import coco_metrics
from mrcnn_tf2.evaluation.visualize import FONT_SIZE, draw_detections, label_font, missing_glyphs
from mrcnn_tf2.runtime.benchmark import report_benchmark
from mrcnn_tf2.runtime.predictor import Photo, Predictor, load_model, pad_batch, predict_function, read_image

PREDICTIONS_FILE = "predictions.json"
IMAGES_FILE = "images.json"
# Extensions of the files a folder or glob --input picks up, any case (a file named directly is read whatever its
# name): the formats PIL reads that photos and datasets come in.
IMAGE_EXTENSIONS = (".jpg", ".jpeg", ".png", ".bmp", ".gif", ".tif", ".tiff", ".webp")


# -- inputs -------------------------------------------------------------------------------------------------


def list_image_files(pattern):
    """Paths --input names, sorted: the file itself, a folder's image files, or a glob's image files (by their
    IMAGE_EXTENSIONS)."""
    if os.path.isfile(pattern):
        return [pattern]
    candidates = [os.path.join(pattern, name) for name in os.listdir(pattern)] if os.path.isdir(pattern) \
        else glob.glob(pattern)
    return sorted(path for path in candidates
                  if os.path.isfile(path) and path.lower().endswith(IMAGE_EXTENSIONS))


def photos_from_files(paths):
    """Yields a Photo per readable file of `paths` (ids 1, 2, ... in order); reports the others on stderr."""
    for image_id, path in enumerate(paths, 1):
        try:
            image = read_image(path)
        # PIL fails in many ways on a damaged or foreign file (OSError, SyntaxError, ValueError,
        # DecompressionBombError...): any failure means this one file is skipped.
        except Exception as err:  # noqa: BLE001
            print(f"[infer] error: cannot read {path}: {err}", file=sys.stderr, flush=True)
            continue
        yield Photo(image_id, path, image)


def photos_from_records(file_pattern, max_images=None):
    """Yields a Photo per record of the TFRecords matching `file_pattern`, in file order (at most max_images)."""
    records = tf.data.TFRecordDataset(sorted(tf.io.gfile.glob(file_pattern)))
    examples = records.map(unconverted(lambda serialized: decode_example(serialized, include_masks=False)),
                           num_parallel_calls=tf.data.AUTOTUNE)
    if max_images is not None:
        examples = examples.take(max_images)
    for example in examples:
        image_id = int(example["source_id"])
        yield Photo(image_id, str(image_id), example["image"].numpy())


# -- pictures -----------------------------------------------------------------------------------------------


def save_picture(path, picture):
    """Writes the [H', W', 3] uint8 `picture` (`visualize.draw_detections`) as PNG to `path`, atomically."""
    with files.atomic_path(path) as temporary:
        Image.fromarray(picture).save(temporary, format="PNG")


def warn_missing_glyphs(names, font, font_path):
    """Warns, in one line, of the class names that `font` (that of `font_path`, None: Pillow's built-in one)
    cannot draw: their pictures would show boxes in place of those characters."""
    lacking = {name: chars for name in names.values() if (chars := missing_glyphs(name, font))}
    if not lacking:
        return
    shown = ", ".join(f"{name!r} ({chars})" for name, chars in list(lacking.items())[:3])
    more = f" and {len(lacking) - 3} more" if len(lacking) > 3 else ""
    font_name = "Pillow's built-in font (ASCII only)" if font_path is None else font_path
    say(f"[infer] warning: {font_name} has no glyph for characters of {len(lacking)} class "
        f"name{'s' if len(lacking) > 1 else ''}: {shown}{more}; "
        "they draw as boxes: --visualize_font FILE names a font that has them (e.g. DejaVuSans.ttf for Latin, "
        "Greek and Cyrillic, NotoSansCJK-Regular.ttc for Chinese, Japanese and Korean)", sys.stderr)


def _picture_name(photo, taken):
    """A PNG file name for `photo` that is not in `taken` (the names given so far and the inputs' own)."""
    stem = os.path.splitext(os.path.basename(photo.name))[0]
    name = f"{stem}.png"
    if name in taken:
        name = f"{stem}_{photo.image_id}.png"
    taken.add(name)
    return name


# -- the runs -----------------------------------------------------------------------------------------------


def _fail(message):
    print(f"[infer] error: {message}", file=sys.stderr)
    return status.BAD_INPUT


def run(config):
    """Entry point of `main.py infer`; returns the exit status."""
    if config.runtime.benchmark:
        return benchmark(config)
    infer = config.infer
    paths = []
    if infer.input is not None:
        paths = list_image_files(infer.input)
        if not paths:
            return _fail(f"--input {infer.input}: no image file there ({', '.join(IMAGE_EXTENSIONS)})")
        photos = photos_from_files(paths)
    else:
        photos = photos_from_records(config.data.resolved_validation_pattern(), config.eval.eval_samples)
    try:
        font = label_font(infer.visualize_font, FONT_SIZE) if infer.visualize else None
    except OSError as err:
        return _fail(f"--visualize_font: {infer.visualize_font} is not a font file Pillow reads ({err})")
    try:
        predictor = Predictor(config=config)
    except ValueError as err:
        return _fail(str(err))
    names = predictor.names
    if font is not None:
        warn_missing_glyphs(names, font, infer.visualize_font)
    output_dir = infer.resolved_output_dir(config.runtime.model_dir)
    os.makedirs(output_dir, exist_ok=True)
    # A previous run's results must not pass for this run's until this run has completed.
    for stale in (PREDICTIONS_FILE, IMAGES_FILE):
        files.remove(os.path.join(output_dir, stale))
    # A picture must not overwrite an input file that lives in output_dir.
    real_output_dir = os.path.realpath(output_dir)
    taken = {os.path.basename(p) for p in paths if os.path.dirname(os.path.realpath(p)) == real_output_dir}
    results, images, dropped = [], [], 0
    started = time.perf_counter()
    for chunk, outputs in predictor.batches(photos):
        chunk_results, chunk_dropped = coco_metrics.convert_detections(outputs, names, predictor.backend.mask_encoder)
        results += chunk_results
        dropped += chunk_dropped
        for b, photo in enumerate(chunk):
            height, width = photo.image.shape[:2]
            images.append({"id": photo.image_id, "file_name": photo.name, "height": height, "width": width})
            if infer.visualize:
                count = int(outputs["num_detections"][b])
                masks = outputs.get("detection_masks")
                picture = draw_detections(
                    photo.image, outputs["detection_boxes"][b, :count], outputs["detection_classes"][b, :count],
                    outputs["detection_scores"][b, :count], None if masks is None else masks[b, :count], names,
                    infer.visualize_score_threshold, infer.visualize_font)
                save_picture(os.path.join(output_dir, _picture_name(photo, taken)), picture)
    coco_metrics.warn_dropped(dropped, names)
    if not images:
        return _fail("no image could be read: nothing was written")
    # In image id order (batches of one padded shape come in another order), each image's detections in theirs.
    images.sort(key=lambda image: image["id"])
    results.sort(key=lambda result: result["image_id"])
    files.write_json(os.path.join(output_dir, IMAGES_FILE), images)
    files.write_json(os.path.join(output_dir, PREDICTIONS_FILE), results)
    failed = len(paths) - len(images) if paths else 0
    print(f"[infer] {len(images)} images, {len(results)} detections in {time.perf_counter() - started:.1f} s "
          f"({predictor.backend.description}): {os.path.join(output_dir, PREDICTIONS_FILE)}"
          + (f"; {failed} unreadable files skipped (see above)" if failed else ""), flush=True)
    return status.OK


def benchmark(config):
    """`main.py infer --benchmark`: times log_warmup_steps + benchmark_steps batches of eval_batch_size.

    A step is the model on one batch, outputs copied to the host; reading the batch is left out. The
    validation TFRecords are read in a loop (--use_synthetic_data: their first batch, repeated). Without a
    checkpoint in model_dir the freshly initialised model is timed (said on stderr).
    """
    runtime, batch_size = config.runtime, config.eval.eval_batch_size
    try:
        loaded = load_model(config, require_checkpoint=False)
    except ValueError as err:
        return _fail(str(err))
    if loaded.checkpoint is None:
        print(f"[infer] no checkpoint in {runtime.model_dir}: timing freshly initialised weights", file=sys.stderr)
    dataset = InputPipeline(config, training=False).dataset(config.data.resolved_validation_pattern(), batch_size)
    dataset = dataset.take(1).cache().repeat() if config.data.use_synthetic_data else dataset.repeat()
    predict = predict_function(loaded.model, runtime.eagerly, fixed_weights=True)
    batches = iter(dataset)
    step_times = []
    for step in range(runtime.log_warmup_steps + runtime.benchmark_steps):
        batch = pad_batch(next(batches), batch_size)
        tic = time.perf_counter()
        {key: value.numpy() for key, value in predict(batch).items()}  # waits for the device
        if step >= runtime.log_warmup_steps:
            step_times.append(time.perf_counter() - tic)
    report_benchmark("inference", step_times, batch_size, loaded.policy)
    return status.OK
