"""Throughput of the training input pipeline alone (decode, augment, resize, mask crops, RPN targets).

    .venv/bin/python scripts/benchmark_pipeline.py                      # generated 480x640 shapes images
    .venv/bin/python scripts/benchmark_pipeline.py --file_pattern '/data/coco/tfrecords/train*.tfrecord'

Without --file_pattern it generates COCO-sized shapes images in a temporary directory and converts them
first. Prints one line: img/s over the timed batches, after warm-up.
"""

import argparse
import os
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from dataset.create_coco_tf_record import convert_coco  # noqa: E402
from dataset.make_shapes_dataset import make_shapes_dataset  # noqa: E402
from mrcnn_tf2.config import Config  # noqa: E402
from mrcnn_tf2.data.pipeline import InputPipeline  # noqa: E402


def generated_records(directory, num_images):
    """Writes num_images shapes images of COCO's typical size as 8 TFRecord shards; returns their pattern."""
    make_shapes_dataset(directory, num_train=num_images, num_val=0, seed=0, image_size=(480, 640))
    output = os.path.join(directory, "tfrecords")
    convert_coco(os.path.join(directory, "train"), os.path.join(directory, "annotations", "instances_train.json"),
                 output, tag="train", num_shards=8, progress=False)
    return os.path.join(output, "train-*.tfrecord")


def measure(file_pattern, image_size, batch_size, warmup, batches):
    """img/s of the training pipeline over `batches` batches after `warmup` batches."""
    config = Config()
    config.data.image_size = tuple(image_size)
    iterator = iter(InputPipeline(config, training=True).dataset(file_pattern, batch_size))
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
