"""Distributed training with Horovod: the world outside a launcher, two Gloo ranks kept in sync and equal to
one process on the combined batch, two ranks sharing the records of one file, `main.py train` under
horovodrun, a dead rank ending the job, resume.

Horovod is built by the set-up (scripts/build_horovod.sh): where it does not import, these tests fail
rather than skip, so CI cannot silently lose them.
"""

import json
import os
import subprocess
import sys
import time

import numpy as np
import pytest
import tensorflow as tf

from mrcnn_tf2.runtime import distributed
from tests.support import ROOT, SMALL_FLAGS, combined_batch, main_py, read_log, sync_config, trainer_for

HOROVODRUN = os.path.join(os.path.dirname(sys.executable), "horovodrun")
# A job whose rank died must be over within this many seconds of the death.
DEAD_RANK_BOUND_S = 120


def horovodrun(*command, np_=2):
    """argv of `horovodrun -np N -H localhost:N --gloo` running `command` with this Python."""
    return [HOROVODRUN, "-np", str(np_), "-H", f"localhost:{np_}", "--gloo", "--network-interface", "lo", *command]


def launcher_free_environment(monkeypatch):
    for name in distributed.LAUNCHER_RANK_VARIABLES:
        monkeypatch.delenv(name, raising=False)


def test_horovod_is_built_with_gloo():
    import horovod.tensorflow as hvd  # an ImportError fails the test: the set-up must have built it

    assert hvd.gloo_built()
    assert os.path.exists(HOROVODRUN)


def test_without_a_launcher_the_world_is_one_process_and_collectives_are_identities(monkeypatch):
    launcher_free_environment(monkeypatch)
    world = distributed.init_world()
    assert (world.size, world.rank, world.local_rank, world.is_chief, world.hvd) == (1, 0, 0, True, None)
    gradients = [tf.ones([2, 3]), None]
    assert world.average_gradients(gradients) is gradients
    assert world.allgather_object({"a": 1}) == [{"a": 1}]


def test_a_launcher_without_horovod_is_a_clear_error(monkeypatch):
    launcher_free_environment(monkeypatch)
    monkeypatch.setenv("OMPI_COMM_WORLD_RANK", "0")
    monkeypatch.setitem(sys.modules, "horovod.tensorflow", None)  # makes the import fail
    with pytest.raises(RuntimeError, match="OMPI_COMM_WORLD_RANK is set.*scripts/setup.sh"):
        distributed.init_world()


@pytest.mark.timeout(300)  # a horovodrun job of two ranks, then the same steps in this process
@pytest.mark.slow
def test_two_ranks_stay_identical_and_equal_one_process_on_the_combined_batch(tmp_path):
    steps = 3
    result = subprocess.run(horovodrun(sys.executable, "-m", "tests.distributed_sync", str(tmp_path), str(steps)),
                            cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    ranks = [np.load(tmp_path / f"rank{r}.npz") for r in (0, 1)]
    count = len([k for k in ranks[0].files if k.startswith("initial_")])
    # Seeded differently, the ranks start from rank 0's weights (the broadcast) and end identical (the
    # allreduce hands both the same average).
    for i in range(count):
        np.testing.assert_array_equal(ranks[1][f"initial_{i}"], ranks[0][f"initial_{i}"])
        np.testing.assert_array_equal(ranks[1][f"final_{i}"], ranks[0][f"final_{i}"])
    # One process with both images per step, from the same start, makes the same updates.
    trainer = trainer_for(sync_config(2, seed=1, model_dir=str(tmp_path / "single")))
    batch = combined_batch()
    trainer.build(batch)
    for i, variable in enumerate(trainer.model.trainable_variables):
        variable.assign(ranks[0][f"initial_{i}"])
    update = trainer.update_function()
    for _ in range(steps):
        update([batch])
    moved = 0
    for i, variable in enumerate(trainer.model.trainable_variables):
        # atol: with oneDNN's kernels (TF_ENABLE_ONEDNN_OPTS=1) convolution gradients sum a batch of 2 in
        # another order than two batches of 1 (a few weights differ by 2e-6); the typical update is 6e-4.
        np.testing.assert_allclose(ranks[0][f"final_{i}"], variable.numpy(), rtol=1e-4, atol=1e-5,
                                   err_msg=variable.path)
        moved += not np.allclose(ranks[0][f"initial_{i}"], variable.numpy())
    assert moved > count // 2  # the updates changed the weights: the comparison is not of the start


@pytest.mark.slow
def test_two_ranks_share_the_records_of_a_single_file_disjointly_and_completely(tmp_path, shapes_records):
    (path,) = tf.io.gfile.glob(shapes_records["val"])  # one file of 5 records: 3 for rank 0, 2 for rank 1
    draws = 20  # several passes over each share, in its shuffled order
    result = subprocess.run(horovodrun(sys.executable, "-m", "tests.distributed_records", path, str(draws),
                                       str(tmp_path)),
                            cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert result.stdout.count("keeps 1 record in 2") == 1, result.stdout[-3000:]  # rank 0's notice
    seen = [set(json.loads((tmp_path / f"rank{r}.json").read_text())) for r in (0, 1)]
    assert not seen[0] & seen[1]
    assert seen[0] | seen[1] == {image["id"] for image in shapes_records["annotations"]["val"]["images"]}


def train_under_horovodrun(model_dir, data_dir, *extra):
    command = horovodrun(*main_py("train", "--data_dir", data_dir, "--model_dir", str(model_dir), *SMALL_FLAGS,
                                  "--train_batch_size", "1", "--steps_per_epoch", "3", "--epochs", "2",
                                  "--checkpoint_every", "1", "--log_every", "1", *extra))
    return subprocess.Popen(command, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)


def rank_process(launcher, rank):
    """The process that horovodrun started as `rank` (its environment says HOROVOD_RANK=rank)."""
    import psutil  # installed with Horovod

    for child in psutil.Process(launcher.pid).children(recursive=True):
        try:
            environment = child.environ()
        except psutil.Error:
            continue
        if environment.get("HOROVOD_RANK") == str(rank) and "main.py" in " ".join(child.cmdline()):
            return child
    return None


@pytest.mark.timeout(600)  # two horovodrun jobs of two ranks, with the test's own deadlines of 400 + 120 s
@pytest.mark.slow
def test_a_dead_rank_ends_the_job_naming_it_and_a_rerun_resumes(tmp_path, shapes_records):
    job = train_under_horovodrun(tmp_path, shapes_records["data_dir"])
    deadline = time.time() + 400
    while not os.path.exists(tmp_path / "ckpt-2.index"):
        assert job.poll() is None, job.stdout.read()
        assert time.time() < deadline, "no checkpoint 2 within 400 s"
        time.sleep(0.2)
    rank_process(job, 1).kill()
    killed = time.time()
    try:
        output, _ = job.communicate(timeout=DEAD_RANK_BOUND_S)
    except subprocess.TimeoutExpired:
        os.killpg(job.pid, 9)
        pytest.fail(f"the job outlived its dead rank 1 by {DEAD_RANK_BOUND_S} s")
    print(f"job ended {time.time() - killed:.1f} s after rank 1 died")
    assert job.returncode != 0
    assert "Process 1 exit with status code" in output, output[-3000:]
    # Rank 0 alone logs: each step once, in one process's order.
    log = read_log(tmp_path / "log.jsonl")
    assert [r["event"] for r in log].count("start") == 1
    steps = [r["step"] for r in log if r["event"] == "metrics"]
    assert steps == list(range(1, len(steps) + 1)) and len(steps) >= 2

    rerun = train_under_horovodrun(tmp_path, shapes_records["data_dir"])
    output, _ = rerun.communicate(timeout=600)
    assert rerun.returncode == 0, output[-3000:]
    log = read_log(tmp_path / "log.jsonl")
    (resumed,) = [r for r in log if r["event"] == "resumed"]
    assert resumed["step"] >= 2
    steps_after = [r["step"] for r in log[log.index(resumed):] if r["event"] == "metrics"]
    assert steps_after == list(range(resumed["step"] + 1, 7))
    start = [r for r in log if r["event"] == "start"]
    assert start[-1]["global_batch_size"] == 2 and start[-1]["start_step"] == resumed["step"]
    assert tf.train.latest_checkpoint(str(tmp_path)).endswith("ckpt-6")
    assert output.count("[train] step 6/6") == 1  # one progress line per step: rank 1 is silent


@pytest.mark.timeout(300)  # a horovodrun job of two ranks that trains and evaluates
@pytest.mark.slow
def test_an_early_stop_under_horovodrun_ends_every_rank_with_status_0(tmp_path, shapes_records):
    # Targets any model meets: rank 0's first evaluation (end of epoch 1, step 3) stops the job.
    job = train_under_horovodrun(tmp_path, shapes_records["data_dir"], "--eval_file", shapes_records["val_json"],
                                 "--eval_samples", "2", "--eval_batch_size", "2", "--min_bbox_map", "0",
                                 "--min_mask_map", "0")
    try:
        output, _ = job.communicate(timeout=600)
    except subprocess.TimeoutExpired:
        os.killpg(job.pid, 9)
        pytest.fail("the job did not end after rank 0 reached its target")
    assert job.returncode == 0, output[-3000:]
    assert "target reached" in output
    log = read_log(tmp_path / "log.jsonl")
    assert [r["step"] for r in log if r["event"] == "done"] == [3]
    assert [r["step"] for r in log if r["event"] == "metrics"] == [1, 2, 3]


@pytest.mark.timeout(300)  # a horovodrun job of two ranks
@pytest.mark.slow
def test_benchmark_under_horovodrun_reports_total_and_per_worker_throughput(tmp_path, shapes_records):
    result = subprocess.run(
        horovodrun(*main_py("train", "--data_dir", shapes_records["data_dir"], "--model_dir", str(tmp_path),
                            *SMALL_FLAGS, "--train_batch_size", "1", "--benchmark", "--benchmark_steps", "3",
                            "--use_synthetic_data")),
        cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    lines = result.stdout.splitlines()
    (total,) = [line for line in lines if "train throughput:" in line]
    (per_worker,) = [line for line in lines if "train per-worker throughput:" in line]
    assert "over 2 workers" in per_worker
    total_rate = float(total.split("train throughput:")[1].split()[0])
    mean_rate = float(per_worker.split("train per-worker throughput:")[1].split()[0])
    # Steps are synchronised: each worker does about half of the job's images per second.
    assert mean_rate == pytest.approx(total_rate / 2, rel=0.2)
