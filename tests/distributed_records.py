"""One rank of test_distributed's record-sharding test, run under `horovodrun -np 2`:
python tests/distributed_records.py PATTERN COUNT OUT_DIR.

Each rank builds the training input of PATTERN as `Trainer.dataset` does (its rank as shard index, the
world size as shard count; augmentation off, seed fixed), reads COUNT batches of one image and writes
their source ids to OUT_DIR/rank<r>.json.

It imports its test helpers as siblings (Python puts the directory of the script it runs first on sys.path),
so that it runs from any directory.
"""

import json
import os
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

from mrcnn_tf2.runtime.distributed import init_world  # noqa: E402
from test_pipeline import make_config, training_pipeline  # noqa: E402


def main(pattern, count, out_dir):
    world = init_world()
    if world.size != 2:
        raise SystemExit(f"run under horovodrun -np 2 (world size is {world.size})")
    dataset = training_pipeline(make_config(augment=False)).dataset(pattern, 1, world.rank, world.size)
    ids = [int(batch["source_ids"][0]) for batch in dataset.take(count)]
    with open(os.path.join(out_dir, f"rank{world.rank}.json"), "w") as f:
        json.dump(ids, f)


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]), sys.argv[3])
