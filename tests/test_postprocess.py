"""Detection post-processing against a NumPy oracle: softmax, decode, clip, filter, greedy per-class NMS, top-D."""
import numpy as np
import pytest
import tensorflow as tf

from mrcnn_tf2.ops import box_ops
from mrcnn_tf2.ops import postprocess

WEIGHTS = (10.0, 10.0, 5.0, 5.0)
IMAGE_HW = (64.0, 80.0)


def np_decode(deltas, roi, weights=WEIGHTS):
    """One box from deltas (dy, dx, dh, dw) w.r.t. one roi, in float32 like the op."""
    deltas, roi = deltas.astype(np.float32), roi.astype(np.float32)
    dy, dx = deltas[0] / np.float32(weights[0]), deltas[1] / np.float32(weights[1])
    dh = min(deltas[2] / np.float32(weights[2]), np.float32(box_ops.BBOX_XFORM_CLIP))
    dw = min(deltas[3] / np.float32(weights[3]), np.float32(box_ops.BBOX_XFORM_CLIP))
    h, w = roi[2] - roi[0], roi[3] - roi[1]
    yc, xc = roi[0] + 0.5 * h + dy * h, roi[1] + 0.5 * w + dx * w
    h, w = np.exp(dh) * h, np.exp(dw) * w
    return np.array([yc - 0.5 * h, xc - 0.5 * w, yc + 0.5 * h, xc + 0.5 * w], np.float32)


def np_iou(a, b):
    inter_h = max(min(a[2], b[2]) - max(a[0], b[0]), 0.0)
    inter_w = max(min(a[3], b[3]) - max(a[1], b[1]), 0.0)
    inter = inter_h * inter_w
    union = (a[2] - a[0]) * (a[3] - a[1]) + (b[2] - b[0]) * (b[3] - b[1]) - inter
    return inter / union


def np_detections(logits, deltas, rois, image_hw, max_det=100, nms=0.5, score_thr=0.05, pre_nms=1000,
                  min_size=0.0):
    """One image: list of (class, score, box) by descending score, from the documented rules."""
    logits = logits.astype(np.float64)
    probs = np.exp(logits - logits.max(-1, keepdims=True))
    probs /= probs.sum(-1, keepdims=True)
    height, width = image_hw
    found = []
    for c in range(1, logits.shape[1]):
        candidates = []
        for i, roi in enumerate(rois):
            if roi.max() < 0 or probs[i, c] <= score_thr:
                continue
            box = np_decode(deltas[i, c], roi)
            box = np.clip(box, 0, [height, width, height, width])
            side = min(box[2] - box[0], box[3] - box[1])
            if side > 0 and side >= min_size:
                candidates.append((probs[i, c], box))
        candidates.sort(key=lambda item: -item[0])
        kept = []
        for score, box in candidates[:pre_nms]:
            if all(np_iou(box, other) <= nms for _, other in kept):
                kept.append((score, box))
        found += [(c, score, box) for score, box in kept]
    found.sort(key=lambda item: -item[1])
    return found[:max_det]


def random_case(rng, batch=2, num_rois=24, num_classes=5, num_padded=4, logit_scale=2.0):
    """Clustered rois (so that NMS has work), random logits and small deltas; the last rows padded."""
    centres = rng.uniform(10, 55, (batch, 4, 2))
    picks = rng.integers(0, 4, (batch, num_rois))
    centre = np.take_along_axis(centres, picks[..., None], axis=1) + rng.normal(0, 2, (batch, num_rois, 2))
    half = rng.uniform(4, 12, (batch, num_rois, 2))
    rois = np.concatenate([centre - half, centre + half], axis=-1).astype(np.float32)
    rois[:, num_rois - num_padded:] = -1
    logits = (logit_scale * rng.normal(size=(batch, num_rois, num_classes))).astype(np.float32)
    deltas = (0.5 * rng.normal(size=(batch, num_rois, num_classes, 4))).astype(np.float32)
    image_hw = np.tile(np.array([IMAGE_HW], np.float32), (batch, 1))
    return logits, deltas, rois, image_hw


def check_against_oracle(out, logits, deltas, rois, image_hw, max_det=100, **kwargs):
    """Assert the op's detections equal the oracle's as ordered lists (scores descending), slot by slot."""
    out = {key: value.numpy() for key, value in out.items()}
    for b in range(logits.shape[0]):
        expected = np_detections(logits[b], deltas[b], rois[b], image_hw[b], max_det=max_det, **kwargs)
        num = len(expected)
        assert out["num_detections"][b] == num
        # Sort both by (class, score) so that equal scores in different classes cannot reorder the pairing.
        got = sorted(zip(out["detection_classes"][b, :num], out["detection_scores"][b, :num],
                         out["detection_boxes"][b, :num]), key=lambda item: (item[0], -item[1]))
        expected = sorted(expected, key=lambda item: (item[0], -item[1]))
        np.testing.assert_array_equal([g[0] for g in got], [e[0] for e in expected])
        np.testing.assert_allclose([g[1] for g in got], [e[1] for e in expected], rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(np.reshape([g[2] for g in got], (-1, 4)),
                                   np.reshape([e[2] for e in expected], (-1, 4)), rtol=1e-5, atol=1e-5)
        scores = out["detection_scores"][b]
        assert (np.diff(scores[:num]) <= 0).all()
        assert (scores[num:] == 0).all() and (out["detection_boxes"][b, num:] == 0).all()
        assert (out["detection_classes"][b, num:] == 0).all()
        assert ((out["detection_classes"][b, :num] >= 1) & (out["detection_classes"][b, :num] < logits.shape[2])).all()


@pytest.mark.parametrize("kwargs", [
    dict(),
    dict(nms_threshold=0.3, score_threshold=0.1),
    dict(nms_threshold=0.7, score_threshold=0.0, max_detections=20),
    dict(pre_nms_topn_per_class=5, score_threshold=0.0),
])
def test_matches_oracle(rng, kwargs):
    logits, deltas, rois, image_hw = random_case(rng)
    out = postprocess.generate_detections(logits, deltas, rois, image_hw, **kwargs)
    names = dict(max_detections="max_det", nms_threshold="nms", score_threshold="score_thr",
                 pre_nms_topn_per_class="pre_nms")
    oracle_kwargs = {names[k]: v for k, v in kwargs.items()}
    check_against_oracle(out, logits, deltas, rois, image_hw, **oracle_kwargs)
    # The case is non-trivial: without the cap, NMS keeps fewer boxes than there are candidates.
    uncapped = dict(oracle_kwargs, max_det=10**6)
    with_nms = np_detections(logits[0], deltas[0], rois[0], image_hw[0], **uncapped)
    without_nms = np_detections(logits[0], deltas[0], rois[0], image_hw[0], **dict(uncapped, nms=1.0))
    assert len(with_nms) < len(without_nms)


def test_tf_function_and_bfloat16_logits(rng):
    logits, deltas, rois, image_hw = random_case(rng)
    run = tf.function(lambda *args: postprocess.generate_detections(*args, max_detections=30))
    logits_bf16 = tf.cast(logits, tf.bfloat16)
    out = run(logits_bf16, tf.cast(deltas, tf.bfloat16), rois, image_hw)
    assert out["detection_boxes"].dtype == tf.float32 and out["detection_scores"].dtype == tf.float32
    assert out["detection_classes"].dtype == tf.int32 and out["num_detections"].dtype == tf.int32
    assert out["detection_boxes"].shape == (2, 30, 4)
    check_against_oracle(out, tf.cast(logits_bf16, tf.float32).numpy(),
                         tf.cast(tf.cast(deltas, tf.bfloat16), tf.float32).numpy(), rois, image_hw, max_det=30)


def test_padded_rois_never_detected(rng):
    logits, deltas, rois, image_hw = random_case(rng, num_padded=0)
    # Row 0: the usual all -1 padding. Row 1: padding by is_padding's rule (max coordinate < 0) with a
    # real extent, whose deltas would move it well inside the image. Both get overwhelming class-1 logits.
    rois[:, 0] = -1
    rois[:, 1] = [-20, -20, -1, -1]
    deltas[:, 1] = [20.0, 20.0, 0.0, 0.0]  # moves the centre by two box sizes
    logits[:, :2] = -10.0
    logits[:, :2, 1] = 10.0
    moved = np_decode(deltas[0, 1, 1], rois[0, 1])
    assert moved.min() > 0  # without the padding rule row 1 would be a confident detection
    out = postprocess.generate_detections(logits, deltas, rois, image_hw, score_threshold=0.0)
    boxes = out["detection_boxes"].numpy()
    assert not np.isclose(boxes, moved, atol=1e-3).all(-1).any()
    check_against_oracle(out, logits, deltas, rois, image_hw, score_thr=0.0)


def test_score_threshold_respected():
    # Two far-apart rois, zero deltas; class-1 scores of 0.3 +- a little.
    rois = np.array([[[0, 0, 10, 10], [30, 30, 40, 40]]], np.float32)
    deltas = np.zeros((1, 2, 3, 4), np.float32)
    probs = np.array([[[0.7 - 1e-3, 0.3 + 1e-3, 0.0], [0.7 + 1e-3, 0.3 - 1e-3, 0.0]]])
    logits = np.log(np.maximum(probs, 1e-30)).astype(np.float32)
    out = postprocess.generate_detections(logits, deltas, rois, np.array([[50, 50]], np.float32),
                                          score_threshold=0.3)
    assert out["num_detections"].numpy()[0] == 1
    np.testing.assert_array_equal(out["detection_boxes"].numpy()[0, 0], rois[0, 0])
    np.testing.assert_allclose(out["detection_scores"].numpy()[0, 0], 0.301, rtol=1e-5)
    assert out["detection_classes"].numpy()[0, 0] == 1


def test_score_must_exceed_the_threshold():
    # Equal logits over two classes: a score of exactly 0.5 is dropped at threshold 0.5 (torchvision's and
    # Detectron2's `score > threshold`) and kept just below it.
    args = (np.zeros((1, 1, 2), np.float32), np.zeros((1, 1, 2, 4), np.float32),
            np.array([[[0, 0, 10, 10]]], np.float32), np.array([[50, 50]], np.float32))
    np.testing.assert_array_equal(postprocess.generate_detections(*args, score_threshold=0.5)["num_detections"], [0])
    out = postprocess.generate_detections(*args, score_threshold=0.4999)
    np.testing.assert_array_equal(out["num_detections"].numpy(), [1])
    np.testing.assert_array_equal(out["detection_scores"].numpy()[0, 0], 0.5)


def test_small_boxes_are_dropped(rng):
    # Boxes with a side below min_box_size (some clipped thin at the image border) go; the rest match the oracle.
    logits, deltas, rois, image_hw = random_case(rng)
    rois[0, :6] = [[0, 0, 0.3, 8], [5, 5, 13, 5.2], [1, 1, 9, 9], [60, 2, 70, 9], [3, 63.7, 9, 70], [2, 2, 2.6, 2.6]]
    deltas[0, :6] = 0
    image_hw[:] = 64
    for min_size in (0.0, 0.5, 2.0):
        out = postprocess.generate_detections(logits, deltas, rois, image_hw, score_threshold=0.0,
                                              min_box_size=min_size)
        check_against_oracle(out, logits, deltas, rois, image_hw, score_thr=0.0, min_size=min_size)


def test_max_detections_cap(rng):
    # 10 x 8 disjoint rois, 4 foreground classes, no threshold: 320 candidates, nothing suppressed.
    grid = np.stack(np.meshgrid(np.arange(10) * 6.0, np.arange(8) * 6.0, indexing="ij"), -1).reshape(-1, 2)
    rois = np.concatenate([grid, grid + 5], axis=-1)[None].astype(np.float32)
    logits = rng.normal(size=(1, 80, 5)).astype(np.float32)
    deltas = np.zeros((1, 80, 5, 4), np.float32)
    out = postprocess.generate_detections(logits, deltas, rois, np.array([IMAGE_HW], np.float32),
                                          max_detections=25, score_threshold=0.0)
    assert out["num_detections"].numpy()[0] == 25
    probs = tf.nn.softmax(logits).numpy()[0, :, 1:]
    np.testing.assert_allclose(out["detection_scores"].numpy()[0], np.sort(probs.ravel())[::-1][:25], rtol=1e-6)
    check_against_oracle(out, logits, deltas, rois, np.array([IMAGE_HW], np.float32), max_det=25, score_thr=0.0)


def test_background_never_emitted(rng):
    logits, deltas, rois, image_hw = random_case(rng, num_classes=3)
    logits[..., 0] = 20.0  # background dominates every roi
    out = postprocess.generate_detections(logits, deltas, rois, image_hw, score_threshold=0.0, nms_threshold=1.0)
    classes = out["detection_classes"].numpy()
    num = out["num_detections"].numpy()
    assert (num == 40).all()  # 20 real rois x 2 foreground classes, nothing suppressed
    assert set(np.unique(classes[:, :40])) == {1, 2}
    assert (out["detection_scores"].numpy() < 0.01).all()


def test_degenerate_and_empty(rng):
    logits, deltas, rois, image_hw = random_case(rng, batch=2, num_rois=6, num_padded=0)
    deltas[:] = 0
    rois[0] = [70, 10, 90, 30]  # below the 64-pixel-high image: zero height once clipped
    rois[1] = -1  # all padding
    out = postprocess.generate_detections(logits, deltas, rois, image_hw, score_threshold=0.0)
    np.testing.assert_array_equal(out["num_detections"].numpy(), [0, 0])
    assert not out["detection_boxes"].numpy().any() and not out["detection_scores"].numpy().any()
    assert not out["detection_classes"].numpy().any()


def test_boxes_clipped_to_image_hw(rng):
    logits, deltas, rois, _ = random_case(rng)
    deltas *= 8  # large deltas push many boxes across the border
    image_hw = np.array([[40, 50], [64, 30]], np.float32)
    out = postprocess.generate_detections(logits, deltas, rois, image_hw, score_threshold=0.0)
    boxes = out["detection_boxes"].numpy()
    for b in range(2):
        assert boxes[b, :, 0::2].max() <= image_hw[b, 0] and boxes[b, :, 1::2].max() <= image_hw[b, 1]
    assert (boxes >= 0).all()
    check_against_oracle(out, logits, deltas, rois, image_hw, score_thr=0.0)


@pytest.mark.parametrize("kwargs, match", [
    (dict(max_detections=0), "max_detections"),
    (dict(nms_threshold=1.5), "nms_threshold"),
    (dict(score_threshold=-0.1), "score_threshold"),
    (dict(pre_nms_topn_per_class=0), "pre_nms_topn_per_class"),
    (dict(bbox_reg_weights=(1.0, 1.0, 0.0, 1.0)), "bbox_reg_weights"),
])
def test_bad_parameters(kwargs, match):
    with pytest.raises(ValueError, match=match):
        postprocess.generate_detections(np.zeros((1, 2, 3)), np.zeros((1, 2, 3, 4)), np.zeros((1, 2, 4)),
                                        np.ones((1, 2)), **kwargs)


@pytest.mark.parametrize("shapes, match", [
    (((1, 2, 1), (1, 2, 1, 4), (1, 2, 4), (1, 2)), "class_logits"),
    (((1, 2, 3), (1, 2, 4, 4), (1, 2, 4), (1, 2)), "box_deltas"),
    (((1, 2, 3), (1, 2, 3), (1, 2, 4), (1, 2)), "box_deltas"),
    (((1, 2, 3), (1, 2, 3, 4), (1, 3, 4), (1, 2)), "rois"),
    (((1, 2, 3), (1, 2, 3, 4), (1, 2, 4), (1, 3)), "image_hw"),
])
def test_bad_shapes(shapes, match):
    with pytest.raises(ValueError, match=match):
        postprocess.generate_detections(*[np.zeros(shape, np.float32) for shape in shapes])
