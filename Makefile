# Two commands do everything on a fresh machine:
#   make run    venv + install + model fetch + python 04_engine.py
#   make test   venv + install + model fetch + the whole test suite (incl. the strict book build),
#               then the exercises' shipped solutions (exercises/README.md)
# and one retakes the book's headline numbers on this machine, CPU only (book/results.md):
#   make results        quick: about 10 minutes on a quiet 2-core machine (estimated from the captures)
#   make results-full   the chapters' own workloads: 1 to 2 hours there (the report says how long it took)
#   PEERS=1 make results    vLLM's CPU build beside ours too (installed apart: kit/peers.py)
PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin
PY     := $(BIN)/python
STAMP  := $(VENV)/.installed

.PHONY: install model run setup test test-fast book book-build book-outputs results results-full help clean

# constraints.txt pins the versions the book and the tests were run with (scripts/make_constraints.py)
$(STAMP): pyproject.toml constraints.txt scripts/install_torch.sh
	$(PYTHON) -m venv $(VENV)
	bash scripts/install_torch.sh $(PY)
	$(PY) -m pip install --disable-pip-version-check -q -c constraints.txt -e ".[dev]"
	touch $(STAMP)

install: $(STAMP)

model: install
	$(PY) -c "import importlib; importlib.import_module('01_setup').provision_default_model()"

run: model
	$(PY) 04_engine.py

setup: install
	$(PY) 01_setup.py

test: model
	$(PY) -m pytest -q
	EXERCISES=solutions $(PY) -m pytest -q exercises

test-fast: install
	$(PY) -m pytest -q -m "not real_model"

book-outputs: model
	$(PY) scripts/capture_outputs.py

# Median of 3 alternating runs per entry, with the range; writes book/outputs/results.txt
RESULTS_FLAGS := $(if $(PEERS),--peers,)
results: model
	$(PY) scripts/results.py $(RESULTS_FLAGS)

results-full: model
	$(PY) scripts/results.py --full $(RESULTS_FLAGS)

help:
	@sed -n '1,/^PYTHON/p' Makefile | grep '^#'

# Material prints an end-of-life banner on every mkdocs run; the variable is its documented off switch.
book: install
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs serve

book-build: install
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs build --strict

clean:
	rm -rf $(VENV) site .pytest_cache
