"""The global Keras precision policy of a run (train, eval, infer and export all set it the same way)."""

import sys
import time

import keras
import tensorflow as tf

from mrcnn_tf2.devices import cpu_flags, run_device
from mrcnn_tf2.runtime.distributed import SINGLE_PROCESS

# /proc/cpuinfo flags of CPUs with bfloat16 arithmetic. Without them TF emulates bfloat16, and measured on
# an AVX2-only CPU a mixed_bfloat16 train step was 8x slower than float32 (a 3x3 conv's backprop 40x).
BFLOAT16_CPU_FLAGS = ("avx512_bf16", "amx_bf16")


def cpu_has_bfloat16(cpuinfo="/proc/cpuinfo"):
    """True when the CPU lists a bfloat16 instruction set flag; None when `cpuinfo` cannot be read."""
    flags = cpu_flags(cpuinfo)
    return None if flags is None else any(flag in flags for flag in BFLOAT16_CPU_FLAGS)


def bfloat16_speedup(size=2048, rounds=3):
    """How many times faster this CPU multiplies two [size, size] matrices in bfloat16 than in float32: the
    ratio of the best of `rounds` timings of each, alternated (the first of each also compiles oneDNN's
    kernel). Above 1 where bfloat16 is faster."""
    with tf.device("/CPU:0"):
        matrix = tf.random.stateless_uniform([size, size], seed=[0, 0])
        operands = {dtype: tf.cast(matrix, dtype) for dtype in (tf.float32, tf.bfloat16)}
        best = dict.fromkeys(operands, float("inf"))
        for _ in range(rounds):
            for dtype, operand in operands.items():
                start = time.perf_counter()
                tf.linalg.matmul(operand, operand).numpy()
                best[dtype] = min(best[dtype], time.perf_counter() - start)
    return best[tf.float32] / best[tf.bfloat16]


def _cpu_amp_dtype():
    """(dtype, why): "bfloat16" and None where this CPU computes bfloat16 faster than float32, else None and
    the reason --amp falls back to float32."""
    if cpu_has_bfloat16() is False:
        return None, (f"this CPU has no bfloat16 instructions ({' or '.join(BFLOAT16_CPU_FLAGS)} in /proc/cpuinfo), "
                      "where mixed_bfloat16 runs several times slower than float32")
    # Instructions are not speed: a 2-core Xeon with avx512_bf16 and no AMX ran bfloat16's kernels at 0.55-0.6x
    # of float32's and the training step at 0.4x (docs/PERFORMANCE.md).
    speedup = bfloat16_speedup()
    if speedup < 1:
        return None, (f"this CPU multiplies matrices in bfloat16 at {speedup:.2f}x its float32 speed (measured at "
                      "start-up), where mixed_bfloat16 trains and infers slower than float32")
    return "bfloat16", None


def set_precision(amp, amp_dtype="auto", world=SINGLE_PROCESS):
    """Sets the global Keras policy and returns its name.

    Without amp: float32. With amp, `amp_dtype` (config.AMP_DTYPES) picks the computation dtype: float16 is
    mixed_float16, which training loss-scales (it runs on a CPU too, slowly, as it runs on a GPU); bfloat16
    is mixed_bfloat16; auto is float16 on a GPU (`devices.run_device`) and bfloat16 on a CPU that computes
    it faster than float32 (its instructions in /proc/cpuinfo, or unreadable, and `bfloat16_speedup` at
    least 1), else float32 with a warning. In a job (`world`: runtime.distributed.World) rank 0 decides for all.
    """
    policy = "float32"
    if amp:
        dtype = amp_dtype
        if dtype == "auto" and run_device() == "GPU":
            dtype = "float16"
        elif dtype == "auto":
            dtype, why = world.broadcast_object(_cpu_amp_dtype() if world.is_chief else None)
            if why is not None and world.is_chief:
                print(f"[amp] warning: {why}: --amp is ignored and the run uses float32 (--amp_dtype bfloat16 or "
                      "float16 forces one)", file=sys.stderr, flush=True)
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
        return "precision float32" + (" (--amp fell back: this CPU computes bfloat16 no faster)" if amp else "")
    line = f"precision {policy}: {policy.removeprefix('mixed_')} compute, float32 variables"
    return line + ("; dynamic loss scaling" if loss_scaled else "")
