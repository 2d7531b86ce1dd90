"""Multilevel RoIAlign: crop fixed-size feature patches for boxes from an FPN feature pyramid.

Box format: ``[ymin, xmin, ymax, xmax]`` float32, in pixels of the resized, padded input image, with
continuous coordinates (width = xmax - xmin). Padded boxes are all -1.

Sampling follows torchvision's ``roi_align(..., aligned=aligned)`` exactly, for either value of ``aligned``:

* a box on level ``l`` is scaled by ``1 / 2**l``;
* ``aligned=True`` (the default; Detectron2's convention) then shifts it by -0.5, so that feature cell
  ``(y, x)`` has its centre at continuous coordinate ``(y, x)``;
* ``aligned=False`` (the original Mask R-CNN's) does not shift it, so every sample reads the features half a
  cell off the box's true geometry; it also forces the box's height and width to at least 1 cell, so that
  tiny boxes spread their samples over a cell;
* the box is split into ``output_size x output_size`` bins; each bin averages
  ``sampling_ratio x sampling_ratio`` bilinear samples at the centres of a regular sub-grid;
* a sample outside ``[-1, H] x [-1, W]`` contributes 0; coordinates in ``[-1, 0)`` are clamped to 0 and
  those in ``(H - 1, H]`` to ``H - 1`` (likewise for x).

Both conventions exist because weights are tied to the one they were trained with: ``aligned=True`` is the
correct half-pixel geometry, but torchvision's Mask R-CNN weights were trained with ``aligned=False``
(``torchvision.ops.MultiScaleRoIAlign`` uses it), and running them with the other convention shifts every
crop by half a cell.

Each box reads from one level (FPN paper, eq. 1): ``floor(4 + log2(sqrt(h * w) / 224))``, clipped to the
levels given. Arithmetic is float32 whatever the features' dtype; the result has the features' dtype.
Gradients flow to the features only: boxes are treated as constants.

Implementation: all levels are flattened into one float32 [B, T, C] table (T = sum of H_l * W_l) and every box
gathers, from its own level, the feature vectors at the 2 * S rows and 2 * S columns its samples touch
(S = output_size * sampling_ratio samples per axis). The bilinear weights and the bin averaging are
separable, so the [2S, 2S] gathered grid is reduced to [output_size, output_size] by two small
contractions, one per axis.

Glossary: B batch, N boxes, C channels, R output_size, s sampling_ratio, S = R * s.
"""
import math

import numpy as np
import tensorflow as tf

from mrcnn_tf2.ops import box_ops

# FPN eq. 1: a box of this side (pixels) is pooled from CANONICAL_LEVEL.
CANONICAL_BOX_SIZE = 224.0
CANONICAL_LEVEL = 4

# Added to log2(size / 224) before flooring, so that sides that are exact powers of two (112, 224, 448)
# land on their level despite float rounding in the logarithm.
_LEVEL_EPS = 1e-6

# Floor on the box area inside log(), so that empty and padded boxes give a finite (lowest) level.
_MIN_AREA = 1e-8


def assign_levels(boxes, min_level, max_level):
    """FPN level each box is pooled from (FPN paper, eq. 1).

    Args:
      boxes: [..., 4] float32 boxes [ymin, xmin, ymax, xmax] in pixels.
      min_level, max_level: ints, the range of levels available.

    Returns:
      [...] int32 ``clip(floor(4 + log2(sqrt(h * w) / 224)), min_level, max_level)``; empty and padded
      boxes get ``min_level``.
    """
    if min_level > max_level:
        raise ValueError(f"min_level ({min_level}) must be <= max_level ({max_level}).")
    area = tf.maximum(box_ops.box_area(boxes), _MIN_AREA)
    # log2(sqrt(area) / 224) = 0.5 * log2(area) - log2(224).
    log2_size = 0.5 * tf.math.log(area) / math.log(2.0) - math.log2(CANONICAL_BOX_SIZE)
    level = tf.floor(CANONICAL_LEVEL + log2_size + _LEVEL_EPS)
    # Clip while still float: an unclipped huge value must not overflow the int cast.
    return tf.cast(tf.clip_by_value(level, float(min_level), float(max_level)), tf.int32)


def _axis_samples(start, length, size, output_size, sampling_ratio):
    """Bilinear taps of regularly spaced samples along one axis, torchvision's rules.

    Args:
      start: [B, N] float32 first edge of the box, in cells of its level (shifted by -0.5 if aligned).
      length: [B, N] float32 box extent in cells (at least 1 unless aligned).
      size: [B, N] float32 the level's extent along this axis (H_l or W_l).
      output_size, sampling_ratio: ints R and s; S = R * s samples along the axis.

    Returns:
      (indices, weights): [B, N, 2S] int32 cell indices in [0, size - 1] and [B, N, 2S] float32 weights;
      entry 2m is sample m's lower tap and 2m + 1 its upper tap. Weights are 0 for samples outside
      [-1, size].
    """
    num_samples = output_size * sampling_ratio
    bin_size = length[..., None] / output_size
    bin_index = tf.repeat(tf.range(output_size, dtype=tf.float32), sampling_ratio)  # [S]
    in_bin = tf.tile(tf.range(sampling_ratio, dtype=tf.float32), [output_size]) + 0.5  # [S]
    # torchvision's expression in its order of operations, so that the coordinates round as its kernel's do:
    # another order moves samples at coordinates near 100 by ~1e-5 cells, and the outputs by as much.
    coords = start[..., None] + bin_index * bin_size + in_bin * bin_size / sampling_ratio  # [B, N, S]
    size = size[..., None]
    inside = tf.cast(tf.logical_and(coords >= -1.0, coords <= size), tf.float32)
    coords = tf.clip_by_value(coords, 0.0, size - 1.0)
    low = tf.floor(coords)
    high = tf.minimum(low + 1.0, size - 1.0)
    frac = coords - low
    indices = tf.stack([low, high], axis=-1)  # [B, N, S, 2]
    weights = tf.stack([(1.0 - frac) * inside, frac * inside], axis=-1)
    new_shape = tf.concat([tf.shape(coords)[:2], [2 * num_samples]], axis=0)
    return tf.reshape(tf.cast(indices, tf.int32), new_shape), tf.reshape(weights, new_shape)


def _bin_weights(tap_weights, output_size, sampling_ratio):
    """Spread per-tap weights into a [R, 2S] matrix that also averages the samples of each bin.

    Args:
      tap_weights: [B, N, 2S] float32 from ``_axis_samples``.

    Returns:
      [B, N, R, 2S] float32: row r holds the taps of bin r's samples, divided by sampling_ratio.
    """
    taps_per_bin = 2 * sampling_ratio
    # bin_of_tap[r, t] is 1 where tap t belongs to a sample of bin r.
    # A constant, not tf.eye: OpenVINO converts no MatrixDiag op.
    bin_of_tap = tf.constant(np.repeat(np.eye(output_size, dtype=np.float32), taps_per_bin, axis=1))  # [R, 2S]
    # expand_dims, not [:, :, None, :]: TFLite's builtin StridedSlice takes no new axis.
    return tf.expand_dims(tap_weights, 2) * bin_of_tap / float(sampling_ratio)


def _check_features(features):
    """Validate the pyramid; return (sorted levels, {level: tensor})."""
    if not isinstance(features, dict) or not features:
        raise ValueError("features must be a non-empty dict {level: [B, H, W, C] tensor}.")
    levels = sorted(features)
    features = {level: tf.convert_to_tensor(features[level]) for level in levels}
    if any(not isinstance(level, int) for level in levels):
        raise ValueError(f"features keys must be int levels, got {levels}.")
    if levels != list(range(levels[0], levels[-1] + 1)):
        raise ValueError(f"features levels must be consecutive, got {levels}.")
    dtypes = {tf.as_dtype(features[level].dtype) for level in levels}
    if len(dtypes) != 1 or not next(iter(dtypes)).is_floating:
        raise ValueError(f"features must all share one float dtype, got {sorted(d.name for d in dtypes)}.")
    channels = {features[level].shape[-1] for level in levels}
    if any(features[level].shape.rank != 4 for level in levels) or len(channels) != 1 or None in channels:
        raise ValueError("features must all be [B, H, W, C] with the same static C, got shapes "
                         f"{[tuple(features[level].shape) for level in levels]}.")
    return levels, features


def check_arguments(features, boxes, output_size, sampling_ratio, aligned):
    """Validate ``multilevel_roi_align``'s arguments (shared with its fused twin).

    Returns:
      (sorted levels, {level: tensor}, boxes as a [B, N, 4] float32 tensor without gradient).
    """
    levels, features = _check_features(features)
    if not isinstance(output_size, int) or output_size < 1:
        raise ValueError(f"output_size must be a positive int, got {output_size!r}.")
    if not isinstance(sampling_ratio, int) or sampling_ratio < 1:
        raise ValueError(f"sampling_ratio must be a positive int, got {sampling_ratio!r}.")
    # A bool only: a tensor or a string such as "False" would silently pick a convention.
    if not isinstance(aligned, bool):
        raise ValueError(f"aligned must be a bool, got {aligned!r}.")
    boxes = tf.stop_gradient(tf.convert_to_tensor(boxes, dtype=tf.float32))
    box_ops.check_last_dim(boxes, 4, "boxes")
    if boxes.shape.rank != 3:
        raise ValueError(f"boxes must be [B, N, 4], got shape {boxes.shape}.")
    return levels, features, boxes


def multilevel_roi_align(features, boxes, output_size, sampling_ratio=2, aligned=True):
    """RoIAlign of each box from its FPN level (see the module docstring for the exact sampling).

    Args:
      features: {level (int): [B, H_l, W_l, C] tensor} of consecutive levels, stride ``2**level``, all
        of one float dtype (float32, bfloat16, float16 ...).
      boxes: [B, N, 4] float32 boxes [ymin, xmin, ymax, xmax] in input-image pixels; padded rows all -1.
      output_size: int R, side of the output patch.
      sampling_ratio: int s >= 1, samples per bin along each axis.
      aligned: bool, torchvision's ``aligned``: True shifts boxes by -0.5 cell; False does not and makes
        them at least 1 cell high and wide.

    Returns:
      [B, N, R, R, C] in the features' dtype. Padded and empty boxes give finite values (read from the
      lowest level). Differentiable w.r.t. ``features``; no gradient reaches ``boxes``.
    """
    levels, features, boxes = check_arguments(features, boxes, output_size, sampling_ratio, aligned)
    dtype = features[levels[0]].dtype
    channels = features[levels[0]].shape[-1]

    # One float32 [B, T, C] table over all levels; per-level height, width and start offset in T.
    # Casting before the gather also makes the gradient's scatter-add accumulate in float32.
    sizes = [tf.shape(features[level])[1:3] for level in levels]  # each (H_l, W_l)
    table = tf.concat([tf.reshape(tf.cast(features[level], tf.float32), [-1, size[0] * size[1], channels])
                       for level, size in zip(levels, sizes)], axis=1)
    heights = tf.cast(tf.stack([s[0] for s in sizes]), tf.float32)
    widths = tf.cast(tf.stack([s[1] for s in sizes]), tf.float32)
    counts = tf.stack([s[0] * s[1] for s in sizes])
    offsets = tf.cumsum(counts, exclusive=True)

    level_index = assign_levels(boxes, levels[0], levels[-1]) - levels[0]  # [B, N]
    scale = tf.pow(2.0, -tf.cast(level_index + levels[0], tf.float32))
    height = tf.gather(heights, level_index)
    width = tf.gather(widths, level_index)
    ymin, xmin, ymax, xmax = tf.unstack(boxes * scale[..., None] - (0.5 if aligned else 0.0), axis=-1)
    box_height, box_width = ymax - ymin, xmax - xmin
    if not aligned:
        box_height, box_width = tf.maximum(box_height, 1.0), tf.maximum(box_width, 1.0)
    y_index, y_weight = _axis_samples(ymin, box_height, height, output_size, sampling_ratio)
    x_index, x_weight = _axis_samples(xmin, box_width, width, output_size, sampling_ratio)

    # Flat table row of every (y tap, x tap) pair: [B, N, 2S, 2S].
    row_start = tf.gather(offsets, level_index)[..., None] + y_index * tf.cast(width, tf.int32)[..., None]
    flat = row_start[..., :, None] + x_index[..., None, :]
    batch, num_boxes = tf.shape(boxes)[0], tf.shape(boxes)[1]
    # One gather from the [B * T, C] table rather than a gather with a batch dimension, which OpenVINO's CPU
    # plugin runs with its reference kernel.
    flat += (tf.range(batch) * tf.shape(table)[1])[:, None, None, None]
    grid = tf.gather(tf.reshape(table, [-1, channels]), tf.reshape(flat, [-1]))
    taps = 2 * output_size * sampling_ratio
    grid = tf.reshape(grid, [batch, num_boxes, taps, taps * channels])

    # The two separable reductions as matrix products (einsum became transposes around them in OpenVINO).
    y_bins = _bin_weights(y_weight, output_size, sampling_ratio)  # [B, N, R, 2S]
    x_bins = _bin_weights(x_weight, output_size, sampling_ratio)
    pooled = tf.reshape(tf.matmul(y_bins, grid), [batch, num_boxes, output_size, taps, channels])
    pooled = tf.matmul(tf.expand_dims(x_bins, 2), pooled)  # [B, N, 1, R, 2S] x [B, N, R, 2S, C]
    return tf.cast(pooled, dtype)
