"""Proposals against a slow NumPy reference (per-level top-k, clip, size filter, greedy NMS, merge); the fused
op (mrcnn_tf2.ops.fused) against this pure-TF twin and the reference.
"""
import numpy as np
import pytest
import tensorflow as tf

from mrcnn_tf2.ops import anchors as anchor_ops
from mrcnn_tf2.ops import box_ops
from mrcnn_tf2.ops import fused
from mrcnn_tf2.ops import roi_ops

IMAGE_SIZE = (64, 96)
LEVELS = (2, 4)
NUM_ANCHORS = 3  # one scale, three aspect ratios


@pytest.fixture(scope="module")
def anchors():
    return anchor_ops.generate_anchors(*LEVELS, 1, ((1.0, 1.0), (1.4, 0.7), (0.7, 1.4)), 4.0, IMAGE_SIZE)


def rpn_outputs(rng, batch_size, delta_scale=0.3):
    """Random head outputs: logits {level: [B, H, W, A]} and deltas {level: [B, H, W, 4A]}."""
    scores, boxes = {}, {}
    for level in range(LEVELS[0], LEVELS[1] + 1):
        feat_h, feat_w = anchor_ops.feature_size(IMAGE_SIZE, level)
        scores[level] = rng.normal(size=(batch_size, feat_h, feat_w, NUM_ANCHORS)).astype(np.float32)
        boxes[level] = (delta_scale * rng.normal(size=(batch_size, feat_h, feat_w, 4 * NUM_ANCHORS))).astype(
            np.float32)
    return scores, boxes


def np_greedy_nms(boxes, threshold, max_output):
    """Indices kept by textbook greedy NMS over boxes already sorted by descending score."""
    iou = box_ops.bbox_overlap(boxes[None], boxes[None]).numpy()[0]
    keep = []
    for i in range(len(boxes)):
        if all(iou[i, j] < threshold for j in keep):
            keep.append(i)
        if len(keep) == max_output:
            break
    return keep


def np_propose(scores, deltas, anchors, image_hw, pre_nms_topn, post_nms_topn, threshold, min_size):
    """The documented proposal rules, one image and one level at a time."""
    batch_size = image_hw.shape[0]
    rois = np.full((batch_size, post_nms_topn, 4), box_ops.PADDING_BOX_VALUE, np.float32)
    roi_scores = np.full((batch_size, post_nms_topn), roi_ops.PADDING_ROI_SCORE, np.float32)
    for b in range(batch_size):
        candidates = []
        for level in sorted(scores):
            logits = scores[level][b].reshape(-1)
            level_deltas = deltas[level][b].reshape(-1, 4)
            order = np.argsort(-logits, kind="stable")[:pre_nms_topn]
            boxes = box_ops.decode_boxes(level_deltas[order], anchors[level][order]).numpy()
            boxes[:, 0::2] = np.clip(boxes[:, 0::2], 0, image_hw[b, 0])
            boxes[:, 1::2] = np.clip(boxes[:, 1::2], 0, image_hw[b, 1])
            heights, widths = boxes[:, 2] - boxes[:, 0], boxes[:, 3] - boxes[:, 1]
            kept = [i for i in range(len(order))
                    if heights[i] >= min_size and widths[i] >= min_size and heights[i] > 0 and widths[i] > 0]
            for i in np_greedy_nms(boxes[kept], threshold, post_nms_topn):
                candidates.append((1 / (1 + np.exp(-logits[order[kept[i]]])), boxes[kept[i]]))
        candidates.sort(key=lambda item: -item[0])
        for n, (score, box) in enumerate(candidates[:post_nms_topn]):
            roi_scores[b, n] = score
            rois[b, n] = box
    return rois, roi_scores


def propose(scores, boxes, anchors, image_hw, pre, post, threshold=0.7, min_size=0.0):
    out = roi_ops.multilevel_propose_rois(scores, boxes, anchors, image_hw, pre, post, threshold, min_size)
    return out["rois"].numpy(), out["roi_scores"].numpy()


@pytest.mark.parametrize("pre, post, threshold, min_size", [
    (100, 60, 0.7, 0.0),  # level 4 has 72 anchors, fewer than pre_nms_topn
    (40, 500, 0.5, 0.0),  # fewer survivors than post_nms_topn: padded output
    (100, 80, 0.7, 6.0),
    (1000, 1000, 0.7, 0.0),  # more candidates than one 512-box NMS tile
])
def test_proposals_match_reference(anchors, rng, pre, post, threshold, min_size):
    scores, boxes = rpn_outputs(rng, 2)
    image_hw = np.array([[64.0, 96.0], [50.0, 70.0]], np.float32)
    rois, roi_scores = propose(scores, boxes, anchors, image_hw, pre, post, threshold, min_size)
    expected_rois, expected_scores = np_propose(
        scores, boxes, anchors, image_hw, pre, post, threshold, min_size)
    assert rois.shape == (2, post, 4) and roi_scores.shape == (2, post)
    np.testing.assert_allclose(roi_scores, expected_scores, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(rois, expected_rois, rtol=1e-5, atol=1e-3)
    valid = roi_scores > roi_ops.PADDING_ROI_SCORE
    heights, widths = rois[..., 2] - rois[..., 0], rois[..., 3] - rois[..., 1]
    assert np.all(np.minimum(heights, widths)[valid] >= max(min_size, 1e-6))
    assert np.all(box_ops.is_padding(rois).numpy() == ~valid)


def test_images_in_a_batch_are_independent(anchors, rng):
    scores, boxes = rpn_outputs(rng, 3)
    image_hw = np.array([[64.0, 96.0], [30.0, 90.0], [64.0, 40.0]], np.float32)
    rois, roi_scores = propose(scores, boxes, anchors, image_hw, 50, 40)
    one = {level: value[1:2] for level, value in scores.items()}
    one_boxes = {level: value[1:2] for level, value in boxes.items()}
    single_rois, single_scores = propose(one, one_boxes, anchors, image_hw[1:2], 50, 40)
    np.testing.assert_array_equal(rois[1:2], single_rois)
    np.testing.assert_array_equal(roi_scores[1:2], single_scores)


def test_empty_image_and_extreme_deltas_give_padding_not_nan(anchors, rng):
    scores, _ = rpn_outputs(rng, 2)
    # Centres stay on the anchors; sizes blow up (clipped by BBOX_XFORM_CLIP) or collapse to zero.
    boxes = {}
    for level, value in rpn_outputs(rng, 2)[1].items():
        extreme = np.where(rng.uniform(size=value.shape) < 0.5, 1e4, -1e4).reshape(value.shape[:3] + (-1, 4))
        extreme[..., :2] = 0.0
        boxes[level] = extreme.reshape(value.shape).astype(np.float32)
    image_hw = np.array([[0.0, 0.0], [64.0, 96.0]], np.float32)
    rois, roi_scores = propose(scores, boxes, anchors, image_hw, 30, 20)
    assert np.all(np.isfinite(rois)) and np.all(np.isfinite(roi_scores))
    # Nothing fits in an empty image: all padding.
    assert np.all(rois[0] == box_ops.PADDING_BOX_VALUE) and np.all(roi_scores[0] == roi_ops.PADDING_ROI_SCORE)
    valid = roi_scores[1] > 0
    assert np.any(valid)
    assert np.all(rois[1, valid] >= 0) and np.all(rois[1, valid, 2] <= 64) and np.all(rois[1, valid, 3] <= 96)


@pytest.mark.parametrize("dtype", [tf.float16, tf.bfloat16])
def test_low_precision_inputs_in_a_tf_function_of_unknown_batch_size(anchors, rng, dtype):
    """The batch size unknown when traced (an exported model's signature): NMS runs per image in a loop op."""
    scores, boxes = rpn_outputs(rng, 2)
    image_hw = np.array([[64.0, 96.0], [64.0, 96.0]], np.float32)
    cast = lambda d: {level: tf.cast(v, dtype) for level, v in d.items()}  # noqa: E731
    rounded = lambda d: {level: tf.cast(v, tf.float32).numpy() for level, v in cast(d).items()}  # noqa: E731
    signature = ({level: tf.TensorSpec([None, *v.shape[1:]], dtype) for level, v in scores.items()},
                 {level: tf.TensorSpec([None, *v.shape[1:]], dtype) for level, v in boxes.items()},
                 tf.TensorSpec([None, 2], tf.float32))
    fn = tf.function(lambda s, b, hw: roi_ops.multilevel_propose_rois(s, b, anchors, hw, 50, 40, 0.7),
                     input_signature=signature)
    assert any("While" in op.type for op in fn.get_concrete_function().graph.get_operations())
    out = fn(cast(scores), cast(boxes), image_hw)
    assert out["rois"].dtype == tf.float32 and out["roi_scores"].dtype == tf.float32
    expected_rois, expected_scores = np_propose(
        rounded(scores), rounded(boxes), anchors, image_hw, 50, 40, 0.7, 0.0)
    np.testing.assert_allclose(out["roi_scores"], expected_scores, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(out["rois"], expected_rois, rtol=1e-5, atol=1e-3)


def test_bad_inputs_raise(anchors, rng):
    scores, boxes = rpn_outputs(rng, 1)
    image_hw = np.array([[64.0, 96.0]], np.float32)
    with pytest.raises(ValueError, match="share levels"):
        roi_ops.multilevel_propose_rois(scores, {2: boxes[2]}, anchors, image_hw, 10, 10, 0.7)
    wrong = dict(anchors)
    wrong[3] = anchors[3][:-3]
    with pytest.raises(ValueError, match="anchors\\[3\\]"):
        roi_ops.multilevel_propose_rois(scores, boxes, wrong, image_hw, 10, 10, 0.7)
    bad_boxes = dict(boxes)
    bad_boxes[2] = boxes[2][..., :-1]
    with pytest.raises(ValueError, match="rpn_boxes\\[2\\]"):
        roi_ops.multilevel_propose_rois(scores, bad_boxes, anchors, image_hw, 10, 10, 0.7)


# -- the fused op against its twin -------------------------------------------------------------------------

def both_propose(scores, boxes, anchors, image_hw, *args):
    outs = [fn(scores, boxes, anchors, image_hw, *args)
            for fn in (fused.multilevel_propose_rois, roi_ops.multilevel_propose_rois)]
    return [(out["rois"].numpy(), out["roi_scores"].numpy()) for out in outs]


def assert_same_proposals(got, want):
    (rois, scores), (want_rois, want_scores) = got, want
    assert rois.shape == want_rois.shape and scores.shape == want_scores.shape
    np.testing.assert_allclose(scores, want_scores, rtol=1e-6, atol=1e-7)
    np.testing.assert_allclose(rois, want_rois, rtol=1e-6, atol=1e-4)


@pytest.mark.parametrize("pre, post, threshold, min_size", [
    (100, 60, 0.7, 0.0), (40, 500, 0.5, 0.0), (100, 80, 0.7, 6.0), (1000, 1000, 0.7, 0.0), (5, 3, 0.3, 0.0)])
def test_proposals_match_twin_and_oracle(anchors, rng, pre, post, threshold, min_size):
    scores, boxes = rpn_outputs(rng, 2)
    image_hw = np.array([[64.0, 96.0], [50.0, 70.0]], np.float32)
    got, want = both_propose(scores, boxes, anchors, image_hw, pre, post, threshold, min_size)
    assert_same_proposals(got, want)
    assert_same_proposals(got, np_propose(scores, boxes, anchors, image_hw, pre, post, threshold,
                                          min_size))


def test_proposals_edge_cases(anchors, rng):
    scores, boxes = rpn_outputs(rng, 3, delta_scale=3.0)  # many boxes leave the image or collapse
    # An empty image (no proposal), a thin one (boxes clipped to nothing), and one where every logit ties.
    image_hw = np.array([[0.0, 0.0], [64.0, 2.0], [64.0, 96.0]], np.float32)
    for level in scores:
        scores[level][2] = 0.5
    got, want = both_propose(scores, boxes, anchors, image_hw, 50, 40, 0.7, 1.0)
    assert_same_proposals(got, want)
    assert np.all(got[0][0] == box_ops.PADDING_BOX_VALUE) and np.all(got[1][0] == roi_ops.PADDING_ROI_SCORE)
    # Extreme deltas (clipped by BBOX_XFORM_CLIP) stay finite, as in the twin.
    extreme = {level: np.where(rng.uniform(size=v.shape) < 0.5, 1e4, -1e4).astype(np.float32)
               for level, v in boxes.items()}
    got, want = both_propose(scores, extreme, anchors, image_hw, 30, 20, 0.7, 0.0)
    assert np.all(np.isfinite(got[0]))
    assert_same_proposals(got, want)


def test_proposals_low_precision_inside_tf_function(anchors, rng):
    scores, boxes = rpn_outputs(rng, 2)
    image_hw = np.array([[64.0, 96.0], [64.0, 60.0]], np.float32)
    cast = lambda d: {level: tf.cast(v, tf.bfloat16) for level, v in d.items()}  # noqa: E731
    outs = [tf.function(lambda s, b, hw, fn=fn: fn(s, b, anchors, hw, 50, 40, 0.7))(
        cast(scores), cast(boxes), image_hw) for fn in (fused.multilevel_propose_rois,
                                                        roi_ops.multilevel_propose_rois)]
    assert_same_proposals(*[(out["rois"].numpy(), out["roi_scores"].numpy()) for out in outs])
