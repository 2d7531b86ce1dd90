"""The set-up's build cache (scripts/build_cache.sh): what ops/build.sh and scripts/build_horovod.sh compile is kept
per user and taken by the next clone or venv of the same inputs, and a failed or other build never is."""

import os
import shutil
import subprocess
import sys

from tests.support import ROOT


def cache_call(cache, *commands, check=True, env=None):
    """Runs bash `commands` (one string each) after sourcing the cache helper with MRCNN_TF2_BUILD_CACHE=cache (or,
    given, the environment `env`)."""
    script = "\n".join(["set -euo pipefail", f"source {ROOT}/scripts/build_cache.sh", *commands])
    return subprocess.run(["bash", "-c", script], capture_output=True, text=True, check=check,
                          env=env or {**os.environ, "PYTHON": sys.executable, "MRCNN_TF2_BUILD_CACHE": str(cache)})


def test_an_entry_is_taken_by_its_key_only_and_a_failed_store_leaves_none(tmp_path):
    cache, built, taken = tmp_path / "cache", tmp_path / "built", tmp_path / "taken"
    built.mkdir()
    taken.mkdir()
    (built / "lib.so").write_bytes(b"\x7fELF library")
    (built / "info.json").write_text('{"tensorflow": "2.21.0"}')
    cache_call(cache, f"build_cache_put ops key-1 {built}/lib.so {built}/info.json")
    result = cache_call(cache, f"build_cache_get ops key-1 {taken}")
    assert sorted(result.stdout.split()) == ["info.json", "lib.so"]
    assert sorted(os.listdir(taken)) == ["info.json", "lib.so"]
    assert (taken / "lib.so").read_bytes() == b"\x7fELF library"
    # Another key (sources, TF version, ...) or name misses.
    assert cache_call(cache, f"build_cache_get ops key-2 {taken}", check=False).returncode == 1
    assert cache_call(cache, f"build_cache_get horovod key-1 {taken}", check=False).returncode == 1
    # A store whose files cannot all be copied leaves no entry and does not fail the build.
    result = cache_call(cache, f"build_cache_put ops key-3 {built}/lib.so {built}/missing.so")
    assert "could not store ops" in result.stderr
    assert cache_call(cache, f"build_cache_get ops key-3 {taken}", check=False).returncode == 1
    assert [name for name in os.listdir(cache) if name.startswith(".")] == []
    # A dropped entry is gone; off (an empty folder name), nothing is stored or taken.
    cache_call(cache, "build_cache_drop ops key-1")
    assert cache_call(cache, f"build_cache_get ops key-1 {taken}", check=False).returncode == 1
    cache_call("", f"build_cache_put ops key-1 {built}/lib.so")
    assert cache_call("", f"build_cache_get ops key-1 {taken}", check=False).returncode == 1
    assert os.listdir(cache) == []
    # Without a home folder (and no other setting) the cache is off rather than the set-up failing.
    homeless = {"PATH": os.environ["PATH"], "PYTHON": sys.executable}
    result = cache_call(None, f"build_cache_put ops key-1 {built}/lib.so", 'echo "root=[$build_cache_root]"',
                        env=homeless)
    assert result.stdout.strip() == "root=[]" and result.stderr == ""


def test_the_fused_ops_build_of_the_same_sources_is_taken_from_the_cache_without_compiling(tmp_path):
    """ops/build.sh in a copy of the repository's ops/, compiled by a stand-in g++ that logs its calls: the first
    build compiles and stores the library, a clean copy then takes it and compiles nothing, and a changed
    source compiles again."""
    clone, cache, bin_dir = tmp_path / "clone", tmp_path / "cache", tmp_path / "bin"
    for folder in ("ops", "scripts"):
        (clone / folder).mkdir(parents=True)
    for name in os.listdir(os.path.join(ROOT, "ops")):
        if name.endswith((".cc", ".h", ".sh")):
            shutil.copy(os.path.join(ROOT, "ops", name), clone / "ops")
    shutil.copy(os.path.join(ROOT, "scripts", "build_cache.sh"), clone / "scripts")
    bin_dir.mkdir()
    calls = tmp_path / "gxx_calls"
    (bin_dir / "g++").write_text(f'#!/bin/bash\necho "$*" >> {calls}\n'
                                 'while [ $# -gt 0 ]; do [ "$1" = -o ] && echo "built by $*" > "$2"; shift; done\n')
    (bin_dir / "g++").chmod(0o755)
    env = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}", "MRCNN_TF2_BUILD_CACHE": str(cache)}

    def build():
        result = subprocess.run(["bash", str(clone / "ops" / "build.sh"), sys.executable], env=env,
                                capture_output=True, text=True, timeout=300)
        assert result.returncode == 0, result.stderr
        compiled = len(calls.read_text().splitlines()) if calls.exists() else 0
        calls.unlink(missing_ok=True)
        return result.stdout, compiled

    out, compiled = build()
    sources = len([name for name in os.listdir(clone / "ops") if name.endswith(".cc")])
    assert "compiling" in out and compiled == sources + 1  # each source, then the link
    library = (clone / "ops" / "build" / "libmrcnn_ops.so").read_bytes()
    shutil.rmtree(clone / "ops" / "build")  # a fresh clone
    out, compiled = build()
    assert "taken from the build cache" in out and compiled == 0
    assert (clone / "ops" / "build" / "libmrcnn_ops.so").read_bytes() == library
    assert '"tensorflow"' in (clone / "ops" / "build" / "BUILD_INFO.json").read_text()
    out, compiled = build()  # the stamp is current: nothing at all
    assert out == "" and compiled == 0
    with open(clone / "ops" / "roi_align_op.cc", "a") as f:
        f.write("// changed\n")
    out, compiled = build()
    assert "compiling" in out and compiled == sources + 1
