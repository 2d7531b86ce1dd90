"""Detection post-processing: box-head outputs of the RoIs -> a fixed number of scored detections.

Box format: ``[ymin, xmin, ymax, xmax]`` float32, in pixels of the resized, padded input image, with
continuous coordinates (width = xmax - xmin). Padded RoIs (from ``roi_ops``) are all -1 and never
yield a detection.

Per image and foreground class c (class 0 is background): softmax score of c for every RoI, RoI
decoded with c's deltas and clipped to the valid image, candidates dropped when the score is not above
``score_threshold``, the RoI is padding or the clipped box is empty or has a side below ``min_box_size``
(torchvision: score > 0.05, sides >= 1e-2); then greedy NMS within the class
(a box is suppressed by a higher-scored kept box when their IoU > ``nms_threshold``) and finally the
``max_detections`` best over all classes, by descending score.

Static output shapes, whole batches inside ``tf.function``, float32 arithmetic for any input dtype.

Glossary: B batch, N RoIs, K classes including background, D ``max_detections``.
"""
import tensorflow as tf

from mrcnn_tf2.ops import box_ops, nms

# Score given to dropped candidates: below every softmax score, so NMS (run with
# _NMS_SCORE_THRESHOLD) discards them and they can suppress nothing.
_DROPPED_SCORE = -1.0
_NMS_SCORE_THRESHOLD = -0.5


def _check_arguments(class_logits, box_deltas, rois, image_hw, max_detections, nms_threshold,
                     score_threshold, min_box_size, pre_nms_topn_per_class, bbox_reg_weights):
    """Raise ValueError on malformed shapes or parameters of ``generate_detections``."""
    for name, tensor, rank in (("class_logits", class_logits, 3), ("box_deltas", box_deltas, 4),
                               ("rois", rois, 3), ("image_hw", image_hw, 2)):
        if tensor.shape.rank != rank:
            raise ValueError(f"{name} must have rank {rank}, got shape {tensor.shape}.")
    box_ops.check_last_dim(box_deltas, 4, "box_deltas")
    box_ops.check_last_dim(rois, 4, "rois")
    box_ops.check_last_dim(image_hw, 2, "image_hw")
    num_classes = class_logits.shape[2]
    if num_classes is None or num_classes < 2:
        raise ValueError(f"class_logits needs a static class dimension >= 2 (background + one class), "
                         f"got shape {class_logits.shape}.")
    if not box_deltas.shape[:3].is_compatible_with(class_logits.shape):
        raise ValueError(f"box_deltas shape {box_deltas.shape} must be [B, N, K, 4] for class_logits "
                         f"{class_logits.shape}.")
    if not rois.shape[:2].is_compatible_with(class_logits.shape[:2]):
        raise ValueError(f"rois shape {rois.shape} must be [B, N, 4] for class_logits {class_logits.shape}.")
    if not isinstance(max_detections, int) or max_detections < 1:
        raise ValueError(f"max_detections must be a positive int, got {max_detections!r}.")
    if not isinstance(pre_nms_topn_per_class, int) or pre_nms_topn_per_class < 1:
        raise ValueError(f"pre_nms_topn_per_class must be a positive int, got {pre_nms_topn_per_class!r}.")
    if not 0.0 <= nms_threshold <= 1.0:
        raise ValueError(f"nms_threshold must be in [0, 1], got {nms_threshold}.")
    if not 0.0 <= score_threshold <= 1.0:
        raise ValueError(f"score_threshold must be in [0, 1], got {score_threshold}.")
    if not min_box_size >= 0.0:
        raise ValueError(f"min_box_size must be >= 0, got {min_box_size}.")
    if len(bbox_reg_weights) != 4 or min(bbox_reg_weights) <= 0:
        raise ValueError(f"bbox_reg_weights must be 4 positive floats, got {bbox_reg_weights!r}.")


def generate_detections(class_logits, box_deltas, rois, image_hw, max_detections=100, nms_threshold=0.5,
                        score_threshold=0.05, min_box_size=0.0, pre_nms_topn_per_class=1000,
                        bbox_reg_weights=(10.0, 10.0, 5.0, 5.0)):
    """Final detections per image from the box head (rules in the module docstring).

    Args:
      class_logits: [B, N, K] float logits (any float dtype); class 0 is background.
      box_deltas: [B, N, K, 4] float class-specific deltas (dy, dx, dh, dw) w.r.t. the RoI, scaled by
        ``bbox_reg_weights`` (any float dtype); the background column is ignored.
      rois: [B, N, 4] float boxes [ymin, xmin, ymax, xmax]; padded rows all -1.
      image_hw: [B, 2] float valid (unpadded) image height and width; boxes are clipped to it.
      max_detections: int D, detections returned per image.
      nms_threshold: float, IoU above which a lower-scored box of the same class is suppressed.
      score_threshold: float, a detection's class score must exceed it.
      min_box_size: float, smallest height and width (pixels of the input) a detection may have.
      pre_nms_topn_per_class: int, only the best this many RoIs of each class (by score) enter NMS.
      bbox_reg_weights: 4 floats (wy, wx, wh, ww) the deltas were multiplied by.

    Returns:
      dict with
        'detection_boxes': [B, D, 4] float32 boxes; 0 in empty slots.
        'detection_scores': [B, D] float32 class probabilities, descending; 0 in empty slots.
        'detection_classes': [B, D] int32 classes in 1..K-1; 0 in empty slots.
        'num_detections': [B] int32, how many leading slots hold a detection.

    Raises:
      ValueError: wrong ranks or dimensions, or parameters out of range.
    """
    class_logits = tf.cast(tf.convert_to_tensor(class_logits), tf.float32)
    box_deltas = tf.cast(tf.convert_to_tensor(box_deltas), tf.float32)
    rois = tf.cast(tf.convert_to_tensor(rois), tf.float32)
    image_hw = tf.cast(tf.convert_to_tensor(image_hw), tf.float32)
    _check_arguments(class_logits, box_deltas, rois, image_hw, max_detections, nms_threshold,
                     score_threshold, min_box_size, pre_nms_topn_per_class, bbox_reg_weights)

    # Foreground classes only: column j below is class j + 1.
    scores = tf.nn.softmax(class_logits, axis=-1)[:, :, 1:]  # [B, N, K-1]
    boxes = box_ops.decode_boxes(box_deltas[:, :, 1:], rois[:, :, None, :], bbox_reg_weights)
    boxes = box_ops.clip_boxes(boxes, image_hw[:, None, None, :])  # [B, N, K-1, 4]
    shortest_side = tf.minimum(boxes[..., 2] - boxes[..., 0], boxes[..., 3] - boxes[..., 1])
    large_enough = (shortest_side > 0.0) & (shortest_side >= min_box_size)
    keep = (scores > score_threshold) & large_enough & ~box_ops.is_padding(rois)[:, :, None]
    scores = tf.where(keep, scores, _DROPPED_SCORE)

    num_rois = class_logits.shape[1]
    if num_rois is None or pre_nms_topn_per_class < num_rois:
        # Per class, the best RoIs by score: [B, K-1, N] -> [B, K-1, n], then back to [B, n, K-1]. Row j
        # of class c is now c's j-th best RoI; NMS below treats every class separately, so rows need not
        # be the same RoI across classes.
        top = tf.math.top_k(tf.transpose(scores, [0, 2, 1]),
                            k=tf.minimum(pre_nms_topn_per_class, tf.shape(scores)[1]))
        scores = tf.transpose(top.values, [0, 2, 1])
        boxes = tf.gather(tf.transpose(boxes, [0, 2, 1, 3]), top.indices, batch_dims=2)  # [B, K-1, n, 4]
        boxes = tf.transpose(boxes, [0, 2, 1, 3])

    # NMS within each class as one NMS over all classes (torchvision's batched_nms): each class's boxes shifted by
    # (class id) * (largest coordinate + 1), so that boxes of different classes never overlap.
    num_classes = scores.shape[2]
    batch = scores.shape[0] if scores.shape[0] is not None else tf.shape(scores)[0]  # static when known: no loop
    scores = tf.reshape(scores, [batch, -1])  # [B, n * (K-1)]: candidate i is class i % (K-1)
    boxes = tf.reshape(boxes, [batch, -1, 4])
    candidate_class = tf.tile(tf.range(1, num_classes + 1), [tf.shape(scores)[1] // num_classes])
    largest = tf.reduce_max(tf.where(scores[..., None] > _NMS_SCORE_THRESHOLD, boxes, 0.0), axis=[1, 2])  # [B]
    offsets = tf.cast(candidate_class, tf.float32)[None, :] * (largest[:, None] + 1.0)
    selected, num_detections = nms.non_max_suppression(boxes + offsets[..., None], scores, max_detections,
                                                       nms_threshold, _NMS_SCORE_THRESHOLD)
    filled = tf.range(max_detections)[None, :] < num_detections[:, None]  # [B, D]
    classes = tf.where(filled, tf.gather(candidate_class, selected), 0)
    nmsed_scores = tf.where(filled, tf.gather(scores, selected, batch_dims=1), 0.0)
    nmsed_boxes = tf.where(filled[..., None], tf.gather(boxes, selected, batch_dims=1), 0.0)
    return {
        "detection_boxes": nmsed_boxes,
        "detection_scores": nmsed_scores,
        "detection_classes": classes,
        "num_detections": num_detections,
    }
