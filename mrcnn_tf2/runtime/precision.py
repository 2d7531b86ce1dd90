"""The global Keras precision policy of a run (train, eval, infer and export all set it the same way)."""

import sys

import keras

from mrcnn_tf2.devices import run_device

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


def set_precision(amp, amp_dtype="auto"):
    """Sets the global Keras policy and returns its name.

    Without amp: float32. With amp, `amp_dtype` (config.AMP_DTYPES) picks the computation dtype: float16 is
    mixed_float16, which training loss-scales (it runs on a CPU too, slowly, as it runs on a GPU); bfloat16
    is mixed_bfloat16; auto is float16 on a GPU (`devices.run_device`) and bfloat16 on a CPU that has
    bfloat16 instructions (or cannot tell), else float32 with a warning, since emulated bfloat16 is slower
    than float32 there.
    """
    policy = "float32"
    if amp:
        dtype = amp_dtype
        if dtype == "auto":
            dtype = "float16" if run_device() == "GPU" else "bfloat16"
            if dtype == "bfloat16" and cpu_has_bfloat16() is False:
                print(f"[amp] warning: this CPU has no bfloat16 instructions ({' or '.join(BFLOAT16_CPU_FLAGS)} "
                      "in /proc/cpuinfo), where mixed_bfloat16 runs several times slower than float32: --amp is "
                      "ignored and the run uses float32 (--amp_dtype bfloat16 or float16 forces one)",
                      file=sys.stderr, flush=True)
                dtype = None
        if dtype is not None:
            policy = f"mixed_{dtype}"
    keras.mixed_precision.set_global_policy(policy)
    return policy


def describe_precision(policy, amp, loss_scaled=False):
    """The run's precision in one line, which train and the predictor print at start-up.

    Args:
      policy: the name set_precision returned.
      amp: --amp, which tells set_precision's float32 fallback from a float32 run.
      loss_scaled: a training run that scales its loss (mixed_float16).
    """
    if policy == "float32":
        return "precision float32" + (" (--amp fell back: this CPU has no bfloat16 instructions)" if amp else "")
    line = f"precision {policy}: {policy.removeprefix('mixed_')} compute, float32 variables"
    return line + ("; dynamic loss scaling" if loss_scaled else "")
