"""The debugging and logging flags of `main.py train`: --xla through the training loop, --log_graph, --eagerly
(with --xla) and --verbose."""

import glob
import math
import os
import re
import subprocess
import sys

import pytest
import tensorflow as tf

import main
from mrcnn_tf2.model.mask_rcnn import MaskRCNN
from mrcnn_tf2.runtime import train as train_runtime
from tests.support import ROOT, SMALL_FLAGS, main_py, read_log

# SMALL_FLAGS at 64x64, one image a step: two steps of the whole loop in seconds, besides XLA's compiling.
TINY_FLAGS = [*SMALL_FLAGS, "--image_size", "64", "64", "--train_batch_size", "1", "--epochs", "1", "--log_every", "1"]
LEARNED_LAYERS = ("backbone", "fpn", "rpn_head", "box_head", "mask_head")


def logged_graph(directory):
    """The GraphDef the event files in `directory` hold (exactly one)."""
    graphs = [tf.compat.v1.GraphDef.FromString(event.graph_def)
              for path in glob.glob(os.path.join(directory, "*"))
              for event in tf.compat.v1.train.summary_iterator(path) if event.graph_def]
    assert len(graphs) == 1, directory
    return graphs[0]


@pytest.fixture
def trainers(monkeypatch):
    """The [(Trainer, update function)] of the runs in this test, recorded as each builds its update step."""
    made = []
    update_function = train_runtime.Trainer.update_function

    def recording(self):
        made.append((self, update_function(self)))
        return made[-1][1]

    monkeypatch.setattr(train_runtime.Trainer, "update_function", recording)
    return made


@pytest.mark.timeout(300)  # a process that XLA-compiles the small model's train step
def test_xla_trains_through_main_with_the_learned_layers_compiled_in_the_step(tmp_path, shapes_records):
    # TensorFlow's C++ INFO lines on, for XLA's "Compiled cluster" line (read at TensorFlow's start: a new process).
    env = {**os.environ, "TF_CPP_MIN_LOG_LEVEL": "0"}
    result = subprocess.run(main_py("train", "--data_dir", shapes_records["data_dir"], "--model_dir", str(tmp_path),
                                    *TINY_FLAGS, "--steps_per_epoch", "2", "--xla", "--log_graph"),
                            cwd=ROOT, env=env, capture_output=True, text=True)
    assert result.returncode == 0, result.stderr[-4000:]
    metrics = [record for record in read_log(tmp_path / "log.jsonl") if record["event"] == "metrics"]
    assert [record["step"] for record in metrics] == [1, 2]
    for record in metrics:
        losses = {name: value for name, value in record.items() if name.startswith("loss_")}
        assert "loss_total" in losses and all(math.isfinite(value) for value in losses.values()), record
    assert tf.train.latest_checkpoint(str(tmp_path)).endswith("ckpt-2")
    assert "Compiled cluster using XLA!" in result.stderr
    # The traced update step (its graph, by --log_graph, in <model_dir>/tensorboard without --log_tensorboard)
    # calls each learned layer's forward and backward as functions TensorFlow must compile with XLA.
    graph = logged_graph(tmp_path / "tensorboard")
    compiled = [node.op for node in graph.node if "_XlaMustCompile" in node.attr and node.attr["_XlaMustCompile"].b]
    assert len(compiled) == 2 * len(LEARNED_LAYERS), compiled


def test_log_graph_writes_the_traced_update_step_with_the_scalars_at_no_extra_trace(tmp_path, shapes_records,
                                                                                     trainers, monkeypatch, capsys):
    traces = []  # the step's Python runs once per trace
    compute_gradients = MaskRCNN.compute_gradients
    monkeypatch.setattr(MaskRCNN, "compute_gradients", lambda *args: traces.append(1) or compute_gradients(*args))
    model_dir, tensorboard = tmp_path / "model", tmp_path / "tb"
    assert main.main(["train", "--data_dir", shapes_records["data_dir"], "--model_dir", str(model_dir), *TINY_FLAGS,
                      "--steps_per_epoch", "2", "--log_graph", "--log_tensorboard", str(tensorboard)]) == 0
    (trainer, update), = trainers
    # One trace in the run, which both steps ran and the graph is of (looked up, not traced again, here).
    traced = update.get_concrete_function([next(iter(trainer.dataset(0)))]).graph.as_graph_def()
    assert len(traces) == 1
    graph = logged_graph(tensorboard)
    assert sorted(node.name for node in graph.node) == sorted(node.name for node in traced.node)
    # The optimizer's update is in it (under "sgd", or "sgd_N" when the process made other SGD optimizers).
    assert any(re.match(r"sgd(_\d+)?/", node.name) for node in graph.node)
    tags = {value.tag for path in glob.glob(str(tensorboard / "*"))
            for event in tf.compat.v1.train.summary_iterator(path) for value in event.summary.value}
    assert "loss_total" in tags
    assert not (model_dir / "tensorboard").exists()
    assert f"[train] graph directory {tensorboard}" in capsys.readouterr().out
    assert [r["directory"] for r in read_log(model_dir / "log.jsonl") if r["event"] == "graph"] == [str(tensorboard)]


def test_eagerly_runs_the_step_untraced_writes_no_graph_and_xla_still_compiles_the_layers(tmp_path, shapes_records,
                                                                                         trainers, capsys):
    assert main.main(["train", "--data_dir", shapes_records["data_dir"], "--model_dir", str(tmp_path), *TINY_FLAGS,
                      "--steps_per_epoch", "1", "--eagerly", "--xla", "--log_graph"]) == 0
    (trainer, update), = trainers
    assert not isinstance(update, tf.types.experimental.PolymorphicFunction)  # the Python function itself
    assert "warning: --log_graph writes no graph under --eagerly" in capsys.readouterr().out
    assert not (tmp_path / "tensorboard").exists()
    # The eager step called each learned layer's XLA-compiled function (a jit_compile function runs compiled).
    model = trainer.model
    for name in LEARNED_LAYERS:
        compiled = model._compiled_layers[(id(getattr(model, name)), True)]
        assert compiled.experimental_get_tracing_count() == 1, name


def test_verbose_shows_tensorflows_own_log(tmp_path):
    # export of a model_dir without a checkpoint: TensorFlow starts, then the run stops with one error line.
    env = {name: value for name, value in os.environ.items() if name != "TF_CPP_MIN_LOG_LEVEL"}
    code = ("import logging, sys, os, main; status = main.main(sys.argv[1:]); import tensorflow as tf; "
            "print(status, os.environ['TF_CPP_MIN_LOG_LEVEL'], "
            "logging.getLevelName(tf.get_logger().getEffectiveLevel()))")
    for verbose in (False, True):
        command = [sys.executable, "-c", code, "export", "--model_dir", str(tmp_path), "--onednn", "on"]
        result = subprocess.run(command + ["-v"] * verbose, cwd=ROOT, env=env, capture_output=True, text=True)
        assert result.stdout.split() == (["2", "0", "INFO"] if verbose else ["2", "2", "WARNING"]), result.stderr
        # TensorFlow's start-up INFO line, held back unless verbose.
        assert ("oneDNN custom operations are on" in result.stderr) is verbose, result.stderr
