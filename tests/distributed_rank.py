"""One rank of test_distributed's two-rank job, run under a launcher (`horovodrun -np 2`, `mpirun -np 2`) from the
repository's root: python -m tests.distributed_rank OUT_DIR STEPS RECORDS DRAWS.

Synchronised updates: each rank builds the Trainer of `sync_config` with its own seed (so the weights differ
until the broadcast), takes its image of the fixed two-image batch (rank r: image r), runs STEPS updates and
writes OUT_DIR/rank<r>.npz: the trainable weights after the broadcast (`initial_<i>`) and after the updates
(`final_<i>`), in model.trainable_variables order.

Records: each rank builds the training input of the TFRecord pattern RECORDS as `Trainer.dataset` does (its
rank as shard index, the world size as shard count; augmentation off, seed fixed), reads DRAWS batches of one
image and writes their source ids to OUT_DIR/rank<r>.json.
"""

import json
import os
import sys

import numpy as np

from mrcnn_tf2.cli import import_tensorflow

tf = import_tensorflow()  # as main.py starts it

from mrcnn_tf2.data.pipeline import InputPipeline  # noqa: E402
from mrcnn_tf2.model.factory import build_anchors, choose_ops  # noqa: E402
from mrcnn_tf2.runtime.distributed import init_world  # noqa: E402
from mrcnn_tf2.runtime.logger import RunLogger  # noqa: E402
from tests.support import combined_batch, small_config, sync_config, trainer_for  # noqa: E402


def synchronised_updates(world, out_dir, steps):
    trainer = trainer_for(sync_config(1, seed=1 + world.rank, model_dir=os.path.join(out_dir, "model")), world)
    batch = tf.nest.map_structure(lambda t: t[world.rank:world.rank + 1], combined_batch())
    trainer._restore_or_initialise(RunLogger(os.devnull, verbose=False))
    initial = [v.numpy() for v in trainer.model.trainable_variables]
    update = trainer.update_function()
    for _ in range(steps):
        update([batch])
    final = [v.numpy() for v in trainer.model.trainable_variables]
    np.savez(os.path.join(out_dir, f"rank{world.rank}.npz"),
             **{f"initial_{i}": v for i, v in enumerate(initial)}, **{f"final_{i}": v for i, v in enumerate(final)})


def shared_records(world, pattern, draws, out_dir):
    config = small_config()
    config.data.augment_input_data = False
    pipeline = InputPipeline(config, training=True, anchors=build_anchors(config),
                             rpn_targets=choose_ops(config).rpn_targets)
    dataset = pipeline.dataset(pattern, 1, world.rank, world.size)
    ids = [int(batch["source_ids"][0]) for batch in dataset.take(draws)]
    with open(os.path.join(out_dir, f"rank{world.rank}.json"), "w") as f:
        json.dump(ids, f)


def main(out_dir, steps, records, draws):
    world = init_world()
    if world.size != 2:
        raise SystemExit(f"run under a launcher with 2 processes (world size is {world.size})")
    synchronised_updates(world, out_dir, steps)
    shared_records(world, records, draws, out_dir)


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]), sys.argv[3], int(sys.argv[4]))
