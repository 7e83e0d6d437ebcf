# Two entry points for a fresh machine: `make run` and `make test`.
PYTHON ?= python3
PIP := $(PYTHON) -m pip

.PHONY: install test run image

# Prometheus and its Pushgateway (Debian packages) for the metrics integration test;
# torch first: 2.13.0 is the CPU wheel on local disk, and it then satisfies torch>=2.13
SUDO := $(shell [ "$$(id -u)" = 0 ] || echo sudo)
install:
	command -v prometheus >/dev/null && command -v prometheus-pushgateway >/dev/null || \
		{ $(SUDO) apt-get update -qq && $(SUDO) apt-get install -y -qq --no-install-recommends prometheus prometheus-pushgateway; }
	$(PIP) install --quiet torch==2.13.0
	$(PIP) install --quiet -e '.[dev]'

test: install
	$(PYTHON) -m pytest

# The main job: the whole pipeline on this machine (kfp.local), the tiny preset.
run: install
	$(PYTHON) -m tracefp4.pipelines.cli run --preset tiny --output runs/tiny

# The component images (needs a Docker engine; none runs on the development machines).
VERSION := $(shell $(PYTHON) -c "import tomllib; print(tomllib.load(open('pyproject.toml', 'rb'))['project']['version'])")
IMAGE ?= ghcr.io/tracefp4/tracefp4
image:
	docker build -f Dockerfile -t $(IMAGE):$(VERSION)-cpu .
	docker build -f Dockerfile.cuda -t $(IMAGE):$(VERSION)-cuda .
