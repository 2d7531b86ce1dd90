"""The README's main job on the embedded default data: generate, convert, train, evaluate, infer, measure.

    python scripts/demo.py [--quick] [--output_dir DIR]

Each stage is the command a user would type; the script runs them in order, shows which one is running
(training prints its progress line), stops at the first that fails with its exit status, and ends with a
summary: COCO bbox and mask AP on the generated validation split, the training run's own throughput, the
inference throughput of `main.py infer --benchmark`, and where the pictures are. Files go to DIR (default
./demo); the summary is also written there as summary.json. --quick is the test suite's shorter run (fewer
images and steps, a lower AP).
"""

import argparse
import json
import os
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# The CPU-sized preset. Scenes of 128x128 pixels (objects of 8 to 64 px) trained at that size with
# ResNet-18 from scratch (so batch norm trains and no block is frozen, the default without pretrained
# weights), FPN and the box head's input narrowed to 128 channels and the mask head to 64 (it costs most
# of a step at 128),
# anchors of 16 px on P2 for the small objects, and second-stage budgets sized to a few objects per image.
# Learning rates are those of a global batch of 8 images (train.learning_rate_batch_size), the demo's.
MODEL_FLAGS = [
    "--backbone", "resnet18", "--image_size", "128", "128",
    "--config_override", "model.fpn_num_filters=128",
    "--config_override", "model.mrcnn_head_num_filters=64",
    "--config_override", "model.fast_rcnn_mlp_head_dim=512",
    "--config_override", "model.anchors.anchor_scale=4.0",
    "--config_override", "model.roi.batch_size_per_im=64",
    "--config_override", "model.rpn.train_rpn_pre_nms_topn=500",
    "--config_override", "model.rpn.train_rpn_post_nms_topn=200",
    "--config_override", "model.rpn.test_rpn_pre_nms_topn=500",
    "--config_override", "model.rpn.test_rpn_post_nms_topn=200",
    "--config_override", "data.max_num_instances=32",
]
# Per preset: generated images and the schedule (epochs over the training images at batch 8; boundaries
# end the warm-up, with no floor in steps, and drop the learning rate 10x). Scenes cost about 6 ms each
# to generate and convert, so the full run sees each one twice (850 steps) rather than six times as many fewer ones: at 750 steps,
# 1000 scenes x 6 gave box / mask AP 0.544 / 0.466 and 3000 x 2 gave 0.578 / 0.494. 200 validation scenes
# (606 objects) keep the AP's sampling noise small.
PRESETS = {
    "full": dict(num_train=3400, num_val=200, epochs=2, boundaries=("0.05", "1.4")),
    "quick": dict(num_train=320, num_val=20, epochs=4, boundaries=("0.5", "3.3")),
}
IMAGE_SIDE, BATCH_SIZE, SEED = 128, 8, 0
# Validation images drawn with their detections, and the steps of the inference benchmark.
PICTURES, BENCHMARK_STEPS = 4, 10


def stages(preset, out):
    """(title, argv after the Python interpreter) of each stage."""
    shapes, records, model = (os.path.join(out, name) for name in ("shapes", "tfrecords", "model"))
    val_json = os.path.join(shapes, "annotations", "instances_val.json")
    yield "generate the synthetic shapes dataset", [
        "dataset/make_shapes_dataset.py", "--output_dir", shapes, "--num_train", str(preset["num_train"]),
        "--num_val", str(preset["num_val"]), "--seed", str(SEED),
        "--min_size", str(IMAGE_SIDE), "--max_size", str(IMAGE_SIDE),
    ]
    for split in ("train", "val"):
        yield f"convert the {split} split to TFRecords", [
            "dataset/create_coco_tf_record.py", "--image_dir", os.path.join(shapes, split),
            "--annotations_file", os.path.join(shapes, "annotations", f"instances_{split}.json"),
            "--output_dir", records, "--num_shards", "4",
        ]
    common = ["--data_dir", records, "--model_dir", model, "--num_classes", "6", *MODEL_FLAGS]
    yield "train Mask R-CNN from scratch", [
        "main.py", "train", *common, "--train_batch_size", str(BATCH_SIZE), "--seed", str(SEED),
        "--epochs", str(preset["epochs"]), "--init_learning_rate", "8e-4",
        "--learning_rate_values", "2e-2", "2e-3", "--learning_rate_boundaries", *preset["boundaries"],
        "--config_override", "train.warmup_min_steps=0",
        "--log_every", "25", "--log_warmup_steps", "5", "--checkpoint_every", "100",
    ]
    yield "evaluate COCO AP on the validation split", [
        "main.py", "eval", *common, "--eval_file", val_json, "--eval_batch_size", str(BATCH_SIZE),
    ]
    yield f"draw the detections on {PICTURES} validation images", [
        "main.py", "infer", *common, "--eval_file", val_json, "--eval_samples", str(PICTURES), "--visualize",
        "--output_dir", os.path.join(out, "inference"),
    ]
    yield "measure inference throughput", [
        "main.py", "infer", *common, "--benchmark", "--use_synthetic_data", "--eval_batch_size", str(BATCH_SIZE),
        "--benchmark_steps", str(BENCHMARK_STEPS), "--log_warmup_steps", "2",
    ]


def run_stage(argv):
    """Runs `python argv`, echoing its output; returns (exit status, output lines)."""
    process = subprocess.Popen([sys.executable, *argv], cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                               text=True, bufsize=1)
    lines = []
    for line in process.stdout:
        print(line, end="", flush=True)
        lines.append(line)
    return process.wait(), lines


def summarise(out, inference_lines):
    """The summary dict: APs from eval_results.json, the training run's img/s from its log (steps after
    the warm-up, checkpoints included), and the inference benchmark's JSON line."""
    model = os.path.join(out, "model")
    with open(os.path.join(model, "eval_results.json")) as f:
        metrics = json.load(f)["metrics"]
    with open(os.path.join(model, "log.jsonl")) as f:
        rates = [r["img_per_s"] for r in map(json.loads, f) if r.get("event") == "metrics" and "img_per_s" in r]
    (benchmark,) = [json.loads(line) for line in inference_lines if line.startswith('{"benchmark"')]
    return {"bbox AP": metrics["bbox/AP"], "mask AP": metrics["segm/AP"], "train throughput": rates[-1],
            "inference throughput": benchmark["throughput_img_per_s"],
            "pictures": os.path.join(out, "inference")}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="the test suite's shorter run")
    parser.add_argument("--output_dir", default=os.path.join(ROOT, "demo"), help="where every file goes")
    args = parser.parse_args(argv)
    out = os.path.abspath(args.output_dir)
    started = time.time()
    plan = list(stages(PRESETS["quick" if args.quick else "full"], out))
    lines = []
    for index, (title, command) in enumerate(plan, 1):
        print(f"\n[demo {index}/{len(plan)}] {title} ({time.time() - started:.0f} s so far)\n"
              f"$ python {' '.join(command)}", flush=True)
        status, lines = run_stage(command)
        if status:
            print(f"\n[demo] stopped at stage {index}/{len(plan)} ({title}): exit status {status}", flush=True)
            return status
    summary = summarise(out, lines)
    summary["total_s"] = round(time.time() - started, 1)
    with open(os.path.join(out, "summary.json.tmp"), "w") as f:
        json.dump(summary, f, indent=1)
    os.replace(os.path.join(out, "summary.json.tmp"), os.path.join(out, "summary.json"))
    print(f"\n[demo] summary ({summary['total_s']:.0f} s)\n"
          f"bbox AP: {summary['bbox AP']:.3f}\nmask AP: {summary['mask AP']:.3f}\n"
          f"train throughput: {summary['train throughput']:.2f} img/s\n"
          f"inference throughput: {summary['inference throughput']:.2f} img/s\n"
          f"pictures: {summary['pictures']}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
