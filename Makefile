# The README's two commands: `make demo` (the main job on the embedded data) and `make test`.
# Both run the set-up first; it is idempotent and takes seconds once done.
.PHONY: setup demo test

setup:
	@bash scripts/setup.sh

demo: setup
	@.venv/bin/python scripts/demo.py

test: setup
	@.venv/bin/python -m pytest
