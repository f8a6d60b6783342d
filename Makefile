# Two commands do all the set-up on a fresh machine (Python >= 3.10, pip):
#   make demo          build a small MoE checkpoint, load it on 8 local ranks, verify, rebalance, report
#   make test          the test suite (pure, multi-process gloo, real transformers models) on the
#                      pinned releases (constraints.txt), in .venv
# And:
#   make test-latest   the same suite on the newest releases the project supports
#                      (constraints-latest.txt), in its own .venv-latest
#   make lint          ruff's checks (the rules are pyproject.toml's [tool.ruff])
PY ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
VENV_LATEST ?= .venv-latest
BIN_LATEST := $(VENV_LATEST)/bin

# $(call install,VENV,CONSTRAINTS): a fresh venv with moeshard (editable) and its test extra.
define install
$(PY) -m venv $(1)
$(1)/bin/pip install -q --upgrade pip
$(1)/bin/pip install -q -c $(2) -e ".[test]"
touch $(1)/bin/.installed
endef

$(BIN)/.installed: pyproject.toml constraints.txt
	$(call install,$(VENV),constraints.txt)

$(BIN_LATEST)/.installed: pyproject.toml constraints-latest.txt
	$(call install,$(VENV_LATEST),constraints-latest.txt)

.PHONY: demo test test-latest lint bench
demo: $(BIN)/.installed
	$(BIN)/moeshard demo

test: $(BIN)/.installed
	$(BIN)/python -m pytest -q tests

test-latest: $(BIN_LATEST)/.installed
	$(BIN_LATEST)/python -m pytest -q tests

lint: $(BIN)/.installed
	$(BIN)/ruff check
	$(BIN)/ruff format --check

bench: $(BIN)/.installed
	$(BIN)/python -m benchmarks.bench_load
