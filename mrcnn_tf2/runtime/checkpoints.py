"""Training checkpoints in model_dir: periodic saves, a bounded history, restore with fallback, and the
model weights of another run's checkpoint (--init_checkpoint).

A run that is killed at any moment resumes from the newest checkpoint that reads back completely; a
truncated or corrupt one is reported and the one before it is used. TensorFlow writes each checkpoint's
files before it updates the `checkpoint` index, so an interrupted save never becomes the latest one.

`TrainingCheckpoint` reads the model's variables alone out of a training checkpoint. It matches them as
TensorFlow's restore does, by the names of the objects from the model to each variable in the checkpoint's
object graph, but checks every variable's shape before it assigns any, so that a checkpoint that does not
fit is one error naming each variable with both shapes rather than the restore's first opaque failure.
"""

import collections
import dataclasses
import os
import re
import shutil
import sys

import tensorflow as tf
from google.protobuf.message import DecodeError
from tensorflow.core.protobuf import trackable_object_graph_pb2

from mrcnn_tf2 import files
from mrcnn_tf2.config import SAVED_CONFIG_FILE, ConfigError, load_saved_config
from mrcnn_tf2.runtime.weight_average import AVERAGE_KEY

INIT_FLAG = "--init_checkpoint"
# A training checkpoint's model, as CheckpointKeeper's tf.train.Checkpoint(model=...) names it.
MODEL_KEY = "model"
# An error names this many variables that do not fit, then counts the others.
NAMED_PROBLEMS = 5
# How a checkpoint that cannot be read fails: in the reader's C++ (OpError), in its Python code on a
# truncated data file (IndexError), or in parsing its object graph (DecodeError).
UNREADABLE = (tf.errors.OpError, IndexError, DecodeError)


class CheckpointWriteError(Exception):
    """A training checkpoint could not be written (`CheckpointKeeper.save`): training stops with status 1."""


class CheckpointKeeper:
    """Saves and restores `tf.train.Checkpoint(**objects)` under `directory`, keeping `max_to_keep`."""

    def __init__(self, directory, max_to_keep, **objects):
        self.checkpoint = tf.train.Checkpoint(**objects)
        # Created on first save otherwise; it must exist for a restore to consume the whole checkpoint.
        self.checkpoint.save_counter  # noqa: B018
        self.manager = tf.train.CheckpointManager(self.checkpoint, directory, max_to_keep=max_to_keep)

    def save(self, step):
        """Writes the checkpoint of update `step` (an int) and returns its path.

        Raises CheckpointWriteError when it cannot (a full disk, a file system gone), after removing what the
        save wrote: its partial files would fill the disk further and are never read.
        """
        try:
            return self.manager.save(checkpoint_number=step)
        except (tf.errors.OpError, OSError) as err:
            prefix = os.path.join(self.manager.directory, f"ckpt-{step}")
            # TensorFlow writes into <prefix>_temp/ and then renames its files to <prefix>.index and .data-*.
            for partial in tf.io.gfile.glob(f"{prefix}_temp*") + tf.io.gfile.glob(f"{prefix}.*"):
                files.remove(partial)
            latest = self.manager.latest_checkpoint
            resume = (f"the newest checkpoint is {latest}" if latest else "there is no checkpoint yet") + (
                ", which rerunning the same command resumes from once there is room")
            raise CheckpointWriteError(f"the checkpoint of step {step} could not be written in "
                                       f"{self.manager.directory} ({_reason(err)}); {resume}") from None

    def restore_latest(self):
        """Restores the newest readable checkpoint; returns its path, or None when there is none.

        Raises RuntimeError naming every checkpoint tried when none of them reads back.
        """
        candidates = list(reversed(self.manager.checkpoints))
        failures = []
        for path in candidates:
            try:
                # Every saved object must match: a checkpoint of another model is an error, not a partial load.
                self.checkpoint.read(path).assert_consumed()
            # A damaged file fails in many ways (OpError, IndexError from the reader, AssertionError from
            # a partial match...): any failure means this checkpoint cannot be trusted.
            except Exception as err:  # noqa: BLE001
                print(f"[train] checkpoint {path} is unreadable ({_first_line(err)}); trying the one before",
                      file=sys.stderr)
                failures.append(f"{path} ({_first_line(err)})")
                continue
            return path
        if failures:
            raise RuntimeError(f"no readable checkpoint in {self.manager.directory}: tried {'; '.join(failures)}")
        return None


def copy_checkpoint(prefix, directory, contents):
    """Makes the checkpoint `prefix` the one checkpoint of the model directory `directory` (made if need be), with
    `contents` {file name: bytes} beside it, and returns its new prefix. Its files are hard-linked where the file
    system allows (no bytes copied, and they outlive the CheckpointManager's removal of the originals), else
    copied; each file is written under a temporary name and renamed, the `checkpoint` index that
    tf.train.latest_checkpoint reads comes after the checkpoint's files and before `contents`, and the checkpoint
    it named before is removed last, so that a reader finds a whole checkpoint at every moment. Other files there
    (an export, inference outputs) are left as they are."""
    name = os.path.basename(prefix)
    os.makedirs(directory, exist_ok=True)
    before = tf.train.latest_checkpoint(directory)
    for source in tf.io.gfile.glob(f"{prefix}.*"):
        with files.atomic_path(os.path.join(directory, os.path.basename(source))) as temporary:
            try:
                os.link(source, temporary)
            except OSError:
                shutil.copyfile(source, temporary)
    index = f'model_checkpoint_path: "{name}"\nall_model_checkpoint_paths: "{name}"\n'
    for file_name, data in {"checkpoint": index.encode(), **contents}.items():
        files.write_bytes(os.path.join(directory, file_name), data)
    if before is not None and os.path.basename(before) != name:
        for old in tf.io.gfile.glob(f"{before}.*"):
            files.remove(old)
    return os.path.join(directory, name)


def find_checkpoint(path):
    """The checkpoint prefix `path` names: the newest checkpoint of a model directory (as
    tf.train.latest_checkpoint finds it), or `path` itself when it is a prefix.

    Raises ConfigError('--init_checkpoint') naming `path` when it is neither.
    """
    if tf.io.gfile.isdir(path):
        prefix = tf.train.latest_checkpoint(path)
        if prefix is None:
            raise ConfigError(INIT_FLAG, f"{path} is a directory without a checkpoint")
        return prefix
    if not tf.io.gfile.exists(f"{path}.index"):
        raise ConfigError(INIT_FLAG, f"{path} is neither a model directory holding checkpoints nor a checkpoint "
                                     "prefix (the path without .index / .data-*)")
    return path


def check_saved_model_config(path, prefix, config):
    """Compares the config saved next to the checkpoint (config.json in `prefix`'s directory, when there is
    one) with the run's `config` (mrcnn_tf2.config.Config).

    A different backbone or ResNet variant (stride_in_1x1) is an error: the weights would not fit, or would
    fit and compute something else. A different num_classes is fine-tuning (the class layers are
    reinitialised), and the other model-defining keys are left to TrainingCheckpoint.load_model_weights,
    which names each variable that does not fit; those that change no weight (image size, anchor sizes)
    may differ.

    Raises ConfigError('--init_checkpoint') naming `path`, the key and both values, or the unreadable file.
    """
    directory = os.path.dirname(prefix)
    try:
        saved = load_saved_config(directory)
    except ConfigError as err:
        raise ConfigError(INIT_FLAG, err.message) from None
    for key in ("model.backbone", "model.stride_in_1x1"):
        if saved and key in saved and saved[key] != config.get(key):
            raise ConfigError(INIT_FLAG, f"{path} holds a model with {key} = {saved[key]} "
                                         f"({os.path.join(directory, SAVED_CONFIG_FILE)}), this run has "
                                         f"{key} = {config.get(key)}")


@dataclasses.dataclass
class LoadedWeights:
    """What TrainingCheckpoint.load_model_weights did. Variables are named by their path of object names
    from the model, as the checkpoint's object graph holds them (e.g. box_head/class_dense/_kernel)."""

    # Number of model variables assigned from the checkpoint.
    loaded: int
    # (name, shape in the checkpoint, shape in the model) of each class variable left at its initial value.
    reinitialised: list
    # (name, shape) of each checkpoint variable under a part of the model that this model lacks.
    ignored: list


class TrainingCheckpoint:
    """A checkpoint written by CheckpointKeeper, opened for its model's weights (--init_checkpoint).

    The constructor reads the index and the object graph, so that a file that is no such checkpoint fails
    before any work; the weights are read by load_model_weights.

    Attributes: `prefix`; `step`, the training step it was written at (None when it holds no step); `averaged`,
    whether the weights read are the moving average its run kept (train.ema_decay) rather than the last step's.

    Raises ConfigError('--init_checkpoint') naming `prefix` when it is unreadable or holds no model.
    """

    def __init__(self, prefix):
        self.prefix = prefix
        try:
            self.reader = tf.train.load_checkpoint(prefix)
            self.graph = trackable_object_graph_pb2.TrackableObjectGraph()
            self.graph.ParseFromString(self.reader.get_tensor("_CHECKPOINTABLE_OBJECT_GRAPH"))
            # The checkpoint's top-level objects: model, optimizer, step, save_counter.
            self.tops = {child.local_name: child.node_id for child in self.graph.nodes[0].children}
            step_key = self._value_key(self.tops["step"]) if "step" in self.tops else None
            self.step = None if step_key is None else int(self.reader.get_tensor(step_key))
        except UNREADABLE as err:
            raise ConfigError(INIT_FLAG, f"{prefix} is not a readable checkpoint ({_first_line(err)})") from None
        if MODEL_KEY not in self.tops:
            raise ConfigError(INIT_FLAG, f"{prefix} holds no model ({', '.join(sorted(self.tops)) or 'nothing'}): "
                                         "it is not a training checkpoint (a pretrained backbone goes to "
                                         "--backbone_checkpoint)")
        self.averaged = AVERAGE_KEY in self.tops
        self.source = AVERAGE_KEY if self.averaged else MODEL_KEY

    def load_model_weights(self, model, class_layers=(), absent=()):
        """Assigns `model`'s variables their values in the checkpoint; its optimizer, step and everything
        else are left unread.

        Args:
          model: the built model; its `optimizer` attribute (Keras' compile) is not part of it here.
          class_layers: layers whose output has one slice per class: where one of their variables differs
            from the checkpoint's in the last (class) axis alone, it keeps its initial value.
          absent: names of the model's optional parts that this model lacks (e.g. 'mask_head' without a mask
            branch): the checkpoint's variables under them are ignored.

        Returns:
          LoadedWeights.

        Raises:
          ConfigError('--init_checkpoint') naming the checkpoint and each model variable missing from it or
          shaped otherwise there (with both shapes) and each of its variables the model does not have (then
          nothing is assigned), or naming the checkpoint when its values are unreadable.
        """
        graph, model_node = self.graph, self.tops[self.source]
        # Keras' model refers to its optimizer, whose variables include the model's trainable ones: the
        # walks below stay out of it (and the checkpoint's other top-level objects), where they would find
        # the model's variables under the optimizer's names.
        outside = {node for name, node in self.tops.items() if name != self.source}
        optimizer = getattr(model, "optimizer", None)

        def stored_children(node):
            return [(c.local_name, c.node_id) for c in graph.nodes[node].children if c.node_id not in outside]

        def model_children(obj):
            return [(name, child) for name, child in tf.train.TrackableView.children(obj).items()
                    if child is not optimizer]

        # The model's objects matched to the checkpoint's by name, from the model down, as a restore matches
        # them: an object may be reachable under several names (an attribute and its layer's name, which
        # Keras numbers per process), and any one of them that the checkpoint knows suffices.
        matched = {id(model): model_node}
        queue = collections.deque([model])
        while queue:
            obj = queue.popleft()
            known = dict(stored_children(matched[id(obj)]))
            for name, child in model_children(obj):
                if name in known and id(child) not in matched:
                    matched[id(child)] = known[name]
                    queue.append(child)

        names = {key: "/".join(path) for key, path in _paths(model, model_children, key=id).items()}
        shapes = self.reader.get_variable_to_shape_map()
        class_variables = {id(v) for layer in class_layers for v in layer.variables}
        assignments, reinitialised, problems = [], [], []
        for variable in model.variables:
            name, shape = names.get(id(variable), variable.path), list(variable.shape)
            key = self._value_key(matched[id(variable)]) if id(variable) in matched else None
            if key is None:
                problems.append(f"{name} {shape} is not in the checkpoint")
            elif shapes[key] == shape:
                assignments.append((variable, key))
            elif id(variable) in class_variables and shapes[key][:-1] == shape[:-1]:
                reinitialised.append((name, shapes[key], shape))
            else:
                problems.append(f"{name} is {shapes[key]} in the checkpoint, {shape} in the model")

        used = set(matched.values())
        unmatched = {node: "/".join(path) for node, path in _paths(model_node, stored_children).items()
                     if node not in used and self._value_key(node) is not None}
        parts = dict(stored_children(model_node))
        skipped = {node for part in absent if part in parts for node in _paths(parts[part], stored_children)}
        ignored = [(name, shapes[self._value_key(node)]) for node, name in unmatched.items() if node in skipped]
        problems += [f"{name} {shapes[self._value_key(node)]} is in the checkpoint, not in the model"
                     for node, name in unmatched.items() if node not in skipped]
        if problems:
            more = f"; and {len(problems) - NAMED_PROBLEMS} more" if len(problems) > NAMED_PROBLEMS else ""
            raise ConfigError(INIT_FLAG, f"{self.prefix} does not fit the model: "
                                         f"{'; '.join(problems[:NAMED_PROBLEMS])}{more}")
        try:
            for variable, key in assignments:
                variable.assign(self.reader.get_tensor(key))
        except UNREADABLE as err:
            raise ConfigError(INIT_FLAG, f"{self.prefix} is not a readable checkpoint ({_first_line(err)})") from None
        return LoadedWeights(len(assignments), reinitialised, ignored)

    def _value_key(self, node):
        """The checkpoint key of the value of the variable at `node` of the object graph; None for an object
        that is not a variable."""
        return next((a.checkpoint_key for a in self.graph.nodes[node].attributes if a.name == "VARIABLE_VALUE"),
                    None)


def _paths(root, children, key=lambda node: node):
    """{key(node): path} of every node reachable from `root`, where `children(node)` gives (name, child)
    pairs and a node's path is the tuple of names along the first route to it, breadth first."""
    paths = {key(root): ()}
    queue = collections.deque([root])
    while queue:
        node = queue.popleft()
        for name, child in children(node):
            if key(child) not in paths:
                paths[key(child)] = paths[key(node)] + (name,)
                queue.append(child)
    return paths


def _reason(err):
    """What an error of a file operation says went wrong: 'No space left on device' of TensorFlow's
    '{{function_node ...}} /path/ckpt-3_temp/part-...; No space left on device [Op:SaveV2]', else its first line."""
    found = re.search(r"; ([^;]+?)(?: \[Op:\w+\])?$", _first_line(err))
    return found.group(1) if found else _first_line(err)


def _first_line(err):
    return str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
