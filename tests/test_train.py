"""`main.py train`: schedule, accumulation, non-finite losses, resume after SIGKILL, the stop on SIGTERM or SIGINT,
corrupt checkpoints, benchmark, evaluation during training and the early stop at the target APs."""

import fcntl
import json
import math
import os
import select
import shutil
import signal
import subprocess
import termios
import time
import types

import keras
import numpy as np
import pytest
import tensorflow as tf

import main
from mrcnn_tf2.arguments import parse
from mrcnn_tf2.config import Config, ConfigError
from mrcnn_tf2.model.factory import choose_ops
from mrcnn_tf2.runtime import evaluate as evaluate_runtime
from mrcnn_tf2.runtime import train as train_runtime
from mrcnn_tf2.runtime.evaluate import (BEST_DIR, BEST_FILE, RESULTS_FILE, TRAINING_RESULTS_FILE, TrainingEvaluator,
                                        targets_reached)
from mrcnn_tf2.runtime.predictor import load_model
from mrcnn_tf2.runtime.schedule import WarmupCosine, WarmupPiecewiseConstant, learning_rate_schedule
from mrcnn_tf2.runtime.weight_average import WeightAverage
from mrcnn_tf2.status import FAILURE
from tests.support import (ROOT, SMALL_FLAGS, TRAINED_STEPS, combined_batch, equally_weighted_config, file_size_limit,
                           lines_until, main_py, read_log, run_main, small_config, synthetic_batch, trainer_for)


def test_schedule_warms_up_linearly_then_steps_at_the_boundaries():
    schedule = WarmupPiecewiseConstant(0.01, [10, 50, 80], [0.1, 0.02, 0.005])
    rates = {step: float(schedule(step)) for step in (0, 5, 9, 10, 49, 50, 79, 80, 10_000)}
    assert rates[0] == pytest.approx(0.01)
    assert rates[5] == pytest.approx(0.055)
    assert rates[9] == pytest.approx(0.091)
    assert rates[10] == rates[49] == pytest.approx(0.1)
    assert rates[50] == rates[79] == pytest.approx(0.02)
    assert rates[80] == rates[10_000] == pytest.approx(0.005)


def test_schedule_from_config_scales_rates_linearly_with_the_global_batch_and_epochs_to_steps():
    train = Config().train  # 1e-2, 1e-3, 1e-4 at a global batch of 8; boundaries 0.3, 8, 10 epochs
    train.warmup_min_steps = 0
    schedule = learning_rate_schedule(train, steps_per_epoch=100, global_batch_size=16)
    assert schedule.boundaries == [30, 800, 1000]
    assert schedule.values == pytest.approx([0.02, 0.002, 0.0002])
    assert float(schedule(15)) == pytest.approx(0.01)
    assert learning_rate_schedule(train, 100, 2).values == pytest.approx([0.0025, 0.00025, 0.000025])


def test_warmup_lasts_at_least_warmup_min_steps_but_ends_at_the_second_boundary():
    train = Config().train  # warmup_min_steps 500
    assert learning_rate_schedule(train, steps_per_epoch=100, global_batch_size=8).boundaries == [500, 800, 1000]
    assert learning_rate_schedule(train, steps_per_epoch=1000, global_batch_size=8).boundaries[0] == 500
    assert learning_rate_schedule(train, steps_per_epoch=10_000, global_batch_size=8).boundaries[0] == 3000
    short = learning_rate_schedule(train, steps_per_epoch=50, global_batch_size=8)
    assert short.boundaries == [400, 400, 500]
    assert float(short(200)) == pytest.approx(0.005) and float(short(400)) == pytest.approx(0.001)


def test_cosine_schedule_warms_up_then_decays_as_half_a_cosine_to_the_last_value_at_the_runs_end():
    schedule = WarmupCosine(0.01, 10, 110, 0.1, 0.002)
    assert [float(schedule(step)) for step in (0, 5, 10)] == pytest.approx([0.01, 0.055, 0.1])
    for step in (10, 35, 60, 85, 110):  # a quarter, a half, three quarters of the way
        expected = 0.002 + 0.049 * (1 + math.cos(math.pi * (step - 10) / 100))
        assert float(schedule(step)) == pytest.approx(expected, rel=1e-6)
    assert float(schedule(60)) == pytest.approx(0.051)
    assert float(schedule(110)) == float(schedule(10_000)) == pytest.approx(0.002)
    rates = [float(schedule(step)) for step in range(10, 111)]
    assert all(b < a for a, b in zip(rates, rates[1:]))

    train = Config().train  # epochs 12; 1e-2 ... 1e-4 at a global batch of 8; warm-up 0.3 epochs, at least 500
    train.learning_rate_schedule = "cosine"
    schedule = learning_rate_schedule(train, steps_per_epoch=100, global_batch_size=16)
    assert isinstance(schedule, WarmupCosine) and schedule.boundaries == [500] and schedule.total_steps == 1200
    assert schedule.values == pytest.approx([0.02, 0.0002])  # the first and last values, scaled to the batch
    assert float(schedule(250)) == pytest.approx(0.01) and float(schedule(850)) == pytest.approx(0.0101)
    assert float(learning_rate_schedule(train, 3, 16, constant=True)(700)) == pytest.approx(0.002)


def test_benchmark_schedule_is_a_tenth_of_the_rate_after_warmup_at_every_step():
    schedule = learning_rate_schedule(Config().train, steps_per_epoch=3, global_batch_size=2, constant=True)
    assert [float(schedule(step)) for step in (0, 1, 499, 10_000)] == pytest.approx([0.00025] * 4)


def test_build_creates_every_variable_from_shapes_alone_and_runs_nothing():
    _, config = parse(["train", *SMALL_FLAGS])  # from scratch: batch norm trains and updates its averages
    trainer = trainer_for(config)
    trainer.build()
    built = [variable.path for variable in trainer.model.variables]
    means = [v for v in trainer.model.variables if v.path.endswith("moving_mean")]
    variances = [v for v in trainer.model.variables if v.path.endswith("moving_variance")]
    # Nothing ran: a pass in training mode would have moved the averages from their initial values.
    assert means and all(not np.any(v.numpy()) for v in means)
    assert variances and all(np.all(v.numpy() == 1.0) for v in variances)
    trainer.update_function()([synthetic_batch(config)])
    assert [variable.path for variable in trainer.model.variables] == built  # the step's trace created none
    assert all(np.any(v.numpy()) for v in means)


def test_the_weight_average_moves_by_its_ramped_decay_and_copies_the_other_variables():
    def model(units=2):
        return keras.Sequential([keras.Input((3,)), keras.layers.Dense(units), keras.layers.BatchNormalization()])

    live, shadow = model(), model()
    average = WeightAverage(live, shadow, decay=0.5)
    average.reset()
    expected = [v.numpy() for v in live.trainable_variables]
    rng = np.random.default_rng(0)
    for n in range(1, 12):  # the ramp (1 + n) / (10 + n) reaches the decay 0.5 at n = 8
        for variable in live.variables:
            variable.assign(rng.normal(size=variable.shape))
        average.update(tf.constant(n, tf.int64))
        decay = min(0.5, (1 + n) / (10 + n))
        expected = [decay * e + (1 - decay) * v.numpy() for e, v in zip(expected, live.trainable_variables)]
        for kept, wanted in zip(shadow.trainable_variables, expected):
            np.testing.assert_allclose(kept.numpy(), wanted, rtol=1e-6, atol=1e-6)
        for copy, variable in zip(shadow.non_trainable_variables, live.non_trainable_variables):
            np.testing.assert_array_equal(copy.numpy(), variable.numpy())  # batch norm's moving statistics
    with pytest.raises(ValueError, match="does not fit the model's"):
        WeightAverage(live, model(units=4), decay=0.5)


def test_a_run_keeping_a_weight_average_evaluates_infers_and_fine_tunes_from_it(tmp_path, capsys):
    """train.ema_decay: the update moves the average (a second model), training's evaluation runs it, the
    checkpoint holds it for load_model (eval, infer, export) and --init_checkpoint, and a resumed run must keep it;
    eval.use_ema false evaluates and loads the last step's weights instead."""
    def weights(model):
        return [v.numpy() for v in model.trainable_variables]

    _, config = parse(["train", *SMALL_FLAGS, "--model_dir", str(tmp_path / "run"),
                       "--config_override", "train.ema_decay=0.5"])
    config.train.init_learning_rate = 0.005  # the warm-up starts here: step 0 must move the weights
    trainer = trainer_for(config)  # from scratch: batch norm's statistics move too
    logger = train_runtime.RunLogger(os.devnull, verbose=False)
    assert trainer._restore_or_initialise(logger) == 0
    expected = weights(trainer.model)
    assert all(np.array_equal(a, w) for a, w in zip(weights(trainer.shadow), expected))  # a new run starts there
    update, batch = trainer.update_function(), synthetic_batch(config)
    for n in (1, 2):
        update([batch])
        decay = (1 + n) / (10 + n)  # below 0.5
        expected = [decay * e + (1 - decay) * w for e, w in zip(expected, weights(trainer.model))]
    for kept, wanted in zip(weights(trainer.shadow), expected):
        np.testing.assert_allclose(kept, wanted, rtol=1e-5, atol=1e-7)
    assert not all(np.array_equal(a, w) for a, w in zip(weights(trainer.shadow), weights(trainer.model)))
    for copy, variable in zip(trainer.shadow.non_trainable_variables, trainer.model.non_trainable_variables):
        np.testing.assert_array_equal(copy.numpy(), variable.numpy())

    evaluated = []
    evaluator = types.SimpleNamespace(evaluate=lambda model, *_, **__: evaluated.append(model) or False)
    assert trainer._evaluate(evaluator, 2, logger, types.SimpleNamespace(signum=0)) == (False, 0)
    assert evaluated == [trainer.shadow]
    trainer.keeper.save(2)
    loaded = load_model(config)
    assert all(np.array_equal(a, w) for a, w in zip(weights(loaded.model), weights(trainer.shadow)))
    assert loaded.averaged and "[model] weights: the moving average training kept (train.ema_decay) in " \
        f"{loaded.checkpoint}" in capsys.readouterr().out
    # The last step's weights instead, in training's evaluations and load_model.
    trainer.config.eval.use_ema = config.eval.use_ema = False
    assert trainer._evaluate(evaluator, 2, logger, types.SimpleNamespace(signum=0)) == (False, 0)
    assert evaluated == [trainer.shadow, trainer.model]
    raw = load_model(config)
    assert all(np.array_equal(a, w) for a, w in zip(weights(raw.model), weights(trainer.model)))
    assert not raw.averaged and "[model] weights: the last step's, not the moving average training kept " \
        f"(eval.use_ema false) in {raw.checkpoint}" in capsys.readouterr().out
    config.eval.use_ema = True

    _, tune = parse(["train", *SMALL_FLAGS, "--model_dir", str(tmp_path / "tune"),
                     "--init_checkpoint", str(tmp_path / "run")])
    tuner = trainer_for(tune)
    tuner._restore_or_initialise(logger)
    assert tuner.shadow is None and f"loaded {len(tuner.model.variables)} model variables (its run's moving average" \
        " of them)" in capsys.readouterr().out
    # All of them: the fine-tuning run freezes batch norm and the first blocks (counted as pretrained).
    assert all(np.array_equal(a.numpy(), w.numpy()) for a, w in zip(tuner.model.variables, trainer.shadow.variables))

    config.train.ema_decay = None
    with pytest.raises(ConfigError, match=r"train.ema_decay: .*ckpt-2 holds an average of the weights and this run "
                                          r"keeps none \(ema_decay None\): a run keeps the average"):
        trainer_for(config)._restore_or_initialise(logger)


def test_accumulated_update_equals_one_update_on_the_larger_batch():
    # One object in each image, so that both images sample as many RoIs (see below).
    batch = combined_batch()
    halves = [tf.nest.map_structure(lambda t, i=i: t[i:i + 1], batch) for i in range(2)]
    trainers = []
    for batch_size, accumulate in ((2, 1), (1, 2)):
        config = equally_weighted_config()
        config.train.train_batch_size, config.train.accumulate_steps = batch_size, accumulate
        trainer = trainer_for(config)
        trainer.build()
        trainers.append(trainer)
    large, accumulated = trainers
    for source, target in zip(large.model.weights, accumulated.model.weights):
        target.assign(source)
    initial = [v.numpy() for v in large.model.trainable_variables]
    losses_large, _ = large.update_function()([batch])
    losses_accumulated, _ = accumulated.update_function()(halves)
    assert float(losses_accumulated["loss_total"]) == pytest.approx(float(losses_large["loss_total"]), rel=1e-4)
    for a, b in zip(large.model.trainable_variables, accumulated.model.trainable_variables):
        np.testing.assert_allclose(b.numpy(), a.numpy(), rtol=1e-4, atol=1e-7, err_msg=a.path)
    assert any(not np.allclose(a.numpy(), before) for a, before in zip(large.model.trainable_variables, initial))
    assert int(large.step.numpy()) == int(accumulated.step.numpy()) == 1
    assert int(accumulated.optimizer.iterations.numpy()) == 1


@pytest.mark.parametrize("momentum, nesterov", [(0.9, False), (0.9, True), (0.0, False)])
def test_momentum_sgd_updates_as_keras_sgd_does_to_the_bit(momentum, nesterov):
    rng = np.random.default_rng(0)
    start = rng.normal(size=(5, 3)).astype(np.float32)
    gradients = [tf.constant(rng.normal(size=(5, 3)), tf.float32) for _ in range(3)]
    results = []
    for optimizer_class in (keras.optimizers.SGD, train_runtime.MomentumSGD):
        variable = keras.Variable(start)
        optimizer = optimizer_class(0.1, momentum=momentum, nesterov=nesterov)
        apply = tf.function(lambda g: optimizer.apply_gradients([(g, variable)]))
        for gradient in gradients:
            apply(gradient)
        results.append([variable.numpy()] + [m.numpy() for m in optimizer.momentums])
    for got, want in zip(*results):
        np.testing.assert_array_equal(got, want)
    assert not np.array_equal(results[1][0], start)


@pytest.mark.parametrize("freeze_bn", [False, True])
def test_non_finite_loss_stops_training_before_a_checkpoint(tmp_path, shapes_records, freeze_bn):
    config = small_config()
    config.data.data_dir = shapes_records["data_dir"]
    config.model.freeze_bn = freeze_bn
    config.runtime.model_dir = str(tmp_path)
    config.runtime.checkpoint_every = 1
    # A learning rate that makes the weights, then the losses, overflow within a few steps.
    config.train.init_learning_rate = 1e3
    config.train.learning_rate_values = (1e3,)
    config.train.learning_rate_boundaries = (0.0,)
    config.train.warmup_min_steps = 0
    config.train.epochs = 50
    assert train_runtime.Trainer(config).run() == FAILURE == 1  # the message names the cause
    log = read_log(tmp_path / "log.jsonl")
    (stopped,) = [r for r in log if r["event"] == "stopped"]
    failed_step = int(stopped["reason"].split("non-finite loss at step ")[1].split()[0])
    assert "loss_total=" in stopped["reason"]
    # Frozen batch norm without pretrained weights is named as the likely cause, with the flag that changes it.
    assert ("frozen (model.freeze_bn=true) without pretrained weights" in stopped["reason"]) == freeze_bn
    assert ("--finetune_bn" in stopped["reason"]) == freeze_bn
    assert ("--clip_grad_norm" in stopped["reason"]) != freeze_bn
    assert [r["step"] for r in log if r["event"] == "checkpoint"] == list(range(1, failed_step))
    assert tf.train.latest_checkpoint(str(tmp_path)).endswith(f"ckpt-{failed_step - 1}")


def start_training(model_dir, data_dir, *extra, **popen):
    """`main.py train` of the small model in a new process; `popen`: Popen's arguments (default: its output in
    one text pipe)."""
    popen = popen or dict(stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    return subprocess.Popen(
        main_py("train", "--data_dir", data_dir, "--model_dir", str(model_dir), *SMALL_FLAGS,
                "--steps_per_epoch", "4", "--epochs", "2", "--checkpoint_every", "2", "--log_every", "1", *extra),
        cwd=ROOT, **popen)


def training_flags(model_dir, data_dir):
    """`main.py train` of the small model: 2 epochs of 4 steps, a checkpoint every 2."""
    return ["train", "--data_dir", data_dir, "--model_dir", str(model_dir), *SMALL_FLAGS, "--steps_per_epoch", "4",
            "--epochs", "2", "--checkpoint_every", "2", "--log_every", "1"]


# Budget: a training process to kill, with the test's own deadline of 300 s, then the rerun.
@pytest.mark.timeout(600)
@pytest.mark.slow
def test_sigkill_then_rerun_resumes_from_the_last_checkpoint(tmp_path, shapes_records, capsys):
    # A real process, killed: what it left on disk is all the rerun has.
    process = subprocess.Popen(main_py(*training_flags(tmp_path, shapes_records["data_dir"])), cwd=ROOT,
                               stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    deadline = time.time() + 300
    # Until the `checkpoint` index names a save: its files come before it, and a kill between the two leaves
    # a run that rightly starts again from step 0 (seen once on a loaded machine).
    while tf.train.latest_checkpoint(str(tmp_path)) is None:
        assert process.poll() is None, process.stdout.read()
        assert time.time() < deadline
        time.sleep(0.2)
    process.send_signal(signal.SIGKILL)
    process.wait()
    killed_at = max(r["step"] for r in read_log(tmp_path / "log.jsonl") if r["event"] == "metrics")
    assert 2 <= killed_at < 8
    assert main.main(training_flags(tmp_path, shapes_records["data_dir"])) == 0
    log = read_log(tmp_path / "log.jsonl")
    resumed = [r for r in log if r["event"] == "resumed"]
    assert len(resumed) == 1 and resumed[0]["step"] >= 2 and resumed[0]["step"] % 2 == 0
    steps_after = [r["step"] for r in log[log.index(resumed[0]):] if r["event"] == "metrics"]
    assert steps_after == list(range(resumed[0]["step"] + 1, 9))
    # The learning rate continues the schedule: the same at a step in either run.
    rates = {}
    for record in (r for r in log if r["event"] == "metrics"):
        rates.setdefault(record["step"], set()).add(round(record["learning_rate"], 10))
    assert all(len(values) == 1 for values in rates.values())
    assert tf.train.latest_checkpoint(str(tmp_path)).endswith("ckpt-8")
    # The run saved its resolved config; rerunning with the model directory alone resumes the same run,
    # and so trains no further.
    saved = json.loads((tmp_path / "config.json").read_text())
    assert saved == [r for r in log if r["event"] == "start"][-1]["config"]
    assert saved["model"]["backbone"] == "resnet18" and saved["train"]["steps_per_epoch"] == 4
    assert not [name for name in os.listdir(tmp_path) if ".tmp" in name]
    capsys.readouterr()
    assert main.main(["train", "--model_dir", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "already trained" in out and "trained with updates of" not in out
    # Another global batch (here --train_batch_size; under a launcher, another number of workers) is said.
    assert main.main(["train", "--model_dir", str(tmp_path), "--train_batch_size", "1"]) == 0
    notice = (f"resuming {tmp_path}/ckpt-8, trained with updates of 2 images, with updates of 1 (1 worker(s) x "
              "--train_batch_size 1 x --accumulate_steps 1): the steps from here on take that many images each, and "
              "the epochs and learning rates count them (4 steps per epoch)")
    assert f"[train] {notice}\n" in capsys.readouterr().out
    assert read_log(tmp_path / "log.jsonl")[-3:-2] == [{"event": "notice", "time": pytest.approx(time.time(), abs=300),
                                                        "message": notice}]
    # eval needs only what it adds; the saved model's shape cannot be changed by a flag.
    assert main.main(["eval", "--model_dir", str(tmp_path), "--eval_file", shapes_records["val_json"],
                      "--eval_samples", "2", "--eval_batch_size", "2"]) == 0
    results = json.loads((tmp_path / "eval_results.json").read_text())
    assert results["step"] == 8 and results["num_images"] == 2
    capsys.readouterr()
    assert run_main(["eval", "--model_dir", str(tmp_path), "--backbone", "resnet34"]) == 2
    err = capsys.readouterr().err
    assert "resnet34" in err and "resnet18" in err


# Budget: a training process stopped after its second update, with the test's own deadline of 300 s.
@pytest.mark.timeout(360)
@pytest.mark.slow
def test_sigterm_stops_training_after_the_update_under_way_with_its_checkpoint(tmp_path, shapes_records):
    # No periodic checkpoint before the signal: the one the run leaves is the stop's own.
    process = start_training(tmp_path, shapes_records["data_dir"], "--steps_per_epoch", "50", "--epochs", "1",
                             "--checkpoint_every", "100")
    lines = lines_until(process, "[train] step 2/50", 300)
    process.send_signal(signal.SIGTERM)
    output = "".join(lines) + process.communicate(timeout=120)[0]
    assert process.returncode == 128 + signal.SIGTERM, output[-3000:]
    log = read_log(tmp_path / "log.jsonl")
    (stopped,) = [r for r in log if r["event"] == "stopped"]
    step = stopped["step"]
    assert 2 <= step < 50 and stopped["reason"].startswith("SIGTERM; checkpoint of step")
    # Each update up to the stop logged once, the last one with the checkpoint the rerun resumes from.
    assert [r["step"] for r in log if r["event"] == "metrics"] == list(range(1, step + 1))
    assert [r["step"] for r in log if r["event"] == "checkpoint"] == [step]
    assert tf.train.latest_checkpoint(str(tmp_path)).endswith(f"ckpt-{step}")
    assert "[train] SIGTERM: stopping after the update under way and its checkpoint" in output
    assert not (tmp_path / "train.lock").exists()


# Budget: a training process that loses its console, then stopped, with the test's own deadlines of 300 + 120 s.
@pytest.mark.timeout(480)
@pytest.mark.slow
def test_training_outlives_its_console_and_still_stops_with_a_checkpoint(tmp_path, shapes_records):
    # `main.py train | tee log` stopped by Ctrl-C: tee ends at once, and training writes its next lines into a
    # closed pipe.
    process = start_training(tmp_path, shapes_records["data_dir"], "--steps_per_epoch", "50", "--epochs", "1",
                             "--checkpoint_every", "100")
    lines_until(process, "[train] step 2/50", 300)
    process.stdout.close()
    deadline = time.time() + 120
    while max(r["step"] for r in read_log(tmp_path / "log.jsonl") if r["event"] == "metrics") < 4:
        assert process.poll() is None, "training ended with its console"
        assert time.time() < deadline
        time.sleep(0.2)
    process.send_signal(signal.SIGTERM)
    assert process.wait(timeout=120) == 128 + signal.SIGTERM
    (stopped,) = [r for r in read_log(tmp_path / "log.jsonl") if r["event"] == "stopped"]
    assert stopped["step"] >= 4 and tf.train.latest_checkpoint(str(tmp_path)).endswith(f"ckpt-{stopped['step']}")


# Budget: a training process whose terminal closes after its second update, with the test's own deadlines of
# 300 + 120 s.
@pytest.mark.timeout(480)
@pytest.mark.slow
def test_a_terminal_that_closes_stops_training_after_its_checkpoint(tmp_path, shapes_records):
    # An ssh connection that drops: the kernel sends SIGHUP to the processes of the terminal's session, and
    # their writes to it fail from then on (EIO).
    controller, terminal = os.openpty()

    def lead_a_session_on_the_terminal():
        os.setsid()
        fcntl.ioctl(terminal, termios.TIOCSCTTY, 0)

    process = start_training(tmp_path, shapes_records["data_dir"], "--steps_per_epoch", "50", "--epochs", "1",
                             "--checkpoint_every", "100", stdin=terminal, stdout=terminal, stderr=terminal,
                             preexec_fn=lead_a_session_on_the_terminal)
    os.close(terminal)
    shown, deadline = b"", time.time() + 300
    while b"[train] step 2/50" not in shown:
        assert process.poll() is None and time.time() < deadline, shown.decode()[-3000:]
        if select.select([controller], [], [], 1)[0]:
            shown += os.read(controller, 65536)
    os.close(controller)
    assert process.wait(timeout=120) == 128 + signal.SIGHUP
    (stopped,) = [r for r in read_log(tmp_path / "log.jsonl") if r["event"] == "stopped"]
    assert stopped["reason"].startswith("SIGHUP; checkpoint of step")
    assert tf.train.latest_checkpoint(str(tmp_path)).endswith(f"ckpt-{stopped['step']}")


def test_a_stop_signal_waits_for_the_loop_and_a_second_one_acts_as_before():
    from mrcnn_tf2.runtime.stop_signals import StopSignals

    seen = []
    saved = {signum: signal.getsignal(signum) for signum in (signal.SIGINT, signal.SIGTERM)}
    try:
        # What the process had before: Python's Ctrl-C handler, and a SIGTERM handler that records its calls
        # (the default one would end the test's process).
        signal.signal(signal.SIGINT, signal.default_int_handler)
        signal.signal(signal.SIGTERM, lambda signum, frame: seen.append(signum))
        before = signal.getsignal(signal.SIGTERM)
        announced = []
        with StopSignals(announce=lambda signum: announced.append(signum) or "") as stops:
            assert stops.signum == 0
            os.kill(os.getpid(), signal.SIGINT)  # no KeyboardInterrupt: held for the loop
            assert stops.signum == signal.SIGINT and announced == [signal.SIGINT]
            assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
            with pytest.raises(KeyboardInterrupt):
                os.kill(os.getpid(), signal.SIGINT)
                time.sleep(5)
            os.kill(os.getpid(), signal.SIGTERM)  # held too; the first signal still names the stop
            assert stops.signum == signal.SIGINT and seen == [] and announced == [signal.SIGINT]
            os.kill(os.getpid(), signal.SIGTERM)
            assert seen == [signal.SIGTERM]
        assert signal.getsignal(signal.SIGTERM) is before
        # An ignored signal stays ignored; leaving the context gives back the handlers it replaced.
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        with StopSignals() as stops:
            assert signal.getsignal(signal.SIGINT) is signal.SIG_IGN
            assert signal.getsignal(signal.SIGTERM) is not before
            os.kill(os.getpid(), signal.SIGINT)
            assert stops.signum == 0
        assert signal.getsignal(signal.SIGTERM) is before
    finally:
        for signum, handler in saved.items():
            signal.signal(signum, handler)


@pytest.mark.slow
def test_corrupt_latest_checkpoint_falls_back_to_the_previous_one(tmp_path, trained_model, capsys):
    model_dir = tmp_path / "model"
    shutil.copytree(trained_model, model_dir)
    latest = f"ckpt-{TRAINED_STEPS}"
    assert tf.train.latest_checkpoint(str(model_dir)).endswith(latest)
    data_file = next(p for p in os.listdir(model_dir) if p.startswith(f"{latest}.data"))
    with open(model_dir / data_file, "r+b") as f:
        f.truncate(os.path.getsize(model_dir / data_file) // 2)
    # One more epoch than the run had: it resumes from the checkpoint before the corrupt one.
    assert main.main(["train", "--model_dir", str(model_dir), "--epochs", str(TRAINED_STEPS // 2 + 1)]) == 0
    printed = capsys.readouterr()
    assert f"{latest} is unreadable" in printed.out + printed.err
    resumed = [r for r in read_log(model_dir / "log.jsonl") if r["event"] == "resumed"]
    assert resumed[-1]["step"] == TRAINED_STEPS - 1 and resumed[-1]["checkpoint"].endswith(f"ckpt-{TRAINED_STEPS - 1}")


def test_benchmark_prints_throughput_and_latency_percentiles(tmp_path, shapes_records, capsys):
    assert main.main(["train", "--data_dir", shapes_records["data_dir"], "--model_dir", str(tmp_path), *SMALL_FLAGS,
                      "--benchmark", "--benchmark_steps", "4", "--use_synthetic_data"]) == 0
    lines = capsys.readouterr().out.splitlines()
    throughput = [line for line in lines if line.startswith("train throughput:")]
    assert len(throughput) == 1 and throughput[0].endswith(" img/s")
    record = json.loads(next(line for line in lines if line.startswith('{"benchmark"')))
    assert record["steps"] == 4 and record["batch_size"] == 2
    assert float(throughput[0].split()[2]) == pytest.approx(record["throughput_img_per_s"], rel=1e-3)
    latency = record["latency_s"]
    assert 0 < latency["p50"] <= latency["p90"] <= latency["p95"] <= latency["p99"]
    assert not any(name.startswith("ckpt") for name in os.listdir(tmp_path))  # benchmarks leave no checkpoint


@pytest.mark.timeout(300)  # the default (full-width) model on ResNet-101
@pytest.mark.slow
# The deepest backbone: ResNet-50 trains from scratch at the defaults in
# test_resnet50_trains_from_scratch_at_the_defaults, ResNet-18's basic blocks from scratch in the quick demo
# (tests/test_demo.py), and test_backbone.py builds every depth.
def test_benchmark_trains_from_scratch_at_the_defaults_at_a_constant_rate(tmp_path, shapes_records):
    """ResNet-101 at the default model, schedule and learning rate, at 128x128 batch 2: the benchmark runs all its
    steps at a tenth of the rate after the warm-up (0.1 x 1e-2 x 2 / 8), with finite losses.

    In a process of its own: a full-width model trained here would keep a GB or more of this worker's memory to
    the end of the run (TensorFlow does not give all of it back), and several of them could exhaust the machine."""
    result = subprocess.run(
        main_py("train", "--data_dir", shapes_records["data_dir"], "--model_dir", str(tmp_path), "--backbone",
                "resnet101", "--image_size", "128", "128", "--train_batch_size", "2", "--seed", "1", "--benchmark",
                "--use_synthetic_data", "--log_warmup_steps", "1", "--benchmark_steps", "3", "--log_every", "1"),
        cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
    assert "no pretrained weights: training from scratch" in result.stdout
    metrics = [r for r in read_log(tmp_path / "log.jsonl") if r["event"] == "metrics"]
    assert [r["step"] for r in metrics] == list(range(1, 5))
    assert all(r["learning_rate"] == pytest.approx(0.00025) for r in metrics)
    assert all(np.isfinite(r["loss_total"]) for r in metrics)


def test_missing_training_files_are_a_clear_error(tmp_path, capsys):
    assert run_main(["train", "--data_dir", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert "--data_dir" in err and "train*.tfrecord" in err


def test_a_class_label_outside_num_classes_is_a_clear_error_before_any_checkpoint(tmp_path, shapes_records, capsys):
    assert run_main(["train", "--data_dir", shapes_records["data_dir"], "--model_dir", str(tmp_path), *SMALL_FLAGS,
                     "--num_classes", "3", "--epochs", "1", "--steps_per_epoch", "1"]) == 2
    err = capsys.readouterr().err
    assert "main.py: error: --num_classes: 3, but a training record with source_id " in err
    assert "the labels must be 1 to 2 (0 is the background)" in err and "Traceback" not in err
    assert not [name for name in os.listdir(tmp_path) if name.startswith("ckpt")]


def test_an_eval_file_of_other_images_stops_training_before_its_first_update(tmp_path, shapes_records, capsys):
    train_json = shapes_records["val_json"].replace("instances_val.json", "instances_train.json")
    assert run_main(["train", "--data_dir", shapes_records["data_dir"], "--model_dir", str(tmp_path), *SMALL_FLAGS,
                     "--eval_file", train_json, "--epochs", "1", "--steps_per_epoch", "1"]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"main.py: error: --eval_file: {train_json} is the annotation file of other images")
    assert sorted(os.listdir(tmp_path)) == ["log.jsonl"]  # no config, no checkpoint
    assert [r["event"] for r in read_log(tmp_path / "log.jsonl")] == []


# Without the check the run waits forever for its first batch, inside TensorFlow, where the default (signal)
# timeout cannot reach it.
@pytest.mark.timeout(120, method="thread")
def test_training_records_too_few_for_the_run_exit_2_naming_the_data_dir(tmp_path, shapes_records, capsys):
    data_dir = tmp_path / "data"
    data_dir.mkdir()
    with tf.io.TFRecordWriter(str(data_dir / "train-00000-of-00001.tfrecord")):
        pass  # what a converter that wrote more shards than images left
    flags = ["train", "--data_dir", data_dir, "--model_dir", tmp_path / "model", *SMALL_FLAGS, "--epochs", "1"]
    assert run_main([*flags, "--steps_per_epoch", "1"]) == 2
    assert capsys.readouterr().err.startswith(
        f"main.py: error: --data_dir: the 1 file(s) hold no record (first: {data_dir}/train-00000-of-00001.tfrecord")
    with tf.io.TFRecordWriter(str(data_dir / "train-00000-of-00001.tfrecord")) as writer:
        writer.write(next(iter(tf.data.TFRecordDataset(
            tf.io.gfile.glob(os.path.join(shapes_records["data_dir"], "train-*"))))).numpy())
    assert run_main([*flags, "--train_batch_size", "2"]) == 2  # the steps of an epoch counted from the records
    assert capsys.readouterr().err.startswith(
        f"main.py: error: --data_dir: {data_dir}/train*.tfrecord holds 1 records, fewer than one global batch of 2")


def test_target_is_reached_when_every_given_ap_is_met():
    metrics = {"bbox/AP": 0.40, "segm/AP": 0.30}
    assert targets_reached(metrics, 0.377, 0.30)  # at the target counts
    assert not targets_reached(metrics, 0.377, 0.342)  # one short: keep training
    assert not targets_reached(metrics, 0.41, 0.2)
    assert targets_reached(metrics, 0.377, None) and targets_reached(metrics, None, 0.3)  # one target given
    assert not targets_reached(metrics, None, None)  # no target: never stop early
    assert not targets_reached({"bbox/AP": 0.9}, 0.1, 0.1)  # no mask AP (Faster R-CNN) cannot meet a mask target


def test_evaluation_is_due_every_n_epochs_and_after_the_last_step(shapes_records):
    config = Config()
    config.eval.eval_file = shapes_records["val_json"]
    config.data.data_dir = shapes_records["data_dir"]
    assert TrainingEvaluator.from_config(Config(), steps_per_epoch=5) is None  # no --eval_file: no evaluation
    at_end = TrainingEvaluator.from_config(config, steps_per_epoch=5)
    assert [step for step in range(1, 31) if at_end.due(step, last_step=30)] == [30]
    config.eval.eval_every_epochs = 2
    every_two = TrainingEvaluator.from_config(config, steps_per_epoch=5)
    assert [step for step in range(1, 24) if every_two.due(step, last_step=23)] == [10, 20, 23]
    config.eval.eval_every_epochs, config.eval.min_bbox_map = None, 0.3  # a target evaluates every epoch
    assert [s for s in range(1, 16) if TrainingEvaluator.from_config(config, 5).due(s, 15)] == [5, 10, 15]


def test_a_schedule_that_does_not_act_at_the_runs_length_is_said_and_one_that_does_is_not():
    def notice(config, steps_per_epoch):
        schedule = learning_rate_schedule(config.train, steps_per_epoch, global_batch_size=8)
        return train_runtime.Trainer._schedule_notice(types.SimpleNamespace(
            config=config, schedule=schedule, total_steps=config.train.epochs * steps_per_epoch))

    config = Config()
    assert notice(config, 1000) is None  # the defaults at COCO's scale: warm-up to 500, drops at epochs 8 and 10
    config.train.epochs = 10
    assert notice(config, 1000).startswith(
        "--learning_rate_boundaries 10 lie at or past the run's end (--epochs 10): the learning rate changes they "
        "set never come")
    config.train.epochs = 12
    warmup = "the learning rate's warm-up (to update {}: --learning_rate_boundaries 0.3 epochs, at least "
    assert notice(config, 50).startswith(  # 600 updates: the warm-up's 500 run into the drop at epoch 8
        warmup.format(400) + "train.warmup_min_steps = 500 updates) lasts until the rate's first drop (epoch 8): no "
        "update is at the full rate")
    config.train.learning_rate_boundaries, config.train.learning_rate_values = (0.3,), (0.01,)
    assert notice(config, 40).startswith(warmup.format(500) + "train.warmup_min_steps = 500 updates) outlasts the "
                                         "run (480 updates)")
    config.train.warmup_min_steps = 0
    assert notice(config, 40) is None
    config.train.epochs, config.runtime.benchmark = 1, True  # a constant rate
    assert notice(config, 40) is None
    config = Config()
    config.train.learning_rate_schedule, config.train.epochs = "cosine", 8  # decays until the end: no late drop
    assert notice(config, 1000) is None
    assert notice(config, 50).startswith(warmup.format(500) + "train.warmup_min_steps = 500 updates) outlasts the "
                                         "run (400 updates)")


def test_a_resumed_run_reads_which_evaluations_it_has_and_refuses_a_record_it_cannot_read(tmp_path, shapes_records):
    config = Config()
    config.eval.eval_file, config.eval.min_bbox_map = shapes_records["val_json"], 0.5
    config.data.data_dir, config.runtime.model_dir = shapes_records["data_dir"], str(tmp_path)
    evaluator = TrainingEvaluator.from_config(config, steps_per_epoch=5)
    logger = train_runtime.RunLogger(str(tmp_path / "log.jsonl"), verbose=False)
    record = tmp_path / TRAINING_RESULTS_FILE
    record.write_text(json.dumps({"5": {"bbox/AP": 0.6}, "10": {"bbox/AP": 0.4}}))
    assert evaluator.resume(5, 15, logger) == "reached"
    assert evaluator.resume(10, 15, logger) is None  # evaluated, short of the target: train on
    assert evaluator.resume(15, 15, logger) == "evaluate"  # due, never evaluated: make it up
    assert evaluator.resume(12, 15, logger) is None  # not due
    for text in ("{", "[1, 2]"):
        record.write_text(text)
        with pytest.raises(ConfigError, match=f"^--model_dir: {record} .*: delete it to evaluate again$"):
            evaluator.resume(5, 15, logger)
    assert evaluator.resume(0, 15, logger) is None and not record.exists()  # a new run forgets an old run's record
    logger.close()


def test_the_training_input_labels_the_models_own_anchors_with_the_factorys_op(shapes_records, monkeypatch):
    config = small_config()
    config.data.data_dir = shapes_records["data_dir"]
    config.model.anchors.anchor_scale = 4.0  # not the default anchors
    config.train.steps_per_epoch = 1
    given = {}

    class RecordingPipeline(train_runtime.InputPipeline):
        def __init__(self, config, training, anchors=None, rpn_targets=None):
            given.update(anchors=anchors, rpn_targets=rpn_targets)
            super().__init__(config, training, anchors, rpn_targets)

    monkeypatch.setattr(train_runtime, "InputPipeline", RecordingPipeline)
    trainer = train_runtime.Trainer(config)
    batch = next(iter(trainer.dataset(0)))
    anchors = trainer.model.anchors
    assert given["anchors"].keys() == anchors.keys()
    for level, boxes in anchors.items():
        np.testing.assert_array_equal(given["anchors"][level], boxes)
        assert np.prod(batch["rpn_score_targets"][level].shape[1:]) == len(boxes)  # one label per anchor
    assert given["rpn_targets"] is choose_ops(config).rpn_targets


def test_training_evaluates_logs_the_aps_and_stops_at_the_target(tmp_path, shapes_records, capsys):
    _, config = parse(["train", *SMALL_FLAGS, "--data_dir", shapes_records["data_dir"], "--model_dir", str(tmp_path),
                       "--eval_file", shapes_records["val_json"], "--steps_per_epoch", "1", "--epochs", "3",
                       "--eval_samples", "2", "--log_every", "1", "--log_tensorboard", str(tmp_path / "tb"),
                       # Targets any model meets: the first evaluation (epoch 1) ends the run.
                       "--min_bbox_map", "0", "--min_mask_map", "0"])
    assert train_runtime.Trainer(config).run() == 0
    out = capsys.readouterr().out
    assert "[eval] step 1 epoch 1: bbox AP" in out and "mask AP" in out
    assert "target reached" in out and "stopping training" in out
    assert ("[train] the learning rate's warm-up (to update 8: --learning_rate_boundaries 0.3 epochs, at least "
            "train.warmup_min_steps = 500 updates) outlasts the run (3 updates)") in out
    log = read_log(tmp_path / "log.jsonl")
    (evaluation,) = [r for r in log if r["event"] == "eval"]
    assert evaluation["step"] == 1 and evaluation["eval_images"] == 2
    assert {"bbox/AP", "segm/AP", "segm/ARl"} <= set(evaluation)
    assert [r["step"] for r in log if r["event"] == "done"] == [1]
    assert [r["step"] for r in log if r["event"] == "metrics"] == [1]  # no step after the stop
    assert tf.train.latest_checkpoint(str(tmp_path)).endswith("ckpt-1")  # the stopping step is saved
    tags = {value.tag for path in tf.io.gfile.glob(str(tmp_path / "tb" / "*"))
            for event in tf.compat.v1.train.summary_iterator(path) for value in event.summary.value}
    assert {"bbox/AP", "segm/AP", "loss_total"} <= tags
    recorded = json.loads((tmp_path / TRAINING_RESULTS_FILE).read_text())
    assert list(recorded) == ["1"] and recorded["1"]["bbox/AP"] == evaluation["bbox/AP"]

    # The same command again: the step met the targets, so nothing trains (a scheduler's rerun, a retried job).
    assert train_runtime.Trainer(config).run() == 0
    assert "target reached step 1" in capsys.readouterr().out
    log = read_log(tmp_path / "log.jsonl")
    assert [r["step"] for r in log if r["event"] == "metrics"] == [1]
    (again,) = [r for r in log if r["event"] == "target reached" and r["message"] == "reached before this run"]
    assert again["step"] == 1 and log[-1]["event"] == "done" and log[-1]["step"] == 1
    assert tf.train.latest_checkpoint(str(tmp_path)).endswith("ckpt-1")
    # A higher target than the step met: training goes on, evaluating every epoch.
    config.eval.min_bbox_map = 1.0
    assert train_runtime.Trainer(config).run() == 0
    assert [r["step"] for r in read_log(tmp_path / "log.jsonl") if r["event"] == "eval"] == [1, 2, 3]
    recorded = json.loads((tmp_path / TRAINING_RESULTS_FILE).read_text())
    assert list(recorded) == ["1", "2", "3"]
    # The checkpoint of the highest box AP (the first of a tie) is kept in best/, a model directory of its own.
    aps = [recorded[str(step)]["bbox/AP"] for step in (1, 2, 3)]
    best = json.loads((tmp_path / BEST_DIR / BEST_FILE).read_text())
    assert best["step"] == 1 + aps.index(max(aps)) and best["value"] == max(aps)
    assert [(r["step"], r["bbox/AP"]) for r in read_log(tmp_path / "log.jsonl") if r["event"] == "best"][-1] == (
        best["step"], f"{max(aps):.4f}")
    _, again = parse(["eval", "--model_dir", str(tmp_path / BEST_DIR)])
    assert again.eval.eval_samples == 2 and again.data.data_dir == shapes_records["data_dir"]  # the run's config
    assert evaluate_runtime.run(again) == 0
    scored = json.loads((tmp_path / BEST_DIR / RESULTS_FILE).read_text())
    assert scored["step"] == best["step"] and scored["metrics"]["bbox/AP"] == pytest.approx(max(aps), abs=1e-6)


def test_a_stop_signal_during_an_evaluation_abandons_it_and_keeps_the_steps_checkpoint(tmp_path, shapes_records,
                                                                                         monkeypatch, capfd):
    from mrcnn_tf2.evaluation import coco_metrics

    convert, converted = coco_metrics.convert_detections, []

    def signalled_in_the_first_batch(*args):
        converted.append(args)
        if len(converted) == 1:  # once: SIGTERM given back to its default would end the test's process
            os.kill(os.getpid(), signal.SIGTERM)
        return convert(*args)

    monkeypatch.setattr(coco_metrics, "convert_detections", signalled_in_the_first_batch)
    _, config = parse(["train", *SMALL_FLAGS, "--data_dir", shapes_records["data_dir"], "--model_dir", str(tmp_path),
                       "--eval_file", shapes_records["val_json"], "--steps_per_epoch", "1", "--epochs", "3",
                       "--eval_every_epochs", "1", "--eval_samples", "4", "--eval_batch_size", "1", "--log_every", "1"])
    before = signal.getsignal(signal.SIGTERM)
    assert train_runtime.Trainer(config).run() == 128 + signal.SIGTERM
    assert signal.getsignal(signal.SIGTERM) is before
    assert len(converted) == 1  # the evaluation ended at its next batch, not after its 4 images
    err = capfd.readouterr().err
    assert "[train] SIGTERM: abandoning the evaluation of step 1, whose checkpoint is written" in err
    log = read_log(tmp_path / "log.jsonl")
    assert [r["event"] for r in log if r["event"] in ("metrics", "checkpoint", "eval", "stopped", "done")] == [
        "metrics", "checkpoint", "stopped"]
    (stopped,) = [r for r in log if r["event"] == "stopped"]
    assert stopped["step"] == 1 and stopped["reason"] == (
        "SIGTERM; its evaluation abandoned; checkpoint of step 1 written: the same command evaluates it, then "
        "resumes from it")
    assert tf.train.latest_checkpoint(str(tmp_path)).endswith("ckpt-1")
    assert not (tmp_path / TRAINING_RESULTS_FILE).exists()

    # The rerun makes up the abandoned evaluation before anything else (here of a run cut to that step).
    monkeypatch.setattr(coco_metrics, "convert_detections", convert)
    config.train.epochs = 1
    assert train_runtime.Trainer(config).run() == 0
    assert "[eval] step 1 epoch 1: bbox AP" in capfd.readouterr().out
    log = read_log(tmp_path / "log.jsonl")
    assert [r["event"] for r in log if r["event"] in ("metrics", "checkpoint", "eval", "stopped", "done")] == [
        "metrics", "checkpoint", "stopped", "eval", "done"]
    assert list(json.loads((tmp_path / TRAINING_RESULTS_FILE).read_text())) == ["1"]


def from_scratch_losses(tmp_path, data_dir, *overrides):
    """loss_total of each of 12 steps of ResNet-50 trained from scratch at the default schedule and learning
    rate, at 256x256, batch 2, with the warm-up shortened to 3.6 steps (0.3 epochs of 12 steps, no floor)."""
    _, config = parse(["train", "--data_dir", data_dir, "--model_dir", str(tmp_path), "--image_size", "256", "256",
                       "--train_batch_size", "2", "--seed", "3", "--steps_per_epoch", "12", "--epochs", "1",
                       "--log_every", "1", "--config_override", "train.warmup_min_steps=0", *overrides])
    status = train_runtime.Trainer(config).run()
    losses = [r["loss_total"] for r in read_log(tmp_path / "log.jsonl") if r["event"] == "metrics"]
    return status, losses


@pytest.mark.timeout(300)  # ResNet-50 at the default widths, 12 steps at 256x256
@pytest.mark.slow
def test_resnet50_trains_from_scratch_at_the_defaults(tmp_path, shapes_records, capsys):
    status, losses = from_scratch_losses(tmp_path, shapes_records["data_dir"])
    assert "no pretrained weights: training from scratch with batch norm on batch statistics" in capsys.readouterr().out
    assert status == 0 and len(losses) == 12 and all(np.isfinite(losses)), losses
    assert np.mean(losses[-5:]) < 0.8 * np.mean(losses[:5]), losses


@pytest.mark.parametrize("policy", ["float32", "mixed_float16"])
def test_clip_grad_norm_scales_the_unscaled_update_to_the_norm(monkeypatch, policy):
    """SGD's first update is -lr * g: clipped to c, it must be -lr * g * c / |g|, whatever the loss scale
    (under mixed_float16 the LossScaleOptimizer's gradients are 2**15 times larger until it unscales them).
    A large rate makes the updates large against the float32 rounding of the weights they are read from."""
    def set_policy(amp, amp_dtype="auto", world=None):
        keras.mixed_precision.set_global_policy(policy)
        return policy

    monkeypatch.setattr(train_runtime, "set_precision", set_policy)
    batch = synthetic_batch(small_config())
    norm = lambda arrays: float(np.sqrt(sum(np.sum(np.square(a, dtype=np.float64)) for a in arrays)))  # noqa: E731
    deltas, initial, clip = [], None, None
    try:
        for _ in range(2):
            config = equally_weighted_config()
            config.train.init_learning_rate = 1.0
            config.train.clip_grad_norm = clip
            trainer = trainer_for(config)
            trainer.build()
            if initial is None:
                initial = [v.numpy() for v in trainer.model.weights]
            for target, source in zip(trainer.model.weights, initial):  # the same start for both updates
                target.assign(source)
            before = [v.numpy() for v in trainer.model.trainable_variables]
            trainer.update_function()([batch])
            deltas.append([v.numpy() - b for v, b in zip(trainer.model.trainable_variables, before)])
            rate = float(trainer.schedule(0))
            gradient_norm = norm(deltas[0]) / rate
            clip = gradient_norm / 4
    finally:
        keras.mixed_precision.set_global_policy("float32")
    assert norm(deltas[1]) == pytest.approx(rate * gradient_norm / 4, rel=1e-3)
    if policy == "float32":  # float16 gradients of two runs differ in rounding: only their norm is exact
        for unclipped, clipped in zip(*deltas):
            np.testing.assert_allclose(clipped, unclipped / 4, rtol=1e-3, atol=1e-6 * rate)


def test_a_checkpoint_that_cannot_be_written_is_one_error_and_leaves_no_partial_files(tmp_path):
    from mrcnn_tf2.runtime.checkpoints import CheckpointKeeper, CheckpointWriteError

    keeper = CheckpointKeeper(str(tmp_path), 3, weights=tf.Variable(tf.zeros([512, 1024])))  # 2 MiB
    keeper.save(1)
    with file_size_limit(1 << 20), pytest.raises(CheckpointWriteError) as raised:
        keeper.save(2)
    assert str(raised.value) == (f"the checkpoint of step 2 could not be written in {tmp_path} (File too large); "
                                 f"the newest checkpoint is {tmp_path}/ckpt-1, which rerunning the same command "
                                 "resumes from once there is room")
    assert sorted(os.listdir(tmp_path)) == ["checkpoint", "ckpt-1.data-00000-of-00001", "ckpt-1.index"]
    assert keeper.save(3).endswith("ckpt-3")  # with room again, saving goes on


def test_training_whose_checkpoint_cannot_be_written_stops_with_status_1_and_one_line(tmp_path, shapes_records,
                                                                                    monkeypatch, capsys):
    from mrcnn_tf2.runtime import checkpoints

    def full(keeper, step):
        raise checkpoints.CheckpointWriteError(f"the checkpoint of step {step} could not be written")

    monkeypatch.setattr(checkpoints.CheckpointKeeper, "save", full)
    _, config = parse(training_flags(tmp_path, shapes_records["data_dir"]))
    assert train_runtime.Trainer(config).run() == FAILURE
    assert capsys.readouterr().err.splitlines()[-1] == (
        "[train] error: the checkpoint of step 2 could not be written")
    log = read_log(tmp_path / "log.jsonl")
    assert [r["step"] for r in log if r["event"] == "metrics"] == [1, 2]  # no update after it
    assert log[-1]["event"] == "stopped" and log[-1]["reason"] == "the checkpoint of step 2 could not be written"


def test_no_readable_checkpoint_names_the_cause_of_each(tmp_path):
    from mrcnn_tf2.runtime.checkpoints import CheckpointKeeper

    CheckpointKeeper(str(tmp_path), 2, weights=tf.Variable([1.0, 2.0])).save(1)
    keeper = CheckpointKeeper(str(tmp_path), 2, weights=tf.Variable([1.0, 2.0, 3.0]))
    with pytest.raises(RuntimeError) as raised:
        keeper.restore_latest()
    message = str(raised.value)
    assert message.startswith(f"no readable checkpoint in {tmp_path}: tried {tmp_path}/ckpt-1 (")
    assert "shape (2,)" in message and "shape (3,)" in message, message
