# The two commands of the README:  make demo  |  make test
# `make demo` needs Python only: `setup` creates .venv and installs nothing else. The system
# packages (Debian's Slurm, munge and MariaDB for the local cluster; g++ for DeepSpeed's CPU
# extension) are installed, when missing, by the targets that need them (install-deps.sh:
# as root or with sudo; else it prints the apt-get command and that target stops).
SHELL := /bin/bash
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
export TORCH_EXTENSIONS_DIR ?= $(CURDIR)/.cache/torch_extensions

.PHONY: setup demo test test-fast cluster-up cluster-down cluster-status cluster-env bench clean

DEPS := bash slurm/cluster/install-deps.sh

## setup: .venv with the project (idempotent; no system packages)
setup: $(STAMP)

$(STAMP): pyproject.toml constraints-cpu.txt
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip >/dev/null
	$(BIN)/python -m pip install -q -c constraints-cpu.txt --config-settings editable_mode=compat -e '.[dev,eval,float8]'
	touch $(STAMP)

## demo: train the tiny model with DDP on 2 local ranks (no Slurm) and print a summary
demo: setup
	$(BIN)/python -m launcher $(ARGS)

## test: the whole suite, with the real local Slurm cluster started for it (tests/run_suite.sh:
## five pytest processes: the tests without Slurm in two runs, beside the Slurm tests in two
## runs on a node pair each, then the tests that need the whole cluster). Installs the Slurm
## packages and g++ first when they are missing.
test: setup
	$(DEPS) slurm build
	bash slurm/cluster/up.sh
	status=0; PYTHON=$(BIN)/python bash tests/run_suite.sh $(PYTEST_ARGS) || status=$$?; \
	  bash slurm/cluster/down.sh || true; exit $$status

## test-fast: the tests that need no Slurm cluster (g++ installed first when missing)
test-fast: setup
	$(DEPS) build
	$(BIN)/python -m pytest -m "not slurm" $(PYTEST_ARGS)

## test-gpu: the tests marked `gpu`, with CUDA kept visible (STO_TEST_GPU=1; every other
## test hides it). On a machine with CUDA; GPU_PYTHON=python3 takes that machine's own torch.
GPU_PYTHON ?= $(BIN)/python
.PHONY: test-gpu
test-gpu:
	STO_TEST_GPU=1 $(GPU_PYTHON) -m pytest -m gpu $(PYTEST_ARGS)

## test-torch-floor: the multi-rank strategy, checkpoint (both DCP readers) and Hugging Face
## tests on the lowest torch supported (constraints-floor.txt; train/torch_compat.py), in
## .venv-floor: PyPI's CUDA wheel (about 3 GB with its nvidia-* packages) runs on CPU, CUDA
## hidden. The cases that go through torch's APIs, one per engine rather than every case (all
## of them: 15 minutes; this set: under 10 on 2 cores); left out: signals, DeepSpeed's own
## checkpoints and conversion. A test id that no longer exists fails the run (pytest exits
## 4), as does a run that collects nothing (5).
FLOOR_VENV := .venv-floor
FLOOR_STAMP := $(FLOOR_VENV)/.installed
FLOOR_TESTS := tests/test_torch_compat.py tests/test_checkpoint_reader.py tests/test_checkpoint_snapshot.py \
  $(foreach t,periodic_checkpoints_are_committed_and_pruned kill_during_save_keeps_previous_and_resumes_exactly \
    rank1_share_of_the_checksums_is_verified_on_resume truncated_or_corrupt_checkpoint_is_skipped \
    async_save_commits_and_does_not_change_training checkpoint_on_demand,tests/test_checkpoint.py::test_$(t)) \
  $(foreach c,ddp-1x4 ddp-1x2-compile fsdp-1x2-compile fsdp-1x2-48 hsdp-2x2-2 zero2-1x2-2 zero3-1x2-48 tp-1x2 \
    fsdp_tp-1x2-selective fsdp_tp-1x2-full pp-1x2-interleaved_1f1b pp_fsdp_tp-1x4-full,'tests/test_strategies.py::test_matches_single_process[$(c)]') \
  $(foreach c,fsdp tp,'tests/test_resume_strategies.py::test_kill_in_save_then_resume_is_exact[$(c)]') \
  tests/test_reshard.py::test_fsdp_resumed_with_tensor_parallel \
  tests/test_hf.py::test_forward_matches_transformers tests/test_hf.py::test_bad_checkpoints_are_refused_naming_what_is_wrong \
  $(foreach c,fsdp zero3 tp pp,'tests/test_hf.py::test_import_then_export_gives_back_the_tensors[$(c)]') \
  'tests/test_hf.py::test_trained_export_loads_in_transformers_with_our_logits[fsdp]' \
  tests/test_context_parallel.py tests/test_lora.py::test_fsdp_lora_trains_as_peft_and_exports_for_it tests/test_float8.py
.PHONY: test-torch-floor
test-torch-floor: $(FLOOR_STAMP)
	$(DEPS) build
	CUDA_VISIBLE_DEVICES= TORCH_EXTENSIONS_DIR=$(CURDIR)/.cache/torch_extensions_floor \
	  $(FLOOR_VENV)/bin/python -m pytest -m "not slurm" -p no:cacheprovider $(FLOOR_TESTS) $(PYTEST_ARGS)

$(FLOOR_STAMP): pyproject.toml constraints-floor.txt
	test -x $(FLOOR_VENV)/bin/python || $(PYTHON) -m venv $(FLOOR_VENV)
	$(FLOOR_VENV)/bin/python -m pip install -q --upgrade pip >/dev/null
	$(FLOOR_VENV)/bin/python -m pip install -q -c constraints-floor.txt --config-settings editable_mode=compat -e '.[dev,eval,float8]'
	$(FLOOR_VENV)/bin/python -c "import torch; from train.torch_compat import FLOOR, torch_version; \
	  assert torch_version() == FLOOR, f'{torch.__version__} installed, floor {FLOOR}'"
	touch $@

## cluster-up: start the local Slurm cluster (its packages installed first when missing)
cluster-up: setup
	$(DEPS) slurm
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
## gpu-check: the CUDA paths for real on this machine's GPU(s), about 4 minutes on one
## H100/H200 (bench/gpu_check.py; table in GPU_CHECK_OUT, default runs/gpu-check). Runs with
## the machine's own python3 and torch; wheels from `make gpu-wheels` fill in the rest.
gpu-check:
	bash bench/gpu_check.sh $(GPU_CHECK_ARGS)

## gpu-wheels: build .whl/ (pure-Python dependencies + CPython 3.12 wheels) for a GPU machine
gpu-wheels: setup
	bash bench/gpu_wheels.sh
