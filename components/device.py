"""Where a step computes (``resources.device``), and how a CPU computes bf16.

Every step resolves ``resources.device`` first, before any work, so that a run
asking for a GPU on a machine without one stops at once with the reason
instead of minutes later inside torch. Artifacts never depend on it:
checkpoints, trajectories and guidance are written from CPU tensors.

bf16 on a CPU without bf16 units is a trap: on an AMD EPYC with AVX2 only,
torch's bf16 ``bmm`` took 57x as long as fp32 for the same shapes, and the
rollout engine ran at 0.18x transformers' ``generate``. Where the CPU has no
native bf16 (x86 ``avx512_bf16`` / ``amx_bf16``, Arm ``bf16``), :func:`bf16_op`
runs a bf16 matmul in fp32 on the bf16-rounded inputs and rounds the output to
bf16: the values of a bf16 matmul (which accumulates in fp32) up to
accumulation order. ``TRACEFP4_CPU_BF16`` forces it: ``native``, ``emulate``
or ``auto`` (the default: emulate where the CPU lacks bf16).
"""

import functools
import os
import platform
import re
from pathlib import Path

import torch
from torch import Tensor

CPU_BF16_ENV = "TRACEFP4_CPU_BF16"
CPU_BF16_MODES = ("auto", "native", "emulate")
DEVICE_PATTERN = r"^(auto|cpu|cuda(:[0-9]+)?)$"
_BF16_FLAGS = {"avx512_bf16", "amx_bf16", "bf16"}  # x86 flags; "bf16" is Arm's Features entry (FEAT_BF16)


def resolve(spec: str) -> torch.device:
    """The device ``resources.device`` names: ``auto`` is CUDA where torch sees
    a GPU, else CPU. A CUDA device that torch cannot see is a RuntimeError
    saying what torch sees."""
    if not re.match(DEVICE_PATTERN, spec):
        raise ValueError(f"resources.device {spec!r}: expected auto, cpu, cuda or cuda:N")
    if spec == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(spec)
    if device.type == "cuda":
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if (device.index or 0) >= count:
            raise RuntimeError(f"resources.device is {spec!r}, but {cuda_seen()}; use 'cpu' or 'auto' on this machine")
    return device


def cuda_seen() -> str:
    """What torch sees of CUDA, in words."""
    if torch.version.cuda is None:
        return f"this torch ({torch.__version__}) is built without CUDA"
    if not torch.cuda.is_available():
        return f"torch {torch.__version__} (CUDA {torch.version.cuda}) sees no CUDA device"
    names = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
    return f"torch sees {len(names)} CUDA device(s): {', '.join(f'cuda:{i} {n}' for i, n in enumerate(names))}"


def parse_cpuinfo(text: str) -> tuple[str, frozenset[str]]:
    """The CPU's model name and feature flags from ``/proc/cpuinfo`` text (x86 ``flags``, Arm ``Features``)."""
    model, flags = "", set()
    for line in text.splitlines():
        key, _, value = line.partition(":")
        key = key.strip()
        if key in ("model name", "Model") and not model:
            model = value.strip()
        elif key in ("flags", "Features") and not flags:
            flags = set(value.split())
    return model or platform.machine(), frozenset(flags)


@functools.cache
def cpu_info() -> tuple[str, frozenset[str]]:
    """This machine's CPU model and flags (empty flags where ``/proc/cpuinfo`` is missing: not Linux)."""
    try:
        return parse_cpuinfo(Path("/proc/cpuinfo").read_text())
    except OSError:
        return platform.processor() or platform.machine(), frozenset()


def cpu_bf16_native(flags: frozenset[str] | None = None) -> bool:
    """Whether the CPU computes bf16 natively. Without flags to read (not
    Linux) it is assumed to, leaving torch's own choice alone."""
    flags = cpu_info()[1] if flags is None else flags
    return not flags or bool(flags & _BF16_FLAGS)


def bf16_emulated() -> bool:
    """Whether bf16 matmuls on the CPU run as fp32 (``TRACEFP4_CPU_BF16``, else the CPU's flags)."""
    mode = os.environ.get(CPU_BF16_ENV, "auto")
    if mode not in CPU_BF16_MODES:
        raise ValueError(f"{CPU_BF16_ENV}={mode!r}: expected one of {CPU_BF16_MODES}")
    return mode == "emulate" or (mode == "auto" and not cpu_bf16_native())


def cpu_kind() -> dict:
    """The CPU next to a figure: its model, whether bf16 is native or emulated, torch's threads."""
    return {
        "cpu": cpu_info()[0],
        "cpu_bf16": "emulated" if bf16_emulated() else "native",
        "cpu_threads": torch.get_num_threads(),
    }


def _computes_bf16_on_cpu(x: Tensor) -> bool:
    """Whether a matmul on ``x`` computes in bf16 on the CPU: bf16 operands, or a bf16 autocast region."""
    if x.device.type != "cpu":
        return False
    return x.dtype == torch.bfloat16 or (
        torch.is_autocast_enabled("cpu") and torch.get_autocast_dtype("cpu") == torch.bfloat16
    )


def bf16_op(op, *args: Tensor | None) -> Tensor:
    """``op(*args)`` (a matmul: ``F.linear``, ``torch.bmm``, ``torch.matmul``;
    or attention: ``F.scaled_dot_product_attention`` with its other arguments bound);
    where it would compute bf16 on a CPU without bf16 units, in fp32 on the
    operands rounded to bf16 (as autocast rounds them), the output rounded to
    bf16. ``None`` arguments (a missing bias) pass through."""
    if not (_computes_bf16_on_cpu(args[0]) and bf16_emulated()):
        return op(*args)
    with torch.autocast("cpu", enabled=False):
        out = op(*(None if a is None else a.to(torch.bfloat16).float() for a in args))
    return out.to(torch.bfloat16)
