"""The device a run computes on, which the device-dependent choices (ops, precision) ask for.

`MRCNN_TF2_FAKE_GPU=1` in the environment makes a CPU-only process answer "GPU" here, so that tests on a
CPU reach the choices a GPU run makes (which ops are traced, which precision `--amp` picks); the computation
itself still runs on the CPU.
"""

import os

FAKE_GPU_ENV = "MRCNN_TF2_FAKE_GPU"


def fake_gpu():
    """True when the environment asks to make the GPU choices on a CPU (`MRCNN_TF2_FAKE_GPU=1`)."""
    value = os.environ.get(FAKE_GPU_ENV, "0")
    if value not in ("0", "1"):
        raise ValueError(f"{FAKE_GPU_ENV}={value!r}: must be 0 or 1")
    return value == "1"


def cpu_flags(cpuinfo="/proc/cpuinfo"):
    """The set of instruction-set flags /proc/cpuinfo lists for the CPU (avx512_bf16, amx_bf16, ...), or None
    when it cannot be read."""
    try:
        with open(cpuinfo) as f:
            return set(f.read().split())
    except OSError:
        return None


def run_device():
    """'GPU' when TensorFlow sees a GPU (or one is faked), else 'CPU': where the model's ops are placed."""
    if fake_gpu():
        return "GPU"
    import tensorflow as tf  # this module is imported by config-level code that must not need TensorFlow

    return "GPU" if tf.config.list_physical_devices("GPU") else "CPU"
