"""The README's main job on the embedded default data: generate, convert, train, then evaluate COCO AP.

Each stage is the same command a user would type; the script runs them in order, shows which one is
running, and stops at the first that fails, with its exit status. Generated files go to ./demo/.
"""

import json
import os
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEMO = os.path.join(ROOT, "demo")
SHAPES = os.path.join(DEMO, "shapes")
RECORDS = os.path.join(DEMO, "tfrecords")
MODEL = os.path.join(DEMO, "model")

NUM_TRAIN, NUM_VAL, SEED = 400, 50, 0
# The CPU-sized preset: small images, ResNet-18, and second-stage budgets sized to a few objects per image
# (64 RoIs per image, at most 16 of them foreground for the mask head), so that a step takes seconds.
# Learning rates are per image of the batch (NVIDIA's convention): 2.5e-3 x 4 images = 0.01.
PRESET = [
    "--backbone", "resnet18", "--image_size", "256", "256", "--train_batch_size", "4", "--seed", str(SEED),
    "--epochs", "2", "--init_learning_rate", "2.5e-4", "--learning_rate_values", "2.5e-3", "2.5e-4",
    "--learning_rate_boundaries", "0.2", "1.5", "--log_every", "10", "--log_warmup_steps", "5",
    "--checkpoint_every", "50",
    "--config_override", "model.roi.batch_size_per_im=64",
    "--config_override", "model.rpn.train_rpn_pre_nms_topn=1000",
    "--config_override", "model.rpn.train_rpn_post_nms_topn=300",
    "--config_override", "data.max_num_instances=32",
]


def stages():
    """(title, argv) of each stage; argv after the Python interpreter."""
    val_json = os.path.join(SHAPES, "annotations", "instances_val.json")
    yield "generate the synthetic shapes dataset", [
        "dataset/make_shapes_dataset.py", "--output_dir", SHAPES, "--num_train", str(NUM_TRAIN),
        "--num_val", str(NUM_VAL), "--seed", str(SEED),
    ]
    for split in ("train", "val"):
        yield f"convert the {split} split to TFRecords", [
            "dataset/create_coco_tf_record.py", "--image_dir", os.path.join(SHAPES, split),
            "--annotations_file", os.path.join(SHAPES, "annotations", f"instances_{split}.json"),
            "--output_dir", RECORDS, "--num_shards", "4",
        ]
    yield "train Mask R-CNN from scratch", lambda: [
        "main.py", "train", "--data_dir", RECORDS, "--model_dir", MODEL, "--eval_file", val_json,
        "--num_classes", str(num_classes(val_json)), *PRESET,
    ]
    yield "evaluate COCO AP on the validation split", lambda: [
        "main.py", "eval", "--data_dir", RECORDS, "--model_dir", MODEL, "--eval_file", val_json,
        "--num_classes", str(num_classes(val_json)), *PRESET,
    ]


def num_classes(annotations_file: str) -> str:
    """Classes the model predicts: the dataset's largest category id plus background."""
    with open(annotations_file) as f:
        return str(max(c["id"] for c in json.load(f)["categories"]) + 1)


def main() -> int:
    started = time.time()
    plan = list(stages())
    for index, (title, argv) in enumerate(plan, 1):
        argv = argv() if callable(argv) else argv
        print(f"\n[demo {index}/{len(plan)}] {title}\n$ python {' '.join(argv)}", flush=True)
        status = subprocess.call([sys.executable, *argv], cwd=ROOT)
        if status:
            print(f"\n[demo] stopped at stage {index}/{len(plan)} ({title}): exit status {status}", flush=True)
            return status
    print(f"\n[demo] done in {time.time() - started:.0f} s", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
