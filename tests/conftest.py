"""Shared pytest set-up: torch without Triton, quiet TensorFlow, fixed seeds, the expensive inputs that several test
modules read (generated data, a trained small model, a converted torchvision model), made once per test run
(support.built_once), and the order in which the tests run.

The tests import the repository's top-level main.py, dataset/, weights/, scripts/ and tests/ modules:
pytest.ini's `pythonpath = .` puts the repository root on sys.path (the package itself is installed, editable).
Helpers shared by test modules are in tests/support.py.
"""
import gc
import json
import os
import signal
import sys

# Before anything imports torch: in a process that has loaded TensorFlow, importing torchvision segfaults
# (torchvision.ops imports torch._dynamo, which loads Triton's native library). Made unimportable, Triton is
# absent to torch, which then runs without it; the tests never need it (torch on the CPU, no torch.compile).
sys.modules.setdefault("triton", None)

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
# Under pytest-xdist the workers share the machine's cores: TensorFlow's threads per op split among them (and
# the processes they start), rather than each worker's fighting the others' for every core. `make test`'s two
# workers on two cores ran 4-5% faster so (docs/TESTING.md).
if os.environ.get("PYTEST_XDIST_WORKER_COUNT"):
    os.environ.setdefault("TF_NUM_INTRAOP_THREADS",
                          str(max(1, (os.cpu_count() or 1) // int(os.environ["PYTEST_XDIST_WORKER_COUNT"]))))

import numpy as np  # noqa: E402
import pytest  # noqa: E402

from tests.support import (SCHEDULE_FLAGS, SMALL_FLAGS, TORCHVISION_BUILDERS, TRAINED_STEPS, built_once,  # noqa: E402
                           run_converter, torchvision_model)


@pytest.fixture
def rng():
    """A seeded NumPy generator, so that every random test input is reproducible."""
    return np.random.default_rng(0)


@pytest.fixture(scope="session")
def shapes_records(tmp_path_factory):
    """Generated shapes images as TFRecords: dict with data_dir (train-*/val-* shards) and COCO annotations.

    Seed 6 gives train images without objects and a crowd region, which the pipeline tests need.
    """
    def build(root):
        from dataset.create_coco_tf_record import convert_coco
        from dataset.make_shapes_dataset import make_shapes_dataset

        make_shapes_dataset(str(root), num_train=6, num_val=5, seed=6, min_size=64, max_size=128)
        for split, shards in (("train", 2), ("val", 1)):
            convert_coco(str(root / split), str(root / "annotations" / f"instances_{split}.json"),
                         str(root / "tfrecords"), tag=split, num_shards=shards, num_workers=1, progress=False)

    root = built_once(tmp_path_factory, "shapes_records", build, across_runs=True)
    out = root / "tfrecords"
    annotations = {}
    for split in ("train", "val"):
        with open(root / "annotations" / f"instances_{split}.json") as f:
            annotations[split] = json.load(f)
    return {"data_dir": str(out), "train": str(out / "train-*.tfrecord"), "val": str(out / "val-*.tfrecord"),
            "annotations": annotations, "val_json": str(root / "annotations" / "instances_val.json")}


@pytest.fixture(scope="session")
def trained_model(tmp_path_factory, shapes_records):
    """The model directory of the small model (SMALL_FLAGS) trained from scratch on shapes_records for
    TRAINED_STEPS steps (2 epochs of SCHEDULE_FLAGS), a checkpoint at every step (ckpt-1 .. ckpt-4), its
    log.jsonl and config.json. Read it only; a test that trains, evaluates or writes into it takes a copy."""
    def build(model_dir):
        from mrcnn_tf2.cli import main

        assert main(["train", "--data_dir", shapes_records["data_dir"], "--model_dir", str(model_dir),
                     *SMALL_FLAGS, *SCHEDULE_FLAGS, "--epochs", str(TRAINED_STEPS // 2),
                     "--checkpoint_every", "1"]) == 0

    return built_once(tmp_path_factory, "trained_model", build)


def converted_torchvision(tmp_path_factory, version):
    """The suite's torchvision Mask R-CNN of `version` (support.torchvision_model), saved with torch.save and
    converted by weights/convert_torchvision.py: dict of state_dict (the .pth path), model_dir (the conversion)
    and converter_output (what the converter printed)."""
    name = TORCHVISION_BUILDERS[version]

    def build(folder):
        import torch

        torch.save(torchvision_model(version).state_dict(), folder / f"{name}.pth")
        code, out, err = run_converter("--input", folder / f"{name}.pth", "--output_dir", folder / "model")
        assert code == 0, err
        (folder / "converter_output.txt").write_text(out)

    folder = built_once(tmp_path_factory, f"torchvision_{version}", build, across_runs=True)
    return {"state_dict": folder / f"{name}.pth", "model_dir": folder / "model",
            "converter_output": (folder / "converter_output.txt").read_text()}


@pytest.fixture(scope="session")
def torchvision_v1(tmp_path_factory):
    """`converted_torchvision` of v1 (maskrcnn_resnet50_fpn)."""
    return converted_torchvision(tmp_path_factory, "v1")


@pytest.fixture(scope="session")
def torchvision_v2(tmp_path_factory):
    """`converted_torchvision` of v2 (maskrcnn_resnet50_fpn_v2)."""
    return converted_torchvision(tmp_path_factory, "v2")


def pytest_collection_modifyitems(items):
    """The modules with slow tests first, each module's tests kept together (its module fixtures made once): the
    two pytest-xdist workers take tests in this order, so the long ones start early and short ones fill the end."""
    slow_modules = {item.module for item in items if item.get_closest_marker("slow")}
    items.sort(key=lambda item: item.module not in slow_modules)


def pytest_runtest_setup(item):
    """Under --dist loadgroup, pytest-xdist suffixes the node id of a test with its xdist_group, which is how the
    controller keeps a group on one worker: with pytest 9.2 and pytest-xdist 3.8 the suffix was silently lost,
    each worker made the group's module fixtures again (requirements.txt)."""
    if (getattr(item.config.option, "loadgroup", False) and item.get_closest_marker("xdist_group")
            and "@" not in item.nodeid):
        pytest.fail("pytest-xdist did not tag this test with its xdist_group: the group is not kept on one worker")


# The handlers of the signals that stop a run (mrcnn_tf2.status, runtime.stop_signals), as the worker starts.
STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
HANDLERS_AT_START = {signum: signal.getsignal(signum) for signum in STOP_SIGNALS}


@pytest.fixture(autouse=True)
def stop_signal_handlers_given_back():
    """Each test, with the fixtures it set up, leaves the stop signals' handlers as the worker started with: one
    left behind turns a later test's signal into something else (a run that should stop goes on), far from the
    test that left it."""
    yield
    left = {signal.Signals(signum).name: handler for signum, handler in
            ((signum, signal.getsignal(signum)) for signum in STOP_SIGNALS) if handler is not HANDLERS_AT_START[signum]}
    assert not left, f"signal handlers left changed by this test or a fixture it set up: {left}"


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_teardown(item, nextitem):
    """After a module's last test and its fixtures' teardown: drop the gradients that tf.custom_gradient
    registered while the module traced models, and collect the graphs they kept.

    In a tf.function, each call of a tf.custom_gradient function (the CPU routes' convs, the FPN's upsampling)
    registers its gradient in TensorFlow's global registry under a new name, and the entry keeps the traced graph
    alive for the life of the process (tensorflow/tensorflow#27492, #97697). A test worker traces hundreds of
    models: without this its memory grew by 0.3-1 GB a module, to 11 GB a worker by the end of the suite, and the
    two workers met the machine's 24 GiB. Gradients are taken while a function traces, so a later module needs
    none of the entries."""
    yield
    if nextitem is None or nextitem.module is not item.module:
        framework_ops = sys.modules.get("tensorflow.python.framework.ops")
        if framework_ops is not None:
            registry = framework_ops._gradient_registry._registry
            for name in [name for name in registry if name.startswith("CustomGradient-")]:
                del registry[name]
            gc.collect()
