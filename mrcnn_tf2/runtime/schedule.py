"""Learning-rate schedules: a linear warm-up, then NVIDIA's piecewise constant rates or a cosine decay, scaled by
the global batch."""

import math

import keras
import tensorflow as tf


# The benchmark's constant rate, as a fraction of the rate after the warm-up: a model from scratch at the
# full rate with no warm-up is unstable (ResNet-50 at 832x1344, batch 2: the box head's class loss went
# from 0.65 to 28.6 within two steps at step 11), and the rate the warm-up passes at a tenth of its length
# is not.
BENCHMARK_RATE_FRACTION = 0.1


class _Warmup(keras.optimizers.schedules.LearningRateSchedule):
    """Learning rate at optimizer update `step` (0-based): from `init_value` at step 0 it rises linearly to
    `values[0]` at `boundaries[0]`, then follows the subclass's `_after_warmup(step)`."""

    def __call__(self, step):
        step = tf.cast(step, tf.float32)
        warmup = self.init_value + (self.values[0] - self.init_value) * step / float(max(self.boundaries[0], 1))
        return tf.where(step < self.boundaries[0], warmup, self._after_warmup(step))


class WarmupPiecewiseConstant(_Warmup):
    """After the warm-up, from `boundaries[i]` on the rate is `values[i]`. Boundaries are in updates, increasing.

    Example: WarmupPiecewiseConstant(0.0, [100, 800], [0.1, 0.01]) gives 0.0 at step 0, 0.05 at 50,
    0.1 from 100 and 0.01 from 800.
    """

    def __init__(self, init_value, boundaries, values):
        if len(boundaries) != len(values) or not values:
            raise ValueError(f"{len(values)} values for {len(boundaries)} boundaries: they pair up, at least one")
        self.init_value = float(init_value)
        self.boundaries = [int(b) for b in boundaries]
        self.values = [float(v) for v in values]

    def _after_warmup(self, step):
        rate = tf.constant(self.values[0])
        for boundary, value in zip(self.boundaries[1:], self.values[1:]):
            rate = tf.where(step >= boundary, value, rate)
        return rate

    def get_config(self):
        return {"init_value": self.init_value, "boundaries": self.boundaries, "values": self.values}


class WarmupCosine(_Warmup):
    """After the warm-up, which ends at update `warmup_steps` (the one boundary), half a cosine from `peak` down to
    `end` at update `total_steps`, and `end` from there on (detectron2's and Model Garden's cosine decay).

    Example: WarmupCosine(0.0, 100, 300, 0.1, 0.001) gives 0.05 at step 50, 0.1 at 100, 0.0505 at 200 and 0.001
    from 300.
    """

    def __init__(self, init_value, warmup_steps, total_steps, peak, end):
        self.init_value = float(init_value)
        self.boundaries = [int(warmup_steps)]
        self.total_steps = int(total_steps)
        self.values = [float(peak), float(end)]

    def _after_warmup(self, step):
        decay_steps = float(max(self.total_steps - self.boundaries[0], 1))
        progress = tf.clip_by_value((step - self.boundaries[0]) / decay_steps, 0.0, 1.0)
        peak, end = self.values
        return end + 0.5 * (peak - end) * (1.0 + tf.cos(math.pi * progress))

    def get_config(self):
        return {"init_value": self.init_value, "warmup_steps": self.boundaries[0], "total_steps": self.total_steps,
                "peak": self.values[0], "end": self.values[1]}


def learning_rate_schedule(train_config, steps_per_epoch, global_batch_size, constant=False):
    """The schedule of a TrainConfig at `steps_per_epoch` updates of `global_batch_size` images.

    The linear scaling rule: `init_learning_rate` and `learning_rate_values` are the rates of a global
    batch (images per update over all workers and accumulated batches) of `learning_rate_batch_size`
    images, so a run at another batch or number of workers takes them times global_batch_size /
    learning_rate_batch_size. Boundaries go from epochs to updates; the warm-up lasts at least
    `warmup_min_steps` updates (but under the piecewise schedule ends at the second boundary), so a short epoch
    still ramps up. The cosine schedule decays from the first value to the last at the run's last update
    (`epochs` x `steps_per_epoch`) and uses no boundary but the warm-up's.

    constant=True gives BENCHMARK_RATE_FRACTION of the rate after the warm-up at every step (benchmark
    mode: a throughput figure must not depend on where the warm-up is, and a step costs the same at any
    rate).
    """
    scale = global_batch_size / train_config.learning_rate_batch_size
    values = [v * scale for v in train_config.learning_rate_values]
    if constant:
        rate = values[0] * BENCHMARK_RATE_FRACTION
        return WarmupPiecewiseConstant(rate, [0], [rate])
    boundaries = [round(b * steps_per_epoch) for b in train_config.learning_rate_boundaries]
    warmup_end = max(boundaries[0], train_config.warmup_min_steps)
    init = train_config.init_learning_rate * scale
    if train_config.learning_rate_schedule == "cosine":
        return WarmupCosine(init, warmup_end, train_config.epochs * steps_per_epoch, values[0], values[-1])
    boundaries[0] = min(warmup_end, boundaries[1]) if len(boundaries) > 1 else warmup_end
    return WarmupPiecewiseConstant(init, boundaries, values)
