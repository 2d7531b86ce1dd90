"""Losses against NumPy references, and their behaviour when there is nothing to learn from."""

import keras
import numpy as np
import tensorflow as tf

from mrcnn_tf2.model import losses


def np_smooth_l1(d, beta):
    d = np.abs(d)
    return np.where(d < beta, 0.5 * d**2 / beta, d - 0.5 * beta)


def np_bce(labels, logits):
    p = 1.0 / (1.0 + np.exp(-logits.astype(np.float64)))
    return -(labels * np.log(p) + (1 - labels) * np.log(1 - p))


def test_smooth_l1_matches_reference_and_is_continuous(rng):
    d = rng.normal(size=1000).astype(np.float32) * 0.3
    for beta in (1.0 / 9.0, 1.0):
        np.testing.assert_allclose(losses.smooth_l1(tf.constant(d), beta).numpy(), np_smooth_l1(d, beta), rtol=1e-5)
        at = np.array([beta - 1e-6, beta + 1e-6], np.float32)
        left, right = losses.smooth_l1(tf.constant(at), beta).numpy()
        assert abs(left - right) < 1e-5


def rpn_inputs(rng, batch=2, anchors=3):
    shapes = {2: (8, 8), 3: (4, 4)}
    scores = {l: rng.normal(size=(batch, h, w, anchors)).astype(np.float32) for l, (h, w) in shapes.items()}
    boxes = {l: rng.normal(size=(batch, h, w, 4 * anchors)).astype(np.float32) for l, (h, w) in shapes.items()}
    labels = {l: rng.choice([-1, 0, 1], p=[0.6, 0.3, 0.1], size=(batch, h, w, anchors)).astype(np.int32)
              for l, (h, w) in shapes.items()}
    targets = {l: rng.normal(size=(batch, h, w, 4 * anchors)).astype(np.float32) for l, (h, w) in shapes.items()}
    return scores, boxes, labels, targets


def test_rpn_losses_match_reference(rng):
    scores, boxes, labels, targets = rpn_inputs(rng)
    got = losses.rpn_losses(scores, boxes, labels, targets)
    score_sum = box_sum = sampled = 0.0
    for level in scores:
        lab = labels[level]
        sampled += (lab >= 0).sum()
        score_sum += (np_bce((lab > 0).astype(np.float64), scores[level]) * (lab >= 0)).sum()
        b, h, w, a = lab.shape
        diff = (boxes[level] - targets[level]).reshape(b, h, w, a, 4)
        box_sum += (np_smooth_l1(diff, 1 / 9).sum(-1) * (lab > 0)).sum()
    np.testing.assert_allclose(got["loss_rpn_score"].numpy(), score_sum / sampled, rtol=1e-5)
    np.testing.assert_allclose(got["loss_rpn_box"].numpy(), box_sum / sampled, rtol=1e-5)


def test_rpn_losses_with_nothing_sampled_are_zero_and_connected(rng):
    scores, boxes, labels, targets = rpn_inputs(rng)
    labels = {l: np.full_like(v, -1) for l, v in labels.items()}
    scores = {l: tf.Variable(v) for l, v in scores.items()}
    with tf.GradientTape() as tape:
        got = losses.rpn_losses(scores, boxes, labels, targets)
        total = got["loss_rpn_score"] + got["loss_rpn_box"]
    assert float(total) == 0.0
    grads = tape.gradient(total, list(scores.values()))
    assert all(g is not None and float(tf.reduce_max(tf.abs(g))) == 0.0 for g in grads)


def test_fast_rcnn_losses_match_reference(rng):
    b, s, k = 2, 16, 5
    logits = rng.normal(size=(b, s, k)).astype(np.float32)
    deltas = rng.normal(size=(b, s, k, 4)).astype(np.float32)
    classes = rng.integers(0, k, size=(b, s)).astype(np.int32)
    targets = rng.normal(size=(b, s, 4)).astype(np.float32)
    valid = rng.random((b, s)) < 0.8
    got = losses.fast_rcnn_losses(logits, deltas, classes, targets, valid)
    log_softmax = logits - np.log(np.exp(logits).sum(-1, keepdims=True))
    ce = -np.take_along_axis(log_softmax, classes[..., None], -1)[..., 0]
    own = np.take_along_axis(deltas, classes[..., None, None].repeat(4, -1), 2)[:, :, 0]
    box = np_smooth_l1(own - targets, 1.0).sum(-1)
    n = valid.sum()
    np.testing.assert_allclose(got["loss_fast_rcnn_class"].numpy(), (ce * valid).sum() / n, rtol=1e-5)
    np.testing.assert_allclose(got["loss_fast_rcnn_box"].numpy(), (box * valid * (classes > 0)).sum() / n, rtol=1e-5)


def test_mask_loss_averages_over_valid_pixels_only(rng):
    b, f, r = 2, 4, 6
    logits = rng.normal(size=(b, f, r, r)).astype(np.float32)
    targets = (rng.random((b, f, r, r)) < 0.5).astype(np.float32)
    valid = np.array([[True, True, False, False], [True, False, False, False]])
    got = losses.mask_loss(logits, targets, valid)["loss_mask"].numpy()
    expected = np_bce(targets, logits)[valid].mean()
    np.testing.assert_allclose(got, expected, rtol=1e-5)
    # What padded slots hold does not matter.
    logits[~valid] = 1e3
    np.testing.assert_allclose(losses.mask_loss(logits, targets, valid)["loss_mask"].numpy(), expected, rtol=1e-5)


def test_mask_loss_without_foreground_is_zero():
    logits = tf.Variable(tf.ones([1, 3, 4, 4]))
    with tf.GradientTape() as tape:
        loss = losses.mask_loss(logits, tf.zeros([1, 3, 4, 4]), tf.zeros([1, 3], tf.bool))["loss_mask"]
    assert float(loss) == 0.0 and tape.gradient(loss, logits) is not None


def test_l2_counts_kernels_only():
    model = keras.Sequential([
        keras.Input((8, 8, 3)),
        keras.layers.Conv2D(4, 3, name="conv"),
        keras.layers.BatchNormalization(name="bn"),
        keras.layers.Flatten(),
        keras.layers.Dense(2, name="fc"),
    ])
    decayed = sorted(v.path.split("/", 1)[1] for v in model.weights if losses.is_decayed(v))
    assert decayed == ["conv/kernel", "fc/kernel"]
    expected = 1e-2 * sum(0.5 * np.sum(np.square(v.numpy())) for v in model.weights if v.path.endswith("kernel"))
    got = losses.l2_loss(model.trainable_variables, 1e-2)["loss_l2"].numpy()
    np.testing.assert_allclose(got, expected, rtol=1e-5)


def test_l2_gradients_are_the_l2_losss_added_once_each_kernels_gradient_exists():
    model = keras.Sequential([keras.Input((8, 8, 3)), keras.layers.Conv2D(4, 3, name="conv"),
                              keras.layers.Flatten(), keras.layers.Dense(2, name="fc")])
    variables = model.trainable_variables
    rng = np.random.default_rng(0)
    others = [tf.constant(rng.normal(size=v.shape), tf.float32) for v in variables]
    with tf.GradientTape() as tape:
        scaled = losses.l2_loss(variables, 1e-2)["loss_l2"] * 8.0
    l2_gradients = tape.gradient(scaled, variables)
    want = [g + d if d is not None else g for g, d in zip(others, l2_gradients)]

    @tf.function
    def add(gradients):
        gradients = [tf.identity(g) for g in gradients]  # an op's outputs, as a tape's gradients are
        return losses.add_l2_gradients(variables, gradients, 1e-2, 8.0)

    for v, got, expected in zip(variables, add(others), want):
        np.testing.assert_allclose(got.numpy(), expected.numpy(), rtol=1e-6, err_msg=v.path)
    graph = add.get_concrete_function(others).graph
    # Each kernel's decay waits for its gradient (not made at the start of the backward pass and held).
    decays = [op for op in graph.get_operations() if op.type == "Mul"]
    assert len(decays) == 2
    # (TensorFlow puts the control input on the variable's read, which the product takes as its input.)
    assert [[c.name for c in op.inputs[0].op.control_inputs] for op in decays] == [["Identity"], ["Identity_2"]]
    # A kernel without another gradient gets the L2 loss's alone; a bias without one stays without.
    alone = losses.add_l2_gradients(variables, [None, None, others[2], None], 1e-2, 8.0)
    np.testing.assert_allclose(alone[0].numpy(), l2_gradients[0].numpy(), rtol=1e-6)
    assert alone[1] is None and alone[3] is None
