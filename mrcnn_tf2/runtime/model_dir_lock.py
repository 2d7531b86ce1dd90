"""One trainer per model directory: `<model_dir>/train.lock`, held by the training process for its run.

Two `main.py train` runs on one model_dir (two terminals, a re-submitted cluster job) would both resume from
the same checkpoint and overwrite each other's checkpoints and log. The first takes the lock; a second is
refused with one line naming the holder, unless the holder is gone:

- held by a live process of this host: refused (the user waits for it, or stops it);
- held by a process of this host that is gone (its pid no longer exists, belongs to a newer process, or the
  machine has restarted since): taken over, with a one-line notice;
- held on another host, whose processes cannot be seen from here: refused, unless `break_lock`;
- a file that is not such a lock: refused naming it and left as it is, unless `break_lock`, which replaces it.

The lock is a small JSON file: host, pid, start time, and what tells a live holder from a dead one on Linux
(the kernel's boot id, the process's start time in clock ticks since boot, its pid namespace), and the
command line, for the user. It is removed when the run ends in any way the process controls (a return, an
exception, Ctrl-C) and only while it is still this process's own; after a SIGKILL it stays behind and the
next run on this host takes it over as stale. Changes to the file (taking, taking over, releasing) are made under
a flock on model_dir, so that trainers racing for it at once cannot both win (`_guarded`).

Only training takes it: eval, infer and export read model_dir and run beside a trainer.
This module imports neither TensorFlow nor anything that does (`mrcnn_tf2.config` and `files` do not).
"""

import contextlib
import datetime
import errno
import fcntl
import json
import os
import shlex
import socket
import sys
import time
import uuid

from mrcnn_tf2 import files
from mrcnn_tf2.config import ConfigError

LOCK_FILE = "train.lock"
# Fields a lock must hold to be judged; the others (boot_id, start_ticks, pid_namespace, started, command)
# may be missing (e.g. written on a system without /proc), and are then not compared.
REQUIRED_FIELDS = ("host", "pid")
# Takeovers tried before giving up, each after another trainer changed the lock under this one: two rounds
# settle any race between new trainers, the rest is margin.
ATTEMPTS = 5
# os.link's errors on file systems without hard links (FAT, some network and FUSE file systems).
NO_HARD_LINKS = (errno.EPERM, errno.EOPNOTSUPP, errno.ENOTSUP, errno.ENOSYS)
# How long a trainer waits for another process's change of the lock file (each takes microseconds) before it
# gives up: only a process stopped in the middle of one (Ctrl-Z, a debugger) holds the guard that long.
GUARD_TIMEOUT_S = 30.0


class ModelDirLocked(ConfigError):
    """model_dir's lock is held by another trainer (or is not a lock): the message says by whom and what to do.

    A ConfigError on '--model_dir', so that `main.py` prints it as one line and exits with status 2.
    """

    def __init__(self, message: str):
        super().__init__("--model_dir", message)


# -- who is running ---------------------------------------------------------------------------------------------

def _read_text(path):
    try:
        with open(path) as f:
            return f.read()
    except OSError:
        return None


def boot_id():
    """The kernel's boot id (a new one at every boot), or None where /proc does not give it (not Linux)."""
    text = _read_text("/proc/sys/kernel/random/boot_id")
    return text.strip() if text else None


def start_ticks(pid):
    """When process `pid` started, in clock ticks since boot (field 22 of /proc/<pid>/stat), or None when
    there is no such process or no /proc. With the boot id it names one process: a reused pid has a later
    start."""
    text = _read_text(f"/proc/{int(pid)}/stat")
    if not text:
        return None
    # Field 2, the command name in parentheses, may hold spaces and ')': the fields after it follow the last ')'.
    # That tail starts at field 3, so field 22 is its 20th word.
    fields = text.rpartition(")")[2].split()
    try:
        return int(fields[22 - 3])
    except (IndexError, ValueError):
        return None


def pid_namespace():
    """This process's pid namespace ('pid:[4026531836]'), or None without /proc. Two containers of one machine
    may share its host name and boot id, but not their pids."""
    try:
        return os.readlink("/proc/self/ns/pid")
    except OSError:
        return None


def own_record(argv=None):
    """The lock's content for this process: {host, pid, started (ISO 8601 UTC), boot_id, start_ticks,
    pid_namespace, command (argv, default sys.argv)}."""
    now = datetime.datetime.now(datetime.timezone.utc)
    return {
        "host": socket.gethostname(),
        "pid": os.getpid(),
        "started": now.strftime("%Y-%m-%dT%H:%M:%SZ"),
        "boot_id": boot_id(),
        "start_ticks": start_ticks(os.getpid()),
        "pid_namespace": pid_namespace(),
        "command": list(sys.argv if argv is None else argv),
    }


def parse_record(data: bytes):
    """The lock record of the file content `data`, or a string saying why it is not one."""
    try:
        record = json.loads(data.decode("utf-8"))
    except (UnicodeDecodeError, ValueError):
        return "not JSON" if data.strip() else "empty"
    if not isinstance(record, dict):
        return "not a JSON object"
    missing = [name for name in REQUIRED_FIELDS if name not in record]
    if missing:
        return f"no {' or '.join(missing)}"
    if not isinstance(record["pid"], int) or isinstance(record["pid"], bool) or record["pid"] <= 0:
        return f"pid {record['pid']!r} is not a process id"
    return record


def judge(record):
    """Whether the holder of `record` runs: ('alive', ''), ('gone', why) or ('elsewhere', why), where
    'elsewhere' is a process this one cannot see (another host, or another pid namespace of this one)."""
    if record["host"] != socket.gethostname():
        return "elsewhere", "another host"
    recorded_boot, recorded_ticks = record.get("boot_id"), record.get("start_ticks")
    if recorded_boot and boot_id() and recorded_boot != boot_id():
        return "gone", "this host has restarted since"
    recorded_namespace = record.get("pid_namespace")
    if recorded_namespace and pid_namespace() and recorded_namespace != pid_namespace():
        return "elsewhere", "another container of this host"
    ticks = start_ticks(record["pid"])
    if ticks is None and boot_id() is not None:  # Linux: /proc lists every process of this namespace
        return "gone", "its pid does not exist"
    if ticks is None:  # no /proc: a pid that exists is taken to be the holder
        return ("alive", "") if files.pid_running(record["pid"]) else ("gone", "its pid does not exist")
    if recorded_ticks is not None and ticks != recorded_ticks:
        return "gone", "its pid now belongs to a newer process"
    return "alive", ""


def _command(record):
    command = record.get("command")
    if isinstance(command, list):
        return shlex.join(str(word) for word in command)
    return str(command) if command else "command unknown"


# -- the file ---------------------------------------------------------------------------------------------------

def _create(path, data):
    """Creates `path` holding `data`, atomically: True, or False when `path` exists. The content is written
    under a temporary name and hard-linked to `path`, which fails if `path` exists, so a reader never sees a
    half-written lock."""
    # Unique per host too: trainers of two hosts on a shared file system may have the same pid.
    temporary = f"{files.temporary_path(path)}.{socket.gethostname()}"
    try:
        with open(temporary, "wb") as f:
            f.write(data)
        os.link(temporary, path)
        return True
    except FileExistsError:
        return False
    except OSError as err:
        if err.errno not in NO_HARD_LINKS:
            raise
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.remove(temporary)
    # A file system without hard links: created exclusively and written in place, so that a reader may find it
    # half-written, judge it not a lock and refuse (which loses nothing).
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    except FileExistsError:
        return False
    with os.fdopen(fd, "wb") as f:
        f.write(data)
    return True


def _read(path):
    """The bytes of `path`, or None when it does not exist."""
    try:
        with open(path, "rb") as f:
            return f.read()
    except FileNotFoundError:
        return None


def _remove_if(path, expected):
    """Removes `path` if it holds `expected`; returns whether it did.

    `path` is first renamed aside to a name of this call's own (atomic: of two processes doing this at once, one
    gets the file and the other finds none), then the moved file is compared with `expected`. If another
    process replaced the file between our reading it and this rename, the moved file is not `expected`: it is
    put back (with `_create`, which fails only if yet another lock was made in the meantime; see `acquire`).
    """
    aside = f"{path}.stale-{uuid.uuid4().hex}"
    try:
        os.rename(path, aside)
    except FileNotFoundError:
        return False
    try:
        moved = _read(aside)
        if moved == expected:
            return True
        _create(path, moved)
        return False
    finally:
        os.remove(aside)


class Lock:
    """A held lock: `path`, `record` (what it holds). `release()` removes the file if it is still this one."""

    def __init__(self, path, record, data):
        self.path, self.record, self._data = path, record, data

    def release(self):
        """Removes the lock file unless it is no longer this lock (broken and taken by another trainer, or
        gone); returns whether it removed it. Safe to call more than once."""
        with _guarded(os.path.dirname(self.path)):
            return _remove_if(self.path, self._data)


def acquire(model_dir, break_lock=False, argv=None):
    """Takes `<model_dir>/train.lock` (creating model_dir if missing) for this process; returns the `Lock`.

    A lock held on this host by a process that is gone is taken over, with a notice on stdout. With
    `break_lock`, so is one held on another host, or a file that is not a lock. `argv` is the command the lock
    names (default sys.argv).

    Raises:
      ModelDirLocked (a ConfigError): the lock is held by a live process of this host (whatever `break_lock`),
        held on another host, or not a lock (the last two without `break_lock`); the message names the lock
        file and the holder's host, pid, start time and command, or what is wrong with the file.
    """
    os.makedirs(model_dir, exist_ok=True)
    path = os.path.join(model_dir, LOCK_FILE)
    record = own_record(argv)
    data = (json.dumps(record, indent=2) + "\n").encode("utf-8")
    with _guarded(model_dir):
        return _acquire(model_dir, path, record, data, break_lock)


def _acquire(model_dir, path, record, data, break_lock):
    """`acquire`'s takeover protocol, which stands alone where `_guarded` cannot guard it.

    Taking over a stale lock S, safe against another new trainer doing the same at once:
    1. S is removed only by `_remove_if(path, S)`: it renames whatever is at `path` aside (atomic, so of two
       takers one moves S and the other finds nothing) and deletes it only if it is S; a newer lock moved by
       mistake (another taker already replaced S) is put back.
    2. This trainer then creates its own lock with `_create`'s atomic link, which fails if another got there
       first; the loop then judges that lock afresh, and refuses a live trainer.
    Unguarded, a third trainer arriving in the microseconds a moved lock is away could slip in (the put-back then
    fails, and two trainers hold it): seen with six takers at once. The guard serialises the takers, and then
    `_remove_if` only ever moves S.
    """
    for _ in range(ATTEMPTS):
        if _create(path, data):
            return Lock(path, record, data)
        seen = _read(path)
        if seen is None:
            continue  # released since: try again
        notice = _judge_or_refuse(model_dir, path, seen, break_lock)
        if _remove_if(path, seen) and _create(path, data):
            print(notice, flush=True)
            return Lock(path, record, data)
    raise ModelDirLocked(f"{path}: other trainers kept taking and changing the lock while this one tried "
                         f"{ATTEMPTS} times to take it; run again once one of them holds it")


@contextlib.contextmanager
def _guarded(model_dir):
    """Runs the block holding an exclusive flock on the directory `model_dir`: the processes of this host (and,
    where the file system arbitrates flock, of other hosts) change the lock file one at a time. The kernel
    drops the flock when its process dies, so it is never stale. Where the file system offers no flock on a
    directory (NFS emulates flock with POSIX locks, which need a file open for writing) or model_dir is gone,
    the block runs unguarded.

    Raises:
      ModelDirLocked: another process has held the flock for GUARD_TIMEOUT_S.
    """
    try:
        fd = os.open(model_dir, os.O_RDONLY)
    except OSError:
        fd = None
    try:
        deadline = time.monotonic() + GUARD_TIMEOUT_S
        while fd is not None:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() > deadline:
                    raise ModelDirLocked(f"{model_dir}: another process has been changing {LOCK_FILE} for "
                                         f"{GUARD_TIMEOUT_S:g} s (it holds a flock on the directory): is a "
                                         "trainer stopped (Ctrl-Z, a debugger)? Resume or end it, then run again")
                time.sleep(0.005)
            except OSError:
                break  # no flock here
        yield
    finally:
        if fd is not None:
            os.close(fd)  # drops the flock


def _judge_or_refuse(model_dir, path, seen, break_lock):
    """The notice of taking over the lock `seen` (the content of `path`); raises ModelDirLocked when it must
    not be taken."""
    record = parse_record(seen)
    if isinstance(record, str):
        if not break_lock:
            raise ModelDirLocked(f"{path} is not a training lock ({record}); it was left as it is: remove it, or "
                                 f"pass --break_lock to replace it")
        return f"[train] --break_lock: replaced {path}, which was not a training lock ({record})"
    state, why = judge(record)
    pid, started, command = record["pid"], record.get("started", "an unknown time"), _command(record)
    where = f"host {record['host']}" if why == "another host" else f"this host ({why})"
    if state == "alive":
        hint = " (--break_lock does not break the lock of a live process of this host)" if break_lock else ""
        raise ModelDirLocked(f"{model_dir} is being trained by pid {pid} on this host since {started} ({command}; "
                             f"lock file {path}): wait for it, or stop it{hint}")
    if state == "elsewhere":
        if not break_lock:
            raise ModelDirLocked(f"{model_dir} is being trained by pid {pid} on {where} since {started} "
                                 f"({command}; lock file {path}); if that training is no longer running, pass "
                                 "--break_lock")
        return (f"[train] --break_lock: broke the lock of pid {pid} on {where} (started {started}; {command}; "
                f"lock file {path})")
    return (f"[train] {model_dir}: took over the lock of pid {pid} on this host (started {started}), which is no "
            f"longer running ({why})")


@contextlib.contextmanager
def hold(model_dir, break_lock=False, argv=None):
    """Holds `<model_dir>/train.lock` inside the block (see `acquire`, which raises ModelDirLocked when it
    cannot be taken); releases it however the block ends. Yields the `Lock`."""
    lock = acquire(model_dir, break_lock, argv)
    try:
        yield lock
    finally:
        lock.release()
