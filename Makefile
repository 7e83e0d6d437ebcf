# Two entry points for a fresh machine: `make run` and `make test`.
PYTHON ?= python3
PIP := $(PYTHON) -m pip

.PHONY: install test run

# torch first: 2.13.0 is the CPU wheel on local disk, and it then satisfies torch>=2.13
install:
	$(PIP) install --quiet torch==2.13.0
	$(PIP) install --quiet -e '.[dev]'

test: install
	$(PYTHON) -m pytest

# The main job. Today: the kernel, rollout and guidance benchmarks; it grows into the local pipeline run.
run: install
	$(PYTHON) benchmarks/kernels.py
	$(PYTHON) benchmarks/rollout.py
	$(PYTHON) benchmarks/guidance.py
