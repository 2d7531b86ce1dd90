"""The fused-op library's loader and the factory's choice of ops, the fused 3x3 convolution (Winograd) against
tf.nn.conv2d, the evaluation's choice of mask encoder, and a whole train step with the fused ops against one
with their pure-TF twins.

Each other fused op is tested against its twin (and the NumPy oracles of the twin's tests) in the twin's own
test module: RoIAlign in tests/test_roi_align.py, mask targets and mask encoding in tests/test_masks.py,
proposals in tests/test_roi_ops.py, RPN anchor targets in tests/test_anchors.py and in the input pipeline in
tests/test_pipeline.py. Those tests call the ops, which raise the loader's CustomOpsUnavailable when the
library cannot be used.

The suite's set-up (make test -> scripts/setup.sh -> ops/build.sh) builds the library, so these tests
require it to load instead of skipping: a skip would hide a broken build.
"""
import json
import warnings

import keras
import numpy as np
import pytest
import tensorflow as tf

from mrcnn_tf2.evaluation import coco_metrics
from mrcnn_tf2.model.factory import build_model, choose_ops
from mrcnn_tf2.ops import anchors as anchor_ops
from mrcnn_tf2.ops import fused, masks
from mrcnn_tf2.ops import conv as conv_ops
from tests.support import small_config, synthetic_batch


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
        route = conv_ops.PLAIN if export else conv_ops.WINOGRAD if want and not xla else conv_ops.CPU
        assert (ops.device, ops.fused, ops.fused_host, ops.conv_route, ops.jit_dense) == (
            "CPU", want, want, route, xla and not export)
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
        assert [layer.conv_route for layer in convs] == [route] * len(convs)


# -- 3x3 convolution (Winograd) ----------------------------------------------------------------------------

@pytest.mark.onednn  # the reference conv, and the matrix products between the transforms, are oneDNN's or not
@pytest.mark.parametrize("block", [4, 5, 6])
@pytest.mark.parametrize("shape, out_channels", [
    ((1, 9, 13, 5), 7),  # sides not multiples of the output block
    ((2, 8, 8, 70), 3),  # channels past one of the kernels' 64-channel blocks
    ((3, 1, 1, 4), 4),  # one pixel: a block that is almost all padding
    ((1, 16, 12, 64), 64),
])
def test_conv2d_3x3_matches_tf_conv(rng, shape, out_channels, block):
    """F(4x4, 3x3), F(5x5, 3x3) and F(6x6, 3x3) (each asked for here; fused.winograd_block picks one by the map's
    size), and one trace for maps of any size: the same output."""
    x = tf.constant(rng.normal(size=shape), tf.float32)
    w = tf.constant(rng.normal(size=(3, 3, shape[3], out_channels)), tf.float32)
    want = tf.nn.conv2d(x, w, 1, "SAME").numpy()
    got = fused.conv2d_3x3(x, w, block=block)
    assert got.shape == want.shape
    # Winograd's rounding: about 1e-5 (F(4x4, 3x3)) or 2e-5 (F(5x5, 3x3), F(6x6, 3x3)) of the output's scale, the op's
    # documented bound, with margin.
    np.testing.assert_allclose(got.numpy(), want, rtol=0, atol=1e-4 * np.abs(want).max())
    dynamic = tf.function(lambda x, w: fused.conv2d_3x3(x, w, block=block),
                          input_signature=[tf.TensorSpec([None, None, None, shape[3]]), tf.TensorSpec(w.shape)])
    np.testing.assert_array_equal(dynamic(x, w).numpy(), got.numpy())
    assert {op.get_attr("block") for op in dynamic.get_concrete_function().graph.get_operations()
            if op.type.startswith("MrcnnWinograd")} == {block}


@pytest.mark.onednn  # the reference gradient, and the matrix products between the transforms, are oneDNN's or not
@pytest.mark.parametrize("block", [4, 5, 6])
@pytest.mark.parametrize("shape, out_channels", [((1, 9, 13, 5), 7), ((2, 8, 8, 70), 3), ((3, 1, 1, 4), 4),
                                                 ((2, 16, 12, 64), 64)])
def test_conv2d_3x3_kernel_gradient_matches_tf(rng, shape, out_channels, block):
    x = tf.constant(rng.normal(size=shape), tf.float32)
    out_grad = tf.constant(rng.normal(size=shape[:3] + (out_channels,)), tf.float32)
    want = tf.raw_ops.Conv2DBackpropFilter(input=x, filter_sizes=[3, 3, shape[3], out_channels], out_backprop=out_grad,
                                           strides=[1, 1, 1, 1], padding="SAME").numpy()
    gradient = tf.function(lambda x, g: fused.conv2d_3x3_kernel_gradient(x, g, block=block))
    got = gradient(x, out_grad).numpy()
    assert got.shape == want.shape
    assert {op.get_attr("block") for op in gradient.get_concrete_function(x, out_grad).graph.get_operations()
            if op.type.startswith("MrcnnWinograd")} == {block}
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-4 * np.abs(want).max())


def test_winograd_takes_the_block_of_fewest_products(rng):
    """The m of F(m x m, 3x3) that takes the fewest products, (m + 2)^2 per m x m block, the smaller m at a tie;
    F(6x6, 3x3) only on maps of at least WINOGRAD_6X6_MIN_BLOCKS 6x6 blocks over the batch, and on maps of
    unknown size. The conv and its kernel gradient run the chosen one's ops."""
    assert fused.WINOGRAD_6X6_MIN_BLOCKS == 256
    cases = {
        (1, 200, 272): 6,  # P2 at 800x1088: 64 x 1564 products against 49 x 2200 and 36 x 3400
        (1, 100, 136): 6,  # 391 blocks
        (2, 50, 68): 5,  # 49 x 140 per image against 36 x 221 (and 216 6x6 blocks: too few)
        (3, 50, 68): 5,  # 324 6x6 blocks, but 64 x 108 against 49 x 140
        (1, 25, 34): 5,
        (100, 14, 14): 5,  # the mask head's RoIs: 9 x 49 products per RoI against 16 x 36 and 9 x 64
        (None, 14, 14): 5,
        (8, 28, 28): 4,  # 36 x 49 and 49 x 36 tie; 64 x 25 fewer, on 200 blocks
        (300, 8, 8): 4,  # 4 x 36 against 4 x 49 and 4 x 64
        (1, None, None): 6,
        (None, None, None): 6,
    }
    assert {shape: fused.winograd_block(shape) for shape in cases} == cases
    assert fused._winograd_bands((2, 13, 17), 8, 6) == [(0, 6)]  # 2 images of 3 lines of 6x6 blocks
    kernel = tf.constant(rng.normal(size=(3, 3, 4, 4)), tf.float32)
    for size, block in (([1, 100, 136], 6), ([100, 14, 14], 5), ([8, 16, 16], 4)):
        x = tf.zeros(size + [4])
        graphs = [tf.function(fused.conv2d_3x3).get_concrete_function(x, kernel).graph,
                  tf.function(fused.conv2d_3x3_kernel_gradient).get_concrete_function(x, x).graph]
        ops = [op for graph in graphs for op in graph.get_operations() if op.type.startswith("MrcnnWinograd")]
        assert sorted({op.type for op in ops}) == ["MrcnnWinogradInput", "MrcnnWinogradOutput",
                                                   "MrcnnWinogradOutputAdjoint"]
        assert {op.get_attr("block") for op in ops} == {block}


@pytest.mark.onednn
def test_conv2d_3x3_in_bands_of_tile_lines(rng, monkeypatch):
    """A conv whose transformed tiles exceed the band size goes band by band of tile lines, each band after the
    previous one's output (one band's tiles at a time), into one output; the same result as in one band."""
    x = tf.constant(rng.normal(size=(3, 9, 8, 3)), tf.float32)  # 3 lines of tiles per image, 9 in all, 2 tiles each
    w = tf.constant(rng.normal(size=(3, 3, 3, 2)), tf.float32)
    whole = fused.conv2d_3x3(x, w, block=4).numpy()
    monkeypatch.setattr(fused, "_WINOGRAD_BAND_BYTES", 36 * 4 * 2 * 3 * 2)  # two lines' tiles per band
    assert fused._winograd_bands(x.shape[:3], 3, 4) == [(0, 2), (2, 2), (4, 2), (6, 2), (8, 1)]
    banded = tf.function(lambda x, w: fused.conv2d_3x3(x, w, block=4)).get_concrete_function(x, w)
    transforms = [op for op in banded.graph.get_operations() if op.type == "MrcnnWinogradInput"]
    outputs = [op for op in banded.graph.get_operations() if op.type.startswith("MrcnnWinogradOutput")]
    assert [op.type for op in outputs] == ["MrcnnWinogradOutput"] + ["MrcnnWinogradOutputInto"] * 4
    assert [op.get_attr("first_line") for op in transforms] == [op.get_attr("first_line") for op in outputs] \
        == [0, 2, 4, 6, 8]
    assert [op.get_attr("lines") for op in transforms] == [2, 2, 2, 2, 1]
    assert [op.control_inputs for op in transforms[1:]] == [[op] for op in outputs[:-1]]
    assert [op.inputs[0].op for op in outputs[1:]] == outputs[:-1]  # one buffer, band after band
    # Not bit for bit: oneDNN's matrix product between the transforms may block a band's fewer tiles
    # differently (seen on an AVX2 CPU), which changes float32 rounding only.
    np.testing.assert_allclose(banded(x, w).numpy(), whole, rtol=0, atol=1e-5 * np.abs(whole).max())
    # The kernel's transform waits for the input: in a backward pass, for the output gradient (the flipped
    # kernel exists from the start, and every conv's transform would be held until its gradient came).
    # (A function's own inputs take no control dependencies: the input here is an op's output, as in a model.)
    graph = tf.function(lambda x, w: fused.conv2d_3x3(tf.nn.relu(x), w)).get_concrete_function(x, w).graph
    (kernel_transform,) = [op for op in graph.get_operations()
                           if op.type == "MatMul" and op.inputs[0].op.type == "Const"]
    # TensorFlow puts the control input on the product's constant (the ops after it carry it through their inputs).
    assert [op.type for op in kernel_transform.inputs[0].op.control_inputs] == ["Relu"]

    out_grad = tf.constant(rng.normal(size=(3, 9, 8, 2)), tf.float32)
    monkeypatch.undo()
    whole = fused.conv2d_3x3_kernel_gradient(x, tf.nn.relu(out_grad), block=4).numpy()
    monkeypatch.setattr(fused, "_WINOGRAD_BAND_BYTES", 36 * 4 * 2 * 3 * 4)  # four lines' tiles per band
    banded = tf.function(lambda x, g: fused.conv2d_3x3_kernel_gradient(x, tf.nn.relu(g), block=4)
                         ).get_concrete_function(x, out_grad)
    ops = banded.graph.get_operations()
    transforms = [op for op in ops if op.type == "MrcnnWinogradInput"]
    adjoints = [op for op in ops if op.type == "MrcnnWinogradOutputAdjoint"]
    assert [op.get_attr("lines") for op in transforms] == [op.get_attr("lines") for op in adjoints] == [3, 3, 3]
    # The first band waits for the output gradient (the input's tiles are not held from the forward pass on),
    # each later band for the sum of the bands before it.
    relu = [op for op in ops if op.type == "Relu"]
    sums = [op for op in ops if op.type == "AddV2"]
    assert [op.control_inputs for op in transforms] == [relu, [transforms[0].outputs[0].consumers()[0]], sums[:1]]
    # (The first adjoint reads the output gradient itself.)
    assert [op.control_inputs for op in adjoints[1:]] == [op.control_inputs for op in transforms[1:]]
    np.testing.assert_allclose(banded(x, out_grad).numpy(), whole, rtol=0, atol=1e-5 * np.abs(whole).max())


@pytest.mark.parametrize("block", [4, 5, 6])
def test_winograd_outputs_write_their_band_and_keep_the_rest(library, rng, block):
    """MrcnnWinogradOutput writes the blocks of its band's tiles into zeros, MrcnnWinogradOutputInto into base,
    and the other lines stay as they were (base is also the caller's here, so the op copies it rather than
    writing in place, and the caller's base is unchanged). With a bias and relu, the band's blocks are
    max(block + bias, 0) and nothing else changes."""
    m, points = block, (block + 2) ** 2
    products = tf.constant(rng.normal(size=[points, 2, 3]), tf.float32)  # one line of 2 tiles
    size = tf.constant([2, 2 * m, 2 * m - 2])  # 2 lines of tiles per image, 2 tiles across (the second cut)
    ops = dict(block=block)
    # The band as line 1 (the first image's second tile row) of a whole output whose other tiles are zeros.
    whole = library.mrcnn_winograd_output(
        tf.concat([tf.zeros([points, 2, 3]), products, tf.zeros([points, 4, 3])], 1), size, bias=[], **ops).numpy()
    rows = list(range(m, 2 * m))
    assert np.all(whole[0, rows] != 0) and not np.any(np.delete(whole, rows, 1)) and not np.any(whole[1])
    bias = np.float32([0.5, -0.25, 2.0])
    for epilogue in ({"bias": []}, {"bias": [bias]}, {"bias": [], "relu": True}, {"bias": [bias], "relu": True}):
        band = whole.copy()
        band[0, rows] += bias if epilogue["bias"] else 0
        band[0, rows] = np.maximum(band[0, rows], 0) if epilogue.get("relu") else band[0, rows]
        assert np.any(band[0, rows] < 0) != epilogue.get("relu", False)
        np.testing.assert_array_equal(
            library.mrcnn_winograd_output(products, size, first_line=1, **epilogue, **ops).numpy(), band)
        base = tf.fill([2, 2 * m, 2 * m - 2, 3], -7.0)
        want = np.full([2, 2 * m, 2 * m - 2, 3], -7.0, np.float32)
        want[0, rows] = band[0, rows]
        np.testing.assert_array_equal(
            library.mrcnn_winograd_output_into(base, products, first_line=1, **epilogue, **ops).numpy(), want)
        np.testing.assert_array_equal(base.numpy(), -7.0)


@pytest.mark.onednn
def test_conv2d_with_fused_3x3_keeps_the_gradient(rng, monkeypatch):
    """conv_ops.conv2d by route WINOGRAD: Winograd for the forward and both gradients; tf.nn.conv2d's values."""
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
    # The bias and the ReLU are the output transform's: no passes of their own.
    forward = tf.function(lambda x: conv_ops.conv2d(x, w, bias=b, relu=True, route=conv_ops.WINOGRAD))
    types = [op.type for op in forward.get_concrete_function(x).graph.get_operations()]
    assert "MrcnnWinogradOutput" in types and "BiasAdd" not in types and "Relu" not in types, types

    def gradients(x, w):
        with tf.GradientTape() as tape:
            tape.watch([x, w])
            y = conv_ops.conv2d(x, w, route=conv_ops.WINOGRAD)
        return tape.gradient(y, [x, w], output_gradients=tf.nn.relu(y))

    # The input gradient starts once the kernel gradient is done, which frees the conv's input before the
    # backward pass goes on (and keeps the two gradients' tiles from being made at once).
    graph = tf.function(gradients).get_concrete_function(x, w).graph
    (input_gradient_tiles,) = [op for op in graph.get_operations()
                               if op.type == "MrcnnWinogradInput" and op.inputs[0].op.type == "Relu"]
    assert [c.outputs[0].shape for c in input_gradient_tiles.control_inputs] == [w.shape]


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
                         ((big, kernel), {"route": conv_ops.PLAIN}),
                         ((big, kernel, 1, "VALID"), {}), ((big[:, :3], kernel, 2), {}),
                         ((tf.cast(big, tf.bfloat16), tf.cast(kernel, tf.bfloat16)), {}),
                         ((big, tf.zeros([1, 1, 2, 2])), {})]:
        conv_ops.conv2d(*args, **{"route": conv_ops.WINOGRAD, **kwargs})
    tf.function(lambda x: conv_ops.conv2d(x, kernel, route=conv_ops.WINOGRAD),
                input_signature=[tf.TensorSpec([None, 4, 4, 2])]).get_concrete_function()
    assert calls == [big.shape, tf.TensorShape([None, 4, 4, 2])]


def test_winograd_ops_name_a_wrong_band(library):
    base = tf.zeros([1, 8, 8, 3])  # 2 lines of 2 tiles
    with pytest.raises(tf.errors.InvalidArgumentError, match="5 tiles, not whole lines of the 2 tiles across"):
        library.mrcnn_winograd_output(tf.zeros([36, 5, 3]), tf.constant([1, 8, 8]), bias=[])
    with pytest.raises(tf.errors.InvalidArgumentError, match="band of 2 lines from line 1 is past the 2 lines"):
        library.mrcnn_winograd_output_into(base, tf.zeros([36, 4, 3]), bias=[], first_line=1)
    with pytest.raises(tf.errors.InvalidArgumentError,
                       match=r"products must be \[36, T, C\] for blocks of 4x4, got \[36,4\]"):
        library.mrcnn_winograd_output(tf.zeros([36, 4]), tf.constant([1, 8, 8]), bias=[])
    with pytest.raises(tf.errors.InvalidArgumentError,
                       match=r"products must be \[64, T, C\] for blocks of 6x6, got \[36,4,3\]"):
        library.mrcnn_winograd_output(tf.zeros([36, 4, 3]), tf.constant([1, 8, 8]), bias=[], block=6)
    for op in (lambda: library.mrcnn_winograd_input(base, block=3),
               lambda: library.mrcnn_winograd_output_adjoint(base, block=8),
               lambda: library.mrcnn_winograd_output(tf.zeros([81, 4, 3]), tf.constant([1, 8, 8]), bias=[], block=7),
               lambda: fused.conv2d_3x3(base, tf.zeros([3, 3, 3, 3]), block=7),
               lambda: fused.conv2d_3x3_kernel_gradient(base, base, block=3)):
        with pytest.raises((tf.errors.InvalidArgumentError, ValueError), match=r"block must be 4, 5 or 6 \(F\(m x m"):
            op()
    with pytest.raises(tf.errors.InvalidArgumentError, match="do not have the channels of the output"):
        library.mrcnn_winograd_output_into(base, tf.zeros([36, 4, 2]), bias=[], first_line=0)
    with pytest.raises(tf.errors.InvalidArgumentError, match=r"bias must be \[C\] for an output of \[1,8,8,3\]"):
        library.mrcnn_winograd_output_into(base, tf.zeros([36, 4, 3]), bias=[tf.zeros([2])], first_line=0)
    with pytest.raises((tf.errors.InvalidArgumentError, ValueError), match="at most one bias, got 2"):
        library.mrcnn_winograd_output(tf.zeros([36, 4, 3]), tf.constant([1, 8, 8]), bias=[tf.zeros([3])] * 2)
    with pytest.raises(tf.errors.InvalidArgumentError, match="band of 1 lines from line 2 is past the 2 lines"):
        library.mrcnn_winograd_input(base, first_line=2, lines=1)


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
