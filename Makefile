# Two commands do all the set-up on a fresh machine (Python >= 3.10, pip):
#   make demo   build a small MoE checkpoint, load it on 8 local ranks, verify, rebalance, report
#   make test   the test suite (pure, multi-process gloo, real transformers models)
#   make lint   ruff's checks (the rules are pyproject.toml's [tool.ruff])
PY ?= python3
VENV ?= .venv
BIN := $(VENV)/bin

$(BIN)/.installed: pyproject.toml constraints.txt
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q -c constraints.txt -e ".[test]"
	touch $@

.PHONY: demo test lint bench
demo: $(BIN)/.installed
	$(BIN)/moeshard demo

test: $(BIN)/.installed
	$(BIN)/python -m pytest -q tests

lint: $(BIN)/.installed
	$(BIN)/ruff check
	$(BIN)/ruff format --check

bench: $(BIN)/.installed
	$(BIN)/python -m benchmarks.bench_load
