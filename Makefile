# Development entry points. Two distributions are built from this checkout: the client `stagediff`
# (pyproject.toml) and the servers `stagediff-server` (server/pyproject.toml). The venv holds both, editable;
# torch is installed first and pinned, so that installing the servers does not pull another torch build.

PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
TORCH_VERSION := 2.13.0
# What the venv holds: the servers (what `make demo` needs), then the development and test tools.
SERVERS_INSTALLED := $(VENV)/.installed-servers
INSTALLED := $(VENV)/.installed

.PHONY: venv servers demo wheel test test-quick test-gpu bench-gpu lint proto clean

venv: $(INSTALLED)

servers: $(SERVERS_INSTALLED)

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)

$(SERVERS_INSTALLED): pyproject.toml server/pyproject.toml | $(BIN)/python
	$(BIN)/pip install torch==$(TORCH_VERSION)
	$(BIN)/pip install -e . -e ./server
	touch $@

$(INSTALLED): $(SERVERS_INSTALLED)
	$(BIN)/pip install -e . -e './server[dev]'
	touch $@

# Both wheels into dist/: the client (stagediff) and the servers (stagediff-server), for `pip install dist/*.whl`.
# build/ is removed first: setuptools packs whatever an earlier build left there.
wheel: | $(BIN)/python
	rm -rf build server/build dist
	$(BIN)/pip wheel --no-deps --wheel-dir dist . ./server

# The demo needs the servers, not the development tools. The demo model is trained and committed
# (shapeworld/checkpoint); init-model copies it.
demo: servers
	$(BIN)/python -m stagediff.cli init-model --family wan-t2v --preset demo --out models/demo
	bash scripts/demo.sh

# Everything: lint, then every tier, quickest first (unit, integration, e2e); prints each tier's time and the 15
# slowest tests.
test: lint
	$(BIN)/python -m pytest -q --durations=15 tests/unit tests/integration tests/e2e

# The unit tier (tests/unit: no cluster, no process, no rank group), for the edit-test loop.
test-quick: venv
	$(BIN)/python -m pytest -q --durations=15 tests/unit

# The CUDA paths, on a machine with an NVIDIA GPU (deselected from `make test`); -s prints their evidence.
test-gpu: venv
	$(BIN)/python -m pytest -m cuda -s -v tests/e2e/test_cuda.py

# The GPU benchmarks on one CUDA GPU in bf16, written together to $OUT/bench-gpu.json: first bench/wan_gpu.py
# (Wan2.1-1.3B at real size, our DiT and cluster against diffusers' WanPipeline), bench/flux_gpu.py (FLUX.1-dev
# at real size, 1024x1024, 28 steps, against FluxPipeline, eager and compiled) and bench/hunyuanvideo_gpu.py
# (HunyuanVideo 1.5 at real size, 480x848, 33 frames, 8 steps, our stages against HunyuanVideo15Pipeline's), then
# the DiT's throughput levers (step caches, regional compilation, request batching, LoRA); BENCH_GPU_QUICK=1 for
# the short variants.
bench-gpu: venv
	bash scripts/bench_gpu.sh

# ruff (lint and format) and mypy over the product packages (configured in pyproject.toml).
lint: venv
	$(BIN)/python -m ruff check .
	$(BIN)/python -m ruff format --check .
	$(BIN)/python -m mypy

proto: venv
	$(BIN)/python -m stagediff._protogen

clean:
	rm -rf build server/build dist *.egg-info .pytest_cache .ruff_cache out
	find . -path ./$(VENV) -prune -o -name __pycache__ -type d -prune -exec rm -rf {} +
