"""The global Keras precision policy of a run (train, eval, infer and export all set it the same way)."""

import keras
import tensorflow as tf


def set_precision(amp):
    """Sets the global Keras policy: mixed_float16 on GPU or mixed_bfloat16 on CPU with amp, else float32.

    Returns the policy's name.
    """
    policy = "float32"
    if amp:
        policy = "mixed_float16" if tf.config.list_physical_devices("GPU") else "mixed_bfloat16"
    keras.mixed_precision.set_global_policy(policy)
    return policy
