# The README's two commands: `make demo` (the main job on the embedded data) and `make test`.
# Both run the set-up first; it is idempotent and takes seconds once done. The demo trains in one process
# and leaves Horovod's build (minutes) and the test-only torch install to `make setup` / `make test`.
.PHONY: setup demo test

# `make setup GPU=1`: TensorFlow with its CUDA libraries, Horovod with NCCL when a CUDA toolkit is present.
setup:
	@SETUP_GPU=$(if $(filter 1,$(GPU)),1,0) bash scripts/setup.sh

demo:
	@SETUP_HOROVOD=0 SETUP_TEST_DEPS=0 bash scripts/setup.sh
	@.venv/bin/python scripts/demo.py

# The suite with oneDNN's kernels, as main.py runs it, then the tests marked onednn (pytest.ini) again with
# TensorFlow's own kernels: TensorFlow's default on CPUs without AVX512-VNNI, AVX512-BF16 or AMX.
test: setup
	@TF_ENABLE_ONEDNN_OPTS=1 .venv/bin/python -m pytest
	@TF_ENABLE_ONEDNN_OPTS=0 .venv/bin/python -m pytest -m onednn
