# The README's two commands: `make demo` and `make test`. Everything they need is set up here.
SHELL := /bin/bash
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
BUILD_DIR := build/py
TORCH_VERSION ?= 2.14.1
# diffusers: the U-Net models optimize() is tested on (tiny configs on the CPU).
DIFFUSERS_VERSION ?= 0.42.1
# ase: mirage.ff.Calculator is an ASE calculator; mirage.ff.md writes ASE trajectories.
ASE_VERSION ?= 3.29.0
export MIRAGE_CUDA_ARCHS ?= 80;86;89;90a
export CMAKE_BUILD_PARALLEL_LEVEL ?= $(shell nproc)
export CCACHE_DIR ?= $(CURDIR)/build/ccache
# pytest's workers (pytest-xdist): one a core, at most 8. Most tests are small and single-threaded,
# so on CI's 2 cores two workers take the suite from ~25 to ~15 minutes; each worker's torch gets
# one intra-op thread, so that two workers do not fight over the cores.
PYTEST_WORKERS ?= $(shell n=$$(nproc); echo $$(( n < 8 ? n : 8 )))
TORCHSCRIPT_MODULE := $(CURDIR)/$(BUILD_DIR)/scripted_group_norm.pt

.PHONY: demo test install system-deps clean

# Re-run when this file changes (a new pinned dependency); pip skips what is installed.
$(VENV)/.ready: Makefile
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q torch==$(TORCH_VERSION) "scikit-build-core>=1.0" pytest pytest-xdist numpy expecttest \
	  diffusers==$(DIFFUSERS_VERSION) ase==$(ASE_VERSION)
	touch $@

# Debian's Catch2 (v2 or v3) for the C++ tests, ccache for rebuilds, and Python's headers for the
# extension module (python3-dev; a python3 of its own, pyenv's say, has them); installed when missing.
system-deps:
	@if { [ ! -f /usr/include/catch2/catch.hpp ] && [ ! -f /usr/include/catch2/catch_all.hpp ]; } || \
	    ! command -v ccache >/dev/null || ! command -v ninja >/dev/null || \
	    ! $(PYTHON) -c 'import os, sys, sysconfig; sys.exit(not os.path.exists(os.path.join(sysconfig.get_paths()["include"], "Python.h")))'; then \
	  echo "mirage: installing catch2, ccache, ninja and python3-dev with apt-get"; \
	  SUDO=$$( [ "$$(id -u)" = 0 ] || echo sudo ); \
	  $$SUDO apt-get update -qq && $$SUDO apt-get install -y -qq catch2 ccache ninja-build python3-dev >/dev/null; \
	fi

# Builds (incrementally, in $(BUILD_DIR)) and installs the package into the venv, C++ tests too.
install: $(VENV)/.ready system-deps
	@echo "mirage: building for CUDA archs '$(MIRAGE_CUDA_ARCHS)' (the first build takes minutes)"
	$(PY) -m pip install -q --no-build-isolation --no-deps -e . \
	  -C build-dir=$(BUILD_DIR) -C cmake.define.MIRAGE_BUILD_TESTS=ON

demo: install
	$(PY) -m mirage info
	$(PY) -m mirage demo

test: install
	MIRAGE_TORCHSCRIPT_MODULE=$(TORCHSCRIPT_MODULE) OMP_NUM_THREADS=1 $(PY) -m pytest -q -n $(PYTEST_WORKERS) tests/python
	MIRAGE_TORCHSCRIPT_MODULE=$(TORCHSCRIPT_MODULE) ctest --test-dir $(BUILD_DIR) --output-on-failure

clean:
	rm -rf build
