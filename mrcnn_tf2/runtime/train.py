"""`main.py train`: the training loop with schedule, precision, accumulation, checkpoints and benchmark mode.

One update ("step") consumes `accumulate_steps` batches of `train_batch_size` images. The step counter,
model, optimizer (momentum, iterations, loss scale) and the data seed live in the checkpoint, so rerunning
the same command resumes at the same step with the same learning rate. The input pipeline cannot be
checkpointed cheaply (its shuffle buffer holds images): a resumed run reseeds it with its start step, so
it reads a fresh, still reproducible order rather than replaying the first batches.

A new run starts from random weights, a pretrained backbone (--backbone_checkpoint) or the model weights
of another run's checkpoint (--init_checkpoint: fine-tuning, at step 0 with a fresh optimizer; the class
layers are reinitialised when --num_classes differs). A run whose model_dir holds a checkpoint resumes
from it and ignores both.

With --eval_file the run also evaluates COCO AP on the validation set (`evaluate.TrainingEvaluator`: when,
what it logs, and the early stop at --min_bbox_map / --min_mask_map).
"""

import contextlib
import copy
import glob
import itertools
import math
import os
import sys
import time

import keras
import numpy as np
import tensorflow as tf

from mrcnn_tf2 import status
from mrcnn_tf2.config import ConfigError
from mrcnn_tf2.data.pipeline import InputPipeline, record_problem
from mrcnn_tf2.model.factory import build_model, choose_ops
from mrcnn_tf2.model.pretrained import check_backbone_metadata, load_backbone_checkpoint
from mrcnn_tf2.runtime import model_dir_lock, stop_signals
from mrcnn_tf2.runtime.benchmark import report_benchmark
from mrcnn_tf2.runtime.checkpoints import (CheckpointKeeper, CheckpointWriteError, TrainingCheckpoint,
                                           check_saved_model_config, find_checkpoint)
from mrcnn_tf2.runtime.distributed import SINGLE_PROCESS
from mrcnn_tf2.runtime.evaluate import EVALUATE, REACHED, EvaluationStopped, TrainingEvaluator
from mrcnn_tf2.runtime.logger import RunLogger, format_duration
from mrcnn_tf2.runtime.precision import describe_precision, set_precision
from mrcnn_tf2.runtime.schedule import learning_rate_schedule
from mrcnn_tf2.runtime.weight_average import AVERAGE_KEY, WeightAverage, holds_average

# The dynamic loss scale's start (Keras's default): high, since an overflow halves it at once while growing
# takes 2000 finite steps per doubling.
INITIAL_LOSS_SCALE = 2.0 ** 15


class NonFiniteLossError(RuntimeError):
    """A loss became NaN or infinite: training stops before any checkpoint. (Under float16 loss scaling,
    gradients that overflow with a finite loss are not this: the update is skipped and counted.)"""


class MomentumSGD(keras.optimizers.SGD):
    """Keras's SGD whose momentum update is TensorFlow's one fused kernel (ResourceApplyKerasMomentum): Keras's
    arithmetic, m = momentum * m - lr * g and w += m (w += momentum * m - lr * g with nesterov), in place. Keras's
    own update is separate ops, and m * momentum needs only the slot: TensorFlow's executor computed it for every
    variable at the start of the step and held it until the gradient came (a copy of the trained variables at
    the step's peak). The fused kernel runs once the gradient exists and makes nothing."""

    def __init__(self, *args, name="sgd", **kwargs):
        # Keras's SGD's own name (its class's, in snake case): the update's scope in a logged graph stays "sgd".
        super().__init__(*args, name=name, **kwargs)

    def update_step(self, gradient, variable, learning_rate):
        if self.momentum == 0:
            return super().update_step(gradient, variable, learning_rate)
        momentum = self.momentums[self._get_variable_index(variable)]
        tf.raw_ops.ResourceApplyKerasMomentum(
            var=variable.handle, accum=momentum.value.handle, lr=tf.cast(learning_rate, variable.dtype),
            grad=tf.cast(gradient, variable.dtype), momentum=tf.cast(self.momentum, variable.dtype),
            use_nesterov=self.nesterov)


def count_records(file_pattern):
    """Number of records in the files matching `file_pattern` (read once; the record bodies are skipped)."""
    paths = sorted(glob.glob(file_pattern))
    if not paths:
        raise FileNotFoundError(f"no file matches {file_pattern}")
    return int(tf.data.TFRecordDataset(paths).reduce(np.int64(0), lambda count, _: count + 1))


class Trainer:
    """Builds everything a run needs from a Config and runs the loop (see `run`).

    `world` (runtime.distributed.World) is this process's place in a Horovod job: each rank reads its own
    shard of the files, gradients are averaged over ranks once per update, and rank 0 alone restores,
    writes checkpoints, logs and summaries, and evaluates.
    """

    def __init__(self, config, world=SINGLE_PROCESS):
        config = self.config = config.resolved()
        train, runtime = config.train, config.runtime
        if train.seed is not None:
            keras.utils.set_random_seed(train.seed)
        self.policy = set_precision(runtime.amp, runtime.amp_dtype, world)
        self.world = world
        self.num_workers, self.worker_index = world.size, world.rank
        self.evaluating = None  # the step whose evaluation is under way (what a stop signal interrupts)
        # Opened before anything is built or read, so that a wrong path fails at once.
        self.init_checkpoint = self._open_init_checkpoint() if world.is_chief else None
        self.pattern = config.data.resolved_training_pattern()
        self.global_batch_size = train.train_batch_size * train.accumulate_steps * world.size
        self.steps_per_epoch = train.steps_per_epoch
        if self.steps_per_epoch is None:
            records = count_records(self.pattern)
            self.steps_per_epoch = records // self.global_batch_size
            if self.steps_per_epoch < 1:
                raise ConfigError("--data_dir", f"{self.pattern} holds {records} records, fewer than one global "
                                  f"batch of {self.global_batch_size} images: lower --train_batch_size or "
                                  "--accumulate_steps")
        self.total_steps = train.epochs * self.steps_per_epoch
        self.schedule = learning_rate_schedule(train, self.steps_per_epoch, self.global_batch_size,
                                               constant=runtime.benchmark)
        # Keras clips inside apply: after the LossScaleOptimizer has unscaled and after the allreduce.
        self.sgd = MomentumSGD(self.schedule, momentum=train.momentum, global_clipnorm=train.clip_grad_norm)
        self.loss_scaled = self.policy == "mixed_float16"
        optimizer = (keras.optimizers.LossScaleOptimizer(self.sgd, initial_scale=INITIAL_LOSS_SCALE) if self.loss_scaled
                     else self.sgd)
        self.model = build_model(config)
        # The weights' moving average lives in a second model (weight_average.py), made WeightAverage in build().
        self.shadow = build_model(config) if train.ema_decay is not None else None
        self.average = None
        self.ops = choose_ops(config)  # the model's (build_model asks the same), said once at start-up
        # The input pipeline labels the model's anchors with the RPN-target op the factory chose for the model.
        self.rpn_targets = self.ops.rpn_targets
        # Not compiled: Keras's compile would wrap the optimizer in a LossScaleOptimizer of its own under
        # mixed_float16 and attach it to the model's checkpoint. The update scales the loss itself.
        self.optimizer = optimizer
        self.step = tf.Variable(0, dtype=tf.int64, trainable=False, name="step")
        # Of the run's steps, those whose update the LossScaleOptimizer skipped (float16 gradients overflowed).
        self.skipped_steps = tf.Variable(0, dtype=tf.int64, trainable=False, name="skipped_steps")
        self.keeper = None

    # -- the update ---------------------------------------------------------------------------------------

    def build(self):
        """Creates every variable (model, optimizer slots, the weight average's model) so that checkpoints restore
        eagerly (once: a second call changes nothing)."""
        if not self.model.built:
            self.model.build()
        self.optimizer.build(self.model.trainable_variables)
        if self.shadow is not None and self.average is None:
            self.shadow.build()
            self.average = WeightAverage(self.model, self.shadow, self.config.train.ema_decay)

    def checkpointed(self):
        """{name: object} of what a checkpoint holds (after `build`).

        The SGD optimizer is saved on its own and the dynamic loss scale beside it, so that checkpoints with
        and without float16 loss scaling hold the same objects and each run resumes the other's: without
        loss scaling, stand-ins at Keras's starting values carry the scale (a run that turns --amp on starts
        from them; one that turns it off keeps the last scale for a later run that turns it on again).
        """
        if self.loss_scaled:
            scale, growth = self.optimizer.dynamic_scale, self.optimizer.step_counter
        else:
            scale = tf.Variable(INITIAL_LOSS_SCALE, dtype=tf.float32, trainable=False)
            growth = tf.Variable(0, dtype=tf.int64, trainable=False)
        objects = dict(model=self.model, optimizer=self.sgd, step=self.step, skipped_steps=self.skipped_steps,
                       loss_scale=tf.train.Checkpoint(scale=scale, growth_steps=growth))
        if self.average is not None:
            objects[AVERAGE_KEY] = self.shadow
        return objects

    def update_function(self):
        """tf.function(batches) -> (losses averaged over the accumulate_steps batches, skipped), after one update.

        Each batch's gradients (of loss / accumulate_steps) are summed, averaged over the Horovod ranks and
        applied once: the update equals one on a batch accumulate_steps x ranks times larger. The batches
        are unrolled in one function, so the sum is of tensors and needs no accumulator variables. (With
        --xla the model compiles its dense layers itself; see MaskRCNN's jit_dense.)

        skipped: int64 scalar, 1 when the LossScaleOptimizer skipped the update (its float16 gradients
        overflowed; it then halves the loss scale), else 0.
        """
        model, optimizer, world, average = self.model, self.optimizer, self.world, self.average
        count = self.config.train.accumulate_steps

        def update(batches):
            # The loss scale (the identity without a LossScaleOptimizer) is read once per update.
            multiplier = optimizer.scale_loss(1.0 / count)
            losses, gradients = model.compute_gradients(batches[0], multiplier)
            for batch in batches[1:]:
                batch_losses, batch_gradients = model.compute_gradients(batch, multiplier)
                losses = {name: value + batch_losses[name] for name, value in losses.items()}
                gradients = [total + gradient for total, gradient in zip(gradients, batch_gradients)]
            gradients = world.average_gradients(gradients)
            iterations = tf.convert_to_tensor(optimizer.iterations)
            optimizer.apply_gradients(zip(gradients, model.trainable_variables))
            # A skipped update leaves the iterations, the schedule's position, where they were: advance them,
            # so that the step, the iterations and the learning rate logged and applied stay one count.
            skipped = tf.cast(tf.equal(optimizer.iterations, iterations), tf.int64)
            optimizer.iterations.assign_add(skipped)
            if average is not None:
                average.update(optimizer.iterations)
            self.skipped_steps.assign_add(skipped)
            self.step.assign_add(1)
            return {name: value / count for name, value in losses.items()}, skipped

        if self.config.runtime.eagerly:
            return update
        # Without autograph: the model has no Python control flow on tensors (tf.cond and tf.while_loop where it
        # branches), and converting its code cost about two seconds at every start-up.
        return tf.function(update, autograph=False)

    def _log_graph(self, update, batches, logger):
        """--log_graph: rank 0 traces `update` on `batches` and writes the graph to TensorBoard (--log_tensorboard,
        else <model_dir>/tensorboard). tf.function keeps this trace for the first step's batches, of the same
        shapes, so the graph costs the loop nothing."""
        runtime = self.config.runtime
        if not (runtime.log_graph and self.world.is_chief):
            return
        if runtime.eagerly:
            notice = "warning: --log_graph writes no graph under --eagerly, which runs the update step untraced"
            print(f"[train] {notice}", flush=True)
            logger.event("notice", echo=False, message=notice)
            return
        logger.graph(update.get_concrete_function(batches).graph, os.path.join(runtime.model_dir, "tensorboard"))

    # -- the loop -----------------------------------------------------------------------------------------

    def dataset(self, start_step):
        config = copy.deepcopy(self.config)
        if config.train.seed is not None:
            # A resumed run reads a new order, still fixed by --seed (see the module docstring).
            config.train.seed += start_step
        pipeline = InputPipeline(config, training=True, anchors=self.model.anchors, rpn_targets=self.rpn_targets)
        return pipeline.dataset(self.pattern, config.train.train_batch_size, self.worker_index, self.num_workers)

    def _open_init_checkpoint(self):
        """The TrainingCheckpoint of --init_checkpoint when this run starts from it: None without the flag or
        when model_dir holds a checkpoint (the run resumes from that). Raises ConfigError naming the path
        when it holds no readable checkpoint or a model of another backbone (checkpoints.py)."""
        config = self.config
        path = config.train.init_checkpoint
        if path is None or tf.train.latest_checkpoint(config.runtime.model_dir):
            return None
        prefix = find_checkpoint(path)
        check_saved_model_config(path, prefix, config)
        return TrainingCheckpoint(prefix)

    def _restore_or_initialise(self, logger):
        """Builds the variables, then rank 0 restores or initialises them and every rank takes rank 0's
        (model, optimizer, step); returns the step."""
        self.build()
        # Only rank 0 reads model_dir and the checkpoints a run starts from: other machines need not see them.
        if self.world.is_chief:
            resumed = self._restore_or_load_pretrained(logger)
            if self.average is not None and not resumed:
                self.average.reset()  # a new run averages from its first weights on
        shadow = self.shadow.variables if self.shadow is not None else []
        self.world.broadcast_variables([*self.model.variables, *self.optimizer.variables, self.step,
                                        self.skipped_steps, *shadow])
        return int(self.step.numpy())

    def _restore_or_load_pretrained(self, logger):
        """Restores the latest checkpoint, or loads the init checkpoint's model or the pretrained backbone in
        a new run; returns whether it restored."""
        runtime, train = self.config.runtime, self.config.train
        self.keeper = CheckpointKeeper(runtime.model_dir, runtime.keep_checkpoints, **self.checkpointed())
        self._check_average_kept_alike()
        path = self.keeper.restore_latest()
        if path is not None:
            logger.event("resumed", checkpoint=path, step=int(self.step.numpy()))
            previous = (logger.last("start") or {}).get("global_batch_size", self.global_batch_size)
            if previous != self.global_batch_size:
                # Steps, epochs and the learning rate schedule count updates: from here they count other ones.
                notice = (f"resuming {path}, trained with updates of {previous} images, with updates of "
                          f"{self.global_batch_size} ({self.num_workers} worker(s) x --train_batch_size "
                          f"{train.train_batch_size} x --accumulate_steps {train.accumulate_steps}): the steps from "
                          "here on take that many images each, and the epochs and learning rates count them "
                          f"({self.steps_per_epoch} steps per epoch)")
                print(f"[train] {notice}", flush=True)
                logger.event("notice", echo=False, message=notice)
            if train.init_checkpoint:
                notice = (f"--init_checkpoint {train.init_checkpoint} is ignored: the run resumes from its own "
                          f"checkpoint {path}")
                print(f"[train] {notice}", flush=True)
                logger.event("notice", echo=False, message=notice)
        elif self.init_checkpoint is not None:
            self._load_init_checkpoint(logger)
        elif train.backbone_checkpoint:
            # Only a new run loads pretrained weights: a resumed one has trained past them.
            check_backbone_metadata(train.backbone_checkpoint, self.config.model)
            load_backbone_checkpoint(self.model.backbone, train.backbone_checkpoint, self.config.model.backbone)
            logger.event("backbone loaded", checkpoint=train.backbone_checkpoint)
        return path is not None

    def _check_average_kept_alike(self):
        """Raises ConfigError naming train.ema_decay when the newest checkpoint of model_dir holds a weight average
        and this run keeps none, or the reverse: a resumed run would lose the average, or start one from the
        weights of some later step while its checkpoints claimed to average the whole run."""
        latest = self.keeper.manager.latest_checkpoint
        if latest is None:
            return
        try:
            held = holds_average(latest)
        except tf.errors.OpError:
            return  # unreadable: restore_latest reports it and falls back
        if held != (self.average is not None):
            kept = "holds an average of the weights" if held else "holds no average of the weights"
            wanted = (f"this run keeps one (ema_decay {self.config.train.ema_decay:g})" if self.average is not None
                      else "this run keeps none (ema_decay None)")
            raise ConfigError("train.ema_decay", f"{latest} {kept} and {wanted}: a run keeps the average from its "
                                                 "start to its end; resume with the setting it started with, or "
                                                 "start a new run (--init_checkpoint takes its weights)")

    def _load_init_checkpoint(self, logger):
        """Assigns the model the weights of the init checkpoint and reports what was loaded: the optimizer
        (momentum, iterations), the step and so the schedule keep their fresh start."""
        model = self.model
        # The layers with one output per class: another --num_classes gives them new shapes (and meanings).
        class_layers = [model.box_head.class_dense, model.box_head.box_dense]
        if model.mask_head is not None:
            class_layers.append(model.mask_head.logits)
        # A checkpoint with a mask head fits a Faster R-CNN: its backbone and box head are what it needs.
        absent = ("mask_head",) if model.mask_head is None else ()
        checkpoint = self.init_checkpoint
        loaded = checkpoint.load_model_weights(model, class_layers, absent)
        step = "" if checkpoint.step is None else f" (step {checkpoint.step})"
        weights = "model variables (its run's moving average of them)" if checkpoint.averaged else "model variables"
        print(f"[train] init checkpoint {checkpoint.prefix}{step}: loaded {loaded.loaded} {weights}; the "
              "optimizer, step and learning rate schedule start fresh", flush=True)
        for name, stored, shape in loaded.reinitialised:
            print(f"[train] init checkpoint: {name} newly initialised: {stored} in the checkpoint, {shape} in "
                  "the model (--num_classes differs)", flush=True)
        if loaded.ignored:
            print(f"[train] init checkpoint: ignored its {len(loaded.ignored)} mask head variables (the model has "
                  f"no mask head): {', '.join(name for name, _ in loaded.ignored)}", flush=True)
        logger.event("init checkpoint loaded", echo=False, checkpoint=checkpoint.prefix, step=checkpoint.step,
                     variables=loaded.loaded, averaged=checkpoint.averaged,
                     reinitialised=[dict(variable=name, checkpoint_shape=stored, model_shape=shape)
                                    for name, stored, shape in loaded.reinitialised],
                     ignored=[name for name, _ in loaded.ignored])

    def run(self):
        """Trains to epochs * steps_per_epoch updates (or benchmarks); returns the process exit status."""
        runtime = self.config.runtime
        if self.world.is_chief:
            log_file = runtime.log_file or os.path.join(runtime.model_dir, "log.jsonl")
            logger = RunLogger(log_file, runtime.log_tensorboard)
        else:
            logger = RunLogger(os.devnull, verbose=False)  # rank 0 reports for the job; errors still print
        try:
            return self._loop(logger)
        except NonFiniteLossError as err:
            print(f"[train] error: {err}", file=sys.stderr)
            logger.event("stopped", reason=str(err))
            return status.FAILURE  # the message names the cause
        except CheckpointWriteError as err:
            print(f"[train] error: {err}", file=sys.stderr)
            with contextlib.suppress(OSError):  # the log may be on the disk that is full
                logger.event("stopped", echo=False, reason=str(err))
            return status.FAILURE
        except tf.errors.InvalidArgumentError as err:
            found = record_problem(err)
            if found is None:
                raise
            problem = ConfigError(*found)
            logger.event("stopped", reason=str(problem))
            raise problem from None
        finally:
            logger.close()

    def _loop(self, logger):
        config, runtime = self.config, self.config.runtime
        accumulate = config.train.accumulate_steps
        if self.world.is_chief:
            print(f"[train] {describe_precision(self.policy, runtime.amp, self.loss_scaled)}", flush=True)
            print(f"[train] {self.ops.describe()}", flush=True)
            if self.shadow is not None:
                users = ("the evaluations, and eval, infer and export of this model directory, use it"
                         if config.eval.use_ema else "eval.use_ema false: the evaluations use the last step's weights")
                print(f"[train] keeping a moving average of the weights (train.ema_decay {config.train.ema_decay:g}): "
                      f"{users}", flush=True)
        start = self._restore_or_initialise(logger)
        # The first batch before anything is written, so that unreadable data stops the run first.
        try:
            batches = iter(self.dataset(start))
        except ValueError as err:  # files that are not TFRecords or hold too few records (pipeline.py)
            raise ConfigError("--data_dir", str(err)) from None
        first = next(batches)
        batches = itertools.chain([first], batches)
        trained = not runtime.benchmark and start >= self.total_steps
        # Evaluation on the validation set (with --eval_file), which may stop the run at the target AP. Under
        # Horovod every rank evaluates its share of the images and takes rank 0's decision to stop. Made before
        # the config and any checkpoint are written: an annotation file of other images stops the run here.
        evaluator = (TrainingEvaluator.from_config(config, self.steps_per_epoch, self.world)
                     if not runtime.benchmark else None)
        if start == 0 and self.world.is_chief:
            for notice in (self._initialisation_notice(), self._schedule_notice()):
                if notice:
                    print(f"[train] {notice}", flush=True)
                    logger.event("notice", echo=False, message=notice)
        logger.event("start", echo=False, config=config.to_dict(), policy=self.policy, ops=self.ops.describe(),
                     steps_per_epoch=self.steps_per_epoch, total_steps=self.total_steps, start_step=start,
                     global_batch_size=self.global_batch_size)
        if self.world.is_chief:
            config.save(runtime.model_dir)  # what eval, infer, export and a resumed run start from
        # A resumed run first makes up the evaluation of its start that a stop abandoned, and does not train past a
        # step that met the target APs.
        resumed = evaluator.resume(start, self.total_steps, logger) if evaluator is not None else None
        if resumed == EVALUATE:
            with stop_signals.StopSignals(self._stop_notice if self.world.is_chief else None) as stops:
                reached, signum = self._evaluate(evaluator, start, logger, stops)
            if signum:
                return self._stop(logger, start, signum, evaluation_abandoned=True)
            resumed = REACHED if reached else None
        if resumed == REACHED or trained:
            logger.event("done", step=start, message="the target APs are reached at this step" if resumed == REACHED
                         else "already trained to the last step")
            return status.OK
        last = (start + runtime.log_warmup_steps + runtime.benchmark_steps if runtime.benchmark
                else self.total_steps)
        update = self.update_function()
        self._log_graph(update, [first] * accumulate, logger)
        step_times, window = [], []
        timer_start = None
        # From the first update on, a stop signal waits for the update under way and its checkpoint; before it,
        # when there is nothing to save, it acts at once (on a first batch slow to come, a trace).
        with stop_signals.StopSignals(self._stop_notice if self.world.is_chief else None) as stops:
            for step in range(start + 1, last + 1):
                tic = time.perf_counter()
                losses, skipped = update([next(batches) for _ in range(accumulate)])
                values = {name: float(value) for name, value in losses.items()}  # waits for the step
                toc = time.perf_counter()
                self._check_finite(step, values)
                if skipped:
                    logger.event("skipped", echo=False, step=step,
                                 loss_scale=float(self.optimizer.dynamic_scale))
                done = step - start
                if done == runtime.log_warmup_steps:
                    timer_start = toc
                elif done > runtime.log_warmup_steps:
                    step_times.append(toc - tic)
                window.append(values)
                # A signal reaches the ranks at different moments: every rank stops after the same update.
                signum = self.world.max_over_ranks(stops.signum) if step < last else 0
                epoch_end = not runtime.benchmark and step % self.steps_per_epoch == 0
                evaluation_due = evaluator is not None and evaluator.due(step, last)
                if step % runtime.log_every == 0 or step == last or signum:
                    self._log_metrics(logger, step, last, window, step_times, timer_start)
                    window = []
                # Evaluations come at the end of an epoch or of the run, so after a checkpoint: a signal during
                # one abandons it and keeps the step.
                if (self.world.is_chief and not runtime.benchmark
                        and (step % runtime.checkpoint_every == 0 or epoch_end or step == last or signum)):
                    logger.event("checkpoint", step=step, path=self.keeper.save(step))
                if signum:
                    return self._stop(logger, step, signum)
                if not evaluation_due:
                    continue
                paused = time.perf_counter()
                reached, signum = self._evaluate(evaluator, step, logger, stops)
                if signum:
                    return self._stop(logger, step, signum, evaluation_abandoned=True)
                if timer_start is not None:
                    timer_start += time.perf_counter() - paused  # evaluating is not training: keep img/s true
                if reached:
                    break  # the target APs are reached (the evaluator logged it); this step has its checkpoint
        if runtime.benchmark:
            self._report_benchmark(logger, step_times)
        logger.event("done", step=step, **self._skipped_summary())
        return status.OK

    def _evaluate(self, evaluator, step, logger, stops):
        """Evaluates the model after update `step`; returns (whether the target APs are reached, the number of the
        signal that abandoned the evaluation, else 0)."""
        self.evaluating = step
        try:
            # The weights inference will use (load_model's choice).
            model = self.shadow if self.shadow is not None and self.config.eval.use_ema else self.model
            return evaluator.evaluate(model, step, logger, stopping=lambda: stops.signum), 0
        except EvaluationStopped as stopped:
            return False, stopped.signum
        finally:
            self.evaluating = None

    def _stop_notice(self, signum):
        """The line rank 0 writes when `signum` comes (stop_signals.StopSignals's announce)."""
        name = stop_signals.name(signum)
        if self.evaluating is not None:
            what = f"abandoning the evaluation of step {self.evaluating}, whose checkpoint is written"
        elif self.config.runtime.benchmark:
            what = "stopping after the update under way"
        else:
            what = "stopping after the update under way and its checkpoint"
        return f"[train] {name}: {what} ({name} again: at once)"

    def _stop(self, logger, step, signum, evaluation_abandoned=False):
        """Ends the run after update `step` (and the evaluation of it that `signum` abandoned) on signal `signum`;
        returns the exit status."""
        # The other ranks wait for rank 0's checkpoint: a launcher ends the whole job once one process exits with
        # a failure status.
        self.world.broadcast_object(None)
        if self.config.runtime.benchmark:
            saved = "a benchmark writes no checkpoint"
        elif evaluation_abandoned:
            saved = (f"its evaluation abandoned; checkpoint of step {step} written: the same command evaluates it, "
                     "then resumes from it")
        else:
            saved = f"checkpoint of step {step} written: the same command resumes from it"
        logger.event("stopped", step=step, reason=f"{stop_signals.name(signum)}; {saved}")
        return status.stopped_by(signum)

    def _skipped_summary(self):
        """{skipped_steps: count} under float16 loss scaling, else {}."""
        return dict(skipped_steps=int(self.skipped_steps.numpy())) if self.loss_scaled else {}

    def _report_benchmark(self, logger, step_times):
        """Rank 0 prints the job's img/s and, under Horovod, each worker's (their mean over the single-
        process figure is the scaling efficiency)."""
        local_batch = self.global_batch_size // self.num_workers
        per_worker = self.world.allgather_object(local_batch * len(step_times) / float(np.sum(step_times)))
        if not self.world.is_chief:
            return
        report_benchmark("train", step_times, self.global_batch_size, self.policy, logger)
        if self.num_workers > 1:
            rates = "  ".join(f"{rate:.3f}" for rate in per_worker)
            print(f"train per-worker throughput: {np.mean(per_worker):.3f} img/s over {self.num_workers} workers "
                  f"(rank 0..{self.num_workers - 1}: {rates})", flush=True)
            logger.event("benchmark workers", echo=False, workers=self.num_workers, per_worker_img_per_s=per_worker)

    def _frozen_bn_from_scratch(self):
        """Batch norm frozen without pretrained weights: the identity, so a deep ResNet's activations explode."""
        return self.config.model.freeze_bn and not self.config.pretrained()

    def _initialisation_notice(self):
        """One line on how batch norm and the first blocks train in a new run without pretrained weights
        (the rule of Config.resolved, or a setting that defies it), else None."""
        model = self.config.model
        if self.config.pretrained():
            return None
        if self._frozen_bn_from_scratch():
            return ("warning: batch norm is frozen (model.freeze_bn=true) without pretrained weights: it is then "
                    "the identity and a deep ResNet trained from scratch is likely to diverge (drop the override, "
                    "or give --backbone_checkpoint)")
        frozen = f"blocks {list(model.freeze_blocks)} frozen" if model.freeze_blocks else "no block frozen"
        return (f"no pretrained weights: training from scratch with batch norm on batch statistics and {frozen} "
                "(with --backbone_checkpoint, NVIDIA's defaults for a pretrained backbone: batch norm frozen, "
                "the stem and the first residual stage frozen; --config_override model.freeze_bn / "
                "model.freeze_blocks set them)")

    def _schedule_notice(self):
        """One line when the learning rate schedule does not do at this run's length what its flags read, else None:
        a warm-up (at least train.warmup_min_steps updates) that outlasts the run or lasts until the first drop
        (a small data set) leaves no update at the full rate, and boundaries at or past the run's end (--epochs
        shortened under the default schedule, whose drops come at epochs 8 and 10) never act."""
        if self.config.runtime.benchmark:
            return None
        train, steps, total = self.config.train, self.schedule.boundaries, self.total_steps
        warmup = (f"the learning rate's warm-up (to update {steps[0]}: --learning_rate_boundaries "
                  f"{train.learning_rate_boundaries[0]:g} epochs, at least train.warmup_min_steps = "
                  f"{train.warmup_min_steps} updates)")
        if steps[0] >= total:
            return (f"{warmup} outlasts the run ({total} updates): no update is at the full rate; lower "
                    "train.warmup_min_steps (--config_override) for a run this short")
        if len(steps) > 1 and steps[0] >= steps[1]:
            return (f"{warmup} lasts until the rate's first drop (epoch {train.learning_rate_boundaries[1]:g}): no "
                    "update is at the full rate; lower train.warmup_min_steps (--config_override) for a data set "
                    "this small")
        late = [epoch for epoch, step in zip(train.learning_rate_boundaries[1:], steps[1:]) if step >= total]
        if late:
            return (f"--learning_rate_boundaries {' '.join(f'{b:g}' for b in late)} lie at or past the run's end "
                    f"(--epochs {train.epochs}): the learning rate changes they set never come; give boundaries "
                    "within the run for it to decay")
        return None

    def _check_finite(self, step, values):
        # Loss scaling overflows the gradients, never the loss: a non-finite loss is divergence in any policy.
        if all(math.isfinite(v) for v in values.values()):
            return
        terms = ", ".join(f"{k}={v:.4g}" for k, v in values.items())
        if self._frozen_bn_from_scratch():
            cause = ("likely cause: batch norm is frozen (model.freeze_bn=true) without pretrained weights, so it is "
                     "the identity and the randomly initialised ResNet's activations explode; train it with "
                     "--finetune_bn or load --backbone_checkpoint")
        else:
            cause = ("lower the learning rate (--learning_rate_values), lengthen the warm-up "
                     "(train.warmup_min_steps) or clip the gradients (--clip_grad_norm)")
        raise NonFiniteLossError(f"non-finite loss at step {step} ({terms}); no checkpoint was written for it; "
                                 f"{cause}")

    def _log_metrics(self, logger, step, last, window, step_times, timer_start):
        means = {name: float(np.mean([w[name] for w in window])) for name in window[0]}
        rate = None
        if step_times:
            rate = self.global_batch_size * len(step_times) / (time.perf_counter() - timer_start)
        means["learning_rate"] = float(self.schedule(step - 1))
        means["epoch"] = (step - 1) // self.steps_per_epoch + 1
        if self.loss_scaled:
            means["amp_loss_scale"] = float(self.optimizer.dynamic_scale)
            means.update(self._skipped_summary())
        if rate:
            means["img_per_s"] = rate
        parts = [f"step {step}/{last}", f"epoch {means['epoch']}/{self.config.train.epochs}"]
        parts += [f"{k} {v:.4f}" for k, v in means.items() if k.startswith("loss_")]
        parts.append(f"lr {means['learning_rate']:.5g}")
        if self.loss_scaled:
            parts.append(f"loss scale {means['amp_loss_scale']:g} ({means['skipped_steps']} steps skipped)")
        if rate:
            parts += [f"{rate:.2f} img/s", f"ETA {format_duration((last - step) * self.global_batch_size / rate)}"]
        logger.metrics(step, means, "[train] " + "  ".join(parts))


def run(config, world=SINGLE_PROCESS):
    """Entry point of `main.py train`, in the process `world` (runtime.distributed.World): trains while rank 0
    holds <model_dir>/train.lock (runtime.model_dir_lock).

    Raises ModelDirLocked (a ConfigError: status 2) on rank 0 when another trainer holds the lock; the other
    ranks then return status 2 silently.
    """
    with contextlib.ExitStack() as held:
        refusal = None
        if world.is_chief:  # only rank 0 writes model_dir
            try:
                held.enter_context(model_dir_lock.hold(config.runtime.model_dir, config.runtime.break_lock))
            except model_dir_lock.ModelDirLocked as err:
                refusal = err
        # Every rank stops when rank 0 could not take the lock: rank 0 with the one line, the others silently.
        refused = world.broadcast_object(None if refusal is None else str(refusal))
        if refusal is not None:
            raise refusal
        if refused is not None:
            return status.BAD_INPUT
        return Trainer(config, world).run()
