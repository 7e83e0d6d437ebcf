"""Shared test setup. Without a GPU, Triton kernels run in its interpreter on
CPU tensors; the variable must be set before anything imports triton."""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

# real servers on loopback: S3 (SeaweedFS) for the store, Prometheus and a Pushgateway for the metrics
pytest_plugins = ["s3_server", "prometheus_server"]
