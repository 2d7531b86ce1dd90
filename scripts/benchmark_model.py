"""Throughput and peak memory of the train step and the predict step, through `main.py ... --benchmark`.

    .venv/bin/python scripts/benchmark_model.py                           # the issue's grid, ResNet-50
    .venv/bin/python scripts/benchmark_model.py --modes train --batch_sizes 2 --precisions fp32 \
        --allocators default jemalloc

Each case is one `main.py train|infer --benchmark --use_synthetic_data` process (one real batch repeated,
so the input pipeline is not measured), on generated shapes images; the script reads the JSON line the
benchmark prints and the process's peak resident memory (from wait4), and prints a table, then the rows
as JSON lines. Weights are random: speed does not depend on them.

`--allocators` runs the same cases with another malloc preloaded (LD_PRELOAD): jemalloc keeping freed
pages (MALLOC_CONF dirty/muzzy decay off, as the peers were measured), or tcmalloc; Debian's packages
libjemalloc2 and libtcmalloc-minimal4 provide them.
"""

import argparse
import itertools
import json
import os
import subprocess
import sys
import tempfile

# A sibling script: run as a file, Python puts this folder first on sys.path; imported as scripts.benchmark_model
# (by the tests), it is a module of the scripts package.
if __package__:
    from .benchmark_pipeline import ROOT, generated_records
else:
    from benchmark_pipeline import ROOT, generated_records

ALLOCATORS = {
    "default": {},
    "jemalloc": {"LD_PRELOAD": "/usr/lib/x86_64-linux-gnu/libjemalloc.so.2",
                 "MALLOC_CONF": "dirty_decay_ms:-1,muzzy_decay_ms:-1"},
    "tcmalloc": {"LD_PRELOAD": "/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4"},
}
# main.py mode and the batch-size flag of each measured step.
MODES = {"train": ("train", "--train_batch_size"), "predict": ("infer", "--eval_batch_size")}
# Random weights at NVIDIA's learning rate diverge within a few steps (a non-finite loss stops the run); a
# step's cost does not depend on the rate. 1e-5 at learning_rate_batch_size images, with no warm-up.
STABLE_LEARNING_RATE = ("--init_learning_rate", "1e-5", "--learning_rate_values", "1e-5",
                        "--learning_rate_boundaries", "0")


def run_measured(argv, env=None):
    """Runs `argv` in the checkout to its end; returns (its output, stdout and stderr interleaved; its exit
    code; its peak resident memory in GiB, from wait4)."""
    process = subprocess.Popen(argv, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    output = process.stdout.read()
    _, status, usage = os.wait4(process.pid, 0)
    # ru_maxrss is in KiB on Linux.
    return output, os.waitstatus_to_exitcode(status), usage.ru_maxrss / 2**20


def run_case(pattern, mode, batch_size, precision, allocator, args):
    """One benchmark process; returns its JSON record with peak_rss_gib added (None on failure)."""
    env = dict(os.environ, **ALLOCATORS[allocator])
    if "LD_PRELOAD" in env and not os.path.exists(env["LD_PRELOAD"]):
        raise SystemExit(f"{allocator}: {env['LD_PRELOAD']} is missing (apt-get install the Debian package)")
    main_mode, batch_flag = MODES[mode]
    with tempfile.TemporaryDirectory() as model_dir:
        # The generated records serve as the training and the validation files (predict reads the latter).
        argv = [sys.executable, "main.py", main_mode, "--benchmark", "--use_synthetic_data",
                "--config_override", f"data.training_file_pattern={pattern}",
                "--config_override", f"data.validation_file_pattern={pattern}", "--model_dir", model_dir,
                "--backbone", args.backbone,
                "--image_size", *map(str, args.image_size), "--num_classes", "6", batch_flag, str(batch_size),
                "--log_warmup_steps", str(args.warmup), "--benchmark_steps", str(args.steps),
                "--custom_ops", args.custom_ops, "--seed", "0"]
        if mode == "train":
            argv += STABLE_LEARNING_RATE
        if precision == "bf16":
            argv.append("--amp")
        output, code, peak_rss_gib = run_measured(argv, env)
    records = [json.loads(line) for line in output.splitlines() if line.startswith('{"benchmark"')]
    if code != 0 or not records:
        print(f"[benchmark] {mode} bs{batch_size} {precision} {allocator} failed:\n{output[-3000:]}", file=sys.stderr)
        return None
    return dict(records[-1], mode=mode, allocator=allocator, peak_rss_gib=peak_rss_gib)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--modes", nargs="+", choices=sorted(MODES), default=["train", "predict"])
    parser.add_argument("--batch_sizes", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--precisions", nargs="+", choices=["fp32", "bf16"], default=["fp32", "bf16"])
    parser.add_argument("--allocators", nargs="+", choices=sorted(ALLOCATORS), default=["default"])
    parser.add_argument("--backbone", default="resnet50")
    parser.add_argument("--image_size", type=int, nargs=2, default=(832, 1344), metavar=("H", "W"))
    parser.add_argument("--custom_ops", choices=["auto", "on", "off"], default="auto")
    parser.add_argument("--warmup", type=int, default=2, help="steps before timing (tracing, allocator warm-up)")
    parser.add_argument("--steps", type=int, default=5, help="timed steps")
    args = parser.parse_args(argv)
    rows = []
    with tempfile.TemporaryDirectory() as directory:
        pattern = generated_records(directory, 8)
        print(f"{'step':8s} {'batch':>5s} {'precision':>9s} {'allocator':>9s} {'img/s':>7s} {'p50 s':>7s} "
              f"{'peak GiB':>8s}", flush=True)
        for mode, batch_size, precision, allocator in itertools.product(
                args.modes, args.batch_sizes, args.precisions, args.allocators):
            record = run_case(pattern, mode, batch_size, precision, allocator, args)
            if record is None:
                continue
            rows.append(record)
            # The policy that ran: --amp falls back to float32 on a CPU without bfloat16 instructions.
            print(f"{mode:8s} {batch_size:5d} {record['precision']:>9s} {allocator:>9s} "
                  f"{record['throughput_img_per_s']:7.3f} {record['latency_s']['p50']:7.2f} "
                  f"{record['peak_rss_gib']:8.2f}", flush=True)
    for row in rows:
        print(json.dumps(row))
    cases = len(args.modes) * len(args.batch_sizes) * len(args.precisions) * len(args.allocators)
    return 0 if len(rows) == cases else 1


if __name__ == "__main__":
    sys.exit(main())
