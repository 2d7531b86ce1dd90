"""Greedy non-maximum suppression of each image of a batch, by the one op that every deployment target converts.

TensorFlow's batched NMS ops (`non_max_suppression_padded`, `combined_non_max_suppression`) are converted by
neither tf2onnx, the TFLite builtins nor OpenVINO. `NonMaxSuppressionV5` on one image is converted by all three
(ONNX NonMaxSuppression, TFLite NON_MAX_SUPPRESSION_V5, OpenVINO NonMaxSuppression), so the model runs it per
image: a Python loop over a batch of static size (no control flow in the graph), `tf.map_fn` otherwise.

Box format: ``[ymin, xmin, ymax, xmax]`` float32 (any corner order is accepted).
"""
import numpy as np
import tensorflow as tf


def non_max_suppression(boxes, scores, max_output_size, iou_threshold, score_threshold, at_threshold=False):
    """Greedy NMS of each image: boxes in descending score order (ties: the lower index first), each kept
    unless a kept box overlaps it beyond `iou_threshold`; only boxes scored above `score_threshold` take part.

    Args:
      boxes: [B, N, 4] float32.
      scores: [B, N] float32.
      max_output_size: int (or int32 scalar tensor) M, boxes kept at most per image.
      iou_threshold: float; a box is suppressed at IoU > iou_threshold (torchvision's and the detections'
        rule), or at IoU >= iou_threshold with `at_threshold` (the proposals' rule, NVIDIA's and the fused
        proposal op's: the op's own ">" against the next float32 below the threshold).
      score_threshold: float.
      at_threshold: bool, see iou_threshold.

    Returns:
      (indices [B, M] int32 into N in descending score order, 0 past the kept ones; num_kept [B] int32).
    """
    if at_threshold:
        iou_threshold = float(np.nextafter(np.float32(iou_threshold), np.float32(-np.inf)))

    def one_image(image):
        image_boxes, image_scores = image
        indices, _, count = tf.raw_ops.NonMaxSuppressionV5(
            boxes=image_boxes, scores=image_scores, max_output_size=max_output_size, iou_threshold=iou_threshold,
            score_threshold=score_threshold, soft_nms_sigma=0.0, pad_to_max_output_size=True)
        return indices, count

    batch = boxes.shape[0]
    if batch is not None:
        kept = [one_image((boxes[i], scores[i])) for i in range(batch)]
        return tf.stack([indices for indices, _ in kept]), tf.stack([count for _, count in kept])
    size = max_output_size if isinstance(max_output_size, int) else None
    return tf.map_fn(one_image, (boxes, scores),
                     fn_output_signature=(tf.TensorSpec([size], tf.int32), tf.TensorSpec([], tf.int32)))
