"""The global Keras precision policy of a run (train, eval, infer and export all set it the same way)."""

import sys

import keras
import tensorflow as tf

# /proc/cpuinfo flags of CPUs with bfloat16 arithmetic. Without them TF emulates bfloat16, and measured on
# an AVX2-only CPU a mixed_bfloat16 train step was 8x slower than float32 (a 3x3 conv's backprop 40x).
BFLOAT16_CPU_FLAGS = ("avx512_bf16", "amx_bf16")


def cpu_has_bfloat16(cpuinfo="/proc/cpuinfo"):
    """True when the CPU lists a bfloat16 instruction set flag; None when `cpuinfo` cannot be read."""
    try:
        with open(cpuinfo) as f:
            flags = set(f.read().split())
    except OSError:
        return None
    return any(flag in flags for flag in BFLOAT16_CPU_FLAGS)


def set_precision(amp):
    """Sets the global Keras policy and returns its name.

    With amp: mixed_float16 (loss-scaled) on GPU; on CPU mixed_bfloat16 where the CPU has bfloat16
    instructions (or cannot tell), else float32 with a warning, since emulated bfloat16 is slower than
    float32. Without amp: float32.
    """
    policy = "float32"
    if amp:
        if tf.config.list_physical_devices("GPU"):
            policy = "mixed_float16"
        elif cpu_has_bfloat16() is False:
            print(f"[amp] warning: this CPU has no bfloat16 instructions ({' or '.join(BFLOAT16_CPU_FLAGS)} "
                  "in /proc/cpuinfo), where mixed_bfloat16 runs several times slower than float32: --amp is "
                  "ignored and the run uses float32", file=sys.stderr, flush=True)
        else:
            policy = "mixed_bfloat16"
    keras.mixed_precision.set_global_policy(policy)
    return policy
