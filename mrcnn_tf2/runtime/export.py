"""`main.py export`: the newest checkpoint in model_dir as a SavedModel for serving without this package, and as
graphs for other runtimes (`--format`, `mrcnn_tf2.runtime.deploy`), all in one directory with the run's
config.json (and label_map.json when the model directory has one).

The SavedModel's signatures (a batch of B images per call, any B >= 1):
  serving_default(images: uint8 [B, H, W, 3])   RGB images of any one size H x W per call
  serving_bytes(image_bytes: string [B])        encoded JPEG / PNG / BMP / GIF (first frame), any sizes;
                                                gray and alpha made RGB as `main.py infer` makes them
                                                (`preprocess.flatten`), EXIF is ignored;
                                                with data.pad_to_multiple each image is run alone, padded
                                                to its own size, so its detections do not depend on the others
  serving_preprocessed(images: float32 [B, H, W, 3], image_info: float32 [B, 5])
                                                images preprocessed as `main.py infer` does (one padded
                                                size per call); each run alone as serving_bytes does
Each image is resized, normalised and padded to data.image_size by `mrcnn_tf2.data.preprocess`, as the
input pipeline and `main.py infer` do, so the outputs equal `main.py infer`'s on the same pixels:
  detection_boxes   [B, D, 4] float32 [ymin, xmin, ymax, xmax] in pixels of the original image
  detection_scores  [B, D] float32, detection_classes [B, D] int32 (category ids, 0 in empty slots)
  detection_masks   [B, D, R, R] float32 mask probabilities inside each box (paste them at 0.5 for
                    image masks, as `mrcnn_tf2.ops.masks.paste_masks` does); only with the mask branch
  num_detections    [B] int32: slots past it are padding
  image_info        [B, 5] float32 [scaled_h, scaled_w, 1 / scale, original_h, original_w]
D = model.test.test_detections_per_image, R = model.mrcnn_resolution.

The model is built for export (`factory.choose_ops(config, export=True)`: the pure-TF ops, whatever
--custom_ops says): the SavedModel loads in any TensorFlow process, without this package or its custom-op
library. The directory is written atomically (`mrcnn_tf2.files.atomic_path`): an export_dir that exists is
complete.
"""

import glob
import os
import shutil
import sys

import tensorflow as tf

from mrcnn_tf2 import files, status
from mrcnn_tf2.data import preprocess
from mrcnn_tf2.config import ConfigError, exported_files
from mrcnn_tf2.runtime import deploy, infer, predictor
from mrcnn_tf2.runtime.predictor import LABEL_MAP_FILE, load_model

SIGNATURES = ("serving_default", "serving_bytes", "serving_preprocessed")


class ServingModule(tf.Module):
    """The model with its preprocessing, as the tf.functions the SavedModel signatures are made of."""

    def __init__(self, model, preprocessor):
        """model: a built MaskRCNN (pure-TF ops); preprocessor: the run's `preprocess.Preprocessor`."""
        super().__init__()
        # The SavedModel tracks the model's weights as a flat list of their tf.Variables, which is all its
        # functions need: the Keras object graph itself cannot be saved (int-keyed dicts of FPN levels).
        self.model_variables = [variable.value for variable in model.variables]
        self._detect_batch = model.detect  # a bound method: not tracked
        self.preprocessor = preprocessor
        # The traces that more than one signature calls, made once: each costs seconds, and a tf.function called
        # inside another's trace is traced again there, a concrete function is not. serve_images and serve_bytes
        # detect on the canvas.
        detect = tf.function(self._detect, autograph=False)
        self._detect_canvas = detect.get_concrete_function(
            tf.TensorSpec([None, *preprocessor.image_size, 3], tf.float32), tf.TensorSpec([None, 5], tf.float32))
        if preprocessor.pad_to_multiple is not None:
            # One image of any size, which serve_preprocessed's and serve_bytes's loops call.
            self._detect_alone = detect.get_concrete_function(
                tf.TensorSpec([1, None, None, 3], tf.float32), tf.TensorSpec([1, 5], tf.float32))
            # What it gives for one image, without its batch axis: the signature of `_detect_each`.
            self._one_image = tf.nest.map_structure(lambda t: tf.TensorSpec(t.shape[1:], t.dtype),
                                                    self._detect_alone.structured_outputs)

    def _preprocess(self, image):
        """[h, w, 3] uint8 -> ([H, W, 3] float32 normalised and padded to the canvas, [5] float32 image_info);
        `_detect` cuts the batch to its own size when the run pads batches so."""
        padded, image_info, _ = self.preprocessor.training_example(image)
        return padded, image_info

    def _detect(self, images, image_info):
        images = self.preprocessor.pad_batch(images, image_info)
        detections = self._detect_batch({"images": images, "image_info": image_info})
        return {**detections, "image_info": image_info}

    def _detect_each(self, images, image_info, detect):
        """`_detect` of each image alone, padded to its own size, stacked: images of different sizes get the
        detections they get alone (with data.pad_to_multiple, a batch is otherwise padded to its largest). `detect`
        (`_detect` or a trace of it for the inputs' shape) takes the batch whole when the run pads to the canvas."""
        if self.preprocessor.pad_to_multiple is None:
            return detect(images, image_info)  # the canvas: every image padded alike
        return tf.map_fn(lambda pair: tf.nest.map_structure(lambda t: t[0],
                                                            self._detect_alone(pair[0][None], pair[1][None])),
                         (images, image_info), fn_output_signature=self._one_image)

    def _preprocess_each(self, function, inputs):
        """`function` (-> `_preprocess`'s pair) on each of the B `inputs`: ([B, H, W, 3], [B, 5]) float32."""
        height, width = self.preprocessor.image_size
        signature = (tf.TensorSpec([height, width, 3], tf.float32), tf.TensorSpec([5], tf.float32))
        return tf.map_fn(function, inputs, fn_output_signature=signature)

    @tf.function(input_signature=[tf.TensorSpec([None, None, None, 3], tf.uint8, name="images")], autograph=False)
    def serve_images(self, images):
        """uint8 [B, H, W, 3] RGB -> the detection dict (module docstring)."""
        return self._detect_canvas(*self._preprocess_each(self._preprocess, images))

    @tf.function(input_signature=[tf.TensorSpec([None, None, None, 3], tf.float32, name="images"),
                                  tf.TensorSpec([None, 5], tf.float32, name="image_info")], autograph=False)
    def serve_preprocessed(self, images, image_info):
        """float32 [B, H, W, 3] images preprocessed as `main.py infer` does, [B, 5] image_info -> the detection
        dict (module docstring): the signature `mrcnn_tf2.runtime.predictor.Predictor` calls."""
        return self._detect_each(images, image_info, self._detect)

    @tf.function(input_signature=[tf.TensorSpec([None], tf.string, name="image_bytes")], autograph=False)
    def serve_bytes(self, image_bytes):
        """string [B] encoded images -> the detection dict (module docstring)."""

        def decode_and_preprocess(encoded):
            return self._preprocess(self.preprocessor.decode(encoded))

        return self._detect_each(*self._preprocess_each(decode_and_preprocess, image_bytes), self._detect_canvas)


def write_saved_model(model, preprocessor, export_dir):
    """Saves `model` with its serving signatures (SIGNATURES) into the directory `export_dir`.

    Args:
      model: a built MaskRCNN made for export (`build_model(config, export=True)`: pure-TF ops).
      preprocessor: the run's `preprocess.Preprocessor`.
      export_dir: the SavedModel directory.
    """
    module = ServingModule(model, preprocessor)
    tf.saved_model.save(module, export_dir, signatures={"serving_default": module.serve_images,
                                                       "serving_bytes": module.serve_bytes,
                                                       "serving_preprocessed": module.serve_preprocessed})


def calibration_inputs(config):
    """The openvino_int8 calibration set: {"images", "image_info"} NumPy inputs of `deploy.detect_function` of up
    to export.calibration_images images of export.calibration (photos), else of the validation TFRecords.

    Raises ConfigError naming --calibration when it holds no readable image.
    """
    source = config.export.calibration
    if source is not None:
        paths = infer.list_image_files(source)
        photos = infer.photos_from_files(paths[:config.export.calibration_images])
    else:
        photos = infer.photos_from_records(config.data.resolved_validation_pattern(), config.export.calibration_images)
    preprocessor = preprocess.Preprocessor(config.data)
    inputs = []
    for photo in photos:
        batch = predictor.preprocess(photo, preprocessor)
        inputs.append({"images": batch["images"].numpy(), "image_info": batch["image_info"].numpy()})
    if not inputs:
        raise ConfigError("--calibration", f"{source or config.data.resolved_validation_pattern()}: no image to "
                                           "calibrate openvino_int8 on")
    return inputs


def check_export_dir(export_dir):
    """Raises ConfigError naming --export_dir when `export_dir` exists and is not a directory an export may
    replace. An export replaces its directory whole, so it takes only a new or empty directory or an earlier
    export (config.json beside an artefact, and no training checkpoint, ckpt-N.index): a model directory, a
    folder of runs or any other directory would be deleted with everything in it."""
    if not os.path.lexists(export_dir):
        return
    if not os.path.isdir(export_dir):
        raise ConfigError("--export_dir", f"{export_dir} is a file, not a directory")
    if os.listdir(export_dir) and not exported_files(export_dir):
        raise ConfigError("--export_dir", f"{export_dir} exists and is not an earlier export; an export replaces "
                                          "its directory with everything in it: name a new or empty directory")


def export(config, model, export_dir, calibration=None):
    """Writes the artefacts of config.export.formats, the run's config.json and the model directory's class names
    (if any) into `export_dir` (an earlier export there is replaced: `check_export_dir`), atomically: a failed
    conversion leaves nothing.

    Args:
      config: the run's Config.
      model: a built MaskRCNN made for export.
      export_dir: the directory.
      calibration: `calibration_inputs(config)`, for openvino_int8.
    """
    check_export_dir(export_dir)
    formats = config.export.formats
    preprocessor = preprocess.Preprocessor(config.data)
    with files.atomic_path(os.path.abspath(export_dir)) as temporary:
        os.makedirs(temporary)
        if "saved_model" in formats:
            write_saved_model(model, preprocessor, temporary)
        others = [fmt for fmt in formats if fmt != "saved_model"]
        functions = {}  # one trace per RoIAlign route
        for fmt in others:
            fused = deploy.fused_roi_align(fmt)
            if fused not in functions:
                functions[fused] = deploy.detect_function(model, fused)
            deploy.convert(fmt, functions[fused], os.path.join(temporary, deploy.ARTEFACTS[fmt][0]), calibration)
        config.save(temporary)
        label_map = os.path.join(config.runtime.model_dir, LABEL_MAP_FILE)
        if os.path.isfile(label_map):
            shutil.copy(label_map, temporary)


def run(config):
    """Entry point of `main.py export`; returns the exit status."""
    try:
        others = [fmt for fmt in config.export.formats if fmt != "saved_model"]
        if others and config.runtime.amp:
            raise ConfigError("--amp", f"{', '.join(others)} are float32 graphs (tflite_fp16 and openvino_int8 lower "
                                       "the precision themselves): export them without --amp")
        for fmt in others:
            deploy.require_extra(fmt)
        export_dir = config.export.resolved_export_dir(config.runtime.model_dir)
        check_export_dir(export_dir)
        loaded = load_model(config, export=True)
        calibration = calibration_inputs(config) if "openvino_int8" in config.export.formats else None
    except ValueError as err:
        print(f"[export] error: {err}", file=sys.stderr)
        return status.BAD_INPUT
    os.makedirs(os.path.dirname(os.path.abspath(export_dir)), exist_ok=True)
    export(config, loaded.model, export_dir, calibration)
    written = [("SavedModel (signatures " + ", ".join(SIGNATURES) + ")") if fmt == "saved_model"
               else deploy.ARTEFACTS[fmt][0] for fmt in config.export.formats]
    print(f"[export] checkpoint {loaded.checkpoint} (step {loaded.step}) -> {export_dir}: {'; '.join(written)}",
          flush=True)
    abandoned = files.abandoned_note(glob.escape(os.path.abspath(export_dir)))
    if abandoned:
        print(f"[export] note: {abandoned}", file=sys.stderr)
    return status.OK
