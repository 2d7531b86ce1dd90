"""Inference throughput of `main.py infer --benchmark --preset torchvision|torchvision_v2` next to torchvision's
own, one run.

    .venv/bin/python scripts/benchmark_torchvision.py                 # v1, 3 alternated rounds, batch 1
    .venv/bin/python scripts/benchmark_torchvision.py --model v2 --rounds 5 --steps 20
    .venv/bin/python scripts/benchmark_torchvision.py --mixed              # photos of 8 shapes, preset batch

Both sides run the same weights (a seeded torchvision maskrcnn_resnet50_fpn, or maskrcnn_resnet50_fpn_v2 with
--model v2, converted by
weights/convert_torchvision.py; speed does not depend on the values) on the same generated 480x640 JPEG
scenes resized as torchvision does (shorter side 800), one image per step, float32 on the CPU. Rounds
alternate the two sides (A B, then B A) so that drifts of the machine fall on both. torchvision runs with
jemalloc preloaded (Debian's libjemalloc2; without it the script says so and uses the default malloc), each
side in a fresh process. Needs torch and torchvision (requirements-test.txt), the package does not.

--mixed: the same scenes cut and turned to 8 shapes of both orientations (COCO's common sizes), and ours is
`main.py infer --input` at the preset's batch size (8), which batches only photos of one padded shape, timed
from its own report (reading, model, mask pasting and encoding; the first traces included); torchvision runs
them one at a time after 3 warm-up photos.
"""

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile

# Sibling scripts: Python puts the directory of the script it runs first on sys.path.
from benchmark_model import ALLOCATORS
from benchmark_pipeline import ROOT, generated_records

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

THROUGHPUT = re.compile(r"inference throughput: ([0-9.]+) img/s")
# main.py infer's report: images and seconds.
INFER_REPORT = re.compile(r"\[infer\] (\d+) images, \d+ detections in ([0-9.]+) s")
# --mixed: (height, width) of the photos, in turn; cut from, turned or scaled from the 480x640 scenes.
MIXED_SHAPES = ((480, 640), (640, 480), (427, 640), (640, 427), (375, 500), (500, 375), (480, 480), (333, 500))


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


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3, help="alternated A/B rounds")
    parser.add_argument("--steps", type=int, default=10, help="timed images per run")
    parser.add_argument("--warmup", type=int, default=3, help="untimed images first")
    parser.add_argument("--photos", type=int, default=8, help="generated 480x640 scenes")
    parser.add_argument("--mixed", action="store_true",
                        help="photos of 8 shapes, ours by main.py infer --input at the preset's batch size")
    parser.add_argument("--model", choices=MODELS, default="v1",
                        help="v1: maskrcnn_resnet50_fpn (--preset torchvision); v2: maskrcnn_resnet50_fpn_v2 "
                             "(--preset torchvision_v2)")
    args = parser.parse_args(argv)
    jemalloc = dict(os.environ, **ALLOCATORS["jemalloc"])
    if not os.path.exists(ALLOCATORS["jemalloc"]["LD_PRELOAD"]):
        print("jemalloc not found (apt-get install libjemalloc2): torchvision runs with the default malloc")
        jemalloc = None
    with tempfile.TemporaryDirectory() as workdir:
        builder, preset = MODELS[args.model]
        photos, records, state, model_dir = prepare(workdir, args.photos, builder)
        ours = [sys.executable, os.path.join(ROOT, "main.py"), "infer", "--benchmark", "--preset", preset,
                "--model_dir", model_dir, "--config_override", f"data.validation_file_pattern={records}",
                "--eval_batch_size", "1",
                "--benchmark_steps", str(args.steps), "--log_warmup_steps", str(args.warmup)]
        theirs = [sys.executable, "-c", TORCHVISION_SIDE, state, photos, str(args.steps), str(args.warmup), builder]
        if args.mixed:
            mixed = os.path.join(workdir, "mixed")
            count = mixed_photos(photos, mixed)
            ours = [sys.executable, os.path.join(ROOT, "main.py"), "infer", "--preset", preset, "--model_dir",
                    model_dir, "--input", mixed, "--output_dir", os.path.join(workdir, "inference")]
            theirs = [sys.executable, "-c", TORCHVISION_SIDE, state, mixed, str(count), "3", builder]
        results = {"package": [], "torchvision": []}
        for round_index in range(args.rounds):
            order = (("package", ours, None), ("torchvision", theirs, jemalloc))
            for name, command, env in order if round_index % 2 == 0 else order[::-1]:
                results[name].append(throughput(command, env))
                print(f"round {round_index + 1} {name}: {results[name][-1]:.3f} img/s", flush=True)
    summary = {name: {"img_per_s": values, "mean": sum(values) / len(values)} for name, values in results.items()}
    shapes = {"photo_sizes": MIXED_SHAPES, "batch_size": "preset"} if args.mixed else {
        "photo_size": [480, 640], "batch_size": 1}
    print(json.dumps({"model": builder, **shapes, **summary}))


if __name__ == "__main__":
    main()
