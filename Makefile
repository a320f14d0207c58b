# `make test` and `make bench` each set up everything on a fresh machine, then run.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
# Where no GPU is present, take torch's CPU build (on this project's machines a local wheel);
# elsewhere set e.g. TORCH_CPU_PIP_ARGS="--index-url https://download.pytorch.org/whl/cpu".
TORCH_CPU_SPEC ?= torch==2.13.0
TORCH_CPU_PIP_ARGS ?=
HAS_GPU := $(shell command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1 && echo 1)
INSTALLED := $(VENV)/.astrai-kernels-installed
# Set up = installed, then the cpp backend's C++ kernels built (minutes, once per change of csrc/)
# so that no test pays for the build. Without a working C++ compiler setup fails: CI tests the
# cpp backend, and `astrai-kernels build` prints the compiler's error.
STAMP := $(VENV)/.astrai-kernels-built
# The oldest versions pyproject.toml declares and the newest releases, each in a venv of its own
# (`make test-oldest`, `make test-newest`): the whole suite, then compile-check. These torch
# releases come from the registry as CUDA builds (a few GB with their nvidia-* wheels) and run on
# the CPU all the same; TORCH_CPU_PIP_ARGS can point pip at an index of CPU builds instead.
# PIP_CONSTRAINT=/dev/null drops a machine-wide pip constraint file that caps torch's version.
OLDEST_VENV ?= .venv-oldest
OLDEST_TORCH_SPEC ?= torch==2.11.0
OLDEST_TRITON_SPEC ?= triton==3.6.0
# Triton 3.6's interpreter (the CPU tests) calls int() on 1-element arrays, which NumPy 2.4 refuses
OLDEST_NUMPY_SPEC ?= numpy<2.4
OLDEST_PINS = "$(OLDEST_TORCH_SPEC)" "$(OLDEST_TRITON_SPEC)" "$(OLDEST_NUMPY_SPEC)"
NEWEST_VENV ?= .venv-newest
NEWEST_TORCH_SPEC ?= torch==2.15.0
NEWEST_TRITON_SPEC ?= triton==3.9.0
NEWEST_PINS = "$(NEWEST_TORCH_SPEC)" "$(NEWEST_TRITON_SPEC)"
PINNED_EXTRAS ?= test,plot,transformers,trl
# verl 0.9.1 pins transformers<5.11 (the transformers and trl extras need 5.24+), so the verl
# integration's tests run in a venv of their own (`make test-verl`) on .venv's torch: the cpp
# backend's build, keyed by the torch version and the sources, is the one .venv built.
VERL_VENV ?= .venv-verl

.PHONY: setup test test-oldest test-newest test-verl bench bench-check bench-pytest lint compile-check verify clean

setup: $(STAMP)

$(INSTALLED): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
ifeq ($(HAS_GPU),1)
	$(PY) -m pip install -q torch
else
	$(PY) -m pip install -q $(TORCH_CPU_PIP_ARGS) "$(TORCH_CPU_SPEC)"
endif
	$(PY) -m pip install -q -e ".[test,plot,dev,transformers,trl,deepspeed]"
	touch $(INSTALLED)

$(STAMP): $(INSTALLED) $(wildcard csrc/*)
	$(PY) -m astrai_kernels build
	touch $(STAMP)

test: $(STAMP)
	$(PY) -m pytest tests -q

# $(call pinned_venv,VENV,PINS): the venv's stamp, built with those (quoted) pins
define pinned_venv
$(1)/.astrai-kernels-installed: pyproject.toml Makefile
	test -x $(1)/bin/python || $(PYTHON) -m venv $(1)
	$(1)/bin/python -m pip install -q --upgrade pip
	PIP_CONSTRAINT=/dev/null $(1)/bin/python -m pip install -q $(TORCH_CPU_PIP_ARGS) $(2)
	PIP_CONSTRAINT=/dev/null $(1)/bin/python -m pip install -q $(TORCH_CPU_PIP_ARGS) \
	  -e ".[$(PINNED_EXTRAS)]" $(2)
	touch $(1)/.astrai-kernels-installed
endef
$(eval $(call pinned_venv,$(OLDEST_VENV),$(OLDEST_PINS)))
$(eval $(call pinned_venv,$(NEWEST_VENV),$(NEWEST_PINS)))

# $(call test_pinned,VENV): the versions, the whole suite, then compile-check (no interpreter;
# its table reports spills, which fail tests/test_compile_check.py from Triton 3.8 on only)
define test_pinned
	$(1)/bin/python -c "import numpy, torch, triton; print('torch', torch.__version__, '| triton', \
	  triton.__version__, '| numpy', numpy.__version__)"
	$(1)/bin/python -m pytest tests -q
	env -u TRITON_INTERPRET $(1)/bin/python -m astrai_kernels.cli compile-check --arch sm_80,sm_90 \
	  --allow-spills
endef

test-oldest: $(OLDEST_VENV)/.astrai-kernels-installed
	$(call test_pinned,$(OLDEST_VENV))

test-newest: $(NEWEST_VENV)/.astrai-kernels-installed
	$(call test_pinned,$(NEWEST_VENV))

$(VERL_VENV)/.astrai-kernels-installed: pyproject.toml Makefile
	test -x $(VERL_VENV)/bin/python || $(PYTHON) -m venv $(VERL_VENV)
	$(VERL_VENV)/bin/python -m pip install -q --upgrade pip
	$(VERL_VENV)/bin/python -m pip install -q $(TORCH_CPU_PIP_ARGS) "$(TORCH_CPU_SPEC)"
	$(VERL_VENV)/bin/python -m pip install -q $(TORCH_CPU_PIP_ARGS) -e ".[test,verl]" \
	  "$(TORCH_CPU_SPEC)"
	touch $(VERL_VENV)/.astrai-kernels-installed

# only the verl integration's modules (the rest of the suite runs in .venv)
test-verl: $(VERL_VENV)/.astrai-kernels-installed
	$(VERL_VENV)/bin/python -m pytest tests/test_integration_verl*.py -q

# `make bench` writes only under bench/results/ (the JSON and the figure). `make bench-docs` runs
# the same benchmark, then rewrites from that one run the tables of docs/benchmarks.md and the
# README's "Measured (CPU)" tables, and says what it wrote; a run cut by its deadline leaves both
# alone (`make bench-docs DOC_TABLES_ARGS=--partial` writes them, headed as partial).
# BENCH_ARGS: more options of `astrai-kernels bench` (e.g. BENCH_ARGS="--ops cross_entropy")
BENCH_RESULTS ?= bench/results
BENCH_ARGS ?=
BENCH_RUN = $(PY) -m astrai_kernels.cli bench --json $(BENCH_RESULTS)/bench.json \
	--plot $(BENCH_RESULTS)/bench.png $(BENCH_ARGS)
DOC_TABLES_ARGS ?=
bench: $(STAMP)
	$(BENCH_RUN)

.PHONY: bench-docs
bench-docs: $(STAMP)
	commit=$$(git describe --always --dirty --abbrev=7 2>/dev/null); $(BENCH_RUN) && \
	$(PY) bench/doc_tables.py $(BENCH_RESULTS)/bench.json --commit "$$commit" \
	  --write docs/benchmarks.md --readme README.md $(DOC_TABLES_ARGS)

# The regression guard: the cases of bench/bounds.toml against their same-run floors; exits 1 on
# any case over its bound. Run it before a kernel change lands (not in CI: it is a benchmark).
# the single-process cases, then the vocabulary-parallel ones (2 ranks); fails if either does
bench-check: $(STAMP)
	$(PY) -m astrai_kernels.cli bench --check --bounds bench/bounds.toml; cases=$$?; \
	$(PY) bench/bench_vocab_parallel.py --bounds bench/bounds.toml && exit $$cases

bench-pytest: $(STAMP)
	$(PY) -m pytest bench -q --benchmark-only

compile-check: $(STAMP)
	env -u TRITON_INTERPRET $(PY) -m astrai_kernels.cli compile-check --arch sm_80,sm_90

verify: $(STAMP)
	$(PY) -m astrai_kernels.cli verify

lint: $(STAMP)
	$(PY) -m ruff check astrai_kernels tests bench

clean:
	rm -rf $(VENV) $(OLDEST_VENV) $(NEWEST_VENV) $(VERL_VENV) build *.egg-info .pytest_cache
