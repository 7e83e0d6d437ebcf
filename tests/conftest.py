"""Shared test setup. Without a GPU, Triton kernels run in its interpreter on
CPU tensors; the variable must be set before anything imports triton."""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

# a real S3 server (SeaweedFS) on loopback, for the store and guidance tests
pytest_plugins = ["s3_server"]
