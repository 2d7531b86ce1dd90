"""Multilevel anchor boxes and the RPN training targets (anchor labels) of one image.

Box format: ``[ymin, xmin, ymax, xmax]`` float32, in pixels of the resized, padded input image, with
continuous coordinates (width = xmax - xmin). Ground truth is padded with all -1 boxes
(``box_ops.PADDING_BOX_VALUE``).

Anchor layout, shared with the RPN head: on level l (stride 2**l, or torchvision's size // grid where a
coarse level's grid rounds up: ``level_strides``) the anchors form a ``[H_l, W_l, A]`` grid, flattened
row-major over (y, x, anchor) to ``[H_l*W_l*A, 4]``; anchor index ``a = s * len(aspect_ratios) + r`` for
octave scale s and aspect ratio r. So the head's score map
``[B, H_l, W_l, A] -> [B, H_l*W_l*A]`` and box map ``[B, H_l, W_l, 4A] -> [B, H_l*W_l*A, 4]`` (channels
``4a:4a+4`` = (dy, dx, dh, dw) of anchor a) line up with the anchors element by element.

``rpn_targets`` runs per image inside the tf.data input pipeline: it is pure TF, has static output
shapes and no Python loop over data. It must not know about the model or batch several images.

Glossary: M anchors of all levels (M_l on level l), K ground-truth boxes, A anchors per location.
"""
import numpy as np
import tensorflow as tf

from mrcnn_tf2.ops import box_ops

# Values of ``rpn_score_targets``.
RPN_POSITIVE = 1
RPN_NEGATIVE = 0
RPN_IGNORE = -1

# Box-delta weights of the RPN (unweighted deltas, as in NVIDIA's reference).
RPN_BOX_WEIGHTS = (1.0, 1.0, 1.0, 1.0)


def num_anchors_per_location(num_scales, aspect_ratios):
    """A: how many anchors share one feature-map location."""
    return num_scales * len(aspect_ratios)


def feature_size(image_size, level):
    """(H_l, W_l) of level ``level`` for an input of ``image_size`` (h, w) pixels: rounded up, as stride-2
    convs and subsamplings of an odd size give (an 800-pixel side: P5 25, P6 13)."""
    return -(-image_size[0] // 2 ** level), -(-image_size[1] // 2 ** level)


def level_strides(image_size, grid):
    """(stride_y, stride_x) of a level's anchors: the input's size // the level's grid, as torchvision's
    AnchorGenerator computes it (2**level when the size is a multiple of it; 800 pixels over 13 cells: 61)."""
    return image_size[0] // grid[0], image_size[1] // grid[1]


def base_anchors(level, num_scales, aspect_ratios, anchor_scale, round_corners=False):
    """The A anchors of one level centred at (0, 0): [A, 4] float32 NumPy [ymin, xmin, ymax, xmax] pixels.

    The anchor of octave scale s (0 <= s < num_scales) and aspect ratio (ar_x, ar_y) has base size
    ``anchor_scale * 2**level * 2**(s / num_scales)``, width ``size * ar_x`` and height ``size * ar_y``;
    index ``a = s * len(aspect_ratios) + r``. ``round_corners`` rounds each corner to a whole pixel (half to
    even), as torchvision's AnchorGenerator does with its base anchors.
    """
    sizes = [anchor_scale * 2.0 ** level * 2.0 ** (s / num_scales) for s in range(num_scales)]
    half = np.array([(size * ar_y / 2.0, size * ar_x / 2.0) for size in sizes for ar_x, ar_y in aspect_ratios])
    corners = np.concatenate([-half, half], axis=1)  # [A, 4]: -h/2, -w/2, h/2, w/2
    if round_corners:
        corners = np.round(corners)
    return corners.astype(np.float32)


def grid_anchors(base, grid_hw, stride_hw, offset):
    """One level's anchors: ``base`` repeated over the feature grid, row-major over (y, x, anchor).

    Works on static and dynamic sizes (the model computes the anchors of each batch's padded size).

    Args:
      base: [A, 4] float32 anchors centred at (0, 0) (``base_anchors``).
      grid_hw: (H_l, W_l) ints or an int32 [2] tensor, the level's feature grid.
      stride_hw: (stride_y, stride_x) ints or an int32 [2] tensor, pixels between grid rows and columns.
      offset: float, anchor (i, j) is centred at ((i + offset) * stride_y, (j + offset) * stride_x).

    Returns:
      [H_l*W_l*A, 4] float32 tensor of boxes [ymin, xmin, ymax, xmax].
    """
    grid_hw = tf.cast(grid_hw, tf.int32)
    stride = tf.cast(stride_hw, tf.float32)
    yc = (tf.range(grid_hw[0], dtype=tf.float32) + offset) * stride[0]
    xc = (tf.range(grid_hw[1], dtype=tf.float32) + offset) * stride[1]
    yc, xc = tf.meshgrid(yc, xc, indexing="ij")  # [H, W] each
    centres = tf.expand_dims(tf.stack([yc, xc, yc, xc], axis=-1), 2)  # [H, W, 1, 4]
    return tf.reshape(centres + tf.constant(base, tf.float32), [-1, 4])


def generate_anchors(min_level, max_level, num_scales, aspect_ratios, anchor_scale, image_size, offset=0.5,
                     round_corners=False):
    """Anchor boxes of every FPN level for a fixed input size (``base_anchors`` over ``grid_anchors``).

    On level l the grid is ``feature_size(image_size, l)`` and the stride ``level_strides`` (2**l where the
    size is a multiple of it). Anchors crossing the image border are kept (NVIDIA's labeler allows any border).

    Args:
      min_level, max_level: int, first and last FPN level (inclusive).
      num_scales: int, octave scales per level.
      aspect_ratios: sequence of (x, y) multipliers, e.g. ((1.0, 1.0), (1.4, 0.7), (0.7, 1.4)).
      anchor_scale: float, base anchor size in units of the level's stride.
      image_size: (height, width) of the padded input in pixels.
      offset: float, anchors are centred at (i + offset) * stride (0.5: cell centres; torchvision: 0).
      round_corners: round the base anchors' corners to whole pixels (torchvision).

    Returns:
      dict level -> [H_l*W_l*A, 4] float32 NumPy array of boxes [ymin, xmin, ymax, xmax], ordered
      row-major over (y, x, anchor) as described in the module docstring.

    Raises:
      ValueError: the levels are empty.
    """
    size = int(image_size[0]), int(image_size[1])
    if max_level < min_level:
        raise ValueError(f"max_level ({max_level}) must be >= min_level ({min_level}).")
    grids = {level: feature_size(size, level) for level in range(min_level, max_level + 1)}
    return {level: grid_anchors(base_anchors(level, num_scales, aspect_ratios, anchor_scale, round_corners),
                                grid, level_strides(size, grid), offset).numpy()
            for level, grid in grids.items()}


def _sample(candidates, keys, max_count, limit=None):
    """Choose at most ``max_count`` (and at most ``limit``) candidates uniformly at random.

    Args:
      candidates: [M] bool, the anchors that may be chosen.
      keys: [M] float32 uniform random numbers in [0, 1); the largest keys among candidates win.
      max_count: Python int, static upper bound of the number chosen.
      limit: optional int32 scalar tensor <= max_count, a tighter data-dependent bound.

    Returns:
      (chosen, indices): chosen is [M] bool, true for the chosen anchors; indices is [n] int32, their
      positions (n <= max_count, dynamic).
    """
    num_anchors = tf.shape(candidates)[0]
    # Non-candidates get a key below every candidate's, so top_k ranks all candidates first.
    ranked = tf.where(candidates, keys, -1.0)
    _, indices = tf.math.top_k(ranked, k=tf.minimum(max_count, num_anchors), sorted=True)
    count = tf.reduce_sum(tf.cast(candidates, tf.int32))
    if limit is not None:
        count = tf.minimum(count, limit)
    indices = indices[:count]
    chosen = tf.scatter_nd(indices[:, None], tf.ones_like(indices, tf.bool), [num_anchors])
    return chosen, indices


def _check_anchor_grid(boxes, level, grid, image_size):
    """Raise ValueError unless ``boxes`` look like ``generate_anchors`` output for ``image_size``.

    ``_grid_iou`` relies on the grid layout, so a wrong image_size would silently give wrong labels:
    check the row count and, when the values are known statically, the centre of the last anchor.
    """
    box_ops.check_last_dim(boxes, 4, f"anchors[{level}]")
    feat_h, feat_w = grid
    message = f"anchors[{level}] do not form the {feat_h}x{feat_w} grid of image_size {tuple(image_size)}"
    if boxes.shape[0] is not None and (boxes.shape[0] == 0 or boxes.shape[0] % (feat_h * feat_w)):
        raise ValueError(f"{message}: {boxes.shape[0]} rows.")
    values = tf.get_static_value(boxes)
    if values is not None:
        last = values[-1]
        centre = np.array(((last[0] + last[2]) / 2, (last[1] + last[3]) / 2))
        # The last anchor sits in the last grid cell, wherever in it the anchor offset puts it.
        stride = np.array(level_strides(image_size, grid))
        low = (np.array(grid) - 1) * stride
        if np.any(centre < low - 1e-3) or np.any(centre >= low + stride):
            raise ValueError(f"{message}: last anchor centred at {tuple(centre)}, outside the last cell "
                             f"[{low[0]}, {low[0] + stride[0]}) x [{low[1]}, {low[1] + stride[1]}).")


def _grid_iou(level_anchors, feat_h, feat_w, gt_boxes):
    """IoU of one level's anchors with the ground truth, exploiting the anchor grid.

    An anchor's y-extent depends only on its row and anchor index, its x-extent only on its column and
    anchor index, so the intersection factors into [H, A, K] heights times [W, A, K] widths. This needs
    three passes over the [H, W, A, K] result instead of the ~20 of ``box_ops.bbox_overlap`` (which
    it equals; the tests check it).

    Args:
      level_anchors: [H*W*A, 4] float32 anchors [ymin, xmin, ymax, xmax] from ``generate_anchors``.
      feat_h, feat_w: ints, the level's grid size.
      gt_boxes: [K, 4] float32 boxes [ymin, xmin, ymax, xmax] without padding rows.

    Returns:
      [H, W, A, K] float32 IoU; zero-area ground truth gives 0.
    """
    grid = tf.reshape(level_anchors, [feat_h, feat_w, -1, 4])
    a_ymin, a_ymax = grid[:, 0, :, 0, None], grid[:, 0, :, 2, None]  # [H, A, 1]
    a_xmin, a_xmax = grid[0, :, :, 1, None], grid[0, :, :, 3, None]  # [W, A, 1]
    g_ymin, g_xmin, g_ymax, g_xmax = tf.unstack(gt_boxes, axis=-1)  # [K] each
    inter_h = tf.nn.relu(tf.minimum(a_ymax, g_ymax) - tf.maximum(a_ymin, g_ymin))  # [H, A, K]
    inter_w = tf.nn.relu(tf.minimum(a_xmax, g_xmax) - tf.maximum(a_xmin, g_xmin))  # [W, A, K]
    anchor_area = (a_ymax[0] - a_ymin[0]) * (a_xmax[0] - a_xmin[0])  # [A, 1]
    area_sum = anchor_area + box_ops.box_area(gt_boxes)  # [A, K]
    intersection = inter_h[:, None] * inter_w[None, :]  # [H, W, A, K]
    return tf.math.divide_no_nan(intersection, area_sum - intersection)


def rpn_targets(anchors, gt_boxes, image_size, positive_overlap=0.7, negative_overlap=0.3,
                batch_size_per_im=256, fg_fraction=0.5, seed=None):
    """Label and encode the anchors of one image for the RPN losses.

    Matching: an anchor whose best IoU with a ground-truth box is >= ``positive_overlap`` is positive,
    < ``negative_overlap`` negative, in between ignored. For each ground-truth box, the anchors with
    its highest IoU (ties included) are positive too, when that IoU is > 0. A positive anchor regresses
    to the ground-truth box it overlaps most. Then at most ``batch_size_per_im * fg_fraction`` positives
    are kept, chosen uniformly at random, and negatives fill the rest of ``batch_size_per_im``; every
    other anchor is ignored. Anchors crossing the image border take part like any other (NVIDIA's
    reference keeps them too). Without ground truth every sampled anchor is negative.

    Args:
      anchors: dict level -> [H_l*W_l*A, 4] float32 boxes [ymin, xmin, ymax, xmax] from
        ``generate_anchors`` (row-major over (y, x, anchor)).
      gt_boxes: [K, 4] float32 ground-truth boxes [ymin, xmin, ymax, xmax] in pixels; padded rows are
        all -1 and may sit anywhere.
      image_size: (height, width) of the padded input the anchors were generated for.
      positive_overlap: float, IoU at or above which an anchor is positive.
      negative_overlap: float, IoU below which an anchor is negative.
      batch_size_per_im: int, anchors sampled per image (positives + negatives).
      fg_fraction: float, largest fraction of positives in the sample.
      seed: optional [2] int32/int64 stateless seed of the random subsampling (the input pipeline derives
        one per example so that a seeded run is reproducible under a parallel map); None draws afresh.

    Returns:
      dict with
        'rpn_score_targets': dict level -> [H_l, W_l, A] int32: ``RPN_POSITIVE`` (1), ``RPN_NEGATIVE`` (0)
          or ``RPN_IGNORE`` (-1).
        'rpn_box_targets': dict level -> [H_l, W_l, 4A] float32 deltas (dy, dx, dh, dw) of the matched
          ground truth w.r.t. the anchor, weights ``RPN_BOX_WEIGHTS``; zero where the label is not
          positive. Channels ``4a:4a+4`` belong to anchor a.
    """
    levels, level_anchors, grids, gt_boxes = check_target_inputs(anchors, gt_boxes, image_size)
    real_gt = real_ground_truth(gt_boxes)  # [K', 4]

    # The only [M, K'] work: one IoU tensor per level and three reductions over it.
    ious = [_grid_iou(boxes, feat_h, feat_w, real_gt)
            for boxes, (feat_h, feat_w) in zip(level_anchors, grids)]  # [H_l, W_l, A, K'] each
    gt_best_iou = tf.reduce_max(tf.stack([tf.reduce_max(iou, axis=[0, 1, 2]) for iou in ious]), axis=0)
    # Ground truth that overlaps no anchor forces nothing: its threshold is unreachable.
    force_threshold = tf.where(gt_best_iou > 0.0, gt_best_iou, np.inf)
    max_iou = tf.concat([tf.reshape(tf.reduce_max(iou, axis=-1), [-1]) for iou in ious], axis=0)  # [M]
    is_gt_best = tf.concat(
        [tf.reshape(tf.reduce_any(iou >= force_threshold, axis=-1), [-1]) for iou in ious], axis=0)  # [M]

    positive = tf.logical_or(max_iou >= positive_overlap, is_gt_best)
    negative = tf.logical_and(max_iou < negative_overlap, tf.logical_not(positive))
    keys = sampling_keys(tf.shape(max_iou), seed)
    sampled_positive, positive_indices = _sample(positive, keys, int(batch_size_per_im * fg_fraction))
    num_negatives = batch_size_per_im - tf.shape(positive_indices)[0]
    sampled_negative, _ = _sample(negative, keys, batch_size_per_im, limit=num_negatives)
    labels = tf.where(sampled_positive, RPN_POSITIVE, tf.where(sampled_negative, RPN_NEGATIVE, RPN_IGNORE))
    return targets_from_labels(levels, level_anchors, grids, real_gt, labels, positive_indices)


def check_target_inputs(anchors, gt_boxes, image_size):
    """Validate ``rpn_targets``' anchors and ground truth (shared with the fused twin).

    Returns:
      (levels: ascending ints, level_anchors: [H_l*W_l*A, 4] float32 tensors in that order,
      grids: [(H_l, W_l)], gt_boxes: [K, 4] float32 tensor).
    """
    levels = sorted(anchors)
    level_anchors = [tf.convert_to_tensor(anchors[level], tf.float32) for level in levels]
    grids = [feature_size(image_size, level) for level in levels]
    for level, boxes, grid in zip(levels, level_anchors, grids):
        _check_anchor_grid(boxes, level, grid, image_size)
    gt_boxes = tf.convert_to_tensor(gt_boxes, tf.float32)
    box_ops.check_last_dim(gt_boxes, 4, "gt_boxes")
    return levels, level_anchors, grids, gt_boxes


def real_ground_truth(gt_boxes):
    """[K, 4] padded ground truth -> [K', 4]: the real rows plus one empty box.

    Dropping padded rows first makes the cost scale with the real instance count, not the padded one.
    The appended empty box overlaps nothing (IoU 0), so no reduction over K' sees an empty axis.
    """
    real_gt = tf.boolean_mask(gt_boxes, tf.logical_not(box_ops.is_padding(gt_boxes)))
    return tf.concat([real_gt, tf.zeros([1, 4], tf.float32)], axis=0)


def sampling_keys(shape, seed):
    """[M] float32 uniform keys of the anchor subsampling: stateless from ``seed``, or fresh when None."""
    if seed is None:
        return tf.random.uniform(shape)
    return tf.random.stateless_uniform(shape, seed)


def targets_from_labels(levels, level_anchors, grids, real_gt, labels, positive_indices):
    """Box targets of the sampled positives and the per-level layout of ``rpn_targets``' outputs.

    Args:
      levels, level_anchors, grids: from ``check_target_inputs``.
      real_gt: [K', 4] float32 from ``real_ground_truth``.
      labels: [M] int32 anchor labels; positive_indices: [P] int32 the anchors labelled positive.

    Returns:
      ``rpn_targets``' dict.
    """
    # Box targets are needed for the sampled positives only: match and encode those few rows.
    all_anchors = tf.concat(level_anchors, axis=0)  # [M, 4]
    positive_anchors = tf.gather(all_anchors, positive_indices)  # [P, 4]
    matched_gt = tf.argmax(box_ops.bbox_overlap(positive_anchors[None], real_gt[None])[0], axis=1)  # [P]
    positive_deltas = box_ops.encode_boxes(tf.gather(real_gt, matched_gt), positive_anchors, RPN_BOX_WEIGHTS)
    deltas = tf.scatter_nd(positive_indices[:, None], positive_deltas, tf.shape(all_anchors))  # [M, 4]

    score_targets = {}
    box_targets = {}
    sizes = [boxes.shape[0] for boxes in level_anchors]
    if None in sizes:
        sizes = [tf.shape(boxes)[0] for boxes in level_anchors]
    for level, (feat_h, feat_w), level_labels, level_deltas in zip(
            levels, grids, tf.split(labels, sizes), tf.split(deltas, sizes)):
        score_targets[level] = tf.reshape(level_labels, [feat_h, feat_w, -1])
        # [H*W*A, 4] -> [H, W, 4A]: anchor a's deltas land in channels 4a:4a+4.
        box_targets[level] = tf.reshape(level_deltas, [feat_h, feat_w, -1])
    return {"rpn_score_targets": score_targets, "rpn_box_targets": box_targets}
