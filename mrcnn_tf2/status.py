"""Exit statuses of every command of the package (main.py's modes, weights/ and dataset/ scripts), and how a
signal or a full disk ends one."""

import contextlib
import errno
import os
import re
import signal
import sys

# The run did what was asked.
OK = 0
# The run started and failed: a diverged loss, a file it could not complete.
FAILURE = 1
# Bad input or usage, found before any work was done: a flag, a missing or malformed file or record.
BAD_INPUT = 2


def stopped_by(signum: int) -> int:
    """A run that a signal stopped (SIGINT, SIGTERM, SIGHUP; runtime.stop_signals): 128 + the signal's number, as a
    shell reports a process that the signal ended (130 for SIGINT, 143 for SIGTERM, 129 for SIGHUP)."""
    return 128 + signum


class Terminated(BaseException):
    """SIGTERM or SIGHUP came (`terminations_raise`). A BaseException, as KeyboardInterrupt is: `except Exception`
    does not stop it."""

    def __init__(self, signum):
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


class Received:
    """The first signal `terminations_raise` acted on (`signum`, 0 before one comes)."""

    signum = 0


# The Received of each `terminations_raise` context open, the innermost last (read by `raise_if_stopped`).
_open = []


def _exception(signum):
    return KeyboardInterrupt() if signum == signal.SIGINT else Terminated(signum)


def raise_if_stopped():
    """Raises again the exception of a signal that an open `terminations_raise` context received, for a run that
    went on because the code the signal interrupted swallowed it: TensorFlow's C++ op dispatcher clears a Python
    error raised inside its isinstance checks. `files.commit` calls it, so that a stopped run publishes no output
    after the signal whatever swallowed it."""
    for received in _open:
        if received.signum:
            raise _exception(received.signum)


@contextlib.contextmanager
def terminations_raise():
    """A context in which SIGTERM and SIGHUP raise `Terminated` where the main thread is, as Ctrl-C raises
    KeyboardInterrupt, instead of ending the process at once: the process unwinds, so that its `finally` blocks
    remove their temporary files (`files.atomic_path`: an export or conversion killed midway leaves nothing) and
    a trainer releases its model directory. Yields a `Received` that records the signal (and Ctrl-C's): raised
    inside C++ that calls back into Python (TensorFlow's tracing), the exception can come out as another.

    A signal the process ignores (`nohup`) or handles otherwise stays so; leaving the context restores the
    handlers. Outside the main thread it changes nothing."""
    received = Received()

    def handle(signum, frame):
        received.signum = received.signum or signum
        raise _exception(signum)

    previous = {}
    with contextlib.suppress(ValueError):  # handlers can only be set in the main thread
        for signum, default in ((signal.SIGINT, signal.default_int_handler), (signal.SIGTERM, signal.SIG_DFL),
                                (signal.SIGHUP, signal.SIG_DFL)):
            if signal.getsignal(signum) is default:
                previous[signum] = signal.signal(signum, handle)
    _open.append(received)
    try:
        yield received
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)
        _open.remove(received)


# The errors of a write that the destination refuses whatever is written: a full disk, a quota, a file size
# limit, a read-only file system.
_WRITE_ERRNOS = (errno.ENOSPC, errno.EDQUOT, errno.EFBIG, errno.EROFS)


def write_failure(err):
    """'No space left on device: PATH' (or the reason alone) when `err` is a write that the destination refused
    (_WRITE_ERRNOS), told by an OSError's errno or by the text of another error (TensorFlow's, with the path
    before '; No space left on device'); else None."""
    if isinstance(err, OSError) and err.errno in _WRITE_ERRNOS:
        return os.strerror(err.errno) + (f": {err.filename}" if err.filename else "")
    for code in _WRITE_ERRNOS:
        reason = os.strerror(code)
        if reason in str(err):
            path = re.search(r"(/\S+); " + re.escape(reason), str(err))
            return reason + (f": {path.group(1)}" if path else "")
    return None


def run_stoppable(run, command):
    """`run()`'s return value (an exit status), run under `terminations_raise`; after Ctrl-C, SIGTERM or SIGHUP,
    once the run has unwound, `stopped_by` the signal, having written '<command>: stopped by SIGTERM' to standard
    error, also when the code the signal interrupted swallowed its exception and the run went on to its end
    (`raise_if_stopped`). A write the destination refused (`write_failure`) is one line, '<command>: error: ...',
    and FAILURE (the writers remove their partial files as they unwind: `files.atomic_path`)."""
    with terminations_raise() as received:
        try:
            result = run()
            if not received.signum:
                return result
            signum = received.signum
        except (KeyboardInterrupt, Terminated):
            signum = received.signum or signal.SIGINT  # a KeyboardInterrupt raised by code, not by a signal
        except BaseException as err:
            if not received.signum:
                reason = write_failure(err)
                if reason is None:
                    raise
                with contextlib.suppress(OSError):
                    print(f"{command}: error: a file could not be written ({reason})", file=sys.stderr, flush=True)
                return FAILURE
            signum = received.signum  # the signal's exception, turned into another by the C++ it was raised in
    with contextlib.suppress(OSError):  # no terminal any more (SIGHUP)
        print(f"{command}: stopped by {signal.Signals(signum).name}", file=sys.stderr, flush=True)
    return stopped_by(signum)
