"""Mask R-CNN for TensorFlow 2: `python main.py train|eval|infer|export [flags]` (see --help).

The same command as the installed `mrcnn-tf2`; the code is mrcnn_tf2/cli.py.
"""

import sys

from mrcnn_tf2.cli import RUNNERS, main  # noqa: F401 (RUNNERS: this module's interface, read by the tests)

if __name__ == "__main__":
    sys.exit(main())
