"""Shared pytest set-up: torch without Triton, quiet TensorFlow, fixed seeds.

The tests import the repository's top-level main.py, dataset/, weights/, scripts/ and tests/ modules:
pytest.ini's `pythonpath = .` puts the repository root on sys.path (the package itself is installed, editable).
"""
import os
import sys

# Before anything imports torch: in a process that has loaded TensorFlow, importing torchvision segfaults
# (torchvision.ops imports torch._dynamo, which loads Triton's native library). Made unimportable, Triton is
# absent to torch, which then runs without it; the tests never need it (torch on the CPU, no torch.compile).
sys.modules.setdefault("triton", None)

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import numpy as np  # noqa: E402
import pytest  # noqa: E402


@pytest.fixture
def rng():
    """A seeded NumPy generator, so that every random test input is reproducible."""
    return np.random.default_rng(0)


@pytest.fixture(scope="session")
def shapes_records(tmp_path_factory):
    """Generated shapes images as TFRecords: dict with data_dir (train-*/val-* shards) and COCO annotations.

    Seed 6 gives train images without objects and a crowd region, which the pipeline tests need.
    """
    import json

    from dataset.create_coco_tf_record import convert_coco
    from dataset.make_shapes_dataset import make_shapes_dataset

    root = tmp_path_factory.mktemp("shapes_records")
    make_shapes_dataset(str(root), num_train=6, num_val=5, seed=6, min_size=64, max_size=128)
    out = root / "tfrecords"
    annotations = {}
    for split, shards in (("train", 2), ("val", 1)):
        annotations_file = root / "annotations" / f"instances_{split}.json"
        convert_coco(str(root / split), str(annotations_file), str(out), tag=split, num_shards=shards,
                     num_workers=1, progress=False)
        with open(annotations_file) as f:
            annotations[split] = json.load(f)
    return {"data_dir": str(out), "train": str(out / "train-*.tfrecord"), "val": str(out / "val-*.tfrecord"),
            "annotations": annotations, "val_json": str(root / "annotations" / "instances_val.json")}
