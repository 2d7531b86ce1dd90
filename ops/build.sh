#!/usr/bin/env bash
# Builds the fused custom ops into ops/build/libmrcnn_ops.so with the flags of the installed TensorFlow.
# Idempotent: the stamp holds a hash of the sources, this script and the TF version, so an unchanged
# tree is not rebuilt, and a build is kept in the per-user build cache (scripts/build_cache.sh) for other clones
# and venvs of the same sources and TF version. BUILD_INFO.json records the TF version the library was built
# for, which the loader (mrcnn_tf2/ops/fused.py) compares with the running one: a custom op built against
# another TF may crash.
# Usage: ops/build.sh [python]   (default: .venv/bin/python)
set -euo pipefail
cd "$(dirname "$0")/.."

PYTHON=${1:-.venv/bin/python}
OUT=ops/build
LIB=$OUT/libmrcnn_ops.so
SOURCES=(ops/*.cc)

# The stamp needs only the installed TF version, read without importing TensorFlow (seconds saved).
dist_version=$("$PYTHON" -c 'import importlib.metadata as m; print(m.version("tensorflow"))')
want=$(cat "${SOURCES[@]}" ops/*.h ops/build.sh | sha256sum | cut -d' ' -f1)-$dist_version
if [ -f "$LIB" ] && [ "$(cat "$OUT/.stamp" 2>/dev/null)" = "$want" ]; then
  exit 0
fi

mkdir -p "$OUT"
# shellcheck source=../scripts/build_cache.sh
source scripts/build_cache.sh
if build_cache_get fused_ops "$want" "$OUT" >/dev/null; then
  echo "$want" > "$OUT/.stamp"
  echo "[build] $LIB: taken from the build cache ($build_cache_root)"
  exit 0
fi

tf_info=$("$PYTHON" -c '
import tensorflow as tf
print(tf.__version__)
print(" ".join(tf.sysconfig.get_compile_flags()))
print(" ".join(tf.sysconfig.get_link_flags()))' 2>/dev/null)
tf_version=$(sed -n 1p <<<"$tf_info")
compile_flags=$(sed -n 2p <<<"$tf_info")
link_flags=$(sed -n 3p <<<"$tf_info")

echo "[build] compiling ${#SOURCES[@]} sources into $LIB (tensorflow $tf_version)"
# -O3 without -march=native: the library must run on any x86-64 the venv runs on (e.g. in Docker).
# -ffp-contract=off: no fused multiply-adds (baseline on e.g. aarch64), so that a kernel that repeats its
# NumPy twin's float operations (mask pasting) rounds as NumPy does. Objects compile in parallel; each is
# a few seconds.
pids=()
objects=()
for src in "${SOURCES[@]}"; do
  obj=$OUT/$(basename "${src%.cc}").o
  objects+=("$obj")
  # shellcheck disable=SC2086
  g++ -O3 -ffp-contract=off -std=c++17 -fPIC -Wall -Wno-sign-compare -Wno-deprecated-declarations -Wno-interference-size $compile_flags -c "$src" -o "$obj" &
  pids+=($!)
done
for pid in "${pids[@]}"; do wait "$pid"; done
# Link to a temporary name, then rename: a half-written library is never loaded.
# shellcheck disable=SC2086
g++ -shared -O3 "${objects[@]}" -o "$LIB.tmp" $link_flags
mv "$LIB.tmp" "$LIB"
printf '{"tensorflow": "%s", "sources_sha256": "%s"}\n' "$tf_version" "${want%-*}" > "$OUT/BUILD_INFO.json"
build_cache_put fused_ops "$want" "$LIB" "$OUT/BUILD_INFO.json"
echo "$want" > "$OUT/.stamp"
