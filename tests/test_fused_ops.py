"""Fused C++ ops against their pure-TF twins (and the NumPy oracles of the twins' tests), and the loader.

The suite's set-up (make test -> scripts/setup.sh -> ops/build.sh) builds the library, so these tests
require it to load instead of skipping: a skip would hide a broken build.
"""
import json
import warnings

import keras
import numpy as np
import pytest
import tensorflow as tf
from pycocotools import mask as mask_utils

from mrcnn_tf2.evaluation import coco_metrics
from mrcnn_tf2.model.factory import build_model, choose_ops
from mrcnn_tf2.model.stages import RoIAligner
from mrcnn_tf2.ops import anchors as anchor_ops
from mrcnn_tf2.ops import box_ops, fused, masks, roi_align, roi_ops
from mrcnn_tf2.ops import conv as conv_ops
from tests.test_anchors import VARIED_GT, flatten, make_gt, np_label_anchors
from tests.test_anchors import IMAGE_SIZE as ANCHOR_IMAGE_SIZE
from tests.test_anchors import anchors as rpn_anchors  # noqa: F401 (a fixture)
from tests.test_masks import np_mask_target, np_paste
from tests.test_model import small_config, synthetic_batch
from tests.test_pipeline import first_batches, make_config, training_pipeline
from tests.test_roi_ops import np_propose, rpn_outputs
from tests.test_roi_align import (check_multiscale_against_torchvision, check_per_level_against_torchvision,
                                   np_roi_align, random_boxes, random_pyramid, torchvision_boxes)


@pytest.fixture(autouse=True, scope="module")
def library():
    """Every test here needs the built library; a failure says why (missing, wrong TF, load error)."""
    return fused.load_library()


# -- loader ------------------------------------------------------------------------------------------------

@pytest.fixture
def missing_library(monkeypatch, tmp_path):
    """The loader pointed at a path with no library; its cached state is restored afterwards."""
    fused._reset_for_tests()
    monkeypatch.setattr(fused, "LIBRARY_PATH", str(tmp_path / "libmrcnn_ops.so"))
    yield str(tmp_path / "libmrcnn_ops.so")
    fused._reset_for_tests()


def test_auto_falls_back_with_one_warning(missing_library):
    with pytest.warns(RuntimeWarning, match="missing") as record:
        assert fused.use_fused("auto") is False
    assert missing_library in str(record[0].message)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert fused.use_fused("auto") is False  # no second warning


def test_on_raises_naming_the_library(missing_library):
    with pytest.raises(fused.CustomOpsUnavailable, match="missing") as error:
        fused.use_fused("on")
    assert missing_library in str(error.value)


def test_main_with_on_and_no_library_is_a_one_line_error(missing_library, shapes_records, tmp_path, capsys):
    import main

    status = main.main(["train", "--data_dir", shapes_records["data_dir"], "--model_dir", str(tmp_path),
                        "--backbone", "resnet18", "--num_classes", "6", "--custom_ops", "on"])
    err = capsys.readouterr().err
    assert status == 2
    assert err.startswith("main.py: error: --custom_ops on:") and missing_library in err
    assert "Traceback" not in err


def test_on_refuses_a_library_built_for_another_tensorflow(monkeypatch, tmp_path):
    fake = tmp_path / "libmrcnn_ops.so"
    fake.write_bytes(b"not a library")
    (tmp_path / fused.BUILD_INFO_NAME).write_text('{"tensorflow": "2.0.0"}')
    fused._reset_for_tests()
    monkeypatch.setattr(fused, "LIBRARY_PATH", str(fake))
    try:
        with pytest.raises(fused.CustomOpsUnavailable, match="built for tensorflow 2.0.0"):
            fused.use_fused("on")
        (tmp_path / fused.BUILD_INFO_NAME).write_text(f'{{"tensorflow": "{tf.__version__}"}}')
        fused._reset_for_tests()
        with pytest.raises(fused.CustomOpsUnavailable, match="failed to load"):
            fused.use_fused("on")
    finally:
        fused._reset_for_tests()


def test_off_and_bad_modes():
    assert fused.use_fused("off") is False
    assert fused.use_fused("on") is True and fused.use_fused("auto") is True
    with pytest.raises(ValueError, match="mode"):
        fused.use_fused("yes")


def test_factory_passes_the_choice_to_the_stages():
    config = small_config()
    # Under --xla the fused ops still run: only the dense layers are compiled. Export: pure TF, no XLA.
    for mode, xla, export, want in [("on", False, False, True), ("off", False, False, False),
                                    ("on", True, False, True), ("auto", False, True, False),
                                    ("on", True, True, False)]:
        config.runtime.custom_ops, config.runtime.xla = mode, xla
        ops = choose_ops(config, export=export)
        winograd = conv_ops.WINOGRAD if want and not xla else conv_ops.CPU
        assert (ops.device, ops.fused, ops.fused_host, ops.conv_route, ops.jit_dense) == (
            "CPU", want, want, winograd, xla and not export)
        # The input pipeline's anchor labelling and the mask encoding follow the same choice.
        assert ops.rpn_targets is (fused.rpn_targets if want else anchor_ops.rpn_targets)
        assert ops.mask_encoder is (fused.encode_pasted_masks if want else masks.encode_pasted_masks)
        model = build_model(config, export=export)
        assert model.jit_dense == ops.jit_dense
        stages = (model.proposal_generator, model.box_roi_aligner, model.mask_roi_aligner,
                  model.mask_target_generator)
        assert [stage.fused for stage in stages] == [want] * len(stages)
        # The convs' fused ops would be inside the layers that --xla compiles: off there.
        convs = (model.backbone, model.backbone.groups[0][0].convs[1], model.fpn, model.fpn.output_convs[2],
                 model.rpn_head.conv, model.mask_head.convs[0])
        assert [layer.conv_route for layer in convs] == [winograd] * len(convs)


# -- 3x3 convolution (Winograd) ----------------------------------------------------------------------------

@pytest.mark.onednn  # the reference conv, and the matrix products between the transforms, are oneDNN's or not
@pytest.mark.parametrize("shape, out_channels", [
    ((1, 9, 13, 5), 7),  # sides not multiples of the 4x4 output block
    ((2, 8, 8, 70), 3),  # channels past one of the kernels' 64-channel blocks
    ((3, 1, 1, 4), 4),  # one pixel: a block that is almost all padding
    ((1, 16, 12, 64), 64),
])
def test_conv2d_3x3_matches_tf_conv(rng, shape, out_channels):
    x = tf.constant(rng.normal(size=shape), tf.float32)
    w = tf.constant(rng.normal(size=(3, 3, shape[3], out_channels)), tf.float32)
    want = tf.nn.conv2d(x, w, 1, "SAME").numpy()
    got = fused.conv2d_3x3(x, w)
    assert got.shape == want.shape
    # Winograd's rounding: about 1e-5 of the output's scale (the op's documented bound, with margin).
    np.testing.assert_allclose(got.numpy(), want, rtol=0, atol=1e-4 * np.abs(want).max())
    dynamic = tf.function(fused.conv2d_3x3, input_signature=[tf.TensorSpec([None, None, None, shape[3]]),
                                                             tf.TensorSpec(w.shape)])
    np.testing.assert_array_equal(dynamic(x, w).numpy(), got.numpy())


@pytest.mark.onednn
def test_conv2d_3x3_in_parts_of_the_batch(rng, monkeypatch):
    """A batch whose transformed tiles exceed the part size goes in nearly equal parts; same result."""
    x = tf.constant(rng.normal(size=(5, 8, 8, 3)), tf.float32)
    w = tf.constant(rng.normal(size=(3, 3, 3, 2)), tf.float32)
    whole = fused.conv2d_3x3(x, w).numpy()
    monkeypatch.setattr(fused, "_WINOGRAD_PART_BYTES", 36 * 4 * 4 * 3 * 2)  # two images' tiles per part
    split = tf.function(fused.conv2d_3x3).get_concrete_function(x, w)
    assert sum(op.type == "MrcnnWinogradInput" for op in split.graph.get_operations()) == 3  # 2 + 2 + 1
    # Not bit for bit: oneDNN's matrix product between the transforms may block a part's smaller batch
    # differently (seen on an AVX2 CPU), which changes float32 rounding only.
    np.testing.assert_allclose(split(x, w).numpy(), whole, rtol=0, atol=1e-5 * np.abs(whole).max())


@pytest.mark.onednn
def test_conv2d_with_fused_3x3_keeps_the_gradient(rng, monkeypatch):
    """conv_ops.conv2d by route WINOGRAD: Winograd for the forward and the input gradient; tf.nn.conv2d's values."""
    monkeypatch.setattr(conv_ops, "WINOGRAD_MIN_TILES", 0)  # the route at this small size too
    x = tf.constant(rng.normal(size=(2, 10, 7, 6)), tf.float32)
    w = tf.constant(rng.normal(size=(3, 3, 6, 5)), tf.float32)
    b = tf.constant(rng.normal(size=5), tf.float32)
    results = []
    for conv in (lambda: conv_ops.conv2d(x, w, bias=b, relu=True, route=conv_ops.WINOGRAD),
                 lambda: tf.nn.relu(tf.nn.conv2d(x, w, 1, "SAME") + b)):
        with tf.GradientTape() as tape:
            tape.watch([x, w, b])
            y = conv()
            loss = tf.reduce_sum(y * tf.cos(y))
        results.append([y, *tape.gradient(loss, [x, w, b])])
    for name, got, want in zip(("output", "x", "kernel", "bias"), *results):
        np.testing.assert_allclose(got.numpy(), want.numpy(), rtol=1e-4, atol=1e-4 * np.abs(want).max(),
                                   err_msg=name)


@pytest.mark.onednn  # conv_ops.conv2d's choice among its routes, oneDNN's among them
def test_conv2d_takes_winograd_only_where_it_pays(monkeypatch):
    """Float32 3x3 stride-1 'SAME' convs of at least WINOGRAD_MIN_TILES 4x4 blocks, or of unknown size."""
    calls = []
    monkeypatch.setattr(fused, "conv2d_3x3", lambda x, w: calls.append(x.shape) or tf.nn.conv2d(x, w, 1, "SAME"))
    kernel = tf.zeros([3, 3, 2, 2])
    blocks = conv_ops.WINOGRAD_MIN_TILES
    big, small = tf.zeros([blocks, 4, 4, 2]), tf.zeros([blocks - 1, 4, 4, 2])
    conv_ops.conv2d(big, kernel, route=conv_ops.WINOGRAD)
    for args, kwargs in [((small, kernel), {}), ((big, kernel), {"route": conv_ops.CPU}),
                         ((big, kernel), {"route": conv_ops.CUDNN}),
                         ((big, kernel, 1, "VALID"), {}), ((big[:, :3], kernel, 2), {}),
                         ((tf.cast(big, tf.bfloat16), tf.cast(kernel, tf.bfloat16)), {}),
                         ((big, tf.zeros([1, 1, 2, 2])), {})]:
        conv_ops.conv2d(*args, **{"route": conv_ops.WINOGRAD, **kwargs})
    tf.function(lambda x: conv_ops.conv2d(x, kernel, route=conv_ops.WINOGRAD),
                input_signature=[tf.TensorSpec([None, 4, 4, 2])]).get_concrete_function()
    assert calls == [big.shape, tf.TensorShape([None, 4, 4, 2])]


def test_winograd_output_names_a_wrong_tile_count(library):
    products = tf.zeros([36, 5, 3])
    with pytest.raises(tf.errors.InvalidArgumentError, match="5 tiles; an output of 1x8x8 has 4"):
        library.mrcnn_winograd_output(products, tf.constant([1, 8, 8]))


# -- RoIAlign ----------------------------------------------------------------------------------------------

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


# -- mask targets ------------------------------------------------------------------------------------------

def random_mask_target_inputs(rng, batch, num, crop_size):
    """Matched RoIs and GT boxes with crops, including padding, empty, inverted and outside boxes."""
    gt = np.sort(rng.uniform(-10, 90, size=(batch, num, 2, 2)), axis=2)
    gt_boxes = np.stack([gt[..., 0, 0], gt[..., 0, 1], gt[..., 1, 0] + 1, gt[..., 1, 1] + 1], -1).astype(np.float32)
    rois = gt_boxes + rng.uniform(-8, 8, size=gt_boxes.shape).astype(np.float32)
    crops = rng.uniform(0, 1, size=(batch, num, crop_size, crop_size)).astype(np.float32)
    rois[0, 0] = -1.0  # padded RoI
    gt_boxes[0, 1] = -1.0  # padded GT
    crops[0, 1] = -1.0
    gt_boxes[0, 2] = [20.0, 20.0, 20.0, 40.0]  # empty GT box
    rois[0, 3] = [30.0, 30.0, 10.0, 10.0]  # inverted RoI
    rois[0, 4] = [-40.0, -40.0, -20.0, -20.0]  # RoI outside the image
    gt_boxes[0, 5] = rois[0, 5] = [-4.0, -4.0, 30.0, 30.0]  # past the corner, GT and RoI alike
    return rois, gt_boxes, crops


@pytest.mark.parametrize("output_size, crop_size", [(28, 14), (7, 12), (1, 5), (4, 1)])
def test_mask_targets_bit_equal_to_twin_and_oracle(rng, output_size, crop_size):
    rois, gt_boxes, crops = random_mask_target_inputs(rng, 2, 12, crop_size)
    got = fused.mask_targets(rois, gt_boxes, crops, output_size).numpy()
    want = masks.mask_targets(rois, gt_boxes, crops, output_size).numpy()
    assert got.shape == (2, 12, output_size, output_size) and got.dtype == np.float32
    np.testing.assert_array_equal(got, want)
    assert 0 < got.sum() < got.size
    for b in range(2):
        for n in range(12):
            if rois[b, n].max() < 0:
                continue  # padding: all zeros, checked above through the twin
            values = np_mask_target(rois[b, n], gt_boxes[b, n], crops[b, n], output_size)
            decided = np.abs(values - 0.5) >= 1e-4
            np.testing.assert_array_equal(got[b, n][decided], (values >= 0.5)[decided])


def test_mask_targets_no_rois_bfloat16_crops_and_tf_function(rng):
    empty = np.zeros((2, 0, 4), np.float32)
    assert fused.mask_targets(empty, empty, np.zeros((2, 0, 6, 6), np.float32), 8).shape == (2, 0, 8, 8)
    rois, gt_boxes, crops = random_mask_target_inputs(rng, 2, 8, 6)
    fn = tf.function(fused.mask_targets, reduce_retracing=True)
    got = fn(rois, gt_boxes, tf.constant(crops, tf.bfloat16), 14).numpy()
    want = masks.mask_targets(rois, gt_boxes, tf.constant(crops, tf.bfloat16), 14).numpy()
    np.testing.assert_array_equal(got, want)


# -- proposals --------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def proposal_anchors():
    """The anchors of tests/test_roi_ops.py: levels 2..4 of a 64x96 image, three aspect ratios."""
    return anchor_ops.generate_anchors(2, 4, 1, ((1.0, 1.0), (1.4, 0.7), (0.7, 1.4)), 4.0, (64, 96))


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
def test_proposals_match_twin_and_oracle(proposal_anchors, rng, pre, post, threshold, min_size):
    scores, boxes = rpn_outputs(rng, 2)
    image_hw = np.array([[64.0, 96.0], [50.0, 70.0]], np.float32)
    got, want = both_propose(scores, boxes, proposal_anchors, image_hw, pre, post, threshold, min_size)
    assert_same_proposals(got, want)
    assert_same_proposals(got, np_propose(scores, boxes, proposal_anchors, image_hw, pre, post, threshold,
                                          min_size))


def test_proposals_edge_cases(proposal_anchors, rng):
    scores, boxes = rpn_outputs(rng, 3, delta_scale=3.0)  # many boxes leave the image or collapse
    # An empty image (no proposal), a thin one (boxes clipped to nothing), and one where every logit ties.
    image_hw = np.array([[0.0, 0.0], [64.0, 2.0], [64.0, 96.0]], np.float32)
    for level in scores:
        scores[level][2] = 0.5
    got, want = both_propose(scores, boxes, proposal_anchors, image_hw, 50, 40, 0.7, 1.0)
    assert_same_proposals(got, want)
    assert np.all(got[0][0] == box_ops.PADDING_BOX_VALUE) and np.all(got[1][0] == roi_ops.PADDING_ROI_SCORE)
    # Extreme deltas (clipped by BBOX_XFORM_CLIP) stay finite, as in the twin.
    extreme = {level: np.where(rng.uniform(size=v.shape) < 0.5, 1e4, -1e4).astype(np.float32)
               for level, v in boxes.items()}
    got, want = both_propose(scores, extreme, proposal_anchors, image_hw, 30, 20, 0.7, 0.0)
    assert np.all(np.isfinite(got[0]))
    assert_same_proposals(got, want)


def test_proposals_low_precision_inside_tf_function(proposal_anchors, rng):
    scores, boxes = rpn_outputs(rng, 2)
    image_hw = np.array([[64.0, 96.0], [64.0, 60.0]], np.float32)
    cast = lambda d: {level: tf.cast(v, tf.bfloat16) for level, v in d.items()}  # noqa: E731
    outs = [tf.function(lambda s, b, hw, fn=fn: fn(s, b, proposal_anchors, hw, 50, 40, 0.7))(
        cast(scores), cast(boxes), image_hw) for fn in (fused.multilevel_propose_rois,
                                                        roi_ops.multilevel_propose_rois)]
    assert_same_proposals(*[(out["rois"].numpy(), out["roi_scores"].numpy()) for out in outs])


# -- RPN anchor targets -----------------------------------------------------------------------------------

def assert_same_rpn_targets(got, want):
    for key in ("rpn_score_targets", "rpn_box_targets"):
        assert got[key].keys() == want[key].keys()
        for level in got[key]:
            assert got[key][level].shape == want[key][level].shape and got[key][level].dtype == want[key][level].dtype
            np.testing.assert_array_equal(got[key][level].numpy(), want[key][level].numpy())


def both_rpn_targets(anchors, gt, **kwargs):
    return [fn(anchors, gt, ANCHOR_IMAGE_SIZE, **kwargs) for fn in (fused.rpn_targets, anchor_ops.rpn_targets)]


@pytest.mark.parametrize("gt_kind", ["varied", "many", "padding only", "none", "outside and degenerate"])
def test_rpn_targets_equal_twin_for_the_same_seed(rpn_anchors, rng, gt_kind):
    all_anchors = flatten(rpn_anchors, 4)
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
        got, want = both_rpn_targets(rpn_anchors, gt, seed=tf.constant(seed))
        assert_same_rpn_targets(got, want)
    labels = flatten(got["rpn_score_targets"], 1)[:, 0]
    expected, _ = np_label_anchors(all_anchors, gt, 0.7, 0.3)
    assert np.all(expected[labels == 1] == 1) and np.all(expected[labels == 0] == 0)
    assert np.sum(labels >= 0) == 256


def test_rpn_targets_other_settings_and_in_tf_data(rpn_anchors):
    gt = make_gt(VARIED_GT)
    kwargs = dict(positive_overlap=0.5, negative_overlap=0.4, batch_size_per_im=64, fg_fraction=0.25,
                  seed=tf.constant([1, 2]))
    assert_same_rpn_targets(*both_rpn_targets(rpn_anchors, gt, **kwargs))
    seeds = tf.constant([[7, 0], [7, 1]], tf.int64)
    boxes = np.stack([make_gt(VARIED_GT), make_gt(VARIED_GT[:1], num_padded=7)])
    datasets = [tf.data.Dataset.from_tensor_slices((boxes, seeds)).map(
        lambda b, s, fn=fn: fn(rpn_anchors, b, ANCHOR_IMAGE_SIZE, seed=s), num_parallel_calls=2)
        for fn in (fused.rpn_targets, anchor_ops.rpn_targets)]
    assert datasets[0].element_spec == datasets[1].element_spec
    for got, want in zip(*datasets):
        assert_same_rpn_targets(got, want)


def test_input_pipeline_with_fused_anchor_targets_equals_twin(shapes_records):
    batches = []
    for mode in ("on", "off"):
        config = make_config(augment=True, seed=11)
        config.runtime.custom_ops = mode
        pipeline = training_pipeline(config, choose_ops(config).rpn_targets)
        assert (pipeline.rpn_targets is fused.rpn_targets) == (mode == "on")
        batches.append(first_batches(pipeline, shapes_records["train"], 2))
    for got, want in zip(*batches):
        tf.nest.map_structure(np.testing.assert_array_equal, got, want)


# -- mask pasting and RLE encoding -------------------------------------------------------------------------

def assert_same_rle(masks_in, boxes, hw, threshold):
    """The fused encoder's RLE is the twin's, byte for byte; returns the decoded [h, w, D] uint8 masks."""
    got = fused.encode_pasted_masks(masks_in, boxes, hw, threshold)
    want = coco_metrics.encode_pasted_masks(masks_in, boxes, hw, threshold)
    assert len(got) == len(want) == len(boxes)
    for fused_rle, twin_rle in zip(got, want):
        assert fused_rle["size"] == twin_rle["size"] == list(hw)
        assert isinstance(fused_rle["counts"], bytes) and fused_rle["counts"] == twin_rle["counts"]
    if not got:
        return np.zeros(tuple(hw) + (0,), np.uint8)
    decoded = mask_utils.decode(got)
    np.testing.assert_array_equal(decoded, mask_utils.decode(want))
    return decoded


def test_encoded_masks_equal_twin_and_oracle(rng):
    hw = (20, 24)
    boxes = np.array([[3.3, 4.1, 15.7, 11.2], [-6.0, 15.0, 9.0, 40.0], [-3.0, -4.0, 30.0, 30.0],
                      [0.0, 0.0, 20.0, 24.0],  # the whole image
                      [30.0, 30.0, 40.0, 40.0],  # wholly outside
                      [5.0, 5.0, 5.0, 9.0],  # zero height
                      [2.0, 7.0, 12.0, 7.0],  # zero width
                      [8.0, 2.0, 4.0, 6.0],  # inverted
                      [5.4, 1.0, 5.6, 2.0]], np.float32)  # covers one pixel centre
    probs = rng.uniform(size=(len(boxes), 6, 6)).astype(np.float32)
    for threshold in (0.5, 0.3):
        decoded = assert_same_rle(probs, boxes, hw, threshold)
        for d in range(len(boxes)):
            # The oracle samples in float64: only pixels this close to the threshold may come out otherwise.
            oracle = np_paste(probs[d], boxes[d], hw)
            decided = np.abs(oracle - threshold) > 1e-5
            np.testing.assert_array_equal(decoded[..., d][decided], (oracle >= threshold)[decided])
        assert_same_rle(probs[:, :1, :1], boxes, hw, threshold)  # 1x1 masks


def test_encoded_masks_edge_cases():
    def rle_of(mask):
        return mask_utils.encode(np.asfortranarray(mask[..., None].astype(np.uint8)))[0]["counts"]

    for hw in ((5, 6), (0, 6), (5, 0)):  # no detections
        decoded = assert_same_rle(np.zeros((0, 4, 4), np.float32), np.zeros((0, 4), np.float32), hw, 0.5)
        assert decoded.shape == hw + (0,)
    hw = (5, 6)
    whole = np.array([[0.0, 0.0, 5.0, 6.0], [-2.0, -3.0, 9.0, 8.0]], np.float32)
    # Every pixel 1 (the RLE starts with an empty run of 0s), or 0 (a single run): the mask is constant.
    for value, threshold, want in ((1.0, 0.5, 1), (0.5, 0.5, 1), (0.4999, 0.5, 0), (0.0, 0.3, 0)):
        got = fused.encode_pasted_masks(np.full((2, 3, 3), value, np.float32), whole, hw, threshold)
        assert [rle["counts"] for rle in got] == [rle_of(np.full(hw, want))] * 2
        assert_same_rle(np.full((2, 3, 3), value, np.float32), whole, hw, threshold)
    inside = np.array([[1.2, 2.1, 3.9, 4.4]], np.float32)
    assert fused.encode_pasted_masks(np.zeros((1, 1, 1), np.float32), inside, hw, 0.5)[0]["counts"] == rle_of(
        np.zeros(hw))
    assert_same_rle(np.ones((1, 1, 1), np.float32), inside, hw, 0.5)
    assert_same_rle(np.ones((1, 2, 2), np.float32), inside, (0, 6), 0.5)  # an image of no pixels: one run of 0


def test_encoded_masks_agree_bit_for_bit_at_the_threshold(rng):
    """Thresholds equal to pasted probabilities: a pixel 1 ulp lower flips (as ~10% of thresholds do
    against BLAS matrix products, which round otherwise)."""
    hw = (60, 80)
    centres = rng.uniform(0, 1, size=(20, 2)) * hw
    sides = rng.uniform(2, 50, size=(20, 2))
    boxes = np.concatenate([centres - sides / 2, centres + sides / 2], axis=1).astype(np.float32)
    probs = rng.uniform(size=(20, 28, 28)).astype(np.float32)
    # The twin's probabilities, pasted as it pastes them for encoding (the transposed problem).
    pasted = masks.paste_masks(probs.transpose(0, 2, 1), boxes[:, [1, 0, 3, 2]], hw[::-1])
    for threshold in rng.choice(pasted[pasted > 0], size=32, replace=False).tolist():
        decoded = assert_same_rle(probs, boxes, hw, threshold)
        assert (decoded.transpose(2, 1, 0) == (pasted >= threshold)).all()


def test_encoded_masks_of_many_detections(rng):
    hw = (480, 640)
    centres = rng.uniform(-0.1, 1.1, size=(300, 2)) * hw
    sides = rng.uniform(0, 300, size=(300, 2))
    boxes = np.concatenate([centres - sides / 2, centres + sides / 2], axis=1).astype(np.float32)
    probs = rng.uniform(size=(300, 28, 28)).astype(np.float32)
    for threshold in (0.5, 0.3):
        assert_same_rle(probs, boxes, hw, threshold)


@pytest.mark.parametrize("args, match", [
    ((np.zeros((2, 4, 5)), np.zeros((2, 4)), (8, 8), 0.5), "masks"),
    ((np.zeros((2, 4, 4)), np.zeros((3, 4)), (8, 8), 0.5), "boxes"),
    ((np.zeros((2, 4, 4)), np.zeros((2, 4)), (8,), 0.5), "image_hw"),
    ((np.zeros((2, 4, 4)), np.zeros((2, 4)), (8, -1), 0.5), "image_hw"),
    ((np.zeros((2, 4, 4)), np.zeros((2, 4)), (8, 8), float("nan")), "threshold"),
    ((np.zeros((2, 4, 4)), np.zeros((2, 4)), (8, 8), None), "threshold"),
])
@pytest.mark.parametrize("encode", [fused.encode_pasted_masks, coco_metrics.encode_pasted_masks])
def test_encoded_masks_bad_arguments_are_the_twins(encode, args, match):
    with pytest.raises(ValueError, match=match):
        encode(*args)


def test_evaluation_encodes_with_the_fused_op_unless_ops_are_off(rng):
    config = small_config()
    for mode, encoder in (("on", fused.encode_pasted_masks), ("off", coco_metrics.encode_pasted_masks)):
        config.runtime.custom_ops = mode
        assert choose_ops(config).mask_encoder is encoder
    # COCO results (RLE included) of one image's detections are the same through either encoder.
    boxes = np.array([[[5.2, 7.9, 40.3, 33.1], [-3.0, 50.0, 20.0, 90.5], [60.0, 10.0, 61.0, 11.0]]], np.float32)
    predictions = {
        "detection_boxes": boxes, "detection_scores": np.array([[0.9, 0.8, 0.7]], np.float32),
        "detection_classes": np.array([[1, 2, 1]]), "num_detections": np.array([3]),
        "detection_masks": rng.uniform(size=(1, 3, 28, 28)).astype(np.float32),
        "image_info": np.array([[128, 128, 1.0, 70, 100]], np.float32), "source_ids": np.array([7]),
    }
    with_fused, _ = coco_metrics.convert_detections(predictions, [1, 2], fused.encode_pasted_masks)
    with_twin, _ = coco_metrics.convert_detections(predictions, [1, 2], coco_metrics.encode_pasted_masks)
    assert json.dumps(with_fused) == json.dumps(with_twin) and len(with_fused) == 3


# -- the whole model -----------------------------------------------------------------------------------------

def losses_and_gradients(config, batch, mode):
    """(losses, gradients) of a train step with `--custom_ops mode`."""
    config.runtime.custom_ops = mode
    keras.utils.set_random_seed(0)
    model = build_model(config)
    model.compile(optimizer=keras.optimizers.SGD(0.01, momentum=0.9))
    keras.utils.set_random_seed(1)  # the same RoI sampling draws in both runs
    losses, grads = model.compute_gradients(batch)
    return {k: float(v) for k, v in losses.items()}, [tf.convert_to_tensor(g).numpy() for g in grads]


@pytest.mark.onednn  # the twins' convs and matrix products are oneDNN's or TensorFlow's
def test_train_step_with_fused_ops_equals_twins(monkeypatch):
    # The fused stages, not Winograd's convs (tested against tf.nn.conv2d above): their different float32
    # rounding can flip a discrete choice downstream (a proposal at the NMS threshold, a sampled RoI), seen
    # on an AVX2 CPU as a class loss 6e-4 apart.
    monkeypatch.setattr(conv_ops, "WINOGRAD_MIN_TILES", 2 ** 62)
    config = small_config()
    batch = synthetic_batch(config)
    on_losses, on_grads = losses_and_gradients(config, batch, "on")
    off_losses, off_grads = losses_and_gradients(config, batch, "off")
    assert on_losses.keys() == off_losses.keys()
    for name in on_losses:
        assert on_losses[name] == pytest.approx(off_losses[name], rel=1e-4, abs=1e-5), name
    for got, want in zip(on_grads, off_grads):
        np.testing.assert_allclose(got, want, rtol=1e-3, atol=1e-4 * max(1.0, np.abs(want).max()))
