"""Multilevel RoIAlign against a NumPy loop transcription of torchvision's roi_align, and against torchvision;
the fused op (mrcnn_tf2.ops.fused) against this pure-TF twin, the oracle and torchvision.

The torchvision helpers take NumPy arrays in this package's layout (NHWC features, [B, N, 4] boxes [ymin, xmin,
ymax, xmax]) and convert them to torchvision's (NCHW, [K, 5] rows (batch index, x1, y1, x2, y2)).
"""
import math

import numpy as np
import pytest
import tensorflow as tf
import torch
import torchvision

from mrcnn_tf2.model.stages import RoIAligner
from mrcnn_tf2.ops import fused, roi_align


def np_bilinear(feature, y, x):
    """torchvision's bilinear_interpolate for one point of an [H, W, C] map."""
    height, width = feature.shape[:2]
    if y < -1.0 or y > height or x < -1.0 or x > width:
        return np.zeros(feature.shape[-1])
    y, x = max(y, 0.0), max(x, 0.0)
    y_low, x_low = int(y), int(x)
    if y_low >= height - 1:
        y_low = y_high = height - 1
        y = float(y_low)
    else:
        y_high = y_low + 1
    if x_low >= width - 1:
        x_low = x_high = width - 1
        x = float(x_low)
    else:
        x_high = x_low + 1
    ly, lx = y - y_low, x - x_low
    return ((1 - ly) * (1 - lx) * feature[y_low, x_low] + (1 - ly) * lx * feature[y_low, x_high]
            + ly * (1 - lx) * feature[y_high, x_low] + ly * lx * feature[y_high, x_high])


def np_level(box, min_level, max_level):
    size = math.sqrt(max(box[2] - box[0], 0.0) * max(box[3] - box[1], 0.0))
    level = math.floor(4 + math.log2(size / 224.0) + 1e-6) if size > 0 else min_level
    return min(max(level, min_level), max_level)


def np_roi_align(features, boxes, output_size, sampling_ratio, aligned=True):
    """features {level: [B, H, W, C]} float64, boxes [B, N, 4] -> [B, N, R, R, C], one point at a time."""
    levels = sorted(features)
    batch, num_boxes = boxes.shape[:2]
    channels = features[levels[0]].shape[-1]
    out = np.zeros((batch, num_boxes, output_size, output_size, channels))
    for b in range(batch):
        for n in range(num_boxes):
            level = np_level(boxes[b, n], levels[0], levels[-1])
            feature = features[level][b]
            y0, x0, y1, x1 = boxes[b, n] / 2.0**level - (0.5 if aligned else 0.0)
            height, width = y1 - y0, x1 - x0
            if not aligned:
                height, width = max(height, 1.0), max(width, 1.0)
            bin_h, bin_w = height / output_size, width / output_size
            for i in range(output_size):
                for j in range(output_size):
                    total = np.zeros(channels)
                    for iy in range(sampling_ratio):
                        y = y0 + i * bin_h + (iy + 0.5) * bin_h / sampling_ratio
                        for ix in range(sampling_ratio):
                            x = x0 + j * bin_w + (ix + 0.5) * bin_w / sampling_ratio
                            total += np_bilinear(feature, y, x)
                    out[b, n, i, j] = total / sampling_ratio**2
    return out


def random_pyramid(rng, batch, image_hw, levels, channels, dtype=np.float32):
    return {level: rng.normal(size=(batch, image_hw[0] // 2**level, image_hw[1] // 2**level, channels)).astype(dtype)
            for level in levels}


def random_boxes(rng, batch, num, image_hw, margin=8.0):
    """Boxes of varied size, some reaching past the image edges (to exercise the clamping rules)."""
    y = rng.uniform(-margin, image_hw[0] + margin, size=(batch, num, 2))
    x = rng.uniform(-margin, image_hw[1] + margin, size=(batch, num, 2))
    return np.stack([y.min(-1), x.min(-1), y.max(-1), x.max(-1)], axis=-1).astype(np.float32)


def test_matches_numpy_oracle_on_two_levels(rng):
    image_hw = (48, 64)
    features = random_pyramid(rng, 2, image_hw, (2, 3), 3)
    boxes = random_boxes(rng, 2, 12, image_hw)
    # Two boxes large enough (side >= 112) for level 3, past the image edges; the rest are on level 2.
    boxes[0, 0] = [-20.0, -30.0, 100.0, 130.0]
    boxes[1, 1] = [-5.0, -5.0, 120.0, 120.0]
    got = roi_align.multilevel_roi_align(features, boxes, output_size=3, sampling_ratio=2).numpy()
    want = np_roi_align({k: v.astype(np.float64) for k, v in features.items()}, boxes, 3, 2)
    assert got.shape == (2, 12, 3, 3, 3)
    assert {np_level(b, 2, 3) for b in boxes.reshape(-1, 4)} == {2, 3}
    np.testing.assert_allclose(got, want, atol=1e-4)


def test_sampling_ratio_one_and_inside_tf_function(rng):
    image_hw = (32, 32)
    features = random_pyramid(rng, 1, image_hw, (2, 3, 4), 2)
    boxes = random_boxes(rng, 1, 5, image_hw, margin=2.0)
    fn = tf.function(lambda f, b: roi_align.multilevel_roi_align(f, b, output_size=4, sampling_ratio=1))
    got = fn(features, tf.constant(boxes)).numpy()
    want = np_roi_align({k: v.astype(np.float64) for k, v in features.items()}, boxes, 4, 1)
    np.testing.assert_allclose(got, want, atol=1e-4)


def test_level_assignment():
    sides = np.array([32.0, 112.0, 224.0, 448.0, 896.0], np.float32)
    boxes = np.stack([np.zeros(5), np.zeros(5), sides, sides], axis=-1)[None].astype(np.float32)
    np.testing.assert_array_equal(roi_align.assign_levels(boxes, 2, 5).numpy(), [[2, 3, 4, 5, 5]])
    # Just below a power of two falls to the lower level.
    np.testing.assert_array_equal(roi_align.assign_levels([[0.0, 0.0, 223.0, 223.0]], 2, 5).numpy(), [3])


def test_level_assignment_selects_features():
    """A box of side 224 on a pyramid whose level 4 alone is nonzero reads that level only."""
    features = {level: np.zeros((1, 512 // 2**level, 512 // 2**level, 1), np.float32) for level in (2, 3, 4, 5)}
    features[4][:] = 1.0
    boxes = np.array([[[100.0, 100.0, 324.0, 324.0], [100.0, 100.0, 212.0, 212.0]]], np.float32)
    out = roi_align.multilevel_roi_align(features, boxes, 2).numpy()
    np.testing.assert_allclose(out[0, 0], 1.0)
    np.testing.assert_allclose(out[0, 1], 0.0)


def test_padded_and_degenerate_boxes_are_finite(rng):
    features = random_pyramid(rng, 2, (32, 48), (2, 3), 4)
    boxes = np.full((2, 3, 4), -1.0, np.float32)
    boxes[0, 1] = [10.0, 10.0, 10.0, 10.0]  # empty
    boxes[1, 2] = [20.0, 5.0, 12.0, 30.0]  # inverted
    got = roi_align.multilevel_roi_align(features, boxes, 2).numpy()
    assert np.all(np.isfinite(got))
    want = np_roi_align({k: v.astype(np.float64) for k, v in features.items()}, boxes, 2, 2)
    np.testing.assert_allclose(got, want, atol=1e-4)
    # A padded box samples at (-0.75, -0.75) on level 2, which clamps to cell (0, 0).
    np.testing.assert_allclose(got[0, 0], np.broadcast_to(features[2][0, 0, 0], (2, 2, 4)), atol=1e-6)


def test_samples_on_the_valid_range_edges():
    """Samples at exactly -1 or H (W) still count, clamped to the edge cell; just beyond, they are 0."""
    feature = np.arange(64, dtype=np.float32).reshape(1, 8, 8, 1)
    # One sample per box at its centre; level-2 coordinate = centre / 4 - 0.5.
    centres = [(34.0, 10.0), (-2.0, 10.0), (10.0, 34.0), (36.0, 10.0), (10.0, -4.0)]
    boxes = np.array([[[cy - 2, cx - 2, cy + 2, cx + 2] for cy, cx in centres]], np.float32)
    got = roi_align.multilevel_roi_align({2: feature}, boxes, output_size=1, sampling_ratio=1).numpy()
    # (y, x) = (8, 2) -> cell (7, 2); (-1, 2) -> (0, 2); (2, 8) -> (2, 7); y = 8.5 and x = -1.5 are out.
    np.testing.assert_allclose(got.reshape(-1), [7 * 8 + 2, 2, 2 * 8 + 7, 0.0, 0.0])


def test_bfloat16_features_give_bfloat16_output(rng):
    features = random_pyramid(rng, 1, (32, 32), (2, 3), 2)
    boxes = random_boxes(rng, 1, 4, (32, 32))
    bf16 = {k: tf.cast(v, tf.bfloat16) for k, v in features.items()}
    with tf.GradientTape() as tape:
        tape.watch(bf16)
        got = roi_align.multilevel_roi_align(bf16, boxes, 3)
        loss = tf.reduce_sum(tf.cast(got, tf.float32))
    assert got.dtype == tf.bfloat16
    grad = tf.convert_to_tensor(tape.gradient(loss, bf16)[2])
    assert grad.dtype == tf.bfloat16 and float(tf.reduce_sum(tf.cast(grad, tf.float32))) > 0
    want = np_roi_align({k: tf.cast(v, tf.float64).numpy() for k, v in bf16.items()}, boxes, 3, 2)
    np.testing.assert_allclose(tf.cast(got, tf.float32).numpy(), want, atol=2e-2, rtol=1e-2)


def test_gradient_reaches_only_features_under_the_box():
    features = {2: tf.zeros((1, 16, 16, 2)), 3: tf.zeros((1, 8, 8, 2))}
    boxes = tf.constant([[[8.0, 16.0, 24.0, 40.0]]])  # level 2 cells y 2..6, x 4..10
    with tf.GradientTape() as tape:
        tape.watch([features, boxes])
        loss = tf.reduce_sum(roi_align.multilevel_roi_align(features, boxes, 2))
    grads, box_grad = tape.gradient(loss, [features, boxes])
    assert box_grad is None
    grad2 = tf.convert_to_tensor(grads[2]).numpy()[0, ..., 0]
    # Scaled box y in [1.5, 5.5], x in [3.5, 9.5]; the bilinear taps span rows 1..6 and cols 3..10.
    assert np.all(grad2[2:6, 4:10] > 0)
    outside = np.ones_like(grad2, bool)
    outside[1:7, 3:11] = False
    assert np.all(grad2[outside] == 0)
    # Every output averages weights that sum to 1: total gradient = R * R outputs * 2 channels / 2 channels.
    assert grad2.sum() == pytest.approx(4.0, abs=1e-5)
    assert grads[3] is None or np.all(tf.convert_to_tensor(grads[3]).numpy() == 0)


@pytest.mark.parametrize("kwargs, match", [
    (dict(features={}), "features"),
    (dict(features={2: np.zeros((1, 4, 4, 1), np.float32), 4: np.zeros((1, 1, 1, 1), np.float32)}), "consecutive"),
    (dict(output_size=0), "output_size"),
    (dict(sampling_ratio=0), "sampling_ratio"),
    (dict(boxes=np.zeros((1, 3, 5), np.float32)), "boxes"),
    (dict(aligned="False"), "aligned"),
])
def test_bad_arguments(kwargs, match):
    args = dict(features={2: np.zeros((1, 4, 4, 1), np.float32)}, boxes=np.zeros((1, 3, 4), np.float32),
                output_size=2, sampling_ratio=2)
    args.update(kwargs)
    with pytest.raises(ValueError, match=match):
        roi_align.multilevel_roi_align(**args)


# -- against torchvision -----------------------------------------------------------------------------------

# A multiple of 32, so that MultiScaleRoIAlign infers P2..P5's strides 4..32 from the feature sizes.
TORCHVISION_IMAGE_HW = (96, 128)


def nchw(features):
    return torch.from_numpy(features).permute(0, 3, 1, 2)


def xyxy(boxes):
    return torch.from_numpy(np.ascontiguousarray(boxes[..., [1, 0, 3, 2]]))


def per_box_nhwc(out, boxes):
    """torchvision's [B * N, C, R, R] output as [B, N, R, R, C]."""
    out = out.permute(0, 2, 3, 1).numpy()
    return out.reshape(boxes.shape[:2] + out.shape[1:])


def torchvision_roi_align(feature, boxes, level, output_size, sampling_ratio, aligned):
    """torchvision.ops.roi_align of every box on one level: [B, H, W, C] feature, [B, N, 4] boxes."""
    batch_index = torch.arange(boxes.shape[0], dtype=torch.float32).repeat_interleave(boxes.shape[1])
    rois = torch.cat([batch_index[:, None], xyxy(boxes).reshape(-1, 4)], dim=1)
    out = torchvision.ops.roi_align(nchw(feature), rois, output_size, 2.0**-level, sampling_ratio, aligned)
    return per_box_nhwc(out, boxes)


def torchvision_multiscale_roi_align(features, boxes, image_hw, output_size, sampling_ratio):
    """torchvision.ops.MultiScaleRoIAlign (aligned=False, FPN level mapper) of {level: [B, H, W, C]}."""
    levels = sorted(features)
    names = [f"p{level}" for level in levels]
    pooler = torchvision.ops.MultiScaleRoIAlign(names, output_size, sampling_ratio)
    out = pooler({name: nchw(features[level]) for name, level in zip(names, levels)}, list(xyxy(boxes)),
                 [image_hw] * len(boxes))
    return per_box_nhwc(out, boxes)


def torchvision_boxes(rng, batch, num, image_hw):
    """[batch, num >= 3, 4] boxes on every level P2..P5, many past the image borders, some under 1 cell.

    Sides are log-uniform in [0.5, 600] px per axis, so some boxes are under one P2 cell (4 px) along one or
    both axes; box 0 is under a cell on both axes, box 1 along y only, and box 2 is on P5 (even images) or
    P4 (odd images). Every box is non-empty: MultiScaleRoIAlign's level of an inverted box is NaN.
    """
    sides = np.exp(rng.uniform(np.log(0.5), np.log(600.0), size=(batch, num, 2)))
    centres = rng.uniform(-16.0, 16.0, size=(batch, num, 2)) + rng.uniform(size=(batch, num, 2)) * image_hw
    sides[:, 0] = [0.6, 0.9]
    sides[:, 1] = [2.0, 40.0]
    sides[0::2, 2] = [500.0, 600.0]  # P5
    sides[1::2, 2] = [250.0, 260.0]  # P4
    return np.concatenate([centres - sides / 2, centres + sides / 2], axis=-1).astype(np.float32)


def check_per_level_against_torchvision(align, rng):
    """align (this package's multilevel_roi_align or its fused twin) given one level only, so that every box
    reads it, equals torchvision.ops.roi_align on that level, for aligned True and False."""
    features = random_pyramid(rng, 3, TORCHVISION_IMAGE_HW, (2, 3), 4)
    boxes = torchvision_boxes(rng, 3, 12, TORCHVISION_IMAGE_HW)
    boxes[2, -1] = -1.0  # a padded row
    cases = [(level, aligned, size) for level in (2, 3) for aligned in (True, False) for size in (7, 14)]
    for level, aligned, output_size in cases:
        reference = torchvision_roi_align(features[level], boxes, level, output_size, 2, aligned)
        got = align({level: features[level]}, boxes, output_size, 2, aligned=aligned)
        np.testing.assert_allclose(got.numpy(), reference, rtol=1e-5, atol=1e-6,
                                   err_msg=f"level {level}, aligned={aligned}, output_size {output_size}")


def check_multiscale_against_torchvision(align, rng):
    """align(..., aligned=False) on P2..P5 equals torchvision.ops.MultiScaleRoIAlign at output sizes 7, 14."""
    levels = (2, 3, 4, 5)
    features = random_pyramid(rng, 3, TORCHVISION_IMAGE_HW, levels, 4)
    boxes = torchvision_boxes(rng, 3, 16, TORCHVISION_IMAGE_HW)
    assert {np_level(box, 2, 5) for box in boxes.reshape(-1, 4)} == set(levels)
    for output_size in (7, 14):
        reference = torchvision_multiscale_roi_align(features, boxes, TORCHVISION_IMAGE_HW, output_size, 2)
        got = align(features, boxes, output_size, 2, aligned=False)
        np.testing.assert_allclose(got.numpy(), reference, rtol=1e-5, atol=1e-6,
                                   err_msg=f"output_size {output_size}")


def test_matches_torchvision_roi_align_per_level(rng):
    check_per_level_against_torchvision(roi_align.multilevel_roi_align, rng)


def test_aligned_false_matches_torchvision_multiscale_roi_align(rng):
    check_multiscale_against_torchvision(roi_align.multilevel_roi_align, rng)


@pytest.mark.parametrize("aligned", [True, False])
def test_feature_sizes_unknown_at_trace_time(rng, aligned):
    """One trace with None batch, height and width serves pyramids of two image sizes (per-batch sizes)."""
    levels = (2, 3, 4, 5)
    # A list, not the {level: tensor} dict: tf.function cannot bind a dict with int keys to a signature.
    signature = [[tf.TensorSpec([None, None, None, 3], tf.float32)] * len(levels),
                 tf.TensorSpec([None, None, 4], tf.float32)]

    @tf.function(input_signature=signature)
    def align(features, boxes):
        return roi_align.multilevel_roi_align(dict(zip(levels, features)), boxes, 7, aligned=aligned)

    for batch, image_hw in [(2, (64, 96)), (1, (128, 32))]:
        features = random_pyramid(rng, batch, image_hw, levels, 3)
        boxes = torchvision_boxes(rng, batch, 6, image_hw)
        want = np_roi_align({k: v.astype(np.float64) for k, v in features.items()}, boxes, 7, 2, aligned)
        got = align([features[level] for level in levels], boxes)
        np.testing.assert_allclose(got.numpy(), want, rtol=1e-5, atol=1e-5)
    assert align.experimental_get_tracing_count() == 1


# -- the fused op against its twin -------------------------------------------------------------------------

def both_roi_align(features, boxes, output_size, sampling_ratio=2, aligned=True):
    return (fused.multilevel_roi_align(features, boxes, output_size, sampling_ratio, aligned),
            roi_align.multilevel_roi_align(features, boxes, output_size, sampling_ratio, aligned))


def edge_case_boxes(rng, image_hw):
    """[2, 10, 4]: random boxes, boxes past and wholly outside the image, empty, inverted and padded."""
    boxes = random_boxes(rng, 2, 10, image_hw, margin=16.0)
    boxes[0, 0] = [-50.0, -60.0, -10.0, -20.0]  # wholly outside (top left)
    boxes[0, 1] = [image_hw[0] + 5.0, 0.0, image_hw[0] + 40.0, 30.0]  # wholly below
    boxes[0, 2] = [10.0, 10.0, 10.0, 10.0]  # empty
    boxes[0, 3] = [20.0, 30.0, 12.0, 5.0]  # inverted
    boxes[1, 5:] = -1.0  # padding
    boxes[1, 0] = [-30.0, -30.0, 200.0, 250.0]  # large: a high level
    return boxes


@pytest.mark.parametrize("aligned", [True, False])
@pytest.mark.parametrize("output_size, sampling_ratio", [(3, 2), (4, 1), (2, 3)])
def test_roi_align_matches_twin_and_oracle(rng, output_size, sampling_ratio, aligned):
    image_hw = (64, 96)
    features = random_pyramid(rng, 2, image_hw, (2, 3, 4), 5)
    boxes = edge_case_boxes(rng, image_hw)
    got, want = both_roi_align(features, boxes, output_size, sampling_ratio, aligned)
    assert got.shape == want.shape == (2, 10, output_size, output_size, 5) and got.dtype == tf.float32
    np.testing.assert_allclose(got.numpy(), want.numpy(), atol=1e-5)
    oracle = np_roi_align({k: v.astype(np.float64) for k, v in features.items()}, boxes, output_size,
                          sampling_ratio, aligned)
    np.testing.assert_allclose(got.numpy(), oracle, atol=1e-4)


def test_roi_align_matches_torchvision_roi_align_per_level(rng):
    check_per_level_against_torchvision(fused.multilevel_roi_align, rng)


def test_roi_align_aligned_false_matches_torchvision_multiscale_roi_align(rng):
    check_multiscale_against_torchvision(fused.multilevel_roi_align, rng)


def test_roi_align_no_boxes_all_padding_and_an_empty_level(rng):
    features = random_pyramid(rng, 2, (64, 64), (2, 3, 4, 5), 3)
    got, want = both_roi_align(features, np.zeros((2, 0, 4), np.float32), 7)
    assert got.shape == (2, 0, 7, 7, 3)
    padded = np.full((2, 4, 4), -1.0, np.float32)
    got, want = both_roi_align(features, padded, 7)
    np.testing.assert_allclose(got.numpy(), want.numpy(), atol=1e-6)
    # Small boxes only: levels 3..5 receive no box.
    small = random_boxes(rng, 2, 6, (64, 64), margin=0.0) / 4.0
    assert roi_align.assign_levels(small, 2, 5).numpy().max() == 2
    got, want = both_roi_align(features, small, 7)
    np.testing.assert_allclose(got.numpy(), want.numpy(), atol=1e-5)


@pytest.mark.parametrize("aligned", [True, False])
def test_roi_align_gradient_matches_twin(rng, aligned):
    image_hw = (64, 96)
    features = {k: tf.constant(v) for k, v in random_pyramid(rng, 2, image_hw, (2, 3, 4), 6).items()}
    boxes = edge_case_boxes(rng, image_hw)
    upstream = tf.constant(rng.normal(size=(2, 10, 3, 3, 6)).astype(np.float32))
    grads = []
    for fn in (fused.multilevel_roi_align, roi_align.multilevel_roi_align):
        with tf.GradientTape() as tape:
            tape.watch(features)
            loss = tf.reduce_sum(fn(features, boxes, 3, 2, aligned) * upstream)
        grads.append(tape.gradient(loss, features))
    for level in features:
        got = tf.convert_to_tensor(grads[0][level]).numpy()
        want = tf.convert_to_tensor(grads[1][level]).numpy()
        assert got.shape == features[level].shape
        np.testing.assert_allclose(got, want, atol=1e-5)


def test_roi_aligns_of_shared_features_have_one_gradient(rng):
    """fused.multilevel_roi_aligns: each call's output is the twin's, and the features' gradient is the sum of
    the calls' gradients, made as one chain (each grad op adds into the one before it)."""
    image_hw = (64, 96)
    features = {k: tf.constant(v) for k, v in random_pyramid(rng, 2, image_hw, (2, 3, 4), 6).items()}
    boxes = [edge_case_boxes(rng, image_hw), random_boxes(rng, 2, 4, image_hw)]
    sizes = [3, 5]
    upstream = [tf.constant(rng.normal(size=(2, b.shape[1], r, r, 6)).astype(np.float32))
                for b, r in zip(boxes, sizes)]

    def value_and_grad(align):
        with tf.GradientTape() as tape:
            tape.watch(features)
            pooled = align()
            loss = sum(tf.reduce_sum(p * u) for p, u in zip(pooled, upstream))
        return pooled, tape.gradient(loss, features)

    (got, got_grad), (want, want_grad) = [value_and_grad(align) for align in (
        lambda: fused.multilevel_roi_aligns(features, boxes, sizes),
        lambda: [roi_align.multilevel_roi_align(features, b, r) for b, r in zip(boxes, sizes)])]
    for g, w in zip(got, want):
        np.testing.assert_allclose(g.numpy(), w.numpy(), atol=1e-5)
    for level in features:
        assert got_grad[level].shape == features[level].shape
        np.testing.assert_allclose(got_grad[level].numpy(), want_grad[level].numpy(), atol=1e-5)

    graph = tf.function(lambda: value_and_grad(
        lambda: fused.multilevel_roi_aligns(features, boxes, sizes))).get_concrete_function().graph
    first, second = [op for op in graph.get_operations() if op.type == "MrcnnRoiAlignGrad"]
    assert first.get_attr("num_base") == 0
    assert [t.op for t in second.inputs[4:]] == [first] * 3  # the first's level gradients, one per level


def test_roi_align_grad_adds_into_its_base(rng):
    """MrcnnRoiAlignGrad with a base per level: base + the gradient, the caller's base unchanged; a base of
    the wrong shape or count is a clear error."""
    lib = fused.load_library()
    boxes = tf.constant(random_boxes(rng, 1, 5, (32, 32)))
    levels = tf.constant([[0, 1, 0, 1, 1]], tf.int32)  # boxes on both levels
    grad = tf.constant(rng.normal(size=(1, 5, 3, 3, 4)).astype(np.float32))
    sizes = tf.constant([[8, 8], [4, 4]], tf.int32)
    base = [tf.constant(v) for v in random_pyramid(rng, 1, (32, 32), (2, 3), 4).values()]
    kept = [b.numpy() for b in base]
    attrs = dict(num_levels=2, min_level=2, sampling_ratio=2)
    alone = lib.mrcnn_roi_align_grad(grad, boxes, levels, sizes, [], **attrs)
    added = lib.mrcnn_roi_align_grad(grad, boxes, levels, sizes, base, **attrs)
    for a, s, b, k in zip(alone, added, base, kept):
        assert np.abs(a.numpy()).max() > 0
        np.testing.assert_allclose(s.numpy(), k + a.numpy(), rtol=1e-6, atol=1e-6)
        np.testing.assert_array_equal(b.numpy(), k)
    with pytest.raises(tf.errors.InvalidArgumentError, match="base 1 must be the level's gradient"):
        lib.mrcnn_roi_align_grad(grad, boxes, levels, sizes, [base[0], base[0]], **attrs)
    with pytest.raises((tf.errors.InvalidArgumentError, ValueError), match="num_base must be 0 or num_levels"):
        lib.mrcnn_roi_align_grad(grad, boxes, levels, sizes, base[:1], **attrs)


def test_roi_align_bfloat16_and_inside_tf_function(rng):
    features = {k: tf.cast(v, tf.bfloat16) for k, v in random_pyramid(rng, 1, (64, 64), (2, 3), 4).items()}
    boxes = tf.constant(random_boxes(rng, 1, 5, (64, 64)))

    @tf.function
    def value_and_grad(fn):
        with tf.GradientTape() as tape:
            tape.watch(features)
            out = fn(features, boxes, 3)
            loss = tf.reduce_sum(tf.cast(out, tf.float32) ** 2)
        return out, tape.gradient(loss, features)

    (got, got_grad), (want, want_grad) = [value_and_grad(fn) for fn in (fused.multilevel_roi_align,
                                                                         roi_align.multilevel_roi_align)]
    assert got.dtype == tf.bfloat16 and got_grad[2].dtype == tf.bfloat16
    np.testing.assert_allclose(tf.cast(got, tf.float32).numpy(), tf.cast(want, tf.float32).numpy(), atol=2e-2,
                               rtol=1e-2)
    for level in features:
        np.testing.assert_allclose(tf.cast(got_grad[level], tf.float32).numpy(),
                                   tf.cast(tf.convert_to_tensor(want_grad[level]), tf.float32).numpy(),
                                   atol=3e-2, rtol=2e-2)


@pytest.mark.parametrize("aligned", [True, False])
def test_roi_align_feature_sizes_unknown_at_trace_time(rng, aligned):
    """One trace with None batch, height and width serves pyramids of two image sizes, forward and gradient."""
    levels = (2, 3, 4, 5)
    # A list, not the {level: tensor} dict: tf.function cannot bind a dict with int keys to a signature.
    signature = [[tf.TensorSpec([None, None, None, 3], tf.float32)] * len(levels),
                 tf.TensorSpec([None, None, 4], tf.float32), tf.TensorSpec([None, None, 7, 7, 3], tf.float32)]

    def value_and_grad(fn):
        @tf.function(input_signature=signature)
        def run(features, boxes, upstream):
            with tf.GradientTape() as tape:
                tape.watch(features)
                out = fn(dict(zip(levels, features)), boxes, 7, 2, aligned)
                loss = tf.reduce_sum(out * upstream)
            return out, tape.gradient(loss, features)
        return run

    got_fn, want_fn = value_and_grad(fused.multilevel_roi_align), value_and_grad(roi_align.multilevel_roi_align)
    for batch, image_hw in [(2, (64, 96)), (1, (128, 32))]:
        features = [tf.constant(v) for v in random_pyramid(rng, batch, image_hw, levels, 3).values()]
        boxes = torchvision_boxes(rng, batch, 6, image_hw)
        upstream = rng.normal(size=(batch, 6, 7, 7, 3)).astype(np.float32)
        (got, got_grads), (want, want_grads) = got_fn(features, boxes, upstream), want_fn(features, boxes, upstream)
        np.testing.assert_allclose(got.numpy(), want.numpy(), atol=1e-5)
        for feature, got_grad, want_grad in zip(features, got_grads, want_grads):
            assert got_grad.shape == feature.shape
            np.testing.assert_allclose(got_grad.numpy(), want_grad.numpy(), atol=1e-5)
    assert got_fn.experimental_get_tracing_count() == 1


@pytest.mark.parametrize("use_fused", [False, True])
def test_roi_aligner_stage_passes_aligned(rng, use_fused):
    features = random_pyramid(rng, 2, (64, 64), (2, 3), 3)
    boxes = torchvision_boxes(rng, 2, 5, (64, 64))
    align = fused.multilevel_roi_align if use_fused else roi_align.multilevel_roi_align
    got = {aligned: RoIAligner(7, aligned=aligned, fused=use_fused)(features, boxes).numpy()
           for aligned in (True, False)}
    for aligned in (True, False):
        np.testing.assert_array_equal(got[aligned], align(features, boxes, 7, 2, aligned).numpy())
    assert not np.allclose(got[True], got[False], atol=1e-3)
    assert RoIAligner(7).aligned is True


def test_roi_align_bad_arguments_are_the_twins():
    with pytest.raises(ValueError, match="sampling_ratio"):
        fused.multilevel_roi_align({2: np.zeros((1, 4, 4, 1), np.float32)}, np.zeros((1, 3, 4), np.float32), 2, 0)
