# Two commands for a fresh machine: `make demo` and `make test`.
# Both create .venv and install torchfn with everything pyproject.toml names.
# TORCH picks the torch build installed first (torch >= 2.11, the floor in pyproject.toml);
# override it, e.g. `make test TORCH=torch==2.12.0`, to use another one.
# `make test-floor` runs the suite on the floor version (its own venv, .venv-floor); keep
# FLOOR_TORCH equal to the floor in pyproject.toml.
PYTHON ?= python3
TORCH ?= torch==2.13.0
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

FLOOR_TORCH ?= torch==2.11.0
FLOOR_VENV := .venv-floor

.PHONY: demo test test-all test-floor lint doctor clean

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q "$(TORCH)"
	$(PY) -m pip install -q -e ".[dev,zoo,accounting,arrow,remote]"
	touch $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/torchfn demo

test: $(STAMP)
	$(VENV)/bin/ruff check torchfn tests examples benchmarks
	$(PY) -m pytest -m "not slow" -q
	$(PY) -m pytest --doctest-modules torchfn -q -p no:cacheprovider

test-floor:
	$(MAKE) test VENV=$(FLOOR_VENV) TORCH=$(FLOOR_TORCH)

test-all: $(STAMP)
	$(PY) -m pytest -q

lint: $(STAMP)
	$(VENV)/bin/ruff check torchfn tests examples benchmarks

doctor: $(STAMP)
	$(VENV)/bin/torchfn doctor

clean:
	rm -rf $(VENV) $(FLOOR_VENV) build *.egg-info
