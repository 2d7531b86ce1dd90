"""An exponential moving average of the model's weights during training (train.ema_decay), as TF Model Garden's
and detectron2's EMA: evaluation, inference, export and fine-tuning use the average instead of the last step's
weights, which a long schedule's final steps leave noisy (eval.use_ema false reads those for all but fine-tuning).

The average lives in a second model of the same build (the `shadow`), never run in training, so that a training
checkpoint holds it under AVERAGE_KEY with the model's own object structure: a loader reads it into a model as it
would read the model (`tf.train.Checkpoint(ema_model=model)`), and nothing else about checkpoints changes.
"""

import tensorflow as tf

# A training checkpoint's averaged weights, beside its MODEL_KEY ('model').
AVERAGE_KEY = "ema_model"


class WeightAverage:
    """The trainable variables of `shadow` follow those of `model` as an exponential moving average; its other
    variables (batch norm's moving statistics, themselves averages) are copies of the model's.

    Args:
      model: the built model in training.
      shadow: a built model of the same build (same variables in the same order and shapes).
      decay: the average's decay d in [0, 1]. After update n (1-based) the average a becomes
        a - (1 - d_n) * (a - w) with d_n = min(d, (1 + n) / (10 + n)), the ramp of tf.train.ExponentialMovingAverage's
        num_updates, so that the first updates, far from where training goes, fade fast.
    """

    def __init__(self, model, shadow, decay):
        self.shadow, self.decay = shadow, float(decay)
        if (len(shadow.trainable_variables), len(shadow.non_trainable_variables)) != (
                len(model.trainable_variables), len(model.non_trainable_variables)):
            raise ValueError("the shadow model has another number of variables than the model")
        self.averaged = list(zip(shadow.trainable_variables, model.trainable_variables))
        self.copied = list(zip(shadow.non_trainable_variables, model.non_trainable_variables))
        for average, variable in self.averaged + self.copied:
            if average.shape != variable.shape:
                raise ValueError(f"the shadow model's {average.path} {average.shape} does not fit the model's "
                                 f"{variable.path} {variable.shape}: they are not of one build")

    def update(self, updates):
        """Moves the average toward the model's weights after its update number `updates` (int scalar tensor, >= 1:
        the optimizer's iterations once it has applied the update)."""
        n = tf.cast(updates, tf.float32)
        decay = tf.minimum(self.decay, (1.0 + n) / (10.0 + n))
        for average, variable in self.averaged:
            average.assign_sub(tf.cast(1.0 - decay, average.dtype) * (average - variable))
        for copy, variable in self.copied:
            copy.assign(variable)

    def reset(self):
        """Makes the average the model's weights (a new run, from initial or loaded weights)."""
        for average, variable in self.averaged + self.copied:
            average.assign(variable)


def holds_average(prefix):
    """Whether the training checkpoint `prefix` holds averaged weights (read from its index alone)."""
    return any(name.startswith(AVERAGE_KEY + "/") for name, _ in tf.train.list_variables(prefix))
