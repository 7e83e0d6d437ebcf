"""Shared test setup. Without a GPU, Triton kernels run in its interpreter on
CPU tensors; the variable must be set before anything imports triton."""

import builtins
import logging
import os
import re
import sys
from pathlib import Path

import pytest
import torch

# The repository's kernels/ folder (installed as tracefp4.kernels) shadows the `kernels` package that transformers
# (5.25 on) imports for its model code, wherever the repository root is on sys.path: `python -m pytest` puts the
# working directory first, and pytest-xdist puts it in the workers' sys.path and PYTHONPATH (which the Pythons
# that tests start inherit). The root off both; tests import the installed package, never the folders.
ROOT = Path(__file__).resolve().parents[1]
sys.path[:] = [entry for entry in sys.path if Path(entry or os.curdir).resolve() != ROOT]
if "PYTHONPATH" in os.environ:
    os.environ["PYTHONPATH"] = os.pathsep.join(
        entry for entry in os.environ["PYTHONPATH"].split(os.pathsep) if entry and Path(entry).resolve() != ROOT
    )

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from tracefp4.components import device  # noqa: E402  (after the variable: nothing may import triton before it)

# real servers on loopback: S3 (SeaweedFS) for the store, Prometheus and a Pushgateway for the metrics
pytest_plugins = ["s3_server", "prometheus_server"]


@pytest.fixture(autouse=True)
def torch_seeded():
    """torch's global generator seeded alike before every test: a test that
    draws from it (``torch.randn`` without a generator) draws the same values
    whatever ran before it in its process, and pytest-xdist deals the test
    files to its workers in no fixed order. A draw that fails a test then
    fails it every time, not one run in many."""
    torch.manual_seed(0)


# environment variables the process sets itself, whichever test comes first: pytest's, at each phase of a test;
# torch's inductor and Triton their cache folders (torch._inductor.runtime.cache_dir_utils.cache_dir), once needed
OWN_VARIABLES = re.compile(r"PYTEST_CURRENT_TEST|_?TORCHINDUCTOR_\w+|\w+_CACHE_DIR")


@pytest.fixture(autouse=True)
def process_left_as_found():
    """A test that leaves the process other than it found it fails, naming what
    it changed, and the change is undone: pytest-xdist deals the test files to
    its workers in no fixed order, so what one test leaves reaches another
    only now and then. A handler left on the root logger, bound to a stream
    that test owned (a run's log, a CliRunner's output), takes every later
    warning and prints 'Logging error' once the stream is closed; a thread
    count, default dtype, working directory or environment variable left
    changes what later tests compute or where they write."""
    root = logging.getLogger()
    handlers, level, printer = list(root.handlers), root.level, builtins.print
    threads, dtype, cwd, environ = torch.get_num_threads(), torch.get_default_dtype(), os.getcwd(), dict(os.environ)
    yield
    changed = []
    if root.handlers != handlers:
        changed.append(f"root logger handlers {root.handlers} (were {handlers})")
        root.handlers[:] = handlers
    if root.level != level:
        changed.append(f"root logger level {root.level} (was {level})")
        root.setLevel(level)
    if builtins.print is not printer:
        changed.append(f"builtins.print {builtins.print}")
        builtins.print = printer
    if torch.get_num_threads() != threads:
        changed.append(f"torch threads {torch.get_num_threads()} (were {threads})")
        torch.set_num_threads(threads)
    if torch.get_default_dtype() != dtype:
        changed.append(f"torch default dtype {torch.get_default_dtype()} (was {dtype})")
        torch.set_default_dtype(dtype)
    if os.getcwd() != cwd:
        changed.append(f"working directory {os.getcwd()} (was {cwd})")
        os.chdir(cwd)
    names = sorted(
        k for k in {*os.environ, *environ} if os.environ.get(k) != environ.get(k) and not OWN_VARIABLES.fullmatch(k)
    )
    if names:
        changed.append(f"environment variables {names}")
        for name in names:
            if name in environ:
                os.environ[name] = environ[name]
            else:
                del os.environ[name]
    if changed:
        pytest.fail("the test left the process changed (undo what it changes: monkeypatch): " + "; ".join(changed))


@pytest.fixture(scope="module")
def native_bf16():
    """bf16 matmuls on torch's own bf16 kernels, also on a CPU without bf16
    units (slower there, not wrong), from the first test that asks for it to
    the end of its module (module-scoped, so that data fixtures of the module
    are computed under it too). For tests whose subject is what those kernels
    do: the train-rollout mismatch that their shape-dependent sums create,
    layouts that give the same bits, transformers' own bf16 forward. The
    fp32 emulation that ``auto`` picks on such a CPU (:func:`device.batch_invariant`)
    rounds the same values but sums in another order. Its float32 sums hardly
    depend on the shapes: bf16 training and rollout of the test models then
    round to the same FP4 codes (docs/performance.md)."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv(device.CPU_BF16_ENV, "native")
        yield


@pytest.fixture(params=["bf16-native", "bf16-emulated", "float32"])
def each_dtype(request, monkeypatch):
    """The rollout dtype, for what every precision must give, such as a
    request's bits whatever shares its batch: bf16 once on torch's bf16
    kernels and once on the fp32 emulation that ``auto`` picks on a CPU
    without bf16 units (:func:`device.batch_invariant`), whatever this CPU
    has; and float32."""
    if request.param.startswith("bf16"):
        monkeypatch.setenv(device.CPU_BF16_ENV, "native" if request.param == "bf16-native" else "emulate")
        return torch.bfloat16
    return torch.float32
