"""The command line, `mrcnn-tf2 train|eval|infer|export [flags]` or `python main.py ...` (see --help).

TensorFlow reads its environment variables once, when it is first imported, so `main` sets them after
parsing the flags and before importing anything that imports TensorFlow; the parsing modules never do.
"""

import contextlib
import importlib
import json
import logging
import os
import re
import sys

from mrcnn_tf2 import console, status
from mrcnn_tf2.arguments import check_inputs, parse
from mrcnn_tf2.config import ConfigError

# Each mode is the `run(config)` of its runtime module.
RUNNERS = {
    "train": "mrcnn_tf2.runtime.train",
    "eval": "mrcnn_tf2.runtime.evaluate",
    "infer": "mrcnn_tf2.runtime.infer",
    "export": "mrcnn_tf2.runtime.export",
}

# The modes that run as one job under horovodrun / mpirun: training, and evaluation (each rank evaluates its
# share of the validation records). Their runners take `run(config, world)`.
DISTRIBUTED_MODES = ("train", "eval")

# TensorFlow's start-up lines that say nothing a user acts on: the oneDNN banner, the CUDA probing of a
# machine without a GPU, the CPU-instructions notice. TensorFlow >= 2.16 writes them through absl before
# its log level applies, so TF_CPP_MIN_LOG_LEVEL alone cannot hide them. Also oneDNN's notice that this CPU
# lacks its kernels of a dtype ("oneDNN supports DT_HALF only on platforms with AVX-512"), logged as an
# error although TensorFlow then runs its own kernels; import_tensorflow makes it come at start-up.
STARTUP_NOISE = re.compile(
    r"All log messages before absl::InitializeLog|cudart_stub\.cc|cuda_platform\.cc.*cuInit|"
    r"port\.cc.*oneDNN custom operations|cpu_feature_guard\.cc|^To enable the following instructions|"
    r"Unable to register cu(DNN|FFT|BLAS) factory|TF-TRT Warning|computation_placer\.cc|"
    r"util\.cc.*oneDNN supports DT_\w+ only on platforms with AVX-512")


def quiet_tensorflow_start(enabled=True):
    """A block whose writes to the process's stderr come out after it without STARTUP_NOISE's lines
    (`console.stderr_without`); nothing is held back unless `enabled`."""
    return console.stderr_without(STARTUP_NOISE.search) if enabled else contextlib.nullcontext()


def set_tensorflow_environment(onednn=None, environ=os.environ, verbose=False):
    """Sets TensorFlow's start-up variables in `environ`, unless the user set them (or `onednn` is given).

    TF_CPP_MIN_LOG_LEVEL=2: TensorFlow's C++ info and warning lines drown the progress display; 0 shows
    them, and is the rule with `verbose` (--verbose), which asks for them.
    TF_ENABLE_ONEDNN_OPTS: oneDNN's CPU kernels on, on every CPU. TensorFlow's own default is on only for
    CPUs with AVX-512 VNNI or bfloat16 instructions; oneDNN (with the model's own kernel gradients) measured
    faster on both kinds (docs/PERFORMANCE.md, "oneDNN"). `onednn` ('on' / 'off', the --onednn flag) wins
    over the user's variable.

    Returns whether TensorFlow's start-up lines are to be shown as they come (see quiet_tensorflow_start):
    when the user set TF_CPP_MIN_LOG_LEVEL, or with `verbose`.
    """
    user_log_level = "TF_CPP_MIN_LOG_LEVEL" in environ
    environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "0" if verbose else "2")
    if onednn is not None:
        environ["TF_ENABLE_ONEDNN_OPTS"] = "1" if onednn == "on" else "0"
    environ.setdefault("TF_ENABLE_ONEDNN_OPTS", "1")
    return user_log_level or verbose


@contextlib.contextmanager
def _without_scikit_learn():
    """Inside the block, `import sklearn` fails, unless scikit-learn is imported already; after it, it imports.

    Keras, imported by TensorFlow, imports scikit-learn (with SciPy's statistics) for its scikit-learn
    wrappers when it is installed, as the openvino extra's 8-bit quantizer installs it: 1.3 s of every
    command's start-up for wrappers the package never uses. Keras then takes scikit-learn to be absent; the
    quantizer, imported later, imports it as usual."""
    if "sklearn" in sys.modules:
        yield
        return
    sys.modules["sklearn"] = None  # Python's marker of a module that must not be imported
    try:
        yield
    finally:
        if sys.modules.get("sklearn", "") is None:
            del sys.modules["sklearn"]


def import_tensorflow(onednn=None, verbose=False):
    """TensorFlow, as every command of the package starts it: environment set (set_tensorflow_environment),
    imported and its devices initialised (CUDA's probing happens there) with the start-up noise held back
    (quiet_tensorflow_start); with `verbose`, nothing held back and TensorFlow's Python logger at INFO.
    Returns the `tensorflow` module. Where TensorFlow is not installed (a Python outside .venv), exits with
    status 2 after one line naming the fix.
    """
    try:
        with quiet_tensorflow_start(enabled=not set_tensorflow_environment(onednn, verbose=verbose)), \
                _without_scikit_learn():
            import tensorflow as tf

            if not tf.config.list_physical_devices("GPU"):
                # oneDNN says once per process, at the first op in a dtype it lacks kernels for on this CPU,
                # that TensorFlow's own kernels run instead (STARTUP_NOISE): under --amp that is mid-run.
                # An op in each --amp dtype makes it come here, held back. Not with a GPU: an op now would
                # initialise the GPUs before a Horovod rank picks its own (runtime.distributed).
                for dtype in (tf.float16, tf.bfloat16):
                    tf.zeros([1], dtype)
    except ModuleNotFoundError as err:
        if err.name != "tensorflow":
            raise
        print(f"error: TensorFlow is not installed for {sys.executable}: run `make setup`, then "
              "`source .venv/bin/activate` (or run .venv/bin/python)", file=sys.stderr)
        sys.exit(status.BAD_INPUT)
    if verbose:
        tf.get_logger().setLevel(logging.INFO)
    return tf


def start_world(mode):
    """The process world of `mode` (runtime.distributed.World): Horovod's under a launcher for the modes in
    DISTRIBUTED_MODES. Raises distributed.LaunchError when the launcher and Horovod disagree, or when a
    launcher started several processes of a one-process mode (they would all write the same files)."""
    from mrcnn_tf2.runtime import distributed

    if mode in DISTRIBUTED_MODES:
        return distributed.init_world()
    launch = distributed.read_launch()
    if launch is not None and launch.size > 1:
        raise distributed.LaunchError(
            f"{mode} runs in one process, but {launch.launcher} started {launch.size} "
            f"({launch.size_variable}={launch.size}): run it without a launcher", launch.rank)
    return distributed.SINGLE_PROCESS


def main(argv=None) -> int:
    """Runs one mode with `argv` (default: sys.argv[1:]); returns the exit status (mrcnn_tf2.status), or 128 + the
    signal's number after Ctrl-C, SIGTERM or SIGHUP (in training the second one: the first stops it after a
    checkpoint, runtime.stop_signals), once the run has unwound (status.run_stoppable)."""
    return status.run_stoppable(lambda: _run(argv), "main.py")


def _run(argv):
    args, config, sources = parse(argv, with_sources=True)
    if args.print_config:
        print(json.dumps({"mode": args.mode, "sources": sources, **config.to_dict()}, indent=2))
        return status.OK
    try:
        check_inputs(args.mode, config)
    except ConfigError as err:
        print(f"main.py: error: {err}", file=sys.stderr)
        return status.BAD_INPUT
    import_tensorflow(args.onednn, config.runtime.verbose)
    from mrcnn_tf2.runtime import distributed

    try:
        world = start_world(args.mode)
    except distributed.LaunchError as err:
        if err.rank == 0:  # one line for the job, not one per process
            print(f"main.py: error: {err}", file=sys.stderr)
        return status.BAD_INPUT
    runner = importlib.import_module(RUNNERS[args.mode])
    from mrcnn_tf2.ops.fused import CustomOpsUnavailable

    try:
        return (runner.run(config, world) if args.mode in DISTRIBUTED_MODES else runner.run(config)) or status.OK
    except CustomOpsUnavailable as err:  # --custom_ops on, and the library cannot be used
        print(f"main.py: error: --custom_ops on: {err}", file=sys.stderr)
        return status.BAD_INPUT
    except ConfigError as err:  # found once the run reads its inputs (e.g. the backbone checkpoint's metadata)
        print(f"main.py: error: {err}", file=sys.stderr)
        return status.BAD_INPUT
