"""The GPU install path as far as a CPU-only machine can check it: `make setup GPU=1` and what it installs
(requirements-gpu.txt resolves against the registry, without installing a CUDA wheel), Horovod's build when
no CUDA toolkit is there, the Docker files, and scripts/gpu_smoke.sh run end to end with a faked GPU."""

import json
import os
import re
import subprocess
import sys

import pytest

from mrcnn_tf2.devices import FAKE_GPU_ENV
from tests.support import ROOT, SMALL_FLAGS

# Dockerfile instructions (Docker's reference).
INSTRUCTIONS = {"ADD", "ARG", "CMD", "COPY", "ENTRYPOINT", "ENV", "EXPOSE", "FROM", "HEALTHCHECK", "LABEL",
                "MAINTAINER", "ONBUILD", "RUN", "SHELL", "STOPSIGNAL", "USER", "VOLUME", "WORKDIR"}


def read_pins(path):
    """{name: version} of the `name==version` lines of a requirements file (extras dropped)."""
    pins = {}
    with open(os.path.join(ROOT, path)) as f:
        for line in f:
            match = re.match(r"^([A-Za-z0-9_.-]+)(\[[^\]]*\])?==(\S+)$", line.strip())
            if match:
                pins[match[1].lower()] = match[3]
    return pins


def dockerfile_instructions(path):
    """[(INSTRUCTION, arguments)] of a Dockerfile, continuation lines joined and comments dropped; raises
    AssertionError naming the line of anything that is not an instruction."""
    instructions, pending = [], ""
    with open(os.path.join(ROOT, path)) as f:
        for number, line in enumerate(f, 1):
            stripped = line.strip()
            if not pending and (not stripped or stripped.startswith("#")):
                continue
            pending += " " + stripped.rstrip("\\").strip()
            if stripped.endswith("\\"):
                continue
            keyword, _, arguments = pending.strip().partition(" ")
            assert keyword.upper() == keyword and keyword in INSTRUCTIONS, f"{path}:{number}: {pending.strip()!r}"
            instructions.append((keyword, arguments.strip()))
            pending = ""
    assert not pending, f"{path}: ends inside a continued line"
    return instructions


@pytest.mark.parametrize("path", ["Dockerfile", "Dockerfile.gpu"])
def test_dockerfiles_parse_and_set_up_as_a_fresh_clone(path):
    instructions = dockerfile_instructions(path)
    keywords = [keyword for keyword, _ in instructions]
    assert "FROM" in keywords and set(keywords[:keywords.index("FROM")]) <= {"ARG"}, keywords
    runs = " ".join(arguments for keyword, arguments in instructions if keyword == "RUN")
    assert "make setup" in runs
    assert ("GPU=1" in runs) == (path == "Dockerfile.gpu")
    # The test-only torch stays out of the images.
    assert "SETUP_TEST_DEPS=0" in runs


def test_the_gpu_image_has_the_cuda_of_the_gpu_requirements_and_a_python_the_pins_need():
    instructions = dockerfile_instructions("Dockerfile.gpu")
    (image,) = [arguments.split("=", 1)[1] for keyword, arguments in instructions
                if keyword == "ARG" and arguments.startswith("CUDA_IMAGE=")]
    assert ("FROM", "${CUDA_IMAGE}") in instructions
    cuda = re.match(r"nvidia/cuda:(\d+)\.(\d+)\.\d+-(cudnn-)?devel-ubuntu", image)
    assert cuda, f"{image}: not an NVIDIA CUDA development image (Horovod's NCCL build needs nvcc)"
    runtime = read_pins("requirements-gpu.txt")["nvidia-cuda-runtime-cu12"]
    assert runtime.split(".")[:2] == [cuda[1], cuda[2]], (image, runtime)
    runs = " ".join(arguments for keyword, arguments in instructions if keyword == "RUN")
    assert "python3.11-venv" in runs and "PYTHON=python3.11" in runs
    assert ("ENV", "CUDA_HOME=/usr/local/cuda") in instructions


def test_gpu_requirements_pin_tensorflow_of_requirements_txt_with_its_cuda_extra():
    cpu, gpu = read_pins("requirements.txt"), read_pins("requirements-gpu.txt")
    assert gpu["tensorflow"] == cpu["tensorflow"]
    with open(os.path.join(ROOT, "requirements-gpu.txt")) as f:
        lines = [line.strip() for line in f if line.strip() and not line.startswith("#")]
    assert "-r requirements.txt" in lines and f"tensorflow[and-cuda]=={cpu['tensorflow']}" in lines


@pytest.mark.timeout(300)  # pip resolves the CUDA wheels' metadata from the registry
@pytest.mark.slow
def test_gpu_requirements_resolve_against_the_registry_without_installing(tmp_path):
    """pip resolves requirements-gpu.txt (TensorFlow's and-cuda ranges accept each CUDA pin) and reports what it
    would install; --dry-run installs nothing. fast-deps reads each wheel's metadata with ranged requests: the
    registry serves no separate metadata files, and a whole download of the CUDA wheels is several GB."""
    def installed():
        listed = subprocess.run([sys.executable, "-m", "pip", "list", "--format", "json",
                                 "--disable-pip-version-check"], capture_output=True, text=True, check=True).stdout
        return {package["name"].lower(): package["version"] for package in json.loads(listed)}

    before = installed()
    report = tmp_path / "report.json"
    result = subprocess.run([sys.executable, "-m", "pip", "install", "--dry-run", "--ignore-installed", "--quiet",
                             "--use-feature=fast-deps", "--disable-pip-version-check", "--report", str(report), "-r",
                             "requirements-gpu.txt"],
                            cwd=ROOT, capture_output=True, text=True)
    assert result.returncode == 0, result.stderr[-3000:]
    resolved = {item["metadata"]["name"].lower(): item["metadata"]["version"]
                for item in json.loads(report.read_text())["install"]}
    for name, version in read_pins("requirements-gpu.txt").items():
        assert resolved.get(name) == version, (name, version, resolved.get(name))
    assert installed() == before


def test_make_setup_gpu_sets_the_gpu_install():
    # Under `make test` the variables of the outer make would make this one print its directory.
    env = {name: value for name, value in os.environ.items() if name not in ("MAKEFLAGS", "MAKELEVEL", "MFLAGS")}

    def setup_line(*args):
        result = subprocess.run(["make", "--no-print-directory", "-n", "setup", *args], cwd=ROOT, env=env,
                                capture_output=True, text=True, check=True)
        return result.stdout.strip()

    assert setup_line("GPU=1") == "SETUP_GPU=1 bash scripts/setup.sh"
    assert setup_line() == setup_line("GPU=0") == "SETUP_GPU=0 bash scripts/setup.sh"


def test_horovod_build_without_a_cuda_toolkit_says_why_and_keeps_the_cpu_build(tmp_path):
    """SETUP_GPU=1 where no nvcc is: the explanation, then the CPU operations' build (here the installed one,
    whose stamp is current: nothing is rebuilt)."""
    env = {**os.environ, "SETUP_GPU": "1", "CUDA_HOME": str(tmp_path / "no-cuda")}
    python = os.path.join(ROOT, ".venv", "bin", "python")
    result = subprocess.run(["bash", "scripts/build_horovod.sh", python], cwd=ROOT, env=env, capture_output=True,
                            text=True, timeout=1200)
    assert result.returncode == 0, result.stderr[-3000:]
    assert f"GPU=1, but no CUDA toolkit: {tmp_path}/no-cuda/bin/nvcc is missing" in result.stderr
    assert "building the CPU operations only" in result.stderr
    assert "building horovod" not in result.stdout, "the CPU build's stamp should have been current"


@pytest.mark.timeout(600)  # ten processes, float16 and XLA on the CPU
@pytest.mark.slow
def test_gpu_smoke_script_runs_every_stage_with_a_faked_gpu(tmp_path):
    """The smoke script end to end on the CPU, the GPU's choices faked, at a tiny size: float16 with loss
    scaling and XLA as on a GPU, each stage's check, and the table. The heads are small: float16 on a CPU is
    Eigen's emulated half precision, in which the default box head took 16 s to build the model for inference."""
    env = {**os.environ, FAKE_GPU_ENV: "1", "SMOKE_IMAGE_SIZE": "64 64", "SMOKE_TRAIN_BATCH": "1",
           "SMOKE_EVAL_BATCH": "1", "SMOKE_BACKBONE": "resnet18", "SMOKE_BENCHMARK_STEPS": "1",
           "SMOKE_WARMUP_STEPS": "1", "SMOKE_TRAIN_STEPS": "3", "SMOKE_NUM_VAL": "2", "PYTHON": sys.executable,
           "SMOKE_MODEL_FLAGS": " ".join(SMALL_FLAGS[SMALL_FLAGS.index("--config_override"):]
                                         + ["--config_override", "model.mrcnn_head_num_filters=32"])}
    out = tmp_path / "smoke"
    result = subprocess.run(["bash", "scripts/gpu_smoke.sh", str(out)], cwd=ROOT, env=env, capture_output=True,
                            text=True, timeout=1800)
    assert result.returncode == 0, (result.stdout[-3000:], result.stderr[-3000:])
    stdout = result.stdout
    for stage in range(1, 8):
        assert f"== gpu_smoke {stage}/7" in stdout
    assert "--amp policy: mixed_float16" in stdout
    assert "policy mixed_float16 | ops on the GPU: convs by TensorFlow's convolutions" in stdout
    assert re.search(r"\d+ of 3 steps skipped by the loss scaling", stdout)
    assert "gpu_smoke: all stages passed. Throughput at 64x64, img/s:" in stdout
    rows = {line.split()[0]: line.split() for line in stdout.splitlines()
            if line.startswith(("train (", "inference ("))}
    assert rows["train"][3:5] == ["1", "mixed_float16"] and float(rows["train"][5]) > 0, rows
    assert rows["inference"][2:4] == ["1", "mixed_float16"] and float(rows["inference"][4]) > 0, rows
    assert (out / "model" / "eval_results.json").exists() and (out / "inference" / "predictions.json").exists()


def test_gpu_smoke_script_stops_where_there_is_no_gpu(tmp_path):
    env = {**os.environ, FAKE_GPU_ENV: "0", "PYTHON": sys.executable}
    result = subprocess.run(["bash", "scripts/gpu_smoke.sh", str(tmp_path / "smoke")], cwd=ROOT, env=env,
                            capture_output=True, text=True, timeout=600)
    assert result.returncode == 1
    assert "gpu_smoke: FAILED: TensorFlow sees no GPU" in result.stderr
    assert "2/7" not in result.stdout
