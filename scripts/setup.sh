#!/usr/bin/env bash
# Set-up of a fresh clone: a virtual environment with the pinned requirements, then the native parts, then
# the test-only requirements.
# Idempotent: every stage leaves a stamp of its inputs and is skipped while they are unchanged, so a
# second run costs seconds.
# SETUP_GPU=1 (`make setup GPU=1`): requirements-gpu.txt (TensorFlow with its CUDA libraries) instead of
# requirements.txt, and Horovod with its NCCL GPU operations when a CUDA toolkit is present
# (scripts/build_horovod.sh).
set -euo pipefail
cd "$(dirname "$0")/.."

PYTHON=${PYTHON:-python3}
VENV=.venv

if [ ! -x "$VENV/bin/python" ]; then
  echo "[setup] creating $VENV"
  "$PYTHON" -m venv "$VENV"
fi

requirements=requirements.txt
stamp="$VENV/.requirements.sha256"
want=$(sha256sum requirements.txt | cut -d' ' -f1)
if [ "${SETUP_GPU:-0}" = 1 ]; then
  requirements=requirements-gpu.txt  # which includes requirements.txt
  want="$want-gpu-$(sha256sum requirements-gpu.txt | cut -d' ' -f1)"
fi
if [ "$(cat "$stamp" 2>/dev/null)" != "$want" ]; then
  echo "[setup] installing $requirements into $VENV"
  "$VENV/bin/python" -m pip install --disable-pip-version-check -q -r "$requirements"
  echo "$want" > "$stamp"
fi
# The package, editable: `mrcnn_tf2` importable from any directory, the `mrcnn-tf2` command in $VENV/bin.
# Without build isolation and dependencies nothing is downloaded: the build backend is the venv's setuptools
# (pinned in requirements.txt), and the requirements are installed above.
stamp="$VENV/.package.sha256"
want=$(sha256sum pyproject.toml | cut -d' ' -f1)
if [ "$(cat "$stamp" 2>/dev/null)" != "$want" ] || [ ! -x "$VENV/bin/mrcnn-tf2" ]; then
  echo "[setup] installing the package (editable) into $VENV"
  if ! "$VENV/bin/python" -c "import setuptools" 2>/dev/null; then
    "$VENV/bin/python" -m pip install --disable-pip-version-check -q "$(grep -E '^setuptools==' requirements.txt)"
  fi
  "$VENV/bin/python" -m pip install --disable-pip-version-check -q --no-deps --no-build-isolation -e .
  echo "$want" > "$stamp"
fi
# Fused C++ ops (ops/build/libmrcnn_ops.so); ops/build.sh keeps its own stamp of sources + TF version.
bash ops/build.sh "$VENV/bin/python"
# Horovod from its sdist with the project's patch (horovodrun --gloo; MPI too when mpicxx is present).
# SETUP_HOROVOD=0 skips it: single-process work (the demo) does not need it and saves its ~3 min build.
if [ "${SETUP_HOROVOD:-1}" != 0 ]; then
  bash scripts/build_horovod.sh "$VENV/bin/python"
fi
# The test-only dependencies (requirements-test.txt: torch and torchvision, about 5.5 GB with their CUDA
# libraries). SETUP_TEST_DEPS=0 skips them: the package and the demo never import them.
if [ "${SETUP_TEST_DEPS:-1}" != 0 ]; then
  stamp="$VENV/.requirements-test.sha256"
  want=$(sha256sum requirements-test.txt | cut -d' ' -f1)
  if [ "$(cat "$stamp" 2>/dev/null)" != "$want" ]; then
    echo "[setup] installing requirements-test.txt into $VENV"
    "$VENV/bin/python" -m pip install --disable-pip-version-check -q -r requirements-test.txt
    echo "$want" > "$stamp"
  fi
fi
echo "[setup] ready in ${SECONDS} s: $VENV ($("$VENV/bin/python" -c 'import tensorflow as tf; print("tensorflow", tf.__version__)' 2>/dev/null))"
