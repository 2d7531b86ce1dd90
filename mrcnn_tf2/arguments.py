"""The command line: every flag of `main.py`, with NVIDIA TF2 Mask R-CNN's names and defaults.

Each flag sets the config field of the same name (`--finetune_bn` sets `model.freeze_bn` to False), and
its default is read from `mrcnn_tf2.config`, so a default lives in one place. `--config_override KEY=VALUE`
reaches any config field by its dotted path and is applied after the flags. Under both lie the config a
training run saved in its model_dir and `--preset NAME` (mrcnn_tf2.presets): see `config_with_sources`.

This module must not import TensorFlow: `--help` and `--print_config` stay fast.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import re

from mrcnn_tf2 import presets
from mrcnn_tf2.config import (AMP_DTYPES, BACKBONES, CUSTOM_OPS_MODES, EXPORT_FORMATS, MODEL_DEFINING_KEYS,
                              PER_COMMAND_KEYS, PER_COMMAND_SECTIONS, SAVED_CONFIG_FILE, Config, ConfigError,
                              exported_files, field_paths, load_saved_config, show_value)
from mrcnn_tf2.status import BAD_INPUT

MODES = ("train", "eval", "infer", "export")

_DEFAULTS = Config()

# flag -> (dotted config path, argparse keyword arguments). The flag's name is the path's leaf.
_FLAGS = {
    "data_dir": ("data.data_dir", dict(help="directory holding train*.tfrecord and val*.tfrecord")),
    "model_dir": ("runtime.model_dir", dict(help="checkpoints, logs and results are written here")),
    "backbone_checkpoint": (
        "train.backbone_checkpoint",
        dict(help="pretrained backbone checkpoint made by weights/ (None: train from scratch)"),
    ),
    "init_checkpoint": (
        "train.init_checkpoint",
        dict(help="start a new run from the model weights of a training checkpoint: a model_dir (its newest "
                  "checkpoint) or a checkpoint prefix; optimizer, step and schedule start fresh, the class "
                  "layers are reinitialised if --num_classes differs (ignored when --model_dir holds a "
                  "checkpoint: the run resumes from it)"),
    ),
    "eval_file": ("eval.eval_file", dict(help="COCO annotation JSON of the validation images")),
    "epochs": ("train.epochs", dict(type=int, help="training epochs")),
    "steps_per_epoch": (
        "train.steps_per_epoch",
        dict(type=int, help="steps per epoch (None: records in the training files / global batch)"),
    ),
    "eval_samples": ("eval.eval_samples", dict(type=int, help="validation images to evaluate (None: all)")),
    "train_batch_size": ("train.train_batch_size", dict(type=int, help="images per device and step")),
    "eval_batch_size": ("eval.eval_batch_size", dict(type=int, help="images per device in evaluation")),
    "seed": ("train.seed", dict(type=int, help="random seed (None: non-deterministic)")),
    "l2_weight_decay": ("train.l2_weight_decay", dict(type=float, help="L2 penalty on kernels")),
    "init_learning_rate": ("train.init_learning_rate", dict(type=float, help="learning rate at step 0 of warm-up")),
    "learning_rate_values": (
        "train.learning_rate_values",
        dict(type=float, nargs="+",
             help="learning rate from each boundary on, at a global batch of train.learning_rate_batch_size (8) "
                  "images; scaled linearly with the global batch"),
    ),
    "learning_rate_boundaries": (
        "train.learning_rate_boundaries",
        dict(type=float, nargs="+",
             help="epochs at which each value starts; the first ends warm-up (at least train.warmup_min_steps)"),
    ),
    "momentum": ("train.momentum", dict(type=float, help="SGD momentum")),
    "clip_grad_norm": (
        "train.clip_grad_norm",
        dict(type=float, help="clip the averaged, unscaled gradients to this global norm (None: no clipping)"),
    ),
    "use_synthetic_data": (
        "data.use_synthetic_data",
        dict(action="store_true", help="repeat one real batch (measures the model without the input pipeline)"),
    ),
    "xla": (
        "runtime.xla",
        dict(action="store_true",
             help="XLA-compile the learned layers, each on its own (the custom ops run between them); also under "
                  "--eagerly"),
    ),
    "amp": (
        "runtime.amp",
        dict(action="store_true",
             help="mixed precision in the dtype of --amp_dtype"),
    ),
    "amp_dtype": (
        "runtime.amp_dtype",
        dict(choices=AMP_DTYPES,
             help="--amp's dtype: float16 (with dynamic loss scaling in training; slow on a CPU), bfloat16, or "
                  "auto: float16 on a GPU, bfloat16 on a CPU with bfloat16 instructions, else float32"),
    ),
    "log_file": ("runtime.log_file", dict(help="JSON-lines log (None: <model_dir>/log.jsonl)")),
    "checkpoint_every": (
        "runtime.checkpoint_every",
        dict(type=int, help="steps between checkpoints (also written at each epoch end)"),
    ),
    "keep_checkpoints": ("runtime.keep_checkpoints", dict(type=int, help="checkpoints kept in model_dir")),
    "log_every": ("runtime.log_every", dict(type=int, help="steps between log lines")),
    "log_warmup_steps": (
        "runtime.log_warmup_steps",
        dict(type=int, help="steps left out of throughput figures"),
    ),
    "log_graph": (
        "runtime.log_graph",
        dict(action="store_true",
             help="train: write the traced update step's graph for TensorBoard's Graphs tab, once before the first "
                  "step, into --log_tensorboard (None: <model_dir>/tensorboard); none under --eagerly (a warning)"),
    ),
    "log_tensorboard": ("runtime.log_tensorboard", dict(help="TensorBoard summary directory (None: none)")),
    "verbose": (
        "runtime.verbose",
        dict(action="store_true",
             help="show TensorFlow's own log, hidden by default: its C++ INFO and WARNING lines "
                  "(TF_CPP_MIN_LOG_LEVEL 0 instead of 2; a value set in the environment wins), its start-up "
                  "lines, and its Python logger's INFO lines"),
    ),
    "eagerly": (
        "runtime.eagerly",
        dict(action="store_true",
             help="debugging: run the train and predict steps op by op, without tf.function; --xla still compiles "
                  "the learned layers (--config_override runtime.xla=false to step into them)"),
    ),
    "backbone": ("model.backbone", dict(choices=BACKBONES, help="ResNet depth of the backbone")),
    "image_size": (
        "data.image_size",
        dict(type=int, nargs=2, metavar=("H", "W"), help="padded input size; multiples of 32 (the backbone's stride)"),
    ),
    "num_classes": ("model.num_classes", dict(type=int, help="object classes plus background")),
    "accumulate_steps": (
        "train.accumulate_steps",
        dict(type=int, help="batches whose gradients make one update"),
    ),
    "benchmark": (
        "runtime.benchmark",
        dict(action="store_true", help="measure img/s over benchmark_steps after the warm-up steps, then stop"),
    ),
    "benchmark_steps": ("runtime.benchmark_steps", dict(type=int, help="steps measured in benchmark mode")),
    "break_lock": (
        "runtime.break_lock",
        dict(action="store_true",
             help="train: take over <model_dir>/train.lock when it names a trainer on another host that is no "
                  "longer running, or is not a lock; a live trainer of this host is never overridden"),
    ),
    "eval_every_epochs": (
        "eval.eval_every_epochs",
        dict(type=int, help="in training with --eval_file, evaluate every N epochs (None: after the last step "
                            "only, or every epoch with --min_bbox_map/--min_mask_map)"),
    ),
    "min_bbox_map": ("eval.min_bbox_map", dict(type=float, help="stop training once bbox AP reaches this")),
    "min_mask_map": ("eval.min_mask_map", dict(type=float, help="stop training once mask AP reaches this")),
    "input": (
        "infer.input",
        dict(help="infer on this image file, folder or glob of image files (JPEG, PNG, BMP, GIF, TIFF, WebP; "
                  "None: the validation TFRecords)"),
    ),
    "output_dir": ("infer.output_dir", dict(help="inference outputs (None: <model_dir>/inference)")),
    "visualize": (
        "infer.visualize",
        dict(action="store_true", help="infer: also write PNGs with masks, boxes, class names and scores"),
    ),
    "label_map": (
        "infer.label_map",
        dict(help='JSON {"category id": "name"} for the pictures (None: --eval_file\'s names, else ids)'),
    ),
    "visualize_score_threshold": (
        "infer.visualize_score_threshold",
        dict(type=float, help="detections scoring below this are not drawn"),
    ),
    "visualize_font": (
        "infer.visualize_font",
        dict(help="TrueType/OpenType font file (.ttf, .otf, .ttc) for the pictures' labels (None: Pillow's "
                  "built-in font, ASCII only)"),
    ),
    "exported": (
        "infer.exported",
        dict(help="infer, eval: run this exported artefact (model.onnx, model.tflite, openvino/model.xml, or an "
                  "export directory's SavedModel) in its runtime instead of the newest checkpoint; --model_dir "
                  "defaults to its directory, whose config.json it reads"),
    ),
    "checkpoint": (
        "infer.checkpoint",
        dict(help="eval, infer, export: read this training checkpoint instead of the newest: its prefix (e.g. "
                  "runs/m/ckpt-600; --model_dir defaults to its directory) or a step number of --model_dir's"),
    ),
    "export_dir": (
        "export.export_dir", dict(help="directory of the exported artefacts (None: <model_dir>/saved_model)"),
    ),
    "format": (
        "export.formats",
        dict(nargs="+", choices=EXPORT_FORMATS,
             help="export: artefacts to write; saved_model holds TensorFlow's signatures, the others one graph per "
                  "image for onnxruntime, LiteRT (float32, float16 weights) and OpenVINO (float32, 8-bit) (optional "
                  "extras: pip install mrcnn-tf2[onnx|tflite|openvino])"),
    ),
    "calibration": (
        "export.calibration",
        dict(help="export openvino_int8: calibration images, an image file, folder or glob (None: the validation "
                  "TFRecords)"),
    ),
    "calibration_images": (
        "export.calibration_images", dict(type=int, help="export openvino_int8: calibration images used, at most"),
    ),
    "custom_ops": (
        "runtime.custom_ops",
        dict(choices=CUSTOM_OPS_MODES,
             help="fused C++ ops, which have CPU kernels only. auto: on a CPU, all of them when built (and the "
                  "CPU conv routes: Winograd's 3x3, oneDNN's batch-of-one routes, the matrix-product kernel "
                  "gradient); on a GPU, cuDNN convs and the pure-TF twins in the model, the fused ops only in "
                  "the input pipeline and the mask encoding. on: all of them, required (an error on a GPU). "
                  "off: the pure-TF twins (the convs still follow the device). The choice is printed at start"),
    ),
}
# The flags that name files or directories: a leading ~ is the home directory, as a shell would expand it where it
# does not (a quoted '~/photos/*.jpg', a job spec run without a shell).
_PATH_FLAGS = ("data_dir", "model_dir", "backbone_checkpoint", "init_checkpoint", "eval_file", "log_file",
               "log_tensorboard", "input", "output_dir", "label_map", "visualize_font", "exported", "export_dir",
               "calibration", "checkpoint")
# config path -> its flag, for errors that name a setting by its path.
_FLAG_OF_KEY = {path: f"--{flag}" for flag, (path, _) in _FLAGS.items()}


class _Parser(argparse.ArgumentParser):
    """An ArgumentParser whose errors are one line: 'main.py: error: <flag>: <problem>'."""

    def error(self, message):
        self.exit(2, f"{self.prog}: error: {message} (see --help)\n")


def build_parser() -> argparse.ArgumentParser:
    """The parser. A config flag left out of the command line is absent from the parsed namespace (its
    default is the config's, shown by --help), so that the config knows which values the user gave."""
    parser = _Parser(
        prog="main.py",
        description="Mask R-CNN (ResNet-FPN) for TensorFlow 2: train, evaluate, infer, export. "
                    "Settings are applied in this order, later ones winning: the defaults, --preset, the config "
                    "saved in --model_dir by training (config.json), the flags, --config_override.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    parser.add_argument("mode", choices=MODES, help="what to run")
    for flag, (path, kwargs) in _FLAGS.items():
        names = ["-v", "--verbose"] if flag == "verbose" else [f"--{flag}"]
        default = _DEFAULTS.get(path)
        shown = list(default) if isinstance(default, tuple) else default
        kwargs = dict(kwargs, help=f"{kwargs['help']} (default: {shown})")
        if flag in _PATH_FLAGS:
            kwargs["type"] = os.path.expanduser
        parser.add_argument(*names, default=argparse.SUPPRESS, **kwargs)
    parser.add_argument(
        "--finetune_bn",
        action="store_true",
        help="train batch norm statistics and affine parameters (default: frozen with pretrained weights, "
             "trained from scratch; model.freeze_bn)",
    )
    parser.add_argument(
        "--preset",
        choices=presets.names(),
        help=f"a named set of config values, applied under the config saved in --model_dir, the flags and "
             f"--config_override: {presets.describe()}",
    )
    parser.add_argument(
        "--config_override",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="set any config field by its dotted path, e.g. model.rpn.rpn_min_size=2 (repeatable; after flags)",
    )
    parser.add_argument(
        "--onednn",
        choices=("on", "off"),
        help="TensorFlow's oneDNN CPU kernels (default: on, unless TF_ENABLE_ONEDNN_OPTS is set; see "
             "docs/PERFORMANCE.md)",
    )
    parser.add_argument(
        "--print_config", action="store_true",
        help="print the resolved configuration as JSON, with the source of each non-default value, and exit",
    )
    return parser


def config_with_sources(args: argparse.Namespace) -> tuple[Config, dict]:
    """The validated Config of `args` and {dotted path: source} of each value that differs from the default.

    Layers, later ones winning: the defaults; --preset; the config saved in <model_dir>/config.json by
    training, without its per-command settings (config.PER_COMMAND_KEYS); the flags; --config_override;
    then the rules of the settings left to None (Config.resolved). A saved run thus keeps what it chose
    under a preset (a model fine-tuned at 512 px from `--preset torchvision` evaluates at 512 px under it),
    and the preset still gives the per-command settings. A flag or override that changes one of
    config.MODEL_DEFINING_KEYS against the saved config is an error naming both values. Raises ConfigError.
    """
    config, sources = Config(), {}

    def apply(path, value, source, key):
        try:
            config.set(path, value)
        except ValueError as err:
            raise ConfigError(key, f"{path}: {err}") from None
        sources[path] = source

    if args.preset:
        for path, value in presets.values(args.preset).items():
            apply(path, value, f"--preset {args.preset}", "--preset")
    # --exported and a --checkpoint prefix imply the model directory they are in.
    implied = [(flag, directory) for flag, directory in (
        ("--exported", exported_directory(getattr(args, "exported", None))),
        ("--checkpoint", _checkpoint_directory(getattr(args, "checkpoint", None)))) if directory]
    model_dir = getattr(args, "model_dir", None) or (implied[0][1] if implied else _DEFAULTS.runtime.model_dir)
    if not hasattr(args, "model_dir") and implied:
        apply("runtime.model_dir", model_dir, implied[0][0], implied[0][0])
    saved = load_saved_config(model_dir)
    saved_file = os.path.join(model_dir, SAVED_CONFIG_FILE)
    for path, value in (saved or {}).items():
        if path not in PER_COMMAND_KEYS and not path.startswith(PER_COMMAND_SECTIONS):
            apply(path, value, f"saved config {saved_file}", "--model_dir")
    for flag, (path, _) in _FLAGS.items():
        if hasattr(args, flag):
            apply(path, getattr(args, flag), f"--{flag}", f"--{flag}")
    if args.finetune_bn:
        apply("model.freeze_bn", False, "--finetune_bn", "--finetune_bn")
    for item in args.config_override:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise ConfigError("--config_override", f"'{item}' is not KEY=VALUE")
        config.override(key.strip(), value.strip())
        sources[key.strip()] = "--config_override"
    for path in MODEL_DEFINING_KEYS if saved else ():
        source = sources.get(path, "")
        if path in saved and not source.startswith("saved config") and config.get(path) != saved[path]:
            key = source.split(" ")[0]
            raise ConfigError(key, f"{path} = {show_value(config.get(path))} contradicts {show_value(saved[path])} "
                                   f"saved in {saved_file}, which the checkpoints there were trained with "
                                   "(use another --model_dir for a different model)")
    resolved = config.resolved()
    for path in field_paths(resolved):
        if resolved.get(path) != config.get(path):
            sources[path] = "rule (Config.resolved: pretrained weights or not)"
    try:
        resolved.validate()
    except ConfigError as err:  # validate names a setting by its key, which the user may know by its flag
        raise ConfigError(_FLAG_OF_KEY.get(err.key, err.key), err.message) from None
    return resolved, {path: sources[path] for path in field_paths(resolved)
                      if path in sources and resolved.get(path) != _DEFAULTS.get(path)}


def config_from_args(args: argparse.Namespace) -> Config:
    """The validated Config of `args` (see config_with_sources). Raises ConfigError."""
    return config_with_sources(args)[0]


def check_inputs(mode: str, config: Config) -> None:
    """Raises ConfigError when files `mode` reads are missing, or a directory it writes is a file or cannot be
    written (a read-only mount of a model directory: checked before an evaluation of an hour, not after it).

    Training checks the validation TFRecords too when it evaluates (--eval_file), so that a wrong path
    fails now rather than after the first epoch.
    """
    data = config.data
    written = [("--model_dir", config.runtime.model_dir)]
    if mode == "infer":
        written.append(("--output_dir", config.infer.resolved_output_dir(config.runtime.model_dir)))
    if mode == "train" and config.runtime.log_tensorboard:
        written.append(("--log_tensorboard", config.runtime.log_tensorboard))
    for flag, directory in written:
        if os.path.exists(directory) and not os.path.isdir(directory):
            raise ConfigError(flag, f"{directory} is a file, not a directory")
    log_file = config.runtime.log_file
    if mode == "train" and log_file and os.path.isdir(log_file):
        raise ConfigError("--log_file", f"{log_file} is a directory: name the JSON-lines file")
    if mode == "train" and log_file and os.path.isfile(log_file) and not _is_run_log(log_file):
        raise ConfigError("--log_file", f"{log_file} is not a run's log (its first line is no JSON record of an "
                          "event), and training appends to it: name a new file or a run's log.jsonl")
    backbone = config.train.backbone_checkpoint
    if mode == "train" and backbone and not os.path.isfile(f"{backbone}.index"):
        raise ConfigError("--backbone_checkpoint", f"{backbone} is not a checkpoint prefix (no {backbone}.index): give "
                          "the --output prefix of weights/convert_keras_resnet.py; a Mask R-CNN model directory or "
                          "checkpoint goes to --init_checkpoint")
    if config.eval.eval_file and mode in ("train", "eval", "infer") and not os.path.isfile(config.eval.eval_file):
        raise ConfigError("--eval_file", f"no such file {config.eval.eval_file}")
    if mode == "infer" and config.infer.label_map and not os.path.isfile(config.infer.label_map):
        raise ConfigError("--label_map", f"no such file {config.infer.label_map}")
    _check_checkpoint(mode, config)
    font = config.infer.visualize_font
    if mode == "infer" and font and not config.infer.visualize:
        raise ConfigError("--visualize_font", "draws the labels of --visualize's pictures: give --visualize too")
    if mode == "infer" and font and not os.path.isfile(font):
        raise ConfigError("--visualize_font", f"no such file {font}")
    patterns = []
    if mode == "train":
        patterns.append((data.training_file_pattern, data.resolved_training_pattern()))
    if (mode == "eval" or (mode == "train" and config.eval.eval_file)
            or (mode == "infer" and (config.infer.input is None or config.runtime.benchmark))):
        patterns.append((data.validation_file_pattern, data.resolved_validation_pattern()))
    for explicit, pattern in patterns:
        if not glob.glob(pattern):
            raise ConfigError("--config_override" if explicit else "--data_dir", f"no file matches {pattern}")
    # Last, so that what is missing is named first. Where the mode's files go: (flag, directory, the directory
    # they are created in). An export writes its directory under a temporary name beside it; infer's benchmark
    # writes nothing.
    targets = [(flag, directory, directory) for flag, directory in written]
    if mode == "infer":
        targets = [] if config.runtime.benchmark else targets[1:]
    elif mode == "export":
        export_dir = config.export.resolved_export_dir(config.runtime.model_dir)
        targets = [("--export_dir", export_dir, os.path.dirname(os.path.abspath(export_dir)))]
    for flag, directory, created_in in targets:
        existing = _nearest_existing(created_in)
        if not os.access(existing, os.W_OK | os.X_OK):
            where = directory if existing == directory else f"{directory} (in {existing})"
            raise ConfigError(flag, f"{where} cannot be written (a read-only file system, or no permission): "
                                    f"{mode} writes its results there")


def _check_checkpoint(mode, config):
    """Raises ConfigError naming --checkpoint when `mode` does not read one, --exported names another model, or it
    names no checkpoint (then the error lists model_dir's)."""
    chosen = config.infer.checkpoint
    if chosen is None:
        return
    if mode == "train":
        raise ConfigError("--checkpoint", "eval, infer and export read it; training resumes from --model_dir's "
                                          "newest checkpoint, or starts a new run from another with --init_checkpoint")
    if config.infer.exported:
        raise ConfigError("--checkpoint", f"{chosen} and --exported {config.infer.exported} name two models: give one")
    model_dir = config.runtime.model_dir
    prefix = config.infer.resolved_checkpoint(model_dir)
    if not os.path.isfile(f"{prefix}.index"):
        steps = sorted(int(name[len("ckpt-"):-len(".index")]) for name in os.listdir(model_dir)
                       if re.fullmatch(r"ckpt-\d+\.index", name)) if os.path.isdir(model_dir) else []
        held = f"steps {' '.join(map(str, steps))}" if steps else "none"
        raise ConfigError("--checkpoint", f"{prefix} is not a checkpoint (no {prefix}.index); the checkpoints of "
                                          f"--model_dir {model_dir}: {held}")


def _nearest_existing(path):
    """`path`, or its nearest ancestor that exists."""
    path = os.path.abspath(path)
    while not os.path.exists(path):
        path = os.path.dirname(path)
    return path


def _is_run_log(path):
    """Whether the file `path` is empty or starts as a run's JSON-lines log (runtime.logger): a record with an
    event. Reads at most its first MiB (an annotation file, one long line, is then no record)."""
    with open(path, "rb") as f:
        first = f.readline(2 ** 20)
    if not first.strip():
        return True
    try:
        record = json.loads(first)
    except ValueError:
        return False
    return isinstance(record, dict) and "event" in record


def exported_directory(path):
    """The directory holding an exported artefact's config.json: the path itself when it is a directory (an export
    directory), else the directory of the file (for openvino/model.xml, the export directory above it)."""
    if not path:
        return None
    if os.path.isdir(path):
        return path
    directory = os.path.dirname(os.path.abspath(path))
    if not os.path.isfile(os.path.join(directory, SAVED_CONFIG_FILE)) and \
            os.path.isfile(os.path.join(os.path.dirname(directory), SAVED_CONFIG_FILE)):
        return os.path.dirname(directory)
    return directory


def _checkpoint_directory(checkpoint):
    """The directory of a --checkpoint prefix; None for a step number (or no flag)."""
    if not checkpoint or checkpoint.isdigit():
        return None
    return os.path.dirname(checkpoint) or "."


def config_for_path(path):
    """The Config `Predictor(path)` runs: `main.py infer --checkpoint path` for a training checkpoint's prefix,
    `--exported path` for an artefact file or an export directory (`exported_files`), else `--model_dir path`.
    Raises ConfigError."""
    if path is None:
        raise ConfigError("path", "name a model directory, a checkpoint or an exported artefact")
    path = os.fspath(path)
    if os.path.isfile(f"{path}.index"):
        return config_with_sources(build_parser().parse_args(["infer", "--checkpoint", path]))[0]
    if not os.path.exists(path):
        raise ConfigError("path", f"{path}: no such file or directory")
    if os.path.isdir(path) and not exported_files(path):
        argv = ["infer", "--model_dir", path]
    else:
        argv = ["infer", "--exported", path]
    return config_with_sources(build_parser().parse_args(argv))[0]


def parse(argv=None, with_sources=False):
    """Parses `argv` (default: sys.argv[1:]) into (args, Config), or (args, Config, sources) with
    `with_sources` (see config_with_sources); exits 2 with one line on bad input."""
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        config, sources = config_with_sources(args)
    except ConfigError as err:
        parser.exit(BAD_INPUT, f"{parser.prog}: error: {err}\n")
    return (args, config, sources) if with_sources else (args, config)

