"""Prediction, shared by `main.py eval`, `main.py infer`, `main.py export` and Python callers (`Predictor`).

`load_model` builds the model the config describes (through the factory, which chooses its ops) and
restores the newest checkpoint's weights; `predict_function` is its traced predict step, one per model, on the
weights as they are then (`fixed_weights`); `pad_batch` and `predict_batch` run a batch of any size up to the
batch size through that one trace. Training evaluates its live model with a `predict_function` that reads the
weights in every call.

`Predictor` is the one inference path of `main.py infer` and of code that calls the model on images: images in,
detections per image out, through a backend: the newest checkpoint of a model directory in TensorFlow, or an
exported artefact in its runtime (`mrcnn_tf2.runtime.deploy`). It reads image files; it writes nothing.

Glossary: B the batch size (eval.eval_batch_size), b <= B the images of one batch, H x W = data.image_size.
"""

import contextlib
import dataclasses
import io
import json
import os
import weakref
from typing import Optional

import numpy as np
import tensorflow as tf
from PIL import Image, ImageOps

from mrcnn_tf2.config import EXPORT_FILES, SAVED_MODEL_FILE, ConfigError, exported_files
from mrcnn_tf2.data.coco_io import to_rgb
from mrcnn_tf2.data.preprocess import Preprocessor
from mrcnn_tf2.evaluation import coco_metrics
from mrcnn_tf2.model.factory import OpChoice, build_model, choose_ops
from mrcnn_tf2.ops import masks as mask_ops
from mrcnn_tf2.ops import fixed
from mrcnn_tf2.runtime import deploy
from mrcnn_tf2.runtime.checkpoints import MODEL_KEY
from mrcnn_tf2.runtime.distributed import SINGLE_PROCESS
from mrcnn_tf2.runtime.precision import describe_precision, set_precision
from mrcnn_tf2.runtime.weight_average import AVERAGE_KEY, holds_average

# The traced predict functions of each model, {fixed_weights: function}, so that repeated evaluations during training
# trace once.
_PREDICT_FUNCTIONS = weakref.WeakKeyDictionary()


def predict_function(model, eagerly=False, fixed_weights=False):
    """`model.predict_step` as a tf.function (the eager method itself when `eagerly`), cached per model.

    The returned callable maps a batch dict (images [B, H, W, 3] float32, image_info [B, 5] float32,
    source_ids [B] int64) to the predict_step outputs (see MaskRCNN).

    fixed_weights: the model's weights stay as they are for as long as the function is called (a model loaded
    for inference): what the convs compute from their weights alone (folded batch norms, Winograd's kernel
    transforms) is computed when it is traced, not in every call (`ops.fixed`). False for a model in
    training, whose weights change between calls.
    """
    if eagerly:
        return model.predict_step
    functions = _PREDICT_FUNCTIONS.setdefault(model, {})
    if fixed_weights not in functions:
        # A weak reference: the cache must not keep a discarded model (and its graph) alive.
        model_ref = weakref.ref(model)

        def predict(batch):
            with fixed.fixed_weights() if fixed_weights else contextlib.nullcontext():
                return model_ref().predict_step(batch)

        # reduce_retracing: batches padded to their own size (data.pad_to_multiple) share a trace of
        # unknown height and width after the first few sizes, instead of one trace per size.
        # Without autograph, as the training step (runtime/train.py).
        functions[fixed_weights] = tf.function(predict, reduce_retracing=True, autograph=False)
    return functions[fixed_weights]


def pad_batch(batch, batch_size):
    """Pads a partial last batch to `batch_size` by repeating its first image: one trace, static shapes.

    `batch` is a dict of tensors with the batch first ([b, ...], b <= batch_size); returns [batch_size, ...].
    """
    count = int(batch["images"].shape[0])
    if count == batch_size:
        return batch
    return {key: tf.concat([value, tf.repeat(value[:1], batch_size - count, axis=0)], axis=0)
            for key, value in batch.items()}


def predict_batch(predict, batch, batch_size=None):
    """The detections of a batch of b images, as NumPy arrays (waits for the device).

    Args:
      predict: `predict_function` of the model.
      batch: dict with images [b, H, W, 3] float32, image_info [b, 5] float32, source_ids [b] int64.
      batch_size: B >= b, the size `predict` runs at: a partial batch is padded to it, so that batches on the
        canvas share one trace of static shapes. None: the batch runs as it is (batches padded to their own
        size, whose shapes vary anyway: padding a batch of one shape to B would cost B images).

    Returns:
      dict of [b, ...] arrays: the predict_step outputs of MaskRCNN (detection_boxes [b, D, 4] in
      original-image pixels, detection_scores, detection_classes, detection_masks [b, D, R, R],
      num_detections, image_info, source_ids).
    """
    count = int(batch["images"].shape[0])
    outputs = predict(batch if batch_size is None else pad_batch(batch, batch_size))
    return {key: value.numpy()[:count] for key, value in outputs.items()}


def same_shape_batches(items, batch_size, shape, held=4):
    """Lists of up to `batch_size` items of `items` with equal `shape(item)`, for batches padded to their own
    size (data.pad_to_multiple): a batch of images of one padded shape pads none of them further, so each
    image's detections are those it gets alone, whatever its batch-mates.

    A group goes out when it is full; when `held` x batch_size items wait, the largest group goes out
    partial (memory stays bounded however many shapes come); the rest go out at the end. Items of a shape
    keep their order; with one shape this is consecutive batching.
    """
    groups, waiting = {}, 0
    for item in items:
        group = groups.setdefault(shape(item), [])
        group.append(item)
        waiting += 1
        if len(group) == batch_size or waiting >= held * batch_size:
            key = shape(item) if len(group) == batch_size else max(groups, key=lambda k: len(groups[k]))
            out = groups.pop(key)
            waiting -= len(out)
            yield out
    yield from groups.values()


def concat_batches(batches):
    """One batch dict of the batch dicts `batches` (tensors of equal shapes but the first), concatenated."""
    return {key: tf.concat([batch[key] for batch in batches], axis=0) for key in batches[0]}


@dataclasses.dataclass
class LoadedModel:
    """A model restored for evaluation, inference or export."""

    model: object  # the built MaskRCNN
    checkpoint: Optional[str]  # the checkpoint read; None: freshly initialised weights
    step: int  # the training step of the checkpoint (0 without one)
    policy: str  # the Keras precision policy it was built under
    ops: OpChoice  # the ops it was built with; `ops.mask_encoder` encodes its masks as COCO RLE
    averaged: bool = False  # the weights are the moving average its training kept (train.ema_decay)


def load_model(config, require_checkpoint=True, export=False, world=SINGLE_PROCESS):
    """Builds the model `config` describes and reads the weights of the newest checkpoint in model_dir (or of
    infer.checkpoint, --checkpoint, when given).

    Only the model is read (training checkpoints also hold the optimizer). `predict_function` with fixed_weights
    is traced (not run) on those weights for batches of eval.eval_batch_size, the trace that evaluation and
    inference then use (with data.pad_to_multiple, of any height and width); not for an export, nor with
    runtime.eagerly.
    Prints the precision and the ops the model was built with (`describe_precision`, `OpChoice.describe`) on
    rank 0 of `world` (runtime.distributed.World: every rank of a job loads the model).

    Args:
      config: the run's Config (model, data.image_size, eval.eval_batch_size, runtime.model_dir, amp).
      require_checkpoint: without a checkpoint, raise (True) or keep the initial weights (False: benchmarks).
      export: build the model for a SavedModel (`factory.choose_ops`: the pure-TF ops, no XLA).

    Returns:
      a `LoadedModel`.

    Raises:
      ValueError naming model_dir or the checkpoint: no checkpoint, or one that does not fit the model;
        ConfigError (a ValueError) naming --custom_ops: 'on' on a GPU (`factory.choose_ops`).
    """
    model_dir = config.runtime.model_dir
    checkpoint = config.infer.resolved_checkpoint(model_dir) or tf.train.latest_checkpoint(model_dir)
    if checkpoint is None and require_checkpoint:
        exported = exported_files(model_dir)
        if exported:
            artefact = model_dir if exported[0] == SAVED_MODEL_FILE else os.path.join(model_dir, exported[0])
            raise ValueError(f"no checkpoint in model_dir {model_dir}: it is an export directory; pass --exported "
                             f"{artefact} (it holds {', '.join(exported)}).")
        raise ValueError(f"no checkpoint in model_dir {model_dir}: train first, or pass --model_dir of a trained run.")
    policy = set_precision(config.runtime.amp, config.runtime.amp_dtype, world)
    model = build_model(config, export=export)
    ops = choose_ops(config, export=export)
    if world.is_chief:
        print(f"[model] {describe_precision(policy, config.runtime.amp)}", flush=True)
        print(f"[model] {ops.describe()}", flush=True)
    model.build()
    step, key = 0, None
    if checkpoint is not None:
        step_variable = tf.Variable(0, dtype=tf.int64, trainable=False)
        # Every model variable must be found in the checkpoint, or this would use freshly initialised weights.
        try:
            # The weights' moving average where training kept one (train.ema_decay) and eval.use_ema asks for it,
            # else the last step's weights.
            held = holds_average(checkpoint)
            key = AVERAGE_KEY if held and config.eval.use_ema else MODEL_KEY
            restored = tf.train.Checkpoint(**{key: model}, step=step_variable).read(checkpoint)
            restored.expect_partial().assert_existing_objects_matched()
        except (AssertionError, ValueError, tf.errors.OpError) as err:
            reason = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
            raise ValueError(f"checkpoint {checkpoint} does not fit the model the flags describe ({reason}).") from None
        step = int(step_variable.numpy())
        if held and world.is_chief:
            weights = ("the moving average training kept (train.ema_decay)" if key == AVERAGE_KEY else
                       "the last step's, not the moving average training kept (eval.use_ema false)")
            print(f"[model] weights: {weights} in {checkpoint}", flush=True)
    if not (export or config.runtime.eagerly):
        # Evaluation's trace, made here without running the model (an export traces its own functions), on the
        # weights just read (`predict_function`'s fixed_weights=True). On the canvas every batch has the eval batch's
        # shape; batches padded to their own size vary in height and width, and share one trace in which both
        # are unknown. The batch stays static: a batch of one then takes oneDNN's batch-of-one conv routes
        # without a cond (ops/conv.py).
        batch_size = config.eval.eval_batch_size
        height, width = config.data.image_size if config.data.pad_to_multiple is None else (None, None)
        predict_function(model, fixed_weights=True).get_concrete_function({
            "images": tf.TensorSpec([batch_size, height, width, 3], tf.float32),
            "image_info": tf.TensorSpec([batch_size, 5], tf.float32),
            "source_ids": tf.TensorSpec([batch_size], tf.int64),
        })
    return LoadedModel(model, checkpoint, step, policy, ops, averaged=key == AVERAGE_KEY)


# -- images in ----------------------------------------------------------------------------------------------

# A model directory's own class names, in --label_map's format (a converted torchvision COCO model has them).
LABEL_MAP_FILE = "label_map.json"


@dataclasses.dataclass
class Photo:
    """One image to run on."""

    image_id: int
    name: str  # the --input path, or the image id for TFRecords
    image: np.ndarray  # [h, w, 3] uint8 RGB


def _is_encoded(image):
    """Whether `image` is an image file's path, its bytes or an open binary file."""
    return isinstance(image, (str, os.PathLike, bytes, bytearray)) or hasattr(image, "read")


def is_one_image(image):
    """Whether `image` is one image as `read_image` takes it, rather than a collection of them."""
    return (_is_encoded(image) or isinstance(image, Image.Image)
            or (isinstance(image, np.ndarray) and image.ndim != 4))


def read_image(image):
    """[h, w, 3] uint8 RGB of `image`: an image file's path, its bytes or an open binary file (an upload), a PIL
    image, or a uint8 array, [h, w, 3] RGB, [h, w] or [h, w, 1] gray, or [h, w, 4] RGBA.

    A file or a PIL image is turned upright by its EXIF orientation. Every other kind than an RGB array goes
    through `coco_io.to_rgb`, as the converter's images do: gray becomes RGB (16-bit gray its high byte),
    transparency is composited over coco_io.TRANSPARENT_FILL. Raises ValueError for an array of another dtype or
    shape, or without pixels, and what PIL raises for an unreadable file (OSError and others).
    """
    if _is_encoded(image):
        with Image.open(io.BytesIO(image) if isinstance(image, (bytes, bytearray)) else image) as opened:
            return read_image(opened)
    if isinstance(image, Image.Image):
        return np.asarray(to_rgb(ImageOps.exif_transpose(image)))
    array = np.asarray(image)
    channels = array.shape[2] if array.ndim == 3 else 1
    if array.dtype != np.uint8 or array.ndim not in (2, 3) or channels not in (1, 3, 4) or 0 in array.shape:
        # Floats in [0, 1] read as uint8 would be black, 16-bit values would wrap: no guess is made.
        raise ValueError(f"an image array must be uint8 [h, w, 3] RGB, [h, w] or [h, w, 1] gray or [h, w, 4] "
                         f"RGBA, with pixels; got {array.dtype} of shape {list(array.shape)}")
    if channels == 3:
        return array
    return np.asarray(to_rgb(Image.fromarray(array.reshape(array.shape[:2]) if channels == 1 else array)))


def preprocess(photo, preprocessor):
    """The model input of one photo, resized, normalised and padded as the input pipeline does (to the canvas,
    or to its own size rounded up to data.pad_to_multiple).

    Args:
      photo: a Photo; preprocessor: the run's `preprocess.Preprocessor`.

    Returns:
      dict with images [1, H, W, 3] float32, image_info [1, 5] float32, source_ids [1] int64.
    """
    image, image_info = preprocessor.example(tf.constant(photo.image))[:2]
    return {"images": preprocessor.pad_batch(image[None], image_info[None]), "image_info": image_info[None],
            "source_ids": tf.constant([photo.image_id], tf.int64)}


def photo_batches(photos, preprocessor, batch_size):
    """Yields (photos, model input batch) of up to `batch_size` of `photos` that share a padded shape
    (`same_shape_batches`): each photo's detections are those it gets alone. On the canvas that is
    every photo, batched in order.

    Args:
      photos: iterable of Photos; preprocessor: the run's `preprocess.Preprocessor`.

    Yields:
      (list of b <= batch_size Photos, dict with images [b, H, W, 3], image_info [b, 5], source_ids [b]).
    """
    inputs = ((photo, preprocess(photo, preprocessor)) for photo in photos)
    for group in same_shape_batches(inputs, batch_size, lambda pair: tuple(pair[1]["images"].shape)):
        yield [photo for photo, _ in group], concat_batches([batch for _, batch in group])


# -- class names --------------------------------------------------------------------------------------------


def read_label_map(path):
    """{category id: name} of a --label_map file: a JSON object {"1": "person", "3": "car", ...}."""
    try:
        with open(path, encoding="utf-8") as f:
            raw = json.load(f)
    except (OSError, json.JSONDecodeError) as err:
        raise ValueError(f"--label_map {path}: cannot read it as JSON ({err})") from None
    if not isinstance(raw, dict) or not raw:
        raise ValueError(f'--label_map {path}: must be a non-empty JSON object {{"category id": "name"}}')
    names = {}
    for key, name in raw.items():
        if not str(key).strip().isdigit() or int(key) < 1 or not isinstance(name, str):
            raise ValueError(f"--label_map {path}: entry {key!r}: {name!r} is not a category id >= 1 with a name")
        names[int(key)] = name
    return names


def category_names(config):
    """{class id: name} of the classes reported: --eval_file's categories, else every class of the model.

    Names come from --label_map, else from --eval_file, else from the model directory's LABEL_MAP_FILE, else
    are the ids. Raises ValueError (naming the file) for an unusable label map.
    """
    label_map_file = config.infer.label_map
    if config.eval.eval_file:
        coco = coco_metrics.load_annotations(config.eval.eval_file)
        names = {category["id"]: category["name"] for category in coco.loadCats(coco.getCatIds())}
    else:
        names = {class_id: str(class_id) for class_id in range(1, config.model.num_classes)}
        saved = os.path.join(config.runtime.model_dir, LABEL_MAP_FILE)
        if not label_map_file and os.path.isfile(saved):
            label_map_file = saved
    if label_map_file:
        label_map = read_label_map(label_map_file)
        names = {class_id: label_map.get(class_id, name) for class_id, name in names.items()}
    return names


# -- backends and the Predictor ------------------------------------------------------------------------------


class ModelBackend:
    """A built MaskRCNN in TensorFlow: `backend(batch)` -> `predict_batch`'s outputs. Batches of up to
    eval.eval_batch_size images (of one padded shape under data.pad_to_multiple)."""

    def __init__(self, model, config, mask_encoder, description, fixed_weights=False):
        """model: the built MaskRCNN; config: the run's Config; mask_encoder: its `OpChoice.mask_encoder`;
        description: what it is, for the run's summary line; fixed_weights: the model's weights stay as they
        are (`predict_function`)."""
        self.model = model
        self.predict = predict_function(model, config.runtime.eagerly, fixed_weights)
        self.batch_size = config.eval.eval_batch_size
        self.run_size = None if config.data.pad_to_multiple is not None else self.batch_size
        self.mask_encoder = mask_encoder
        self.description = description
        self.loaded = None  # the LoadedModel, when made by `from_checkpoint`

    @classmethod
    def from_checkpoint(cls, config, world=SINGLE_PROCESS):
        """The newest checkpoint of config.runtime.model_dir (`load_model`, on each rank of `world`)."""
        loaded = load_model(config, world=world)
        backend = cls(loaded.model, config, loaded.ops.mask_encoder,
                      f"checkpoint {loaded.checkpoint}, step {loaded.step}", fixed_weights=True)
        backend.loaded = loaded
        return backend

    def __call__(self, batch):
        return predict_batch(self.predict, batch, self.run_size)


class ExportedBackend:
    """An exported artefact (`deploy.Runner`: one image per call) or an export directory's SavedModel (its
    serving_preprocessed signature): `backend(batch)` -> the same outputs as `ModelBackend`."""

    def __init__(self, config, path):
        """config: the run's Config (eval.eval_batch_size, model.test.mask_paste); path: an artefact file, or an
        export directory for its SavedModel. Raises ConfigError naming --exported for anything else."""
        if os.path.isdir(path):
            if not os.path.isfile(os.path.join(path, SAVED_MODEL_FILE)):
                present = exported_files(path)
                holds = ", ".join(present) if present else "none of " + ", ".join(EXPORT_FILES.values())
                raise ConfigError("--exported", f"{path}: a directory without a SavedModel ({SAVED_MODEL_FILE}); "
                                                f"name an artefact file in it (it holds {holds})")
            signatures = tf.saved_model.load(path).signatures
            if "serving_preprocessed" not in signatures:
                raise ConfigError("--exported", f"{path}: a SavedModel without the serving_preprocessed signature "
                                                "(exported by an older version): export it again")
            detect = signatures["serving_preprocessed"]
            self.run = lambda images, image_info: {key: value.numpy() for key, value in detect(
                images=tf.constant(images), image_info=tf.constant(image_info)).items()}
            self.batch_size, self.description = config.eval.eval_batch_size, f"SavedModel {path}"
        else:
            self.run = deploy.Runner(path)
            self.batch_size, self.description = 1, f"{self.run.format} {path}"
        self.mask_encoder = choose_ops(config, export=True).mask_encoder
        self.loaded = None

    def __call__(self, batch):
        images, image_info = np.asarray(batch["images"]), np.asarray(batch["image_info"])
        outputs = [self.run(images[i:i + self.batch_size], image_info[i:i + self.batch_size])
                   for i in range(0, len(images), self.batch_size)]
        outputs = {key: np.concatenate([out[key] for out in outputs]) for key in outputs[0]}
        return {**outputs, "image_info": image_info, "source_ids": np.asarray(batch["source_ids"])}


def open_backend(config, world=SINGLE_PROCESS):
    """config.infer.exported's backend, else the newest checkpoint's (`load_model`, on each rank of `world`).
    Raises ValueError (ConfigError) naming the file."""
    exported = config.infer.exported
    return ModelBackend.from_checkpoint(config, world) if exported is None else ExportedBackend(config, exported)


class Predictor:
    """Detections of images, per image, in original pixels, by a model directory's newest checkpoint, another of its
    checkpoints, or an exported artefact.

        predictor = Predictor("runs/my_model")                            # TensorFlow, the newest checkpoint
        predictor = Predictor("runs/my_model/ckpt-600")                   # or that one
        predictor = Predictor("runs/my_model/saved_model/model.onnx")    # or .tflite, openvino/model.xml,
                                                                          # or the export directory (SavedModel)
        detections = predictor("photo.jpg")             # or its bytes, a PIL image, a uint8 [h, w, 3] RGB array,
                                                        # or a list of them

    Each image's detections: dict with boxes [N, 4] float32 [ymin, xmin, ymax, xmax] in the image's pixels,
    classes [N] int64 category ids, names [N] str, scores [N] float32 (descending), masks [N, h, w] bool pasted
    at the image's size (absent without the mask branch). A photo's detections are those it gets alone.
    """

    def __init__(self, path=None, config=None):
        """path: a model directory, a training checkpoint's prefix (its directory holds the run's config.json) or an
        exported artefact (its directory holds the export's config.json);
        config: a Config instead (`main.py infer`'s; its infer.exported picks the artefact)."""
        if config is None:
            from mrcnn_tf2.arguments import config_for_path  # the CLI layer: imported by this entry point only

            config = config_for_path(path)
        self.config = config
        self.names = category_names(config)
        self.backend = open_backend(config)
        self.preprocessor = Preprocessor(config.data)

    def batches(self, photos):
        """Yields (photos, outputs): `photo_batches` of `photos` through the backend."""
        for chunk, batch in photo_batches(photos, self.preprocessor, self.backend.batch_size):
            yield chunk, self.backend(batch)

    def __call__(self, images):
        """images: an image, as `read_image` takes it (a path, encoded bytes, a PIL image or a uint8 array), or
        a list, any other iterable or a uint8 [n, h, w, 3] array of them -> the dict of the class docstring for
        each (one dict for one image). ValueError names the image that cannot be read as RGB."""
        single = is_one_image(images)
        images = [images] if single else list(images)
        photos = []
        for index, image in enumerate(images):
            name = str(image) if isinstance(image, (str, os.PathLike)) else f"image {index}"
            try:
                photos.append(Photo(index, name, read_image(image)))
            except ValueError as err:
                raise ValueError(f"{name}: {err}") from None
        found = [None] * len(photos)
        for chunk, outputs in self.batches(photos):
            for b, photo in enumerate(chunk):
                found[photo.image_id] = self.detections(outputs, b, photo.image.shape[:2])
        return found[0] if single else found

    def detections(self, outputs, b, image_hw):
        """Image b of a backend's outputs as the per-image dict of the class docstring."""
        count = int(outputs["num_detections"][b])
        boxes = outputs["detection_boxes"][b, :count]
        classes = outputs["detection_classes"][b, :count].astype(np.int64)
        result = {"boxes": boxes, "classes": classes, "names": [self.names.get(int(c), str(c)) for c in classes],
                  "scores": outputs["detection_scores"][b, :count]}
        if "detection_masks" in outputs:  # pasted as evaluation pastes them (model.test.mask_paste)
            paste = mask_ops.paste_masks_torchvision if self.config.model.test.mask_paste == "torchvision" \
                else mask_ops.paste_masks
            masks = paste(outputs["detection_masks"][b, :count], boxes, image_hw, coco_metrics.MASK_THRESHOLD)
            result["masks"] = masks.astype(bool)
        return result
