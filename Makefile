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

.PHONY: setup test bench bench-pytest lint compile-check verify clean

setup: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
ifeq ($(HAS_GPU),1)
	$(PY) -m pip install -q torch
else
	$(PY) -m pip install -q $(TORCH_CPU_PIP_ARGS) "$(TORCH_CPU_SPEC)"
endif
	$(PY) -m pip install -q -e ".[test,plot,dev]"
	touch $(STAMP)

test: $(STAMP)
	$(PY) -m pytest tests -q

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
	rm -rf $(VENV) build *.egg-info .pytest_cache
