# Two commands for a fresh machine: `make demo` and `make test`.
# Both create .venv and install torchfn with everything pyproject.toml names.
# TORCH picks the torch build installed first (any torch >= 2.5 works);
# override it, e.g. `make test TORCH=torch==2.11.0`, to use another one.
PYTHON ?= python3
TORCH ?= torch==2.13.0
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: demo test test-all lint doctor clean

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q "$(TORCH)"
	$(PY) -m pip install -q -e ".[dev]"
	touch $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/torchfn demo

test: $(STAMP)
	$(VENV)/bin/ruff check torchfn tests examples benchmarks
	$(PY) -m pytest -m "not slow" -q
	$(PY) -m pytest --doctest-modules torchfn -q -p no:cacheprovider

test-all: $(STAMP)
	$(PY) -m pytest -q

lint: $(STAMP)
	$(VENV)/bin/ruff check torchfn tests examples benchmarks

doctor: $(STAMP)
	$(VENV)/bin/torchfn doctor

clean:
	rm -rf $(VENV) build *.egg-info
