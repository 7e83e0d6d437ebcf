# syntax=docker/dockerfile:1
# The component image, CPU variant: tracefp4 and its dependencies on Python 3.11,
# for linux/amd64 and linux/arm64. No Triton: CPU tensors take the torch reference
# path (tracefp4.kernels imports Triton only where it is installed).
# Build: make image (docker buildx; tags ghcr.io/tracefp4/tracefp4:<version>-cpu)
FROM python:3.11-slim

ENV PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1 PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
WORKDIR /opt/tracefp4
# The source folders (kernels/, ...) are copied here, the working directory of every step: no Python started here
# (KFP runs `python -m kfp.dsl.executor_main`) may put it on sys.path, where kernels/ would shadow the `kernels`
# package that transformers imports
ENV PYTHONSAFEPATH=1

# torch first, from the CPU wheel index (amd64 and arm64), so that torch>=2.11 is satisfied
RUN pip install torch==2.13.0 --index-url https://download.pytorch.org/whl/cpu

# The dependencies alone, read from pyproject.toml, Triton left out: this layer is
# rebuilt when pyproject.toml changes, not on every source edit.
COPY pyproject.toml ./
RUN python -c "import tomllib; deps = tomllib.load(open('pyproject.toml', 'rb'))['project']['dependencies']; \
print('\n'.join(d for d in deps if not d.startswith('triton')))" > /tmp/requirements.txt \
    && pip install -r /tmp/requirements.txt && rm /tmp/requirements.txt

# The source last; the package itself without resolving dependencies again
COPY README.md ./
COPY kernels kernels
COPY components components
COPY pipelines pipelines
COPY schemas schemas
RUN pip install --no-deps . \
    && python -c "import tracefp4.kernels, tracefp4.components, tracefp4.pipelines, tracefp4.schemas" \
    && ! python -c "import triton" 2>/dev/null

# A user of its own (numeric, so that runAsNonRoot can check it). KFP's launcher
# keeps artifacts under /gcs, /minio and /s3 in the container, and a step writes
# its metrics file (metrics.metrics_file, relative) in the working directory: all
# writable for it (group 0 too, for clusters that run images under an arbitrary UID).
RUN useradd --uid 1000 --gid 0 --create-home --shell /usr/sbin/nologin tracefp4 \
    && mkdir -p /gcs /minio /s3 && chown 1000:0 /gcs /minio /s3 /opt/tracefp4 \
    && chmod 0775 /gcs /minio /s3 /opt/tracefp4
ENV HOME=/home/tracefp4
USER 1000

# KFP lightweight components run `python -m kfp.dsl.executor_main` in this image
ENTRYPOINT []
