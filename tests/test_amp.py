"""Mixed precision: which policy --amp / --amp_dtype pick on each device, and training under float16 loss
scaling (run on the CPU, as on a GPU): the unscaled update, skipped overflow steps, a diverged run, and
resuming a model_dir with --amp switched on or off."""

import keras
import numpy as np
import pytest
import tensorflow as tf

from mrcnn_tf2 import devices
from mrcnn_tf2.runtime import precision
from mrcnn_tf2.runtime import train as train_runtime
from mrcnn_tf2.status import FAILURE
from tests.support import equally_weighted_config, read_log, small_config, synthetic_batch, trainer_for


@pytest.fixture(autouse=True)
def float32_after():
    yield
    keras.mixed_precision.set_global_policy("float32")


@pytest.mark.parametrize("flags, expected", [("fpu avx2 fma", False), ("avx2 avx512f avx512_bf16", True),
                                             ("avx2 amx_bf16 amx_tile", True)])
def test_bfloat16_instructions_are_read_from_cpuinfo(tmp_path, flags, expected):
    cpuinfo = tmp_path / "cpuinfo"
    cpuinfo.write_text(f"processor\t: 0\nflags\t\t: {flags}\n")
    assert precision.cpu_has_bfloat16(str(cpuinfo)) is expected
    assert precision.cpu_has_bfloat16(str(tmp_path / "missing")) is None


# bfloat16's speed over float32's in a matrix product: the EPYC of docs/PERFORMANCE.md, the Xeon without AMX.
FAST, SLOW = 1.74, 0.56


@pytest.mark.parametrize("amp, amp_dtype, gpu, has_bfloat16, speedup, expected", [
    (False, "auto", True, True, FAST, "float32"),
    (False, "float16", False, True, FAST, "float32"),
    (True, "auto", True, False, SLOW, "mixed_float16"),
    (True, "auto", False, True, FAST, "mixed_bfloat16"),
    (True, "auto", False, True, SLOW, "float32"),
    (True, "auto", False, None, FAST, "mixed_bfloat16"),
    (True, "auto", False, None, SLOW, "float32"),
    (True, "auto", False, False, FAST, "float32"),
    (True, "float16", False, False, SLOW, "mixed_float16"),
    (True, "bfloat16", True, False, SLOW, "mixed_bfloat16"),
    (True, "bfloat16", False, True, SLOW, "mixed_bfloat16"),
])
def test_amp_dtype_picks_the_policy_by_device_and_speed(monkeypatch, capsys, amp, amp_dtype, gpu, has_bfloat16,
                                                       speedup, expected):
    monkeypatch.setenv(devices.FAKE_GPU_ENV, "1" if gpu else "0")
    monkeypatch.setattr(precision, "cpu_has_bfloat16", lambda: has_bfloat16)
    measured = []
    monkeypatch.setattr(precision, "bfloat16_speedup", lambda: measured.append(speedup) or speedup)
    assert precision.set_precision(amp, amp_dtype) == expected
    assert keras.mixed_precision.global_policy().name == expected
    # Only auto on a CPU measures, where it has (or may have) the instructions, and only auto falls back to
    # float32, saying why.
    assert len(measured) == (amp and amp_dtype == "auto" and not gpu and has_bfloat16 is not False)
    err = capsys.readouterr().err
    assert ("--amp is ignored" in err) == (amp and expected == "float32")
    if measured and expected == "float32":
        assert f"bfloat16 at {SLOW:.2f}x its float32 speed" in err
    if has_bfloat16 is False and expected == "float32":
        assert "no bfloat16 instructions" in err


class FakeWorld:
    """A rank of a job whose chief decided `decision` (`World.broadcast_object` sends rank 0's object)."""

    def __init__(self, rank, decision):
        self.rank, self.is_chief, self.decision = rank, rank == 0, decision

    def broadcast_object(self, obj):
        assert (obj is None) == (not self.is_chief)  # only the chief measures
        return self.decision


@pytest.mark.parametrize("decision, expected", [(("bfloat16", None), "mixed_bfloat16"),
                                                ((None, "rank 0 measured 0.56x"), "float32")])
def test_rank_0_decides_amps_dtype_for_every_rank(monkeypatch, capsys, decision, expected):
    monkeypatch.setenv(devices.FAKE_GPU_ENV, "0")
    monkeypatch.setattr(precision, "bfloat16_speedup", lambda: pytest.fail("only rank 0 measures"))
    assert precision.set_precision(True, "auto", FakeWorld(1, decision)) == expected
    assert capsys.readouterr().err == ""  # rank 0 warns, once for the job
    monkeypatch.setattr(precision, "bfloat16_speedup", lambda: FAST)
    monkeypatch.setattr(precision, "cpu_has_bfloat16", lambda: True)
    assert precision.set_precision(True, "auto", FakeWorld(0, decision)) == expected


def test_bfloat16_speedup_is_float32s_best_time_over_bfloat16s(monkeypatch):
    """Timed on a fake clock that each product advances: the first of each dtype is slow (oneDNN compiles its
    kernel then), float32's later products take 3 ticks or 5, bfloat16's 2."""
    clock = [0.0]
    durations = {tf.float32: [100.0, 5.0, 3.0, 5.0], tf.bfloat16: [100.0, 2.0, 2.0, 2.0]}

    def matmul(a, b):
        clock[0] += durations[a.dtype].pop(0)
        return a

    monkeypatch.setattr(precision.tf.linalg, "matmul", matmul)
    monkeypatch.setattr(precision, "time", type("Clock", (), {"perf_counter": staticmethod(lambda: clock[0])}))
    assert precision.bfloat16_speedup(size=8, rounds=4) == 1.5
    assert not any(durations.values())  # `rounds` products of each


def test_fake_gpu_env_is_checked(monkeypatch):
    monkeypatch.setenv(devices.FAKE_GPU_ENV, "yes")
    with pytest.raises(ValueError, match="MRCNN_TF2_FAKE_GPU='yes': must be 0 or 1"):
        devices.run_device()


def float16_config(**train):
    config = equally_weighted_config()
    config.runtime.amp, config.runtime.amp_dtype = True, "float16"
    for key, value in train.items():
        setattr(config.train, key, value)
    return config


def first_update(config, batch, initial):
    """The weight change of one update from `initial` weights (plain SGD, lr 0.5, no warm-up)."""
    trainer = trainer_for(config)
    trainer.build()
    for target, source in zip(trainer.model.weights, initial):
        target.assign(source)
    before = [v.numpy() for v in trainer.model.trainable_variables]
    _, skipped = trainer.update_function()([batch])
    assert int(skipped) == 0
    return trainer, [v.numpy() - b for v, b in zip(trainer.model.trainable_variables, before)]


def test_float16_update_is_unscaled_to_the_float32_update():
    """The LossScaleOptimizer's gradients are 2**15 times the loss's: the update applied must be the float32
    one, up to float16 rounding of the forward and backward passes."""
    batch = synthetic_batch(small_config())
    rates = dict(init_learning_rate=0.5, momentum=0.0, warmup_min_steps=0)
    reference = equally_weighted_config()
    vars(reference.train).update(rates)
    trainer32 = trainer_for(reference)
    trainer32.build()
    initial = [v.numpy() for v in trainer32.model.weights]
    _, update32 = first_update(reference, batch, initial)
    trainer16, update16 = first_update(float16_config(**rates), batch, initial)
    assert trainer16.policy == "mixed_float16" and trainer16.loss_scaled
    assert float(trainer16.optimizer.dynamic_scale) == train_runtime.INITIAL_LOSS_SCALE
    flat32 = np.concatenate([u.ravel() for u in update32])
    flat16 = np.concatenate([u.ravel() for u in update16])
    norm32 = np.linalg.norm(flat32)
    assert norm32 > 1e-3  # the update moved the weights
    assert np.linalg.norm(flat16) == pytest.approx(norm32, rel=0.02)
    assert np.linalg.norm(flat16 - flat32) < 0.05 * norm32


def test_overflow_step_is_skipped_counted_and_counters_agree():
    """A loss scale so large that the float16 gradients overflow: the update is skipped (weights and
    momentum unchanged), the scale halves, and step, optimizer iterations and the schedule move on together."""
    batch = synthetic_batch(small_config())
    trainer = trainer_for(float16_config(warmup_min_steps=0))
    trainer.build()
    update = trainer.update_function()
    update([batch])
    weights = [v.numpy() for v in trainer.model.trainable_variables]
    slots = [v.numpy() for v in trainer.sgd.variables]
    trainer.optimizer.dynamic_scale.assign(2.0 ** 60)
    losses, skipped = update([batch])
    assert int(skipped) == 1 and np.isfinite(float(losses["loss_total"]))
    for before, variable in zip(weights, trainer.model.trainable_variables):
        np.testing.assert_array_equal(variable.numpy(), before, err_msg=variable.path)
    iterations = int(trainer.sgd.iterations.numpy())
    for before, variable in zip(slots, trainer.sgd.variables):
        if variable is not trainer.sgd.iterations:
            np.testing.assert_array_equal(variable.numpy(), before, err_msg=variable.path)
    assert float(trainer.optimizer.dynamic_scale) == 2.0 ** 59
    assert int(trainer.step.numpy()) == iterations == 2 and int(trainer.skipped_steps.numpy()) == 1
    trainer.optimizer.dynamic_scale.assign(train_runtime.INITIAL_LOSS_SCALE)
    _, skipped = update([batch])
    assert int(skipped) == 0
    assert int(trainer.step.numpy()) == int(trainer.sgd.iterations.numpy()) == 3
    assert int(trainer.skipped_steps.numpy()) == 1
    assert any(not np.array_equal(v.numpy(), w) for v, w in zip(trainer.model.trainable_variables, weights))


def run_config(tmp_path, data_dir, steps, amp_dtype=None, **train):
    """The small model's training run of one epoch of `steps` steps, logging each, without a warm-up floor."""
    config = small_config()
    # float16 on a CPU runs the mask head's transposed-conv kernel gradient through Eigen's emulated half
    # precision: at SMALL_FLAGS' 256 filters two steps took 29 s, at 32 filters 14 s.
    config.model.mrcnn_head_num_filters = 32
    config.data.data_dir = data_dir
    config.runtime.model_dir = str(tmp_path)
    config.runtime.log_every = 1
    config.train.steps_per_epoch = steps
    config.train.epochs = 1
    config.train.warmup_min_steps = 0
    if amp_dtype is not None:
        config.runtime.amp, config.runtime.amp_dtype = True, amp_dtype
    for key, value in train.items():
        setattr(config.train, key, value)
    return config


def test_skipped_steps_are_logged_and_the_run_goes_on(tmp_path, shapes_records, monkeypatch, capsys):
    # 2**22 overflows the first step's float16 gradients; each skip halves it until they fit.
    monkeypatch.setattr(train_runtime, "INITIAL_LOSS_SCALE", 2.0 ** 22)
    config = run_config(tmp_path, shapes_records["data_dir"], 6, "float16")
    trainer = train_runtime.Trainer(config)
    assert trainer.run() == 0
    log = read_log(tmp_path / "log.jsonl")
    skipped = [r["step"] for r in log if r["event"] == "skipped"]
    assert 1 in skipped and len(skipped) < 6, skipped
    metrics = [r for r in log if r["event"] == "metrics"]
    assert [m["skipped_steps"] for m in metrics] == [sum(s <= step for s in skipped) for step in range(1, 7)]
    assert metrics[0]["amp_loss_scale"] == 2.0 ** 21
    assert [r for r in log if r["event"] == "done"][0]["skipped_steps"] == len(skipped)
    assert int(trainer.sgd.iterations.numpy()) == int(trainer.step.numpy()) == 6
    # The learning rate logged is the schedule at the iterations it was applied at: step - 1.
    assert [m["learning_rate"] for m in metrics] == pytest.approx([float(trainer.schedule(s)) for s in range(6)])
    assert f"({len(skipped)} steps skipped)" in capsys.readouterr().out


def test_non_finite_loss_stops_a_float16_run(tmp_path, shapes_records):
    """A loss that is itself infinite is no overflow of the loss scaling: the run stops as in float32."""
    config = run_config(tmp_path, shapes_records["data_dir"], 50, "float16", init_learning_rate=1e3,
                        learning_rate_values=(1e3,), learning_rate_boundaries=(0.0,))
    config.runtime.checkpoint_every = 1
    assert train_runtime.Trainer(config).run() == FAILURE
    log = read_log(tmp_path / "log.jsonl")
    (stopped,) = [r for r in log if r["event"] == "stopped"]
    failed_step = int(stopped["reason"].split("non-finite loss at step ")[1].split()[0])
    assert failed_step < 50
    assert tf.train.latest_checkpoint(str(tmp_path)).endswith(f"ckpt-{failed_step - 1}")


def resumed(tmp_path, data_dir, steps, amp_dtype, before, fresh_scale=False):
    """A Trainer of `steps` steps under `amp_dtype` on the model directory that `before` (a Trainer that ran, or
    None) trained: it restores `before`'s weights, momentum and iterations (and, with `fresh_scale`, starts the
    loss scale anew), then runs to `steps`."""
    trainer = train_runtime.Trainer(run_config(tmp_path, data_dir, steps, amp_dtype))
    if before is not None:
        logger = train_runtime.RunLogger(str(tmp_path / "resume.jsonl"))
        done = int(before.step.numpy())
        assert trainer._restore_or_initialise(logger) == done
        logger.close()
        for variable, value in zip(trainer.model.weights, before.model.weights):
            np.testing.assert_array_equal(variable.numpy(), value.numpy(), err_msg=variable.path)
        for variable, value in zip(trainer.sgd.variables, before.sgd.variables):
            np.testing.assert_array_equal(variable.numpy(), value.numpy(), err_msg=variable.path)
        assert int(trainer.sgd.iterations.numpy()) == done
        if fresh_scale:
            assert float(trainer.optimizer.dynamic_scale) == train_runtime.INITIAL_LOSS_SCALE
            assert int(trainer.optimizer.step_counter.numpy()) == 0
    assert trainer.run() == 0
    assert int(trainer.step.numpy()) == int(trainer.sgd.iterations.numpy()) == steps
    return trainer


@pytest.mark.timeout(300)  # four float16 or float32 runs of the small model on one model directory
def test_resume_with_amp_switched(tmp_path, shapes_records, capsys):
    """A model_dir trained without, then with float16 loss scaling, then without and with again, resumes at each
    switch: weights, step, iterations and schedule kept; the loss scale starts fresh where it did not exist, and
    the scale the float16 run left is carried through the float32 run after it."""
    data_dir = shapes_records["data_dir"]
    first = resumed(tmp_path, data_dir, 2, None, None)
    scaled = resumed(tmp_path, data_dir, 4, "float16", first, fresh_scale=True)
    unscaled = resumed(tmp_path, data_dir, 6, None, scaled)
    again = resumed(tmp_path, data_dir, 8, "float16", unscaled)
    assert float(again.optimizer.dynamic_scale) == float(scaled.optimizer.dynamic_scale)
    assert [r["step"] for r in read_log(tmp_path / "log.jsonl") if r["event"] == "resumed"] == [2, 4, 6]
    assert "unreadable" not in capsys.readouterr().err
