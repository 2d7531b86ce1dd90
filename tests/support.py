"""What the tests share: the repository's root, the small test model, synthetic batches, the run log, and
`main.py` run in this process or in a fresh one.

Test modules import from here (`from tests.support import ...`) and from conftest's fixtures, never from each
other. Expensive set-up that several modules use (generated data, a trained small model, converted
torchvision weights) is a session fixture in tests/conftest.py, made once by `built_once`.
"""

import contextlib
import fcntl
import io
import json
import os
import resource
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

from mrcnn_tf2.arguments import parse

ROOT = Path(__file__).resolve().parent.parent  # the repository's root

# `make test` runs the suite twice, with oneDNN's kernels and with TensorFlow's own: a directory of both runs
# (the Makefile makes and removes it) for what neither kernel choice changes.
ACROSS_RUNS_ENV = "MRCNN_TF2_TEST_SHARED_DIR"


def built_once(tmp_path_factory, name, build, across_runs=False):
    """The directory `name`, made by `build(directory)` once per test run and shared by pytest-xdist's workers:
    the first worker to ask builds it under a lock and marks it done, and the others wait for it (a build that
    failed is retried, from an empty directory). Read it only: a test that changes it works on a copy
    (shutil.copytree). across_runs: once for both runs of `make test` (under ACROSS_RUNS_ENV when it is set),
    for what TensorFlow's kernels do not compute (generated data, converted weights, torch's outputs)."""
    root = tmp_path_factory.getbasetemp()
    if across_runs and os.environ.get(ACROSS_RUNS_ENV):
        root = Path(os.environ[ACROSS_RUNS_ENV])
    elif os.environ.get("PYTEST_XDIST_WORKER"):
        root = root.parent  # the run's directory, above each worker's own
    target, done = root / name, root / f"{name}.done"
    with open(root / f"{name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not done.exists():
            shutil.rmtree(target, ignore_errors=True)
            target.mkdir()
            build(target)
            done.touch()
    return target


# The small test model as `main.py` flags: a ResNet-18 Mask R-CNN at 128x128 with small heads and budgets, 6
# classes (background and the generated shapes' 5), a step in a fraction of a second. Every small model of the
# tests is this one; a test changes only what it is about (later flags win).
SMALL_FLAGS = [
    "--backbone", "resnet18", "--image_size", "128", "128", "--num_classes", "6", "--train_batch_size", "2",
    "--eval_batch_size", "2", "--seed", "1", "--log_warmup_steps", "1",
    "--config_override", "model.fast_rcnn_mlp_head_dim=64",
    "--config_override", "model.roi.batch_size_per_im=32",
    "--config_override", "model.rpn.train_rpn_pre_nms_topn=200",
    "--config_override", "model.rpn.train_rpn_post_nms_topn=100",
    "--config_override", "model.rpn.test_rpn_pre_nms_topn=200",
    "--config_override", "model.rpn.test_rpn_post_nms_topn=100",
    "--config_override", "model.test.test_detections_per_image=10",
    "--config_override", "data.max_num_instances=8",
    "--config_override", "data.gt_mask_size=14",
]

# The schedule of conftest's trained small model (TRAINED_STEPS steps): two updates of 2 images per epoch, a linear
# warm-up from 0.005 to 0.01 (at 8 images) over the first epoch, so that the learning rate of each step tells where
# the schedule is.
SCHEDULE_FLAGS = ["--steps_per_epoch", "2", "--log_every", "1", "--init_learning_rate", "0.005",
                  "--learning_rate_values", "0.01", "--learning_rate_boundaries", "1",
                  "--config_override", "train.warmup_min_steps=0"]
TRAINED_STEPS = 4



def small_config():
    """SMALL_FLAGS as a Config, with batch norm and the stem and first group frozen (the settings of a
    pretrained backbone): the component tests compare steps, whose batch statistics would amplify float
    rounding."""
    _, config = parse(["train", *SMALL_FLAGS])
    config.model.freeze_bn, config.model.freeze_blocks = True, (0, 1)
    return config


def synthetic_batch(config, objects_per_image=(2, 1)):
    """A fixed batch as the input pipeline makes it for `config`'s model: coloured rectangles and discs on grey,
    masks in their boxes. Image b holds objects_per_image[b] objects (at most 3) of classes 1..3.

    Returns the features dict: images [B, H, W, 3], image_info [B, 5], source_ids [B], gt_boxes [B, K, 4],
    gt_classes [B, K], gt_masks [B, K, M, M] (K = max_num_instances, padded), rpn_score_targets and
    rpn_box_targets {level: [B, H_l, W_l, A] / [B, H_l, W_l, 4A]}.
    """
    import tensorflow as tf

    from mrcnn_tf2.data.pipeline import PADDING_CLASS, PADDING_MASK
    from mrcnn_tf2.data.preprocess import normalize
    from mrcnn_tf2.model.factory import build_anchors
    from mrcnn_tf2.ops.anchors import rpn_targets

    image_size = tuple(config.data.image_size)
    max_instances, mask_size = config.data.max_num_instances, config.data.gt_mask_size
    anchor_boxes = build_anchors(config)
    rng = np.random.default_rng(1)
    images, boxes, classes, masks = [], [], [], []
    score_targets, box_targets = [], []
    yy, xx = (np.mgrid[0:mask_size, 0:mask_size] + 0.5) / mask_size - 0.5
    disc = (yy**2 + xx**2 <= 0.25).astype(np.float32)
    batch_size = len(objects_per_image)
    for b, count in enumerate(objects_per_image):
        image = np.full(image_size + (3,), 110.0, np.float32)
        image_boxes = np.full((max_instances, 4), -1.0, np.float32)
        image_classes = np.full((max_instances,), PADDING_CLASS, np.int32)
        image_masks = np.full((max_instances, mask_size, mask_size), PADDING_MASK, np.float32)
        for i in range(count):
            y, x = rng.integers(4, 60, size=2)
            h, w = rng.integers(24, 60, size=2)
            cls = 1 + (b + i) % 3
            image_boxes[i] = (y, x, y + h, x + w)
            image_classes[i] = cls
            image_masks[i] = disc if cls == 2 else 1.0
            region = image[y:y + h, x:x + w]
            shape = np.ones((h, w), bool) if cls != 2 else (
                (((np.arange(h)[:, None] + 0.5) / h - 0.5) ** 2 + ((np.arange(w) + 0.5) / w - 0.5) ** 2) <= 0.25)
            region[shape] = [(255, 0, 0), (0, 255, 0), (0, 0, 255)][cls - 1]
        targets = rpn_targets(anchor_boxes, image_boxes, image_size, seed=tf.constant([b, 5]))
        images.append(normalize(image))
        boxes.append(image_boxes)
        classes.append(image_classes)
        masks.append(image_masks)
        score_targets.append(targets["rpn_score_targets"])
        box_targets.append(targets["rpn_box_targets"])
    stack = lambda dicts: {level: tf.stack([d[level] for d in dicts]) for level in dicts[0]}  # noqa: E731
    return {
        "images": tf.constant(np.stack(images), tf.float32),
        "image_info": tf.constant([[*image_size, 0.5, 64, 64]] * batch_size, tf.float32),
        "source_ids": tf.range(batch_size, dtype=tf.int64),
        "gt_boxes": tf.constant(np.stack(boxes)),
        "gt_classes": tf.constant(np.stack(classes)),
        "gt_masks": tf.constant(np.stack(masks)),
        "rpn_score_targets": stack(score_targets),
        "rpn_box_targets": stack(box_targets),
    }


def equally_weighted_config():
    """The small model as a Faster R-CNN with every proposal sampled: when each image holds one object, its
    loss is a mean of equally weighted per-image terms, so one update on a batch of N images must equal N
    accumulated (or N Horovod ranks') updates on one image each."""
    config = small_config()
    config.model.include_mask = False
    # A narrow FPN: the box head's fc6 then takes 64 x 7 x 7 inputs, not 256 x 7 x 7, whose kernel gradient was
    # most of a float16 step on a CPU (Eigen's emulated half precision).
    config.model.fpn_num_filters = 64
    config.model.roi.batch_size_per_im = 128
    config.model.roi.fg_fraction = 1.0
    config.model.rpn.train_rpn_post_nms_topn = 20
    config.train.init_learning_rate = 0.005  # the warm-up starts here: step 0 must move the weights
    # Frozen batch norm: batch statistics of a batch of N images are not those of N batches of one.
    config.model.freeze_bn = True
    return config


def trainer_for(config, world=None):
    """A Trainer of `config` (in Horovod's `world` if given) that reads no records (steps_per_epoch is set):
    tests call its update step."""
    from mrcnn_tf2.runtime import train as train_runtime

    config.data.training_file_pattern = "/nonexistent/train-*.tfrecord"
    config.train.steps_per_epoch = 10
    return train_runtime.Trainer(config) if world is None else train_runtime.Trainer(config, world)


def sync_config(batch_size, seed, model_dir):
    """equally_weighted_config's Faster R-CNN, `batch_size` images per rank (test_distributed's sync test)."""
    config = equally_weighted_config()
    config.train.train_batch_size = batch_size
    config.train.seed = seed
    config.runtime.model_dir = model_dir
    return config


def combined_batch():
    """The two-image batch of equally_weighted_config's tests: one object in each image."""
    return synthetic_batch(small_config(), objects_per_image=(1, 1))


def read_log(path):
    """The records of a run's log.jsonl, in order."""
    with open(path) as f:
        return [json.loads(line) for line in f]


def run_main(argv):
    """The exit status of `main.py ARGV` run in this process: what main() returns, or the code argparse exits
    with on bad flags."""
    import main

    try:
        return main.main([str(arg) for arg in argv])
    except SystemExit as exit_:
        return exit_.code


@contextlib.contextmanager
def terminations_by_default():
    """A context in which SIGINT, SIGTERM and SIGHUP have the handlers Python gives a command started from a
    terminal, whatever the test runner inherited (a background job of a shell without job control, such as a CI
    script's `make test &`, starts with SIGINT ignored); the runner's come back after it."""
    before = {signum: signal.signal(signum, handler) for signum, handler in (
        (signal.SIGINT, signal.default_int_handler), (signal.SIGTERM, signal.SIG_DFL), (signal.SIGHUP, signal.SIG_DFL))}
    try:
        yield
    finally:
        for signum, handler in before.items():
            signal.signal(signum, handler)


@contextlib.contextmanager
def detect_traces():
    """A context that counts the calls of `MaskRCNN.detect`, each a trace of the model (it runs in graphs only):
    yields the list that gets one entry per call."""
    from mrcnn_tf2.model.mask_rcnn import MaskRCNN

    calls, detect = [], MaskRCNN.detect

    def counted(self, *args, **kwargs):
        calls.append(None)
        return detect(self, *args, **kwargs)

    MaskRCNN.detect = counted
    try:
        yield calls
    finally:
        MaskRCNN.detect = detect


def dead_pid():
    """The pid of a process that has ended (as a process killed outright leaves it in its temporary names)."""
    process = subprocess.Popen([sys.executable, "-c", "pass"])
    process.wait()
    return process.pid


@contextlib.contextmanager
def file_size_limit(nbytes):
    """A context in which no file of this process grows past `nbytes`: a write past it fails with EFBIG, as one
    fails on a full disk with ENOSPC (SIGXFSZ, whose default ends the process, is ignored meanwhile)."""
    limits = resource.getrlimit(resource.RLIMIT_FSIZE)
    signalled = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    resource.setrlimit(resource.RLIMIT_FSIZE, (nbytes, limits[1]))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, limits)
        signal.signal(signal.SIGXFSZ, signalled)


def box_font(path, chars):
    """Writes to `path` a TrueType font whose glyph of each of `chars` (and of the space) is a solid box, and
    which has no other; returns `path` as a str."""
    from fontTools.fontBuilder import FontBuilder
    from fontTools.pens.ttGlyphPen import TTGlyphPen

    pen = TTGlyphPen(None)
    for x, y in ((50, 0), (50, 700), (450, 700), (450, 0)):
        (pen.lineTo if x != 50 or y != 0 else pen.moveTo)((x, y))
    pen.closePath()
    solid, empty = pen.glyph(), TTGlyphPen(None).glyph()
    names = {ord(char): f"u{ord(char):04x}" for char in chars}
    font = FontBuilder(1000, isTTF=True)
    font.setupGlyphOrder([".notdef", "space", *names.values()])
    font.setupCharacterMap({32: "space", **names})
    font.setupGlyf({".notdef": empty, "space": empty, **{name: solid for name in names.values()}})
    font.setupHorizontalMetrics({name: (500, 0) for name in [".notdef", "space", *names.values()]})
    font.setupHorizontalHeader(ascent=800, descent=-200)
    font.setupNameTable({"familyName": "Boxes", "styleName": "Regular"})
    font.setupOS2()
    font.setupPost()
    font.save(str(path))
    return str(path)


def live_processes(group):
    """[(pid, command)] of the processes of process group `group` that are not zombies (an orphan exited under a
    container's first process may stay a zombie)."""
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/stat") as f:
                stat = f.read()
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                command = f.read().replace(b"\0", b" ").decode(errors="replace")
        except OSError:  # it ended meanwhile
            continue
        state, _, pgrp = stat[stat.rindex(")") + 2:].split()[:3]
        if int(pgrp) == group and state != "Z":
            found.append((int(pid), command))
    return found


def lines_until(process, marker, seconds):
    """The lines of `process`'s text stdout up to the first that holds `marker`. Raises AssertionError, with the
    lines read, when the process ends first or `seconds` have passed at a line."""
    deadline = time.time() + seconds
    lines = []
    for line in process.stdout:
        lines.append(line)
        if marker in line:
            return lines
        assert time.time() < deadline, f"no {marker!r} within {seconds} s:\n" + "".join(lines[-50:])
    raise AssertionError(f"the process ended before {marker!r}:\n" + "".join(lines[-50:]))


def main_py(*args):
    """argv of `python main.py ARGS` in a fresh process (run it with cwd=ROOT)."""
    return [sys.executable, str(ROOT / "main.py"), *(str(arg) for arg in args)]



def run_converter(*argv):
    """(exit status, stdout, stderr) of weights/convert_torchvision.py's main(argv) run in this process."""
    from weights import convert_torchvision

    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = convert_torchvision.main([str(arg) for arg in argv])
    return code, out.getvalue(), err.getvalue()


# -- torchvision (test-only: torch is imported where it is used) ------------------------------------------------

def photo(height, width, seed):
    """A photo-like RGB image: a smooth gradient, blurred shapes and noise, as uint8 [h, w, 3]."""
    from PIL import Image, ImageDraw, ImageFilter

    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0:height, 0:width] / max(height, width)
    base = np.stack([120 + 100 * np.sin(3 * x + c) * np.cos(2 * y - c) for c in (0.0, 1.0, 2.0)], -1)
    image = Image.fromarray(np.clip(base, 0, 255).astype(np.uint8))
    draw = ImageDraw.Draw(image)
    for _ in range(12):
        x0, y0 = rng.uniform(0, width), rng.uniform(0, height)
        w, h = rng.uniform(20, width / 2), rng.uniform(20, height / 2)
        colour = tuple(int(v) for v in rng.integers(0, 256, 3))
        (draw.ellipse if rng.uniform() < 0.5 else draw.rectangle)([x0, y0, x0 + w, y0 + h], fill=colour)
    image = image.filter(ImageFilter.GaussianBlur(1.5))
    noisy = np.asarray(image, np.float32) + rng.normal(0, 6, (height, width, 3))
    return np.clip(noisy, 0, 255).astype(np.uint8)


def randomize(model, seed):
    """Random batch-norm statistics and affine parameters (so that folding matters: variances down to 1e-6,
    where eps 0 and 1e-5 differ) and random biases (torchvision initialises many to zero), in place; returns the
    model in eval mode."""
    import torch
    from torchvision.ops.misc import FrozenBatchNorm2d

    generator = torch.Generator().manual_seed(seed)

    def uniform(shape, low, high):
        return low + (high - low) * torch.rand(shape, generator=generator)

    with torch.no_grad():
        for module in model.modules():
            if isinstance(module, (torch.nn.BatchNorm2d, FrozenBatchNorm2d)):
                channels = module.running_var.shape
                module.running_var.copy_(10.0 ** uniform(channels, -6.0, 0.0))
                # Scales gamma / sqrt(var) of order 1, as trained networks have.
                module.weight.copy_(uniform(channels, 0.5, 1.5) * module.running_var.sqrt())
                module.running_mean.copy_(0.3 * torch.randn(channels, generator=generator))
                module.bias.copy_(0.2 * torch.randn(channels, generator=generator))
            elif isinstance(module, (torch.nn.Conv2d, torch.nn.ConvTranspose2d, torch.nn.Linear)) \
                    and module.bias is not None:
                module.bias.copy_(0.1 * torch.randn(module.bias.shape, generator=generator))
    return model.eval()


# torchvision's builder of each Mask R-CNN version the converter reads.
TORCHVISION_BUILDERS = {"v1": "maskrcnn_resnet50_fpn", "v2": "maskrcnn_resnet50_fpn_v2"}


def maskrcnn_resnet50_fpn(version="v1", **kwargs):
    """torchvision's Mask R-CNN of `version` (TORCHVISION_BUILDERS) without pretrained weights (nn.BatchNorm2d
    backbone, eps 1e-5), 91 classes; `kwargs` go to it (min_size, max_size)."""
    import torchvision

    builder = getattr(torchvision.models.detection, TORCHVISION_BUILDERS[version])
    return builder(weights=None, weights_backbone=None, num_classes=91, **kwargs)


def torchvision_model(version="v1", seed=0):
    """The test suite's torchvision Mask R-CNN of `version` (v1: maskrcnn_resnet50_fpn, v2: ..._v2; in eval
    mode): seeded, randomised (`randomize`), with its RPN and class outputs scaled to a trained model's ranges
    (measured on a 480x640 photo resized to 480..800), so that it gives confident, varied detections on photos."""
    import torch

    torch.manual_seed(seed)
    model = randomize(maskrcnn_resnet50_fpn(version, min_size=480, max_size=800), seed)
    generator = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        # Objectness logits of a few units, box deltas of a few tenths.
        model.rpn.head.cls_logits.weight.mul_(0.2)
        model.rpn.head.bbox_pred.weight.mul_(0.01)
        # Class logits of about 2.5 standard deviations and class deltas of about 0.5 on a photo's RoI features.
        image = torch.from_numpy(photo(480, 640, seed)).permute(2, 0, 1).float() / 255.0
        image_list, _ = model.transform([image])
        features = model.backbone(image_list.tensors)
        proposals, _ = model.rpn(image_list, features)
        pooled = model.roi_heads.box_roi_pool(features, proposals, image_list.image_sizes)
        rms = model.roi_heads.box_head(pooled).pow(2).mean().sqrt()
        predictor = model.roi_heads.box_predictor
        width = predictor.cls_score.in_features ** 0.5
        predictor.cls_score.weight.normal_(0.0, float(2.5 / (rms * width)), generator=generator)
        predictor.bbox_pred.weight.normal_(0.0, float(0.5 / (rms * width)), generator=generator)
    return model
