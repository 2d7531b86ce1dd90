"""conv_ops.conv2d: tf.nn.conv2d's output and both gradients, with the kernel gradient as matrix products."""

import keras
import numpy as np
import pytest
import tensorflow as tf

from mrcnn_tf2.model.backbone import Conv2D, ConvBN
from mrcnn_tf2.ops import conv as conv_ops
from mrcnn_tf2.ops.fixed import fixed_weights

pytestmark = pytest.mark.onednn  # the routes that conv_ops.ONEDNN picks, and the kernels under them

# (kernel size, stride, padding, input height, input width): the convs of the model (3x3 'SAME', 1x1,
# strided 1x1 'VALID', the stem's 7x7/2 and the 3x3/2 with symmetric explicit padding) on odd sizes, the 3x3/2
# also on even ones (the padded input's last row and column in no window), the 3x3 'SAME' on a map small enough
# for the matrix product of patches, and the stride-1 paddings that kernel_gradient handles (even kernels pad one
# pixel more after than before).
CASES = [
    (3, 1, "SAME", 9, 12),
    (3, 1, "SAME", 3, 4),
    (1, 1, "SAME", 7, 5),
    (1, 2, "VALID", 9, 11),
    (3, 2, "SAME", 9, 11),
    (3, 2, [[0, 0], [1, 1], [1, 1], [0, 0]], 9, 11),
    (3, 2, [[0, 0], [1, 1], [1, 1], [0, 0]], 8, 10),
    (7, 2, [[0, 0], [3, 3], [3, 3], [0, 0]], 15, 13),
    (3, 1, "VALID", 6, 8),
    (2, 1, "SAME", 5, 6),
    (3, 1, [[0, 0], [2, 0], [1, 2], [0, 0]], 6, 7),
]


def _gradients(fn, x, w, upstream):
    with tf.GradientTape() as tape:
        tape.watch([x, w])
        y = fn(x, w)
        loss = tf.reduce_sum(y * upstream)
    return (y, *tape.gradient(loss, [x, w]))


@pytest.mark.parametrize("kernel_size,stride,padding,height,width", CASES)
def test_conv2d_matches_tensorflow(kernel_size, stride, padding, height, width):
    rng = np.random.default_rng(kernel_size * 10 + stride)
    x = tf.constant(rng.normal(size=(2, height, width, 5)), tf.float32)
    w = tf.constant(rng.normal(size=(kernel_size, kernel_size, 5, 4)), tf.float32)
    upstream = tf.constant(rng.normal(size=tf.nn.conv2d(x, w, stride, padding).shape), tf.float32)
    expected = _gradients(lambda x, w: tf.nn.conv2d(x, w, stride, padding), x, w, upstream)
    actual = _gradients(lambda x, w: conv_ops.conv2d(x, w, stride, padding), x, w, upstream)
    for name, want, got in zip(("output", "input gradient", "kernel gradient"), expected, actual):
        assert got.shape == want.shape, name
        np.testing.assert_allclose(got.numpy(), want.numpy(), rtol=1e-4, atol=1e-4, err_msg=name)


@pytest.mark.parametrize("route", conv_ops.ROUTES)
@pytest.mark.parametrize("batch", [1, 2])
def test_a_small_maps_conv_and_its_input_gradient_are_products_of_patches(route, batch):
    """Up to PATCH_MAX_PIXELS output pixels a 3x3 'SAME' conv and its input gradient are one matrix product each
    (oneDNN's direct kernels ran [8, 4, 4, 512] -> 512 at 1.6x the time); a pixel more, and the conv is
    TensorFlow's (or, at one image under oneDNN, its transposed conv)."""
    def op_types(height, width):
        x = tf.zeros([batch, height, width, 8])
        w = tf.zeros([3, 3, 8, 4])
        conv = tf.function(lambda x, w: _gradients(lambda x, w: conv_ops.conv2d(x, w, route=route), x, w,
                                                   tf.ones([batch, height, width, 4])))
        return {op.type for op in conv.get_concrete_function(x, w).graph.get_operations()}

    tensorflows = {"Conv2D", "Conv2DBackpropInput"}
    small, larger = op_types(4, conv_ops.PATCH_MAX_PIXELS // 4), op_types(4, conv_ops.PATCH_MAX_PIXELS // 4 + 1)
    if route == conv_ops.PLAIN:
        assert tensorflows <= small
        return
    assert not small & tensorflows and "MatMul" in small, small
    assert larger & tensorflows, larger


@pytest.mark.parametrize("sizes", ["static", "run-time"])
def test_a_bfloat16_conv_of_a_large_map_runs_winograds_float32_route(monkeypatch, sizes):
    """Where BFLOAT16_WINOGRAD holds, a bfloat16 3x3 'SAME' conv of at least BFLOAT16_WINOGRAD_MIN_CHANNELS input
    channels and BFLOAT16_WINOGRAD_MIN_TILES Winograd tiles over the batch (of fused.winograd_block's m x m
    output blocks) runs Winograd's float32 route between casts, forward and both gradients, with its bias and
    ReLU; its output and gradients are as close to the exact conv of its bfloat16 operands as the direct
    bfloat16 conv's. A conv of fewer tiles, or without BFLOAT16_WINOGRAD, keeps TensorFlow's bfloat16 conv; with
    sizes known only at run time, the tiles decide when the step runs."""
    monkeypatch.setattr(conv_ops, "BFLOAT16_WINOGRAD_MIN_TILES", 6)  # the large map, at a test's size
    monkeypatch.setattr(conv_ops, "WINOGRAD_MIN_TILES", 0)  # and float32's route there
    rng = np.random.default_rng(7)
    channels = conv_ops.BFLOAT16_WINOGRAD_MIN_CHANNELS
    w = tf.cast(tf.constant(rng.normal(size=(3, 3, channels, 8)) / 48, tf.float32), tf.bfloat16)
    b = tf.cast(tf.constant(rng.normal(size=8), tf.float32), tf.bfloat16)
    conv_types = {"Conv2D", "Conv2DBackpropInput"}  # the direct conv and its input gradient

    def run(x, upstream, route, bfloat16_winograd, exact=False):
        """(output, input gradient, kernel gradient) in float64, and the traced graph's op types."""
        monkeypatch.setattr(conv_ops, "BFLOAT16_WINOGRAD", bfloat16_winograd)
        dtype = tf.float64 if exact else tf.bfloat16

        def conv(x, w):
            if exact:
                return tf.nn.relu(tf.nn.conv2d(x, w, 1, "SAME") + tf.cast(b, dtype))
            return conv_ops.conv2d(x, w, bias=b, relu=True, route=route)

        shape = [None, None, None, channels] if sizes == "run-time" else x.shape
        fn = tf.function(lambda x, w: _gradients(conv, x, w, tf.cast(upstream, dtype)),
                         input_signature=[tf.TensorSpec(shape, dtype), tf.TensorSpec(w.shape, dtype)])
        graph = fn.get_concrete_function().graph
        types = {op.type for op in graph.get_operations()}
        for function in graph._functions.values():  # tf.cond's branches
            types |= {op.type for op in function.graph.get_operations()}
        return [tf.cast(t, tf.float64) for t in fn(tf.cast(x, dtype), tf.cast(w, dtype))], types

    # Tiles over the batch, static sizes (4x4 blocks) / run-time sizes (6x6): 12 / 8, 4 / 4, 8 / 8 (the batch
    # counts: many small maps, such as the mask head's RoIs, take the route).
    for batch, height, width, large in ((2, 8, 12, True), (2, 4, 8, False), (4, 4, 8, True)):
        x = tf.cast(tf.constant(rng.normal(size=(batch, height, width, channels)), tf.float32), tf.bfloat16)
        upstream = tf.cast(tf.constant(rng.normal(size=(batch, height, width, 8)), tf.float32), tf.bfloat16)
        exact, _ = run(x, upstream, conv_ops.WINOGRAD, True, exact=True)
        routed, types = run(x, upstream, conv_ops.WINOGRAD, True)
        direct, direct_types = run(x, upstream, conv_ops.WINOGRAD, False)
        assert "MrcnnWinogradInput" not in direct_types and conv_types <= direct_types, direct_types
        if sizes == "run-time":
            assert "MrcnnWinogradInput" in types and conv_types <= types and types & {"If", "StatelessIf"}, types
        elif large:
            assert "MrcnnWinogradInput" in types and not types & conv_types, types
        else:
            assert "MrcnnWinogradInput" not in types and conv_types <= types, types
        for name, got, want, theirs in zip(("output", "input gradient", "kernel gradient"), routed, exact, direct):
            scale = float(tf.reduce_max(tf.abs(want)))
            error, direct_error = (float(tf.reduce_max(tf.abs(t - want))) / scale for t in (got, theirs))
            assert error <= max(1.5 * direct_error, 2 ** -8), (name, height, error, direct_error)
        if not large:  # the same conv as the direct route's
            for got, theirs in zip(routed, direct):
                np.testing.assert_array_equal(got.numpy(), theirs.numpy())


@pytest.mark.parametrize("route", conv_ops.ROUTES)
@pytest.mark.parametrize("kernel_size,stride,padding", [(3, 1, "SAME"), (1, 1, "SAME"), (1, 2, "VALID")])
def test_conv2d_of_a_scaled_kernel_is_the_conv_of_the_product(monkeypatch, route, kernel_size, stride, padding):
    """kernel_scale (a frozen batch norm folded in): the output and the gradients of x, kernel and scale are
    those of conv2d(x, kernel * scale); the CPU routes make the product again for the gradient, once the output
    gradient exists, rather than keep the forward pass's."""
    monkeypatch.setattr(conv_ops, "WINOGRAD_MIN_TILES", 0)  # Winograd's route at this small size too
    rng = np.random.default_rng(kernel_size + stride)
    x = tf.constant(rng.normal(size=(2, 9, 12, 5)), tf.float32)
    w = tf.constant(rng.normal(size=(kernel_size, kernel_size, 5, 4)), tf.float32)
    scale = tf.constant(rng.uniform(0.5, 2.0, size=4), tf.float32)
    upstream = tf.constant(rng.normal(size=tf.nn.conv2d(x, w, stride, padding).shape), tf.float32)

    def gradients(conv, x, w, scale):
        with tf.GradientTape() as tape:
            tape.watch([x, w, scale])
            y = conv(x, w, scale)
            loss = tf.reduce_sum(y * upstream)
        return (y, *tape.gradient(loss, [x, w, scale]))

    def scaled(x, w, scale):
        return conv_ops.conv2d(x, w, stride, padding, route=route, kernel_scale=scale)

    expected = gradients(lambda x, w, scale: tf.nn.conv2d(x, w * scale, stride, padding), x, w, scale)
    actual = gradients(scaled, x, w, scale)
    for name, want, got in zip(("output", "input gradient", "kernel gradient", "scale gradient"), expected, actual):
        np.testing.assert_allclose(got.numpy(), want.numpy(), rtol=1e-4, atol=1e-4 * np.abs(want).max(),
                                   err_msg=name)
    if route == conv_ops.PLAIN:
        return
    graph = tf.function(lambda x, w, scale: gradients(scaled, x, w, scale)).get_concrete_function(x, w, scale).graph
    products = [op for op in graph.get_operations()  # kernel * scale, of the function's arguments
                if op.type == "Mul" and [i.op.type for i in op.inputs] == ["Placeholder", "Placeholder"]]
    # The forward pass's product and the gradient's, which waits for the output gradient.
    assert len(products) == 2
    assert [op.control_inputs for op in products][0] == []
    assert [c.type for c in products[1].control_inputs] == ["Mul"]  # upstream's product: the output gradient



class _Block(keras.layers.Layer):
    """layers[1](layers[0](x)): ConvBN inside a layer, as in a model (Keras autocasts the variables of a layer
    called at the top under a mixed policy, whatever its `autocast`)."""

    def __init__(self, *layers):
        super().__init__(name="block")
        self.parts = list(layers)

    def call(self, x, training=None):
        return self.parts[1](self.parts[0](x, training=training))


@pytest.mark.parametrize("policy", ["float32", "mixed_bfloat16"])
def test_a_function_traced_on_fixed_weights_prepares_the_kernels_when_traced(monkeypatch, request, policy):
    """Traced under fixed_weights, a ConvBN (batch norm on its moving statistics, folded into the kernel) and a
    Conv2D, both of Winograd's route, fold and transform their kernels when traced: the function's graph holds
    no batch norm fold (Rsqrt) and no kernel transform (MatMul), and its outputs are bit for
    bit those of the function that prepares the kernels in every call. It keeps the weights it was traced on,
    where the other follows a change of the variables."""
    # bfloat16's 3x3 convs by Winograd's float32 route too, at this size (BFLOAT16_WINOGRAD).
    for name, value in (("BFLOAT16_WINOGRAD", True), ("BFLOAT16_WINOGRAD_MIN_CHANNELS", 8),
                        ("BFLOAT16_WINOGRAD_MIN_TILES", 0)):
        monkeypatch.setattr(conv_ops, name, value)
    keras.mixed_precision.set_global_policy(policy)  # for the layers' calls too
    request.addfinalizer(lambda: keras.mixed_precision.set_global_policy("float32"))
    conv_bn = ConvBN(16, 3, conv_route=conv_ops.WINOGRAD)
    conv = Conv2D(8, 3, padding="same", activation="relu", conv_route=conv_ops.WINOGRAD)
    rng = np.random.default_rng(3)
    x = tf.constant(rng.normal(size=(1, 24, 32, 8)), tf.float32)  # 6 x 8 blocks: Winograd's route
    block = _Block(conv_bn, conv)
    block(x)
    for variable in (conv_bn.bn.moving_mean, conv_bn.bn.moving_variance, conv_bn.bn.gamma, conv.bias):
        variable.assign(rng.uniform(0.5, 2.0, size=variable.shape))

    def step(x):
        return block(x, training=False)

    def fixed_step(x):
        with fixed_weights():
            return step(x)

    spec = tf.TensorSpec(x.shape, tf.float32)
    plain, fixed = (tf.function(fn).get_concrete_function(spec) for fn in (step, fixed_step))
    types = [{op.type for op in fn.graph.get_operations()} for fn in (plain, fixed)]
    assert {"Rsqrt", "MatMul"} <= types[0], types[0]
    assert not {"Rsqrt", "MatMul"} & types[1], types[1]
    before = plain(x).numpy()
    np.testing.assert_array_equal(fixed(x).numpy(), before)
    assert np.abs(before).max() > 0

    conv.kernel.assign(conv.kernel * 2.0)
    np.testing.assert_array_equal(fixed(x).numpy(), before)
    np.testing.assert_array_equal(plain(x).numpy(), tf.function(step)(x).numpy())
    assert not np.array_equal(plain(x).numpy(), before)


@pytest.mark.parametrize("kernel_size,stride,padding,height,width",
                         [case for case in CASES if case[1] == 2 and not isinstance(case[2], str)])
def test_bfloat16_strided_conv_with_explicit_padding_matches_tensorflow(kernel_size, stride, padding, height, width):
    """Under --amp the strided convs' gradients are those of a 'VALID' conv of the padded input (conv_ops's
    custom gradient): the same values as float32 TensorFlow on the same bfloat16 numbers, to bfloat16's rounding."""
    rng = np.random.default_rng(kernel_size)
    x = tf.cast(tf.constant(rng.normal(size=(2, height, width, 5)), tf.float32), tf.bfloat16)
    w = tf.cast(tf.constant(rng.normal(size=(kernel_size, kernel_size, 5, 4)), tf.float32), tf.bfloat16)
    upstream = tf.cast(rng.normal(size=tf.nn.conv2d(x, w, stride, padding).shape), tf.bfloat16)
    as_float = lambda *tensors: [tf.cast(t, tf.float32) for t in tensors]  # noqa: E731
    expected = _gradients(lambda x, w: tf.nn.conv2d(x, w, stride, padding), *as_float(x, w, upstream))
    actual = _gradients(lambda x, w: conv_ops.conv2d(x, w, stride, padding), x, w, upstream)
    for name, want, got in zip(("output", "input gradient", "kernel gradient"), expected, actual):
        assert got.dtype == tf.bfloat16 and got.shape == want.shape, name
        scale = np.abs(want.numpy()).max()
        np.testing.assert_allclose(tf.cast(got, tf.float32).numpy(), want.numpy(), rtol=0, atol=0.02 * scale,
                                   err_msg=name)


@pytest.mark.parametrize("onednn", [False, True])
def test_kernel_gradient_in_a_compiled_function_with_unknown_batch_and_size(monkeypatch, onednn):
    """Shapes known only at run time (the model's tf.function with dynamic image batches), through the direct
    conv and through oneDNN's batch-of-one route, whatever the test process's kernels."""
    monkeypatch.setattr(conv_ops, "ONEDNN", onednn)
    rng = np.random.default_rng(0)
    w = tf.constant(rng.normal(size=(3, 3, 3, 2)), tf.float32)

    @tf.function(input_signature=[tf.TensorSpec([None, None, None, 3], tf.float32)])
    def kernel_grad(x):
        with tf.GradientTape() as tape:
            tape.watch(w)
            loss = tf.reduce_sum(conv_ops.conv2d(x, w, 1, "SAME") ** 2)
        return tape.gradient(loss, w)

    for batch in (3, 1):
        x = tf.constant(rng.normal(size=(batch, 10, 7, 3)), tf.float32)
        with tf.GradientTape() as tape:
            tape.watch(w)
            loss = tf.reduce_sum(tf.nn.conv2d(x, w, 1, "SAME") ** 2)
        np.testing.assert_allclose(kernel_grad(x).numpy(), tape.gradient(loss, w).numpy(), rtol=1e-4, atol=1e-3)


@pytest.mark.parametrize("kernel_size,activation,residual", [(3, "relu", False), (1, None, True)])
def test_keras_layer_trains_like_keras_conv2d(kernel_size, activation, residual):
    """The model's Conv2D layer: same outputs and variable gradients as keras.layers.Conv2D's (+ residual)."""
    rng = np.random.default_rng(1)
    x = tf.constant(rng.normal(size=(2, 8, 8, 3)), tf.float32)
    r = tf.constant(rng.normal(size=(2, 8, 8, 4)), tf.float32) if residual else None
    ours, theirs = (layer(4, kernel_size, padding="same", activation=activation)
                    for layer in (Conv2D, keras.layers.Conv2D))
    ours.build(x.shape)
    theirs.build(x.shape)
    theirs.set_weights(ours.get_weights())
    results = []
    for layer, call in ((ours, lambda: ours(x, r)), (theirs, lambda: theirs(x) if r is None else theirs(x) + r)):
        with tf.GradientTape() as tape:
            y = call()
            loss = tf.reduce_sum(y * y)
        results.append([y, *tape.gradient(loss, [v.value for v in layer.trainable_variables])])
    for got, want in zip(*results):
        np.testing.assert_allclose(got.numpy(), want.numpy(), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("kernel_size", [1, 3])
def test_transposed_conv2d_is_the_conv(kernel_size):
    """The batch-of-one route under oneDNN (module docstring), checked whatever the test process's kernels."""
    rng = np.random.default_rng(kernel_size)
    x = tf.constant(rng.normal(size=(1, 9, 12, 5)), tf.float32)
    w = tf.constant(rng.normal(size=(kernel_size, kernel_size, 5, 4)), tf.float32)
    got = conv_ops.transposed_conv2d(x, w)
    assert got.shape == (1, 9, 12, 4)
    np.testing.assert_allclose(got.numpy(), tf.nn.conv2d(x, w, 1, "SAME").numpy(), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("kernel_size,stride,padding,height", [
    (3, 2, [[0, 0], [1, 1], [1, 1], [0, 0]], 9),  # odd output height: the halves share a row
    (3, 2, [[0, 0], [1, 1], [1, 1], [0, 0]], 8),
    (1, 2, "VALID", 10),
    (1, 2, "VALID", 12),  # the halves are a reshape of the rows
    (1, 3, "VALID", 12),
    (7, 2, [[0, 0], [3, 3], [3, 3], [0, 0]], 15),
    (3, 2, "VALID", 3),  # a single output row
    (3, 1, "VALID", 2),  # no output row: under oneDNN, Conv2D's output would be shaped like its input
    (3, 2, "VALID", 1),
])
def test_split_conv2d_is_the_conv(kernel_size, stride, padding, height):
    """The batch-of-one route of strided convs under oneDNN, checked whatever the test process's kernels.

    The reference is the float64 conv: TensorFlow's own kernel with oneDNN on or off (oneDNN has no float64
    conv, and its float32 one mis-shapes an empty output)."""
    rng = np.random.default_rng(height)
    x = tf.constant(rng.normal(size=(1, height, 11, 5)), tf.float32)
    w = tf.constant(rng.normal(size=(kernel_size, kernel_size, 5, 4)), tf.float32)
    want = tf.nn.conv2d(tf.cast(x, tf.float64), tf.cast(w, tf.float64), stride, padding)
    got = conv_ops.split_conv2d(x, w, stride, padding)
    assert got.shape == want.shape
    np.testing.assert_allclose(got.numpy(), want.numpy(), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("kernel_size,stride,padding", [
    (3, 1, "SAME"), (1, 1, "VALID"), (3, 2, [[0, 0], [1, 1], [1, 1], [0, 0]]), (1, 2, "VALID")])
def test_conv2d_with_the_onednn_route(monkeypatch, kernel_size, stride, padding):
    """conv2d's block (conv, bias, residual, ReLU) as it runs under oneDNN: static and dynamic batches of one
    and of two, odd and even heights (a 1x1 conv folds an even one into the batch); output and gradients."""
    monkeypatch.setattr(conv_ops, "ONEDNN", True)
    rng = np.random.default_rng(3)
    w = tf.constant(rng.normal(size=(kernel_size, kernel_size, 5, 4)), tf.float32)
    b = tf.constant(rng.normal(size=4), tf.float32)

    def gradients(conv, x, residual):
        with tf.GradientTape() as tape:
            tape.watch([x, w, b, residual])
            y = conv(x, w, b, residual)
            loss = tf.reduce_sum(y * tf.cos(y))  # an upstream gradient that varies by element
        return (y, *tape.gradient(loss, [x, w, b, residual]))

    def block(x, w, b, residual):
        return conv_ops.conv2d(x, w, stride, padding, bias=b, residual=residual, relu=True)

    def reference(x, w, b, residual):
        return tf.nn.relu(tf.nn.conv2d(x, w, stride, padding) + b + residual)

    spec = tf.TensorSpec([None, None, None, None])
    dynamic = tf.function(lambda x, r: gradients(block, x, r), input_signature=[spec, spec])
    for batch in (1, 2):
        for height in (9, 10):
            x = tf.constant(rng.normal(size=(batch, height, 7, 5)), tf.float32)
            r = tf.constant(rng.normal(size=tf.nn.conv2d(x, w, stride, padding).shape), tf.float32)
            expected = gradients(reference, x, r)
            static = tf.function(lambda x, r: gradients(block, x, r))
            for got in (gradients(block, x, r), static(x, r), dynamic(x, r)):
                for name, want, value in zip(("output", "x", "kernel", "bias", "residual"), expected, got):
                    assert value.shape == want.shape, name
                    np.testing.assert_allclose(value.numpy(), want.numpy(), rtol=1e-4, atol=1e-4, err_msg=name)


@pytest.mark.parametrize("stride,padding,route_op", [
    (1, "SAME", "Conv2DBackpropInput"), (2, [[0, 0], [1, 1], [1, 1], [0, 0]], "ConcatV2")])
def test_a_batch_of_one_takes_the_onednn_route_in_float32_and_the_direct_conv_in_bfloat16(
        monkeypatch, stride, padding, route_op):
    """Under oneDNN a float32 image alone runs as a transposed conv (stride 1) or as its two halves (strided);
    in bfloat16 oneDNN's direct kernel is the faster one, so the traced forward holds one Conv2D and no route."""
    monkeypatch.setattr(conv_ops, "ONEDNN", True)
    rng = np.random.default_rng(4)
    for dtype in (tf.float32, tf.bfloat16):
        x = tf.cast(rng.normal(size=(1, 10, 8, 5)), dtype)
        w = tf.cast(rng.normal(size=(3, 3, 5, 4)), dtype)
        graph = tf.function(lambda x: conv_ops.conv2d(x, w, stride, padding)).get_concrete_function(x).graph
        types = [op.type for op in graph.get_operations()]
        if dtype == tf.float32:
            assert route_op in types, types
        else:
            assert route_op not in types and types.count("Conv2D") == 1, types


def test_a_1x1_conv_of_one_image_of_any_size_is_one_fusable_conv(monkeypatch):
    """Under oneDNN a 1x1 conv of one image runs as a batch of two, its pixels in two columns, and a strided one
    on every stride-th pixel first: no transposed conv, no halves concatenated. oneDNN fuses the bias, the
    residual's add and the ReLU into the conv only where grappler's shape inference finds the add's operands
    of one shape; with the image's size known only at run time (inference on batches padded to their own
    size) the sizes are symbols, equal only when one shape is derived from the other."""
    from tensorflow.python.grappler import item as grappler_item

    monkeypatch.setattr(conv_ops, "ONEDNN", True)
    w, b = tf.ones([1, 1, 5, 4]), tf.ones([4])
    for stride in (1, 2):
        block = tf.function(lambda x, r: conv_ops.conv2d(x, w, stride, "VALID", bias=b, residual=r, relu=True))
        graph = block.get_concrete_function(tf.TensorSpec([1, None, None, 5]),
                                            tf.TensorSpec([1, None, None, 4])).graph
        types = [op.type for op in graph.get_operations()]
        assert types.count("Conv2D") == 1 and "Conv2DBackpropInput" not in types, types
        (conv,) = [op for op in graph.get_operations() if op.type == "Conv2D"]
        assert conv.inputs[0].shape[0] == 2 and conv.get_attr("strides") == [1, 1, 1, 1], conv.node_def
        meta = tf.compat.v1.train.export_meta_graph(graph_def=graph.as_graph_def(), graph=graph)
        meta.collection_def["train_op"].node_list.value.append(graph.outputs[0].op.name)
        inferred = grappler_item.Item(meta).GetOpProperties()
        (add,) = [op for op in graph.get_operations() if op.type == "AddV2" and "BiasAdd" in
                  [tensor.op.type for tensor in op.inputs]]
        left, right = ([dim.size for dim in inferred[t.op.name][t.value_index].shape.dim] for t in add.inputs)
        assert left == right and left[0] == 2 and left[1] < -1, (left, right)  # -2, -3, ...: a symbol


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_the_conv_benchmark_times_each_kernel_in_its_dtype(dtype, capsys, monkeypatch):
    from scripts import benchmark_conv

    # bfloat16: conv2d's Winograd route at this size, on any CPU (6 tiles of 4x4, 16 channels).
    for name, value in (("BFLOAT16_WINOGRAD", True), ("BFLOAT16_WINOGRAD_MIN_CHANNELS", 16),
                        ("BFLOAT16_WINOGRAD_MIN_TILES", 6)):
        monkeypatch.setattr(conv_ops, name, value)
    benchmark_conv.main(["--shape", "1", "8", "12", "16", "--repeats", "1", "--dtype", dtype])
    lines = capsys.readouterr().out.splitlines()
    assert f"[1, 8, 12, 16] in {dtype}:" in lines[0] and "kernel gradients differ by" in lines[0], lines[0]
    # The gradients agree to the dtype's rounding. bfloat16 keeps 8 bits of mantissa, and with oneDNN off
    # TensorFlow's own kernel sums the 96 products of each tap in bfloat16: these inputs differ by 1.7e-2 there
    # (random ones reached 2.2e-2), by 0 with oneDNN on; a wrong gradient differs by the gradient's own size.
    error = float(lines[0].split("kernel gradients differ by ")[1].split()[0])
    assert error <= (1e-5 if dtype == "float32" else 5e-2), lines[0]
    patches_error = float(lines[0].split("the products of patches by ")[1].split()[0].rstrip(",;"))
    assert patches_error <= (1e-5 if dtype == "float32" else 5e-2), lines[0]
    timed = [line.split("  ")[1].strip() for line in lines[1:]]
    expected = ["forward", "input gradient", "kernel gradient, TensorFlow", "kernel gradient, matrix products",
                "forward, matrix product of patches", "input gradient, matrix product of patches"]
    if dtype == "float32":
        winograd = [f"{kind}, Winograd F({m}x{m}, 3x3)" for m in (4, 5, 6) for kind in ("forward", "kernel gradient")]
    else:
        winograd = ["forward, Winograd's float32 route"]
    assert timed == expected + winograd, lines
    # Every block's forwards and kernel gradients agree with the direct kernels (bfloat16: both rounded to it).
    assert float(lines[0].split("Winograd's by ")[1].split()[0]) <= (1e-4 if dtype == "float32" else 2e-2), lines[0]
    assert lines[0].endswith("(it takes F(4x4, 3x3) at this shape)" if dtype == "float32" else
                             "(it takes F(4x4, 3x3) at this shape; conv2d takes this route here: yes)"), lines[0]
    assert all(line.rstrip().endswith("GFLOP/s") for line in lines[1:]), lines


def test_the_conv_benchmark_times_a_strided_conv_and_its_gradients_each_way(capsys):
    from scripts import benchmark_conv

    gradients = ["input gradient, explicit padding", "input gradient, 'VALID' cropped",
                 "kernel gradient, explicit padding", "kernel gradient, 'VALID' padded copy"]
    # An odd height: the halves share a row, and the output's odd row count is concatenated. An even width: the
    # padded shape's last column is in no window. The halves' route serves a batch of one only.
    for batch, routes in (("1", ["direct", "halves (split_conv2d)"]), ("2", ["direct"])):
        benchmark_conv.main(["--strided", "3", "--shape", batch, "11", "12", "8", "--repeats", "1"])
        lines = capsys.readouterr().out.splitlines()
        assert lines[0].startswith(f"3x3/2 conv 8->8 on [{batch}, 11, 12, 8] in float32:"), lines[0]
        error = float(lines[0].split("each pair differs by at most ")[1].split()[0])
        assert error <= 1e-5, lines[0]  # two kernels' float rounding (1e-6 at the ResNet's sizes); a wrong one: ~1
        assert [line.split("  ")[1].strip() for line in lines[1:]] == routes + gradients, lines
        assert all(line.rstrip().endswith("GFLOP/s") for line in lines[1:]), lines
