# The component image, CPU variant: tracefp4 and its dependencies on Python 3.11.
# Build: make image (tags ghcr.io/tracefp4/tracefp4:<version>-cpu)
FROM python:3.11-slim

ENV PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1 PIP_NO_CACHE_DIR=1
WORKDIR /opt/tracefp4

# torch first, from the CPU wheel index, so that torch>=2.13 is already satisfied
RUN pip install torch==2.13.0 --index-url https://download.pytorch.org/whl/cpu

COPY pyproject.toml README.md ./
COPY kernels kernels
COPY components components
COPY pipelines pipelines
COPY schemas schemas
RUN pip install . && python -c "import tracefp4.kernels, tracefp4.components, tracefp4.pipelines, tracefp4.schemas"

# KFP lightweight components run `python -m kfp.dsl.executor_main` in this image
ENTRYPOINT []
