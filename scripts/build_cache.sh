# Sourced by ops/build.sh and scripts/build_horovod.sh: a per-user cache of what they compile (the fused ops'
# library, Horovod's wheel), as pip keeps the wheels it builds from an sdist. A second clone, or a new venv, on
# the same machine then takes the build from the cache instead of compiling it again (Horovod: minutes).
# An entry is keyed by the caller's key (its stamp: sources, scripts, TensorFlow version, ...), $PYTHON's
# version and the machine's architecture, and is written under a temporary name, then renamed: a build that
# failed or was interrupted leaves no entry. MRCNN_TF2_BUILD_CACHE sets the folder (default
# ${XDG_CACHE_HOME:-~/.cache}/mrcnn_tf2/builds); set to an empty value, the cache is off, as it is without a
# home folder.
if [ -n "${MRCNN_TF2_BUILD_CACHE+set}" ]; then
  build_cache_root=$MRCNN_TF2_BUILD_CACHE
elif [ -n "${XDG_CACHE_HOME:-}${HOME:-}" ]; then
  build_cache_root=${XDG_CACHE_HOME:-$HOME/.cache}/mrcnn_tf2/builds
else
  build_cache_root=
fi

# build_cache_entry NAME KEY: the entry's folder.
build_cache_entry() {
  local python_version
  python_version=$("$PYTHON" -c 'import sys; print(sys.version)')
  printf '%s/%s-%s' "$build_cache_root" "$1" \
    "$(printf '%s\n' "$2" "$python_version" "$(uname -m)" | sha256sum | cut -c1-32)"
}

# build_cache_get NAME KEY DEST: copies the entry's files into the folder DEST (each under a temporary name,
# then renamed) and prints their names; status 1 when the cache is off or has no such entry.
build_cache_get() {
  [ -n "$build_cache_root" ] || return 1
  local entry file
  entry=$(build_cache_entry "$1" "$2")
  [ -d "$entry" ] || return 1
  for file in "$entry"/*; do
    cp "$file" "$3/.$(basename "$file").tmp" && mv "$3/.$(basename "$file").tmp" "$3/$(basename "$file")" || return 1
    basename "$file"
  done
}

# build_cache_put NAME KEY FILE...: stores the files as the entry (kept if one exists). A cache that cannot be
# written is skipped with a warning: the build has succeeded.
build_cache_put() {
  local name=$1 key=$2 entry temporary
  shift 2
  [ -n "$build_cache_root" ] || return 0
  entry=$(build_cache_entry "$name" "$key")
  [ -d "$entry" ] && return 0
  if mkdir -p "$build_cache_root" && temporary=$(mktemp -d "$build_cache_root/.$name.XXXXXX") \
      && cp "$@" "$temporary/" && chmod 755 "$temporary" && mv -T "$temporary" "$entry" 2>/dev/null; then
    return 0
  fi
  [ -z "${temporary:-}" ] || rm -rf "$temporary"
  [ -d "$entry" ] || echo "[build cache] warning: could not store $name in $build_cache_root" >&2
}

# build_cache_drop NAME KEY: removes the entry (one that was taken and did not work).
build_cache_drop() {
  [ -z "$build_cache_root" ] || rm -rf "$(build_cache_entry "$1" "$2")"
}
