# Two commands: `make demo` (the main job) and `make test` (the tests). Both install what they
# need into .venv first, idempotently: the CPU build of torch, then the project with its extras.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
# The CPU build of torch; override for a GPU host: make TORCH="torch==2.13.0+cu128" ...
TORCH ?= torch==2.13.0

.PHONY: install browser demo test lint typecheck bench clean

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet "$(TORCH)"
	$(PY) -m pip install --quiet -e ".[dev]"
	touch $(STAMP)

install: $(STAMP)

# The dashboard test's browser: Debian's chromium and its chromedriver (selenium downloads none).
# Root (CI) installs them; elsewhere sudo without a password may, else the test is skipped.
browser:
	@if [ ! -x /usr/bin/chromium ] || [ ! -x /usr/bin/chromedriver ]; then \
	  if [ "$$(id -u)" = 0 ]; then SUDO=; else SUDO="sudo -n"; fi; \
	  { $$SUDO apt-get update -qq && $$SUDO env DEBIAN_FRONTEND=noninteractive \
	    apt-get install -y -qq chromium chromium-driver; } \
	  || echo "chromium not installed: the dashboard browser test is skipped (fails under CI)"; \
	fi

demo: install
	$(VENV)/bin/stepline demo

lint: install
	$(VENV)/bin/ruff check app tasks scheduler workers tests

typecheck: install
	$(VENV)/bin/mypy --strict scheduler workers
	$(VENV)/bin/mypy app tasks

test: install browser lint typecheck
	$(PY) -m pytest -q tests

bench: install
	$(PY) tests/bench/bench_tick.py --out bench-out/tick.json

clean:
	rm -rf $(VENV) .stepline bench-out
