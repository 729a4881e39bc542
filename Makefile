# The two commands a newcomer runs: `make demo` and `make test`.
# Each creates .venv if it is missing and installs the CPU build of torch and
# partita with its test extras first. `make test` also installs Debian's
# Chromium (as root, via apt-get) for the plan viewer's browser tests.

PYTHON ?= $(shell command -v python3.11 || command -v python3)
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.partita-installed
# setuptools' notice that an editable install maps folders by name (core/ -> partita.core): by design here
QUIET  := PYTHONWARNINGS="ignore:Editable installation"
# the project's own folders: a user's scripts saved in the root are theirs to lint
SOURCES := core passes runtime compiler partita tests benchmarks examples docs

.PHONY: demo test check lint bench install browser clean test-oldest

install: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	# The CPU build of torch, pinned: a plain `torch` would pull a multi-GB CUDA build.
	$(BIN)/python -m pip install -q torch==2.13.0
	$(QUIET) $(BIN)/python -m pip install -q -e '.[test]'
	touch $(STAMP)

# Playwright drives Debian's chromium (never `playwright install`, which downloads a browser).
browser:
	@test -x /usr/bin/chromium || { \
	  if [ "$$(id -u)" = 0 ]; then apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium >/dev/null; \
	  else echo "note: install Debian's chromium (sudo apt-get install chromium) to run the browser tests"; fi; }

demo: $(STAMP)
	$(BIN)/partita demo

# The linter (ruff, configured in pyproject.toml) over the project's own folders.
lint: $(STAMP)
	$(BIN)/ruff check $(SOURCES)

# tests/unit on every core (pytest-xdist; each test takes one, and a worker steals queued tests when
# idle). tests/integration on two workers, whatever the cores: each keeps rank groups of its own (up to
# 6 processes, ~1 GB each once they have run models), and two keep 2 cores busy (97%, against 75% for
# one, whose ranks wait on each other and on the test's own planning).
UNIT        := -q -p no:logging -n auto --dist worksteal tests/unit
INTEGRATION := -q -p no:logging -n 2 --dist worksteal

# Everything: tests/unit (no process of its own), then tests/integration (gloo ranks, launchers, the CLI as a
# command, the browser), with the 30 slowest tests listed.
test: $(STAMP) browser lint
	$(BIN)/python -m pytest $(UNIT) --durations=15
	$(BIN)/python -m pytest $(INTEGRATION) --durations=30 tests/integration

# The fast tier for a developer's loop: the linter, then tests/unit (no process group, no subprocess).
check: $(STAMP) lint
	$(BIN)/python -m pytest $(UNIT)

# The oldest supported torch and transformers (pyproject's lower bounds; the torch GPU images ship):
# tests/unit and the multi-process runs of every axis, in a second environment kept in the user's
# cache (torch 2.11 comes only as a CUDA build, 4.6 GB and 10-25 minutes to install, so it is reused).
OLDEST_TORCH        := 2.11.0
OLDEST_TRANSFORMERS := 5.15.1
OLD_VENV            ?= $(HOME)/.cache/partita/venv-torch-$(OLDEST_TORCH)
# every axis (dp, tp, sp, pp with each schedule, ZeRO-1/2/3, recomputation, offload) on the example
# models and HF GPT-2 / Llama; experts; bf16-mixed; the HF families on every plan
OLD_RUNS            := tests/integration/test_plan_matrix.py tests/integration/test_expert_parallel.py \
                       tests/integration/test_mixed_precision.py tests/integration/test_any_model.py

test-oldest:
	test -x $(OLD_VENV)/bin/python || { rm -rf $(OLD_VENV); mkdir -p $(dir $(OLD_VENV)); $(PYTHON) -m venv $(OLD_VENV); }
	$(OLD_VENV)/bin/python -c "import torch; assert torch.__version__.startswith('$(OLDEST_TORCH)')" 2>/dev/null \
	  || $(OLD_VENV)/bin/python -m pip install -q torch==$(OLDEST_TORCH)
	$(QUIET) $(OLD_VENV)/bin/python -m pip install -q -e '.[test]' transformers==$(OLDEST_TRANSFORMERS)
	$(OLD_VENV)/bin/python -m pytest $(UNIT)
	$(OLD_VENV)/bin/python -m pytest $(INTEGRATION) $(OLD_RUNS)

bench: $(STAMP)
	$(BIN)/python benchmarks/dp_vs_ddp.py
	$(BIN)/python benchmarks/predicted_vs_measured.py
	$(BIN)/python benchmarks/capture_llama70b.py

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache
