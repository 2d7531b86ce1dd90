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
# TensorFlow's own kernels: TensorFlow's default on CPUs without AVX512-VNNI, AVX512-BF16 or AMX. Two pytest-xdist
# workers share the machine's cores (docs/TESTING.md); the wall time of both passes is printed at the end. What
# TensorFlow's kernels do not compute (generated data, converted weights, torch's outputs) both passes share,
# in MRCNN_TF2_TEST_SHARED_DIR (tests/support.py's built_once).
PYTEST = .venv/bin/python -m pytest -n 2 --dist loadgroup
test: setup
	@start=$$(date +%s); status=0; export MRCNN_TF2_TEST_SHARED_DIR=$$(mktemp -d); \
	TF_ENABLE_ONEDNN_OPTS=1 $(PYTEST) || status=$$?; \
	if [ $$status = 0 ]; then TF_ENABLE_ONEDNN_OPTS=0 $(PYTEST) -m onednn || status=$$?; fi; \
	rm -rf "$$MRCNN_TF2_TEST_SHARED_DIR"; \
	echo "[test] both passes: $$(( $$(date +%s) - start )) s wall, exit status $$status"; \
	exit $$status
