"""RoI sampling against a NumPy oracle of the labelling rules (fg/bg thresholds, best match, fg cap)."""
import numpy as np
import pytest
import tensorflow as tf

from mrcnn_tf2.ops import sampling

WEIGHTS = (10.0, 10.0, 5.0, 5.0)


def random_boxes(rng, shape, size=64.0, min_side=2.0, max_side=24.0):
    """[..., 4] float32 boxes inside a size x size image."""
    corner = rng.uniform(0, size - max_side, shape + (2,))
    sides = rng.uniform(min_side, max_side, shape + (2,))
    return np.concatenate([corner, corner + sides], axis=-1).astype(np.float32)


def jittered(rng, boxes, count, scale=0.15):
    """``count`` boxes per image, each a copy of a random row of ``boxes`` [B, K, 4] moved by up to scale x size."""
    picks = rng.integers(0, boxes.shape[1], (boxes.shape[0], count))
    base = np.take_along_axis(boxes, picks[..., None], axis=1)
    sides = np.concatenate([base[..., 2:] - base[..., :2]] * 2, axis=-1)
    return (base + rng.uniform(-scale, scale, base.shape) * sides).astype(np.float32)


def np_iou(a, b):
    """[N, 4] x [M, 4] -> [N, M] IoU in float32, -1 where either box is padding (max coordinate < 0)."""
    a = a[:, None, :]
    b = b[None, :, :]
    inter_h = np.maximum(np.minimum(a[..., 2], b[..., 2]) - np.maximum(a[..., 0], b[..., 0]), 0)
    inter_w = np.maximum(np.minimum(a[..., 3], b[..., 3]) - np.maximum(a[..., 1], b[..., 1]), 0)
    inter = inter_h * inter_w
    area_a = np.maximum(a[..., 2] - a[..., 0], 0) * np.maximum(a[..., 3] - a[..., 1], 0)
    area_b = np.maximum(b[..., 2] - b[..., 0], 0) * np.maximum(b[..., 3] - b[..., 1], 0)
    union = area_a + area_b - inter
    iou = np.where(union > 0, inter / np.where(union > 0, union, 1), 0).astype(np.float32)
    padding = (a.max(-1) < 0) | (b.max(-1) < 0)
    return np.where(padding, np.float32(-1), iou)


def np_encode(box, ref, weights=WEIGHTS):
    """Deltas (dy, dx, dh, dw) of one box w.r.t. one reference box, in float64."""
    box, ref = box.astype(np.float64), ref.astype(np.float64)
    h, w = box[2] - box[0], box[3] - box[1]
    rh, rw = ref[2] - ref[0], ref[3] - ref[1]
    return np.array([weights[0] * ((box[0] + h / 2) - (ref[0] + rh / 2)) / rh,
                     weights[1] * ((box[1] + w / 2) - (ref[1] + rw / 2)) / rw,
                     weights[2] * np.log(h / rh), weights[3] * np.log(w / rw)])


def np_labels(proposals, gt_boxes, gt_classes, fg_thresh=0.5, bg_hi=0.5, bg_lo=0.0):
    """One image: (candidates [C, 4], label [C] in {'fg', 'bg', None}, best GT index [C])."""
    candidates = np.concatenate([proposals, gt_boxes])
    real = (gt_boxes.max(-1) >= 0) & (gt_classes >= 1)
    iou = np_iou(candidates, gt_boxes)
    iou[:, ~real] = -1
    labels, best = [], []
    for row, box in zip(iou, candidates):
        best.append(int(np.argmax(row)))
        if box.max() < 0:
            labels.append(None)
            continue
        top = max(row.max(initial=-1.0), 0.0)
        labels.append("fg" if top >= fg_thresh else "bg" if bg_lo <= top < bg_hi else None)
    return candidates, labels, np.array(best)


def check_against_oracle(out, proposals, gt_boxes, gt_classes, size, fg_fraction, **thresholds):
    """Assert every documented property of ``sample_rois`` output ``out`` for every image."""
    max_fg = int(round(size * fg_fraction))
    out = {key: value.numpy() for key, value in out.items()}
    for b in range(proposals.shape[0]):
        candidates, labels, best = np_labels(proposals[b], gt_boxes[b], gt_classes[b], **thresholds)
        num_fg = min(max_fg, labels.count("fg"))
        num_bg = min(size - num_fg, labels.count("bg"))
        slots = np.arange(size)
        np.testing.assert_array_equal(out["is_foreground"][b], slots < num_fg)
        np.testing.assert_array_equal(out["is_valid"][b], slots < num_fg + num_bg)
        chosen = []
        for s in range(num_fg + num_bg):
            roi = out["rois"][b, s]
            (index,) = np.flatnonzero((candidates == roi).all(-1))[:1]
            chosen.append(index)
            assert labels[index] == ("fg" if s < num_fg else "bg")
            if s < num_fg:
                k = best[index]
                assert out["matched_gt_indices"][b, s] == k
                assert out["class_targets"][b, s] == gt_classes[b, k] >= 1
                np.testing.assert_array_equal(out["matched_gt_boxes"][b, s], gt_boxes[b, k])
                np.testing.assert_allclose(out["box_targets"][b, s], np_encode(gt_boxes[b, k], roi),
                                           rtol=1e-4, atol=1e-4)
        assert len(set(chosen)) == len(chosen), "a candidate was sampled twice"
        not_fg = ~out["is_foreground"][b]
        assert (out["class_targets"][b][not_fg] == 0).all()
        assert (out["matched_gt_indices"][b][not_fg] == 0).all()
        assert (out["box_targets"][b][not_fg] == 0).all()
        assert (out["matched_gt_boxes"][b][not_fg] == -1).all()
        assert (out["rois"][b][~out["is_valid"][b]] == -1).all()


def make_inputs(rng, batch=2, num_gt=6, num_padded_gt=3, num_near=40, num_random=30, num_padded=10):
    """Proposals with many near-GT boxes (foreground), random ones and padding; GT padded at the front."""
    gt = random_boxes(rng, (batch, num_gt))
    classes = rng.integers(1, 9, (batch, num_gt)).astype(np.int32)
    gt_boxes = np.concatenate([np.full((batch, num_padded_gt, 4), -1, np.float32), gt], axis=1)
    gt_classes = np.concatenate([np.full((batch, num_padded_gt), -1, np.int32), classes], axis=1)
    proposals = np.concatenate([jittered(rng, gt, num_near), random_boxes(rng, (batch, num_random)),
                                np.full((batch, num_padded, 4), -1, np.float32)], axis=1)
    return proposals, gt_boxes, gt_classes


@pytest.mark.parametrize("size, fg_fraction, thresholds", [
    (32, 0.25, {}),  # fg cap binds (many foreground candidates)
    (64, 0.5, {}),
    (128, 0.25, {}),  # fewer candidates than S: invalid slots at the end
    (48, 0.25, dict(fg_thresh=0.6, bg_hi=0.4, bg_lo=0.1)),  # a gap of ignored IoUs
])
def test_matches_oracle(rng, size, fg_fraction, thresholds):
    proposals, gt_boxes, gt_classes = make_inputs(rng)
    names = dict(fg_thresh="fg_thresh", bg_hi="bg_thresh_hi", bg_lo="bg_thresh_lo")
    out = sampling.sample_rois(proposals, gt_boxes, gt_classes, batch_size_per_im=size, fg_fraction=fg_fraction,
                               seed=[3, 4], **{names[k]: v for k, v in thresholds.items()})
    check_against_oracle(out, proposals, gt_boxes, gt_classes, size, fg_fraction, **thresholds)


def test_fg_cap_and_fill(rng):
    proposals, gt_boxes, gt_classes = make_inputs(rng, num_near=60, num_random=60)
    out = sampling.sample_rois(proposals, gt_boxes, gt_classes, batch_size_per_im=40, fg_fraction=0.25, seed=[0, 1])
    # The oracle finds more than 10 foreground and 30 background per image, so exactly 10 foreground
    # are kept and 30 background fill up.
    for b in range(2):
        labels = np_labels(proposals[b], gt_boxes[b], gt_classes[b])[1]
        assert labels.count("fg") > 10 and labels.count("bg") > 30
    np.testing.assert_array_equal(out["is_foreground"].numpy().sum(1), [10, 10])
    np.testing.assert_array_equal(out["is_valid"].numpy().sum(1), [40, 40])


def test_image_without_gt_is_all_background(rng):
    proposals, gt_boxes, gt_classes = make_inputs(rng)
    gt_boxes[1] = -1
    gt_classes[1] = -1
    out = sampling.sample_rois(proposals, gt_boxes, gt_classes, batch_size_per_im=128, seed=[5, 6])
    # 70 real proposals, no GT candidates: 70 background slots, then invalid.
    np.testing.assert_array_equal(out["is_valid"].numpy()[1], np.arange(128) < 70)
    assert not out["is_foreground"].numpy()[1].any()
    assert out["is_foreground"].numpy()[0].any()
    check_against_oracle(out, proposals, gt_boxes, gt_classes, 128, 0.25)


def test_zero_gt_columns(rng):
    proposals = random_boxes(rng, (2, 20))
    out = sampling.sample_rois(proposals, np.zeros((2, 0, 4), np.float32), np.zeros((2, 0), np.int32),
                               batch_size_per_im=16, seed=[0, 0])
    assert out["rois"].shape == (2, 16, 4)
    assert out["is_valid"].numpy().all() and not out["is_foreground"].numpy().any()


def test_padded_gt_never_matched(rng):
    proposals, gt_boxes, gt_classes = make_inputs(rng, num_padded_gt=0)
    # Padding in the middle, and a real-looking box whose class says padding: neither may be matched.
    gt_boxes[:, 2] = -1
    gt_classes[:, 2] = -1
    gt_classes[:, 4] = -1
    out = sampling.sample_rois(proposals, gt_boxes, gt_classes, batch_size_per_im=64, fg_fraction=0.5, seed=[1, 1])
    fg = out["is_foreground"].numpy()
    matched = out["matched_gt_indices"].numpy()[fg]
    assert fg.sum() > 0
    assert not np.isin(matched, [2, 4]).any()
    assert (out["class_targets"].numpy()[fg] >= 1).all()
    check_against_oracle(out, proposals, gt_boxes, gt_classes, 64, 0.5)


def test_gt_is_always_a_foreground_candidate(rng):
    gt_boxes = random_boxes(rng, (1, 3))
    gt_classes = np.array([[4, 7, 2]], np.int32)
    proposals = np.full((1, 5, 4), -1, np.float32)  # no real proposal at all
    out = sampling.sample_rois(proposals, gt_boxes, gt_classes, batch_size_per_im=8, seed=[2, 2])
    np.testing.assert_array_equal(out["is_foreground"].numpy()[0], np.arange(8) < 2)  # cap round(8/4) = 2
    out = sampling.sample_rois(proposals, gt_boxes, gt_classes, batch_size_per_im=8, fg_fraction=1.0, seed=[2, 2])
    np.testing.assert_array_equal(out["is_valid"].numpy()[0], np.arange(8) < 3)
    np.testing.assert_array_equal(out["is_foreground"].numpy()[0], np.arange(8) < 3)
    order = out["matched_gt_indices"].numpy()[0, :3]
    assert sorted(order) == [0, 1, 2]
    np.testing.assert_array_equal(out["rois"].numpy()[0, :3], gt_boxes[0, order])
    np.testing.assert_array_equal(out["class_targets"].numpy()[0, :3], gt_classes[0, order])
    np.testing.assert_allclose(out["box_targets"].numpy()[0, :3], 0, atol=1e-6)
    np.testing.assert_array_equal(out["rois"].numpy()[0, 3:], -1)


def test_degenerate_boxes(rng):
    gt_boxes = np.array([[[10, 10, 30, 30], [40, 40, 40, 50]]], np.float32)  # second has zero height
    gt_classes = np.array([[1, 2]], np.int32)
    proposals = np.array([[[40, 40, 40, 50], [11, 11, 11, 11], [10, 10, 31, 30]]], np.float32)
    out = sampling.sample_rois(proposals, gt_boxes, gt_classes, batch_size_per_im=8, fg_fraction=1.0, seed=[0, 0])
    # Foreground: proposal 2 and GT 0 (both match GT 0); background: the two zero-area proposals and
    # the zero-area GT, whose IoU with everything is 0.
    np.testing.assert_array_equal(out["is_foreground"].numpy()[0], np.arange(8) < 2)
    np.testing.assert_array_equal(out["is_valid"].numpy()[0], np.arange(8) < 5)
    np.testing.assert_array_equal(out["class_targets"].numpy()[0], [1, 1, 0, 0, 0, 0, 0, 0])
    assert np.isfinite(out["box_targets"].numpy()).all()


@pytest.mark.parametrize("fg_thresh, bg_hi, bg_lo, expected", [
    (0.5, 0.5, 0.0, ["fg", "fg", "bg", "bg"]),  # IoU exactly fg_thresh is foreground
    (0.6, 0.5, 0.0, [None, None, "bg", "bg"]),  # IoU exactly bg_thresh_hi is not background
    (0.6, 0.55, 0.25, ["bg", "bg", "bg", None]),  # IoU exactly bg_thresh_lo is background
    (0.4, 0.6, 0.0, ["fg", "fg", "bg", "bg"]),  # overlapping ranges: foreground wins
])
def test_threshold_boundaries(fg_thresh, bg_hi, bg_lo, expected):
    # IoUs with the GT [0, 0, 10, 10], exact in float32: 0.5, 0.5, 0.25 and 0.
    proposals = np.array([[[0, 0, 10, 5], [0, 5, 10, 10], [0, 0, 10, 2.5], [20, 20, 30, 30]]], np.float32)
    gt_boxes = np.array([[[0, 0, 10, 10]]], np.float32)
    out = sampling.sample_rois(proposals, gt_boxes, np.array([[3]], np.int32), batch_size_per_im=8,
                               fg_fraction=1.0, fg_thresh=fg_thresh, bg_thresh_hi=bg_hi, bg_thresh_lo=bg_lo,
                               seed=[0, 0])
    rois = out["rois"].numpy()[0]
    fg = out["is_foreground"].numpy()[0]
    bg = out["is_valid"].numpy()[0] & ~fg
    labels = {tuple(r): "fg" for r in rois[fg]}
    labels.update({tuple(r): "bg" for r in rois[bg]})
    assert labels.pop((0, 0, 10, 10)) == "fg"  # the GT itself
    assert [labels.get(tuple(box)) for box in proposals[0]] == expected
    assert len(labels) == sum(e is not None for e in expected)


def test_seed_is_deterministic_and_selection_random(rng):
    proposals, gt_boxes, gt_classes = make_inputs(rng, num_near=60)

    def fg_rois(seed):
        out = sampling.sample_rois(proposals, gt_boxes, gt_classes, batch_size_per_im=16, seed=seed)
        return out["rois"].numpy()[:, :4]

    np.testing.assert_array_equal(fg_rois([7, 8]), fg_rois([7, 8]))
    assert not np.array_equal(fg_rois([7, 8]), fg_rois([7, 9]))


def test_tf_function_bfloat16_and_no_gradient(rng):
    proposals, gt_boxes, gt_classes = make_inputs(rng)
    proposals_bf16 = tf.cast(proposals, tf.bfloat16)

    @tf.function
    def run(props):
        with tf.GradientTape() as tape:
            tape.watch(props)
            out = sampling.sample_rois(props, gt_boxes, gt_classes, batch_size_per_im=32, seed=[1, 2])
            loss = tf.reduce_sum(out["rois"]) + tf.reduce_sum(out["box_targets"])
        return out, tape.gradient(loss, props)

    out, grad = run(tf.constant(proposals))
    assert grad is None
    assert out["rois"].dtype == tf.float32 and out["rois"].shape == (2, 32, 4)
    check_against_oracle(out, proposals, gt_boxes, gt_classes, 32, 0.25)
    out, _ = run(proposals_bf16)
    check_against_oracle(out, tf.cast(proposals_bf16, tf.float32).numpy(), gt_boxes, gt_classes, 32, 0.25)


@pytest.mark.parametrize("kwargs, match", [
    (dict(batch_size_per_im=0), "batch_size_per_im"),
    (dict(fg_fraction=1.5), "fg_fraction"),
    (dict(bg_thresh_lo=0.6), "bg_thresh_lo"),
    (dict(bg_thresh_lo=-1.0), "bg_thresh_lo"),
    (dict(fg_thresh=-0.1), "fg_thresh"),
    (dict(bbox_reg_weights=(1.0, 1.0)), "bbox_reg_weights"),
])
def test_bad_parameters(kwargs, match):
    boxes = np.zeros((1, 3, 4), np.float32)
    with pytest.raises(ValueError, match=match):
        sampling.sample_rois(boxes, boxes, np.ones((1, 3), np.int32), **kwargs)


def test_bad_shapes():
    boxes = np.zeros((1, 3, 4), np.float32)
    with pytest.raises(ValueError, match="proposals"):
        sampling.sample_rois(boxes[0], boxes, np.ones((1, 3), np.int32))
    with pytest.raises(ValueError, match="gt_boxes"):
        sampling.sample_rois(boxes, boxes[..., :3], np.ones((1, 3), np.int32))
    with pytest.raises(ValueError, match="gt_classes"):
        sampling.sample_rois(boxes, boxes, np.ones((1, 4), np.int32))
