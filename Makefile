# The two commands a newcomer runs: `make demo` and `make test`.
# Each creates .venv if it is missing and installs the CPU build of torch and
# partita with its test extras first.

PYTHON ?= $(shell command -v python3.11 || command -v python3)
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.partita-installed

.PHONY: demo test bench install clean

install: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	# The CPU build of torch, pinned: a plain `torch` would pull a multi-GB CUDA build.
	$(BIN)/python -m pip install -q torch==2.13.0
	$(BIN)/python -m pip install -q -e '.[test]'
	touch $(STAMP)

demo: $(STAMP)
	$(BIN)/partita demo

test: $(STAMP)
	$(BIN)/python -m pytest -q

bench: $(STAMP)
	$(BIN)/python benchmarks/dp_vs_ddp.py
	$(BIN)/python benchmarks/capture_llama70b.py

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache
