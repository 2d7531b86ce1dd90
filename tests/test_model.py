"""The whole MaskRCNN at 128x128 with ResNet-18: losses, gradients, inference outputs, overfitting, policies."""

import keras
import numpy as np
import pytest
import tensorflow as tf

from mrcnn_tf2.model.factory import build_model
from tests.support import small_config, synthetic_batch

LOSS_KEYS = {"loss_rpn_score", "loss_rpn_box", "loss_fast_rcnn_class", "loss_fast_rcnn_box", "loss_mask",
             "loss_l2", "loss_total"}


@pytest.fixture(scope="module")
def config():
    return small_config()


@pytest.fixture(scope="module")
def batch(config):
    return synthetic_batch(config)


def compiled_model(config, learning_rate=0.01, optimizer=None):
    keras.utils.set_random_seed(0)
    model = build_model(config)
    model.compile(optimizer=optimizer or keras.optimizers.SGD(learning_rate, momentum=0.9))
    return model


def test_train_step_gives_every_loss_finite(config, batch):
    model = compiled_model(config)
    losses = model.train_step(batch)
    assert set(losses) == LOSS_KEYS
    for name, value in losses.items():
        assert value.dtype == tf.float32 and value.shape == () and np.isfinite(value.numpy()), name
    parts = sum(float(v) for k, v in losses.items() if k != "loss_total")
    assert float(losses["loss_total"]) == pytest.approx(parts, rel=1e-5)


def test_gradients_reach_every_trainable_variable_and_no_frozen_one(config, batch):
    model = compiled_model(config)
    model.build()  # every layer built
    frozen = [v for v in model.variables if not v.trainable]
    trainable = model.trainable_variables
    # The stem and first group are frozen, like every batch norm: their weights must not be trained.
    assert any("conv1" in v.path for v in frozen) and any("bn" in v.path or "batch" in v.path for v in frozen)
    assert not {id(v) for v in frozen} & {id(v) for v in trainable}
    with tf.GradientTape() as tape:
        losses = model.compute_losses(batch, model.forward_train(batch, training=True))
    grads = tape.gradient(losses["loss_total"], trainable)
    missing = [v.path for v, g in zip(trainable, grads) if g is None or not np.any(g.numpy())]
    assert not missing


def test_inference_outputs(config, batch):
    model = compiled_model(config)
    out = model.predict_step(batch)
    detections = config.model.test.test_detections_per_image
    assert out["detection_boxes"].shape == (2, detections, 4)
    assert out["detection_scores"].shape == (2, detections)
    assert out["detection_classes"].shape == (2, detections) and out["detection_classes"].dtype == tf.int32
    assert out["detection_masks"].shape == (2, detections, 28, 28)
    assert out["num_detections"].shape == (2,)
    count = out["num_detections"].numpy()
    classes = out["detection_classes"].numpy()
    for b in range(2):
        assert (classes[b, :count[b]] >= 1).all() and (classes[b, count[b]:] == 0).all()
        # Boxes are mapped to the original image (image_info scale 0.5 of a 128x128 input -> 64x64).
        assert (out["detection_boxes"].numpy()[b, :count[b]] <= 64 + 1e-3).all()
    masks = out["detection_masks"].numpy()
    assert ((masks >= 0) & (masks <= 1)).all()
    np.testing.assert_array_equal(out["source_ids"].numpy(), [0, 1])


def test_overfitting_one_batch_halves_the_loss(config, batch):
    model = compiled_model(config, learning_rate=0.005)
    # As main.py's step: every variable made first and no autograph, so one trace (not two, after autograph had
    # converted every function the step calls), and the same losses.
    model.build()
    model.optimizer.build(model.trainable_variables)
    step = tf.function(model.train_step, autograph=False)
    totals = [float(step(batch)["loss_total"]) for _ in range(50)]
    # RoI sampling is random at every step: compare the first loss with the mean of the last five.
    assert np.mean(totals[-5:]) < 0.5 * totals[0], totals


def test_fit_and_evaluate_run_on_a_dataset(config, batch):
    model = compiled_model(config)
    dataset = tf.data.Dataset.from_tensors(batch).repeat()
    history = model.fit(dataset, steps_per_epoch=2, epochs=1, verbose=0)
    assert np.isfinite(history.history["loss_total"]).all()
    results = model.evaluate(dataset, steps=1, verbose=0, return_dict=True)
    assert LOSS_KEYS <= set(results)


@pytest.mark.parametrize("policy", ["mixed_bfloat16", "mixed_float16"])
def test_mixed_precision_policies_train(config, batch, policy):
    keras.mixed_precision.set_global_policy(policy)
    try:
        optimizer = keras.optimizers.SGD(0.01, momentum=0.9)
        if policy == "mixed_float16":
            optimizer = keras.optimizers.LossScaleOptimizer(optimizer)
        model = compiled_model(config, optimizer=optimizer)
        losses = model.train_step(batch)
        assert all(np.isfinite(v.numpy()) for v in losses.values())
        assert model.backbone.compute_dtype == policy.removeprefix("mixed_")
        assert all(v.dtype == "float32" for v in model.trainable_variables)
    finally:
        keras.mixed_precision.set_global_policy("float32")


def test_checkpoint_holds_every_weight_and_restores_predictions(config, batch, tmp_path):
    model = compiled_model(config)
    model.build()
    prefix = tf.train.Checkpoint(model=model).write(str(tmp_path / "ckpt"))
    # Every weight is saved (the compiled optimizer rides along under model/optimizer).
    saved = [name for name, _ in tf.train.list_variables(prefix)
             if name.startswith("model/") and not name.startswith("model/optimizer/")]
    assert len(saved) == len(model.weights)
    keras.utils.set_random_seed(1)  # different initial weights
    restored = build_model(config)
    restored.build()
    tf.train.Checkpoint(model=restored).read(prefix).assert_existing_objects_matched()
    for a, b in zip(model.weights, restored.weights):
        np.testing.assert_array_equal(a.numpy(), b.numpy(), err_msg=a.path)
    np.testing.assert_array_equal(model.predict_step(batch)["detection_scores"].numpy(),
                                  restored.predict_step(batch)["detection_scores"].numpy())


def xla_step(batch, xla):
    """(model, losses, gradients, detection scores): a train step's and a predict step's, --xla on or off."""
    config = small_config()
    config.runtime.xla = xla
    keras.utils.set_random_seed(0)
    model = build_model(config)
    model.compile(optimizer=keras.optimizers.SGD(0.01, momentum=0.9))
    model.build()  # every layer built: later calls take the compiled path
    keras.utils.set_random_seed(1)  # the same RoI sampling draws in both runs
    losses, grads = model.compute_gradients(batch)
    detections = model.predict_step(batch)
    return (model, {k: float(v) for k, v in losses.items()}, [tf.convert_to_tensor(g).numpy() for g in grads],
            detections["detection_scores"].numpy())


@pytest.mark.onednn  # XLA's kernels against oneDNN's or TensorFlow's
def test_xla_compiles_the_dense_layers_and_gives_the_same_step(batch, monkeypatch):
    # Both runs on the same conv route: Winograd's (off under XLA) rounds differently, which can flip a
    # sampled RoI (seen on an AVX2 CPU); Winograd has its own tests against tf.nn.conv2d.
    from mrcnn_tf2.ops import conv as conv_ops

    monkeypatch.setattr(conv_ops, "WINOGRAD_MIN_TILES", 2 ** 62)
    results = {}
    for xla in (False, True):
        model, *results[xla] = xla_step(batch, xla)
        compiled = {(name, training) for name in ("backbone", "fpn", "rpn_head", "box_head", "mask_head")
                    for training in (True, False) if (id(getattr(model, name)), training) in model._compiled_layers}
        assert len(compiled) == (10 if xla else 0), compiled
    (losses, grads, scores), (xla_losses, xla_grads, xla_scores) = results[False], results[True]
    for name in losses:
        assert xla_losses[name] == pytest.approx(losses[name], rel=1e-3, abs=1e-4), name
    for got, want in zip(xla_grads, grads):
        np.testing.assert_allclose(got, want, rtol=1e-2, atol=1e-3 * max(1.0, np.abs(want).max()))
    np.testing.assert_allclose(xla_scores, scores, atol=1e-3)
