"""Exit statuses of every command of the package (main.py's modes, weights/ and dataset/ scripts), and how a
signal ends one."""

import contextlib
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


def _raise_terminated(signum, frame):
    raise Terminated(signum)


@contextlib.contextmanager
def terminations_raise():
    """A context in which SIGTERM and SIGHUP raise `Terminated` where the main thread is, as Ctrl-C raises
    KeyboardInterrupt, instead of ending the process at once: the process unwinds, so that its `finally` blocks
    remove their temporary files (`files.atomic_path`: an export or conversion killed midway leaves nothing) and
    a trainer releases its model directory. A signal the process ignores (`nohup`) or handles stays so; leaving
    the context restores the handlers. Outside the main thread it changes nothing."""
    previous = {}
    with contextlib.suppress(ValueError):  # handlers can only be set in the main thread
        for signum in (signal.SIGTERM, signal.SIGHUP):
            if signal.getsignal(signum) is signal.SIG_DFL:
                previous[signum] = signal.signal(signum, _raise_terminated)
    try:
        yield
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)


def run_stoppable(run, command):
    """`run()`'s return value (an exit status), run under `terminations_raise`; after Ctrl-C, SIGTERM or SIGHUP,
    once the run has unwound, `stopped_by` the signal, having written '<command>: stopped by SIGTERM' to standard
    error."""
    try:
        with terminations_raise():
            return run()
    except KeyboardInterrupt:
        signum = signal.SIGINT
    except Terminated as stop:
        signum = stop.signum
    with contextlib.suppress(OSError):  # no terminal any more (SIGHUP)
        print(f"{command}: stopped by {signal.Signals(signum).name}", file=sys.stderr, flush=True)
    return stopped_by(signum)
