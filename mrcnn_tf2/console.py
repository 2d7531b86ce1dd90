"""Lines for the console that a long run prints while it works, and what happens when no one reads them."""

import os
import sys


def say(line, stream=None):
    """Prints `line` to `stream` (None: standard output) and flushes it.

    When the console is gone (the reader of its pipe ended: `main.py train | tee log` stopped by the same Ctrl-C
    that stops training, a closed ssh pipe), the stream is pointed at /dev/null and the run goes on: its log file
    keeps every record, and a training run still writes the checkpoint of its stop. Otherwise the next progress
    line would end it with BrokenPipeError, before that checkpoint.
    """
    stream = sys.stdout if stream is None else stream
    try:
        print(line, file=stream, flush=True)
    except BrokenPipeError:
        os.dup2(os.open(os.devnull, os.O_WRONLY), stream.fileno())
