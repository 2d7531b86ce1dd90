"""The README's main job on the embedded default data: generate, convert, train, evaluate, infer, measure.

    python scripts/demo.py [--quick] [--output_dir DIR] [--seed N]

Each stage is the command a user would type; the script runs them in order, shows which one is running
(training prints its progress line), stops at the first that fails with its exit status, and ends with a
summary: COCO bbox and mask AP on the generated validation split, the training run's own throughput, the
inference throughput of `main.py infer --benchmark`, and where the pictures are. Files go to DIR (default
./demo); the summary is also written there as summary.json. --quick is the test suite's shorter run (fewer
images and steps, a lower AP). The model and its schedule are `main.py --preset demo`.
"""

import argparse
import json
import os
import signal
import subprocess
import sys
import time

from mrcnn_tf2 import files
from mrcnn_tf2.console import say
from mrcnn_tf2.runtime import stop_signals

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# The model and its schedule are `--preset demo` (mrcnn_tf2/presets.py). Per size: generated images, their
# side in pixels, and the training flags that the shorter run changes. 200 validation scenes (606 objects)
# keep the AP's sampling noise small.
SIZES = {
    "full": dict(num_train=3400, num_val=200, side=128, train_flags=[]),
    # 400 steps over 800 scenes: long enough that the test's AP floor tells a learning model from a broken
    # one, 50 validation scenes to keep its sampling noise small. Scenes of 64 px (objects of 8 to 32 px),
    # trained at that size: the step costs about 0.86 of a 96 px one (the heads' fixed work stays), and the
    # model learns as much.
    "quick": dict(num_train=800, num_val=50, side=64,
                  train_flags=["--image_size", "64", "64", "--epochs", "4", "--learning_rate_boundaries", "0.1",
                               "3.3"]),
}
# Validation images drawn with their detections, and the steps of the inference benchmark.
PICTURES, BENCHMARK_STEPS = 4, 10


def stages(size, out, seed):
    """(title, argv after the Python interpreter) of each stage."""
    shapes, records, model = (os.path.join(out, name) for name in ("shapes", "tfrecords", "model"))
    val_json = os.path.join(shapes, "annotations", "instances_val.json")
    yield "generate the synthetic shapes dataset", [
        "dataset/make_shapes_dataset.py", "--output_dir", shapes, "--num_train", str(size["num_train"]),
        "--num_val", str(size["num_val"]), "--seed", str(seed),
        "--min_size", str(size["side"]), "--max_size", str(size["side"]),
    ]
    for split in ("train", "val"):
        yield f"convert the {split} split to TFRecords", [
            "dataset/create_coco_tf_record.py", "--image_dir", os.path.join(shapes, split),
            "--annotations_file", os.path.join(shapes, "annotations", f"instances_{split}.json"),
            "--output_dir", records, "--num_shards", "4",
        ]
    # Training saves its config in the model directory: the later commands need only what they change.
    yield "train Mask R-CNN from scratch", [
        "main.py", "train", "--preset", "demo", "--data_dir", records, "--model_dir", model, "--seed", str(seed),
        *size["train_flags"],
    ]
    yield "evaluate COCO AP on the validation split", ["main.py", "eval", "--model_dir", model, "--eval_file", val_json]
    yield f"draw the detections on {PICTURES} validation images", [
        "main.py", "infer", "--model_dir", model, "--eval_file", val_json, "--eval_samples", str(PICTURES),
        "--visualize", "--output_dir", os.path.join(out, "inference"),
    ]
    yield "measure inference throughput", [
        "main.py", "infer", "--model_dir", model, "--benchmark", "--use_synthetic_data",
        "--benchmark_steps", str(BENCHMARK_STEPS), "--log_warmup_steps", "2",
    ]


def run_stage(argv):
    """Runs `python argv`, echoing its output; returns (exit status, output lines).

    Ctrl-C, SIGTERM or SIGHUP (a closed terminal) sends the stage SIGTERM and goes on echoing until it ends:
    training then stops after a checkpoint (mrcnn_tf2.runtime.stop_signals), which a rerun resumes from. Left to
    themselves, this script would end at once and the stage, writing to a closed pipe, would fail before its
    checkpoint. A second signal reaches the stage as a second SIGTERM, which stops it at once. Echoing into a
    console that is gone (console.say) is not an error. A signal this script ignores (SIGHUP under `nohup`,
    SIGINT in a background job) stays ignored, as in main.py (stop_signals.StopSignals).
    """
    process = subprocess.Popen([sys.executable, *argv], cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                               text=True, bufsize=1)
    # None: a handler set outside Python, which could not be given back.
    previous = {signum: signal.signal(signum, lambda *_: process.send_signal(signal.SIGTERM))
                for signum in stop_signals.SIGNALS if signal.getsignal(signum) not in (signal.SIG_IGN, None)}
    lines = []
    try:
        for line in process.stdout:
            say(line.rstrip("\n"))
            lines.append(line)
        return process.wait(), lines
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)


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
    parser.add_argument("--seed", type=int, default=0, help="seeds the generated scenes and the training")
    args = parser.parse_args(argv)
    out = os.path.abspath(args.output_dir)
    started = time.time()
    plan = list(stages(SIZES["quick" if args.quick else "full"], out, args.seed))
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
    files.write_json(os.path.join(out, "summary.json"), summary, indent=1)
    print(f"\n[demo] summary ({summary['total_s']:.0f} s)\n"
          f"bbox AP: {summary['bbox AP']:.3f}\nmask AP: {summary['mask AP']:.3f}\n"
          f"train throughput: {summary['train throughput']:.2f} img/s\n"
          f"inference throughput: {summary['inference throughput']:.2f} img/s\n"
          f"pictures: {summary['pictures']}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
