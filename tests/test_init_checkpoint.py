"""`main.py train --init_checkpoint`: a new run from another run's model weights (optimizer, step and schedule
fresh), class layers reinitialised for another --num_classes, the errors that name what does not fit, and
the resume that wins over it."""

import numpy as np
import pytest
import tensorflow as tf

from mrcnn_tf2.arguments import parse
from mrcnn_tf2.cli import main
from mrcnn_tf2.runtime import train as train_runtime
from tests.support import SCHEDULE_FLAGS, SMALL_FLAGS, TRAINED_STEPS, read_log

# The Keras layer names of the class-dependent variables (box head logits and deltas, mask head logits).
CLASS_LAYERS = ("/class_logits/", "/box_deltas/", "/mask_logits/")


def train(data_dir, model_dir, *flags):
    """Exit status of `main.py train` on the small model, run in this process."""
    return main(["train", "--data_dir", data_dir, "--model_dir", str(model_dir), *SMALL_FLAGS, *SCHEDULE_FLAGS,
                 *flags])


@pytest.fixture
def first_update(monkeypatch):
    """The state of the next Trainer as its first update starts (after initialisation, before any step):
    dict with `model` [(Keras path, value)] in model.variables order, `optimizer` {path: value}, `step`."""
    seen = {}
    update_function = train_runtime.Trainer.update_function

    def recording_update_function(trainer):
        update = update_function(trainer)

        def recording_update(batches):
            if not seen:
                seen.update(model=[(v.path, v.numpy()) for v in trainer.model.variables],
                            optimizer={v.path: v.numpy() for v in trainer.optimizer.variables},
                            step=int(trainer.step.numpy()))
            return update(batches)

        return recording_update

    monkeypatch.setattr(train_runtime.Trainer, "update_function", recording_update_function)
    return seen


def restored_weights(model_dir):
    """Values of the model variables (in model.variables order) of the newest checkpoint in `model_dir`,
    restored by TensorFlow's own restore into the model of the config saved there."""
    _, config = parse(["train", "--model_dir", str(model_dir)])
    trainer = train_runtime.Trainer(config)
    trainer.build()
    tf.train.Checkpoint(model=trainer.model).read(
        tf.train.latest_checkpoint(str(model_dir))).assert_existing_objects_matched().expect_partial()
    return [v.numpy() for v in trainer.model.variables]


def is_class_variable(path):
    return any(layer in path for layer in CLASS_LAYERS)


def metrics(model_dir):
    return [r for r in read_log(model_dir / "log.jsonl") if r["event"] == "metrics"]


def test_a_new_run_starts_from_the_weights_alone(tmp_path, shapes_records, trained_model, first_update, capsys):
    run_b = tmp_path / "b"
    assert train(shapes_records["data_dir"], run_b, "--epochs", "1", "--seed", "2",
                 "--init_checkpoint", str(trained_model)) == 0
    out = capsys.readouterr().out
    # Steps 1.. at the schedule's start: each step's learning rate is A's at the same step (which differ).
    rates = [r["learning_rate"] for r in metrics(trained_model)][:2]
    assert [r["step"] for r in metrics(run_b)] == [1, 2]
    assert [r["learning_rate"] for r in metrics(run_b)] == rates and rates[0] != rates[1]
    # Every model variable is A's before the first step; the optimizer (iterations, momentum) and step are fresh.
    expected = restored_weights(trained_model)
    assert len(first_update["model"]) == len(expected)
    for (path, value), reference in zip(first_update["model"], expected):
        np.testing.assert_array_equal(value, reference, err_msg=path)
    assert first_update["step"] == 0
    assert first_update["optimizer"] and not any(np.any(value) for value in first_update["optimizer"].values())
    (loaded,) = [r for r in read_log(run_b / "log.jsonl") if r["event"] == "init checkpoint loaded"]
    assert loaded["checkpoint"] == str(trained_model / f"ckpt-{TRAINED_STEPS}") and loaded["step"] == TRAINED_STEPS
    assert loaded["variables"] == len(expected) and loaded["reinitialised"] == [] == loaded["ignored"]
    assert (f"init checkpoint {trained_model / f'ckpt-{TRAINED_STEPS}'} (step {TRAINED_STEPS}): loaded {len(expected)} "
            "model variables") in out
    assert not [r for r in read_log(run_b / "log.jsonl") if r["event"] == "resumed"]


def test_another_num_classes_reinitialises_the_class_layers_alone(tmp_path, shapes_records, trained_model, first_update,
                                                                   capsys):
    run_b = tmp_path / "b"
    assert train(shapes_records["data_dir"], run_b, "--epochs", "1", "--steps_per_epoch", "1", "--seed", "2",
                 "--init_checkpoint", str(trained_model), "--num_classes", "8") == 0
    out = capsys.readouterr().out
    expected = restored_weights(trained_model)  # 6 classes
    reinitialised = []
    for (path, value), reference in zip(first_update["model"], expected):
        if is_class_variable(path):
            # The new model's shape (8 classes: logits, 4 x 8 box deltas), at its initialiser's values.
            assert value.shape[:-1] == reference.shape[:-1] and value.shape[-1] * 6 == reference.shape[-1] * 8
            assert not np.array_equal(value[..., :reference.shape[-1]], reference), path
            reinitialised.append((list(reference.shape), list(value.shape)))
        else:
            np.testing.assert_array_equal(value, reference, err_msg=path)
    assert len(reinitialised) == 6  # kernel and bias of each of the three layers
    (loaded,) = [r for r in read_log(run_b / "log.jsonl") if r["event"] == "init checkpoint loaded"]
    assert sorted((r["checkpoint_shape"], r["model_shape"]) for r in loaded["reinitialised"]) == sorted(reinitialised)
    assert loaded["variables"] == len(expected) - 6
    lines = [line for line in out.splitlines() if "newly initialised" in line]
    assert len(lines) == 6
    for record in loaded["reinitialised"]:
        assert any(record["variable"] in line and str(record["checkpoint_shape"]) in line
                   and str(record["model_shape"]) in line for line in lines), record
    assert {r["variable"].split("/")[0] for r in loaded["reinitialised"]} == {"box_head", "mask_head"}


def test_a_checkpoint_with_a_mask_head_initialises_a_model_without_one(tmp_path, shapes_records, trained_model, capsys):
    run_b = tmp_path / "b"
    assert train(shapes_records["data_dir"], run_b, "--epochs", "1", "--steps_per_epoch", "1",
                 "--init_checkpoint", str(trained_model), "--config_override", "model.include_mask=false") == 0
    (loaded,) = [r for r in read_log(run_b / "log.jsonl") if r["event"] == "init checkpoint loaded"]
    assert loaded["ignored"] and all(name.startswith("mask_head/") for name in loaded["ignored"])
    assert "ignored its" in capsys.readouterr().out


@pytest.mark.parametrize("flags, named", [
    (["--backbone", "resnet34"], ["resnet18", "resnet34", "model.backbone"]),
    # Not a config contradiction (fpn_num_filters is left to the variables): the FPN's first kernel is named,
    # though it differs in its last axis alone, as a class layer's may.
    (["--config_override", "model.fpn_num_filters=128"],
     ["fpn/fpn_lateral2/_kernel is [1, 1, 64, 256] in the checkpoint, [1, 1, 64, 128] in the model"]),
])
def test_a_checkpoint_that_does_not_fit_is_an_error_naming_what(tmp_path, shapes_records, trained_model, capsys, flags,
                                                                named):
    status = train(shapes_records["data_dir"], tmp_path / "b", "--init_checkpoint", str(trained_model), *flags)
    err = capsys.readouterr().err
    assert status == 2
    assert "--init_checkpoint" in err and str(trained_model) in err and all(text in err for text in named), err
    assert not tf.train.latest_checkpoint(str(tmp_path / "b"))


def test_a_path_without_a_checkpoint_is_an_error_naming_it(tmp_path, shapes_records, capsys):
    empty, garbage = tmp_path / "empty", tmp_path / "garbage"
    empty.mkdir()
    (tmp_path / "garbage.index").write_bytes(b"not a checkpoint")
    for path, problem in ((tmp_path / "missing", "neither a model directory"), (empty, "without a checkpoint"),
                          (garbage, "not a readable checkpoint")):
        status = train(shapes_records["data_dir"], tmp_path / "b", "--init_checkpoint", str(path))
        err = capsys.readouterr().err
        assert status == 2 and f"--init_checkpoint: {path}" in err and problem in err, err


def test_init_checkpoint_counts_as_pretrained_and_excludes_backbone_checkpoint(capsys):
    _, config = parse(["train", "--init_checkpoint", "/runs/a"])
    assert config.pretrained() and config.model.freeze_bn is True and config.model.freeze_blocks == (0, 1)
    with pytest.raises(SystemExit) as exit_info:
        parse(["train", "--init_checkpoint", "/runs/a", "--backbone_checkpoint", "/weights/resnet50"])
    err = capsys.readouterr().err
    assert exit_info.value.code == 2 and "--init_checkpoint" in err and "--backbone_checkpoint" in err


def test_a_run_with_its_own_checkpoint_resumes_from_it(tmp_path, shapes_records, trained_model, capsys):
    run_b = tmp_path / "b"
    flags = ["--steps_per_epoch", "1", "--init_checkpoint", str(trained_model)]
    assert train(shapes_records["data_dir"], run_b, "--epochs", "1", *flags) == 0
    capsys.readouterr()
    assert train(shapes_records["data_dir"], run_b, "--epochs", "2", *flags) == 0
    out = capsys.readouterr().out
    log = read_log(run_b / "log.jsonl")
    second = log[[r["event"] for r in log].index("resumed"):]  # the rerun's records
    assert second[0]["event"] == "resumed" and second[0]["checkpoint"] == str(run_b / "ckpt-1")
    assert second[0]["step"] == 1 and [r["step"] for r in second if r["event"] == "metrics"] == [2]
    assert not [r for r in second if r["event"] == "init checkpoint loaded"]
    assert out.count("is ignored") == 1 and f"--init_checkpoint {trained_model} is ignored" in out
