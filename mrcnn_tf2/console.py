"""Lines for the console that a long run prints while it works, and what happens when no one reads them."""

import contextlib
import errno
import os
import sys
import tempfile

# What writing to a console that is gone raises: a pipe without a reader (EPIPE), a terminal that hung up (EIO).
_GONE = (errno.EPIPE, errno.EIO)


def say(line, stream=None):
    """Prints `line` to `stream` (None: standard output) and flushes it.

    When the console is gone (the reader of its pipe ended: `main.py train | tee log` stopped by the same Ctrl-C
    that stops training; the terminal closed or its ssh connection dropped), the stream is pointed at /dev/null
    and the run goes on: its log file keeps every record, and a training run still writes the checkpoint of its
    stop. Otherwise the next progress line would end it with BrokenPipeError or an input/output error, before
    that checkpoint.
    """
    stream = sys.stdout if stream is None else stream
    try:
        print(line, file=stream, flush=True)
    except OSError as err:
        if err.errno not in _GONE:
            raise
        os.dup2(os.open(os.devnull, os.O_WRONLY), stream.fileno())


@contextlib.contextmanager
def stderr_without(drop):
    """Holds back what is written to the process's stderr inside the block (file descriptor 2, where C++ libraries
    such as TensorFlow's and LiteRT's write, out of reach of Python's logging), then writes it out, in its order,
    without the lines for which `drop(line)` (a str, its newline kept) is true."""
    sys.stderr.flush()
    saved = os.dup(2)
    with tempfile.TemporaryFile(mode="w+b") as held:
        os.dup2(held.fileno(), 2)
        try:
            yield
        finally:
            sys.stderr.flush()
            os.dup2(saved, 2)
            os.close(saved)
            held.seek(0)
            kept = [line for line in held.read().decode("utf-8", "replace").splitlines(keepends=True)
                    if not drop(line)]
            sys.stderr.write("".join(kept))
            sys.stderr.flush()
