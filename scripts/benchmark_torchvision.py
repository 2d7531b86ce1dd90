"""Inference or training throughput of `main.py infer|train --benchmark --preset torchvision` next to
torchvision's own, one run.

    .venv/bin/python scripts/benchmark_torchvision.py                 # v1, 3 alternated rounds, batch 1
    .venv/bin/python scripts/benchmark_torchvision.py --model v2 --rounds 5 --steps 20
    .venv/bin/python scripts/benchmark_torchvision.py --mixed              # photos of 8 shapes, preset batch
    .venv/bin/python scripts/benchmark_torchvision.py --precisions fp32 bf16  # and ours under --amp (bfloat16)
    .venv/bin/python scripts/benchmark_torchvision.py --mode train         # scratch and finetune, fp32 and bf16
    .venv/bin/python scripts/benchmark_torchvision.py --mode train --settings finetune --precisions fp32 \\
        --image_size 800 1088                                              # ours on the scenes' own canvas

Both sides run the same weights (a seeded torchvision maskrcnn_resnet50_fpn, or maskrcnn_resnet50_fpn_v2 with
--model v2, converted by
weights/convert_torchvision.py; speed does not depend on the values) on the same generated 480x640 JPEG
scenes resized as torchvision does (shorter side 800); inference runs one image per step, float32 on the CPU. Rounds
alternate the two sides (A B, then B A) so that drifts of the machine fall on both. torchvision runs with
jemalloc preloaded (Debian's libjemalloc2; without it the script says so and uses the default malloc), each
side in a fresh process. Needs torch and torchvision (requirements-test.txt), the package does not.

--mixed: the same scenes cut and turned to 8 shapes of both orientations (COCO's common sizes), and ours is
`main.py infer --input` at the preset's batch size (8), which batches only photos of one padded shape, timed
from its own report (reading, model, mask pasting and encoding; the first traces included); torchvision runs
them one at a time after 3 warm-up photos.

--mode train: one SGD-with-momentum update of 2 images per step, timed after the warm-up steps (img/s = images
/ time); v1 only. Ours is `main.py train --preset torchvision --benchmark --use_synthetic_data
--train_batch_size 2` (one real batch repeated: the input pipeline is not measured); torchvision trains on the
same two scenes (ours' first batch, which a separate process reads through the same Trainer) with their
ground truth from the same COCO annotations (crowd regions left out, as ours leaves them out), in train mode:
forward, the sum of the loss dict, backward, optimizer.step, weight decay 1e-4, at the learning rate ours
applies (small: random weights diverge at the usual one, and the rate costs nothing). Settings (--settings):
  finetune  ours from the converted model (--init_checkpoint): batch norm and the stem and first stage frozen
            (Config.resolved); torchvision with FrozenBatchNorm2d and trainable_backbone_layers=3, built from its
            parts (maskrcnn_resnet50_fpn without weights switches to BatchNorm2d and all 5 layers);
  scratch   ours without pretrained weights (its own random initialisation): batch norm on batch statistics,
            nothing frozen; torchvision with BatchNorm2d and all 5 layers trainable (the seeded weights).
The trainable tensors and parameters of both models (ours: those the Trainer's update applies gradients to) are
printed per part for each setting: they must agree.
Precisions (--precisions): fp32 on both sides; bf16 is ours with --amp in bfloat16 against torchvision's float32,
a side of its own (inference: `--precisions fp32 bf16`; training measures both by default), measured only on a
CPU with bfloat16 instructions (avx512_bf16 or amx_bf16): elsewhere TensorFlow emulates bfloat16, slower than
float32. Each training round runs, per setting, ours at each precision and torchvision, in the reverse order
every other round, each in a fresh process; the table gives img/s per round and their mean, ours over
torchvision, and each side's peak resident memory (wait4's ru_maxrss, the largest over the rounds).
torchvision pads each batch to its own images (800x1088 for these scenes) while ours trains on the preset's
canvas, 1344x1344, which holds an image of either orientation: --image_size 800 1088 gives ours the same
canvas, the same work. --min_size shrinks the scenes on both sides (a quick run).
"""

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile

from mrcnn_tf2 import presets
from mrcnn_tf2.config import Config

# Sibling scripts: run as a file, Python puts this folder first on sys.path; imported as scripts.benchmark_torchvision
# (by the tests), they are modules of the scripts package.
if __package__:
    from .benchmark_model import ALLOCATORS, STABLE_LEARNING_RATE, run_measured
    from .benchmark_pipeline import ROOT, generated_records
    from .benchmark_runtimes import cpu_flags
else:
    from benchmark_model import ALLOCATORS, STABLE_LEARNING_RATE, run_measured
    from benchmark_pipeline import ROOT, generated_records
    from benchmark_runtimes import cpu_flags

# Run in a fresh interpreter: argv = state dict, photo folder, steps, warm-up steps, builder; prints the img/s.
TORCHVISION_SIDE = """
import glob, sys, time
import numpy as np, torch, torchvision
from PIL import Image
state, folder, steps, warmup, builder = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), sys.argv[5]
model = getattr(torchvision.models.detection, builder)(weights=None, weights_backbone=None)
model.load_state_dict(torch.load(state, weights_only=True))
model.eval()
photos = [torch.from_numpy(np.asarray(Image.open(p).convert("RGB")).copy()).permute(2, 0, 1).float() / 255
          for p in sorted(glob.glob(folder + "/*.jpg"))]
times = []
with torch.no_grad():
    for step in range(warmup + steps):
        tic = time.perf_counter()
        model([photos[step % len(photos)]])
        if step >= warmup:
            times.append(time.perf_counter() - tic)
print(f"inference throughput: {len(times) / sum(times):.3f} img/s")
"""

# Run in a fresh interpreter: argv = where to save the state dict of a seeded model, builder.
SAVE_MODEL = """
import sys, torch, torchvision
torch.manual_seed(0)
model = getattr(torchvision.models.detection, sys.argv[2])(weights=None, weights_backbone=None)
torch.save(model.state_dict(), sys.argv[1])
"""

# --mode train, run in a fresh interpreter: argv = JSON {setting, state, annotations, photos, image_ids, min_size,
# max_size, learning_rate, weight_decay, momentum, steps, warmup}; prints one JSON line.
TORCHVISION_TRAIN_SIDE = """
import json, os, sys, time
import numpy as np, torch, torchvision
from PIL import Image
from pycocotools import mask as coco_mask
from torchvision.models.detection import MaskRCNN
from torchvision.models.detection.backbone_utils import _resnet_fpn_extractor
from torch.utils.flop_counter import FlopCounterMode
from torchvision.ops.misc import FrozenBatchNorm2d

a = json.loads(sys.argv[1])
finetune = a["setting"] == "finetune"
backbone = torchvision.models.resnet50(norm_layer=FrozenBatchNorm2d if finetune else torch.nn.BatchNorm2d)
model = MaskRCNN(_resnet_fpn_extractor(backbone, 3 if finetune else 5), num_classes=91, min_size=a["min_size"],
                 max_size=a["max_size"])
model.load_state_dict(torch.load(a["state"], weights_only=True))
model.train()
with open(a["annotations"]) as f:
    coco = json.load(f)
infos = {info["id"]: info for info in coco["images"]}
images, targets = [], []
for image_id in a["image_ids"]:
    info = infos[image_id]
    height, width = info["height"], info["width"]
    objects = [o for o in coco["annotations"] if o["image_id"] == image_id and not o["iscrowd"]]
    photo = np.asarray(Image.open(os.path.join(a["photos"], info["file_name"])).convert("RGB"))
    images.append(torch.from_numpy(photo.copy()).permute(2, 0, 1).float() / 255)
    masks = [coco_mask.decode(coco_mask.merge(coco_mask.frPyObjects(o["segmentation"], height, width)))
             for o in objects]
    targets.append({
        "boxes": torch.tensor([[x, y, x + w, y + h] for x, y, w, h in (o["bbox"] for o in objects)],
                              dtype=torch.float32).reshape(-1, 4),
        "labels": torch.tensor([o["category_id"] for o in objects], dtype=torch.int64),
        "masks": torch.from_numpy(np.stack(masks)) if masks else torch.zeros((0, height, width), dtype=torch.uint8),
    })


def part(name):
    body = name.removeprefix("backbone.body.").split(".")[0]
    if name.startswith("backbone.body."):
        return "stem" if body in ("conv1", "bn1") else "stage" + body.removeprefix("layer")
    for prefix, label in (("backbone.fpn.", "fpn"), ("rpn.", "rpn"), ("roi_heads.box_", "box head"),
                          ("roi_heads.mask_", "mask head")):
        if name.startswith(prefix):
            return label
    return "other: " + name


trainable = {}
for name, parameter in model.named_parameters():
    if parameter.requires_grad:
        count = trainable.setdefault(part(name), [0, 0])
        count[0] += 1
        count[1] += parameter.numel()
padded = list(model.transform(images)[0].tensors.shape[-2:])
optimizer = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=a["learning_rate"],
                            momentum=a["momentum"], weight_decay=a["weight_decay"])
times, first_losses = [], None
for step in range(a["warmup"] + a["steps"]):
    tic = time.perf_counter()
    losses = model(images, targets)
    optimizer.zero_grad()
    sum(losses.values()).backward()
    optimizer.step()
    toc = time.perf_counter()
    if first_losses is None:
        first_losses = {name: value.item() for name, value in losses.items()}
    if step >= a["warmup"]:
        times.append(toc - tic)
# The work of one update, after the timed ones: FLOPs (2 per multiply-add) of the convolutions and matrix products,
# forward and backward, as torch counts them.
counter = FlopCounterMode(display=False)
with counter:
    losses = model(images, targets)
    optimizer.zero_grad()
    sum(losses.values()).backward()
print(json.dumps({"torchvision_train": a["setting"], "throughput_img_per_s": len(images) * len(times) / sum(times),
                  "precision": "float32", "padded_shape": padded, "instances": [len(t["labels"]) for t in targets],
                  "trainable": trainable, "first_losses": first_losses,
                  "flops_per_image": counter.get_total_flops() / len(images)}))
"""

# --mode train, run in a fresh interpreter with main.py's oneDNN setting: argv = dtype name; prints the best
# FLOP/s of a 4096 x 4096 matrix product over 5 tries, the rate the CPU's matrix kernels reach in TensorFlow.
MATMUL_PEAK = """
import sys, time
import tensorflow as tf
dtype, size = getattr(tf, sys.argv[1]), 4096
a, b = (tf.cast(tf.random.stateless_normal([size, size], [seed, 0]), dtype) for seed in (1, 2))
tf.linalg.matmul(a, b)
best = float("inf")
for _ in range(5):
    tic = time.perf_counter()
    float(tf.linalg.matmul(a, b)[0, 0])
    best = min(best, time.perf_counter() - tic)
print(2 * size ** 3 / best)
"""

# --mode train, run in a fresh interpreter: argv = JSON of `main.py train`'s arguments. The Trainer those arguments
# make reads its first batch (the one --use_synthetic_data repeats) and builds its model and optimizer on it; prints
# one JSON line: the variables the update applies gradients to and their parameters, per part (the names of the
# torchvision side's parts), the COCO ids and object counts of the batch, and the learning rate of the first update.
PACKAGE_PROBE = """
import json, sys
import numpy as np
from mrcnn_tf2.arguments import parse
from mrcnn_tf2.runtime.train import Trainer

trainer = Trainer(parse(json.loads(sys.argv[1]))[1])
batch = next(iter(trainer.dataset(0)))
trainer.build()
model = trainer.model


def count(layers):
    variables = [variable for layer in layers for variable in layer.trainable_variables]
    return [len(variables), int(sum(np.prod(variable.shape) for variable in variables))]


parts = {"stem": [model.backbone.stem],
         **{f"stage{g}": blocks for g, blocks in enumerate(model.backbone.groups, 1)},
         "fpn": [model.fpn], "rpn": [model.rpn_head], "box head": [model.box_head], "mask head": [model.mask_head]}
trainable = {name: count(layers) for name, layers in parts.items()}
total = count([model])
parted = [sum(counts[i] for counts in trainable.values()) for i in (0, 1)]
if total != parted:
    trainable["other"] = [total[0] - parted[0], total[1] - parted[1]]
print(json.dumps({"package_probe": True, "trainable": {name: c for name, c in trainable.items() if c[0]},
                  "image_ids": batch["source_ids"].numpy().tolist(),
                  "instances": (batch["gt_classes"].numpy() > 0).sum(axis=1).tolist(),
                  "learning_rate": float(trainer.schedule(0))}))
"""

THROUGHPUT = re.compile(r"inference throughput: ([0-9.]+) img/s")
# main.py infer's report: images and seconds.
INFER_REPORT = re.compile(r"\[infer\] (\d+) images, \d+ detections in ([0-9.]+) s")
# --mixed: (height, width) of the photos, in turn; cut from, turned or scaled from the 480x640 scenes.
MIXED_SHAPES = ((480, 640), (640, 480), (427, 640), (640, 427), (375, 500), (500, 375), (480, 480), (333, 500))

# --mode train: images per step, on both sides.
TRAIN_BATCH_SIZE = 2
TRAIN_SETTINGS = ("scratch", "finetune")
PRECISIONS = ("fp32", "bf16")
# The trainable parts of both models, in the order printed.
PARTS = ("stem", "stage1", "stage2", "stage3", "stage4", "fpn", "rpn", "box head", "mask head")
# CPU flags printed with the results: the instruction sets the convolutions and matrix products of both sides use.
SHOWN_CPU_FLAGS = ("avx2", "avx512f", "avx512_vnni", "avx512_bf16", "amx_bf16")
# mrcnn_tf2.runtime.precision.BFLOAT16_CPU_FLAGS (that module imports Keras): --amp's bfloat16 runs in hardware.
BFLOAT16_CPU_FLAGS = ("avx512_bf16", "amx_bf16")
# Ours' flags for bf16: --amp in bfloat16 whatever the CPU would pick.
AMP_BF16 = ("--amp", "--amp_dtype", "bfloat16")
# --steps and --warmup of each mode when not given.
DEFAULT_STEPS = {"infer": (10, 3), "train": (5, 2)}


def throughput(command, env=None):
    """The img/s a benchmark process prints, or that main.py infer's report gives (its output on failure)."""
    done = subprocess.run(command, capture_output=True, text=True, cwd=ROOT, env=env)
    found, report = THROUGHPUT.search(done.stdout), INFER_REPORT.search(done.stdout)
    if done.returncode or not (found or report):
        raise RuntimeError(f"{' '.join(command[:4])} ... failed ({done.returncode}):\n{done.stdout}\n{done.stderr}")
    return float(found.group(1)) if found else int(report.group(1)) / float(report.group(2))


def mixed_photos(folder, target):
    """Writes the JPEG scenes of `folder` to `target` as MIXED_SHAPES in turn (portrait ones turned from
    landscape, smaller ones cut or scaled); returns how many."""
    from PIL import Image

    os.makedirs(target)
    paths = sorted(os.listdir(folder))
    for i, name in enumerate(paths):
        height, width = MIXED_SHAPES[i % len(MIXED_SHAPES)]
        with Image.open(os.path.join(folder, name)) as image:
            scene = image.transpose(Image.Transpose.ROTATE_90) if height > width else image
            scale = max(height / scene.height, width / scene.width)
            scene = scene.resize((round(scene.width * scale), round(scene.height * scale)))
            scene.crop((0, 0, width, height)).save(os.path.join(target, name), quality=90)
    return len(paths)


# --model: (torchvision's builder, our preset).
MODELS = {"v1": ("maskrcnn_resnet50_fpn", "torchvision"), "v2": ("maskrcnn_resnet50_fpn_v2", "torchvision_v2")}


def prepare(workdir, num_photos, builder):
    """Photos, their TFRecords and a converted model of torchvision's `builder` in `workdir`: (photo folder,
    record pattern, state, model)."""
    records = generated_records(workdir, num_photos)
    state = os.path.join(workdir, "model.pth")
    subprocess.run([sys.executable, "-c", SAVE_MODEL, state, builder], check=True)
    model_dir = os.path.join(workdir, "converted")
    subprocess.run([sys.executable, os.path.join(ROOT, "weights", "convert_torchvision.py"), "--input", state,
                    "--output_dir", model_dir], check=True, capture_output=True)
    return os.path.join(workdir, "train"), records, state, model_dir


def torchvision_environment():
    """The environment of the torchvision side: jemalloc preloaded, or None (the default malloc, said once)
    when the library is missing."""
    if not os.path.exists(ALLOCATORS["jemalloc"]["LD_PRELOAD"]):
        print("jemalloc not found (apt-get install libjemalloc2): torchvision runs with the default malloc")
        return None
    return dict(os.environ, **ALLOCATORS["jemalloc"])


def torchvision_allocator(env):
    """(the allocator's name for the JSON lines, the line printed under the results or None) of the torchvision
    side's environment `env` (torchvision_environment's). The default malloc slows torchvision, so that every
    ratio printed above that line overstates ours: a run without jemalloc says so where its figures are."""
    if env is not None:
        return "jemalloc", None
    return "malloc", ("torchvision ran with the default malloc, not jemalloc (apt-get install libjemalloc2), which "
                      "slows it: the ratios above overstate ours")


def cpu_model(cpuinfo="/proc/cpuinfo"):
    """The CPU's model name as /proc/cpuinfo gives it ('unknown CPU' when it does not)."""
    try:
        with open(cpuinfo) as f:
            return next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), "unknown CPU")
    except OSError:
        return "unknown CPU"


def bfloat16_unmeasured(flags):
    """Why bf16 is not measured on a CPU of these /proc/cpuinfo `flags`: one line, or None when it is."""
    if any(flag in flags for flag in BFLOAT16_CPU_FLAGS):
        return None
    return (f"bfloat16 not measured: this CPU has no bfloat16 instructions ({' or '.join(BFLOAT16_CPU_FLAGS)} in "
            "/proc/cpuinfo), so TensorFlow would emulate bfloat16, slower than float32")


def measured_precisions(precisions, flags=None):
    """`precisions` without repeats, and without bf16 (saying why) on a CPU without bfloat16 instructions."""
    precisions = list(dict.fromkeys(precisions))
    reason = bfloat16_unmeasured(cpu_flags() if flags is None else flags) if "bf16" in precisions else None
    if reason:
        print(reason)
        precisions.remove("bf16")
    return precisions


def train_sizes(min_size, image_size=None):
    """(longer-side cap, ours' training canvas (H, W)) at shorter side `min_size`: the cap in the preset's
    proportion (1333 at 800), and the canvas `image_size`, else the preset's rule, a square that holds either
    orientation (1344x1344 at 800: the cap rounded up to 2**max_level)."""
    values = presets.values("torchvision")
    max_size = round(min_size * values["data.resize_max_size"] / values["data.resize_min_size"])
    stride = 2 ** Config().model.anchors.max_level
    side = -(-max_size // stride) * stride
    return max_size, tuple(image_size) if image_size else (side, side)


def package_train_command(setting, precision, records, converted, run_dir, steps, warmup, min_size, image_size=None):
    """`main.py train` of one setting and precision (the arguments after main.py), in `run_dir`; `converted` is
    the model directory that finetune starts from. Sizes other than the preset's are given as flags."""
    argv = ["train", "--benchmark", "--use_synthetic_data", "--preset", "torchvision", "--model_dir", run_dir,
            "--config_override", f"data.training_file_pattern={records}",
            "--train_batch_size", str(TRAIN_BATCH_SIZE), "--benchmark_steps", str(steps),
            "--log_warmup_steps", str(warmup), "--log_every", "1", "--seed", "0", *STABLE_LEARNING_RATE]
    if setting == "finetune":
        argv += ["--init_checkpoint", converted]
    if precision == "bf16":
        argv += AMP_BF16
    values = presets.values("torchvision")
    max_size, canvas = train_sizes(min_size, image_size)
    if min_size != values["data.resize_min_size"]:
        argv += ["--config_override", f"data.resize_min_size={min_size}",
                 "--config_override", f"data.resize_max_size={max_size}"]
    if canvas != values["data.image_size"]:
        argv += ["--image_size", *map(str, canvas)]
    return argv


def matmul_peak(precision):
    """FLOP/s of TensorFlow's matrix product at `precision` ("fp32" or "bf16") on this CPU, with main.py's oneDNN
    setting (MATMUL_PEAK): the ceiling a step made of convolutions and matrix products can approach."""
    env = dict(os.environ)
    env.setdefault("TF_ENABLE_ONEDNN_OPTS", "1")
    dtype = {"fp32": "float32", "bf16": "bfloat16"}[precision]
    result = subprocess.run([sys.executable, "-c", MATMUL_PEAK, dtype], env=env, capture_output=True, text=True,
                            check=True)
    return float(result.stdout.split()[-1])


def json_line(output, key):
    """The last line of `output` that is a JSON object starting with `key`, parsed; None if there is none."""
    lines = [line for line in output.splitlines() if line.startswith('{"' + key + '"')]
    return json.loads(lines[-1]) if lines else None


def run_package(argv, run_dir):
    """One `main.py train` benchmark: {img_per_s, precision (the policy it ran), peak_rss_gib, first_losses}."""
    output, code, peak = run_measured([sys.executable, os.path.join(ROOT, "main.py"), *argv])
    record = json_line(output, "benchmark")
    if code or record is None:
        raise RuntimeError(f"main.py {' '.join(argv)} failed ({code}):\n{output[-4000:]}")
    first = None
    with open(os.path.join(run_dir, "log.jsonl")) as f:
        for line in f:
            event = json.loads(line)
            if event.get("event") == "metrics" and event.get("step") == 1:
                first = {name: value for name, value in event.items() if name.startswith("loss")}
    return dict(img_per_s=record["throughput_img_per_s"], precision=record["precision"], peak_rss_gib=peak,
                first_losses=first)


def run_torchvision(params, env):
    """One torchvision training benchmark: its JSON line plus img_per_s and peak_rss_gib."""
    output, code, peak = run_measured([sys.executable, "-c", TORCHVISION_TRAIN_SIDE, json.dumps(params)], env)
    record = json_line(output, "torchvision_train")
    if code or record is None:
        raise RuntimeError(f"torchvision {params['setting']} training failed ({code}):\n{output[-4000:]}")
    return dict(record, img_per_s=record["throughput_img_per_s"], peak_rss_gib=peak)


def probe_package(argv):
    """PACKAGE_PROBE's JSON of `main.py train argv`: trainable counts per part, the first batch's images."""
    done = subprocess.run([sys.executable, "-c", PACKAGE_PROBE, json.dumps(argv)], capture_output=True, text=True,
                          cwd=ROOT)
    record = json_line(done.stdout, "package_probe")
    if done.returncode or record is None:
        raise RuntimeError(f"the probe of main.py {' '.join(argv)} failed:\n{done.stdout}\n{done.stderr[-4000:]}")
    return record


def print_trainable(setting, ours, theirs):
    """The trainable tensors and parameters per part of both models; a part where they differ is marked."""
    print(f"trainable, {setting}: {'part':10s} {'ours':>20s} {'torchvision':>20s}")
    names = [*PARTS, *sorted((set(ours) | set(theirs)) - set(PARTS))]
    totals = [[0, 0], [0, 0]]
    for name in names:
        counts = [ours.get(name, [0, 0]), theirs.get(name, [0, 0])]
        for total, count in zip(totals, counts):
            total[0], total[1] = total[0] + count[0], total[1] + count[1]
        cells = [f"{n:4d} / {p:12,d}" if n else f"{'frozen':>20s}" for n, p in counts]
        print(f"trainable, {setting}: {name:10s} {cells[0]:>20s} {cells[1]:>20s}"
              f"{'' if counts[0] == counts[1] else '  DIFFERS'}")
    print(f"trainable, {setting}: {'total':10s} " + " ".join(f"{n:4d} / {p:12,d}".rjust(20) for n, p in totals)
          + "  (tensors / parameters)", flush=True)


def print_train_table(rows, caveat=None):
    """The results of --mode train: a table, then `caveat` (torchvision_allocator's line) if any, then its rows as
    JSON lines."""
    def rates(values):
        return " ".join(f"{value:.3f}" for value in values)

    width = max(len("torchvision"), *(len(rates(row[side])) for row in rows
                                      for side in ("package_img_per_s", "torchvision_img_per_s")))
    print(f"\n{'setting':9s} {'precision':9s} {'ours img/s':>{width}s} {'mean':>6s} {'torchvision':>{width}s} "
          f"{'mean':>6s} {'ours/tv':>7s} {'ours GiB':>8s} {'tv GiB':>6s}")
    for row in rows:
        print(f"{row['setting']:9s} {row['precision']:9s} {rates(row['package_img_per_s']):>{width}s} "
              f"{row['package_mean']:6.3f} {rates(row['torchvision_img_per_s']):>{width}s} "
              f"{row['torchvision_mean']:6.3f} {row['ratio']:7.2f} {row['package_peak_rss_gib']:8.2f} "
              f"{row['torchvision_peak_rss_gib']:6.2f}")
    print("(ours img/s and torchvision's per round; torchvision trains in float32 in every row)")
    print("\nwork: torchvision's FLOPs per image of one update (forward and backward, 2 per multiply-add); its rate "
          "at each side's img/s against the matrix product peak of the side's precision")
    for row in rows:
        print(f"{row['setting']:9s} {row['precision']:9s} {row['gflop_per_image']:6.0f} GFLOP/image: ours "
              f"{row['package_mean'] * row['gflop_per_image']:5.0f} GFLOP/s = {row['package_share_of_peak']:4.0%} "
              f"of {row['matmul_peak_gflops']:.0f}, torchvision {row['torchvision_mean'] * row['gflop_per_image']:5.0f}"
              f" GFLOP/s = {row['torchvision_share_of_peak']:4.0%}")
    if caveat:
        print(caveat)
    for row in rows:
        print(json.dumps(row))


def train_main(args):
    """--mode train: see the module docstring."""
    flags = cpu_flags()
    print(f"CPU: {cpu_model()}, {os.cpu_count()} cores; "
          + ", ".join(f"{flag} {'yes' if flag in flags else 'no'}" for flag in SHOWN_CPU_FLAGS), flush=True)
    precisions = measured_precisions(args.precisions, flags)
    if not precisions:
        return
    env = torchvision_environment()
    settings = list(dict.fromkeys(args.settings))
    max_size, canvas = train_sizes(args.min_size, args.image_size)
    results = {(setting, side): [] for setting in settings for side in [*precisions, "torchvision"]}
    peaks = {precision: matmul_peak(precision) for precision in dict.fromkeys(["fp32", *precisions])}
    print("matrix product peak (TensorFlow, 4096 x 4096, best of 5): "
          + ", ".join(f"{precision} {peak / 1e9:.0f} GFLOP/s" for precision, peak in peaks.items()), flush=True)
    with tempfile.TemporaryDirectory() as workdir:
        photos, records, state, converted = prepare(workdir, args.photos, MODELS["v1"][0])
        annotations = os.path.join(workdir, "annotations", "instances_train.json")

        def command(setting, precision):
            run_dir = tempfile.mkdtemp(prefix=f"{setting}-{precision}-", dir=workdir)
            return package_train_command(setting, precision, records, converted, run_dir, args.steps, args.warmup,
                                         args.min_size, args.image_size), run_dir

        probes = {setting: probe_package(command(setting, "fp32")[0]) for setting in settings}
        image_ids = probes[settings[0]]["image_ids"]
        print(f"batch: ours' first one (repeated), scenes {image_ids} of the {args.photos} generated 480x640 ones "
              f"({probes[settings[0]]['instances']} objects), shorter side {args.min_size} (longer at most "
              f"{max_size}); ours trains on a {canvas[0]}x{canvas[1]} canvas", flush=True)
        if any(probe["image_ids"] != image_ids for probe in probes.values()):
            raise RuntimeError(f"the settings' first batches differ: {probes}")
        params = dict(state=state, annotations=annotations, photos=photos, image_ids=image_ids,
                      min_size=args.min_size, max_size=max_size, learning_rate=probes[settings[0]]["learning_rate"],
                      weight_decay=Config().train.l2_weight_decay, momentum=Config().train.momentum,
                      steps=args.steps, warmup=args.warmup)
        for round_index in range(args.rounds):
            for setting in settings:
                sides = [*precisions, "torchvision"]
                for side in sides if round_index % 2 == 0 else sides[::-1]:
                    if side == "torchvision":
                        result = run_torchvision(dict(params, setting=setting), env)
                        if not results[setting, side]:
                            if round_index == 0 and setting == settings[0]:
                                print(f"batch: torchvision pads it to {result['padded_shape'][0]}x"
                                      f"{result['padded_shape'][1]}, {result['instances']} objects", flush=True)
                            print_trainable(setting, probes[setting]["trainable"], result["trainable"])
                    else:
                        argv, run_dir = command(setting, side)
                        result = run_package(argv, run_dir)
                    results[setting, side].append(result)
                    print(f"round {round_index + 1} {setting} {'torchvision fp32' if side == 'torchvision' else side}"
                          f": {result['img_per_s']:.3f} img/s, peak {result['peak_rss_gib']:.2f} GiB", flush=True)
    rows, (allocator, caveat) = [], torchvision_allocator(env)
    for setting in settings:
        theirs = results[setting, "torchvision"]
        for precision in precisions:
            ours = results[setting, precision]
            package_mean = sum(r["img_per_s"] for r in ours) / len(ours)
            torchvision_mean = sum(r["img_per_s"] for r in theirs) / len(theirs)
            work = theirs[0]["flops_per_image"]
            rows.append(dict(
                setting=setting, precision=precision, policy=ours[0]["precision"], batch_size=TRAIN_BATCH_SIZE,
                min_size=args.min_size, canvas=list(canvas), torchvision_padded=theirs[0]["padded_shape"],
                learning_rate=params["learning_rate"],
                package_img_per_s=[r["img_per_s"] for r in ours], package_mean=package_mean,
                torchvision_img_per_s=[r["img_per_s"] for r in theirs], torchvision_mean=torchvision_mean,
                ratio=package_mean / torchvision_mean,
                package_peak_rss_gib=max(r["peak_rss_gib"] for r in ours),
                torchvision_peak_rss_gib=max(r["peak_rss_gib"] for r in theirs),
                package_first_losses=ours[0]["first_losses"], torchvision_first_losses=theirs[0]["first_losses"],
                package_trainable=probes[setting]["trainable"], torchvision_trainable=theirs[0]["trainable"],
                gflop_per_image=work / 1e9, matmul_peak_gflops=peaks[precision] / 1e9,
                package_share_of_peak=package_mean * work / peaks[precision],
                torchvision_share_of_peak=torchvision_mean * work / peaks["fp32"],
                steps=args.steps, warmup=args.warmup, torchvision_allocator=allocator))
    print_train_table(rows, caveat)


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--mode", choices=("infer", "train"), default="infer",
                        help="infer: eval-mode forward passes, batch 1; train: SGD updates of 2 images")
    parser.add_argument("--rounds", type=int, default=3, help="alternated A/B rounds")
    parser.add_argument("--steps", type=int, help="timed images per run (infer: 10), timed updates (train: 5)")
    parser.add_argument("--warmup", type=int, help="untimed images first (infer: 3), untimed updates (train: 2)")
    parser.add_argument("--photos", type=int, default=8, help="generated 480x640 scenes")
    parser.add_argument("--mixed", action="store_true",
                        help="photos of 8 shapes, ours by main.py infer --input at the preset's batch size")
    parser.add_argument("--model", choices=MODELS, default="v1",
                        help="v1: maskrcnn_resnet50_fpn (--preset torchvision); v2: maskrcnn_resnet50_fpn_v2 "
                             "(--preset torchvision_v2); train: v1 only")
    parser.add_argument("--settings", nargs="+", choices=TRAIN_SETTINGS,
                        help=f"train: from scratch and/or fine-tuning (default: {' '.join(TRAIN_SETTINGS)})")
    parser.add_argument("--precisions", nargs="+", choices=PRECISIONS,
                        help=f"ours' precisions (infer default: fp32; train default: {' '.join(PRECISIONS)}); bf16 "
                             "(--amp) only on a CPU with bfloat16 instructions; torchvision's is float32")
    parser.add_argument("--min_size", type=int,
                        help="train: shorter side of the resized scenes on both sides (default: the preset's 800); "
                             "the longer side's cap follows (1333 at 800)")
    parser.add_argument("--image_size", type=int, nargs=2, metavar=("H", "W"),
                        help="train: ours' training canvas, multiples of 32 (default: the preset's, a square that "
                             "holds either orientation: 1344 1344 at 800)")
    args = parser.parse_args(argv)
    train_only = [f"--{name}" for name in ("settings", "min_size", "image_size")
                  if getattr(args, name) is not None]
    if args.mode == "infer" and train_only:
        parser.error(f"{', '.join(train_only)}: only with --mode train")
    if args.mode == "train" and (args.mixed or args.model != "v1"):
        parser.error("--mode train measures v1 on the generated scenes: without --mixed and --model v2")
    args.precisions = args.precisions or (list(PRECISIONS) if args.mode == "train" else ["fp32"])
    default_steps, default_warmup = DEFAULT_STEPS[args.mode]
    args.steps = default_steps if args.steps is None else args.steps
    args.warmup = default_warmup if args.warmup is None else args.warmup
    if args.mode == "train":
        args.settings = args.settings or list(TRAIN_SETTINGS)
        args.min_size = args.min_size or presets.values("torchvision")["data.resize_min_size"]
        if args.steps < 1 or args.rounds < 1:
            parser.error("--steps and --rounds must be >= 1")
    return args


def package_infer_command(precision, preset, model_dir, records, steps, warmup):
    """`main.py infer --benchmark` of one precision at batch 1 (the arguments after main.py)."""
    argv = ["infer", "--benchmark", "--preset", preset, "--model_dir", model_dir,
            "--config_override", f"data.validation_file_pattern={records}", "--eval_batch_size", "1",
            "--benchmark_steps", str(steps), "--log_warmup_steps", str(warmup)]
    return argv + (list(AMP_BF16) if precision == "bf16" else [])


def main(argv=None):
    args = parse_args(argv)
    if args.mode == "train":
        return train_main(args)
    precisions = measured_precisions(args.precisions)
    if not precisions:
        return
    jemalloc = torchvision_environment()
    with tempfile.TemporaryDirectory() as workdir:
        builder, preset = MODELS[args.model]
        photos, records, state, model_dir = prepare(workdir, args.photos, builder)
        ours = {precision: [sys.executable, os.path.join(ROOT, "main.py"),
                            *package_infer_command(precision, preset, model_dir, records, args.steps, args.warmup)]
                for precision in precisions}
        theirs = [sys.executable, "-c", TORCHVISION_SIDE, state, photos, str(args.steps), str(args.warmup), builder]
        if args.mixed:
            mixed = os.path.join(workdir, "mixed")
            count = mixed_photos(photos, mixed)
            ours = {precision: [sys.executable, os.path.join(ROOT, "main.py"), "infer", "--preset", preset,
                                "--model_dir", model_dir, "--input", mixed, "--output_dir",
                                os.path.join(workdir, f"inference-{precision}"),
                                *(AMP_BF16 if precision == "bf16" else ())]
                    for precision in precisions}
            theirs = [sys.executable, "-c", TORCHVISION_SIDE, state, mixed, str(count), "3", builder]
        # "package" is ours in float32, "package_bf16" under --amp's bfloat16.
        order = [("package" if precision == "fp32" else f"package_{precision}", ours[precision], None)
                 for precision in precisions] + [("torchvision", theirs, jemalloc)]
        results = {name: [] for name, _, _ in order}
        for round_index in range(args.rounds):
            for name, command, env in order if round_index % 2 == 0 else order[::-1]:
                results[name].append(throughput(command, env))
                print(f"round {round_index + 1} {name}: {results[name][-1]:.3f} img/s", flush=True)
    summary = {name: {"img_per_s": values, "mean": sum(values) / len(values)} for name, values in results.items()}
    for name in results:
        if name != "torchvision":
            summary[name]["over_torchvision"] = summary[name]["mean"] / summary["torchvision"]["mean"]
    shapes = {"photo_sizes": MIXED_SHAPES, "batch_size": "preset"} if args.mixed else {
        "photo_size": [480, 640], "batch_size": 1}
    allocator, caveat = torchvision_allocator(jemalloc)
    if caveat:
        print(caveat)
    print(json.dumps({"model": builder, **shapes, **summary, "torchvision_allocator": allocator}))


if __name__ == "__main__":
    main()
