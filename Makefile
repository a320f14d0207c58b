# `make test` and `make bench` each set up everything on a fresh machine, then run.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
# Where no GPU is present, take torch's CPU build (on this project's machines a local wheel);
# elsewhere set e.g. TORCH_CPU_PIP_ARGS="--index-url https://download.pytorch.org/whl/cpu".
TORCH_CPU_SPEC ?= torch==2.13.0
TORCH_CPU_PIP_ARGS ?=
HAS_GPU := $(shell command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1 && echo 1)
STAMP := $(VENV)/.astrai-kernels-installed
# The oldest versions pyproject.toml declares, in a venv of their own (`make test-oldest`).
# torch's CPU build there too, so the Triton tests run under the interpreter on any machine.
OLDEST_VENV ?= .venv-oldest
OLDEST_PY := $(OLDEST_VENV)/bin/python
OLDEST_TORCH_SPEC ?= $(TORCH_CPU_SPEC)
OLDEST_TRITON_SPEC ?= triton==3.8.0
OLDEST_PINS = "$(OLDEST_TORCH_SPEC)" "$(OLDEST_TRITON_SPEC)"
OLDEST_STAMP := $(OLDEST_VENV)/.astrai-kernels-installed

.PHONY: setup test test-oldest bench bench-pytest lint compile-check verify clean

setup: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
ifeq ($(HAS_GPU),1)
	$(PY) -m pip install -q torch
else
	$(PY) -m pip install -q $(TORCH_CPU_PIP_ARGS) "$(TORCH_CPU_SPEC)"
endif
	$(PY) -m pip install -q -e ".[test,plot,dev,transformers,trl]"
	touch $(STAMP)

test: $(STAMP)
	$(PY) -m pytest tests -q

$(OLDEST_STAMP): pyproject.toml Makefile
	test -x $(OLDEST_PY) || $(PYTHON) -m venv $(OLDEST_VENV)
	$(OLDEST_PY) -m pip install -q --upgrade pip
	$(OLDEST_PY) -m pip install -q $(TORCH_CPU_PIP_ARGS) $(OLDEST_PINS)
	$(OLDEST_PY) -m pip install -q $(TORCH_CPU_PIP_ARGS) -e ".[test]" $(OLDEST_PINS)
	touch $(OLDEST_STAMP)

# The Triton tests (every test or case with "triton" in its id; the interpreter where there is
# no CUDA) and compile-check under the oldest declared torch and Triton.
test-oldest: $(OLDEST_STAMP)
	$(OLDEST_PY) -c "import numpy, torch, triton; print('torch', torch.__version__, '| triton', \
	  triton.__version__, '| numpy', numpy.__version__)"
	$(OLDEST_PY) -m pytest tests -q -k triton
	env -u TRITON_INTERPRET $(OLDEST_PY) -m astrai_kernels.cli compile-check --arch sm_80,sm_90

bench: $(STAMP)
	$(PY) -m astrai_kernels.cli bench --json bench/results/bench.json --plot bench/results/bench.png

bench-pytest: $(STAMP)
	$(PY) -m pytest bench -q --benchmark-only

compile-check: $(STAMP)
	env -u TRITON_INTERPRET $(PY) -m astrai_kernels.cli compile-check --arch sm_80,sm_90

verify: $(STAMP)
	$(PY) -m astrai_kernels.cli verify

lint: $(STAMP)
	$(PY) -m ruff check astrai_kernels tests bench

clean:
	rm -rf $(VENV) $(OLDEST_VENV) build *.egg-info .pytest_cache
