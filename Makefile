# The two commands of the README:  make demo  |  make test
SHELL := /bin/bash
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
export TORCH_EXTENSIONS_DIR ?= $(CURDIR)/.cache/torch_extensions

.PHONY: setup demo test test-fast cluster-up cluster-down cluster-status cluster-env bench clean

## setup: Debian's Slurm packages (when missing) + .venv with the project (idempotent)
setup: $(STAMP)

$(STAMP): pyproject.toml constraints-cpu.txt slurm/cluster/install-deps.sh
	bash slurm/cluster/install-deps.sh
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip >/dev/null
	$(BIN)/python -m pip install -q -c constraints-cpu.txt --config-settings editable_mode=compat -e '.[dev]'
	touch $(STAMP)

## demo: train the tiny model with DDP on 2 local ranks (no Slurm) and print a summary
demo: setup
	$(BIN)/python -m launcher $(ARGS)

## test: the whole suite, with the real local Slurm cluster started for it. The Slurm
## tests run one after another beside the rest (tests/run_suite.sh: two pytest processes).
test: setup
	bash slurm/cluster/up.sh
	status=0; PYTHON=$(BIN)/python bash tests/run_suite.sh $(PYTEST_ARGS) || status=$$?; \
	  bash slurm/cluster/down.sh || true; exit $$status

## test-fast: the tests that need no Slurm cluster
test-fast: setup
	$(BIN)/python -m pytest -m "not slurm" $(PYTEST_ARGS)

## test-gpu: the tests marked `gpu`, with CUDA kept visible (STO_TEST_GPU=1; every other
## test hides it). On a machine with CUDA; GPU_PYTHON=python3 takes that machine's own torch.
GPU_PYTHON ?= $(BIN)/python
.PHONY: test-gpu
test-gpu:
	STO_TEST_GPU=1 $(GPU_PYTHON) -m pytest -m gpu $(PYTEST_ARGS)

cluster-up: setup
	bash slurm/cluster/up.sh

cluster-down:
	bash slurm/cluster/down.sh

cluster-status:
	bash slurm/cluster/status.sh

cluster-env:
	@bash slurm/cluster/env.sh

bench: setup
	$(BIN)/python bench/launch.py

clean:
	rm -rf runs multirun .pytest_cache

.PHONY: gpu-check gpu-wheels
## gpu-check: the CUDA paths for real on this machine's GPU(s), under 5 minutes on one
## H100/H200 (bench/gpu_check.py; table in GPU_CHECK_OUT, default runs/gpu-check). Runs with
## the machine's own python3 and torch; wheels from `make gpu-wheels` fill in the rest.
gpu-check:
	bash bench/gpu_check.sh $(GPU_CHECK_ARGS)

## gpu-wheels: build .whl/ (pure-Python dependencies + CPython 3.12 wheels) for a GPU machine
gpu-wheels: setup
	bash bench/gpu_wheels.sh
