"""NVIDIA's learning-rate schedule: linear warm-up, then piecewise constant, scaled by the global batch."""

import keras
import tensorflow as tf


class WarmupPiecewiseConstant(keras.optimizers.schedules.LearningRateSchedule):
    """Learning rate at optimizer update `step` (0-based).

    From `init_value` at step 0 it rises linearly to `values[0]` at `boundaries[0]`; from `boundaries[i]`
    on it is `values[i]`. Boundaries are in updates, increasing.

    Example: WarmupPiecewiseConstant(0.0, [100, 800], [0.1, 0.01]) gives 0.0 at step 0, 0.05 at 50,
    0.1 from 100 and 0.01 from 800.
    """

    def __init__(self, init_value, boundaries, values):
        if len(boundaries) != len(values) or not values:
            raise ValueError(f"{len(values)} values for {len(boundaries)} boundaries: they pair up, at least one")
        self.init_value = float(init_value)
        self.boundaries = [int(b) for b in boundaries]
        self.values = [float(v) for v in values]

    def __call__(self, step):
        step = tf.cast(step, tf.float32)
        warmup_end = float(max(self.boundaries[0], 1))
        warmup = self.init_value + (self.values[0] - self.init_value) * step / warmup_end
        rate = tf.where(step < self.boundaries[0], warmup, self.values[0])
        for boundary, value in zip(self.boundaries[1:], self.values[1:]):
            rate = tf.where(step >= boundary, value, rate)
        return rate

    def get_config(self):
        return {"init_value": self.init_value, "boundaries": self.boundaries, "values": self.values}


def learning_rate_schedule(train_config, steps_per_epoch, global_batch_size):
    """The schedule of a TrainConfig: boundaries from epochs to updates, values (per image) x global batch.

    As NVIDIA's, `learning_rate_values` and `init_learning_rate` are per image of the global batch
    (images per update over all workers and accumulated batches), so the same flags keep their meaning
    when the batch or the number of workers changes.
    """
    return WarmupPiecewiseConstant(
        init_value=train_config.init_learning_rate * global_batch_size,
        boundaries=[round(b * steps_per_epoch) for b in train_config.learning_rate_boundaries],
        values=[v * global_batch_size for v in train_config.learning_rate_values],
    )
