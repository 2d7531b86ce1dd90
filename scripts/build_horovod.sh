#!/usr/bin/env bash
# Builds Horovod from its sdist into the venv, against the installed TensorFlow, with the project's patch.
# No Horovod wheel matches TF 2.21: it must compile against this TF's headers, so --no-build-isolation
# (an isolated build would fetch another TF). Gloo is always built (horovodrun --gloo needs no MPI); MPI
# too when an MPI compiler is on PATH. Extra HOROVOD_* variables in the environment (e.g.
# HOROVOD_BUILD_CUDA_CC_LIST=80,90) reach the build unchanged.
# With SETUP_GPU=1 (`make setup GPU=1`) and a CUDA toolkit present (nvcc under $CUDA_HOME, default
# /usr/local/cuda), Horovod is built with its NCCL GPU operations (allreduce, allgather, broadcast on the
# GPU), NCCL taken from $HOROVOD_NCCL_HOME, the system (libnccl-dev) or the venv's nvidia-nccl-cu12 wheel;
# without a toolkit it says why and builds the CPU operations only.
# Idempotent: the stamp holds this script's hash (version, pins, patch), the TF version, the installed
# Horovod version, the MPI compiler and the GPU operations, so an unchanged set-up is not rebuilt. A CPU build's
# wheel is kept in the per-user build cache (scripts/build_cache.sh) under the same key, which other clones and
# venvs then install in seconds. A failed build fails the set-up: CI must not silently lose the distributed
# tests.
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

# The GPU operations: SETUP_GPU=1 and nvcc found.
gpu=()
cuda_home=${CUDA_HOME:-/usr/local/cuda}
if [ "${SETUP_GPU:-0}" = 1 ]; then
  if [ -x "$cuda_home/bin/nvcc" ]; then
    gpu=(HOROVOD_GPU_OPERATIONS=NCCL "HOROVOD_CUDA_HOME=$cuda_home")
  else
    echo "[horovod] GPU=1, but no CUDA toolkit: $cuda_home/bin/nvcc is missing (set CUDA_HOME to the toolkit)." \
         "Horovod compiles its NCCL GPU operations with nvcc, and TensorFlow's pip CUDA libraries carry no" \
         "complete toolkit; building the CPU operations only, so each allreduce copies the gradients to host" \
         "memory. Install the CUDA 12 toolkit (e.g. NVIDIA's cuda-toolkit-12-9 and libnccl-dev packages) or" \
         "build Dockerfile.gpu, then rerun make setup GPU=1." >&2
  fi
fi
want="$(sha256sum scripts/build_horovod.sh | cut -d' ' -f1)-tf$tf_version-mpi:$mpicxx-gpu:${gpu[*]}"
if [ "$installed" = "$HOROVOD_VERSION" ] && [ "$(cat "$STAMP" 2>/dev/null)" = "$want" ]; then
  exit 0
fi

# Imports Horovod once: a library that built but does not load (an ABI mismatch with TF) must fail here, not in
# CI. A GPU build must also have NCCL in it.
check_horovod() {
  TF_CPP_MIN_LOG_LEVEL=3 "$PYTHON" -c 'import sys, horovod.tensorflow as hvd
assert hvd.gloo_built(), "horovod was built without gloo"
assert sys.argv[1] == "0" or hvd.nccl_built(), "horovod was built without NCCL"' "${#gpu[@]}"
}
# shellcheck source=build_cache.sh
source scripts/build_cache.sh
# The cache holds CPU builds only: a GPU build links NCCL through its path in this venv.
if [ ${#gpu[@]} -gt 0 ]; then build_cache_root=; fi
cache_key="$want-mpi-version:$([ -z "$mpicxx" ] || "$mpicxx" --showme:version 2>&1 || true)"
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
if wheel=$(build_cache_get horovod "$cache_key" "$work"); then
  if "$PYTHON" -m pip install --disable-pip-version-check -q "$work/$wheel" "${RUNTIME_PINS[@]}" && check_horovod; then
    echo "$want" > "$STAMP"
    echo "[horovod] installed horovod $HOROVOD_VERSION from the build cache ($build_cache_root)"
    exit 0
  fi
  echo "[horovod] the cached wheel $wheel did not install or load (above): dropped, building instead" >&2
  build_cache_drop horovod "$cache_key"
fi

if ! command -v cmake >/dev/null; then
  echo "[horovod] error: cmake is required to build Horovod (e.g. apt-get install cmake)" >&2
  exit 1
fi
parts="gloo${mpicxx:+, mpi}${gpu:+, nccl}"
echo "[horovod] building horovod $HOROVOD_VERSION against tensorflow $tf_version ($parts); a few minutes"
"$PYTHON" -m pip download --disable-pip-version-check -q --no-binary :all: --no-deps \
  "horovod==$HOROVOD_VERSION" -d "$work"
tar -xzf "$work/horovod-$HOROVOD_VERSION.tar.gz" -C "$work"
src=$work/horovod-$HOROVOD_VERSION

# The patch. xla_mpi_ops.cc (Horovod's ops for XLA-compiled graphs, off unless HOROVOD_ENABLE_XLA_OPS) includes
# TF's XLA headers for TF >= 2.6 at paths the TF 2.21 wheel no longer has (xla_builder.h moved), and
# implements anything only under HAVE_GPU: compile it out without a GPU, and on a GPU while the headers are
# missing.
xla_ops=$src/horovod/tensorflow/xla_mpi_ops.cc
header=tensorflow/compiler/xla/client/xla_builder.h
guard="#if TENSORFLOW_VERSION >= 2006000000 \&\& HAVE_GPU \&\& __has_include(\"$header\")"
sed -i "s|^#if TENSORFLOW_VERSION >= 2006000000\$|$guard|" "$xla_ops"
if ! grep -qF '#if TENSORFLOW_VERSION >= 2006000000 && HAVE_GPU && __has_include(' "$xla_ops"; then
  echo "[horovod] error: the patch no longer applies to $xla_ops" >&2
  exit 1
fi

# Release rather than Horovod's RelWithDebInfo: the same -O3 without debug information, which the build spent a
# fifth of its time writing (CHANGELOG.md) for symbols that nobody here debugs with.
sed -i "s/else 'RelWithDebInfo'\$/else 'Release'/" "$src/setup.py"
if ! grep -q "else 'Release'\$" "$src/setup.py"; then
  echo "[horovod] error: the build-type patch no longer applies to $src/setup.py" >&2
  exit 1
fi

if [ ${#gpu[@]} -gt 0 ]; then
  # TensorFlow >= 2.18 no longer exports stream_executor::gpu::AsGpuStreamValue, which Horovod's GPU ops
  # declare and call (the library would build, then fail to load with an undefined symbol): define it
  # from the stream's platform handle, the same cudaStream_t.
  mpi_ops=$src/horovod/tensorflow/mpi_ops.cc
  sed -i '/^GpuStreamHandle AsGpuStreamValue(Stream\* stream);$/d' "$mpi_ops"
  sed -i 's|^#include "tensorflow/compiler/xla/stream_executor/stream.h"$|&\
namespace stream_executor {\
namespace gpu {\
inline GpuStreamHandle AsGpuStreamValue(Stream* stream) {\
  return static_cast<GpuStreamHandle>(stream->platform_specific_handle().stream);\
}\
}  // namespace gpu\
}  // namespace stream_executor|' "$mpi_ops"
  if grep -q '^GpuStreamHandle AsGpuStreamValue' "$mpi_ops" || ! grep -q 'platform_specific_handle' "$mpi_ops"; then
    echo "[horovod] error: the GPU stream patch no longer applies to $mpi_ops" >&2
    exit 1
  fi
  # NCCL: the user's, the system's (libnccl-dev), or the venv's wheel, which has no unversioned libnccl.so
  # for the linker (a folder of links gives it one) and is found at run time through the library's rpath.
  if [ -z "${HOROVOD_NCCL_HOME:-}${HOROVOD_NCCL_INCLUDE:-}" ] && [ ! -e /usr/include/nccl.h ]; then
    wheel=$("$PYTHON" -c 'import nvidia.nccl; print(list(nvidia.nccl.__path__)[0])' 2>/dev/null || true)
    if [ -z "$wheel" ] || [ ! -e "$wheel/include/nccl.h" ]; then
      echo "[horovod] error: GPU=1 with CUDA at $cuda_home, but no NCCL: install libnccl-dev, set" \
           "HOROVOD_NCCL_HOME, or install requirements-gpu.txt (nvidia-nccl-cu12)" >&2
      exit 1
    fi
    mkdir -p "$work/nccl/lib"
    ln -s "$wheel/include" "$work/nccl/include"
    ln -s "$wheel/lib/libnccl.so.2" "$work/nccl/lib/libnccl.so"
    gpu+=("HOROVOD_NCCL_HOME=$work/nccl" HOROVOD_NCCL_LINK=SHARED "LDFLAGS=-Wl,-rpath,$wheel/lib")
  fi
fi

if [ -n "$mpicxx" ]; then mpi=(HOROVOD_WITH_MPI=1); else mpi=(HOROVOD_WITHOUT_MPI=1); fi
env HOROVOD_WITH_TENSORFLOW=1 HOROVOD_WITH_GLOO=1 HOROVOD_WITHOUT_PYTORCH=1 HOROVOD_WITHOUT_MXNET=1 \
  "${mpi[@]}" "${gpu[@]}" \
  MAKEFLAGS="-j$(nproc)" \
  "$PYTHON" -m pip wheel --disable-pip-version-check -q --no-deps --no-build-isolation -w "$work/dist" "$src"
wheel=$(echo "$work"/dist/horovod-*.whl)
"$PYTHON" -m pip install --disable-pip-version-check -q "$wheel" "${RUNTIME_PINS[@]}"
check_horovod
build_cache_put horovod "$cache_key" "$wheel"
echo "$want" > "$STAMP"
echo "[horovod] installed horovod $HOROVOD_VERSION"
