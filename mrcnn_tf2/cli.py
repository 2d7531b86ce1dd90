"""The command line, `mrcnn-tf2 train|eval|infer|export [flags]` or `python main.py ...` (see --help).

This module sets TensorFlow's environment variables when it is imported, so it must be imported before
TensorFlow is (the `mrcnn-tf2` entry point and main.py import nothing else first).
"""

import importlib
import json
import os
import sys

# TensorFlow's C++ info and warning lines (oneDNN, CUDA probing) drown the progress display; set the
# variable to 0 to see them. It must be set before TensorFlow is first imported.
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
# oneDNN's CPU kernels, which TensorFlow turns on by itself only on AVX-512 class CPUs. With the model's own
# convolution kernel gradients (mrcnn_tf2/ops/conv.py) they made ResNet-50 at 832x1344 train 1.6x and
# predict 1.5x (batch 1) to 1.8x (batch 2) faster on a 2-core AVX2 CPU, and the demo's 128x128 train step
# 1.3x (docs/PERFORMANCE.md). Set the variable to 0 for TensorFlow's own kernels.
os.environ.setdefault("TF_ENABLE_ONEDNN_OPTS", "1")

from mrcnn_tf2.arguments import check_inputs, parse  # noqa: E402 (after the environment variables)
from mrcnn_tf2.config import ConfigError  # noqa: E402

# Each mode is the `run(config)` of its runtime module.
RUNNERS = {
    "train": "mrcnn_tf2.runtime.train",
    "eval": "mrcnn_tf2.runtime.evaluate",
    "infer": "mrcnn_tf2.runtime.infer",
    "export": "mrcnn_tf2.runtime.export",
}


def main(argv=None) -> int:
    """Runs one mode with `argv` (default: sys.argv[1:]); returns the exit status (2: bad flags or inputs)."""
    args, config = parse(argv)
    if args.print_config:
        print(json.dumps({"mode": args.mode, **config.to_dict()}, indent=2))
        return 0
    try:
        check_inputs(args.mode, config)
    except ConfigError as err:
        print(f"main.py: error: {err}", file=sys.stderr)
        return 2
    runner = importlib.import_module(RUNNERS[args.mode])
    from mrcnn_tf2.ops.fused import CustomOpsUnavailable  # imports TensorFlow: after the argument checks

    try:
        return runner.run(config) or 0
    except CustomOpsUnavailable as err:  # --custom_ops on, and the library cannot be used
        print(f"main.py: error: --custom_ops on: {err}", file=sys.stderr)
        return 2
    except ConfigError as err:  # found once the run reads its inputs (e.g. the backbone checkpoint's metadata)
        print(f"main.py: error: {err}", file=sys.stderr)
        return 2
