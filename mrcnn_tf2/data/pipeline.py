"""The tf.data input pipeline: TFRecords -> batched, padded `features` dicts for the model.

Training: files matching the pattern -> this worker's share (`worker_records`: its own files read
interleaved, or every N-th record when there are fewer files than N workers) -> with repeat factor sampling
(data.repeat_threshold), each record repeated by its rarest category's factor -> shuffle -> decode ->
drop crowd -> labels checked against num_classes, a record past max_num_instances named -> with scale jitter
(data.aug_scale_min / aug_scale_max), a random resize and cut to image_size (objects clipped to the cut, those
outside it dropped) -> GT masks cropped to their boxes at gt_mask_size -> random horizontal flip (image, boxes,
mask crops together) -> aspect-preserving resize to fit image_size (without jitter), ImageNet normalisation,
pad bottom/right (`preprocess.resize_normalize_pad`, as infer and export do) -> GT padded to max_num_instances
with -1 -> RPN targets per level -> batch -> prefetch.
Evaluation: image, image_info and source_id only.

Boxes are [ymin, xmin, ymax, xmax] float32 in pixels of the resized, padded image.
`image_info` is [scaled_h, scaled_w, 1 / scale, original_h, original_w]: multiplying a box by
image_info[2] maps it back to original-image pixels (in training with scale jitter, scaled_h x scaled_w is the
cut's size, and the cut's offset is not undone).

This module reads the config's data settings; the ops it calls take plain arguments. The choice of fused ops
or twins is not made here: the runtime passes in the anchor-labelling function the factory chose, and the
model's anchors.

Glossary: B batch, M = max_num_instances, S = gt_mask_size, H x W = image_size, H_l x W_l the size of
FPN level l, A anchors per cell.
"""

import collections
import functools
import re
import sys

import tensorflow as tf

from mrcnn_tf2.console import say
from mrcnn_tf2.data.decoder import decode_example
from mrcnn_tf2.data.preprocess import Preprocessor
from mrcnn_tf2.data.repeat_factors import RepeatFactors
from mrcnn_tf2.ops.box_ops import PADDING_BOX_VALUE

# tf.data runs a map's function through autograph unless told not to; the preprocessing has no Python control
# flow on tensors, and converting it cost seconds at every start-up.
unconverted = tf.autograph.experimental.do_not_convert
# Class id and mask value of a padded ground-truth slot (padded boxes are PADDING_BOX_VALUE).
PADDING_CLASS = -1
PADDING_MASK = -1.0
# Serialized records held for shuffling (each is one encoded image: this bounds memory, not images).
SHUFFLE_RECORDS = 256
# Files read at once by the interleave.
CYCLE_LENGTH = 8
# Opens the messages of the assertions of the training input's checks of each record (`InputPipeline._check_record`),
# "<RECORD_PROBLEM><flag>: <the record, what is wrong, what to do>", which `record_problem` finds in the error the
# iterator raises.
RECORD_PROBLEM = "training record problem: "


def crop_instance_masks(masks, boxes, size):
    """Crops each instance mask to its box and resamples it to size x size.

    Sampling is at pixel centres: cell (i, j) of the crop samples the mask at the continuous point
    (ymin + (i + 0.5) * box_h / size, xmin + (j + 0.5) * box_w / size), bilinearly.

    Args:
      masks: [K, h, w] uint8 full-image masks in {0, 1}.
      boxes: [K, 4] float32 [ymin, xmin, ymax, xmax] in pixels of the same image.
      size: output side S.

    Returns:
      [K, S, S] float32 in [0, 1].
    """
    height = tf.cast(tf.shape(masks)[1], tf.float32)
    width = tf.cast(tf.shape(masks)[2], tf.float32)
    ymin, xmin, ymax, xmax = tf.unstack(boxes, axis=-1)
    half_cell_h = 0.5 * (ymax - ymin) / size
    half_cell_w = 0.5 * (xmax - xmin) / size
    # crop_and_resize puts the first and last samples on the box corners, in index units where pixel j
    # has its centre at j: move the corners to the first and last cell centres, shifted by half a pixel.
    normalized = tf.stack(
        [
            (ymin + half_cell_h - 0.5) / tf.maximum(height - 1.0, 1.0),
            (xmin + half_cell_w - 0.5) / tf.maximum(width - 1.0, 1.0),
            (ymax - half_cell_h - 0.5) / tf.maximum(height - 1.0, 1.0),
            (xmax - half_cell_w - 0.5) / tf.maximum(width - 1.0, 1.0),
        ],
        axis=-1,
    )
    crops = tf.image.crop_and_resize(
        tf.cast(masks[..., None], tf.float32),
        normalized,
        tf.range(tf.shape(masks)[0]),
        [size, size],
        method="bilinear",
        extrapolation_value=0.0,
    )
    return crops[..., 0]


def cut_to_window(boxes, classes, masks, window):
    """The objects that a part of their image shows, with boxes around what it shows of them.

    A box is clipped to the part and, where the object's mask has pixels in the part, to their extent (a disk
    cut near its top shows a narrow cap, not the width of its box), as detectron2 recomputes boxes from masks
    after a crop. An object left without area, or whose mask has pixels but none in the part, is dropped.

    Args:
      boxes: [K, 4] float32 [ymin, xmin, ymax, xmax] in pixels of the image.
      classes: [K] int32.
      masks: [K, h, w] uint8 full-image masks in {0, 1}, or None (a model without masks: boxes are clipped).
      window: [4] float32 [ymin, xmin, ymax, xmax], the part, in the same pixels.

    Returns:
      (boxes [K', 4] in the image's pixels, within the window, classes [K'], masks [K', h, w] or None).
    """
    boxes = tf.clip_by_value(boxes, tf.tile(window[:2], [2]), tf.tile(window[2:], [2]))
    keep = tf.ones_like(classes, tf.bool)
    if masks is not None:
        def inside(size, low, high):
            """[size] whether pixel i (covering [i, i + 1)) overlaps [low, high)."""
            pixels = tf.range(size, dtype=tf.float32)
            return tf.logical_and(pixels + 1.0 > low, pixels < high)

        height, width = tf.shape(masks)[1], tf.shape(masks)[2]
        seen = tf.logical_and(masks > 0, tf.logical_and(inside(height, window[0], window[2])[:, None],
                                                        inside(width, window[1], window[3])[None, :]))

        def extent(covered):
            """[K] first and one-past-last index that `covered` [K, n] holds, as float32."""
            first = tf.argmax(tf.cast(covered, tf.int32), axis=1, output_type=tf.int32)
            last = tf.shape(covered)[1] - tf.argmax(tf.cast(covered[:, ::-1], tf.int32), axis=1, output_type=tf.int32)
            return tf.cast(first, tf.float32), tf.cast(last, tf.float32)

        top, bottom = extent(tf.reduce_any(seen, axis=2))
        left, right = extent(tf.reduce_any(seen, axis=1))
        shown = tf.reduce_any(seen, axis=[1, 2])
        tight = tf.stack([tf.maximum(boxes[:, 0], top), tf.maximum(boxes[:, 1], left),
                          tf.minimum(boxes[:, 2], bottom), tf.minimum(boxes[:, 3], right)], axis=1)
        boxes = tf.where(shown[:, None], tight, boxes)
        keep = tf.logical_or(shown, tf.logical_not(tf.reduce_any(masks > 0, axis=[1, 2])))
    keep = tf.logical_and(keep, tf.logical_and(boxes[:, 2] > boxes[:, 0], boxes[:, 3] > boxes[:, 1]))
    masks = None if masks is None else tf.boolean_mask(masks, keep)
    return tf.boolean_mask(boxes, keep), tf.boolean_mask(classes, keep), masks


def flip_horizontally(image, boxes, *mask_crops):
    """Mirrors an image with its boxes and, when given, their box-aligned mask crops.

    Args:
      image: [h, w, 3] image of any dtype.
      boxes: [K, 4] float32 [ymin, xmin, ymax, xmax] in pixels of `image`.
      *mask_crops: optionally [K, S, S] masks cropped to their boxes.

    Returns:
      (image, boxes, *mask_crops) flipped left-right.
    """
    width = tf.cast(tf.shape(image)[1], tf.float32)
    ymin, xmin, ymax, xmax = tf.unstack(boxes, axis=-1)
    boxes = tf.stack([ymin, width - xmax, ymax, width - xmin], axis=-1)
    return (image[:, ::-1, :], boxes, *[crops[:, :, ::-1] for crops in mask_crops])


def record_problem(error):
    """(flag, message) of the check of `InputPipeline._check_record` that `error` (an error of the training
    iterator) reports, else None."""
    # Its data ends the message as b'...' when the check ran eagerly, as [...] in the graph of tf.data.
    found = re.search(re.escape(RECORD_PROBLEM) + r"(--\w+): (.*?)'?(?:\]|$)", error.message, re.MULTILINE)
    return found and found.groups()


def check_tfrecord_file(path, file_pattern):
    """Raises ValueError naming `path` when its first record is not a TFRecord (e.g. a JSON file that the
    pattern also matched); reading stops there, so this costs one record per file."""
    try:
        for _ in tf.data.TFRecordDataset(path).take(1):
            pass
    except tf.errors.DataLossError:
        raise ValueError(f"{path} (matched by {file_pattern!r}) is not a TFRecord file: narrow the pattern to "
                         "the TFRecord shards") from None


def matching_files(file_pattern):
    """The sorted paths that `file_pattern` matches; raises ValueError naming it when there is none."""
    paths = sorted(tf.io.gfile.glob(file_pattern))
    if not paths:
        raise ValueError(f"file pattern {file_pattern!r} matches no file (make TFRecords with "
                         "dataset/create_coco_tf_record.py)")
    return paths


def evaluation_records(file_pattern, max_records=None):
    """The serialized records an evaluation reads, in one process's order: the first `max_records` (None: all)
    of the files `file_pattern` matches, in their sorted order, after checking that each is a TFRecord file."""
    paths = matching_files(file_pattern)
    for path in paths:
        check_tfrecord_file(path, file_pattern)
    records = worker_records(paths, 0, 1, training=False)
    return records if max_records is None else records.take(max_records)


def evaluation_images(file_pattern, max_records=None):
    """{source id: (file name, height, width)} of the images `evaluation_records` reads, from their records'
    features alone (no image is decoded); "" and 0 where a record lacks the feature (records of other
    converters may have no image/filename).

    Raises ValueError naming the pattern when records repeat an id: an evaluation would score each of those
    images' detections twice, the second copy as false positives."""
    features = {"image/source_id": tf.io.FixedLenFeature([], tf.string),
                "image/filename": tf.io.FixedLenFeature([], tf.string, default_value=""),
                "image/height": tf.io.FixedLenFeature([], tf.int64, default_value=0),
                "image/width": tf.io.FixedLenFeature([], tf.int64, default_value=0)}
    images, repeated = {}, collections.Counter()
    for batch in evaluation_records(file_pattern, max_records).batch(256).map(
            lambda records: tf.io.parse_example(records, features)):
        for source_id, name, height, width in zip(*(batch[key].numpy() for key in features)):
            source_id = int(source_id)
            if source_id in images:
                repeated[source_id] += 1
            images[source_id] = (name.decode("utf-8", "replace"), int(height), int(width))
    if repeated:
        (source_id, copies), = repeated.most_common(1)
        raise ValueError(f"file pattern {file_pattern!r} matches {len(repeated)} images more than once (image id "
                         f"{source_id} in {copies + 1} records): it matches the same images twice, such as the "
                         "shards of two conversions of one split; narrow it (--config_override "
                         "data.validation_file_pattern=PATTERN)")
    return images


def worker_records(paths, shard_index, num_shards, training, seed=None):
    """The serialized records that worker `shard_index` of `num_shards` reads, before any record shuffle.

    With at least `num_shards` files the worker reads its own files, paths[shard_index::num_shards],
    interleaved (in training: in a shuffled order, repeated forever). With fewer (a small data set is
    often one file) it reads every file in order and keeps records shard_index, shard_index + num_shards,
    ... counted across the files: the workers' shares are disjoint, cover the files and differ by at most
    one record, whatever the seeds.

    Args:
      paths: sorted list of TFRecord paths, the same on every worker.
      shard_index, num_shards: this worker's index and the number of workers.
      training: repeat forever (True) or read each record once in a fixed order (False).
      seed: the seed of the file order in training; None: random.

    Returns:
      a tf.data.Dataset of scalar tf.string records.
    """
    if len(paths) < num_shards:
        records = tf.data.TFRecordDataset(paths).shard(num_shards, shard_index)
        return records.repeat() if training else records
    files = tf.data.Dataset.from_tensor_slices(paths[shard_index::num_shards])
    if training:
        files = files.shuffle(4096, seed=seed, reshuffle_each_iteration=True).repeat()
    return files.interleave(
        tf.data.TFRecordDataset,
        cycle_length=CYCLE_LENGTH,
        num_parallel_calls=tf.data.AUTOTUNE,
        deterministic=not training or seed is not None,
    )


@functools.lru_cache(maxsize=None)
def notice_record_sharding(file_pattern, num_files, num_shards):
    """Prints, once per process and arguments, that workers share records rather than files (training
    builds its dataset twice: once to peek a batch, once to train)."""
    print(f"[data] {file_pattern} matches {num_files} file(s) for {num_shards} workers: each worker reads "
          f"every file and keeps 1 record in {num_shards}", flush=True)


def pad_instances(tensor, size, value):
    """Pads (or truncates) the first dimension of `tensor` to `size` with `value`: [K, ...] -> [size, ...]."""
    tensor = tensor[:size]
    paddings = [[0, size - tf.shape(tensor)[0]]] + [[0, 0]] * (tensor.shape.rank - 1)
    padded = tf.pad(tensor, paddings, constant_values=tf.cast(value, tensor.dtype))
    return tf.ensure_shape(padded, [size] + tensor.shape[1:].as_list())


class InputPipeline:
    """Builds the training or evaluation tf.data.Dataset from a Config.

    Usage: `InputPipeline(config, training=True, anchors=model.anchors, rpn_targets=ops.rpn_targets)
    .dataset(pattern, batch_size, shard_index, num_shards)`; in evaluation `InputPipeline(config,
    training=False)`.
    """

    def __init__(self, config, training, anchors=None, rpn_targets=None):
        """
        Args:
          config: the run's Config (data, model, train.seed).
          training: the training input (augmented, with ground truth and RPN targets) or the evaluation input.
          anchors: {level: [H_l*W_l*A, 4] float32} the model's own anchors (`MaskRCNN.anchors`), which the RPN
            targets label; training only. Taken from the model so that the two can never disagree.
          rpn_targets: `ops.anchors.rpn_targets` or its fused twin, as the factory's `choose_ops` decides
            (`OpChoice.rpn_targets`); training only.

        Raises:
          ValueError: training without anchors or rpn_targets.
        """
        if training and (anchors is None or rpn_targets is None):
            raise ValueError("the training input needs the model's anchors and the rpn_targets function")
        self.data = config.data
        self.model = config.model
        self.training = training
        self.seed = config.train.seed
        # XLA does not apply to these: tf.data functions are not jit-compiled.
        self.rpn_targets = rpn_targets
        self.anchors = anchors
        self.preprocessor = Preprocessor(config.data)
        self.overflowed = set()  # source ids of the records `_check_record` warned of

    def dataset(self, file_pattern, batch_size, shard_index=0, num_shards=1, max_records=None):
        """The batched dataset of `features` dicts (see `preprocess_train` / `preprocess_eval`).

        Training: worker `shard_index` of `num_shards` reads its share of the records before they are
        shuffled: its own files, or with fewer files than workers every `num_shards`-th record (see
        `worker_records`; worker 0 prints a notice), repeated forever.
        Evaluation: the first `max_records` records (None: all) in the order one process reads them, and of
        those every `num_shards`-th from `shard_index` on, each once, keeping the last partial batch: the
        workers together evaluate exactly the images one process would.
        """
        if self.training:
            paths = matching_files(file_pattern)
            records = self._training_records(paths, file_pattern, shard_index, num_shards)
            threshold = self.data.repeat_threshold
            if threshold is not None:
                # Of every record, not of this worker's share: each worker repeats an image alike.
                factors = RepeatFactors.from_records(paths, threshold, self.model.num_classes)
                if shard_index == 0:
                    say(f"[data] {factors.describe(threshold)}")
                records = factors.repeat(records, self.seed)
            records = records.shuffle(SHUFFLE_RECORDS, seed=self.seed)
            # The element index seeds its augmentation, so a seeded run is reproducible under parallel map.
            examples = records.enumerate().map(unconverted(self.preprocess_train), num_parallel_calls=tf.data.AUTOTUNE)
            batches = examples.batch(batch_size, drop_remainder=True)
            if self.data.use_synthetic_data:
                batches = batches.take(1).cache().repeat()
        else:
            records = evaluation_records(file_pattern, max_records).shard(num_shards, shard_index)
            examples = records.map(unconverted(self.preprocess_eval), num_parallel_calls=tf.data.AUTOTUNE)
            # Zero padding to the batch's largest example, then to the model input's size (`pad_batch`).
            batches = examples.padded_batch(batch_size, drop_remainder=False).map(unconverted(self._pad_batch))
        return batches.prefetch(tf.data.AUTOTUNE)

    def _training_records(self, paths, file_pattern, shard_index, num_shards):
        """This worker's training records (`worker_records`), after checking the files it reads."""
        by_record = len(paths) < num_shards
        for path in paths if by_record else paths[shard_index::num_shards]:
            check_tfrecord_file(path, file_pattern)
        # A worker left without records would spin forever in the repeated training input. Every worker checks
        # every share (one record each), so that all stop with the same message.
        idle = next((worker for worker in range(num_shards)
                     if not any(True for _ in worker_records(paths, worker, num_shards, training=False).take(1))),
                    None)
        if idle is not None and by_record:
            raise ValueError(f"file pattern {file_pattern!r} holds fewer records than the {num_shards} workers")
        if idle is not None:
            own = paths[idle::num_shards]
            reader = "" if num_shards == 1 else f" that worker {idle} of {num_shards} reads"
            raise ValueError(f"the {len(own)} file(s){reader} hold no record (first: {own[0]}, matched by "
                             f"{file_pattern!r}): convert the data into no more shards than it has images "
                             "(dataset/create_coco_tf_record.py --num_shards)")
        if by_record and shard_index == 0:
            notice_record_sharding(file_pattern, len(paths), num_shards)
        return worker_records(paths, shard_index, num_shards, True, self.seed)

    def _pad_batch(self, batch):
        return dict(batch, images=self.preprocessor.pad_batch(batch["images"], batch["image_info"]))

    def _stateless_seed(self, index):
        """[2] int64 seed of the element `index`: fixed by --seed when given, random otherwise."""
        base = self.seed if self.seed is not None else tf.random.uniform([], 0, 2**31 - 1, tf.int64)
        return tf.stack([tf.cast(base, tf.int64), tf.cast(index, tf.int64)])

    def _check_record(self, example, classes):
        """Checks of a decoded training record `example` (`decode_example`), whose objects left after the crowd
        regions are dropped have the classes [K] int32 (stateful ops: tf.data's functions run them in order
        without control dependencies). Assertions (`record_problem`): that each class is one of the model (1 ..
        num_classes - 1; 0 is the background), as a label past the classifier's outputs would otherwise stop
        training deep in the loss, and a 0 would make the object a negative; with a mask head, that the record
        holds a mask for each object (records converted with --noinclude_masks have none, and the input failed
        on them in a gather), example["gt_masks"] then replaced by the same masks made to wait for it. A warning
        on stderr, once per record and process, when K is more than data.max_num_instances: `pad_instances`
        keeps the first M, and the objects left out would otherwise turn into background for the anchors on them
        without a word."""
        source_id, num_classes = example["source_id"], self.model.num_classes
        record = tf.strings.join(["training record with source_id ", tf.strings.as_string(source_id)])
        bad = tf.logical_or(classes < 1, classes >= num_classes)
        labels = tf.strings.reduce_join(tf.strings.as_string(tf.boolean_mask(classes, bad)), separator=", ")
        tf.debugging.Assert(tf.logical_not(tf.reduce_any(bad)), [tf.strings.join([
            f"{RECORD_PROBLEM}--num_classes: {num_classes}, but a ", record, " holds class labels ", labels,
            f": the labels must be 1 to {num_classes - 1} (0 is the background); --num_classes is the largest "
            "category id plus one"])])
        if "gt_masks" in example:
            objects, masks = tf.size(example["gt_classes"]), tf.shape(example["gt_masks"])[0]
            masks_checked = tf.debugging.Assert(tf.equal(objects, masks), [tf.strings.join([
                f"{RECORD_PROBLEM}--data_dir: ", record, " holds ", tf.strings.as_string(objects), " objects and ",
                tf.strings.as_string(masks), " masks: a model with a mask head trains on their masks (convert the "
                "records without --noinclude_masks, or train boxes alone: --config_override "
                "model.include_mask=false)"])])
            # The masks' gather would otherwise fail first, in its own words (graph ops run as their inputs allow).
            with tf.control_dependencies([masks_checked]):
                example["gt_masks"] = tf.identity(example["gt_masks"])
        count = tf.size(classes)
        tf.cond(count > self.data.max_num_instances,
                lambda: tf.py_function(self._warn_overflow, [source_id, count], tf.bool), lambda: tf.constant(False))

    def _warn_overflow(self, source_id, count):
        """`_check_record`'s warning for scalar tensors `source_id` and `count`; returns True."""
        source_id, count = int(source_id), int(count)
        if source_id not in self.overflowed:
            self.overflowed.add(source_id)
            capacity = self.data.max_num_instances
            say(f"[data] warning: training record with source_id {source_id} holds {count} objects, more than "
                f"data.max_num_instances ({capacity}): the last {count - capacity} are left out of its targets, "
                f"where they count as background (--config_override data.max_num_instances={count} keeps them)",
                sys.stderr)
        return True

    def preprocess_train(self, index, serialized):
        """One training example.

        Returns:
          dict with images [H, W, 3] float32, image_info [5] float32, source_ids int64,
          gt_boxes [M, 4] float32 (-1 padded), gt_classes [M] int32 (-1 padded),
          gt_masks [M, S, S] float32 (with include_mask; -1 padded), rpn_score_targets
          {level: [H_l, W_l, A] int32}, rpn_box_targets {level: [H_l, W_l, 4A] float32}.
        """
        data = self.data
        include_mask = self.model.include_mask
        example = decode_example(serialized, include_masks=include_mask, dct_method=data.jpeg_dct_method)
        image, boxes, classes = example["image"], example["gt_boxes"], example["gt_classes"]
        keep = tf.ones_like(classes, tf.bool)
        if data.skip_crowd_during_training:
            keep = tf.logical_not(example["gt_is_crowd"])
        boxes, classes = tf.boolean_mask(boxes, keep), tf.boolean_mask(classes, keep)
        if not data.use_category:
            classes = tf.ones_like(classes)
        self._check_record(example, classes)  # and gt_masks made to wait for its check
        masks = tf.boolean_mask(example["gt_masks"], keep) if include_mask else None
        jitter = (data.aug_scale_min, data.aug_scale_max) != (1.0, 1.0)
        if jitter:
            # Its own stream of the element's seed, so that the flips and anchor samples stay those of a run
            # without jitter.
            draws = tf.random.stateless_uniform(
                [3], tf.random.experimental.stateless_fold_in(self._stateless_seed(index), 1))
            factor = data.aug_scale_min + draws[0] * (data.aug_scale_max - data.aug_scale_min)
            image, image_info, scale, window = self.preprocessor.scale_and_crop(image, factor, draws[1:])
            boxes, classes, masks = cut_to_window(boxes, classes, masks, window)
        # The mask crops, when the model has a mask branch, travel with the boxes through the flip.
        parts = (image, boxes)
        if include_mask:
            parts += (crop_instance_masks(masks, boxes, data.gt_mask_size),)
        if jitter:  # the image shows the window from here on
            parts = (image, (boxes - tf.tile(window[:2], [2])) * scale, *parts[2:])
            scale = 1.0
        flip_seed, anchor_seed = tf.unstack(tf.random.experimental.stateless_split(self._stateless_seed(index), 2))
        if data.augment_input_data:
            flip = tf.random.stateless_uniform([], flip_seed) < 0.5
            parts = tf.cond(flip, lambda: flip_horizontally(*parts), lambda: parts)
        image, boxes = parts[:2]
        if jitter:
            image = self.preprocessor.normalize_pad(image)
        else:
            image, image_info, scale = self.preprocessor.training_example(image)
        boxes = pad_instances(boxes * scale, data.max_num_instances, PADDING_BOX_VALUE)
        features = {
            "images": image,
            "image_info": image_info,
            "source_ids": example["source_id"],
            "gt_boxes": boxes,
            "gt_classes": pad_instances(classes, data.max_num_instances, PADDING_CLASS),
        }
        if include_mask:
            features["gt_masks"] = pad_instances(parts[2], data.max_num_instances, PADDING_MASK)
        rpn = self.model.rpn
        features.update(
            self.rpn_targets(
                self.anchors,
                boxes,
                data.image_size,
                positive_overlap=rpn.rpn_positive_overlap,
                negative_overlap=rpn.rpn_negative_overlap,
                batch_size_per_im=rpn.rpn_batch_size_per_im,
                fg_fraction=rpn.rpn_fg_fraction,
                seed=anchor_seed,
            )
        )
        return features

    def preprocess_eval(self, serialized):
        """One evaluation example: dict with images [H, W, 3] float32 (or [h', w', 3] when batches are padded to
        their own size: `Preprocessor.example`), image_info [5], source_ids int64."""
        example = decode_example(serialized, include_masks=False, dct_method=self.data.jpeg_dct_method)
        image, image_info, _ = self.preprocessor.example(example["image"])
        return {"images": image, "image_info": image_info, "source_ids": example["source_id"]}
