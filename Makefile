# make demo   installs minispec into .venv and runs the SmolLM2 demo
# make test   installs minispec with its dev extras into .venv and runs the tests and the notebooks (fast mode)
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin

.PHONY: install demo test check-env clean

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip

install: $(BIN)/python
	$(BIN)/pip install -q -e ".[dev]"

demo: install
	$(BIN)/python -m minispec demo

check-env: install
	$(BIN)/python -m minispec check-env

test: install
	$(BIN)/python -m minispec check-env
	$(BIN)/python tools/make_exercises.py --check
	$(BIN)/python -m pytest
	MINISPEC_FAST=1 $(BIN)/python -m pytest --nbmake notebooks

clean:
	rm -rf $(VENV) *.egg-info .pytest_cache
