#!/usr/bin/env bash
# Trains every backbone from scratch at the default model, learning rate and schedule, and benchmarks it (at
# the rate after the warm-up), at batch 2 at 832x1344 and at the demo's 128x128, on generated shapes; prints each run's exit status, first/last/largest loss and img/s.
#   bash scripts/check_from_scratch.sh [OUT_DIR (default runs/from_scratch)] [BACKBONES...]
# Each 832x1344 run takes minutes on a 2-core CPU (ResNet-101: ~20 s a step).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${1:-runs/from_scratch}
shift || true
BACKBONES=${*:-resnet18 resnet34 resnet50 resnet101}
PY=.venv/bin/python
data() {  # data NAME GENERATOR_SIZE_FLAGS...
  local name=$1; shift
  [ -d "$OUT/$name/tfrecords" ] && return
  $PY dataset/make_shapes_dataset.py --output_dir "$OUT/$name/shapes" --num_val 4 --seed 0 "$@" >/dev/null &&
  $PY dataset/create_coco_tf_record.py --image_dir "$OUT/$name/shapes/train" \
    --annotations_file "$OUT/$name/shapes/annotations/instances_train.json" --output_dir "$OUT/$name/tfrecords" \
    --num_shards 2 >/dev/null
}
summary() {  # summary NAME STATUS LOG
  $PY - "$@" <<'PY'
import json, sys
name, status, log = sys.argv[1:]
records = [json.loads(line) for line in open(log)]
losses = [r["loss_total"] for r in records if r["event"] == "metrics"]
rates = [r["throughput_img_per_s"] for r in records if r["event"] == "benchmark"]
print(f"{name:28s} exit {status}  steps {len(losses)}  loss first {losses[0]:.3f} last {losses[-1]:.3f} "
      f"max {max(losses):.3f}" + (f"  {rates[0]:.3f} img/s" if rates else ""), flush=True)
PY
}
data s832 --num_train 64 --image_size 832 1344
data s128 --num_train 400 --image_size 128 128
for backbone in $BACKBONES; do
  # (data, --image_size, benchmark steps): one epoch of the default run is 32 steps at 832x1344 (64
  # images), 200 at 128x128 (400 images).
  for spec in "s832 832 1344 13" "s128 128 128 28"; do
    set -- $spec
    name=$1 size="$2 $3" steps=$4
    common=(--data_dir "$OUT/$name/tfrecords" --backbone "$backbone" --image_size $size --train_batch_size 2
            --seed 0 --log_every 1)
    dir="$OUT/$name-$backbone-default"; rm -rf "$dir"
    $PY main.py train "${common[@]}" --model_dir "$dir" --epochs 1 > "$dir.out" 2>&1
    summary "$name $backbone default" $? "$dir/log.jsonl"
    dir="$OUT/$name-$backbone-benchmark"; rm -rf "$dir"
    $PY main.py train "${common[@]}" --model_dir "$dir" --benchmark --use_synthetic_data --log_warmup_steps 2 \
      --benchmark_steps "$steps" > "$dir.out" 2>&1
    summary "$name $backbone benchmark" $? "$dir/log.jsonl"
  done
done
