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

# The main job: the whole pipeline on this machine (kfp.local), the tiny preset.
run: install
	tracefp4 run --preset tiny --output runs/tiny
