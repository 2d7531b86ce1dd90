#!/usr/bin/env bash
# Builds Horovod from its sdist into the venv, against the installed TensorFlow, with the project's patch.
# No Horovod wheel matches TF 2.21: it must compile against this TF's headers, so --no-build-isolation
# (an isolated build would fetch another TF). Gloo is always built (horovodrun --gloo needs no MPI); MPI
# too when an MPI compiler is on PATH. Extra HOROVOD_* variables in the environment (e.g.
# HOROVOD_GPU_OPERATIONS=NCCL) reach the build unchanged.
# Idempotent: the stamp holds this script's hash (version, pins, patch), the TF version, the installed
# Horovod version and the MPI compiler, so an unchanged set-up is not rebuilt. A failed build fails the
# set-up: CI must not silently lose the distributed tests.
# Usage: scripts/build_horovod.sh [python]   (default: .venv/bin/python)
set -euo pipefail
cd "$(dirname "$0")/.."

PYTHON=${1:-.venv/bin/python}
HOROVOD_VERSION=0.28.1
# Horovod's run-time dependencies, pinned like requirements.txt (pip would otherwise take the newest).
RUNTIME_PINS=(cloudpickle==3.1.2 psutil==7.2.2 pyyaml==6.0.3)
STAMP=$(dirname "$(dirname "$PYTHON")")/.horovod.stamp

versions=$("$PYTHON" -c '
import importlib.metadata as m
for name in ("tensorflow", "horovod"):
    try:
        print(m.version(name))
    except m.PackageNotFoundError:
        print("none")')
tf_version=$(sed -n 1p <<<"$versions")
installed=$(sed -n 2p <<<"$versions")
mpicxx=$(command -v mpicxx || true)
want="$(sha256sum scripts/build_horovod.sh | cut -d' ' -f1)-tf$tf_version-mpi:$mpicxx"
if [ "$installed" = "$HOROVOD_VERSION" ] && [ "$(cat "$STAMP" 2>/dev/null)" = "$want" ]; then
  exit 0
fi

if ! command -v cmake >/dev/null; then
  echo "[horovod] error: cmake is required to build Horovod (e.g. apt-get install cmake)" >&2
  exit 1
fi
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
echo "[horovod] building horovod $HOROVOD_VERSION against tensorflow $tf_version (gloo${mpicxx:+, mpi}); a few minutes"
"$PYTHON" -m pip download --disable-pip-version-check -q --no-binary :all: --no-deps \
  "horovod==$HOROVOD_VERSION" -d "$work"
tar -xzf "$work/horovod-$HOROVOD_VERSION.tar.gz" -C "$work"
src=$work/horovod-$HOROVOD_VERSION

# The patch. xla_mpi_ops.cc includes TF's XLA headers for TF >= 2.6, but the TF wheel ships none of them,
# and the file only implements anything under HAVE_GPU: compile it out without a GPU.
xla_ops=$src/horovod/tensorflow/xla_mpi_ops.cc
sed -i 's|^#if TENSORFLOW_VERSION >= 2006000000$|#if TENSORFLOW_VERSION >= 2006000000 \&\& HAVE_GPU|' "$xla_ops"
if ! grep -q '^#if TENSORFLOW_VERSION >= 2006000000 && HAVE_GPU$' "$xla_ops"; then
  echo "[horovod] error: the patch no longer applies to $xla_ops" >&2
  exit 1
fi

if [ -n "$mpicxx" ]; then mpi=(HOROVOD_WITH_MPI=1); else mpi=(HOROVOD_WITHOUT_MPI=1); fi
env HOROVOD_WITH_TENSORFLOW=1 HOROVOD_WITH_GLOO=1 HOROVOD_WITHOUT_PYTORCH=1 HOROVOD_WITHOUT_MXNET=1 "${mpi[@]}" \
  MAKEFLAGS="-j$(nproc)" \
  "$PYTHON" -m pip install --disable-pip-version-check -q --no-build-isolation "$src" "${RUNTIME_PINS[@]}"
# Import it once: a library that built but does not load (an ABI mismatch with TF) must fail here, not in CI.
TF_CPP_MIN_LOG_LEVEL=3 "$PYTHON" -c 'import horovod.tensorflow as hvd; assert hvd.gloo_built(), "horovod was built without gloo"'
echo "$want" > "$STAMP"
echo "[horovod] installed horovod $HOROVOD_VERSION"
