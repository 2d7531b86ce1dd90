"""Training checkpoints in model_dir: periodic saves, a bounded history, and restore with fallback.

A run that is killed at any moment resumes from the newest checkpoint that reads back completely; a
truncated or corrupt one is reported and the one before it is used. TensorFlow writes each checkpoint's
files before it updates the `checkpoint` index, so an interrupted save never becomes the latest one.
"""

import sys

import tensorflow as tf


class CheckpointKeeper:
    """Saves and restores `tf.train.Checkpoint(**objects)` under `directory`, keeping `max_to_keep`."""

    def __init__(self, directory, max_to_keep, **objects):
        self.checkpoint = tf.train.Checkpoint(**objects)
        # Created on first save otherwise; it must exist for a restore to consume the whole checkpoint.
        self.checkpoint.save_counter  # noqa: B018
        self.manager = tf.train.CheckpointManager(self.checkpoint, directory, max_to_keep=max_to_keep)

    def save(self, step):
        """Writes the checkpoint of update `step` (an int) and returns its path."""
        return self.manager.save(checkpoint_number=step)

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
                reason = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
                print(f"[train] checkpoint {path} is unreadable ({reason}); trying the one before", file=sys.stderr)
                failures.append(path)
                continue
            return path
        if failures:
            raise RuntimeError(f"no readable checkpoint in {self.manager.directory}: tried {', '.join(failures)}")
        return None
