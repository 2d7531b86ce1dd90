"""Fused C++ ops against their pure-TF twins at realistic sizes, and a whole train step with ops on vs off.

    .venv/bin/python scripts/benchmark_ops.py [--repeats 7] [--no-train-step] [--only TEXT]

Prints one row per op: the median milliseconds of the twin and of the fused op, and the speed-up. The two
run alternately, repeat after repeat, so that load from other jobs on a shared machine hits both alike;
the median then drops the outliers. Sizes: an 832x1344 input, FPN P2..P5 with 256 channels, batch 2 (NVIDIA's
training set-up); the train step is a small ResNet-18 at 256x256, batch 4. The 3x3 conv rows
compare conv_ops.conv2d's Winograd route with its route when the ops are off, under oneDNN as main.py runs.
"""
import argparse
import os
import time

import numpy as np

from mrcnn_tf2.cli import import_tensorflow

# TensorFlow and the ops are imported inside the functions that use them, so that --help answers at once;
# main() starts TensorFlow first, as main.py does (import_tensorflow: oneDNN on unless TF_ENABLE_ONEDNN_OPTS
# says otherwise).

IMAGE_SIZE = (832, 1344)
BATCH = 2
CHANNELS = 256
ASPECT_RATIOS = ((1.0, 1.0), (1.4, 0.7), (0.7, 1.4))
TRAIN_STEP_NAME = "train step ResNet-18 256x256, batch 4"
NAME_WIDTH = 57  # the table's op column: the longest row name


def random_boxes(rng, shape, image_size, min_side=8.0, max_side=400.0):
    """[..., 4] boxes [ymin, xmin, ymax, xmax] of sides in [min_side, max_side], centres in the image."""
    centres = rng.uniform(0, 1, size=shape + (2,)) * image_size
    sides = rng.uniform(min_side, max_side, size=shape + (2,))
    return np.concatenate([centres - sides / 2, centres + sides / 2], axis=-1).astype(np.float32)


def finish(result):
    """Wait for every tensor of a result (TF runs ops asynchronously only until a value is read)."""
    import tensorflow as tf

    for value in tf.nest.flatten(result):
        if isinstance(value, tf.Tensor):
            value.numpy()


def time_pair(twin, fused_fn, repeats):
    """Median milliseconds of (twin, fused), run alternately after one warm-up call each."""
    finish(twin())
    finish(fused_fn())
    times = {"twin": [], "fused": []}
    for _ in range(repeats):
        for name, fn in (("twin", twin), ("fused", fused_fn)):
            start = time.perf_counter()
            finish(fn())
            times[name].append(1000.0 * (time.perf_counter() - start))
    return float(np.median(times["twin"])), float(np.median(times["fused"]))


def roi_align_cases(rng):
    """(name, twin thunk, fused thunk) for the box and mask RoIAlign, forward and forward + backward."""
    import tensorflow as tf

    from mrcnn_tf2.ops import fused, roi_align

    features = {level: tf.constant(rng.normal(size=(BATCH, IMAGE_SIZE[0] // 2**level, IMAGE_SIZE[1] // 2**level,
                                                     CHANNELS)).astype(np.float32)) for level in (2, 3, 4, 5)}
    cases = []
    for output_size, num_rois in ((7, 512), (14, 128)):
        boxes = tf.constant(random_boxes(rng, (BATCH, num_rois), IMAGE_SIZE))
        upstream = tf.constant(rng.normal(size=(BATCH, num_rois, output_size, output_size, CHANNELS)).astype(np.float32))
        for backward in (False, True):
            def make(fn, output_size=output_size, boxes=boxes, upstream=upstream, backward=backward):
                @tf.function
                def run():
                    with tf.GradientTape() as tape:
                        tape.watch(features)
                        out = fn(features, boxes, output_size, 2)
                        loss = tf.reduce_sum(out * upstream)
                    return tape.gradient(loss, features) if backward else out
                return run
            name = f"RoIAlign {output_size}x{output_size}, {BATCH}x{num_rois} RoIs, {'fwd+bwd' if backward else 'fwd'}"
            cases.append((name, make(roi_align.multilevel_roi_align), make(fused.multilevel_roi_align)))
    return cases


def proposal_case(rng):
    import tensorflow as tf

    from mrcnn_tf2.ops import anchors as anchor_ops
    from mrcnn_tf2.ops import fused, roi_ops

    anchors = anchor_ops.generate_anchors(2, 6, 1, ASPECT_RATIOS, 8.0, IMAGE_SIZE)
    scores, deltas = {}, {}
    for level in anchors:
        grid = anchor_ops.feature_size(IMAGE_SIZE, level)
        scores[level] = tf.constant(rng.normal(size=(BATCH,) + grid + (3,)).astype(np.float32))
        deltas[level] = tf.constant((0.3 * rng.normal(size=(BATCH,) + grid + (12,))).astype(np.float32))
    image_hw = tf.constant([IMAGE_SIZE, (800.0, 1200.0)], tf.float32)

    def make(fn):
        return tf.function(lambda: fn(scores, deltas, anchors, image_hw, 2000, 1000, 0.7, 0.0))
    return ("proposals P2..P6, 3 anchors, pre 2000 / post 1000", make(roi_ops.multilevel_propose_rois),
            make(fused.multilevel_propose_rois))


def mask_target_case(rng):
    import tensorflow as tf

    from mrcnn_tf2.ops import fused, masks

    gt_boxes = random_boxes(rng, (BATCH, 128), IMAGE_SIZE)
    rois = tf.constant(gt_boxes + rng.uniform(-16, 16, size=gt_boxes.shape).astype(np.float32))
    gt_boxes = tf.constant(gt_boxes)
    crops = tf.constant((rng.uniform(size=(BATCH, 128, 112, 112)) > 0.5).astype(np.float32))

    def make(fn):
        return tf.function(lambda: fn(rois, gt_boxes, crops, 28))
    return "mask targets 2x128 RoIs, 112 -> 28", make(masks.mask_targets), make(fused.mask_targets)


def rpn_target_case(rng):
    import tensorflow as tf

    from mrcnn_tf2.ops import anchors as anchor_ops
    from mrcnn_tf2.ops import fused

    anchors = anchor_ops.generate_anchors(2, 6, 1, ASPECT_RATIOS, 8.0, IMAGE_SIZE)
    gt = np.full((100, 4), -1.0, np.float32)
    gt[:20] = random_boxes(rng, (20,), IMAGE_SIZE, 16.0, 400.0)
    gt = tf.constant(gt)
    seed = tf.constant([1, 2])

    def make(fn):
        return tf.function(lambda: fn(anchors, gt, IMAGE_SIZE, seed=seed))
    return "RPN anchor targets, 1 image, 20 GT boxes", make(anchor_ops.rpn_targets), make(fused.rpn_targets)


def paste_case(rng):
    from mrcnn_tf2.ops import fused, masks

    boxes = random_boxes(rng, (100,), (800, 1333), 16.0, 400.0)
    probs = rng.uniform(size=(100, 28, 28)).astype(np.float32)
    return ("paste + RLE-encode 100 masks into 800x1333, threshold 0.5",
            lambda: masks.encode_pasted_masks(probs, boxes, (800, 1333), 0.5),
            lambda: fused.encode_pasted_masks(probs, boxes, (800, 1333), 0.5))


def conv_cases(rng):
    """The model's 3x3 256->256 convs: FPN/RPN on P2 (forward at batch 1 and 2, with gradients at batch 2)
    and the mask head's over 100 RoIs."""
    import tensorflow as tf

    from mrcnn_tf2.ops import conv as conv_ops

    kernel = tf.constant(rng.normal(scale=0.03, size=(3, 3, CHANNELS, CHANNELS)).astype(np.float32))
    cases = []
    for name, shape, backward in [
            ("3x3 conv 256->256 on P2, batch 1, fwd", (1, 208, 336), False),
            ("3x3 conv 256->256 on P2, batch 2, fwd", (BATCH, 208, 336), False),
            ("3x3 conv 256->256 on P2, batch 2, fwd+bwd", (BATCH, 208, 336), True),
            ("3x3 conv 256->256, 100 RoIs 14x14, fwd", (100, 14, 14), False)]:
        x = tf.constant(rng.normal(size=shape + (CHANNELS,)).astype(np.float32))

        def make(on, x=x, backward=backward):
            def run():
                with tf.GradientTape() as tape:
                    tape.watch([x, kernel])
                    y = conv_ops.conv2d(x, kernel, route=conv_ops.WINOGRAD if on else conv_ops.CPU)
                return tape.gradient(y, [x, kernel], output_gradients=y) if backward else y
            return tf.function(run)
        cases.append((name, make(False), make(True)))
    return cases


def train_step_case(rng):
    """One train step of ResNet-18 at 256x256, batch 4 (default RPN/RoI settings), ops off vs on."""
    import keras
    import tensorflow as tf

    from mrcnn_tf2.config import Config
    from mrcnn_tf2.model.factory import build_anchors, build_model
    from mrcnn_tf2.ops import anchors as anchor_ops

    image_size, batch, max_instances, mask_size = (256, 256), 4, 8, 28
    config = Config()
    config.model.backbone = "resnet18"
    config.model.num_classes = 6
    config.data.image_size = image_size
    config.data.max_num_instances = max_instances
    config.data.gt_mask_size = mask_size
    anchors = build_anchors(config)
    boxes = np.full((batch, max_instances, 4), -1.0, np.float32)
    boxes[:, :5] = random_boxes(rng, (batch, 5), image_size, 16.0, 128.0).clip(0, 256)
    targets = [anchor_ops.rpn_targets(anchors, boxes[b], image_size, seed=tf.constant([b, 0])) for b in range(batch)]
    data = {
        "images": tf.constant(rng.normal(size=(batch,) + image_size + (3,)).astype(np.float32)),
        "image_info": tf.constant([[*image_size, 1.0, *image_size]] * batch, tf.float32),
        "gt_boxes": tf.constant(boxes),
        "gt_classes": tf.constant(np.where(boxes[..., 0] >= 0, rng.integers(1, 6, size=boxes.shape[:2]), -1), tf.int32),
        "gt_masks": tf.constant((rng.uniform(size=(batch, max_instances, mask_size, mask_size)) > 0.5).astype(np.float32)),
        "rpn_score_targets": {lv: tf.stack([t["rpn_score_targets"][lv] for t in targets]) for lv in anchors},
        "rpn_box_targets": {lv: tf.stack([t["rpn_box_targets"][lv] for t in targets]) for lv in anchors},
    }
    steps = {}
    for mode in ("off", "on"):
        config.runtime.custom_ops = mode
        keras.utils.set_random_seed(0)
        model = build_model(config)
        model.compile(optimizer=keras.optimizers.SGD(0.001, momentum=0.9))
        steps[mode] = tf.function(lambda model=model: model.train_step(data))
        finish(steps[mode]())  # trace and build the optimizer outside the timing
    return TRAIN_STEP_NAME, steps["off"], steps["on"]


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=7, help="timed calls of each implementation")
    parser.add_argument("--no-train-step", action="store_true", help="skip the whole-step comparison")
    parser.add_argument("--only", default="", metavar="TEXT", help="time only the rows whose name contains TEXT")
    args = parser.parse_args(argv)
    tf = import_tensorflow()
    from mrcnn_tf2.ops import fused

    fused.load_library()  # fail here, clearly, when the library is not built
    rng = np.random.default_rng(0)
    cases = roi_align_cases(rng) + [proposal_case(rng), mask_target_case(rng), rpn_target_case(rng), paste_case(rng)]
    cases += conv_cases(rng)
    cases = [case for case in cases if args.only in case[0]]
    if not args.no_train_step and args.only in TRAIN_STEP_NAME:
        cases.append(train_step_case(rng))
    print(f"median of {args.repeats} alternating repeats; {os.cpu_count()} CPU cores; tensorflow {tf.__version__}")
    print(f"| {'op':<{NAME_WIDTH}} | {'twin ms':>9} | {'fused ms':>9} | {'speed-up':>8} |")
    print(f"| {'-' * NAME_WIDTH} | {'-' * 9}:| {'-' * 9}:| {'-' * 8}:|")
    for name, twin, fused_fn in cases:
        twin_ms, fused_ms = time_pair(twin, fused_fn, args.repeats)
        print(f"| {name:<{NAME_WIDTH}} | {twin_ms:9.1f} | {fused_ms:9.1f} | {twin_ms / fused_ms:7.1f}x |", flush=True)


if __name__ == "__main__":
    main()
