# Every target bootstraps .venv on first use; a second run installs nothing (the stamp is newer than its inputs).
SHELL := /bin/bash
# pip's output without the lines a local find-links/index configuration adds for every package; pip's status kept.
QUIET = 2>&1 | { grep -v 'is ignored: it is neither' || true; }; test $${PIPESTATUS[0]} = 0
# TORCH=lock (default): the lock's torch 2.7.0 from PyPI. TORCH=system: keep PYTHON's own torch, torchvision and
# CUDA (a GPU image's), everything else from the lock; `.venv/.torch-system` remembers the choice for later targets.
VENV ?= .venv
TORCH ?= $(if $(wildcard $(VENV)/.torch-system),system,lock)
# The marker holds PYTHON and WHEELS of that install: a reinstall after a pull needs neither again.
MARKED = $(if $(wildcard $(VENV)/.torch-system),$(shell sed -n $(1)p $(VENV)/.torch-system))
PYTHON ?= $(or $(call MARKED,1),$(if $(filter system,$(TORCH)),python3,python3.11))
# WHEELS=DIR: install from that folder alone (no index needed), as `make wheelhouse WHEELS=DIR` wrote it.
WHEELS ?= $(call MARKED,2)
PIP_FROM = $(if $(WHEELS),--no-index --find-links $(abspath $(WHEELS)))
PIP := $(VENV)/bin/pip install --quiet --disable-pip-version-check
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed-stamp
# The newest torch Composer 0.32.1 still runs with, which CI tests too (shared/runtime/stack.py TESTED_TORCH).
TORCH_NEXT ?= torch==2.11.0 torchvision==0.26.0
# test-torch-next's stand-in for a GPU image (a Python holding TORCH_NEXT) and the venv made on top of it.
NEXT_IMAGE ?= .venv-torch-next-image
NEXT_VENV ?= .venv-torch-next
# The training, resume, FSDP-consolidation and export tests CI reruns on TORCH_NEXT (docs/gpu-tests.md).
# From test_sharded_checkpoints.py only the torch-behaviour canary and the refusals (DCP differs there).
SHARDED_TESTS = tests/train/checkpoints/test_sharded_checkpoints.py
TORCH_NEXT_TESTS ?= tests/train/loop/test_fit.py tests/train/checkpoints/test_resume.py \
	tests/train/checkpoints/test_gpu_path.py tests/train/export/test_export.py tests/shared/test_stack.py \
	$(SHARDED_TESTS)::test_torch_misloads_adamw_state_of_channels_last_weights_under_fsdp \
	$(SHARDED_TESTS)::test_a_planted_metadata_pickle_is_refused_before_it_runs \
	$(SHARDED_TESTS)::test_metadata_naming_a_shard_file_outside_the_folder_is_refused

# make test / test-quick / test-torch-next run on TEST_WORKERS pytest-xdist processes (CI's 2 cores; a serial
# run left a third of them idle in waits); TEST_WORKERS=1 runs the suite in one process. --no-loadscope-reorder:
# xdist hands out the groups in tests/conftest.py's order (slow groups first), not largest test count first.
TEST_WORKERS ?= 2
XDIST = $(if $(filter-out 0 1,$(TEST_WORKERS)),-n $(TEST_WORKERS) --dist loadgroup --no-loadscope-reorder)
# The project's bytecode, written before a suite: where PYTHONDONTWRITEBYTECODE is set (this workplace's
# image and many Docker images set it) Python never caches it, and each of the suite's hundreds of
# `python -m train|encode` processes compiled the same project sources again (~0.4 s of CPU each).
BYTECODE = $(1) -m compileall -q -j 0 encode train shared tests

DATASET ?= sample
CONFIG ?= tiny
ESTIMATE ?= sd2-base
BENCH ?= quick
ARGS ?=
OUT ?= outputs

# Launch knobs shared by `make train` and `make encode` (see docs/cluster.md).
GPUS ?=
LAUNCHER ?= auto
# MASTER_ADDR / NODE_RANK make this machine one node of a hand-launched run: taken when either is given on
# make's command line, or when the environment has both. A MASTER_ADDR alone in the environment is what
# torchrun, a container or a site profile leaves behind, and would turn LAUNCHER=auto's sbatch or kubectl
# run of several nodes into a local node waiting for the others: ignored (the plan says so where it matters).
HAND_NODE = $(or $(filter command line,$(origin MASTER_ADDR) $(origin NODE_RANK)),$(and $(MASTER_ADDR),$(NODE_RANK)))
NODE_FLAGS = $(if $(NODE_RANK),--node-rank $(NODE_RANK)) $(if $(MASTER_ADDR),--master-addr $(MASTER_ADDR))
LAUNCH_FLAGS = --gpus $(or $(GPUS),1) --launcher $(LAUNCHER) $(if $(NODES),--nodes $(NODES)) \
	$(if $(GPUS_PER_NODE),--gpus-per-node $(GPUS_PER_NODE)) $(if $(IMAGE),--image $(IMAGE)) \
	$(if $(filter local auto,$(LAUNCHER)),$(if $(HAND_NODE),$(NODE_FLAGS))) \
	$(if $(EFA),--efa) $(if $(EFA_DEVICES),--efa-devices $(EFA_DEVICES)) $(if $(DRY_RUN),--dry-run) $(LAUNCH_ARGS)

.DEFAULT_GOAL := help
.PHONY: help install wheelhouse torch-mode torch-next-venv test-torch-next demo test test-quick test-gpu lint format encode encode-gc train export bench estimate tiny-vae lock clean

help:  ## list targets
	@grep -E '^[a-z-]+:.*## ' $(MAKEFILE_LIST) | sed 's/:.*## /\t/' | column -t -s '	'

$(STAMP): pyproject.toml requirements.lock | torch-mode
ifeq ($(TORCH),system)
	@$(PYTHON) -m shared.runtime.stack check $(if $(ALLOW_UNTESTED),--allow-untested)
	@test -x $(BIN)/python || $(PYTHON) -m venv --system-site-packages $(VENV)
	@# PYTHON may itself be a venv's interpreter, whose packages a venv made from it does not see: name them.
	@($(PYTHON) -m shared.runtime.stack site-dirs && pwd) > "$$($(BIN)/python -m shared.runtime.stack site-dirs | head -1)/sd-pretrain-image.pth"
	@$(PYTHON) -m shared.runtime.stack requirements --out $(VENV)/requirements-system.txt
	$(PIP) --no-deps $(PIP_FROM) -r $(VENV)/requirements-system.txt $(QUIET)
	@$(BIN)/python -m shared.runtime.stack check $(if $(ALLOW_UNTESTED),--allow-untested)
	@printf '%s\n%s\n' "$(PYTHON)" "$(abspath $(WHEELS))" > $(VENV)/.torch-system
else
	@test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	@echo "installing the pinned stack into $(VENV) (first run: ~5 min, ~6.5 GB)"
	$(PIP) $(PIP_FROM) -c requirements.lock -e '.[dev]' 2>&1 | grep -v 'is ignored: it is neither' || true
endif
	@$(BIN)/python -c 'import encode, train, shared, streaming, composer, diffusers' || (echo "install failed; see the pip output above" && exit 1)
	@touch $(STAMP)

torch-mode:  # refuse to switch an existing .venv between the lock's torch and PYTHON's own
	@if [ "$(TORCH)" = system ] && [ -x $(BIN)/python ] && [ ! -f $(VENV)/.torch-system ]; then \
	  echo "$(VENV) holds the lock's torch; for TORCH=system remove it first: rm -rf $(VENV)"; exit 1; fi
	@if [ "$(TORCH)" != system ] && [ -f $(VENV)/.torch-system ]; then \
	  echo "$(VENV) keeps $$(head -1 $(VENV)/.torch-system)'s torch; for the lock's remove it first: rm -rf $(VENV)"; exit 1; fi

install: $(STAMP)  ## create .venv: the pinned stack, or [TORCH=system PYTHON=..] on that python's torch; [WHEELS=DIR] offline

wheelhouse:  ## make wheelhouse WHEELS=DIR [PYTHON=python3.12 | WHEEL_PYTHON=3.12 WHEEL_PLATFORM=manylinux_2_28_x86_64]
	@test -n "$(WHEELS)" || (echo "usage: make wheelhouse WHEELS=DIR [PYTHON=<the GPU machine's python version here>]" && exit 1)
	@mkdir -p $(WHEELS)
	@python3 -m shared.runtime.stack requirements --out $(WHEELS)/requirements.txt
ifdef WHEEL_PYTHON
	python3 -m pip download --quiet --disable-pip-version-check --no-deps --only-binary=:all: -d $(WHEELS) \
	  --python-version $(WHEEL_PYTHON) --implementation cp $(addprefix --platform ,$(or $(WHEEL_PLATFORM),manylinux_2_28_x86_64 manylinux_2_17_x86_64 manylinux2014_x86_64 manylinux1_x86_64 linux_x86_64 any)) \
	  -r $(WHEELS)/requirements.txt $(QUIET)
else
	$(PYTHON) -m pip wheel --quiet --disable-pip-version-check --no-deps -w $(WHEELS) -r $(WHEELS)/requirements.txt $(QUIET)
endif
	@echo "$(WHEELS): $$(ls $(WHEELS)/*.whl | wc -l) wheels, $$(du -sh $(WHEELS) | cut -f1); copy it next to the project and run make install TORCH=system WHEELS=$(WHEELS)"

demo: $(STAMP)  ## sample data -> encode -> train a tiny U-Net -> export; prints where everything went
	$(BIN)/python -m train demo --out $(OUT)/demo $(ARGS)

test: $(STAMP)  ## the full suite, as CI runs it [TEST_WORKERS=2]
	$(call BYTECODE,$(BIN)/python)
	$(BIN)/python -m pytest -q $(XDIST) $(PYTEST_ARGS)

test-quick: $(STAMP)  ## everything but the slow tests
	$(call BYTECODE,$(BIN)/python)
	$(BIN)/python -m pytest -q -m 'not slow' $(XDIST) $(PYTEST_ARGS)

# `make test-gpu` alone writes outputs/gpu-check; OUT given on the command line is that folder itself.
GPU_OUT = $(if $(filter file,$(origin OUT)),$(OUT)/gpu-check,$(OUT))
COMPILE_CACHE ?= outputs/compile-cache

test-gpu: $(STAMP)  ## make test-gpu [OUT=folder]: the GPU list + a short bench in <= 8 min -> OUT/gpu-check.json (docs/gpu-tests.md)
	$(call BYTECODE,$(BIN)/python)
	$(BIN)/python -m tests.gpu_check --out $(GPU_OUT) --cache $(COMPILE_CACHE) $(if $(PYTEST_ARGS),--pytest-args '$(PYTEST_ARGS)') $(if $(ARGS),--bench-args '$(ARGS)')

# test-torch-next's venvs alone: CI builds them while `make test` runs (downloads and unpacking, mostly waits).
torch-next-venv:
	@test -x $(NEXT_IMAGE)/bin/python || python3.11 -m venv $(NEXT_IMAGE)
	$(NEXT_IMAGE)/bin/pip install --quiet --disable-pip-version-check $(TORCH_NEXT) $(QUIET)
	$(MAKE) --no-print-directory install TORCH=system PYTHON=$(abspath $(NEXT_IMAGE))/bin/python VENV=$(NEXT_VENV)

test-torch-next: torch-next-venv  ## CI: the training, resume, FSDP and export tests on TORCH_NEXT over the lock's other pins
	$(call BYTECODE,$(NEXT_VENV)/bin/python)
	$(NEXT_VENV)/bin/python -m pytest -q $(XDIST) $(TORCH_NEXT_TESTS) $(PYTEST_ARGS)

lint: $(STAMP)  ## ruff lint + format check
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

format: $(STAMP)  ## apply ruff fixes and formatting
	$(BIN)/ruff check --fix .
	$(BIN)/ruff format .

encode: $(STAMP)  ## make encode DATASET=<name|path.yaml> [GPUS=n LAUNCHER=auto|local|slurm|k8s] [ARGS='k=v ..'] [DRY_RUN=1]
	$(if $(GPUS)$(DRY_RUN),$(BIN)/python -m encode launch $(DATASET) $(LAUNCH_FLAGS) $(ARGS),$(BIN)/python -m encode run $(DATASET) $(ARGS))

encode-gc: $(STAMP)  ## make encode-gc DATASET=... [ARGS='--keep 2 --dry-run']: drop old versions + unused data
	$(BIN)/python -m encode gc $(DATASET) $(ARGS)

train: $(STAMP)  ## make train [GPUS=256 NODES=.. LAUNCHER=auto|local|slurm|k8s] CONFIG=<name|path.yaml> [ARGS='k=v ..'] [DRY_RUN=1]
	$(if $(GPUS)$(DRY_RUN),$(BIN)/python -m train launch --config $(CONFIG) $(LAUNCH_FLAGS) $(ARGS),$(BIN)/python -m train fit $(CONFIG) $(ARGS))

# `make export` alone exports the demo's run (what `make train` trains with CONFIG=tiny) to outputs/pipeline;
# OUT given on the command line is the pipeline folder itself.
CHECKPOINT ?= outputs/demo/train
EXPORT_OUT = $(if $(filter file,$(origin OUT)),$(OUT)/pipeline,$(OUT))

export: $(STAMP)  ## make export [CHECKPOINT=<checkpoint .pt or save folder>] [OUT=<folder>]; default: the demo's run
	$(BIN)/python -m train export $(CHECKPOINT) $(EXPORT_OUT) $(ARGS)

estimate: $(STAMP)  ## make estimate [ESTIMATE=sd2-base] ARGS='gpus=256 gpu.type=H100 throughput_from=outputs/bench/bench.json'
	$(BIN)/python -m train estimate $(ESTIMATE) $(ARGS)

bench: $(STAMP)  ## make bench [BENCH=quick|full|sd2-base-cpu] [ARGS='k=v ..']: throughput, FLOPs, MFU -> outputs/bench
	$(BIN)/python -m train bench $(BENCH) out_dir=$(OUT)/bench $(ARGS)

tiny-vae: $(STAMP)  ## retrain the tiny preset's VAE on the sample data (writes shared/assets/)
	$(BIN)/python -m train tiny-vae --out shared/assets $(ARGS)

lock: $(STAMP)  ## re-pin requirements.lock from the current environment
	$(BIN)/pip freeze --exclude-editable | sed '1i # Every package in the environment, pinned. Generated by `make lock` from pyproject.toml; edit pins there.' > requirements.lock

clean:  ## remove outputs and caches (keeps .venv)
	rm -rf $(OUT) .pytest_cache .ruff_cache
