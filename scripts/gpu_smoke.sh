#!/usr/bin/env bash
# The GPU smoke test: on a machine with one NVIDIA GPU, after `make setup GPU=1` (or in the Dockerfile.gpu
# image), confirms in one go that the package runs there as it should, and prints one table.
#
#   bash scripts/gpu_smoke.sh [OUTPUT_DIR]          (default ./gpu_smoke; replaced if it exists)
#
# Stages, each stopping the script with a message when it fails:
#   1. TensorFlow sees a GPU;
#   2. the device-dependent choices are the GPU's: --amp is mixed_float16, the model holds cuDNN convs and
#      the pure-TF twins (no CPU-only custom op), --custom_ops on is refused;
#   3. a small generated shapes data set, converted to TFRecords;
#   4. 20 training steps with --amp --xla (finite losses, checkpoint, the skipped-step count of the loss
#      scaling in the log);
#   5. eval (COCO metrics written) and 6. infer (predictions and pictures);
#   7. --benchmark img/s of the train step and of inference, at 832x1344, batch 4 / 8, with --amp (train
#      also with --xla), beside NVIDIA's published figures.
# SMOKE_IMAGE_SIZE, SMOKE_TRAIN_BATCH, SMOKE_EVAL_BATCH, SMOKE_BACKBONE, SMOKE_TRAIN_STEPS, SMOKE_NUM_VAL
# (validation images), SMOKE_BENCHMARK_STEPS and SMOKE_WARMUP_STEPS (of the benchmarks) change the
# sizes, and SMOKE_MODEL_FLAGS adds main.py flags to the trained models' (the test suite runs this script on
# a CPU with a faked GPU, MRCNN_TF2_FAKE_GPU=1, at a tiny size with small heads).
set -euo pipefail
cd "$(dirname "$0")/.."

PY=${PYTHON:-.venv/bin/python}
OUT=${1:-gpu_smoke}
IMAGE_SIZE=${SMOKE_IMAGE_SIZE:-832 1344}
TRAIN_BATCH=${SMOKE_TRAIN_BATCH:-4}
EVAL_BATCH=${SMOKE_EVAL_BATCH:-8}
BACKBONE=${SMOKE_BACKBONE:-resnet50}
BENCHMARK_STEPS=${SMOKE_BENCHMARK_STEPS:-50}
WARMUP_STEPS=${SMOKE_WARMUP_STEPS:-10}
TRAIN_STEPS=${SMOKE_TRAIN_STEPS:-20}
NUM_VAL=${SMOKE_NUM_VAL:-16}

stage() { echo; echo "== gpu_smoke $*"; }
fail() { echo "gpu_smoke: FAILED: $*" >&2; exit 1; }
[ -x "$PY" ] || fail "$PY is missing: run 'make setup GPU=1' first"
rm -rf "$OUT"
mkdir -p "$OUT"
# Size flags of the trained models (word-split on purpose); eval and infer read them from config.json.
# shellcheck disable=SC2206
SIZE=(--image_size $IMAGE_SIZE --backbone "$BACKBONE" ${SMOKE_MODEL_FLAGS:-})

stage "1/7: the GPU"
"$PY" - <<'EOF' || fail "TensorFlow sees no GPU (is the NVIDIA driver installed, and requirements-gpu.txt?)"
import os
import sys

from mrcnn_tf2.cli import import_tensorflow

tf = import_tensorflow()
gpus = tf.config.list_physical_devices("GPU")
if os.environ.get("MRCNN_TF2_FAKE_GPU") == "1":
    print("a faked GPU (MRCNN_TF2_FAKE_GPU=1): the GPU's choices, computed on the CPU")
elif not gpus:
    sys.exit(1)
for gpu in gpus:
    details = tf.config.experimental.get_device_details(gpu)
    print(gpu.name, details.get("device_name"), "compute capability", details.get("compute_capability"))
print("tensorflow", tf.__version__, "built with CUDA", tf.sysconfig.get_build_info().get("cuda_version"))
EOF

stage "2/7: the device-dependent choices"
"$PY" - <<'EOF' || fail "the device-dependent choices are not the GPU's (above)"
from mrcnn_tf2.cli import import_tensorflow

import_tensorflow()
from mrcnn_tf2.config import Config, ConfigError
from mrcnn_tf2.model.factory import choose_ops
from mrcnn_tf2.runtime.precision import set_precision

policy = set_precision(True, "auto")
print("--amp policy:", policy)
assert policy == "mixed_float16", policy
ops = choose_ops(Config())
print(ops.describe())
assert ops.device == "GPU" and not ops.fused and ops.conv_route == "plain", ops
config = Config()
config.runtime.custom_ops = "on"
try:
    choose_ops(config)
    raise AssertionError("--custom_ops on was accepted on a GPU")
except ConfigError as err:
    print("--custom_ops on:", err)
EOF

stage "3/7: a generated data set"
"$PY" dataset/make_shapes_dataset.py --output_dir "$OUT/shapes" --num_train 64 --num_val "$NUM_VAL" --seed 0 \
  --min_size 128 --max_size 256 || fail "generating the data set"
for split in train val; do
  "$PY" dataset/create_coco_tf_record.py --image_dir "$OUT/shapes/$split" \
    --annotations_file "$OUT/shapes/annotations/instances_$split.json" --output_dir "$OUT/tfrecords" \
    --num_shards 2 || fail "converting the $split split"
done
VAL_JSON=$OUT/shapes/annotations/instances_val.json

stage "4/7: $TRAIN_STEPS training steps with --amp --xla"
"$PY" main.py train --data_dir "$OUT/tfrecords" --model_dir "$OUT/model" "${SIZE[@]}" --num_classes 6 \
  --train_batch_size "$TRAIN_BATCH" --epochs 1 --steps_per_epoch "$TRAIN_STEPS" --log_every 5 \
  --log_warmup_steps 5 --seed 0 --amp --xla || fail "training"
"$PY" - "$OUT/model" "$TRAIN_STEPS" <<'EOF' || fail "the training log (above)"
import json
import math
import sys

model_dir, steps = sys.argv[1], int(sys.argv[2])
with open(f"{model_dir}/log.jsonl") as f:
    log = [json.loads(line) for line in f]
start = [r for r in log if r["event"] == "start"][0]
print("policy", start["policy"], "|", start["ops"])
assert start["policy"] == "mixed_float16", start["policy"]
assert start["ops"].startswith("ops on the GPU: convs by TensorFlow's convolutions"), start["ops"]
metrics = [r for r in log if r["event"] == "metrics"]
assert metrics and metrics[-1]["step"] == steps, [r["step"] for r in metrics]
assert all(math.isfinite(r["loss_total"]) for r in metrics), [r["loss_total"] for r in metrics]
done = [r for r in log if r["event"] == "done"][0]
print(f"loss_total {metrics[0]['loss_total']:.3f} -> {metrics[-1]['loss_total']:.3f}; loss scale "
      f"{metrics[-1]['amp_loss_scale']:g}; {done['skipped_steps']} of {steps} steps skipped by the loss scaling")
EOF

stage "5/7: eval"
"$PY" main.py eval --model_dir "$OUT/model" --eval_file "$VAL_JSON" --eval_batch_size "$EVAL_BATCH" \
  || fail "eval"
[ -s "$OUT/model/eval_results.json" ] || fail "eval wrote no $OUT/model/eval_results.json"

stage "6/7: infer"
"$PY" main.py infer --model_dir "$OUT/model" --eval_file "$VAL_JSON" --eval_samples 4 --visualize \
  --output_dir "$OUT/inference" || fail "infer"
[ -s "$OUT/inference/predictions.json" ] || fail "infer wrote no $OUT/inference/predictions.json"

stage "7/7: throughput"
benchmark() {  # name, then main.py's arguments; prints the JSON line of its --benchmark report
  local name=$1
  shift
  "$PY" main.py "$@" --benchmark --use_synthetic_data --benchmark_steps "$BENCHMARK_STEPS" \
    --log_warmup_steps "$WARMUP_STEPS" --seed 0 | tee "$OUT/$name.out" || fail "the $name benchmark"
}
# From scratch at the full rate the benchmark's weights would diverge; a step's cost does not depend on it.
benchmark train train --data_dir "$OUT/tfrecords" --model_dir "$OUT/bench_train" "${SIZE[@]}" --num_classes 6 \
  --train_batch_size "$TRAIN_BATCH" --amp --xla --init_learning_rate 1e-5 --learning_rate_values 1e-5 \
  --learning_rate_boundaries 0
benchmark inference infer --model_dir "$OUT/model" --eval_batch_size "$EVAL_BATCH"

"$PY" - "$OUT" "$IMAGE_SIZE" "$TRAIN_BATCH" "$EVAL_BATCH" <<'EOF'
import json
import sys

out, size, train_batch, eval_batch = sys.argv[1:]


def measured(name):
    with open(f"{out}/{name}.out") as f:
        return [json.loads(line) for line in f if line.startswith('{"benchmark"')][-1]


# Published figures of NVIDIA's implementations with AMP (not measured by this package): its TF2 Mask
# R-CNN on one A100, and its PyTorch Mask R-CNN 19.02 on one V100 16G (batch 4 train, 8 inference).
REFERENCE = {"train": "28.6 (TF2, A100)  12.73 (PyTorch, V100)", "inference": "80.7 (TF2, A100)  16.94 (PyTorch, V100)"}
rows = [("train (--amp --xla)", measured("train"), train_batch, REFERENCE["train"]),
        ("inference (--amp)", measured("inference"), eval_batch, REFERENCE["inference"])]
print(f"\ngpu_smoke: all stages passed. Throughput at {size.replace(' ', 'x')}, img/s:")
print(f"{'step':<22}{'batch':>6}{'policy':>16}{'img/s':>10}   NVIDIA's published figures, AMP")
for name, record, batch, reference in rows:
    print(f"{name:<22}{batch:>6}{record['precision']:>16}{record['throughput_img_per_s']:>10.2f}   {reference}")
EOF
