"""One rank of test_distributed's sync test, run under `horovodrun -np 2`: python tests/distributed_sync.py OUT_DIR STEPS.

Each rank builds the Trainer of `sync_config` with its own seed (so the weights differ until the
broadcast), takes its image of the fixed two-image batch (rank r: image r), runs STEPS updates and writes
OUT_DIR/rank<r>.npz: the trainable weights after the broadcast (`initial_<i>`) and after the updates
(`final_<i>`), in model.trainable_variables order.

It imports its test helpers as siblings (Python puts the directory of the script it runs first on sys.path),
so that it runs from any directory; test_distributed imports it, and pytest puts tests/ on sys.path too.
"""

import os
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

from mrcnn_tf2.runtime.distributed import init_world  # noqa: E402
from mrcnn_tf2.runtime.logger import RunLogger  # noqa: E402
from mrcnn_tf2.runtime.train import Trainer  # noqa: E402
from test_model import small_config, synthetic_batch  # noqa: E402
from test_train import equally_weighted_config  # noqa: E402


def sync_config(batch_size, seed, model_dir):
    """test_train's equally weighted Faster R-CNN, `batch_size` images per rank."""
    config = equally_weighted_config()
    config.train.train_batch_size = batch_size
    config.train.seed = seed
    config.train.steps_per_epoch = 10
    config.data.training_file_pattern = "/nonexistent/train-*.tfrecord"  # never read: steps_per_epoch is set
    config.runtime.model_dir = model_dir
    return config


def combined_batch():
    """The two-image batch, one object in each image."""
    return synthetic_batch(small_config(), objects_per_image=(1, 1))


def main(out_dir, steps):
    world = init_world()
    if world.size != 2:
        raise SystemExit(f"run under horovodrun -np 2 (world size is {world.size})")
    trainer = Trainer(sync_config(1, seed=1 + world.rank, model_dir=os.path.join(out_dir, "model")), world)
    batch = tf.nest.map_structure(lambda t: t[world.rank:world.rank + 1], combined_batch())
    trainer._restore_or_initialise(batch, RunLogger(os.devnull, verbose=False))
    initial = [v.numpy() for v in trainer.model.trainable_variables]
    update = trainer.update_function()
    for _ in range(steps):
        update([batch])
    final = [v.numpy() for v in trainer.model.trainable_variables]
    np.savez(os.path.join(out_dir, f"rank{world.rank}.npz"),
             **{f"initial_{i}": v for i, v in enumerate(initial)}, **{f"final_{i}": v for i, v in enumerate(final)})


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]))
