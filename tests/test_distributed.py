"""Distributed training and evaluation with Horovod under horovodrun (Gloo and MPI) and Open MPI's mpirun: the
launcher's process count checked against Horovod's world, two ranks kept in sync and equal to one process on
the combined batch, the records of one file shared, `main.py train` and `main.py eval` as one job, a dead rank
ending the job, resume, and a signal to one rank stopping every rank with a checkpoint.

Horovod is built by the set-up (scripts/build_horovod.sh), with MPI where Open MPI is installed (the set-up
installs it where it can): where it does not import, or lacks MPI, these tests fail rather than skip, so CI
cannot silently lose them.
"""

import json
import os
import shutil
import signal
import subprocess
import sys
import time
import types

import numpy as np
import pytest
import tensorflow as tf

from mrcnn_tf2 import cli
from mrcnn_tf2.runtime import distributed
from tests.support import (ROOT, SMALL_FLAGS, combined_batch, lines_until, main_py, read_log, run_main, sync_config,
                           trainer_for)

HOROVODRUN = os.path.join(os.path.dirname(sys.executable), "horovodrun")
# A job whose rank died must be over within this many seconds of the death.
DEAD_RANK_BOUND_S = 120
# Open MPI refuses to start as root (CI's containers) unless told twice; both are ignored for other users.
MPI_ENVIRONMENT = dict(os.environ, OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1",
                       PATH=os.path.dirname(sys.executable) + os.pathsep + os.environ["PATH"])


def horovodrun(*command, np_=2, controller="--gloo"):
    """argv of `horovodrun -np N -H localhost:N --gloo|--mpi` running `command`."""
    return [HOROVODRUN, "-np", str(np_), "-H", f"localhost:{np_}", controller, "--network-interface", "lo",
            *command]


def mpirun(*command, np_=2, options=()):
    """argv of Open MPI's `mpirun -np N` running `command`, bound as docs/DISTRIBUTED.md says."""
    return ["mpirun", "-np", str(np_), "-bind-to", "none", "-map-by", "slot", *options, *command]


def launcher_free_environment(monkeypatch):
    for _, rank_variable, size_variable in distributed.LAUNCHERS:
        monkeypatch.delenv(rank_variable, raising=False)
        monkeypatch.delenv(size_variable, raising=False)


def test_horovod_is_built_with_gloo_and_mpi():
    import horovod.tensorflow as hvd  # an ImportError fails the test: the set-up must have built it

    assert hvd.gloo_built()
    assert hvd.mpi_built(), "Horovod was built without MPI: install Open MPI and rerun make setup"
    assert os.path.exists(HOROVODRUN) and shutil.which("mpirun")


def test_without_a_launcher_the_world_is_one_process_and_collectives_are_identities(monkeypatch):
    launcher_free_environment(monkeypatch)
    world = distributed.init_world()
    assert (world.size, world.rank, world.local_rank, world.is_chief, world.hvd) == (1, 0, 0, True, None)
    gradients = [tf.ones([2, 3]), None]
    assert world.average_gradients(gradients) is gradients
    assert world.allgather_object({"a": 1}) == [{"a": 1}]
    assert world.broadcast_object({"a": 1}) == {"a": 1}
    assert world.max_over_ranks(15) == 15


@pytest.mark.parametrize("environ, names", [
    ({"OMPI_COMM_WORLD_RANK": "1"}, "OMPI_COMM_WORLD_RANK='1' and OMPI_COMM_WORLD_SIZE=None"),
    ({"HOROVOD_RANK": "2", "HOROVOD_SIZE": "2"}, "HOROVOD_RANK='2' and HOROVOD_SIZE='2'"),
    ({"PMI_RANK": "x", "PMI_SIZE": "2"}, "PMI_RANK='x' and PMI_SIZE='2'"),
])
def test_launcher_variables_that_are_not_a_rank_and_a_count_are_refused(environ, names):
    with pytest.raises(distributed.LaunchError, match="^" + names.replace("(", r"\(")) as refused:
        distributed.init_world(environ)
    assert "\n" not in str(refused.value) and "horovodrun or mpirun" in str(refused.value)


def test_one_process_under_a_launcher_needs_no_horovod(monkeypatch):
    monkeypatch.setitem(sys.modules, "horovod.tensorflow", None)  # makes the import fail
    assert distributed.init_world({"OMPI_COMM_WORLD_RANK": "0", "OMPI_COMM_WORLD_SIZE": "1"}) is \
        distributed.SINGLE_PROCESS


def test_a_launch_of_two_without_horovod_is_refused_naming_the_count_and_the_fix(monkeypatch):
    monkeypatch.setitem(sys.modules, "horovod.tensorflow", None)
    with pytest.raises(distributed.LaunchError) as refused:
        distributed.init_world({"OMPI_COMM_WORLD_RANK": "1", "OMPI_COMM_WORLD_SIZE": "2"})
    assert str(refused.value).startswith("mpirun started 2 processes (OMPI_COMM_WORLD_SIZE=2) but "
                                         "horovod.tensorflow does not import")
    assert "make setup" in str(refused.value) and refused.value.rank == 1


def fake_horovod(size, rank, mpi_built=True, mpi_enabled=True):
    """A stand-in for horovod.tensorflow whose hvd.init() forms a world of `size`."""
    return types.SimpleNamespace(init=lambda: None, size=lambda: size, rank=lambda: rank, local_rank=lambda: rank,
                                 mpi_built=lambda: mpi_built, mpi_enabled=lambda: mpi_enabled)


@pytest.mark.parametrize("hvd, environ, cause", [
    (fake_horovod(1, 0, mpi_built=False), {}, "this Horovod was built without MPI"),
    (fake_horovod(1, 0, mpi_enabled=False), {"HOROVOD_CONTROLLER": "gloo"}, "HOROVOD_CONTROLLER=gloo"),
    (fake_horovod(4, 0), {}, "the launcher's MPI is not the one Horovod was built with"),
])
def test_a_horovod_world_unlike_the_launchers_is_refused_with_its_cause(monkeypatch, hvd, environ, cause):
    import horovod

    monkeypatch.setitem(sys.modules, "horovod.tensorflow", hvd)
    monkeypatch.setattr(horovod, "tensorflow", hvd, raising=False)  # `import horovod.tensorflow` reads it first
    with pytest.raises(distributed.LaunchError) as refused:
        distributed.init_world({"OMPI_COMM_WORLD_RANK": "0", "OMPI_COMM_WORLD_SIZE": "2", **environ})
    message = str(refused.value)
    assert message.startswith(f"mpirun started 2 processes (OMPI_COMM_WORLD_SIZE=2) but Horovod formed a world "
                              f"of {hvd.size()}")
    assert cause in message and "\n" not in message


def test_infer_and_export_under_a_launcher_of_two_are_refused(monkeypatch):
    launcher_free_environment(monkeypatch)
    monkeypatch.setenv("HOROVOD_RANK", "0")
    monkeypatch.setenv("HOROVOD_SIZE", "2")
    for mode in ("infer", "export"):
        with pytest.raises(distributed.LaunchError, match=f"^{mode} runs in one process, but horovodrun started 2"):
            cli.start_world(mode)


@pytest.mark.timeout(120)  # an mpirun job of two processes that stop at start-up
@pytest.mark.slow
def test_mpirun_with_horovod_off_mpi_is_refused_once_with_status_2_and_nothing_written(tmp_path, shapes_records):
    # Horovod told to use Gloo under mpirun is what a Horovod built without MPI does there: each process
    # becomes rank 0 of 1, and would train a model of its own into the same model_dir.
    model_dir = tmp_path / "model"
    result = subprocess.run(
        mpirun(*main_py("train", "--data_dir", shapes_records["data_dir"], "--model_dir", model_dir, *SMALL_FLAGS),
               options=["-x", "HOROVOD_CONTROLLER=gloo", "-x", "HOROVOD_CPU_OPERATIONS=gloo"]),
        cwd=ROOT, capture_output=True, text=True, timeout=300, env=MPI_ENVIRONMENT)
    assert result.returncode == 2, result.stdout[-3000:] + result.stderr[-3000:]
    errors = [line for line in result.stderr.splitlines() if "main.py: error" in line]
    assert errors == ["main.py: error: mpirun started 2 processes (OMPI_COMM_WORLD_SIZE=2) but Horovod formed a "
                      "world of 1 (this process: launcher rank 0, Horovod rank 0): Horovod did not use MPI "
                      "(HOROVOD_CONTROLLER=gloo); unset HOROVOD_CONTROLLER and HOROVOD_CPU_OPERATIONS under "
                      "mpirun"], result.stderr[-3000:]
    assert not model_dir.exists()


# Each launcher runs tests.distributed_rank's two ranks: synchronised updates, then the records of one file.
LAUNCHED_RANKS = {
    "horovodrun --gloo": lambda *command: horovodrun(*command),
    "mpirun": lambda *command: mpirun(*command),
}


@pytest.fixture(scope="module")
def one_process_updates(tmp_path_factory):
    """updated(initial, steps): sync_config's model after `steps` updates on the combined batch in one process
    from the weights `initial` (list in trainable_variables order), as {variable path: array}: the reference
    of the two-rank jobs."""
    trainer = trainer_for(sync_config(2, seed=1, model_dir=str(tmp_path_factory.mktemp("single"))))
    batch = combined_batch()
    trainer.build()
    update = trainer.update_function()
    # Each call starts where a new run does: optimizer slots, iterations and step as built.
    state = [*trainer.optimizer.variables, trainer.step]
    at_start = [variable.numpy() for variable in state]

    def updated(initial, steps):
        for variable, value in zip([*trainer.model.trainable_variables, *state], [*initial, *at_start]):
            variable.assign(value)
        for _ in range(steps):
            update([batch])
        return {variable.path: variable.numpy() for variable in trainer.model.trainable_variables}

    return updated


@pytest.mark.timeout(300)  # a job of two ranks, then the same steps in this process
@pytest.mark.slow
@pytest.mark.xdist_group("one_process_updates")  # one worker builds the reference for both launchers
@pytest.mark.parametrize("launcher", LAUNCHED_RANKS)
def test_two_ranks_stay_identical_equal_one_process_and_share_a_files_records(launcher, tmp_path, shapes_records,
                                                                              one_process_updates):
    steps, draws = 3, 20  # draws: several passes over each rank's share of the records, in its shuffled order
    (path,) = tf.io.gfile.glob(shapes_records["val"])  # one file of 5 records: 3 for rank 0, 2 for rank 1
    result = subprocess.run(LAUNCHED_RANKS[launcher](sys.executable, "-m", "tests.distributed_rank", str(tmp_path),
                                                     str(steps), path, str(draws)),
                            cwd=ROOT, capture_output=True, text=True, timeout=600, env=MPI_ENVIRONMENT)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    ranks = [np.load(tmp_path / f"rank{r}.npz") for r in (0, 1)]
    count = len([k for k in ranks[0].files if k.startswith("initial_")])
    # Seeded differently, the ranks start from rank 0's weights (the broadcast) and end identical (the
    # allreduce hands both the same average).
    for i in range(count):
        np.testing.assert_array_equal(ranks[1][f"initial_{i}"], ranks[0][f"initial_{i}"])
        np.testing.assert_array_equal(ranks[1][f"final_{i}"], ranks[0][f"final_{i}"])
    # One process with both images per step, from the same start, makes the same updates.
    expected = one_process_updates([ranks[0][f"initial_{i}"] for i in range(count)], steps)
    moved = 0
    for i, (path_, value) in enumerate(expected.items()):
        # atol: with oneDNN's kernels (TF_ENABLE_ONEDNN_OPTS=1) convolution gradients sum a batch of 2 in
        # another order than two batches of 1 (a few weights differ by 2e-6); the typical update is 6e-4.
        np.testing.assert_allclose(ranks[0][f"final_{i}"], value, rtol=1e-4, atol=1e-5, err_msg=path_)
        moved += not np.allclose(ranks[0][f"initial_{i}"], value)
    assert moved > count // 2  # the updates changed the weights: the comparison is not of the start
    # The records of one file: rank 0 says that the ranks share records, and their shares are disjoint and
    # complete.
    assert result.stdout.count("keeps 1 record in 2") == 1, result.stdout[-3000:]
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


@pytest.mark.timeout(300)  # a horovodrun job of two ranks, with the test's own deadline of 240 s
@pytest.mark.slow
def test_sigterm_to_one_rank_stops_every_rank_after_the_same_update_with_rank_0s_checkpoint(tmp_path, shapes_records):
    job = train_under_horovodrun(tmp_path, shapes_records["data_dir"], "--steps_per_epoch", "50", "--epochs", "1",
                                 "--checkpoint_every", "100")
    lines = lines_until(job, "[train] step 2/50", 240)
    # Rank 1, which writes nothing: without the ranks' agreement rank 0 would wait for it in the next update
    # until the launcher ended the job, and write no checkpoint.
    rank_process(job, 1).send_signal(signal.SIGTERM)
    try:
        output = "".join(lines) + job.communicate(timeout=120)[0]
    except subprocess.TimeoutExpired:
        os.killpg(job.pid, signal.SIGKILL)
        pytest.fail("the job did not stop within 120 s of the signal")
    assert "exit with status code 143" in output, output[-3000:]
    log = read_log(tmp_path / "log.jsonl")
    (stopped,) = [r for r in log if r["event"] == "stopped"]
    step = stopped["step"]
    assert 2 <= step < 50 and stopped["reason"].startswith("SIGTERM; checkpoint of step"), stopped
    assert [r["step"] for r in log if r["event"] == "metrics"] == list(range(1, step + 1))
    assert [r["step"] for r in log if r["event"] == "checkpoint"] == [step]
    assert tf.train.latest_checkpoint(str(tmp_path)).endswith(f"ckpt-{step}")


@pytest.mark.timeout(600)  # two mpirun jobs of two ranks (train with evaluation, eval), one evaluation here
@pytest.mark.slow
def test_mpirun_trains_one_model_and_two_ranks_evaluate_it_as_one_process_does(tmp_path, shapes_records):
    data = ["--data_dir", shapes_records["data_dir"], "--eval_file", shapes_records["val_json"]]
    # Targets any model meets: the first evaluation (end of epoch 1, step 3) stops the job, on both ranks.
    command = mpirun(*main_py("train", *data, "--model_dir", tmp_path, *SMALL_FLAGS, "--train_batch_size", "1",
                              "--steps_per_epoch", "3", "--epochs", "2", "--checkpoint_every", "1", "--log_every", "1",
                              "--min_bbox_map", "0", "--min_mask_map", "0"))
    train = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=600, env=MPI_ENVIRONMENT)
    assert train.returncode == 0, train.stdout[-3000:] + train.stderr[-3000:]
    # One job: a global batch of 2, rank 0 alone logging and writing checkpoints, every step once.
    log = read_log(tmp_path / "log.jsonl")
    (start,) = [r for r in log if r["event"] == "start"]
    assert start["global_batch_size"] == 2
    assert [r["step"] for r in log if r["event"] == "metrics"] == [1, 2, 3]
    assert [r["step"] for r in log if r["event"] == "done"] == [3]
    assert train.stdout.count("[train] step 3/6") == 1 and "target reached" in train.stdout
    assert sorted(p.name for p in tmp_path.glob("ckpt-*.index")) == ["ckpt-1.index", "ckpt-2.index", "ckpt-3.index"]
    (during_training,) = [r for r in log if r["event"] == "eval"]
    assert during_training["step"] == 3 and during_training["eval_images"] == 5  # both ranks' shares: 3 + 2
    # The same job again: step 3 met the targets, so both ranks end without training.
    again = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=600, env=MPI_ENVIRONMENT)
    assert again.returncode == 0, again.stdout[-3000:] + again.stderr[-3000:]
    assert "target reached step 3" in again.stdout and "[train] step 4/6" not in again.stdout
    assert [r["step"] for r in read_log(tmp_path / "log.jsonl") if r["event"] == "done"] == [3, 3]

    evaluate = subprocess.run(mpirun(*main_py("eval", *data, "--model_dir", tmp_path, "--eval_batch_size", "2")),
                              cwd=ROOT, capture_output=True, text=True, timeout=600, env=MPI_ENVIRONMENT)
    assert evaluate.returncode == 0, evaluate.stdout[-3000:] + evaluate.stderr[-3000:]
    assert evaluate.stdout.count("[eval] 5 images") == 1  # rank 0 alone reports
    two_ranks = json.loads((tmp_path / "eval_results.json").read_text())
    two_ranks_detections = json.loads((tmp_path / "detections.json").read_text())
    assert two_ranks["num_images"] == 5 and two_ranks["step"] == 3
    # One process on the same checkpoint and records: the same COCO statistics, and the same detections in
    # the same order (batches of 2 pair other images on 2 ranks, so scores agree to float32 rounding).
    assert run_main(["eval", *data, "--model_dir", tmp_path, "--eval_batch_size", "2"]) == 0
    one = json.loads((tmp_path / "eval_results.json").read_text())
    one_detections = json.loads((tmp_path / "detections.json").read_text())
    assert len(one_detections) == len(two_ranks_detections) > 0
    for mine, theirs in zip(two_ranks_detections, one_detections):
        assert (mine["image_id"], mine["category_id"]) == (theirs["image_id"], theirs["category_id"])
        np.testing.assert_allclose(mine["bbox"] + [mine["score"]], theirs["bbox"] + [theirs["score"]], atol=1e-3)
    for key, value in one["metrics"].items():
        assert two_ranks["metrics"][key] == pytest.approx(value, abs=1e-6), key
        assert during_training[key] == pytest.approx(value, abs=1e-6), key


@pytest.mark.timeout(300)  # a horovodrun job of two ranks
@pytest.mark.slow
def test_benchmark_under_horovodrun_with_mpi_reports_total_and_per_worker_throughput(tmp_path, shapes_records):
    result = subprocess.run(
        horovodrun(*main_py("train", "--data_dir", shapes_records["data_dir"], "--model_dir", str(tmp_path),
                            *SMALL_FLAGS, "--train_batch_size", "1", "--benchmark", "--benchmark_steps", "3",
                            "--use_synthetic_data"), controller="--mpi"),
        cwd=ROOT, capture_output=True, text=True, timeout=600, env=MPI_ENVIRONMENT)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    lines = result.stdout.splitlines()
    (total,) = [line for line in lines if "train throughput:" in line]
    (per_worker,) = [line for line in lines if "train per-worker throughput:" in line]
    assert "over 2 workers" in per_worker
    total_rate = float(total.split("train throughput:")[1].split()[0])
    mean_rate = float(per_worker.split("train per-worker throughput:")[1].split()[0])
    # Steps are synchronised: each worker does about half of the job's images per second.
    assert mean_rate == pytest.approx(total_rate / 2, rel=0.2)
