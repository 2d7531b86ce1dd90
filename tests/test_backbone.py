"""ResNet backbone: ConvBN against a NumPy reference, keras.applications.ResNet50 as the architecture oracle,
output shapes and strides, v1 / v1.5 stride placement, frozen blocks and frozen batch norm."""

import keras
import numpy as np
import pytest
import tensorflow as tf

from mrcnn_tf2.model import backbone
from mrcnn_tf2.model.backbone import BN_EPSILON, BN_MOMENTUM, ConvBN, ResNet

# Output of the last block of each group in keras.applications.ResNet50, i.e. C2..C5.
KERAS_GROUP_OUTPUTS = {2: "conv2_block3_out", 3: "conv3_block4_out", 4: "conv4_block6_out", 5: "conv5_block3_out"}


def np_conv2d(x, kernel, stride, pad):
    """[B, H, W, Ci] * [k, k, Ci, Co] with symmetric zero padding `pad`: a sum of shifted matmuls."""
    k = kernel.shape[0]
    xp = np.pad(x.astype(np.float64), [(0, 0), (pad, pad), (pad, pad), (0, 0)])
    out_h = (xp.shape[1] - k) // stride + 1
    out_w = (xp.shape[2] - k) // stride + 1
    out = np.zeros(x.shape[:1] + (out_h, out_w, kernel.shape[3]))
    for i in range(k):
        for j in range(k):
            out += xp[:, i:i + stride * out_h:stride, j:j + stride * out_w:stride, :] @ kernel[i, j]
    return out


def variable_key(variable):
    """'<layer name>/<variable name>', the part of a path that keras.applications and ResNet share."""
    return "/".join(variable.path.split("/")[-2:])


def randomize_bn(layer, rng):
    """Random gamma/beta/moving statistics, so that BN is not (nearly) an identity."""
    c = layer.gamma.shape[0]
    layer.gamma.assign(rng.uniform(0.5, 1.5, c).astype(np.float32))
    layer.beta.assign(rng.normal(0, 0.2, c).astype(np.float32))
    layer.moving_mean.assign(rng.normal(0, 0.2, c).astype(np.float32))
    layer.moving_variance.assign(rng.uniform(0.5, 2.0, c).astype(np.float32))


def bn_layers(model):
    return [layer for layer in model._flatten_layers() if isinstance(layer, keras.layers.BatchNormalization)]


@pytest.mark.parametrize("kernel_size,strides,with_residual", [(1, 1, False), (1, 2, False), (3, 1, True),
                                                               (3, 2, False), (7, 2, False)])
@pytest.mark.parametrize("training", [False, True])
@pytest.mark.onednn  # the conv's numbers are oneDNN's or TensorFlow's
def test_conv_bn_matches_numpy_reference(rng, kernel_size, strides, with_residual, training):
    x = rng.normal(size=(2, 9, 10, 4)).astype(np.float32)
    layer = ConvBN(5, kernel_size, strides, name="unit")
    out_shape = (2, -(-9 // strides), -(-10 // strides), 5)
    residual = rng.normal(size=out_shape).astype(np.float32) if with_residual else None
    layer.build(x.shape)
    randomize_bn(layer.bn, rng)
    old_mean, old_variance = layer.bn.moving_mean.numpy(), layer.bn.moving_variance.numpy()
    got = layer(x, residual=residual, training=training).numpy()

    y = np_conv2d(x, layer.conv.kernel.numpy(), strides, (kernel_size - 1) // 2)
    assert y.shape == out_shape
    if training:
        mean, var = y.mean((0, 1, 2)), y.var((0, 1, 2))
        np.testing.assert_allclose(layer.bn.moving_mean.numpy(), BN_MOMENTUM * old_mean + (1 - BN_MOMENTUM) * mean,
                                   rtol=1e-4, atol=1e-5)
        # Keras' moving variance: the biased one (the fused kernel's is unbiased: 0.6% larger over 180 values).
        np.testing.assert_allclose(layer.bn.moving_variance.numpy(),
                                   BN_MOMENTUM * old_variance + (1 - BN_MOMENTUM) * var, rtol=1e-5)
    else:
        mean, var = old_mean, layer.bn.moving_variance.numpy()
    want = (y - mean) / np.sqrt(var + BN_EPSILON) * layer.bn.gamma.numpy() + layer.bn.beta.numpy()
    if with_residual:
        want = want + residual
    np.testing.assert_allclose(got, np.maximum(want, 0), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("depth,c2_channels", [(18, 64), (34, 64), (50, 256), (101, 256)])
def test_output_shapes_and_strides(depth, c2_channels):
    # 96 is an odd multiple of 32: every stride-2 stage must halve exactly, also at C5 (3 x 2).
    images = tf.zeros([2, 64, 96, 3])
    features = ResNet(depth)(images)
    assert sorted(features) == [2, 3, 4, 5]
    for level, feature in features.items():
        channels = c2_channels * 2 ** (level - 2)  # each group doubles the width
        assert feature.shape == (2, 64 // 2**level, 96 // 2**level, channels)


@pytest.fixture(scope="module")
def keras_resnet50():
    return keras.applications.ResNet50(weights=None, include_top=False, input_shape=(64, 64, 3))


def test_resnet50_v1_has_keras_applications_parameters_and_names(keras_resnet50):
    model = ResNet(50, stride_in_1x1=True)
    model(tf.zeros([1, 64, 64, 3]))
    conv_biases = sum(int(np.prod(layer.bias.shape)) for layer in keras_resnet50.layers
                      if isinstance(layer, keras.layers.Conv2D))
    assert model.count_params() == keras_resnet50.count_params() - conv_biases

    ours = {variable_key(v): tuple(v.shape) for v in model.weights}
    theirs = {variable_key(v): tuple(v.shape) for v in keras_resnet50.weights if not v.path.endswith("_conv/bias")}
    assert ours == theirs


@pytest.mark.onednn
def test_resnet50_v1_computes_keras_applications_features(keras_resnet50, rng):
    """With keras.applications' weights (conv biases folded into the BN mean) C2..C5 match its group outputs."""
    for layer in bn_layers(keras_resnet50):
        randomize_bn(layer, rng)
    theirs = {variable_key(v): v for v in keras_resnet50.weights}
    for v in keras_resnet50.weights:
        if v.path.endswith("_conv/bias"):
            v.assign(rng.normal(0, 0.1, v.shape).astype(np.float32))
    model = ResNet(50, stride_in_1x1=True)
    images = rng.normal(size=(2, 64, 64, 3)).astype(np.float32)
    model(images)
    for v in model.weights:
        key = variable_key(v)
        value = theirs[key].numpy()
        if key.endswith("_bn/moving_mean"):
            # BN(conv(x) + b) with mean m is BN(conv(x)) with mean m - b.
            value = value - theirs[key.replace("_bn/moving_mean", "_conv/bias")].numpy()
        v.assign(value)
    group_outputs = {level: keras_resnet50.get_layer(name).output for level, name in KERAS_GROUP_OUTPUTS.items()}
    reference = keras.Model(keras_resnet50.input, group_outputs)
    want = reference(images, training=False)
    got = model(images, training=False)
    for level in KERAS_GROUP_OUTPUTS:
        scale = np.abs(want[level].numpy()).max()
        np.testing.assert_allclose(got[level].numpy(), want[level].numpy(), rtol=1e-3, atol=1e-4 * scale)


@pytest.mark.parametrize("stride_in_1x1", [False, True])
def test_stride_placement_v1_and_v15(stride_in_1x1):
    model = ResNet(50, stride_in_1x1=stride_in_1x1)
    model(tf.zeros([1, 64, 64, 3]))
    strides = {layer.name: layer.strides for layer in model._flatten_layers() if isinstance(layer, ConvBN)}
    for group in (3, 4, 5):
        first_1x1, conv_3x3 = strides[f"conv{group}_block1_1"], strides[f"conv{group}_block1_2"]
        assert (first_1x1, conv_3x3) == ((2, 1) if stride_in_1x1 else (1, 2))
        assert strides[f"conv{group}_block1_0"] == 2  # the projection shortcut matches the block's stride
    assert strides["conv2_block1_1"] == strides["conv2_block1_2"] == 1  # the max-pool already halved
    assert all(s == 1 for name, s in strides.items() if "block1" not in name and name != "conv1")


def expected_trainable(variable, freeze_blocks, freeze_bn):
    """Whether `variable` should be trainable, from its layer name ('conv1_bn', 'conv3_block2_1_conv')."""
    layer = variable.path.split("/")[-2]
    group = 0 if layer.startswith("conv1_") else int(layer[len("conv")]) - 1
    kind = variable.path.split("/")[-1]
    if group in freeze_blocks or kind in ("moving_mean", "moving_variance"):
        return False
    return kind == "kernel" or not freeze_bn


@pytest.mark.parametrize("freeze_blocks,freeze_bn", [((0, 1), True), ((0, 1), False), ((), True), ((0, 2), False)])
def test_frozen_blocks_and_batch_norm_are_not_trainable(freeze_blocks, freeze_bn):
    model = ResNet(18, freeze_bn=freeze_bn, freeze_blocks=freeze_blocks)
    model(tf.zeros([1, 64, 64, 3]))
    trainable = {v.path for v in model.trainable_variables}
    for v in model.weights:
        assert (v.path in trainable) == expected_trainable(v, freeze_blocks, freeze_bn), v.path


def test_frozen_bn_uses_moving_statistics_in_training(rng):
    model = ResNet(18, freeze_bn=True, freeze_blocks=())
    images = rng.normal(size=(2, 64, 64, 3)).astype(np.float32)
    model(images)
    for layer in bn_layers(model):
        randomize_bn(layer, rng)
    before = [v.numpy() for v in model.non_trainable_variables]
    train, infer = model(images, training=True), model(images, training=False)
    for level in train:
        np.testing.assert_array_equal(train[level].numpy(), infer[level].numpy())
    for old, v in zip(before, model.non_trainable_variables):
        np.testing.assert_array_equal(old, v.numpy())


def test_trainable_bn_updates_moving_statistics_outside_frozen_blocks(rng):
    model = ResNet(18, freeze_bn=False, freeze_blocks=(0,))
    images = rng.normal(size=(2, 64, 64, 3)).astype(np.float32)
    model(images)
    before = {v.path: v.numpy() for v in model.non_trainable_variables}
    train, infer = model(images, training=True), model(images, training=False)
    assert not np.allclose(train[5].numpy(), infer[5].numpy())
    for v in model.non_trainable_variables:
        frozen = v.path.split("/")[-2].startswith("conv1_")  # the stem, frozen block group 0
        assert np.array_equal(before[v.path], v.numpy()) == frozen, v.path


def test_stem_and_first_group_are_computed_again_for_their_gradient(rng, monkeypatch):
    """Training, the stem and the first group keep no activations for the backward pass: their gradient runs
    them again once the output gradient arrives, and gives the gradients and moving averages of a plain call."""
    images = tf.constant(rng.normal(size=(2, 64, 64, 3)), tf.float32)
    monkeypatch.setattr(backbone, "RECOMPUTE_MIN_BYTES", 2 * 32 * 32 * 64 * 4)  # these images' stem output
    runs, initial = [], None
    for recompute in (True, False):
        if not recompute:
            monkeypatch.setattr(backbone, "_recomputed", lambda forward, x: forward(x))
        model = ResNet(18, freeze_bn=False, freeze_blocks=())
        model(images[:1])
        if initial is None:
            initial = model.get_weights()
        model.set_weights(initial)

        @tf.function
        def gradients():
            with tf.GradientTape() as tape:
                features = model(images, training=True)
                loss = tf.add_n([tf.reduce_sum(f * tf.cos(f)) for f in features.values()])
            return tape.gradient(loss, model.trainable_variables)

        graph = gradients.get_concrete_function().graph
        runs.append(dict(gradients=[g.numpy() for g in gradients()],
                         averages=[v.numpy() for v in model.non_trainable_variables],
                         ops=[op for op in graph.get_operations()]))
    recomputed, plain = runs
    count = lambda run, kind: sum(op.type == kind for op in run["ops"])  # noqa: E731
    # ResNet-18's stem and first group hold 5 batch norms, computed twice; the moving averages update once.
    assert count(recomputed, "FusedBatchNormV3") == count(plain, "FusedBatchNormV3") + 5
    assert count(recomputed, "AssignVariableOp") == count(plain, "AssignVariableOp") == 2 * 20
    # The recomputation starts from the images once the output gradient is there (not during the forward pass).
    (wait,) = [op for op in recomputed["ops"] if op.type == "Identity" and op.inputs[0].shape == images.shape]
    assert [op.outputs[0].shape for op in wait.control_inputs] == [[2, 16, 16, 64]]  # C2's gradient
    for got, want in zip(recomputed["gradients"], plain["gradients"]):
        np.testing.assert_array_equal(got, want)
    for got, want in zip(recomputed["averages"], plain["averages"]):
        np.testing.assert_array_equal(got, want)


def test_bad_arguments_raise():
    with pytest.raises(ValueError, match="depth"):
        ResNet(42)
    with pytest.raises(ValueError, match="freeze_blocks"):
        ResNet(18, freeze_blocks=(5,))
    with pytest.raises(ValueError, match="images"):
        ResNet(18)(tf.zeros([1, 64, 64, 4]))
