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
# The test-only dependencies (requirements-test.txt: torch and torchvision, about 5.5 GB with their CUDA
# libraries) and the package's optional deployment extras (pyproject.toml), which the tests exercise.
# SETUP_TEST_DEPS=0 skips them: training, evaluation and the demo never import them. pip unpacks them in the
# background while the native parts below compile: the two share no package, and requirements.txt's setuptools
# already satisfies torch, so nothing the Horovod build imports changes under it.
test_deps_pid=
test_deps_stamp="$VENV/.requirements-test.sha256"
if [ "${SETUP_TEST_DEPS:-1}" != 0 ]; then
  test_deps_want=$(cat requirements-test.txt pyproject.toml | sha256sum | cut -d' ' -f1)
  if [ "$(cat "$test_deps_stamp" 2>/dev/null)" != "$test_deps_want" ]; then
    echo "[setup] installing requirements-test.txt and the extras onnx, tflite, openvino into $VENV"
    # Its pip first, in the foreground: pip must not replace itself while the Horovod build below runs pip.
    "$VENV/bin/python" -m pip install --disable-pip-version-check -q "$(grep -E '^pip==' requirements-test.txt)"
    "$VENV/bin/python" -m pip install --disable-pip-version-check -q -r requirements-test.txt &
    test_deps_pid=$!
    # A failed build must not leave pip writing into the venv after the set-up has exited.
    trap '[ -z "$test_deps_pid" ] || kill "$test_deps_pid" 2>/dev/null || true' EXIT
  fi
fi
# Fused C++ ops (ops/build/libmrcnn_ops.so); ops/build.sh keeps its own stamp of sources + TF version.
bash ops/build.sh "$VENV/bin/python"
# Horovod from its sdist with the project's patch: Gloo (horovodrun --gloo) and, where Open MPI is installed,
# MPI (mpirun, horovodrun --mpi). Open MPI comes from Debian's packages (openmpi-bin, libopenmpi-dev) where the
# set-up may install system packages (root, or sudo without a password); elsewhere it says what to install and
# Horovod is built with Gloo only.
# SETUP_HOROVOD=0 skips both: single-process work (the demo) does not need them and saves the ~3 min build.
if [ "${SETUP_HOROVOD:-1}" != 0 ]; then
  if ! command -v mpicxx >/dev/null; then
    sudo=()
    if [ "$(id -u)" != 0 ] && command -v sudo >/dev/null && sudo -n true 2>/dev/null; then sudo=(sudo -n); fi
    if command -v apt-get >/dev/null && { [ "$(id -u)" = 0 ] || [ ${#sudo[@]} -gt 0 ]; }; then
      echo "[setup] installing Open MPI (openmpi-bin, libopenmpi-dev) for mpirun"
      install=("${sudo[@]}" env DEBIAN_FRONTEND=noninteractive apt-get install -y -q openmpi-bin libopenmpi-dev)
      # The package lists may be missing (a fresh container): fetch them, then try once more.
      if ! "${install[@]}" >/dev/null 2>&1 \
          && ! { "${sudo[@]}" apt-get update -q >/dev/null && "${install[@]}" >/dev/null; }; then
        echo "[setup] could not install Open MPI with apt-get (above): Horovod is built with Gloo only" >&2
      fi
    else
      echo "[setup] Open MPI is not installed, and this set-up cannot install system packages (it needs root," \
           "or sudo without a password, and apt-get): Horovod is built with Gloo only, so horovodrun --gloo" \
           "works and mpirun does not. For mpirun: sudo apt-get install openmpi-bin libopenmpi-dev (or your" \
           "system's Open MPI with its mpicxx), then rerun make setup." >&2
    fi
  fi
  bash scripts/build_horovod.sh "$VENV/bin/python"
fi
if [ -n "$test_deps_pid" ]; then
  wait "$test_deps_pid" || { echo "[setup] installing requirements-test.txt failed (above)" >&2; exit 1; }
  test_deps_pid=
  # Their dependencies are new packages only: pip keeps the installed pins, which satisfy them.
  "$VENV/bin/python" -m pip install --disable-pip-version-check -q --no-build-isolation -e ".[onnx,tflite,openvino]"
  echo "$test_deps_want" > "$test_deps_stamp"
fi
echo "[setup] ready in ${SECONDS} s: $VENV ($("$VENV/bin/python" -c 'import tensorflow as tf; print("tensorflow", tf.__version__)' 2>/dev/null))"
