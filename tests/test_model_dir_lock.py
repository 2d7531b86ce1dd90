"""One trainer per model directory (mrcnn_tf2/runtime/model_dir_lock.py): the lock's content and release, a live
holder refused, a gone one (dead, its pid reused, the host restarted) taken over, another host's lock refused
unless --break_lock, a file that is not a lock left as it is, takers racing for one stale lock, rank 0 alone
taking it under Horovod; then `main.py train` refused beside a running trainer and taking over from a killed
one, and `main.py eval` ignoring the lock."""

import errno
import fcntl
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time

import pytest

from mrcnn_tf2 import status
from mrcnn_tf2.config import ConfigError
from mrcnn_tf2.runtime import model_dir_lock
from mrcnn_tf2.runtime.model_dir_lock import LOCK_FILE, ModelDirLocked, acquire, hold
from tests.support import ROOT, SMALL_FLAGS, main_py, read_log, run_main

HOLDER_COMMAND = ["main.py", "train", "--model_dir", "/somewhere"]


@pytest.fixture
def sleeper():
    """A live child process (the holder of a lock), killed at the end."""
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        yield child
    finally:
        child.kill()
        child.wait()


def write_lock(model_dir, pid, **fields):
    """Writes <model_dir>/train.lock as a trainer `pid` of this host would (`fields` change it); returns its
    bytes."""
    record = {"host": socket.gethostname(), "pid": pid, "started": "2026-01-02T03:04:05Z",
              "boot_id": model_dir_lock.boot_id(), "start_ticks": model_dir_lock.start_ticks(pid),
              "pid_namespace": model_dir_lock.pid_namespace(), "command": HOLDER_COMMAND}
    record.update(fields)
    data = json.dumps(record).encode()
    os.makedirs(model_dir, exist_ok=True)
    (model_dir / LOCK_FILE).write_bytes(data)
    return data


def lock_record(model_dir):
    return json.loads((model_dir / LOCK_FILE).read_text())


# -- the module -------------------------------------------------------------------------------------------------

def test_the_lock_names_this_process_and_goes_when_released(tmp_path):
    model_dir = tmp_path / "new" / "model"  # made if missing
    with hold(str(model_dir), argv=["main.py", "train"]) as lock:
        record = lock_record(model_dir)
        assert lock.record == record
        assert record["host"] == socket.gethostname() and record["pid"] == os.getpid()
        assert re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\dZ", record["started"])
        assert record["boot_id"] == open("/proc/sys/kernel/random/boot_id").read().strip()
        # Field 22 of /proc/<pid>/stat, counted after the command name.
        assert record["start_ticks"] == int(open(f"/proc/{os.getpid()}/stat").read().rsplit(")", 1)[1].split()[19])
        assert record["command"] == ["main.py", "train"]
        assert os.listdir(model_dir) == [LOCK_FILE]  # no temporary file left beside it
    assert os.listdir(model_dir) == []


def test_start_ticks_reads_past_a_command_name_with_spaces_and_parentheses(tmp_path):
    script = tmp_path / "a b) c (d"
    shutil.copy(sys.executable, script)
    child = subprocess.Popen([str(script), "-c", "import time; time.sleep(60)"])
    try:
        deadline = time.time() + 10
        while "a b) c" not in open(f"/proc/{child.pid}/stat").read():  # the exec has happened
            assert time.time() < deadline
            time.sleep(0.01)
        stat = open(f"/proc/{child.pid}/stat").read()
        assert model_dir_lock.start_ticks(child.pid) == int(stat.rsplit(")", 1)[1].split()[19])
    finally:
        child.kill()
        child.wait()


@pytest.mark.parametrize("break_lock", [False, True])
def test_a_live_holder_on_this_host_is_refused_even_with_break_lock(tmp_path, sleeper, break_lock):
    data = write_lock(tmp_path, sleeper.pid)
    with pytest.raises(ModelDirLocked) as refused:
        acquire(str(tmp_path), break_lock=break_lock)
    message = str(refused.value)
    assert isinstance(refused.value, ConfigError) and "\n" not in message
    assert f"is being trained by pid {sleeper.pid} on this host since 2026-01-02T03:04:05Z" in message
    assert f"(main.py train --model_dir /somewhere; lock file {tmp_path / LOCK_FILE})" in message
    assert message.endswith("wait for it, or stop it" + (" (--break_lock does not break the lock of a live "
                                                          "process of this host)" if break_lock else ""))
    assert (tmp_path / LOCK_FILE).read_bytes() == data and os.listdir(tmp_path) == [LOCK_FILE]


def test_the_lock_of_a_holder_that_died_is_taken_over(tmp_path, sleeper, capsys):
    write_lock(tmp_path, sleeper.pid)
    sleeper.kill()
    sleeper.wait()
    with hold(str(tmp_path)):
        assert lock_record(tmp_path)["pid"] == os.getpid()
    out = capsys.readouterr().out
    assert out == (f"[train] {tmp_path}: took over the lock of pid {sleeper.pid} on this host (started "
                   "2026-01-02T03:04:05Z), which is no longer running (its pid does not exist)\n")
    assert os.listdir(tmp_path) == []


@pytest.mark.parametrize("fields, why", [
    (lambda pid: dict(start_ticks=model_dir_lock.start_ticks(pid) - 1), "its pid now belongs to a newer process"),
    (lambda pid: dict(boot_id="00000000-0000-0000-0000-000000000000"), "this host has restarted since"),
], ids=["reused pid", "restarted host"])
def test_a_reused_pid_or_a_restarted_host_is_stale(tmp_path, sleeper, capsys, fields, why):
    write_lock(tmp_path, sleeper.pid, **fields(sleeper.pid))  # the sleeper runs, but is not the holder
    with hold(str(tmp_path)):
        assert lock_record(tmp_path)["pid"] == os.getpid()
    assert capsys.readouterr().out == (f"[train] {tmp_path}: took over the lock of pid {sleeper.pid} on this host "
                                       f"(started 2026-01-02T03:04:05Z), which is no longer running ({why})\n")


def test_another_hosts_lock_is_refused_unless_broken(tmp_path, capsys):
    data = write_lock(tmp_path, 4242, host="gpu-node-7", boot_id="theirs", start_ticks=5)
    with pytest.raises(ModelDirLocked) as refused:
        acquire(str(tmp_path))
    assert str(refused.value) == (
        f"--model_dir: {tmp_path} is being trained by pid 4242 on host gpu-node-7 since 2026-01-02T03:04:05Z "
        f"(main.py train --model_dir /somewhere; lock file {tmp_path / LOCK_FILE}); if that training is no longer "
        "running, pass --break_lock")
    assert (tmp_path / LOCK_FILE).read_bytes() == data
    with hold(str(tmp_path), break_lock=True):
        assert lock_record(tmp_path)["pid"] == os.getpid()
    assert capsys.readouterr().out == (
        "[train] --break_lock: broke the lock of pid 4242 on host gpu-node-7 (started 2026-01-02T03:04:05Z; "
        f"main.py train --model_dir /somewhere; lock file {tmp_path / LOCK_FILE})\n")


def test_another_pid_namespace_of_this_host_is_not_judged_from_here(tmp_path, sleeper):
    # A container of this machine with the same host name: its pids are not ours (the sleeper's is just a live one).
    write_lock(tmp_path, sleeper.pid, pid_namespace="pid:[1]")
    with pytest.raises(ModelDirLocked, match=r"on this host \(another container of this host\).*--break_lock"):
        acquire(str(tmp_path))


@pytest.mark.parametrize("data, what", [
    (b"\x00\x01garbage", "not JSON"),
    (b"", "empty"),
    (b"[1, 2]", "not a JSON object"),
    (b'{"pid": 12}', "no host"),
    (b'{"host": "h", "pid": "12"}', "pid '12' is not a process id"),
])
def test_a_file_that_is_not_a_lock_is_left_as_it_is_unless_broken(tmp_path, capsys, data, what):
    (tmp_path / LOCK_FILE).write_bytes(data)
    with pytest.raises(ModelDirLocked) as refused:
        acquire(str(tmp_path))
    assert str(refused.value) == (f"--model_dir: {tmp_path / LOCK_FILE} is not a training lock ({what}); it was "
                                  "left as it is: remove it, or pass --break_lock to replace it")
    assert (tmp_path / LOCK_FILE).read_bytes() == data and os.listdir(tmp_path) == [LOCK_FILE]
    with hold(str(tmp_path), break_lock=True):
        assert lock_record(tmp_path)["pid"] == os.getpid()
    assert capsys.readouterr().out == (f"[train] --break_lock: replaced {tmp_path / LOCK_FILE}, which was not a "
                                       f"training lock ({what})\n")


@pytest.mark.parametrize("error", [RuntimeError, KeyboardInterrupt])
def test_the_lock_is_released_when_the_run_raises(tmp_path, error):
    with pytest.raises(error):
        with hold(str(tmp_path)):
            raise error("stop")
    assert os.listdir(tmp_path) == []


def test_release_leaves_a_lock_that_is_no_longer_ours(tmp_path):
    lock = acquire(str(tmp_path))
    theirs = write_lock(tmp_path, 4242, host="gpu-node-7")  # another host broke ours and took it
    assert lock.release() is False
    assert (tmp_path / LOCK_FILE).read_bytes() == theirs and os.listdir(tmp_path) == [LOCK_FILE]


def test_a_lock_replaced_after_it_was_judged_is_put_back(tmp_path):
    # A taker judged `stale` gone, but another taker replaced it with its own lock first: removing `stale`
    # must not remove the newer lock.
    stale = write_lock(tmp_path, 4242, start_ticks=0)
    newer = write_lock(tmp_path, os.getpid())
    assert model_dir_lock._remove_if(str(tmp_path / LOCK_FILE), stale) is False
    assert (tmp_path / LOCK_FILE).read_bytes() == newer and os.listdir(tmp_path) == [LOCK_FILE]
    assert model_dir_lock._remove_if(str(tmp_path / LOCK_FILE), newer) is True
    assert os.listdir(tmp_path) == []


def test_on_a_file_system_without_hard_links_the_lock_is_created_exclusively(tmp_path, monkeypatch):
    def no_link(source, target):
        raise PermissionError(1, "Operation not permitted")

    monkeypatch.setattr(os, "link", no_link)
    with hold(str(tmp_path)):
        assert lock_record(tmp_path)["pid"] == os.getpid()
        with pytest.raises(ModelDirLocked, match=f"pid {os.getpid()} on this host"):
            acquire(str(tmp_path))
        assert os.listdir(tmp_path) == [LOCK_FILE]
    assert os.listdir(tmp_path) == []


def no_flock(fd, operation):
    raise OSError(errno.ENOLCK, "No locks available")  # as on a file system without flock


def test_a_taker_leaves_alone_the_lock_another_took_over_after_it_judged_the_stale_one(tmp_path, sleeper,
                                                                                        monkeypatch):
    # Unguarded (no flock), the takeover protocol alone: another trainer takes over between this one's judging
    # and its removing the stale lock.
    monkeypatch.setattr(model_dir_lock.fcntl, "flock", no_flock)
    write_lock(tmp_path, sleeper.pid, start_ticks=0)  # a reused pid: stale
    judge, calls = model_dir_lock._judge_or_refuse, []

    def judge_then_the_other_takes_over(*args):
        calls.append(args)
        notice = judge(*args)
        if len(calls) == 1:  # this trainer has judged the stale lock: the other takes it over now
            acquire(str(tmp_path), argv=["the other trainer"])
        return notice

    monkeypatch.setattr(model_dir_lock, "_judge_or_refuse", judge_then_the_other_takes_over)
    # The other trainer runs in this process: its lock names a live pid of this host.
    with pytest.raises(ModelDirLocked, match=f"pid {os.getpid()} on this host .*the other trainer"):
        acquire(str(tmp_path), argv=["this trainer"])
    assert lock_record(tmp_path)["command"] == ["the other trainer"] and os.listdir(tmp_path) == [LOCK_FILE]


TAKER = """
import sys, time
from mrcnn_tf2.runtime import model_dir_lock
time.sleep(max(0.0, float(sys.argv[2]) - time.time()))
try:
    lock = model_dir_lock.acquire(sys.argv[1])
except model_dir_lock.ModelDirLocked:
    print("refused", flush=True)
else:
    print("holds", flush=True)
    sys.stdin.read()  # runs, holding the lock, until the test has every verdict
    lock.release()
"""


def test_of_trainers_taking_over_one_stale_lock_at_once_exactly_one_holds_it(tmp_path, sleeper):
    write_lock(tmp_path, sleeper.pid, start_ticks=0)  # a reused pid: stale
    start = time.time() + 0.5  # the takers start together, once Python has started in each
    takers = [subprocess.Popen([sys.executable, "-c", TAKER, str(tmp_path), str(start)], cwd=ROOT,
                               stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True) for _ in range(6)]
    outputs = []
    for taker in takers:
        lines = []
        while not lines or lines[-1] not in ("holds\n", "refused\n", ""):
            lines.append(taker.stdout.readline())
        outputs.append("".join(lines))
    for taker in takers:
        taker.stdin.close()
        taker.wait(timeout=60)
    assert all(taker.returncode == 0 for taker in takers), outputs
    assert sorted(output.splitlines()[-1] for output in outputs) == ["holds"] + ["refused"] * 5, outputs
    # The holder says it took over, unless it found the lock already moved aside by a taker it then outran.
    assert "".join(outputs).count(f"took over the lock of pid {sleeper.pid}") <= 1, outputs
    assert os.listdir(tmp_path) == []


def test_a_stale_lock_is_judged_and_replaced_under_a_flock_on_the_directory(tmp_path, sleeper, monkeypatch):
    write_lock(tmp_path, sleeper.pid, start_ticks=0)  # a reused pid: stale
    judge, guarded = model_dir_lock._judge_or_refuse, []

    def judge_while_another_tries_the_flock(*args):
        other = os.open(tmp_path, os.O_RDONLY)  # another open file description, as in another process
        try:
            fcntl.flock(other, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            guarded.append(True)
        finally:
            os.close(other)
        return judge(*args)

    monkeypatch.setattr(model_dir_lock, "_judge_or_refuse", judge_while_another_tries_the_flock)
    with hold(str(tmp_path)):
        assert lock_record(tmp_path)["pid"] == os.getpid()
    assert guarded == [True] and os.listdir(tmp_path) == []


def test_a_process_stopped_while_changing_the_lock_file_is_named_after_the_guards_timeout(tmp_path, monkeypatch):
    monkeypatch.setattr(model_dir_lock, "GUARD_TIMEOUT_S", 0.2)
    guard = os.open(tmp_path, os.O_RDONLY)  # another open file description: a flock of "another process"
    try:
        fcntl.flock(guard, fcntl.LOCK_EX)
        with pytest.raises(ModelDirLocked, match=f"^--model_dir: {tmp_path}: another process has been changing "
                                                 f"train.lock for 0.2 s .*Ctrl-Z"):
            acquire(str(tmp_path))
        assert os.listdir(tmp_path) == []
    finally:
        os.close(guard)
    with hold(str(tmp_path)):  # the flock gone with its holder
        assert os.listdir(tmp_path) == [LOCK_FILE]


def test_the_module_imports_without_tensorflow():
    code = "import sys, mrcnn_tf2.runtime.model_dir_lock; print('tensorflow' in sys.modules)"
    result = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert result.stdout == "False\n", result.stderr


def test_break_lock_is_a_flag_of_one_command(tmp_path):
    from mrcnn_tf2.arguments import parse

    _, config = parse(["train", "--model_dir", str(tmp_path), "--break_lock"])
    assert config.runtime.break_lock is True
    config.save(str(tmp_path))  # as the run that broke a lock saves its config
    assert parse(["train", "--model_dir", str(tmp_path)])[1].runtime.break_lock is False  # the next run does not


# -- train.run under Horovod: rank 0 alone takes the lock, every rank stops when it cannot ------------------------

class FakeWorld:
    """A rank of a job of two; `broadcast_object` records what it is given and returns rank 0's object."""

    size = 2

    def __init__(self, rank, from_rank_0=None):
        self.rank, self.from_rank_0, self.sent = rank, from_rank_0, []

    @property
    def is_chief(self):
        return self.rank == 0

    def broadcast_object(self, obj):
        self.sent.append(obj)
        return obj if self.rank == 0 else self.from_rank_0


@pytest.fixture
def train_runtime(monkeypatch):
    """runtime.train with a Trainer whose run() records whether the lock was held."""
    from mrcnn_tf2.runtime import train

    class Trainer:
        runs = []

        def __init__(self, config, world):
            self.config = config

        def run(self):
            path = os.path.join(self.config.runtime.model_dir, LOCK_FILE)
            Trainer.runs.append(os.path.exists(path) and json.load(open(path))["pid"] == os.getpid())
            return status.OK

    monkeypatch.setattr(train, "Trainer", Trainer)
    return train


def config_of(model_dir):
    from mrcnn_tf2.arguments import parse

    return parse(["train", "--model_dir", str(model_dir)])[1]


def test_rank_0_trains_holding_the_lock_and_releases_it(tmp_path, train_runtime):
    world = FakeWorld(rank=0)
    assert train_runtime.run(config_of(tmp_path), world) == status.OK
    assert train_runtime.Trainer.runs == [True] and world.sent == [None]
    assert not (tmp_path / LOCK_FILE).exists()


def test_rank_0_refused_raises_and_tells_the_other_ranks(tmp_path, train_runtime, sleeper):
    data = write_lock(tmp_path, sleeper.pid)
    world = FakeWorld(rank=0)
    with pytest.raises(ModelDirLocked, match=f"pid {sleeper.pid}"):
        train_runtime.run(config_of(tmp_path), world)
    assert len(world.sent) == 1 and f"pid {sleeper.pid}" in world.sent[0]
    assert train_runtime.Trainer.runs == [] and (tmp_path / LOCK_FILE).read_bytes() == data


def test_other_ranks_take_no_lock_and_stop_with_status_2_when_rank_0_was_refused(tmp_path, train_runtime,
                                                                                 monkeypatch, capsys):
    data = write_lock(tmp_path, 4242, host="gpu-node-7")  # rank 1 must not even judge it
    world = FakeWorld(rank=1, from_rank_0="--model_dir: refused")
    assert train_runtime.run(config_of(tmp_path), world) == status.BAD_INPUT
    assert train_runtime.Trainer.runs == [] and (tmp_path / LOCK_FILE).read_bytes() == data
    assert capsys.readouterr().err == ""  # rank 0 alone says why
    # When rank 0 holds the lock, rank 1 trains without touching it.
    world = FakeWorld(rank=1, from_rank_0=None)
    assert train_runtime.run(config_of(tmp_path), world) == status.OK
    assert train_runtime.Trainer.runs == [False] and (tmp_path / LOCK_FILE).read_bytes() == data


# -- main.py ----------------------------------------------------------------------------------------------------

def snapshot(directory):
    """{name: (size, mtime_ns)} of the files in `directory`."""
    return {entry.name: (entry.stat().st_size, entry.stat().st_mtime_ns) for entry in os.scandir(directory)}


def latest_step(model_dir):
    """The step of the newest checkpoint that model_dir's `checkpoint` file names."""
    text = (model_dir / "checkpoint").read_text()
    return int(re.search(r'^model_checkpoint_path: "ckpt-(\d+)"', text, re.MULTILINE).group(1))


@pytest.mark.timeout(300)  # three `main.py train` processes (one refused at start-up) on a 2-core machine
@pytest.mark.slow
def test_a_second_trainer_is_refused_and_a_killed_ones_lock_is_taken_over(tmp_path, shapes_records):
    model_dir = tmp_path / "model"
    command = main_py("train", "--data_dir", shapes_records["data_dir"], "--model_dir", model_dir, *SMALL_FLAGS,
                      "--train_batch_size", "1", "--steps_per_epoch", "4", "--epochs", "2",
                      "--checkpoint_every", "1", "--log_every", "1")
    with open(tmp_path / "a.out", "w") as a_out:
        a = subprocess.Popen(command, cwd=ROOT, stdout=a_out, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        deadline = time.time() + 150
        while not (model_dir / "ckpt-2.index").exists():
            assert a.poll() is None, (tmp_path / "a.out").read_text()
            assert time.time() < deadline, "no checkpoint 2 within 150 s"
            time.sleep(0.1)
        # Stopped, trainer A is still alive (and holds the lock), but cannot finish before B starts.
        os.kill(a.pid, signal.SIGSTOP)
        before = snapshot(model_dir)
        # As a user runs it: conftest's TF_CPP_MIN_LOG_LEVEL would count as the user's and show TensorFlow's
        # start-up lines (cli.set_tensorflow_environment).
        environment = {name: value for name, value in os.environ.items() if name != "TF_CPP_MIN_LOG_LEVEL"}
        b = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=120, env=environment)
        assert b.returncode == status.BAD_INPUT, b.stderr
        (line,) = b.stderr.strip().splitlines()
        assert line.startswith(f"main.py: error: --model_dir: {model_dir} is being trained by pid {a.pid} on this "
                               "host since ")
        assert f"lock file {model_dir / LOCK_FILE}" in line and "wait for it, or stop it" in line
        assert snapshot(model_dir) == before  # B wrote nothing
    finally:
        os.kill(a.pid, signal.SIGKILL)  # as SIGKILL leaves it: its lock stays behind
        a.wait()
    assert lock_record(model_dir)["pid"] == a.pid
    step = latest_step(model_dir)
    c = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=200)
    assert c.returncode == 0, c.stderr[-3000:]
    assert f"took over the lock of pid {a.pid} on this host" in c.stdout
    log = read_log(model_dir / "log.jsonl")
    resumed = [r for r in log if r["event"] == "resumed"][-1]
    assert resumed["step"] == step
    assert [r["step"] for r in log[log.index(resumed):] if r["event"] == "metrics"] == list(range(step + 1, 9))
    assert latest_step(model_dir) == 8
    assert not (model_dir / LOCK_FILE).exists()


@pytest.mark.slow
def test_eval_takes_no_lock_and_leaves_a_trainers_lock_alone(tmp_path, trained_model, shapes_records):
    model_dir = tmp_path / "model"
    shutil.copytree(trained_model, model_dir)
    data = write_lock(model_dir, 4242, host="gpu-node-7")
    assert run_main(["eval", "--model_dir", model_dir, "--data_dir", shapes_records["data_dir"],
                     "--eval_file", shapes_records["val_json"], "--eval_samples", "1"]) == 0
    assert (model_dir / LOCK_FILE).read_bytes() == data
