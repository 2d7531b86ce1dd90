"""Prediction with a trained model, shared by `main.py eval`, `main.py infer` and `main.py export`.

`load_model` builds the model the config describes (through the factory, which chooses its ops) and
restores the newest checkpoint's weights; `predict_function` is its traced predict step, one per model;
`pad_batch` and `predict_batch` run a batch of any size up to the batch size through that one trace.
Training evaluates its live model with the same `predict_function`.

This module reads no data and writes nothing: its callers bring the images and keep the detections.

Glossary: B the batch size (eval.eval_batch_size), b <= B the images of one batch, H x W = data.image_size.
"""

import dataclasses
import weakref
from typing import Optional

import tensorflow as tf

from mrcnn_tf2.model.factory import OpChoice, build_model, choose_ops
from mrcnn_tf2.runtime.precision import describe_precision, set_precision

# One traced predict function per model, so that repeated evaluations during training trace once.
_PREDICT_FUNCTIONS = weakref.WeakKeyDictionary()


def predict_function(model, eagerly=False):
    """`model.predict_step` as a tf.function (the eager method itself when `eagerly`), cached per model.

    The returned callable maps a batch dict (images [B, H, W, 3] float32, image_info [B, 5] float32,
    source_ids [B] int64) to the predict_step outputs (see MaskRCNN).
    """
    if eagerly:
        return model.predict_step
    function = _PREDICT_FUNCTIONS.get(model)
    if function is None:
        # A weak reference: the cache must not keep a discarded model (and its graph) alive.
        model_ref = weakref.ref(model)
        # reduce_retracing: batches padded to their own size (data.pad_to_multiple) share a trace of
        # unknown height and width after the first few sizes, instead of one trace per size.
        function = tf.function(lambda batch: model_ref().predict_step(batch), reduce_retracing=True)
        _PREDICT_FUNCTIONS[model] = function
    return function


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


def load_model(config, require_checkpoint=True, export=False, announce=True):
    """Builds the model `config` describes and reads the weights of the newest checkpoint in model_dir.

    Only the model is read (training checkpoints also hold the optimizer). The variables are built by a
    trace of `predict_function` on a blank batch of eval.eval_batch_size, which evaluation then reuses (with
    data.pad_to_multiple, on one blank image of 2**max_level pixels a side).
    Prints the precision and the ops the model was built with (`describe_precision`, `OpChoice.describe`)
    when `announce` (False on the ranks other than 0 of a job).

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
    checkpoint = tf.train.latest_checkpoint(model_dir)
    if checkpoint is None and require_checkpoint:
        raise ValueError(f"no checkpoint in model_dir {model_dir}: train first, or pass --model_dir of a trained run.")
    policy = set_precision(config.runtime.amp, config.runtime.amp_dtype)
    model = build_model(config, export=export)
    ops = choose_ops(config, export=export)
    if announce:
        print(f"[model] {describe_precision(policy, config.runtime.amp)}", flush=True)
        print(f"[model] {ops.describe()}", flush=True)
    height, width = config.data.image_size
    batch_size = config.eval.eval_batch_size
    if config.data.pad_to_multiple is not None:
        # Batches padded to their own size vary in shape anyway: the smallest input whose FPN levels all exist
        # builds the variables, instead of batch_size images of the whole canvas.
        height = width = 2 ** config.model.anchors.max_level
        batch_size = 1
    # A blank batch shaped like the evaluation batches builds the variables through the same trace that
    # evaluation then reuses (an eager build would cost as much as that trace again).
    predict_function(model, config.runtime.eagerly)({
        "images": tf.zeros([batch_size, height, width, 3]),
        "image_info": tf.constant([[height, width, 1.0, height, width]] * batch_size, tf.float32),
        "source_ids": tf.zeros([batch_size], tf.int64),
    })
    if checkpoint is None:
        return LoadedModel(model, None, 0, policy, ops)
    step = tf.Variable(0, dtype=tf.int64, trainable=False)
    # Every model variable must be found in the checkpoint, or this would use freshly initialised weights.
    try:
        tf.train.Checkpoint(model=model, step=step).read(checkpoint).expect_partial().assert_existing_objects_matched()
    except (AssertionError, ValueError, tf.errors.OpError) as err:
        reason = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise ValueError(f"checkpoint {checkpoint} does not fit the model the flags describe ({reason}).") from None
    return LoadedModel(model, checkpoint, int(step.numpy()), policy, ops)
