"""FPN and heads against references built from their parts, and the layer contract of the whole stack:
config round trip, mixed precision output dtypes, gradients reaching every trainable variable."""

import keras
import numpy as np
import pytest
import tensorflow as tf

from mrcnn_tf2.model.backbone import ResNet
from mrcnn_tf2.model.fpn import FPN, upsample2x
from mrcnn_tf2.model.heads import BoxHead, MaskHead, RPNHead

BATCH, NUM_ROIS, NUM_CLASSES, NUM_ANCHORS = 2, 3, 5, 3


def backbone_features(rng, size=64, channels=8):
    """{level: [B, size / 2**level, size / 2**level, channels]} random C2..C5 stand-ins."""
    return {level: rng.normal(size=(BATCH, size >> level, size >> level, channels)).astype(np.float32)
            for level in range(2, 6)}


def np_upsample2x(x):
    return np.repeat(np.repeat(x, 2, axis=1), 2, axis=2)


def test_fpn_matches_top_down_reference_and_subsamples_p6(rng):
    features = backbone_features(rng)
    fpn = FPN(min_level=2, max_level=7, num_filters=16)
    got = {level: p.numpy() for level, p in fpn(features).items()}
    assert sorted(got) == [2, 3, 4, 5, 6, 7]
    for level, p in got.items():
        assert p.shape == (BATCH, -(-64 // 2**level), -(-64 // 2**level), 16)

    top_down = None
    for level in (5, 4, 3, 2):
        lateral = fpn.lateral[level](features[level]).numpy()
        top_down = lateral if top_down is None else lateral + np_upsample2x(top_down)
        np.testing.assert_allclose(got[level], fpn.output_convs[level](top_down).numpy(), rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(got[6], got[5][:, ::2, ::2])
    np.testing.assert_array_equal(got[6], tf.nn.max_pool2d(got[5], 1, 2, "VALID").numpy())  # NVIDIA's form
    np.testing.assert_array_equal(got[7], got[6][:, ::2, ::2])


@pytest.mark.onednn  # the pooled gradient is a pooling kernel, oneDNN's or TensorFlow's
@pytest.mark.parametrize("pooled_gradient", [True, False])
@pytest.mark.parametrize("dtype", [tf.float32, tf.bfloat16])
def test_upsample2x_values_and_gradient(rng, dtype, pooled_gradient):
    """The 2x copy, and as its gradient each pixel's sum over its 2x2 copies (the broadcast's own gradient)."""
    x = tf.cast(rng.normal(size=(2, 3, 5, 4)), dtype)
    out_grad = tf.cast(rng.normal(size=(2, 6, 10, 4)), dtype)
    with tf.GradientTape() as tape:
        tape.watch(x)
        y = upsample2x(x, pooled_gradient)
    got = tape.gradient(y, x, output_gradients=out_grad)
    np.testing.assert_array_equal(y.numpy(), np_upsample2x(x.numpy()))
    blocks = tf.cast(out_grad, tf.float32).numpy().reshape(2, 3, 2, 5, 2, 4)
    want = blocks[:, :, 0, :, 0] + blocks[:, :, 0, :, 1] + blocks[:, :, 1, :, 0] + blocks[:, :, 1, :, 1]
    assert got.dtype == dtype and got.shape == x.shape
    tolerance = 1e-6 if dtype == tf.float32 else 2e-2  # bfloat16: 8 bits of mantissa, summed in any order
    np.testing.assert_allclose(tf.cast(got, tf.float32).numpy(), want, rtol=tolerance, atol=tolerance)


def test_fpn_levels_and_bad_arguments(rng):
    features = backbone_features(rng)
    assert sorted(FPN(min_level=3, max_level=5)(features)) == [3, 4, 5]
    with pytest.raises(ValueError, match="min_level"):
        FPN(min_level=1)
    with pytest.raises(ValueError, match="max_level"):
        FPN(max_level=4)
    with pytest.raises(ValueError, match="missing"):
        FPN(min_level=2)({level: features[level] for level in (3, 4, 5)})


def test_rpn_head_shares_one_set_of_weights_across_levels(rng):
    levels = {level: rng.normal(size=(BATCH, 32 >> level, 32 >> level, 16)).astype(np.float32) for level in (2, 3, 4)}
    head = RPNHead(NUM_ANCHORS, num_filters=8)
    got = head(levels)
    assert len(head.weights) == 6  # shared conv, score conv, box conv: kernel + bias each
    for level, x in levels.items():
        assert got["rpn_scores"][level].shape == x.shape[:3] + (NUM_ANCHORS,)
        assert got["rpn_boxes"][level].shape == x.shape[:3] + (4 * NUM_ANCHORS,)
        hidden = head.conv(x)
        np.testing.assert_allclose(got["rpn_scores"][level].numpy(), head.score_conv(hidden).numpy(), rtol=1e-5)
        np.testing.assert_allclose(got["rpn_boxes"][level].numpy(), head.box_conv(hidden).numpy(), rtol=1e-5)


def test_box_head_matches_mlp_reference_per_roi(rng):
    rois = rng.normal(size=(BATCH, NUM_ROIS, 7, 7, 4)).astype(np.float32)
    head = BoxHead(NUM_CLASSES, mlp_head_dim=16)
    got = head(rois)
    assert got["class_logits"].shape == (BATCH, NUM_ROIS, NUM_CLASSES)
    assert got["box_deltas"].shape == (BATCH, NUM_ROIS, NUM_CLASSES, 4)

    def dense(layer, x):
        return x @ layer.kernel.numpy() + layer.bias.numpy()

    for b in range(BATCH):
        for n in range(NUM_ROIS):
            hidden = np.maximum(dense(head.fc7, np.maximum(dense(head.fc6, rois[b, n].reshape(-1)), 0)), 0)
            np.testing.assert_allclose(got["class_logits"][b, n].numpy(), dense(head.class_dense, hidden),
                                       rtol=1e-4, atol=1e-6)
            np.testing.assert_allclose(got["box_deltas"][b, n].numpy(),
                                       dense(head.box_dense, hidden).reshape(NUM_CLASSES, 4), rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("side", [14, 7])
def test_mask_head_doubles_resolution_and_gives_each_roi_its_class_logits(rng, side):
    rois = rng.normal(size=(BATCH, NUM_ROIS, side, side, 8)).astype(np.float32)
    classes = rng.integers(0, NUM_CLASSES, size=(BATCH, NUM_ROIS)).astype(np.int32)
    head = MaskHead(NUM_CLASSES, num_filters=8)
    got = head((rois, classes)).numpy()
    assert got.shape == (BATCH, NUM_ROIS, 2 * side, 2 * side)
    # Reference: the 1x1 logits conv over every class, then each RoI's class channel.
    x = rois.reshape((-1, side, side, 8))
    for conv in head.convs:
        x = conv(x)
    x = head.deconv(x).numpy().reshape((BATCH, NUM_ROIS, 2 * side, 2 * side, 8))
    every_class = np.einsum("bnyxc,ck->bnyxk", x, head.logits.kernel.numpy()[0, 0]) + head.logits.bias.numpy()
    want = np.take_along_axis(every_class, classes[:, :, None, None, None], axis=4)[..., 0]
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-6)
    for b in range(BATCH):
        for n in range(NUM_ROIS):
            alone = head((rois[b:b + 1, n:n + 1], classes[b:b + 1, n:n + 1])).numpy()[0, 0]
            np.testing.assert_allclose(got[b, n], alone, rtol=1e-4, atol=1e-6)


def test_heads_reject_features_without_roi_axis():
    with pytest.raises(ValueError, match="BoxHead"):
        BoxHead(NUM_CLASSES)(tf.zeros([NUM_ROIS, 7, 7, 4]))
    with pytest.raises(ValueError, match="MaskHead"):
        MaskHead(NUM_CLASSES)((tf.zeros([NUM_ROIS, 14, 14, 4]), tf.zeros([NUM_ROIS], tf.int32)))


def build_stack(**backbone_kwargs):
    return {
        "backbone": ResNet(18, **backbone_kwargs),
        "fpn": FPN(num_filters=16),
        "rpn_head": RPNHead(NUM_ANCHORS, num_filters=16),
        "box_head": BoxHead(NUM_CLASSES, mlp_head_dim=16),
        "mask_head": MaskHead(NUM_CLASSES, num_filters=8, num_convs=2),
    }


def run_stack(stack, images, training):
    """Backbone -> FPN -> heads; corner crops of P2 stand in for RoIAlign so gradients reach the backbone."""
    features = stack["fpn"](stack["backbone"](images, training=training), training=training)
    p2 = features[2]
    outputs = dict(stack["rpn_head"](features, training=training))
    box_rois = tf.tile(p2[:, None, :7, :7], [1, NUM_ROIS, 1, 1, 1])
    outputs.update(stack["box_head"](box_rois, training=training))
    classes = tf.ones([tf.shape(p2)[0], 1], tf.int32)
    outputs["mask_logits"] = stack["mask_head"]((p2[:, None, :14, :14], classes), training=training)
    return features, outputs


# The stack runs on a batch of one image: conv_ops.conv2d's oneDNN routes with oneDNN on, the direct conv without.
@pytest.mark.onednn
@pytest.mark.parametrize("name", ["backbone", "fpn", "rpn_head", "box_head", "mask_head"])
def test_config_round_trip(rng, name):
    stack = build_stack(stride_in_1x1=True, freeze_bn=False, freeze_blocks=(0,))
    images = rng.normal(size=(1, 64, 64, 3)).astype(np.float32)
    features, _ = run_stack(stack, images, training=False)
    inputs = {"backbone": images, "fpn": stack["backbone"](images), "rpn_head": features,
              "box_head": rng.normal(size=(1, NUM_ROIS, 7, 7, 16)).astype(np.float32),
              "mask_head": (rng.normal(size=(1, NUM_ROIS, 14, 14, 16)).astype(np.float32),
                            rng.integers(0, NUM_CLASSES, size=(1, NUM_ROIS)).astype(np.int32))}[name]
    layer = stack[name]
    layer(inputs)
    rebuilt = type(layer).from_config(layer.get_config())
    assert rebuilt.get_config() == layer.get_config()
    rebuilt(inputs)
    assert [v.trainable for v in rebuilt.weights] == [v.trainable for v in layer.weights]
    rebuilt.set_weights(layer.get_weights())
    for want, got in zip(tf.nest.flatten(layer(inputs)), tf.nest.flatten(rebuilt(inputs))):
        np.testing.assert_array_equal(got.numpy(), want.numpy())


@pytest.fixture
def mixed_bfloat16():
    keras.mixed_precision.set_global_policy("mixed_bfloat16")
    try:
        yield
    finally:
        keras.mixed_precision.set_global_policy("float32")


@pytest.mark.onednn
def test_mixed_bfloat16_stack_computes_in_bfloat16_and_heads_return_float32(rng, mixed_bfloat16):
    stack = build_stack()
    images = rng.normal(size=(1, 64, 64, 3)).astype(np.float32)
    features, outputs = run_stack(stack, images, training=True)
    assert all(f.dtype == tf.bfloat16 for f in features.values())
    assert all(v.dtype == tf.float32 for layer in stack.values() for v in layer.weights)
    for output in tf.nest.flatten(outputs):
        assert output.dtype == tf.float32
        assert np.isfinite(output.numpy()).all()


@pytest.mark.onednn
@pytest.mark.parametrize("freeze_bn,freeze_blocks", [(True, (0, 1)), (False, ())])
def test_gradients_reach_every_trainable_variable(rng, freeze_bn, freeze_blocks):
    stack = build_stack(freeze_bn=freeze_bn, freeze_blocks=freeze_blocks)
    images = rng.normal(size=(1, 64, 64, 3)).astype(np.float32)
    run_stack(stack, images, training=True)  # build
    variables = [v for layer in stack.values() for v in layer.trainable_variables]
    with tf.GradientTape() as tape:
        _, outputs = run_stack(stack, images, training=True)
        loss = tf.add_n([tf.reduce_mean(tf.square(o)) for o in tf.nest.flatten(outputs)])
    grads = tape.gradient(loss, variables)
    for v, g in zip(variables, grads):
        assert g is not None, v.path
        assert np.any(tf.convert_to_tensor(g).numpy() != 0), v.path
