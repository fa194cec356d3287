# Two commands: `make demo` (the main job) and `make test` (the tests). Both install what they
# need into .venv first, idempotently: the CPU build of torch, then the project with its extras.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
# The CPU build of torch; override for a GPU host: make TORCH="torch==2.13.0+cu128" ...
TORCH ?= torch==2.13.0

.PHONY: install demo test lint typecheck bench clean

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet "$(TORCH)"
	$(PY) -m pip install --quiet -e ".[dev]"
	touch $(STAMP)

install: $(STAMP)

demo: install
	$(VENV)/bin/stepline demo

lint: install
	$(VENV)/bin/ruff check app tasks scheduler workers tests

typecheck: install
	$(VENV)/bin/mypy --strict scheduler workers
	$(VENV)/bin/mypy app tasks

test: install lint typecheck
	$(PY) -m pytest -q tests

bench: install
	$(PY) tests/bench/bench_tick.py --out bench-out/tick.json

clean:
	rm -rf $(VENV) .stepline bench-out
