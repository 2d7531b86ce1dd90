"""Box math shared by every detection op: IoU, delta encoding/decoding, clipping, areas.

Box format: ``[ymin, xmin, ymax, xmax]`` float32, in pixels of the resized, padded input image.
Coordinates are continuous: a box's height is ``ymax - ymin`` and its width ``xmax - xmin`` (no "+1"),
matching RoIAlign with ``aligned=True``.

Padding: ground truth is padded to a static size with boxes that are all ``PADDING_BOX_VALUE`` (-1).
A box is treated as padding when its largest coordinate is negative (``is_padding``).

Deltas: ``(dy, dx, dh, dw)`` relative to a reference box (anchor or RoI), scaled by per-coordinate
weights ``(wy, wx, wh, ww)``:
``dy = wy * (yc - yc_ref) / h_ref``, ``dx = wx * (xc - xc_ref) / w_ref``,
``dh = wh * log(h / h_ref)``, ``dw = ww * log(w / w_ref)``.

This module holds pure, stateless tensor functions only: no sampling, no NMS, no knowledge of levels
or of the model.

Glossary: B batch, N boxes, K ground-truth boxes, ``...`` any broadcastable leading dimensions.
"""
import math

import tensorflow as tf

# Largest allowed (unweighted) log-scale change of height/width when decoding, so that exp() cannot
# blow a box up beyond 1000/16 times its reference size (Detectron's bound).
BBOX_XFORM_CLIP = math.log(1000.0 / 16.0)

# Value of every coordinate of a padded ground-truth box.
PADDING_BOX_VALUE = -1.0

# IoU reported for any pair where either box is padding.
PADDING_IOU = -1.0

# Floor on reference heights/widths and on encoded target sizes, so that degenerate (zero-area) boxes
# give large but finite deltas instead of inf/NaN.
_MIN_SIZE_EPS = 1e-6


def check_last_dim(tensor, size, name):
    """Raise ValueError when the static last dimension of ``tensor`` is known and differs from ``size``."""
    shape = tf.TensorShape(tensor.shape)
    last = shape[-1] if shape.rank else None
    if last is not None and last != size:
        raise ValueError(f"{name} must have last dimension {size}, got shape {shape}.")


def _as_boxes(boxes, name):
    boxes = tf.convert_to_tensor(boxes, dtype=tf.float32)
    check_last_dim(boxes, 4, name)
    return boxes


def is_padding(boxes):
    """Whether each box is padding.

    Args:
      boxes: [..., 4] float32 boxes [ymin, xmin, ymax, xmax].

    Returns:
      [...] bool, True where the box's largest coordinate is < 0 (a padded, all -1 box).
    """
    boxes = _as_boxes(boxes, "boxes")
    return tf.reduce_max(boxes, axis=-1) < 0.0


def box_area(boxes):
    """Area of each box.

    Args:
      boxes: [..., 4] float32 boxes [ymin, xmin, ymax, xmax].

    Returns:
      [...] float32 ``(ymax - ymin) * (xmax - xmin)``; negative extents are clamped to zero.
    """
    boxes = _as_boxes(boxes, "boxes")
    ymin, xmin, ymax, xmax = tf.unstack(boxes, axis=-1)
    return tf.maximum(ymax - ymin, 0.0) * tf.maximum(xmax - xmin, 0.0)


def bbox_overlap(boxes, gt_boxes):
    """Pairwise IoU between two padded sets of boxes, per batch element.

    Args:
      boxes: [B, N, 4] float32 boxes [ymin, xmin, ymax, xmax]; padded rows are all -1.
      gt_boxes: [B, K, 4] float32 boxes [ymin, xmin, ymax, xmax]; padded rows are all -1.

    Returns:
      [B, N, K] float32 IoU in [0, 1]; ``PADDING_IOU`` (-1) where either box is padding.
      Pairs of zero-area boxes have IoU 0 (no division by zero).
    """
    boxes = _as_boxes(boxes, "boxes")
    gt_boxes = _as_boxes(gt_boxes, "gt_boxes")
    if boxes.shape.rank != 3 or gt_boxes.shape.rank != 3:
        raise ValueError(
            f"boxes and gt_boxes must be [B, N, 4] and [B, K, 4], got {boxes.shape} and {gt_boxes.shape}.")
    # [B, N, 1] and [B, 1, K] coordinates, broadcast to [B, N, K].
    b_ymin, b_xmin, b_ymax, b_xmax = tf.split(boxes, 4, axis=-1)
    g_ymin, g_xmin, g_ymax, g_xmax = [tf.transpose(c, [0, 2, 1]) for c in tf.split(gt_boxes, 4, axis=-1)]
    inter_h = tf.maximum(tf.minimum(b_ymax, g_ymax) - tf.maximum(b_ymin, g_ymin), 0.0)
    inter_w = tf.maximum(tf.minimum(b_xmax, g_xmax) - tf.maximum(b_xmin, g_xmin), 0.0)
    intersection = inter_h * inter_w
    area_b = tf.maximum(b_ymax - b_ymin, 0.0) * tf.maximum(b_xmax - b_xmin, 0.0)
    area_g = tf.maximum(g_ymax - g_ymin, 0.0) * tf.maximum(g_xmax - g_xmin, 0.0)
    union = area_b + area_g - intersection
    iou = tf.math.divide_no_nan(intersection, union)
    padding = tf.logical_or(is_padding(boxes)[:, :, None], is_padding(gt_boxes)[:, None, :])
    return tf.where(padding, tf.constant(PADDING_IOU, tf.float32), iou)


def _centers_and_sizes(boxes):
    """[..., 4] boxes -> (yc, xc, h, w), each [...]."""
    ymin, xmin, ymax, xmax = tf.unstack(boxes, axis=-1)
    h = ymax - ymin
    w = xmax - xmin
    return ymin + 0.5 * h, xmin + 0.5 * w, h, w


def encode_boxes(boxes, anchors, weights=(1.0, 1.0, 1.0, 1.0)):
    """Encode boxes as weighted deltas relative to reference boxes.

    Args:
      boxes: [..., 4] float32 target boxes [ymin, xmin, ymax, xmax].
      anchors: [..., 4] float32 reference boxes [ymin, xmin, ymax, xmax], broadcastable with ``boxes``.
      weights: 4 floats (wy, wx, wh, ww) multiplying (dy, dx, dh, dw).

    Returns:
      [..., 4] float32 deltas (dy, dx, dh, dw), the broadcast shape of the inputs. Zero-size boxes or
      anchors give large finite values, never inf/NaN.
    """
    boxes = _as_boxes(boxes, "boxes")
    anchors = _as_boxes(anchors, "anchors")
    wy, wx, wh, ww = [float(w) for w in weights]
    yc, xc, h, w = _centers_and_sizes(boxes)
    yca, xca, ha, wa = _centers_and_sizes(anchors)
    ha = tf.maximum(ha, _MIN_SIZE_EPS)
    wa = tf.maximum(wa, _MIN_SIZE_EPS)
    h = tf.maximum(h, _MIN_SIZE_EPS)
    w = tf.maximum(w, _MIN_SIZE_EPS)
    return tf.stack([
        wy * (yc - yca) / ha,
        wx * (xc - xca) / wa,
        wh * tf.math.log(h / ha),
        ww * tf.math.log(w / wa),
    ], axis=-1)


def decode_boxes(deltas, anchors, weights=(1.0, 1.0, 1.0, 1.0)):
    """Apply weighted deltas to reference boxes (inverse of ``encode_boxes``).

    Args:
      deltas: [..., 4] float32 deltas (dy, dx, dh, dw), scaled by ``weights``.
      anchors: [..., 4] float32 reference boxes [ymin, xmin, ymax, xmax], broadcastable with ``deltas``.
      weights: 4 floats (wy, wx, wh, ww) the deltas were multiplied by.

    Returns:
      [..., 4] float32 boxes [ymin, xmin, ymax, xmax]. dh and dw are clipped at ``BBOX_XFORM_CLIP``
      after dividing by the weights, so that exp() stays finite.
    """
    deltas = _as_boxes(deltas, "deltas")
    anchors = _as_boxes(anchors, "anchors")
    wy, wx, wh, ww = [float(w) for w in weights]
    dy, dx, dh, dw = tf.unstack(deltas, axis=-1)
    dy = dy / wy
    dx = dx / wx
    dh = tf.minimum(dh / wh, BBOX_XFORM_CLIP)
    dw = tf.minimum(dw / ww, BBOX_XFORM_CLIP)
    yca, xca, ha, wa = _centers_and_sizes(anchors)
    yc = dy * ha + yca
    xc = dx * wa + xca
    h = tf.exp(dh) * ha
    w = tf.exp(dw) * wa
    return tf.stack([yc - 0.5 * h, xc - 0.5 * w, yc + 0.5 * h, xc + 0.5 * w], axis=-1)


def clip_boxes(boxes, image_hw):
    """Clip boxes to the image.

    Args:
      boxes: [..., 4] float32 boxes [ymin, xmin, ymax, xmax].
      image_hw: [..., 2] float (height, width) broadcastable with ``boxes[..., 0]`` (e.g. [B, 1, 2] for
        [B, N, 4] boxes), or a Python pair (h, w).

    Returns:
      [..., 4] float32 boxes with y in [0, h] and x in [0, w].
    """
    boxes = _as_boxes(boxes, "boxes")
    image_hw = tf.convert_to_tensor(image_hw, dtype=tf.float32)
    check_last_dim(image_hw, 2, "image_hw")
    height, width = tf.unstack(image_hw, axis=-1)
    ymin, xmin, ymax, xmax = tf.unstack(boxes, axis=-1)
    # minimum/maximum rather than clip_by_value: the bounds may broadcast to a larger shape.
    return tf.stack([
        tf.minimum(tf.maximum(ymin, 0.0), height),
        tf.minimum(tf.maximum(xmin, 0.0), width),
        tf.minimum(tf.maximum(ymax, 0.0), height),
        tf.minimum(tf.maximum(xmax, 0.0), width),
    ], axis=-1)
