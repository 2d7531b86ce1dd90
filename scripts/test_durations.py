"""Seconds by test file, from the `--durations=0` report of pytest runs.

    PYTEST_ADDOPTS=--durations=0 make test 2>&1 | tee test.log
    python scripts/test_durations.py test.log [other.log ...] [--top 20]

Prints one column per pytest run (a log holding several, as make test's two passes, gives one each): setup,
call and teardown summed by file, largest first, and a total row; then the slowest single tests of the first
run. Under pytest-xdist the seconds are each test's own, added up over both workers: their sum is the suite's
cost, not its wall time.
"""

import argparse
import collections
import re

# A line of pytest's durations report: "12.34s call     tests/test_x.py::test_y[param]".
DURATION = re.compile(r"^(\d+(?:\.\d+)?)s (setup|call|teardown)\s+(\S+?)::(\S.*)$")


# The first line of each pytest run's output.
SESSION_START = "test session starts"


def read_runs(path):
    """[[(seconds, phase, file, test)] of each pytest run's durations report] in the output saved at `path`."""
    with open(path, encoding="utf-8", errors="replace") as f:
        sessions = f.read().split(SESSION_START)[1:]
    return [[(float(m[1]), m[2], m[3], m[4]) for m in map(DURATION.match, session.splitlines()) if m]
            for session in sessions]


def by_file(rows):
    """{file: seconds} of read_durations' rows."""
    totals = collections.Counter()
    for seconds, _, file, _ in rows:
        totals[file] += seconds
    return totals


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("logs", nargs="+", help="saved pytest output of runs with --durations=0")
    parser.add_argument("--top", type=int, default=20, help="slowest tests of the first log to list")
    args = parser.parse_args(argv)
    runs = []
    for path in args.logs:
        found = read_runs(path)
        if not found or not all(found):
            parser.error(f"{path}: a pytest run without a durations report (run pytest with --durations=0)")
        runs += found
    totals = [by_file(rows) for rows in runs]
    files = sorted(set().union(*totals), key=lambda name: -max(t[name] for t in totals))
    width = max(len(name) for name in files)
    print(f"{'file':<{width}}" + "".join(f" {f'run {i + 1} s':>10}" for i in range(len(runs))))
    for name in files:
        print(f"{name:<{width}}" + "".join(f" {t[name]:>10.1f}" if name in t else f" {'-':>10}" for t in totals))
    print(f"{'total':<{width}}" + "".join(f" {sum(t.values()):>10.1f}" for t in totals))
    print("\nslowest tests of run 1 (setup, call and teardown summed):")
    tests = collections.Counter()
    for seconds, _, file, test in runs[0]:
        tests[f"{file}::{test}"] += seconds
    for test, seconds in tests.most_common(args.top):
        print(f"{seconds:8.1f} s  {test}")


if __name__ == "__main__":
    main()
