"""Second-stage RoI sampling: label proposals against ground truth and draw a fixed-size training batch.

Box format: ``[ymin, xmin, ymax, xmax]`` float32, in pixels of the resized, padded input image, with
continuous coordinates (width = xmax - xmin). Padded proposals and padded ground-truth boxes are all
``box_ops.PADDING_BOX_VALUE`` (-1); padded ground-truth classes are -1 and real classes are >= 1.

Rules (Mask R-CNN / Detectron, as in NVIDIA's reference): the ground-truth boxes are appended to the
proposals as extra candidates; each candidate's IoU with every real ground-truth box decides its label.
Foreground: best IoU >= ``fg_thresh``. Background: ``bg_thresh_lo <= best IoU < bg_thresh_hi`` (and not
foreground). Padded candidates are neither. A real candidate in an image without ground truth has best
IoU 0. At most ``round(S * fg_fraction)`` foreground candidates are drawn uniformly at random, background
fills the rest of the S slots, and slots left over are invalid.

Everything has static output shapes, works on a whole batch inside ``tf.function`` and carries no
gradient (the sample is a constant for the losses).

Glossary: B batch, P proposals, K ground-truth boxes, C = P + K candidates, S sampled RoIs
(``batch_size_per_im``), F = round(S * fg_fraction) foreground slots at most.
"""
import tensorflow as tf

from mrcnn_tf2.ops import box_ops


def _check_arguments(proposals, gt_boxes, gt_classes, batch_size_per_im, fg_fraction, fg_thresh,
                     bg_thresh_hi, bg_thresh_lo, bbox_reg_weights):
    """Raise ValueError on malformed shapes or parameters of ``sample_rois``."""
    for name, tensor, rank in (("proposals", proposals, 3), ("gt_boxes", gt_boxes, 3),
                               ("gt_classes", gt_classes, 2)):
        if tensor.shape.rank != rank:
            raise ValueError(f"{name} must have rank {rank}, got shape {tensor.shape}.")
    box_ops.check_last_dim(proposals, 4, "proposals")
    box_ops.check_last_dim(gt_boxes, 4, "gt_boxes")
    if not gt_boxes.shape[:2].is_compatible_with(gt_classes.shape):
        raise ValueError(f"gt_classes shape {gt_classes.shape} must be gt_boxes' [B, K] {gt_boxes.shape[:2]}.")
    if not isinstance(batch_size_per_im, int) or batch_size_per_im < 1:
        raise ValueError(f"batch_size_per_im must be a positive int, got {batch_size_per_im!r}.")
    if not 0.0 <= fg_fraction <= 1.0:
        raise ValueError(f"fg_fraction must be in [0, 1], got {fg_fraction}.")
    if not 0.0 <= bg_thresh_lo <= bg_thresh_hi:
        raise ValueError(f"bg_thresh_lo ({bg_thresh_lo}) must be in [0, bg_thresh_hi ({bg_thresh_hi})].")
    if not 0.0 <= fg_thresh <= 1.0:
        raise ValueError(f"fg_thresh must be in [0, 1], got {fg_thresh}.")
    if len(bbox_reg_weights) != 4 or min(bbox_reg_weights) <= 0:
        raise ValueError(f"bbox_reg_weights must be 4 positive floats, got {bbox_reg_weights!r}.")


def _top_candidates(mask, keys, count):
    """Up to ``count`` candidates where ``mask`` holds, in descending order of ``keys``.

    Args:
      mask: [B, C] bool, the candidates that may be chosen.
      keys: [B, C] float32 random priorities in [0, 1).
      count: Python int, how many slots to fill.

    Returns:
      (indices, num): [B, count] int32 positions into C (arbitrary past ``num``) and [B] int32, how many
      of them are real candidates (min(count, mask.sum())).
    """
    k = tf.minimum(count, tf.shape(mask)[1])
    # Non-candidates rank below every candidate (keys are >= 0).
    _, indices = tf.math.top_k(tf.where(mask, keys, -1.0), k=k, sorted=True)  # [B, k]
    indices = tf.pad(indices, [[0, 0], [0, count - k]])
    num = tf.minimum(tf.reduce_sum(tf.cast(mask, tf.int32), axis=1), count)
    return indices, num


def sample_rois(proposals, gt_boxes, gt_classes, batch_size_per_im=512, fg_fraction=0.25, fg_thresh=0.5,
                bg_thresh_hi=0.5, bg_thresh_lo=0.0, bbox_reg_weights=(10.0, 10.0, 5.0, 5.0), seed=None):
    """Label candidate RoIs against the ground truth and sample S of them per image (see module docstring).

    A ground-truth box is real when its box is not padding and its class is >= 1; only real boxes are
    matched. Every non-degenerate real ground-truth box is itself a foreground candidate (IoU 1 with
    itself); a zero-area one overlaps nothing (IoU 0) and is never matched. Ties in best IoU go to the
    lowest ground-truth index.

    Args:
      proposals: [B, P, 4] float boxes [ymin, xmin, ymax, xmax]; padded rows all -1 (any float dtype).
      gt_boxes: [B, K, 4] float ground-truth boxes; padded rows all -1, anywhere in K.
      gt_classes: [B, K] int ground-truth classes >= 1; padded entries -1.
      batch_size_per_im: int S, RoIs sampled per image.
      fg_fraction: float, largest fraction of foreground slots: at most F = round(S * fg_fraction).
      fg_thresh: float, best IoU at or above which a candidate is foreground.
      bg_thresh_hi, bg_thresh_lo: floats, a non-foreground candidate is background when
        bg_thresh_lo <= best IoU < bg_thresh_hi.
      bbox_reg_weights: 4 floats (wy, wx, wh, ww) of the box-target encoding.
      seed: optional [2] int32/int64 stateless seed, so that the draw is reproducible; None draws afresh.

    Returns:
      dict of tensors, slots ordered foreground first, then background, then invalid (foreground and
      background each in random order), so ``[:, :F]`` holds every sampled foreground RoI:
        'rois': [B, S, 4] float32 sampled boxes; invalid slots are padding (all -1).
        'class_targets': [B, S] int32 matched ground-truth class for foreground, 0 otherwise.
        'box_targets': [B, S, 4] float32 ``encode_boxes(matched_gt_box, roi, bbox_reg_weights)`` for
          foreground, 0 otherwise.
        'matched_gt_indices': [B, S] int32 index into K of the matched ground truth; only meaningful
          where 'is_foreground' (0 elsewhere).
        'matched_gt_boxes': [B, S, 4] float32 matched ground-truth box for foreground; padding (all -1)
          otherwise.
        'is_foreground': [B, S] bool.
        'is_valid': [B, S] bool, foreground or background.

    Raises:
      ValueError: wrong ranks or last dimensions, or parameters out of range.
    """
    proposals = tf.cast(tf.convert_to_tensor(proposals), tf.float32)
    gt_boxes = tf.cast(tf.convert_to_tensor(gt_boxes), tf.float32)
    gt_classes = tf.cast(tf.convert_to_tensor(gt_classes), tf.int32)
    _check_arguments(proposals, gt_boxes, gt_classes, batch_size_per_im, fg_fraction, fg_thresh,
                     bg_thresh_hi, bg_thresh_lo, bbox_reg_weights)
    num_samples = batch_size_per_im
    max_foreground = int(round(num_samples * fg_fraction))

    # Ground truth with a padding class is treated as a padding box, so both padding markers agree.
    gt_real = tf.logical_and(tf.logical_not(box_ops.is_padding(gt_boxes)), gt_classes >= 1)  # [B, K]
    gt_boxes = tf.where(gt_real[..., None], gt_boxes, box_ops.PADDING_BOX_VALUE)
    # One extra padding column keeps the IoU reductions and gathers below defined when K == 0.
    batch = tf.shape(gt_boxes)[0]
    gt_boxes = tf.concat([gt_boxes, tf.fill([batch, 1, 4], box_ops.PADDING_BOX_VALUE)], axis=1)
    gt_classes = tf.concat([gt_classes, tf.zeros([batch, 1], tf.int32)], axis=1)

    candidates = tf.concat([proposals, gt_boxes[:, :-1]], axis=1)  # [B, C, 4]
    candidate_padding = box_ops.is_padding(candidates)  # [B, C]
    iou = box_ops.bbox_overlap(candidates, gt_boxes)  # [B, C, K + 1]; -1 on padded pairs
    # Real-vs-real IoU is >= 0, so the floor at 0 only gives real candidates of GT-less images IoU 0.
    max_iou = tf.where(candidate_padding, box_ops.PADDING_IOU, tf.maximum(tf.reduce_max(iou, axis=2), 0.0))
    matched = tf.argmax(iou, axis=2, output_type=tf.int32)  # [B, C]

    foreground = max_iou >= fg_thresh
    # Padded candidates have max_iou -1, below bg_thresh_lo (>= 0), so they are never background.
    background = (max_iou >= bg_thresh_lo) & (max_iou < bg_thresh_hi) & ~foreground

    if seed is None:
        keys = tf.random.uniform(tf.shape(max_iou))
    else:
        keys = tf.random.stateless_uniform(tf.shape(max_iou), seed)
    fg_indices, num_fg = _top_candidates(foreground, keys, max_foreground)  # [B, F], [B]
    bg_indices, num_bg = _top_candidates(background, keys, num_samples)  # [B, S], [B]

    # Slot s takes foreground s while s < num_fg, then background s - num_fg: a gather from the two
    # index lists side by side, with a per-image offset.
    slots = tf.range(num_samples)[None, :]  # [1, S]
    is_foreground = slots < num_fg[:, None]  # [B, S]
    is_valid = slots < (num_fg + num_bg)[:, None]
    source = tf.where(is_foreground, slots, max_foreground + slots - num_fg[:, None])
    indices = tf.gather(tf.concat([fg_indices, bg_indices], axis=1), source, batch_dims=1)  # [B, S]

    rois = tf.gather(candidates, indices, batch_dims=1)
    rois = tf.where(is_valid[..., None], rois, box_ops.PADDING_BOX_VALUE)
    matched_gt_indices = tf.where(is_foreground, tf.gather(matched, indices, batch_dims=1), 0)
    matched_gt_boxes = tf.gather(gt_boxes, matched_gt_indices, batch_dims=1)
    matched_gt_boxes = tf.where(is_foreground[..., None], matched_gt_boxes, box_ops.PADDING_BOX_VALUE)
    class_targets = tf.where(is_foreground, tf.gather(gt_classes, matched_gt_indices, batch_dims=1), 0)
    box_targets = box_ops.encode_boxes(matched_gt_boxes, rois, bbox_reg_weights)
    box_targets = tf.where(is_foreground[..., None], box_targets, 0.0)
    return {
        "rois": tf.stop_gradient(rois),
        "class_targets": class_targets,
        "box_targets": tf.stop_gradient(box_targets),
        "matched_gt_indices": matched_gt_indices,
        "matched_gt_boxes": tf.stop_gradient(matched_gt_boxes),
        "is_foreground": is_foreground,
        "is_valid": is_valid,
    }
