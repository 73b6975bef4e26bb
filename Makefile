# Two entry points on a fresh machine: `make demo` (set up, convert the embedded default model, generate) and
# `make test` (set up, run the test suite). Everything else is a building block of those.
VENV   ?= .venv
PY     := $(VENV)/bin/python
PIP    := $(PY) -m pip
TORCH  ?= torch==2.13.0
PYTEST_ARGS ?=

KERNEL_STAMP := build/.kernels-built
KERNEL_SRCS  := $(shell find kernels -type f -not -path '*/build/*')

.PHONY: setup kernels test bench lint demo clean

setup: $(VENV)/.setup-done

# The pinned CPU torch wheel goes in first: an unpinned torch would pull a multi-GB CUDA build.
$(VENV)/.setup-done: pyproject.toml setup.py kernels/CMakeLists.txt
	test -x $(PY) || python3 -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	$(PIP) install -q $(TORCH)
	$(PIP) install -q -e '.[test]'
	mkdir -p build && touch $(KERNEL_STAMP)
	touch $@

# Rebuild the C++ kernel library in place when kernels/ changed since the last build (pip install builds it too).
kernels: setup $(KERNEL_STAMP)

$(KERNEL_STAMP): $(KERNEL_SRCS)
	$(PY) setup.py -q build_ext --inplace
	mkdir -p build && touch $@

test: kernels
	$(PY) -m pytest -q -rs $(PYTEST_ARGS) tests

bench: kernels
	for b in bench/bench_*.py; do echo "== $$b"; $(PY) $$b || exit 1; done

lint: setup
	$(VENV)/bin/ruff check ktconvert layouts runtime tests bench
	$(VENV)/bin/lint-imports --no-logo

demo: kernels
	$(PY) -m ktconvert.default_model.demo

clean:
	rm -rf build converted runtime/*.so
