"""One rank of test_distributed's record-sharding test, run under `horovodrun -np 2` from the repository's root:
python -m tests.distributed_records PATTERN COUNT OUT_DIR.

Each rank builds the training input of PATTERN as `Trainer.dataset` does (its rank as shard index, the
world size as shard count; augmentation off, seed fixed), reads COUNT batches of one image and writes
their source ids to OUT_DIR/rank<r>.json.
"""

import json
import os
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

from mrcnn_tf2.data.pipeline import InputPipeline  # noqa: E402
from mrcnn_tf2.model.factory import build_anchors, choose_ops  # noqa: E402
from mrcnn_tf2.runtime.distributed import init_world  # noqa: E402
from tests.support import small_config  # noqa: E402


def main(pattern, count, out_dir):
    world = init_world()
    if world.size != 2:
        raise SystemExit(f"run under horovodrun -np 2 (world size is {world.size})")
    config = small_config()
    config.data.augment_input_data = False
    pipeline = InputPipeline(config, training=True, anchors=build_anchors(config),
                             rpn_targets=choose_ops(config).rpn_targets)
    dataset = pipeline.dataset(pattern, 1, world.rank, world.size)
    ids = [int(batch["source_ids"][0]) for batch in dataset.take(count)]
    with open(os.path.join(out_dir, f"rank{world.rank}.json"), "w") as f:
        json.dump(ids, f)


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]), sys.argv[3])
