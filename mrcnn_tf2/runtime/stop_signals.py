"""A training run stops cleanly on SIGINT (Ctrl-C), SIGTERM (`docker stop`, Kubernetes, a batch scheduler that
preempts or ends a job) or SIGHUP (its terminal closed: an ssh connection that dropped): it finishes the update
under way (or abandons an evaluation: `evaluate.run_evaluation`'s `stopping`), writes its checkpoint and exits
with 128 + the signal's number (`status.stopped_by`), so that the same command resumes at that step rather than
at the last periodic checkpoint (`--checkpoint_every`, 1000 updates by default).

Only the first signal of each kind waits for the update: the handler then gives the signal back to what handled
it before (under main.py `status.terminations_raise`: KeyboardInterrupt or `status.Terminated`, which unwind the
process; otherwise KeyboardInterrupt for SIGINT and the end of the process for the others), so that sending it
again stops the process at once. A signal the process ignores (SIGINT of a job that a non-interactive shell
started in the background) stays ignored.
"""

import os
import signal
import threading

SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


def name(signum):
    """'SIGTERM' for signal.SIGTERM."""
    return signal.Signals(signum).name


class StopSignals:
    """A context in which SIGINT, SIGTERM and SIGHUP set `signum` (0 until one comes; then the first) instead of
    acting at once.

    announce: None, or f(signum) -> the line written to standard error when the signal comes (os.write, which
    a signal handler may call while the main thread is inside a print).
    Handlers can only be set in the main thread: elsewhere (a Python caller's worker thread) the context
    changes nothing and `signum` stays 0.
    """

    def __init__(self, announce=None):
        self.announce = announce
        self.signum = 0
        self._previous = {}

    def _handle(self, signum, frame):
        signal.signal(signum, self._previous.pop(signum))
        if self.signum:  # already stopping: the first signal names the stop (Ctrl-C of `make demo` sends two kinds)
            return
        self.signum = signum
        if self.announce is not None:
            try:
                os.write(2, (self.announce(signum) + "\n").encode())
            except OSError:  # no console any more (console.say): the stop goes on without the line
                pass

    def __enter__(self):
        if threading.current_thread() is threading.main_thread():
            for signum in SIGNALS:
                previous = signal.getsignal(signum)
                if previous in (signal.SIG_IGN, None):  # None: set outside Python, which cannot restore it
                    continue
                self._previous[signum] = previous
                signal.signal(signum, self._handle)
        return self

    def __exit__(self, *exc_info):
        for signum, previous in self._previous.items():
            signal.signal(signum, previous)
        self._previous = {}
        return False
