"""What a run reports: console progress lines, a JSON-lines log, TensorBoard scalars (and with --log_graph the
traced update step's graph).

Every record goes to all three sinks; the JSON-lines file is appended to, so a resumed run continues the
log of the run it resumes. Throughput excludes the first `warmup_steps` steps of this process (tracing
and allocator warm-up would otherwise dominate short runs).
"""

import contextlib
import json
import math
import os
import time

import tensorflow as tf
from tensorflow.core.framework import summary_pb2

from mrcnn_tf2.console import say

# TensorBoard shows a record as a scalar when it carries this metadata. tf.summary.scalar, which adds it,
# lives in the tensorboard package, which TensorFlow >= 2.20 no longer installs: write it ourselves.
_SCALAR_METADATA = summary_pb2.SummaryMetadata(
    plugin_data=summary_pb2.SummaryMetadata.PluginData(plugin_name="scalars"))


def format_duration(seconds):
    """12345.6 -> '3:25:46'."""
    seconds = int(round(seconds))
    return f"{seconds // 3600}:{seconds % 3600 // 60:02d}:{seconds % 60:02d}"


class RunLogger:
    """Writes metric records to the console, `log_file` (JSON lines) and `tensorboard_dir` (optional)."""

    def __init__(self, log_file, tensorboard_dir=None, verbose=True):
        os.makedirs(os.path.dirname(os.path.abspath(log_file)), exist_ok=True)
        self.log = open(log_file, "a", encoding="utf-8")
        self.writer = tf.summary.create_file_writer(tensorboard_dir) if tensorboard_dir else None
        self.tensorboard_dir = tensorboard_dir
        self.verbose = verbose

    def event(self, name, echo=True, **fields):
        """A one-off record (run start with its config, checkpoint written, run end); `echo` prints it too."""
        self._write({"event": name, "time": time.time(), **fields})
        if self.verbose and echo:
            details = " ".join(f"{k} {v}" for k, v in fields.items())
            say(f"[train] {name} {details}")

    def metrics(self, step, values, line, event="metrics"):
        """A record of `values` at update `step`: JSON line (of kind `event`), TensorBoard scalars, and
        `line` on the console."""
        self._write({"event": event, "time": time.time(), "step": step, **values})
        if self.writer is not None:
            with self.writer.as_default(step=step):
                for name, value in values.items():
                    if isinstance(value, (int, float)) and math.isfinite(value):
                        tf.summary.write(name, tf.constant(value, tf.float32), metadata=_SCALAR_METADATA)
            self.writer.flush()
        if self.verbose:
            say(line)

    def graph(self, graph, default_dir):
        """Writes `graph` (a tf.Graph) for TensorBoard's Graphs tab into the summary directory, or into
        `default_dir` when the logger has none (then only the graph goes there), and records where."""
        directory = self.tensorboard_dir or default_dir
        writer = self.writer or tf.summary.create_file_writer(directory)
        with writer.as_default():
            tf.summary.graph(graph)
        if writer is self.writer:
            writer.flush()
        else:
            writer.close()
        self.event("graph", directory=directory)

    def last(self, event):
        """The newest record of kind `event` in the log file (a resumed run's log holds the earlier runs'), or
        None. Lines that are not JSON (the last one of a process that was killed while writing) are passed over."""
        found = None
        with open(self.log.name, encoding="utf-8") as f:
            for line in f:
                with contextlib.suppress(ValueError):
                    record = json.loads(line)
                    if isinstance(record, dict) and record.get("event") == event:
                        found = record
        return found

    def _write(self, record):
        self.log.write(json.dumps(record) + "\n")
        self.log.flush()

    def close(self):
        self.log.close()
        if self.writer is not None:
            self.writer.close()
