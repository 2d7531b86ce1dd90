"""Atomic file output, the one way the package and its scripts write a file or directory that others read.

A result appears under its final name only once it is complete: it is written to `temporary_path(path)`
beside the destination, then renamed over it (a rename within one directory is atomic), so an
interrupted run never leaves a file that looks finished, and a failed run leaves the previous one intact.
The temporary name ends in `.tmp-<pid>`, which no reader's `*.tfrecord` / `*.json` pattern matches.

This module imports neither TensorFlow nor the rest of the package but its exit statuses (`status`), which say
whether a signal stopped the run.
"""

import contextlib
import glob
import json
import os
import shutil

from mrcnn_tf2 import status


def temporary_path(path: str) -> str:
    """The name `path` is written under until it is complete (unique to this process)."""
    return f"{path}.tmp-{os.getpid()}"


def abandoned(pattern: str) -> list:
    """The temporary names (`temporary_path`) of the outputs that the glob `pattern` matches whose process is not
    running on this host: left by a process killed outright (SIGKILL, the kernel's out-of-memory killer), which
    removes nothing. Sorted."""
    found = []
    for path in glob.glob(f"{pattern}.tmp-*"):
        pid = path.rsplit(".tmp-", 1)[1]
        if pid.isdigit() and not pid_running(int(pid)):
            found.append(path)
    return sorted(found)


def abandoned_note(pattern: str):
    """One line on `abandoned(pattern)` (how many, the first, the bytes they hold), or None when there is none:
    reported, not removed, as a process of another host sharing the directory may be writing them."""
    found = abandoned(pattern)
    if not found:
        return None
    size = sum(_size(path) for path in found)
    return (f"{len(found)} temporary file(s) that a killed process left beside the output ({found[0]}; "
            f"{size / 2**20:.1f} MiB in all): delete them")


def _size(path):
    """Bytes of the file `path`, or of the files under the directory `path` (what vanished meanwhile counts 0)."""
    paths = [os.path.join(root, name) for root, _, names in os.walk(path) for name in names] \
        if os.path.isdir(path) else [path]
    total = 0
    for name in paths:
        with contextlib.suppress(OSError):
            total += os.stat(name).st_size
    return total


def pid_running(pid) -> bool:
    """Whether a process of this host (this pid namespace) has the id `pid`."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # another user's process
    except (OverflowError, ValueError):
        return False  # not a pid
    return True


def remove(path: str) -> None:
    """Removes the file or directory `path`, if it exists."""
    if os.path.isdir(path) and not os.path.islink(path):
        shutil.rmtree(path, ignore_errors=True)
    elif os.path.lexists(path):
        os.remove(path)


def commit(temporary: str, path: str) -> None:
    """Renames the finished `temporary` (a file or a directory) to `path`, replacing what is there; raises
    instead when a signal stopped the run (`status.raise_if_stopped`)."""
    status.raise_if_stopped()
    if os.path.isdir(temporary) and os.path.isdir(path):
        # A directory cannot be renamed over a non-empty one: move the old one aside first.
        previous = f"{path}.old-{os.getpid()}"
        os.replace(path, previous)
        try:
            os.replace(temporary, path)
        except BaseException:
            os.replace(previous, path)  # a failed commit leaves the old result, as promised
            raise
        remove(previous)
    else:
        os.replace(temporary, path)


@contextlib.contextmanager
def atomic_path(path: str):
    """Yields the temporary name to write `path` under; commits it when the block succeeds, removes it
    whatever happens (so an exception leaves `path` as it was)."""
    temporary = temporary_path(path)
    remove(temporary)
    try:
        yield temporary
        commit(temporary, path)
    finally:
        remove(temporary)


def write_bytes(path: str, data: bytes) -> None:
    """Writes `data` to `path` atomically."""
    with atomic_path(path) as temporary, open(temporary, "wb") as f:
        f.write(data)


def write_json(path: str, obj, indent=None) -> None:
    """Writes `obj` as UTF-8 JSON to `path` atomically. indent=None writes compact JSON (annotation files
    with polygons grow several-fold when indented)."""
    separators = (",", ":") if indent is None else (",", ": ")
    write_bytes(path, json.dumps(obj, indent=indent, separators=separators).encode("utf-8"))
