# Two commands do everything on a fresh machine:
#   make run    venv + install + model fetch + python 04_engine.py
#   make test   venv + install + model fetch + the whole test suite (incl. the strict book build),
#               then the exercises' shipped solutions (exercises/README.md)
PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin
PY     := $(BIN)/python
STAMP  := $(VENV)/.installed

.PHONY: install model run setup test test-fast book book-build book-outputs clean

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

# Material prints an end-of-life banner on every mkdocs run; the variable is its documented off switch.
book: install
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs serve

book-build: install
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs build --strict

clean:
	rm -rf $(VENV) site .pytest_cache
