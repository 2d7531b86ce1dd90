"""Throughput of the training input pipeline alone (decode, augment, resize, mask crops, RPN targets).

    .venv/bin/python scripts/benchmark_pipeline.py                      # generated 480x640 shapes images
    .venv/bin/python scripts/benchmark_pipeline.py --file_pattern '/data/coco/tfrecords/train*.tfrecord'

Without --file_pattern it generates COCO-sized shapes images in a temporary directory and converts them
first. Prints one line: img/s over the timed batches, after warm-up.
"""

import argparse
import os
import subprocess
import sys
import tempfile
import time

from mrcnn_tf2.config import Config

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run_dataset_tool(script, *args):
    """Runs `python dataset/<script> args` of this checkout; exits with its output when it fails.

    The dataset tools are scripts beside the package, not part of it: like the demo, run them rather than
    import them.
    """
    result = subprocess.run([sys.executable, os.path.join(ROOT, "dataset", script), *args],
                            capture_output=True, text=True)
    if result.returncode:
        raise SystemExit(f"dataset/{script} failed (exit status {result.returncode}):\n{result.stdout}{result.stderr}")


def generated_records(directory, num_images):
    """Writes num_images shapes images of COCO's typical size as 8 TFRecord shards (fewer for fewer images: the
    converter refuses empty shards); returns their pattern."""
    run_dataset_tool("make_shapes_dataset.py", "--output_dir", directory, "--num_train", str(num_images),
                     "--num_val", "0", "--seed", "0", "--image_size", "480", "640")
    output = os.path.join(directory, "tfrecords")
    run_dataset_tool("create_coco_tf_record.py", "--image_dir", os.path.join(directory, "train"),
                     "--annotations_file", os.path.join(directory, "annotations", "instances_train.json"),
                     "--output_dir", output, "--tag", "train", "--num_shards", str(min(8, num_images)))
    return os.path.join(output, "train-*.tfrecord")


def measure(file_pattern, image_size, batch_size, warmup, batches):
    """img/s of the training pipeline over `batches` batches after `warmup` batches."""
    # Here, not at the top: --help, and the sibling scripts that import this one, answer without TensorFlow.
    from mrcnn_tf2.data.pipeline import InputPipeline
    from mrcnn_tf2.model.factory import build_anchors, choose_ops

    config = Config()
    config.data.image_size = tuple(image_size)
    # The anchors and the RPN-target op a model of this config would give the pipeline.
    pipeline = InputPipeline(config, training=True, anchors=build_anchors(config),
                             rpn_targets=choose_ops(config).rpn_targets)
    iterator = iter(pipeline.dataset(file_pattern, batch_size))
    for _ in range(warmup):
        next(iterator)
    start = time.perf_counter()
    for _ in range(batches):
        next(iterator)
    return batches * batch_size / (time.perf_counter() - start)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--file_pattern", help="training TFRecords; default: generated shapes images")
    parser.add_argument("--num_images", type=int, default=64, help="images to generate without --file_pattern")
    parser.add_argument("--image_size", type=int, nargs=2, default=(832, 1344), metavar=("H", "W"))
    parser.add_argument("--batch_size", type=int, default=2)
    parser.add_argument("--warmup", type=int, default=10, help="batches before timing")
    parser.add_argument("--batches", type=int, default=50, help="timed batches")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as directory:
        pattern = args.file_pattern or generated_records(directory, args.num_images)
        rate = measure(pattern, args.image_size, args.batch_size, args.warmup, args.batches)
    print(f"input pipeline: {rate:.1f} img/s (image_size {args.image_size[0]}x{args.image_size[1]}, "
          f"batch {args.batch_size}, {args.batches} batches, {os.cpu_count()} CPU cores)")


if __name__ == "__main__":
    main()
