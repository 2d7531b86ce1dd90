"""Shared pytest set-up: quiet TensorFlow, the repository root importable, fixed seeds."""
import os
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import numpy as np  # noqa: E402
import pytest  # noqa: E402


@pytest.fixture
def rng():
    """A seeded NumPy generator, so that every random test input is reproducible."""
    return np.random.default_rng(0)
