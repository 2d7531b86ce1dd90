"""Region proposals: turn the RPN's multilevel scores and deltas into a fixed number of RoIs per image.

Box format: ``[ymin, xmin, ymax, xmax]`` float32, in pixels of the resized, padded input image, with
continuous coordinates (width = xmax - xmin).

Everything here has static output shapes and works on a whole batch inside ``tf.function``; the
arithmetic is float32 whatever the dtype of the head outputs. This module only proposes: it must not
sample RoIs against ground truth or know about the second stage.

Glossary: B batch, L levels, H_l x W_l the grid of level l, A anchors per location,
M_l = H_l*W_l*A anchors of level l.
"""
import tensorflow as tf

from mrcnn_tf2.ops import box_ops, nms
from mrcnn_tf2.ops.anchors import RPN_BOX_WEIGHTS

# Score of an output slot that holds no proposal; real proposals have sigmoid scores in (0, 1).
PADDING_ROI_SCORE = 0.0

# Score given to removed candidates (too small or empty) before NMS: below every sigmoid, so NMS drops
# them (via _DROP_SCORE_THRESHOLD) and the final top-k ranks them last.
_DROPPED_SCORE = -1.0
_DROP_SCORE_THRESHOLD = -0.5


def _propose_level(logits, deltas, anchors, image_hw, pre_nms_topn, post_nms_topn, nms_threshold,
                   min_size):
    """Proposals of one level: top-k, decode, clip, size filter, NMS.

    Args:
      logits: [B, M_l] float32 objectness logits.
      deltas: [B, M_l, 4] float32 deltas (dy, dx, dh, dw).
      anchors: [M_l, 4] float32 anchors [ymin, xmin, ymax, xmax].
      image_hw: [B, 2] float32 valid (unpadded) image height and width.
      pre_nms_topn, post_nms_topn, nms_threshold, min_size: see ``multilevel_propose_rois``.

    Returns:
      (boxes, scores, valid): [B, N_l, 4] float32 boxes, [B, N_l] float32 sigmoid scores in descending
      order, [B, N_l] bool, where N_l = min(pre_nms_topn, M_l, post_nms_topn); invalid slots hold
      arbitrary boxes.
    """
    num_anchors = anchors.shape[0]
    if num_anchors is None:  # the grid of a batch padded to its own size: known when the graph runs
        num_candidates = tf.minimum(pre_nms_topn, tf.shape(anchors)[0])
        num_kept = min(pre_nms_topn, post_nms_topn)
    else:
        num_candidates = min(pre_nms_topn, num_anchors)
        num_kept = min(num_candidates, post_nms_topn)
    # top_k on logits picks the same boxes in the same order as on sigmoid probabilities.
    top_logits, top_indices = tf.math.top_k(logits, k=num_candidates, sorted=True)  # [B, k]
    top_deltas = tf.gather(deltas, top_indices, batch_dims=1)  # [B, k, 4]
    top_anchors = tf.gather(anchors, top_indices)  # [B, k, 4]
    boxes = box_ops.decode_boxes(top_deltas, top_anchors, RPN_BOX_WEIGHTS)
    boxes = box_ops.clip_boxes(boxes, image_hw[:, None, :])

    heights = boxes[..., 2] - boxes[..., 0]
    widths = boxes[..., 3] - boxes[..., 1]
    # Empty boxes (e.g. wholly outside the valid image once clipped) are dropped whatever min_size is.
    keep = tf.logical_and(tf.minimum(heights, widths) >= min_size, tf.minimum(heights, widths) > 0.0)
    scores = tf.where(keep, tf.sigmoid(top_logits), _DROPPED_SCORE)

    # Dropped boxes stay in place but are below the score threshold: they can neither be selected nor
    # suppress others. A box is suppressed by an earlier selected one when their IoU >= nms_threshold.
    selected, num_valid = nms.non_max_suppression(boxes, scores, num_kept, nms_threshold, _DROP_SCORE_THRESHOLD,
                                                  at_threshold=True)  # [B, N_l], [B]
    valid = tf.range(num_kept)[None, :] < num_valid[:, None]
    return (tf.gather(boxes, selected, batch_dims=1), tf.gather(scores, selected, batch_dims=1), valid)


def flatten_level_inputs(rpn_scores, rpn_boxes, anchors, image_hw):
    """Check ``multilevel_propose_rois``' inputs and flatten each level in anchor order (shared with the
    fused twin).

    Returns:
      ([(logits [B, M_l] float32, deltas [B, M_l, 4] float32, anchors [M_l, 4] float32) per level in
      ascending level order], image_hw [B, 2] float32).

    Raises:
      ValueError: the dicts have different levels, or a level's shapes disagree with its anchors.
    """
    levels = sorted(rpn_scores)
    if sorted(rpn_boxes) != levels or sorted(anchors) != levels:
        raise ValueError(f"rpn_scores, rpn_boxes and anchors must share levels, got {levels}, "
                         f"{sorted(rpn_boxes)} and {sorted(anchors)}.")
    image_hw = tf.cast(image_hw, tf.float32)
    box_ops.check_last_dim(image_hw, 2, "image_hw")
    level_inputs = []
    for level in levels:
        scores = tf.convert_to_tensor(rpn_scores[level])
        deltas = tf.convert_to_tensor(rpn_boxes[level])
        level_anchors = tf.convert_to_tensor(anchors[level], tf.float32)
        _, feat_h, feat_w, num_anchors = scores.shape
        box_ops.check_last_dim(deltas, 4 * num_anchors, f"rpn_boxes[{level}]")
        box_ops.check_last_dim(level_anchors, 4, f"anchors[{level}]")
        if feat_h is None or feat_w is None:  # a batch padded to its own size: the grid is dynamic
            num_level_anchors = -1
        elif level_anchors.shape[0] != feat_h * feat_w * num_anchors:
            raise ValueError(f"anchors[{level}] has {level_anchors.shape[0]} boxes but rpn_scores[{level}] "
                             f"{tuple(scores.shape)} needs {feat_h * feat_w * num_anchors}.")
        else:
            num_level_anchors = feat_h * feat_w * num_anchors
        # [B, H, W, A] -> [B, H*W*A] and [B, H, W, 4A] -> [B, H*W*A, 4], matching the anchor order.
        batch = tf.shape(scores)[0]
        logits = tf.reshape(tf.cast(scores, tf.float32), [batch, num_level_anchors])
        deltas = tf.reshape(tf.cast(deltas, tf.float32), [batch, num_level_anchors, 4])
        level_inputs.append((logits, deltas, level_anchors))
    return level_inputs, image_hw


def multilevel_propose_rois(rpn_scores, rpn_boxes, anchors, image_hw, pre_nms_topn, post_nms_topn,
                            nms_threshold, min_size=0.0):
    """Propose RoIs from the RPN outputs of every level, per image.

    Per level: keep the top min(pre_nms_topn, M_l) anchors by score, decode their deltas (weights
    ``RPN_BOX_WEIGHTS``, dh/dw clipped), clip the boxes to the valid image, drop boxes whose height or
    width is < ``min_size`` or that are empty, then greedy NMS keeping up to post_nms_topn. Finally the
    best ``post_nms_topn`` by score over all levels, in descending order.

    This follows NVIDIA's TF2 reference (same per-level output cap min(pre_nms_topn, post_nms_topn),
    same merge) with one deliberate difference: NVIDIA runs NMS over all of a level's boxes, while here
    (as in Detectron and Google's TPU Mask R-CNN, which NVIDIA derives from) pre_nms_topn selects the
    candidates *before* NMS, which bounds the NMS cost. Pixel conventions are continuous (no "+1").

    Args:
      rpn_scores: dict level -> [B, H_l, W_l, A] objectness logits (any float dtype).
      rpn_boxes: dict level -> [B, H_l, W_l, 4A] deltas; channels 4a:4a+4 are (dy, dx, dh, dw) of
        anchor a.
      anchors: dict level -> [M_l, 4] float32 anchors [ymin, xmin, ymax, xmax] from
        ``anchors.generate_anchors``, row-major over (y, x, anchor).
      image_hw: [B, 2] float valid (unpadded) image height and width inside the padded input.
      pre_nms_topn: int, candidates per level before NMS.
      post_nms_topn: int, proposals per image returned.
      nms_threshold: float, IoU at or above which a lower-scored box is suppressed.
      min_size: float, smallest allowed proposal height and width in pixels.

    Returns:
      dict with
        'rois': [B, post_nms_topn, 4] float32 boxes [ymin, xmin, ymax, xmax]. Slots without a proposal
          (fewer survivors than post_nms_topn) are padding boxes, all ``box_ops.PADDING_BOX_VALUE`` (-1),
          so ``box_ops.is_padding`` spots them and ``box_ops.bbox_overlap`` gives them IoU -1.
        'roi_scores': [B, post_nms_topn] float32 sigmoid objectness in (0, 1), descending;
          ``PADDING_ROI_SCORE`` (0) in padding slots.

    Raises:
      ValueError: the dicts have different levels, or a level's shapes disagree with its anchors.
    """
    level_inputs, image_hw = flatten_level_inputs(rpn_scores, rpn_boxes, anchors, image_hw)
    level_boxes, level_scores, level_valid = [], [], []
    for logits, deltas, level_anchors in level_inputs:
        boxes, scores, valid = _propose_level(
            logits, deltas, level_anchors, image_hw, pre_nms_topn, post_nms_topn, nms_threshold, min_size)
        level_boxes.append(boxes)
        level_scores.append(scores)
        level_valid.append(valid)

    boxes = tf.concat(level_boxes, axis=1)  # [B, sum N_l, 4]
    valid = tf.concat(level_valid, axis=1)  # [B, sum N_l]
    scores = tf.where(valid, tf.concat(level_scores, axis=1), _DROPPED_SCORE)
    num_outputs = min(post_nms_topn, scores.shape[1])
    top_scores, top_indices = tf.math.top_k(scores, k=num_outputs, sorted=True)  # [B, n]
    top_boxes = tf.gather(boxes, top_indices, batch_dims=1)  # [B, n, 4]
    top_valid = tf.gather(valid, top_indices, batch_dims=1)  # [B, n]
    # Pad to the static post_nms_topn even when the levels together hold fewer candidates.
    pad = post_nms_topn - num_outputs
    top_boxes = tf.pad(top_boxes, [[0, 0], [0, pad], [0, 0]])
    top_scores = tf.pad(top_scores, [[0, 0], [0, pad]])
    top_valid = tf.pad(top_valid, [[0, 0], [0, pad]])
    rois = tf.where(top_valid[..., None], top_boxes, box_ops.PADDING_BOX_VALUE)
    roi_scores = tf.where(top_valid, top_scores, PADDING_ROI_SCORE)
    return {"rois": rois, "roi_scores": roi_scores}
