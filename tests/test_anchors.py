"""Anchors and RPN targets against slow NumPy references (a loop generator and a loop labeler); the fused RPN
targets op (mrcnn_tf2.ops.fused) against this pure-TF twin, seed for seed, and the labeler.
"""
import numpy as np
import pytest
import tensorflow as tf

from mrcnn_tf2.ops import anchors as anchor_ops
from mrcnn_tf2.ops import box_ops
from mrcnn_tf2.ops import fused

IMAGE_SIZE = (96, 128)
MIN_LEVEL, MAX_LEVEL = 2, 5
NUM_SCALES = 2
ASPECT_RATIOS = ((1.0, 1.0), (1.4, 0.7), (0.7, 1.4))
ANCHOR_SCALE = 2.0
NUM_PER_LOCATION = NUM_SCALES * len(ASPECT_RATIOS)


@pytest.fixture(scope="module")
def anchors():
    return anchor_ops.generate_anchors(
        MIN_LEVEL, MAX_LEVEL, NUM_SCALES, ASPECT_RATIOS, ANCHOR_SCALE, IMAGE_SIZE)


def np_generate_anchors(min_level, max_level, num_scales, aspect_ratios, anchor_scale, image_size):
    """One box at a time, in the documented (y, x, scale, ratio) order."""
    out = {}
    for level in range(min_level, max_level + 1):
        stride = 2 ** level
        boxes = []
        for i in range(image_size[0] // stride):
            for j in range(image_size[1] // stride):
                for s in range(num_scales):
                    for ar_x, ar_y in aspect_ratios:
                        size = anchor_scale * stride * 2 ** (s / num_scales)
                        yc, xc = (i + 0.5) * stride, (j + 0.5) * stride
                        h, w = size * ar_y, size * ar_x
                        boxes.append([yc - h / 2, xc - w / 2, yc + h / 2, xc + w / 2])
        out[level] = np.array(boxes)
    return out


def np_label_anchors(all_anchors, gt_boxes, positive_overlap, negative_overlap):
    """Labels before sampling (1, 0, -1) and the matched ground truth of every anchor, from the rules."""
    real = gt_boxes[gt_boxes.max(axis=1) >= 0]
    labels = np.full(len(all_anchors), -1)
    if len(real) == 0:
        labels[:] = 0
        return labels, None
    iou = box_ops.bbox_overlap(all_anchors[None], real[None]).numpy()[0]
    max_iou = iou.max(axis=1)
    labels[max_iou < negative_overlap] = 0
    labels[max_iou >= positive_overlap] = 1
    for k in range(len(real)):
        best = iou[:, k].max()
        if best > 0:
            labels[iou[:, k] == best] = 1
    return labels, real[iou.argmax(axis=1)]


def flatten(per_level, width):
    """dict level -> [H, W, A*width] -> [M, width], in anchor order."""
    return np.concatenate([np.reshape(per_level[level], [-1, width]) for level in sorted(per_level)])


def make_gt(rows, num_padded=3):
    """Ground truth [K, 4] with padding rows inserted after the first box."""
    rows = np.asarray(rows, np.float32).reshape(-1, 4)
    padding = np.full((num_padded, 4), box_ops.PADDING_BOX_VALUE, np.float32)
    return np.concatenate([rows[:1], padding, rows[1:]])


def run_targets(anchors, gt, **kwargs):
    out = anchor_ops.rpn_targets(anchors, gt, IMAGE_SIZE, **kwargs)
    return flatten(out["rpn_score_targets"], 1)[:, 0], flatten(out["rpn_box_targets"], 4), out


# Boxes of several sizes; the 2x2 one lies inside many equal anchors (an exact tie of best IoUs), the
# 6x5 one overlaps every anchor by less than 0.7 (its best anchors are forced positive), and the
# zero-height one matches nothing.
VARIED_GT = [[10.3, 20.1, 50.7, 70.2], [40.0, 90.0, 94.0, 127.0], [45.0, 45.0, 47.0, 47.0],
             [70.2, 5.1, 76.2, 10.1], [30.0, 30.0, 30.0, 60.0]]


def test_generate_anchors_matches_loop_reference(anchors):
    expected = np_generate_anchors(MIN_LEVEL, MAX_LEVEL, NUM_SCALES, ASPECT_RATIOS, ANCHOR_SCALE, IMAGE_SIZE)
    assert sorted(anchors) == list(range(MIN_LEVEL, MAX_LEVEL + 1))
    for level, boxes in anchors.items():
        assert boxes.dtype == np.float32
        feat_h, feat_w = anchor_ops.feature_size(IMAGE_SIZE, level)
        assert boxes.shape == (feat_h * feat_w * NUM_PER_LOCATION, 4)
        np.testing.assert_allclose(boxes, expected[level], rtol=1e-6, atol=1e-4)
    assert anchor_ops.num_anchors_per_location(NUM_SCALES, ASPECT_RATIOS) == NUM_PER_LOCATION


def test_generate_anchors_rejects_bad_levels():
    with pytest.raises(ValueError, match="max_level"):
        anchor_ops.generate_anchors(4, 3, 1, ASPECT_RATIOS, 8.0, IMAGE_SIZE)


def test_generate_anchors_of_a_size_that_coarse_levels_round_up():
    """800x1088, a multiple of 32 but not of 64: P6's grid rounds up to 13x17, as a stride-2 subsampling of P5's
    25x34 gives, and its anchors step by torchvision's 800 // 13 = 61 pixels down (1088 // 17 = 64 across)."""
    anchors = anchor_ops.generate_anchors(2, 6, 1, ASPECT_RATIOS, 8.0, (800, 1088), offset=0.0)
    assert [anchor_ops.feature_size((800, 1088), level) for level in (2, 5, 6)] == [(200, 272), (25, 34), (13, 17)]
    centres = anchors[6].reshape(13, 17, len(ASPECT_RATIOS), 4)[..., :2] + anchors[6].reshape(
        13, 17, len(ASPECT_RATIOS), 4)[..., 2:]
    np.testing.assert_allclose(centres[:, 0, 0, 0] / 2, 61 * np.arange(13), atol=1e-4)
    np.testing.assert_allclose(centres[0, :, 0, 1] / 2, 64 * np.arange(17), atol=1e-4)
    np.testing.assert_array_equal(anchors[5], anchor_ops.generate_anchors(5, 5, 1, ASPECT_RATIOS, 8.0, (800, 1088),
                                                                          offset=0.0)[5])
    # The labels' grid check takes these anchors (the input pipeline labels them for training).
    gt = tf.constant([[100.0, 100.0, 300.0, 400.0]])
    targets = anchor_ops.rpn_targets(anchors, gt, (800, 1088), seed=tf.constant([1, 2]))
    assert targets["rpn_score_targets"][6].shape == (13, 17, len(ASPECT_RATIOS))


def test_grid_iou_equals_pairwise_iou(anchors, rng):
    gt = np.concatenate([rng.uniform(0, 60, (6, 2)), rng.uniform(60, 130, (6, 2))], axis=1)[:, [0, 1, 2, 3]]
    gt = gt.astype(np.float32)
    gt[0] = [20, 20, 20, 50]  # zero area
    for level, boxes in anchors.items():
        feat_h, feat_w = anchor_ops.feature_size(IMAGE_SIZE, level)
        grid = anchor_ops._grid_iou(boxes, feat_h, feat_w, gt).numpy()
        expected = box_ops.bbox_overlap(boxes[None], gt[None]).numpy()[0]
        np.testing.assert_allclose(grid.reshape(-1, len(gt)), expected, atol=1e-6)


def test_labels_match_reference_without_subsampling(anchors):
    gt = make_gt(VARIED_GT)
    all_anchors = flatten(anchors, 4)
    expected, _ = np_label_anchors(all_anchors, gt, 0.7, 0.3)
    # A sample larger than all anchors keeps every positive and negative: no randomness left.
    labels, _, _ = run_targets(anchors, gt, batch_size_per_im=10 * len(all_anchors))
    np.testing.assert_array_equal(labels, expected)
    assert 0 < np.sum(expected == 1) < 128
    assert np.sum(expected == -1) > 0


def test_forced_matches_include_ties_and_only_positive_overlaps(anchors):
    all_anchors = flatten(anchors, 4)
    tiny = np.array([[45.0, 45.0, 47.0, 47.0]], np.float32)
    iou = box_ops.bbox_overlap(all_anchors[None], tiny[None]).numpy()[0, :, 0]
    best = np.flatnonzero(iou == iou.max())
    assert len(best) > 1 and iou.max() < 0.3  # the case really has tied, low-quality best matches
    labels, _, _ = run_targets(anchors, make_gt(tiny))
    np.testing.assert_array_equal(np.flatnonzero(labels == 1), best)
    # A box outside every anchor forces nothing.
    far = np.array([[5000.0, 5000.0, 5010.0, 5010.0]], np.float32)
    labels, _, _ = run_targets(anchors, make_gt(far))
    assert np.sum(labels == 1) == 0 and np.sum(labels == 0) == 256


def test_sampling_keeps_all_few_positives_and_fills_with_negatives(anchors):
    gt = make_gt(VARIED_GT)
    expected, _ = np_label_anchors(flatten(anchors, 4), gt, 0.7, 0.3)
    labels, _, _ = run_targets(anchors, gt)
    num_positive = np.sum(expected == 1)
    np.testing.assert_array_equal(np.flatnonzero(labels == 1), np.flatnonzero(expected == 1))
    assert np.sum(labels == 0) == 256 - num_positive
    assert np.all(expected[labels == 0] == 0)


def test_sampling_caps_many_positives(anchors, rng):
    all_anchors = flatten(anchors, 4)
    # Slightly moved copies of 200 anchors: each overlaps its anchor by far more than 0.7.
    gt = all_anchors[rng.choice(len(all_anchors), 200, replace=False)] + rng.uniform(-0.2, 0.2, (200, 4))
    gt = gt.astype(np.float32)
    expected, _ = np_label_anchors(all_anchors, gt, 0.7, 0.3)
    assert np.sum(expected == 1) > 128
    labels, _, _ = run_targets(anchors, gt, batch_size_per_im=256, fg_fraction=0.5)
    assert np.sum(labels == 1) == 128 and np.sum(labels == 0) == 128
    assert np.all(expected[labels == 1] == 1) and np.all(expected[labels == 0] == 0)


def test_box_targets_decode_to_matched_gt_and_vanish_elsewhere(anchors):
    gt = make_gt(VARIED_GT)
    all_anchors = flatten(anchors, 4)
    _, matched = np_label_anchors(all_anchors, gt, 0.7, 0.3)
    labels, deltas, out = run_targets(anchors, gt)
    for level in anchors:
        feat_h, feat_w = anchor_ops.feature_size(IMAGE_SIZE, level)
        assert out["rpn_score_targets"][level].shape == (feat_h, feat_w, NUM_PER_LOCATION)
        assert out["rpn_score_targets"][level].dtype == tf.int32
        assert out["rpn_box_targets"][level].shape == (feat_h, feat_w, 4 * NUM_PER_LOCATION)
    positive = labels == 1
    decoded = box_ops.decode_boxes(deltas[positive], all_anchors[positive], anchor_ops.RPN_BOX_WEIGHTS)
    np.testing.assert_allclose(decoded, matched[positive], atol=1e-3)
    assert np.all(deltas[~positive] == 0.0)


@pytest.mark.parametrize("gt", [np.full((4, 4), -1.0, np.float32), np.zeros((0, 4), np.float32)])
def test_no_ground_truth_gives_only_negatives(anchors, gt):
    labels, deltas, _ = run_targets(anchors, gt)
    assert np.sum(labels == 1) == 0 and np.sum(labels == 0) == 256
    assert np.all(deltas == 0.0) and np.all(np.isfinite(deltas))


def test_negatives_are_sampled_uniformly(anchors):
    gt = make_gt(VARIED_GT)
    expected, _ = np_label_anchors(flatten(anchors, 4), gt, 0.7, 0.3)
    negatives = np.flatnonzero(expected == 0)
    targets = tf.function(lambda g: anchor_ops.rpn_targets(anchors, g, IMAGE_SIZE)["rpn_score_targets"])
    counts = np.zeros(len(expected))
    runs = 40
    for _ in range(runs):
        counts += flatten(targets(gt), 1)[:, 0] == 0
    rate = np.mean(counts[negatives]) / runs
    # A sampler biased by position (e.g. the first negatives) would starve one half of the candidates.
    halves = np.array_split(negatives, 2)
    for half in halves:
        np.testing.assert_allclose(np.mean(counts[half]) / runs, rate, rtol=0.15)
    assert np.all(counts[expected != 0] == 0)


def test_runs_in_tf_data_with_static_shapes(anchors):
    gt = np.stack([make_gt(VARIED_GT), make_gt(VARIED_GT[:1], num_padded=7)])
    dataset = tf.data.Dataset.from_tensor_slices(gt).map(
        lambda boxes: anchor_ops.rpn_targets(anchors, boxes, IMAGE_SIZE), num_parallel_calls=2)
    spec = dataset.element_spec
    for level in anchors:
        feat_h, feat_w = anchor_ops.feature_size(IMAGE_SIZE, level)
        assert spec["rpn_score_targets"][level].shape == (feat_h, feat_w, NUM_PER_LOCATION)
        assert spec["rpn_box_targets"][level].shape == (feat_h, feat_w, 4 * NUM_PER_LOCATION)
    for element in dataset:
        labels = flatten(element["rpn_score_targets"], 1)
        assert 0 < np.sum(labels == 1) <= 128 and np.sum(labels >= 0) == 256


def test_bad_inputs_raise(anchors):
    with pytest.raises(ValueError, match="last dimension 4"):
        anchor_ops.rpn_targets(anchors, np.zeros((3, 5), np.float32), IMAGE_SIZE)
    with pytest.raises(ValueError, match="grid"):
        anchor_ops.rpn_targets(anchors, np.zeros((3, 4), np.float32), (64, 64))


# -- the fused op against its twin -------------------------------------------------------------------------

def assert_same_rpn_targets(got, want):
    for key in ("rpn_score_targets", "rpn_box_targets"):
        assert got[key].keys() == want[key].keys()
        for level in got[key]:
            assert got[key][level].shape == want[key][level].shape and got[key][level].dtype == want[key][level].dtype
            np.testing.assert_array_equal(got[key][level].numpy(), want[key][level].numpy())


def both_rpn_targets(anchors, gt, **kwargs):
    return [fn(anchors, gt, IMAGE_SIZE, **kwargs) for fn in (fused.rpn_targets, anchor_ops.rpn_targets)]


@pytest.mark.parametrize("gt_kind", ["varied", "many", "padding only", "none", "outside and degenerate"])
def test_rpn_targets_equal_twin_for_the_same_seed(anchors, rng, gt_kind):
    all_anchors = flatten(anchors, 4)
    gt = {
        "varied": make_gt(VARIED_GT),
        # More positives than the cap: the random choice among them must match too.
        "many": (all_anchors[rng.choice(len(all_anchors), 200, replace=False)]
                 + rng.uniform(-0.2, 0.2, (200, 4))).astype(np.float32),
        "padding only": np.full((4, 4), -1.0, np.float32),
        "none": np.zeros((0, 4), np.float32),
        "outside and degenerate": make_gt([[-50.0, -50.0, -10.0, -10.0], [200.0, 10.0, 260.0, 60.0],
                                           [20.0, 20.0, 20.0, 40.0], [30.0, 40.0, 10.0, 20.0],
                                           [10.0, 10.0, 60.0, 70.0]]),
    }[gt_kind]
    for seed in ([3, 4], [5, 6]):
        got, want = both_rpn_targets(anchors, gt, seed=tf.constant(seed))
        assert_same_rpn_targets(got, want)
    labels = flatten(got["rpn_score_targets"], 1)[:, 0]
    expected, _ = np_label_anchors(all_anchors, gt, 0.7, 0.3)
    assert np.all(expected[labels == 1] == 1) and np.all(expected[labels == 0] == 0)
    assert np.sum(labels >= 0) == 256


def test_rpn_targets_other_settings_and_in_tf_data(anchors):
    gt = make_gt(VARIED_GT)
    kwargs = dict(positive_overlap=0.5, negative_overlap=0.4, batch_size_per_im=64, fg_fraction=0.25,
                  seed=tf.constant([1, 2]))
    assert_same_rpn_targets(*both_rpn_targets(anchors, gt, **kwargs))
    seeds = tf.constant([[7, 0], [7, 1]], tf.int64)
    boxes = np.stack([make_gt(VARIED_GT), make_gt(VARIED_GT[:1], num_padded=7)])
    datasets = [tf.data.Dataset.from_tensor_slices((boxes, seeds)).map(
        lambda b, s, fn=fn: fn(anchors, b, IMAGE_SIZE, seed=s), num_parallel_calls=2)
        for fn in (fused.rpn_targets, anchor_ops.rpn_targets)]
    assert datasets[0].element_spec == datasets[1].element_spec
    for got, want in zip(*datasets):
        assert_same_rpn_targets(got, want)
