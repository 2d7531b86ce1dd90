"""The command line the converters in weights/ share: the parser's description and the run of a conversion
with its exit status (`mrcnn_tf2.status`) and error convention. Each converter keeps its own flags.

Convention: a conversion raises ValueError for bad input or flags (found before anything is written; exit
status BAD_INPUT) and RuntimeError when it started and could not complete (FAILURE); either is printed as one
line, `error: <message>`, on stderr.
"""

import argparse
import sys

from mrcnn_tf2 import status
from mrcnn_tf2.cli import import_tensorflow


def build_parser(doc):
    """An ArgumentParser described by the first paragraph of `doc`, the converter's module docstring."""
    return argparse.ArgumentParser(description=doc.split("\n\n")[0])


def run(parser, argv, convert):
    """Parses `argv` (None: sys.argv[1:]) with `parser`, starts TensorFlow as main.py does (TensorFlow reads its
    environment once, at its first import) and returns the exit status of `convert(args)`.

    `convert` returns the lines to print on success (OK); its ValueError gives BAD_INPUT, its RuntimeError
    FAILURE, each printed as `error: <message>` on stderr. --help and bad flags exit in the parser, before
    TensorFlow is imported.
    """
    args = parser.parse_args(argv)
    import_tensorflow()
    try:
        lines = convert(args)
    except ValueError as err:
        print(f"error: {err}", file=sys.stderr)
        return status.BAD_INPUT
    except RuntimeError as err:
        print(f"error: {err}", file=sys.stderr)
        return status.FAILURE
    for line in lines:
        print(line)
    return status.OK
