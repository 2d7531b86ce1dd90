"""Lines for the console that a long run prints while it works, and what happens when no one reads them."""

import errno
import os
import sys

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
