"""One rank of test_distributed's sync test, run under `horovodrun -np 2` from the repository's root:
python -m tests.distributed_sync OUT_DIR STEPS.

Each rank builds the Trainer of `sync_config` with its own seed (so the weights differ until the
broadcast), takes its image of the fixed two-image batch (rank r: image r), runs STEPS updates and writes
OUT_DIR/rank<r>.npz: the trainable weights after the broadcast (`initial_<i>`) and after the updates
(`final_<i>`), in model.trainable_variables order.
"""

import os
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

from mrcnn_tf2.runtime.distributed import init_world  # noqa: E402
from mrcnn_tf2.runtime.logger import RunLogger  # noqa: E402
from tests.support import combined_batch, sync_config, trainer_for  # noqa: E402


def main(out_dir, steps):
    world = init_world()
    if world.size != 2:
        raise SystemExit(f"run under horovodrun -np 2 (world size is {world.size})")
    trainer = trainer_for(sync_config(1, seed=1 + world.rank, model_dir=os.path.join(out_dir, "model")), world)
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
