# The README's two commands: `make demo` (the main job on the embedded data) and `make test`.
# Both run the set-up first; it is idempotent and takes seconds once done. The demo trains in one process
# and leaves Horovod's build (minutes) to `make setup` / `make test`.
.PHONY: setup demo test

setup:
	@bash scripts/setup.sh

demo:
	@SETUP_HOROVOD=0 bash scripts/setup.sh
	@.venv/bin/python scripts/demo.py

test: setup
	@.venv/bin/python -m pytest
