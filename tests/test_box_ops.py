"""Box math against slow NumPy references: IoU with padding, delta encoding round trips, clipping."""
import math

import numpy as np
import pytest
import tensorflow as tf

from mrcnn_tf2.ops import box_ops


def np_iou(box_a, box_b):
    """IoU of two [ymin, xmin, ymax, xmax] boxes, -1 when either is padding (largest coordinate < 0)."""
    if max(box_a) < 0 or max(box_b) < 0:
        return -1.0
    inter_h = max(0.0, min(box_a[2], box_b[2]) - max(box_a[0], box_b[0]))
    inter_w = max(0.0, min(box_a[3], box_b[3]) - max(box_a[1], box_b[1]))
    inter = inter_h * inter_w
    area_a = (box_a[2] - box_a[0]) * (box_a[3] - box_a[1])
    area_b = (box_b[2] - box_b[0]) * (box_b[3] - box_b[1])
    union = area_a + area_b - inter
    return inter / union if union > 0 else 0.0


def np_encode(box, anchor, weights):
    """Deltas of one box w.r.t. one anchor, written out from the definition."""
    h, w = box[2] - box[0], box[3] - box[1]
    ha, wa = anchor[2] - anchor[0], anchor[3] - anchor[1]
    yc, xc = box[0] + h / 2, box[1] + w / 2
    yca, xca = anchor[0] + ha / 2, anchor[1] + wa / 2
    return [weights[0] * (yc - yca) / ha, weights[1] * (xc - xca) / wa,
            weights[2] * math.log(h / ha), weights[3] * math.log(w / wa)]


def random_boxes(rng, shape, size=100.0):
    """Random valid boxes [..., 4] with positive extents inside [0, 1.5 * size]."""
    corner = rng.uniform(0, size, shape + (2,))
    extent = rng.uniform(1, size / 2, shape + (2,))
    return np.concatenate([corner, corner + extent], axis=-1).astype(np.float32)


def test_bbox_overlap_matches_reference_with_padding_and_degenerate_boxes(rng):
    boxes = random_boxes(rng, (2, 7))
    gt = random_boxes(rng, (2, 5))
    gt[:, 1] = boxes[:, 2]  # an exact match: IoU 1
    gt[0, 3:] = box_ops.PADDING_BOX_VALUE
    boxes[1, 6] = box_ops.PADDING_BOX_VALUE
    boxes[0, 4] = [10, 10, 10, 30]  # zero height
    gt[1, 2] = [5, 5, 5, 5]  # a point
    iou = box_ops.bbox_overlap(boxes, gt).numpy()
    assert iou.shape == (2, 7, 5) and iou.dtype == np.float32
    expected = np.array([[[np_iou(b, g) for g in gt[i]] for b in boxes[i]] for i in range(2)])
    np.testing.assert_allclose(iou, expected, atol=1e-6)
    assert np.all(iou[0, :, 3:] == box_ops.PADDING_IOU)
    assert np.all(iou[1, 6, :] == box_ops.PADDING_IOU)
    np.testing.assert_allclose(iou[:, 2, 1], 1.0, atol=1e-6)
    assert np.all(iou[0, 4, :3] == 0.0) and np.all(iou[1, :6, 2] == 0.0)


def test_bbox_overlap_is_scale_invariant(rng):
    boxes = random_boxes(rng, (1, 20))
    gt = random_boxes(rng, (1, 6))
    np.testing.assert_allclose(box_ops.bbox_overlap(boxes, gt), box_ops.bbox_overlap(3.5 * boxes, 3.5 * gt),
                               atol=1e-5)


def test_bbox_overlap_all_padding_and_empty():
    padding = np.full((1, 3, 4), box_ops.PADDING_BOX_VALUE, np.float32)
    np.testing.assert_array_equal(box_ops.bbox_overlap(padding, padding), -np.ones((1, 3, 3)))
    assert box_ops.bbox_overlap(np.zeros((2, 0, 4)), padding[[0, 0]]).shape == (2, 0, 3)


@pytest.mark.parametrize("weights", [(1.0, 1.0, 1.0, 1.0), (10.0, 10.0, 5.0, 5.0)])
def test_encode_matches_reference_and_decode_inverts_it(rng, weights):
    boxes = random_boxes(rng, (30,))
    anchors = random_boxes(rng, (30,))
    deltas = box_ops.encode_boxes(boxes, anchors, weights).numpy()
    expected = np.array([np_encode(b, a, weights) for b, a in zip(boxes, anchors)])
    np.testing.assert_allclose(deltas, expected, rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(box_ops.decode_boxes(deltas, anchors, weights), boxes, rtol=1e-5, atol=1e-3)


def test_encode_decode_broadcast(rng):
    boxes = random_boxes(rng, (4, 1))
    anchors = random_boxes(rng, (1, 6))
    deltas = box_ops.encode_boxes(boxes, anchors)
    assert deltas.shape == (4, 6, 4)
    decoded = box_ops.decode_boxes(deltas, anchors).numpy()
    np.testing.assert_allclose(decoded, np.broadcast_to(boxes, (4, 6, 4)), rtol=1e-5, atol=1e-3)


@pytest.mark.parametrize("weights", [(1.0, 1.0, 1.0, 1.0), (10.0, 10.0, 5.0, 5.0)])
def test_decode_clips_log_size_change(weights):
    anchor = np.array([[20.0, 40.0, 30.0, 60.0]], np.float32)  # h 10, w 20, centre (25, 50)
    deltas = np.array([[0.0, 0.0, 100.0 * weights[2], 50.0 * weights[3]]], np.float32)
    decoded = box_ops.decode_boxes(deltas, anchor, weights).numpy()[0]
    scale = math.exp(box_ops.BBOX_XFORM_CLIP)  # 1000 / 16
    np.testing.assert_allclose(decoded, [25 - 5 * scale, 50 - 10 * scale, 25 + 5 * scale, 50 + 10 * scale],
                               rtol=1e-5)
    # Deltas below the clip are left alone.
    small = np.array([[0.0, 0.0, 0.5 * weights[2], -0.5 * weights[3]]], np.float32)
    height = np.diff(box_ops.decode_boxes(small, anchor, weights).numpy()[0, [0, 2]])[0]
    np.testing.assert_allclose(height, 10 * math.exp(0.5), rtol=1e-5)


def test_degenerate_boxes_give_finite_deltas():
    boxes = np.array([[5, 5, 5, 5], [-1, -1, -1, -1], [0, 0, 10, 10]], np.float32)
    anchors = np.array([[0, 0, 10, 10], [0, 0, 10, 10], [3, 3, 3, 3]], np.float32)
    deltas = box_ops.encode_boxes(boxes, anchors).numpy()
    assert np.all(np.isfinite(deltas))
    assert np.all(np.isfinite(box_ops.decode_boxes(deltas, anchors).numpy()))


def test_clip_boxes_per_image_and_fixed_size(rng):
    boxes = rng.uniform(-50, 150, (2, 10, 4)).astype(np.float32)
    image_hw = np.array([[60.0, 100.0], [80.0, 40.0]], np.float32)
    clipped = box_ops.clip_boxes(boxes, image_hw[:, None, :]).numpy()
    for i, (height, width) in enumerate(image_hw):
        np.testing.assert_array_equal(clipped[i, :, 0::2], np.clip(boxes[i, :, 0::2], 0, height))
        np.testing.assert_array_equal(clipped[i, :, 1::2], np.clip(boxes[i, :, 1::2], 0, width))
    np.testing.assert_array_equal(box_ops.clip_boxes(boxes[0], (60, 100)), clipped[0])


def test_area_and_padding():
    boxes = np.array([[0, 0, 2, 3], [1, 1, 1, 5], [-1, -1, -1, -1], [4, 4, 2, 2]], np.float32)
    np.testing.assert_array_equal(box_ops.box_area(boxes), [6, 0, 0, 0])
    np.testing.assert_array_equal(box_ops.is_padding(boxes), [False, False, True, False])


@pytest.mark.parametrize("call", [
    lambda bad: box_ops.bbox_overlap(bad, np.zeros((1, 2, 4))),
    lambda bad: box_ops.bbox_overlap(np.zeros((1, 2, 4)), bad),
    lambda bad: box_ops.encode_boxes(bad, np.zeros((1, 4))),
    lambda bad: box_ops.decode_boxes(bad, np.zeros((1, 4))),
    lambda bad: box_ops.decode_boxes(np.zeros((1, 4)), bad),
    lambda bad: box_ops.clip_boxes(bad, (10, 10)),
    lambda bad: box_ops.box_area(bad),
    lambda bad: box_ops.is_padding(bad),
])
def test_wrong_last_dim_raises(call):
    with pytest.raises(ValueError, match="last dimension 4"):
        call(np.zeros((1, 2, 5), np.float32))


def test_bad_image_hw_and_rank_raise():
    with pytest.raises(ValueError, match="last dimension 2"):
        box_ops.clip_boxes(np.zeros((2, 4)), np.zeros((2, 3)))
    with pytest.raises(ValueError, match=r"\[B, N, 4\]"):
        box_ops.bbox_overlap(np.zeros((2, 4)), np.zeros((2, 4)))


def test_ops_trace_in_tf_function(rng):
    boxes = random_boxes(rng, (1, 8))
    fn = tf.function(lambda b, g: box_ops.decode_boxes(box_ops.encode_boxes(b, g[:, :1]), g[:, :1]))
    np.testing.assert_allclose(fn(boxes, boxes), boxes, rtol=1e-5, atol=1e-3)
