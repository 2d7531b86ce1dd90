"""Config defaults, flags and overrides reaching the config, and the CLI's errors."""

import dataclasses
import errno
import importlib.util
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
import types

import pytest

import main
from mrcnn_tf2 import arguments, cli, files, presets, status
from mrcnn_tf2.config import Config, ConfigError, field_paths
from tests.support import ROOT, run_main, terminations_by_default


# The defaults the foundation issue fixes (NVIDIA TF2 config.py, max_num_instances from TAO).
SPEC_DEFAULTS = {
    "data.image_size": (832, 1344),
    "data.augment_input_data": True,
    "data.gt_mask_size": 112,
    "data.max_num_instances": 200,
    "data.skip_crowd_during_training": True,
    "data.use_category": True,
    "model.num_classes": 91,
    "model.include_mask": True,
    "model.fast_rcnn_mlp_head_dim": 1024,
    "model.bbox_reg_weights": (10.0, 10.0, 5.0, 5.0),
    "model.mrcnn_resolution": 28,
    "model.backbone": "resnet50",
    "model.freeze_bn": None,  # the rule of Config.resolved
    "model.freeze_blocks": None,
    "model.rpn.rpn_positive_overlap": 0.7,
    "model.rpn.rpn_negative_overlap": 0.3,
    "model.rpn.rpn_batch_size_per_im": 256,
    "model.rpn.rpn_fg_fraction": 0.5,
    "model.rpn.rpn_min_size": 0.0,
    "model.rpn.train_rpn_pre_nms_topn": 2000,
    "model.rpn.train_rpn_post_nms_topn": 1000,
    "model.rpn.train_rpn_nms_threshold": 0.7,
    "model.rpn.test_rpn_pre_nms_topn": 1000,
    "model.rpn.test_rpn_post_nms_topn": 1000,
    "model.rpn.test_rpn_nms_thresh": 0.7,
    "model.roi.batch_size_per_im": 512,
    "model.roi.fg_fraction": 0.25,
    "model.roi.fg_thresh": 0.5,
    "model.roi.bg_thresh_hi": 0.5,
    "model.roi.bg_thresh_lo": 0.0,
    "model.test.test_detections_per_image": 100,
    "model.test.test_nms": 0.5,
    "model.anchors.min_level": 2,
    "model.anchors.max_level": 6,
    "model.anchors.num_scales": 1,
    "model.anchors.aspect_ratios": ((1.0, 1.0), (1.4, 0.7), (0.7, 1.4)),
    "model.anchors.anchor_scale": 8.0,
    "model.loss.rpn_box_loss_weight": 1.0,
    "model.loss.fast_rcnn_box_loss_weight": 1.0,
    "model.loss.mrcnn_weight_loss_mask": 1.0,
}

# Every flag of the foundation issue with its default (None where the flag has no value by default).
FLAG_DEFAULTS = {
    "data_dir": "/data",
    "model_dir": "/results",
    "backbone_checkpoint": None,
    "eval_file": None,
    "epochs": 12,
    "steps_per_epoch": None,
    "eval_samples": None,
    "train_batch_size": 4,
    "eval_batch_size": 8,
    "seed": None,
    "l2_weight_decay": 1e-4,
    "init_learning_rate": 0.0,
    "learning_rate_values": [1e-2, 1e-3, 1e-4],
    "learning_rate_boundaries": [0.3, 8.0, 10.0],
    "momentum": 0.9,
    "clip_grad_norm": None,
    "finetune_bn": False,
    "use_synthetic_data": False,
    "xla": False,
    "amp": False,
    "log_file": None,
    "log_every": 100,
    "log_warmup_steps": 100,
    "log_graph": False,
    "log_tensorboard": None,
    "verbose": False,
    "eagerly": False,
    "backbone": "resnet50",
    "image_size": [832, 1344],
    "num_classes": 91,
    "accumulate_steps": 1,
    "benchmark": False,
    "eval_every_epochs": None,
    "min_bbox_map": None,
    "min_mask_map": None,
    "custom_ops": "auto",
    "input": None,
    "output_dir": None,
    "visualize": False,
    "label_map": None,
    "visualize_score_threshold": 0.5,
    "visualize_font": None,
    "export_dir": None,
}


def get(config, path):
    for part in path.split("."):
        config = getattr(config, part)
    return config


def test_config_defaults_match_the_spec():
    config = Config()
    for path, expected in SPEC_DEFAULTS.items():
        assert get(config, path) == expected, path
    config.validate()


def test_flag_defaults_and_no_flag_gives_the_default_config():
    args = arguments.build_parser().parse_args(["train"])
    assert args.finetune_bn is False and args.preset is None and args.onednn is None
    for flag, expected in FLAG_DEFAULTS.items():
        if flag == "finetune_bn":
            continue
        default = Config().get(arguments._FLAGS[flag][0])
        assert (list(default) if isinstance(default, tuple) else default) == expected, flag
        assert not hasattr(args, flag), flag  # absent unless given: the config's sources know who set what
    assert arguments.config_from_args(args) == Config().resolved()


@pytest.mark.parametrize("flags, freeze_bn, freeze_blocks", [
    ([], False, ()),  # from scratch: batch norm trains, nothing frozen
    (["--backbone_checkpoint", "/w"], True, (0, 1)),  # pretrained: NVIDIA's frozen defaults
    (["--backbone_checkpoint", "/w", "--finetune_bn"], False, (0, 1)),  # explicit flags and overrides win
    (["--config_override", "model.freeze_bn=true", "--config_override", "model.freeze_blocks=[0]"], True, (0,)),
])
def test_batch_norm_and_frozen_blocks_follow_pretrained_weights(flags, freeze_bn, freeze_blocks):
    config = arguments.config_from_args(arguments.build_parser().parse_args(["train", *flags]))
    assert (config.model.freeze_bn, config.model.freeze_blocks) == (freeze_bn, freeze_blocks)
    assert config.resolved() == config


def test_leaf_names_are_unique_so_flags_and_keys_read_the_same():
    leaves = [path.rsplit(".", 1)[-1] for path in field_paths(Config())]
    assert len(leaves) == len(set(leaves))


def test_flags_reach_the_config():
    argv = (
        "train --data_dir /d --model_dir /m --backbone_checkpoint /w --eval_file /e.json --epochs 3 "
        "--steps_per_epoch 7 --eval_samples 9 --train_batch_size 2 --eval_batch_size 3 --seed 5 "
        "--l2_weight_decay 0.5 --init_learning_rate 0.001 --learning_rate_values 0.1 0.01 "
        "--learning_rate_boundaries 1 2 --momentum 0.8 --clip_grad_norm 5 --finetune_bn --use_synthetic_data "
        "--xla --amp "
        "--log_file /l.jsonl --log_every 4 --log_warmup_steps 6 --log_graph --log_tensorboard /tb -v "
        "--eagerly --backbone resnet18 --image_size 256 320 --num_classes 5 --accumulate_steps 2 "
        "--benchmark --benchmark_steps 11 --min_bbox_map 0.3 --min_mask_map 0.2 --custom_ops off "
        "--eval_every_epochs 2 --input /photos --output_dir /o --visualize --label_map /labels.json "
        "--visualize_score_threshold 0.3 --visualize_font /f.ttf --export_dir /x"
    ).split()
    _, config = arguments.parse(argv)
    expected = {
        "data.data_dir": "/d",
        "runtime.model_dir": "/m",
        "train.backbone_checkpoint": "/w",
        "eval.eval_file": "/e.json",
        "train.epochs": 3,
        "train.steps_per_epoch": 7,
        "eval.eval_samples": 9,
        "train.train_batch_size": 2,
        "eval.eval_batch_size": 3,
        "train.seed": 5,
        "train.l2_weight_decay": 0.5,
        "train.init_learning_rate": 0.001,
        "train.learning_rate_values": (0.1, 0.01),
        "train.learning_rate_boundaries": (1.0, 2.0),
        "train.momentum": 0.8,
        "train.clip_grad_norm": 5.0,
        "model.freeze_bn": False,
        "model.freeze_blocks": (0, 1),  # the pretrained rule (--backbone_checkpoint)
        "data.use_synthetic_data": True,
        "runtime.xla": True,
        "runtime.amp": True,
        "runtime.log_file": "/l.jsonl",
        "runtime.log_every": 4,
        "runtime.log_warmup_steps": 6,
        "runtime.log_graph": True,
        "runtime.log_tensorboard": "/tb",
        "runtime.verbose": True,
        "runtime.eagerly": True,
        "model.backbone": "resnet18",
        "data.image_size": (256, 320),
        "model.num_classes": 5,
        "train.accumulate_steps": 2,
        "runtime.benchmark": True,
        "runtime.benchmark_steps": 11,
        "eval.min_bbox_map": 0.3,
        "eval.min_mask_map": 0.2,
        "runtime.custom_ops": "off",
        "eval.eval_every_epochs": 2,
        "infer.input": "/photos",
        "infer.output_dir": "/o",
        "infer.visualize": True,
        "infer.label_map": "/labels.json",
        "infer.visualize_score_threshold": 0.3,
        "infer.visualize_font": "/f.ttf",
        "export.export_dir": "/x",
    }
    for path, value in expected.items():
        assert get(config, path) == value, path
    # Everything not named above kept its default.
    default = Config()
    for path in field_paths(default):
        if path not in expected:
            assert get(config, path) == get(default, path), path


@pytest.mark.parametrize(
    "override, path, value",
    [
        ("model.rpn.rpn_min_size=2.5", "model.rpn.rpn_min_size", 2.5),
        ("model.anchors.max_level=5", "model.anchors.max_level", 5),
        ("model.include_mask=false", "model.include_mask", False),
        ("data.image_size=[256, 384]", "data.image_size", (256, 384)),
        ("data.image_size=256,384", "data.image_size", (256, 384)),
        ("model.freeze_blocks=[]", "model.freeze_blocks", ()),
        ("model.anchors.aspect_ratios=[[1, 1]]", "model.anchors.aspect_ratios", ((1.0, 1.0),)),
        ("train.seed=none", "train.seed", None),
        ("train.seed=3", "train.seed", 3),
        ("runtime.model_dir=/x=y", "runtime.model_dir", "/x=y"),
    ],
)
def test_overrides_parse_by_field_type(override, path, value):
    _, config = arguments.parse(["train", "--config_override", override])
    assert get(config, path) == value


def test_override_applies_after_flags_and_repeats():
    _, config = arguments.parse(
        ["train", "--train_batch_size", "2", "--config_override", "train.train_batch_size=6",
         "--config_override", "model.roi.fg_fraction=0.5"]
    )
    assert config.train.train_batch_size == 6
    assert config.model.roi.fg_fraction == 0.5


def main_status(argv, capsys):
    """main.py's exit status for `argv`, run in this process, and its stderr lines."""
    return run_main(argv), capsys.readouterr().err.strip().splitlines()


@pytest.mark.parametrize(
    "argv, names",
    [
        (["--image_size", "800", "1340"], ["--image_size", "800 1340", "multiple of 32 (the backbone's stride)"]),
        (["--image_size", "832", "1000"], ["--image_size", "1000"]),
        (["--learning_rate_values", "0.1", "0.01"], ["--learning_rate_values", "2 values", "3"]),
        (["--learning_rate_boundaries", "1", "3", "2"], ["--learning_rate_boundaries", "increasing"]),
        (["--config_override", "train.learning_rate_schedule=linear"],
         ["train.learning_rate_schedule: 'linear' is not one of ('piecewise', 'cosine')"]),
        (["--config_override", "train.learning_rate_schedule=cosine", "--learning_rate_values", "0.1",
          "--learning_rate_boundaries", "1"], ["train.learning_rate_schedule: cosine decays from the first",
                                               "[0.1] has one; give two"]),
        (["--config_override", "model.rpn.nonexistent=1"], ["--config_override", "model.rpn.nonexistent"]),
        (["--config_override", "rpn_min_size=1"], ["--config_override", "did you mean model.rpn.rpn_min_size"]),
        (["--config_override", "model.rpn=1"], ["--config_override", "section"]),
        (["--config_override", "model.num_classes=many"], ["--config_override", "'many' is not a valid int"]),
        (["--config_override", "noequals"], ["--config_override", "KEY=VALUE"]),
        (["--train_batch_size", "0"], ["--train_batch_size", ">= 1"]),
        (["--backbone", "resnet7"], ["--backbone", "resnet7"]),
        (["--data_dir", "/nonexistent/dir"], ["--data_dir", "no file matches /nonexistent/dir/train*.tfrecord"]),
        (["--eval_every_epochs", "0"], ["--eval_every_epochs", ">= 1"]),
        (["--min_bbox_map", "0.3"], ["--min_bbox_map", "needs --eval_file"]),
        (["--eval_file", "/e.json", "--min_mask_map", "1.5"], ["--min_mask_map", "[0, 1]"]),
        (["--eval_file", "/e.json", "--min_mask_map", "0.3", "--config_override", "model.include_mask=false"],
         ["--min_mask_map", "no mask branch"]),
        (["--eval_file", "/nonexistent/e.json"], ["--eval_file", "no such file /nonexistent/e.json"]),
        # Numeric settings out of range (config.RANGES, POSITIVE), named by their flag where they have one.
        (["--seed", "-1"], ["--seed: -1 must lie in [0, 4294967295]"]),
        (["--config_override", "train.train_batch_size=0"], ["--train_batch_size: 0 must be >= 1"]),
        (["--learning_rate_values", "0.1", "-1", "0.01"], ["--learning_rate_values: 0.1 -1.0 0.01 must be >= 0"]),
        (["--config_override", "data.max_num_instances=0"], ["data.max_num_instances: 0 must be >= 1"]),
        (["--config_override", "model.rpn.rpn_batch_size_per_im=0"], ["model.rpn.rpn_batch_size_per_im: 0 must"]),
        (["--config_override", "model.rpn.rpn_positive_overlap=1.5"],
         ["model.rpn.rpn_positive_overlap: 1.5 must lie in [0, 1]"]),
        (["--config_override", "model.rpn.rpn_negative_overlap=0.8"],
         ["model.rpn.rpn_negative_overlap: 0.8 exceeds model.rpn.rpn_positive_overlap 0.7"]),
        (["--config_override", "model.freeze_blocks=[1,5]"], ["model.freeze_blocks: 1 5 must lie in [0, 4]"]),
        (["--config_override", "model.bbox_reg_weights=[10,10,0,5]"], ["model.bbox_reg_weights: 10.0 10.0 0.0 5.0"]),
        (["--clip_grad_norm", "0"], ["--clip_grad_norm: 0.0 must be > 0"]),
        (["--momentum", "1.5"], ["--momentum: 1.5 must lie in [0, 1]"]),
        (["--image_size", "0", "64"], ["--image_size: 0 64 must be >= 1"]),
        (["--config_override", "data.aug_scale_min=0"], ["data.aug_scale_min: 0.0 must be > 0"]),
        (["--config_override", "data.repeat_threshold=0"], ["data.repeat_threshold: 0.0 must be > 0"]),
        (["--config_override", "data.repeat_threshold=2"], ["data.repeat_threshold: 2.0 must lie in [0, 1]"]),
        (["--config_override", "data.aug_scale_min=2"], ["data.aug_scale_min: 2.0 exceeds data.aug_scale_max 1.0"]),
        (["--config_override", "eval.best_metric=mask/AP"],
         ["eval.best_metric: 'mask/AP' is not one of (bbox|segm)/(AP|AP50|AP75|APs|APm|APl|AR1|AR10|AR100|ARs|"]),
        (["--config_override", "eval.best_metric=segm/AP", "--config_override", "model.include_mask=false"],
         ["eval.best_metric: 'segm/AP' is not one of (bbox)/(AP|", "(the model has no mask branch)"]),
    ],
)
def test_invalid_input_exits_2_with_one_line_naming_the_flag(argv, names, capsys):
    status, lines = main_status(["train", *argv], capsys)
    assert status == 2
    assert len(lines) == 1, lines
    for name in names:
        assert name in lines[0]


def test_explicit_pattern_that_matches_nothing_names_the_override(tmp_path, capsys):
    status, lines = main_status(
        ["eval", "--config_override", f"data.validation_file_pattern={tmp_path}/none-*.tfrecord"], capsys
    )
    assert status == 2 and "--config_override" in lines[0] and "none-*.tfrecord" in lines[0]


def test_training_that_evaluates_needs_the_validation_records(tmp_path, capsys):
    (tmp_path / "train-00000-of-00001.tfrecord").write_bytes(b"")
    (tmp_path / "val.json").write_text("{}")
    status, lines = main_status(["train", "--data_dir", str(tmp_path), "--eval_file", str(tmp_path / "val.json")],
                             capsys)
    assert status == 2 and "--data_dir" in lines[0] and "val*.tfrecord" in lines[0]


def test_eval_every_epochs_defaults_to_the_end_or_every_epoch_with_a_target():
    config = Config()
    assert config.eval.resolved_eval_every_epochs() is None
    config.eval.min_mask_map = 0.3
    assert config.eval.resolved_eval_every_epochs() == 1
    config.eval.eval_every_epochs = 3
    assert config.eval.resolved_eval_every_epochs() == 3


def test_every_mode_has_its_runtime_module():
    for module in main.RUNNERS.values():
        assert importlib.util.find_spec(module) is not None, module


def test_print_config_is_the_resolved_config_as_json(capsys):
    status = main.main(["train", "--print_config", "--backbone", "resnet18", "--config_override",
                        "model.rpn.rpn_min_size=1"])
    printed = json.loads(capsys.readouterr().out)
    assert status == 0 and printed["mode"] == "train"
    assert printed["model"]["backbone"] == "resnet18"
    assert printed["model"]["rpn"]["rpn_min_size"] == 1.0
    expected = Config()
    expected.model.backbone, expected.model.rpn.rpn_min_size = "resnet18", 1.0
    assert {k: v for k, v in printed.items() if k not in ("mode", "sources")} == expected.resolved().to_dict()
    rule = "rule (Config.resolved: pretrained weights or not)"
    assert printed["sources"] == {"model.backbone": "--backbone", "model.rpn.rpn_min_size": "--config_override",
                                  "model.freeze_bn": rule, "model.freeze_blocks": rule}


def test_help_lists_every_flag_with_its_default():
    # A subprocess: this is the user's `python main.py train --help`, and it must not need TensorFlow.
    result = subprocess.run(
        [sys.executable, "main.py", "train", "--help"], cwd=ROOT, capture_output=True, text=True, check=True
    )
    text = " ".join(result.stdout.split())
    for flag in FLAG_DEFAULTS:
        assert f"--{flag}" in text, flag
    for flag in ("--benchmark_steps", "--config_override", "--print_config", "-v"):
        assert flag in text
    assert "(default: /data)" in text and "(default: 12)" in text and "(default: [0.01, 0.001, 0.0001])" in text


def test_cli_does_not_import_tensorflow():
    # --help and --print_config must answer at once: the CLI modules stay free of TensorFlow.
    code = "import sys, main; main.main(['train', '--print_config']); print('tensorflow' in sys.modules)"
    result = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True)
    assert result.stdout.strip().splitlines()[-1] == "False"


def test_config_override_rejects_value_of_wrong_arity():
    config = Config()
    with pytest.raises(ConfigError, match="expected 2 values"):
        config.override("data.image_size", "[1, 2, 3]")
    assert dataclasses.asdict(config) == dataclasses.asdict(Config())


# -- presets, the config a training run saves, and where each value came from ---------------------------------


def saved_run(model_dir, *flags):
    """`model_dir` holding the config.json that a training run with `flags` writes."""
    _, config = arguments.parse(["train", "--model_dir", str(model_dir), *flags])
    config.save(str(model_dir))
    return model_dir


def test_every_preset_value_is_a_config_field_of_its_type():
    for name in presets.names():
        config = Config()
        for path, value in presets.values(name).items():
            config.set(path, value)  # raises on an unknown field or a value of the wrong type
            assert config.get(path) == value, (name, path)
        config.resolved().validate()


def test_preset_lies_under_the_flags_and_the_overrides():
    _, config, sources = arguments.parse(
        ["train", "--preset", "demo", "--backbone", "resnet34", "--config_override", "model.fpn_num_filters=64"],
        with_sources=True)
    assert (config.model.backbone, sources["model.backbone"]) == ("resnet34", "--backbone")
    assert (config.model.fpn_num_filters, sources["model.fpn_num_filters"]) == (64, "--config_override")
    assert (config.model.mrcnn_head_num_filters, sources["model.mrcnn_head_num_filters"]) == (64, "--preset demo")
    assert config.data.image_size == (128, 128) and config.train.learning_rate_values == (2e-2, 2e-3)


def test_help_lists_the_presets():
    result = subprocess.run([sys.executable, "main.py", "eval", "--help"], cwd=ROOT, capture_output=True, text=True,
                            check=True)
    text = " ".join(result.stdout.split())
    assert "--preset {demo,torchvision,torchvision_v2}" in text and "demo: the README's demo" in text
    assert "torchvision: torchvision's maskrcnn_resnet50_fpn conventions" in text
    assert "torchvision_v2: torchvision's maskrcnn_resnet50_fpn_v2" in text


def test_saved_config_is_the_base_of_later_commands_without_its_per_command_settings(tmp_path):
    saved_run(tmp_path, "--preset", "demo", "--data_dir", "/d", "--epochs", "3", "--benchmark", "--use_synthetic_data",
              "--config_override", "infer.visualize=true", "--export_dir", "/x")
    assert json.loads((tmp_path / "config.json").read_text())["runtime"]["benchmark"] is True
    _, config, sources = arguments.parse(["eval", "--model_dir", str(tmp_path), "--eval_batch_size", "2"],
                                         with_sources=True)
    demo = Config()
    for path, value in presets.values("demo").items():
        demo.set(path, value)
    assert config.model == demo.resolved().model
    assert (config.data.data_dir, config.train.epochs, config.eval.eval_batch_size) == ("/d", 3, 2)
    saved = f"saved config {tmp_path}/config.json"
    assert sources["model.backbone"] == sources["data.data_dir"] == sources["train.epochs"] == saved
    assert sources["eval.eval_batch_size"] == "--eval_batch_size"
    # Settings of one command do not carry over: this eval is no benchmark and exports nowhere.
    assert not config.runtime.benchmark and not config.data.use_synthetic_data
    assert not config.infer.visualize and config.export.export_dir is None


@pytest.mark.parametrize("saved_flags, flags, names", [
    (["--preset", "demo"], ["--backbone", "resnet50"], ["--backbone", "resnet50", "resnet18"]),
    (["--preset", "demo"], ["--num_classes", "91"], ["--num_classes", "91", "6"]),
    (["--preset", "demo"], ["--image_size", "256", "256"], ["--image_size", "256 256", "128 128"]),
    (["--preset", "demo"], ["--config_override", "model.fpn_num_filters=256"],
     ["--config_override", "model.fpn_num_filters", "256", "128"]),
])
def test_a_command_that_changes_a_saved_models_shape_is_an_error_naming_both_values(
        tmp_path, capsys, saved_flags, flags, names):
    saved_run(tmp_path, *saved_flags)
    for mode in ("train", "eval", "infer", "export"):
        status, lines = main_status([mode, "--model_dir", str(tmp_path), *flags], capsys)
        assert status == 2 and len(lines) == 1, lines
        for name in [*names, f"{tmp_path}/config.json"]:
            assert name in lines[0], (name, lines[0])


def test_a_saved_run_keeps_what_it_chose_under_a_preset(tmp_path):
    # Fine-tuned from the torchvision preset at 256 px: evaluating under the preset keeps the run's resize rule
    # and proposal counts rather than the preset's 800 / 1333 and 1000.
    saved_run(tmp_path, "--preset", "torchvision", "--image_size", "256", "256", "--num_classes", "6",
              "--config_override", "data.resize_min_size=256", "--config_override", "data.resize_max_size=256",
              "--config_override", "model.rpn.test_rpn_post_nms_topn=300")
    _, config, sources = arguments.parse(["eval", "--model_dir", str(tmp_path), "--preset", "torchvision"],
                                         with_sources=True)
    saved = f"saved config {tmp_path}/config.json"
    data = config.data
    assert (data.image_size, data.resize_min_size, data.resize_max_size) == ((256, 256), 256, 256)
    assert (config.model.num_classes, config.model.rpn.test_rpn_post_nms_topn) == (6, 300)
    assert sources["data.resize_min_size"] == sources["model.rpn.test_rpn_post_nms_topn"] == saved
    # The preset's values the run did not change are the run's too.
    assert config.model.test.mask_paste == "torchvision" and sources["model.test.mask_paste"] == saved


def test_a_preset_gives_the_settings_of_one_command_over_a_saved_run(tmp_path):
    # A model trained without the preset: its own values stay, and the preset gives what a saved config does
    # not carry (runtime.log_warmup_steps is a setting of one command).
    saved_run(tmp_path, "--num_classes", "7")
    _, config, sources = arguments.parse(["eval", "--model_dir", str(tmp_path), "--preset", "demo"], with_sources=True)
    assert (config.model.backbone, config.model.num_classes, config.data.image_size) == ("resnet50", 7, (832, 1344))
    assert config.model.rpn.test_rpn_post_nms_topn == Config().model.rpn.test_rpn_post_nms_topn
    assert sources["model.num_classes"] == f"saved config {tmp_path}/config.json"
    assert config.runtime.log_warmup_steps == 5 and sources["runtime.log_warmup_steps"] == "--preset demo"


def test_repeating_a_saved_value_is_no_contradiction(tmp_path):
    saved_run(tmp_path, "--preset", "demo")
    _, config = arguments.parse(["eval", "--model_dir", str(tmp_path), "--preset", "demo", "--backbone", "resnet18",
                                 "--image_size", "128", "128"])
    assert config.model.backbone == "resnet18"


def test_print_config_names_the_source_of_every_non_default_value(tmp_path, capsys):
    saved_run(tmp_path, "--preset", "demo", "--l2_weight_decay", "5e-5", "--config_override",
              "model.rpn.rpn_min_size=1")
    status = main.main(["train", "--print_config", "--model_dir", str(tmp_path), "--preset", "demo", "--seed", "7",
                        "--config_override", "train.momentum=0.8"])
    printed = json.loads(capsys.readouterr().out)
    sources, saved = printed["sources"], f"saved config {tmp_path}/config.json"
    assert status == 0
    assert sources["train.l2_weight_decay"] == sources["model.rpn.rpn_min_size"] == sources["model.freeze_bn"] == saved
    assert sources["model.backbone"] == sources["train.epochs"] == saved
    assert sources["runtime.log_warmup_steps"] == "--preset demo"
    assert sources["train.seed"] == "--seed" and sources["runtime.model_dir"] == "--model_dir"
    assert sources["train.momentum"] == "--config_override"
    # Exactly the non-default values have a source.
    defaults = Config().to_dict()
    changed = {path for path in field_paths(Config()) if get_in(printed, path) != get_in(defaults, path)}
    assert set(sources) == changed


def get_in(tree, path):
    for part in path.split("."):
        tree = tree[part]
    return tree


@pytest.mark.parametrize("text, names", [
    ('{"model": {"backbone": "resnet18", "colour": 1}}', ["unknown config key 'model.colour'"]),
    ('{"model": {"num_classes": "six"}}', ["model.num_classes", "'six' is not of type int"]),
    ('{"model": ', ["not readable JSON"]),
])
def test_a_malformed_saved_config_is_an_error_naming_the_file_and_key(tmp_path, capsys, text, names):
    (tmp_path / "config.json").write_text(text)
    status, lines = main_status(["eval", "--model_dir", str(tmp_path)], capsys)
    assert status == 2 and len(lines) == 1, lines
    for name in ["--model_dir", f"{tmp_path}/config.json", *names]:
        assert name in lines[0], (name, lines[0])


# -- TensorFlow's environment -----------------------------------------------------------------------------------


@pytest.mark.parametrize("environ, onednn, expected, user_log_level", [
    ({}, None, {"TF_CPP_MIN_LOG_LEVEL": "2", "TF_ENABLE_ONEDNN_OPTS": "1"}, False),  # the rule: quiet, oneDNN on
    ({"TF_CPP_MIN_LOG_LEVEL": "0", "TF_ENABLE_ONEDNN_OPTS": "0"}, None,
     {"TF_CPP_MIN_LOG_LEVEL": "0", "TF_ENABLE_ONEDNN_OPTS": "0"}, True),  # the user's variables win over the rule
    ({"TF_ENABLE_ONEDNN_OPTS": "0"}, "on", {"TF_CPP_MIN_LOG_LEVEL": "2", "TF_ENABLE_ONEDNN_OPTS": "1"}, False),
    ({"TF_ENABLE_ONEDNN_OPTS": "1"}, "off", {"TF_CPP_MIN_LOG_LEVEL": "2", "TF_ENABLE_ONEDNN_OPTS": "0"}, False),
])
def test_tensorflow_environment_follows_the_rule_the_users_variables_and_onednn_flag(
        environ, onednn, expected, user_log_level):
    assert cli.set_tensorflow_environment(onednn, environ) is user_log_level
    assert environ == expected


@pytest.mark.parametrize("environ, expected", [({}, "0"), ({"TF_CPP_MIN_LOG_LEVEL": "3"}, "3")])
def test_verbose_shows_tensorflows_info_lines_unless_the_user_set_the_level(environ, expected):
    assert cli.set_tensorflow_environment(None, environ, verbose=True) is True  # start-up lines shown as they come
    assert environ["TF_CPP_MIN_LOG_LEVEL"] == expected


def test_start_up_is_quiet_unless_the_user_sets_tensorflows_log_level(tmp_path):
    # export of a model_dir without a checkpoint: TensorFlow starts, then the run stops with one error line.
    env = {k: v for k, v in os.environ.items() if k not in ("TF_CPP_MIN_LOG_LEVEL", "TF_ENABLE_ONEDNN_OPTS")}
    command = [sys.executable, "main.py", "export", "--model_dir", str(tmp_path)]
    quiet = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True)
    assert quiet.returncode == 2 and len(quiet.stderr.strip().splitlines()) == 1, quiet.stderr
    assert "checkpoint" in quiet.stderr and str(tmp_path) in quiet.stderr
    # The scripts that start TensorFlow start it the same way.
    converter = subprocess.run([sys.executable, "weights/convert_keras_resnet.py", "--h5", str(tmp_path / "none.h5"),
                                "--output", str(tmp_path / "w")], cwd=ROOT, env=env, capture_output=True, text=True)
    assert converter.returncode == 2 and len(converter.stderr.strip().splitlines()) == 1, converter.stderr
    for onednn, banner in (("on", True), ("off", False)):
        loud = subprocess.run([*command, "--onednn", onednn], cwd=ROOT, env={**env, "TF_CPP_MIN_LOG_LEVEL": "0"},
                              capture_output=True, text=True)
        assert loud.returncode == 2 and "cuda" in loud.stderr.lower(), loud.stderr  # TensorFlow's own lines
        assert ("oneDNN custom operations are on" in loud.stderr) is banner, loud.stderr


def test_onednns_dtype_notice_is_held_back_at_start_up():
    # oneDNN logs, as an error, once per process and at the first op in a dtype it has no kernels of on this
    # CPU (float16 without AVX512-FP16), that TensorFlow's own kernels run instead: under --amp_dtype float16
    # that was mid-run. A process started as main.py starts TensorFlow says nothing.
    env = {k: v for k, v in os.environ.items() if k not in ("TF_CPP_MIN_LOG_LEVEL", "TF_ENABLE_ONEDNN_OPTS")}
    code = ("from mrcnn_tf2.cli import import_tensorflow\ntf = import_tensorflow()\n"
            "x, kernel = tf.ones([1, 8, 8, 3], tf.float16), tf.ones([3, 3, 3, 4], tf.float16)\n"
            "print(tf.nn.conv2d(x, kernel, 1, 'SAME').dtype)")
    result = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True)
    assert result.returncode == 0 and result.stdout.strip() == "<dtype: 'float16'>", result.stderr
    assert result.stderr == ""


def test_start_up_leaves_scikit_learn_to_whatever_imports_it_later():
    # Keras imports scikit-learn, when installed (the openvino extra), for wrappers the package never uses.
    code = ("import sys\nfrom mrcnn_tf2.cli import import_tensorflow\nimport_tensorflow()\n"
            "print('sklearn' in sys.modules)\nimport sklearn.base\nprint(sklearn.base.BaseEstimator.__name__)")
    result = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True)
    assert result.stdout.split() == ["False", "BaseEstimator"], result.stderr


def test_a_python_without_tensorflow_gets_one_line_naming_the_fix(tmp_path):
    # As `python main.py ...` outside .venv, and a converter, which starts TensorFlow as main.py does.
    code = ("import sys\nsys.modules['tensorflow'] = None  # what `import tensorflow` meets there\n"
            "import main\nfrom weights import convert_keras_resnet\n"
            "for run, argv in ((main.main, ['export', '--model_dir', sys.argv[1]]),\n"
            "                  (convert_keras_resnet.main, ['--h5', 'w.h5', '--output', sys.argv[1] + '/w'])):\n"
            "    try:\n        run(argv)\n    except SystemExit as exit:\n        print(exit.code)\n")
    result = subprocess.run([sys.executable, "-c", code, str(tmp_path)], cwd=ROOT, capture_output=True, text=True)
    assert result.stdout.split() == ["2", "2"], result.stderr
    lines = result.stderr.splitlines()
    assert len(lines) == 2 and lines[0] == lines[1], result.stderr
    for part in (f"TensorFlow is not installed for {sys.executable}", "make setup", "source .venv/bin/activate"):
        assert part in lines[0]


@pytest.mark.parametrize("policy, amp, loss_scaled, line", [
    ("float32", False, False, "precision float32"),
    ("float32", True, False, "precision float32 (--amp fell back: this CPU computes bfloat16 no faster)"),
    ("mixed_float16", True, True, "precision mixed_float16: float16 compute, float32 variables; dynamic loss scaling"),
    ("mixed_bfloat16", True, False, "precision mixed_bfloat16: bfloat16 compute, float32 variables"),
])
def test_the_start_up_line_names_the_precision_policy(policy, amp, loss_scaled, line):
    from mrcnn_tf2.runtime.precision import describe_precision  # imports Keras: here, not at the top

    assert describe_precision(policy, amp, loss_scaled) == line


def test_the_predictor_path_is_a_model_directory_an_artefact_or_an_error_naming_it(tmp_path):
    with pytest.raises(ConfigError, match="name a model directory, a checkpoint or an exported artefact"):
        arguments.config_for_path(None)
    with pytest.raises(ConfigError, match=f"^path: {tmp_path / 'none'}: no such file or directory$"):
        arguments.config_for_path(tmp_path / "none")
    assert arguments.config_for_path(tmp_path).runtime.model_dir == str(tmp_path)  # a directory: a model directory
    (tmp_path / "model.onnx").write_text("x")
    assert arguments.config_for_path(tmp_path / "model.onnx").infer.exported == str(tmp_path / "model.onnx")
    (tmp_path / "config.json").write_text("{}")  # an export directory: its config.json beside an artefact
    assert arguments.config_for_path(tmp_path).infer.exported == str(tmp_path)
    (tmp_path / "ckpt-1.index").write_text("x")  # a training checkpoint: a model directory after all
    assert arguments.config_for_path(tmp_path).runtime.model_dir == str(tmp_path)


@pytest.mark.parametrize("mode, flag", [("train", "--model_dir"), ("eval", "--model_dir"), ("infer", "--output_dir"),
                                        ("train", "--log_tensorboard")])
def test_a_file_where_a_run_writes_its_directory_is_named_before_anything_starts(tmp_path, mode, flag):
    (tmp_path / "file").write_text("mine")
    argv = [mode, "--model_dir", str(tmp_path / ("file" if flag == "--model_dir" else "run"))]
    if flag == "--output_dir":
        argv += ["--output_dir", str(tmp_path / "file"), "--input", str(tmp_path)]
    if flag == "--log_tensorboard":
        argv += ["--log_tensorboard", str(tmp_path / "file")]
    with pytest.raises(ConfigError, match=f"^{flag}: {tmp_path / 'file'} is a file, not a directory$"):
        arguments.check_inputs(mode, arguments.parse(argv)[1])


def test_a_directory_a_run_cannot_write_is_named_before_anything_starts(tmp_path, monkeypatch):
    read_only = tmp_path / "ro"  # a model directory mounted read-only, say
    read_only.mkdir()
    for name in ("train-0.tfrecord", "val-0.tfrecord"):  # what training, evaluation and the benchmark read
        (tmp_path / name).write_bytes(b"")
    access = os.access  # root writes whatever the permission bits say, and a read-only mount needs privileges
    monkeypatch.setattr(os, "access", lambda path, mode: path != str(read_only) and access(path, mode))
    for argv, problem in (
            (["eval", "--model_dir", read_only, "--data_dir", tmp_path],
             f"--model_dir: {read_only} cannot be written"),
            (["train", "--model_dir", read_only / "run", "--data_dir", tmp_path],
             f"--model_dir: {read_only}/run (in {read_only}) cannot"),
            (["infer", "--model_dir", read_only, "--input", tmp_path],
             f"--output_dir: {read_only}/inference (in {read_only}) cannot be written"),
            (["export", "--model_dir", read_only], f"--export_dir: {read_only}/saved_model (in {read_only}) cannot")):
        with pytest.raises(ConfigError, match=f"^{re.escape(problem)}"):
            arguments.check_inputs(argv[0], arguments.parse([str(arg) for arg in argv])[1])
    # Elsewhere, or writing nothing: taken.
    for argv in (["infer", "--model_dir", read_only, "--input", tmp_path, "--output_dir", tmp_path / "out"],
                 ["infer", "--model_dir", read_only, "--benchmark", "--data_dir", tmp_path],
                 ["export", "--model_dir", read_only, "--export_dir", tmp_path / "exported"]):
        arguments.check_inputs(argv[0], arguments.parse([str(arg) for arg in argv])[1])


def test_a_visualize_font_needs_visualize_and_a_file(tmp_path):
    font = str(tmp_path / "labels.ttf")
    with pytest.raises(ConfigError, match="^--visualize_font: draws the labels of --visualize's pictures: give "):
        arguments.check_inputs("infer", arguments.parse(["infer", "--visualize_font", font])[1])
    with pytest.raises(ConfigError, match=f"^--visualize_font: no such file {font}$"):
        arguments.check_inputs("infer", arguments.parse(["infer", "--visualize", "--visualize_font", font])[1])


def test_a_signal_outside_trainings_own_stop_unwinds_the_run_then_is_one_line_and_its_status(monkeypatch, capsys,
                                                                                            tmp_path):
    unwound, seen = [], []

    def signalled(config, signum=signal.SIGINT):
        # What the signal meets, for the failure's message: its handler, the thread, the signals blocked.
        seen.append((signal.getsignal(signum), threading.current_thread().name,
                     signal.pthread_sigmask(signal.SIG_BLOCK, [])))
        try:
            os.kill(os.getpid(), signum)
            time.sleep(5)  # the handler raises before this ends
        finally:
            unwound.append(signum)  # where the run removes its temporary files

    monkeypatch.setattr(cli, "check_inputs", lambda mode, config: None)
    monkeypatch.setitem(sys.modules, "signalled_runner", types.SimpleNamespace(run=signalled))
    monkeypatch.setitem(cli.RUNNERS, "export", "signalled_runner")
    with terminations_by_default():
        assert main.main(["export"]) == 130, seen
        assert capsys.readouterr().err.splitlines()[-1] == "main.py: stopped by SIGINT"
        for signum in (signal.SIGTERM, signal.SIGHUP):
            monkeypatch.setattr(sys.modules["signalled_runner"], "run", lambda config: signalled(config, signum))
            assert main.main(["export"]) == 128 + signum
            assert capsys.readouterr().err.splitlines()[-1] == f"main.py: stopped by {signal.Signals(signum).name}"
            assert signal.getsignal(signum) is signal.SIG_DFL  # given back

        def turned_into_another(config):
            try:
                signalled(config, signal.SIGTERM)
            except BaseException:
                raise TypeError from None  # what TensorFlow's C++ made of it in a trace (an export, seen once)

        monkeypatch.setattr(sys.modules["signalled_runner"], "run", turned_into_another)
        assert main.main(["export"]) == 128 + signal.SIGTERM
        assert capsys.readouterr().err.splitlines()[-1] == "main.py: stopped by SIGTERM"

        def swallowed(config, output):
            try:
                signalled(config, signal.SIGTERM)
            except BaseException:
                pass  # what TensorFlow's C++ op dispatcher does with it inside a trace
            if output:
                files.write_json(output, {"complete": True})
            return status.OK

        # The run goes on, but publishes nothing after the signal, and ends as stopped.
        for output in (str(tmp_path / "result.json"), None):
            monkeypatch.setattr(sys.modules["signalled_runner"], "run", lambda config: swallowed(config, output))
            assert main.main(["export"]) == 128 + signal.SIGTERM
            assert capsys.readouterr().err.splitlines()[-1] == "main.py: stopped by SIGTERM"
            assert os.listdir(tmp_path) == []
    assert unwound == [signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGTERM, signal.SIGTERM, signal.SIGTERM]
    files.write_json(str(tmp_path / "result.json"), {})  # once the run is over, a commit is taken again
    monkeypatch.setattr(sys.modules["signalled_runner"], "run", lambda config: 1 / 0)
    with pytest.raises(ZeroDivisionError):  # without a signal an error is the run's own
        main.main(["export"])


def test_a_write_the_disk_refuses_is_one_line_and_status_1_and_any_other_error_stays_a_traceback(capsys):
    full = OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), "/results/eval_results.json.tmp-7")
    assert status.write_failure(full) == "No space left on device: /results/eval_results.json.tmp-7"
    assert status.write_failure(OSError(errno.EFBIG, os.strerror(errno.EFBIG))) == "File too large"
    saved = Exception("{{function_node __wrapped__SaveV2_dtypes_143}} /out.tmp-9/variables/variables_temp/part-0; "
                      "No space left on device [Op:SaveV2]")  # TensorFlow's, whatever its class
    assert status.write_failure(saved) == "No space left on device: /out.tmp-9/variables/variables_temp/part-0"
    assert status.write_failure(OSError(errno.ENOENT, "No such file or directory", "/x")) is None
    assert status.write_failure(ValueError("bad value")) is None

    def fails(err):
        raise err

    assert status.run_stoppable(lambda: fails(full), "main.py") == status.FAILURE
    assert capsys.readouterr().err == (
        "main.py: error: a file could not be written (No space left on device: /results/eval_results.json.tmp-7)\n")
    with pytest.raises(ValueError, match="bad value"):
        status.run_stoppable(lambda: fails(ValueError("bad value")), "main.py")


def test_every_range_checked_is_a_numeric_setting_and_the_blocks_range_is_the_backbones():
    from mrcnn_tf2.config import POSITIVE, RANGES
    from mrcnn_tf2.model import backbone

    defaults = Config()
    for key in [key for key, _, _ in RANGES] + list(POSITIVE):
        value = defaults.get(key)
        items = value if isinstance(value, tuple) else (value,)
        assert all(type(item) in (int, float) for item in items if item is not None), key
    assert [(low, high) for key, low, high in RANGES if key == "model.freeze_blocks"] == [
        (backbone.STEM_GROUP, backbone.NUM_GROUPS)]
    defaults.validate()  # the defaults lie in their ranges


def test_training_appends_its_log_only_to_a_runs_log_or_a_new_file(tmp_path):
    def check(log_file):
        arguments.check_inputs("train", arguments.parse(["train", "--model_dir", str(tmp_path / "run"), "--data_dir",
                                                         str(tmp_path), "--log_file", str(log_file)])[1])

    (tmp_path / "train-0.tfrecord").write_bytes(b"")
    with pytest.raises(ConfigError, match=f"^--log_file: {tmp_path} is a directory: name the JSON-lines file$"):
        check(tmp_path)
    # A file that is not a run's log (an annotation file named by mistake) would get lines appended to it.
    (tmp_path / "instances_train.json").write_text(json.dumps({"images": [], "annotations": []}))
    (tmp_path / "notes.txt").write_text("my notes\n")
    for name in ("instances_train.json", "notes.txt"):
        with pytest.raises(ConfigError, match=f"^--log_file: {tmp_path / name} is not a run's log"):
            check(tmp_path / name)
    (tmp_path / "log.jsonl").write_text(json.dumps({"event": "start", "time": 1.0}) + "\n")
    (tmp_path / "empty.jsonl").write_text("")
    for name in ("log.jsonl", "empty.jsonl", "new.jsonl"):
        check(tmp_path / name)


def test_a_path_flag_starting_with_a_tilde_is_under_the_home_directory(tmp_path, monkeypatch):
    # As a shell expands it where none did: a quoted glob, a job spec run without a shell.
    monkeypatch.setenv("HOME", str(tmp_path))
    assert set(arguments._PATH_FLAGS) <= set(arguments._FLAGS)
    _, config = arguments.parse(["infer", "--model_dir", "~/m", "--input", "~/photos/*.jpg", "--output_dir", "~/out",
                                 "--label_map", "~", "--data_dir", "data~/~"])
    assert (config.runtime.model_dir, config.infer.input, config.infer.output_dir, config.infer.label_map) == (
        f"{tmp_path}/m", f"{tmp_path}/photos/*.jpg", f"{tmp_path}/out", str(tmp_path))
    assert config.data.data_dir == "data~/~"  # only a leading one
    assert arguments.parse(["train", "--model_dir", "~/m"])[1].runtime.model_dir == f"{tmp_path}/m"
