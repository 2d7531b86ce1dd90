"""Exit statuses of every command of the package (main.py's modes, weights/ and dataset/ scripts)."""

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
