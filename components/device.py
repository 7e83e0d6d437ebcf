"""Where a step computes (``resources.device``), how a CPU computes bf16, and how
it keeps a row's bits whatever else a matmul or attention computes beside it.

Every step resolves ``resources.device`` first, before any work, so that a run
asking for a GPU on a machine without one stops at once with the reason
instead of minutes later inside torch. Artifacts never depend on it:
checkpoints, trajectories and guidance are written from CPU tensors.

bf16 on a CPU without bf16 units is a trap: on an AMD EPYC with AVX2 only,
torch's bf16 ``bmm`` took 57x as long as fp32 for the same shapes, and the
rollout engine ran at 0.18x transformers' ``generate``. Where the CPU has no
native bf16 (x86 ``avx512_bf16`` / ``amx_bf16``, Arm ``bf16``; or torch
without oneDNN's bf16 kernels, which :func:`cpu_bf16_native` asks torch about),
:func:`batch_invariant` runs a bf16 matmul in fp32 on the bf16-rounded inputs
and rounds the output to bf16: the values of a bf16 matmul (which accumulates
in fp32) up to accumulation order. ``TRACEFP4_CPU_BF16`` forces it:
``native``, ``emulate`` or ``auto`` (the default: emulate where the CPU lacks bf16).

oneDNN, which runs torch's bf16 matmuls on x86, can be capped below the CPU's
ISA (``ONEDNN_MAX_CPU_ISA``); capped below ``AVX512_CORE_BF16`` it computes
bf16 without the bf16 units, so ``auto`` emulates there too. With the cap at
``AVX2`` (and ``ATEN_CPU_CAPABILITY=avx2``, ``MKL_ENABLE_INSTRUCTIONS=AVX2``
for torch's own kernels and MKL) a machine with bf16 units stands in for one
without: docs/performance.md measures both kinds that way.

In float32 (a float32 model, and bf16 where it is emulated) torch's CPU
matmuls and attention run on MKL, and MKL picks its kernels and splits its
work by the matrices' sizes: on an Intel Xeon with two threads a row's bits
moved with the row count of its matmul up to 200 rows and more. Its strict
reproducibility mode (``MKL_CBWR=AUTO,STRICT``, which MKL reads at its first
call: :data:`MKL_MODE`) sums every row alike there; this module asks for it
when imported, unless the environment names another mode. A process that ran
torch's CPU math before importing it keeps MKL's default.

A CPU also computes some elementwise functions (softplus, sigmoid, SiLU) in
two ways: torch's kernel runs a vector loop, and a scalar loop over the
tensor's last few elements, and the two differ in float32's last bit for one
input in ten to thirty. Which elements land in the scalar loop depends on the
tensor's size, so a request's values could depend on what shares its batch;
:func:`size_independent` computes such a function where that matters.
"""

import ctypes
import functools
import os
import platform
import re
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import Tensor

from .choices import DEVICE_PATTERN

CPU_BF16_ENV = "TRACEFP4_CPU_BF16"
CPU_BF16_MODES = ("auto", "native", "emulate")
CPUINFO = Path("/proc/cpuinfo")  # Linux's; missing elsewhere
_BF16_FLAGS = {"avx512_bf16", "amx_bf16", "bf16"}  # x86 flags; "bf16" is Arm's Features entry (FEAT_BF16)
# oneDNN's x86 ISA caps below AVX512_CORE_BF16: capped there, its bf16 matmuls convert to fp32 and back
# (AVX512_CORE) or fall to its reference code (AVX2); AVX2_VNNI_2's bf16 kernels need avx_ne_convert, which the
# bf16 flags above do not imply
ONEDNN_ISA_ENV = ("ONEDNN_MAX_CPU_ISA", "DNNL_MAX_CPU_ISA")
_ISA_CAPS_WITHOUT_BF16 = {"SSE41", "AVX", "AVX2", "AVX2_VNNI", "AVX2_VNNI_2", "AVX512_CORE", "AVX512_CORE_VNNI"}

# MKL's strict conditional numerical reproducibility, its code path chosen for the CPU (AUTO): MKL reads MKL_CBWR
# at its first call (any CPU math of torch's), so it is set when this module is imported, before any (what it cost
# the engine where bf16 is emulated: docs/rollout.md)
MKL_MODE = ("MKL_CBWR", "AUTO,STRICT")
os.environ.setdefault(*MKL_MODE)

# glibc's malloc thresholds (mallopt parameters): own mappings from 32 MB, the ceiling its adaptive threshold
# reaches on 64-bit (DEFAULT_MMAP_THRESHOLD_MAX); trimming from 256 MB (keep_freed_memory says why not 64 MB)
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3
_MMAP_THRESHOLD, _TRIM_THRESHOLD = 32 << 20, 256 << 20


def resolve(spec: str) -> torch.device:
    """The device ``resources.device`` names: ``auto`` is CUDA where torch sees
    a GPU, else CPU; CUDA with its index (``cuda`` is the current device:
    ``torch.cuda.set_device`` refuses a device without one, and ``cuda`` never
    equals a tensor's ``cuda:0``). A CUDA device that torch cannot see is a
    RuntimeError saying what torch sees."""
    if not re.match(DEVICE_PATTERN, spec):
        raise ValueError(f"resources.device {spec!r}: expected auto, cpu, cuda or cuda:N")
    if spec == "auto":
        spec = "cuda" if torch.cuda.is_available() else "cpu"
    device = torch.device(spec)
    if device.type == "cuda":
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if (device.index or 0) >= count:
            raise RuntimeError(f"resources.device is {spec!r}, but {cuda_seen()}; use 'cpu' or 'auto' on this machine")
        if device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
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
        return parse_cpuinfo(CPUINFO.read_text())
    except OSError:
        return platform.processor() or platform.machine(), frozenset()


@functools.cache
def onednn_isa_cap() -> str | None:
    """The ISA oneDNN is capped at (``ONEDNN_MAX_CPU_ISA``, or its older name
    ``DNNL_MAX_CPU_ISA``), if set. Read once, as oneDNN reads it: every bf16
    matmul on the CPU asks :func:`bf16_emulated`."""
    cap = next((os.environ[name] for name in ONEDNN_ISA_ENV if os.environ.get(name)), None)
    return cap.strip().upper() if cap else None


@functools.cache
def onednn_bf16() -> bool:
    """Whether this torch runs bf16 matmuls in oneDNN with bf16 support on this
    CPU: torch's own check (built with oneDNN, whose ISA, at its cap, takes bf16),
    asked once. oneDNN says yes from AVX512_CORE on, without bf16 units too: a
    yes alone does not make bf16 native."""
    return torch.backends.mkldnn.is_available() and bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())


def cpu_bf16_native(flags: frozenset[str] | None = None) -> bool:
    """Whether the CPU computes bf16 natively: torch runs bf16 matmuls in
    oneDNN (:func:`onednn_bf16`, and ``torch.backends.mkldnn`` enabled: without
    it torch's own bf16 kernels crawl), the CPU has bf16 units and oneDNN is not
    capped below them (:func:`onednn_isa_cap`). Without flags to read (no
    ``/proc/cpuinfo``: not Linux) torch's answer stands alone."""
    flags = cpu_info()[1] if flags is None else flags
    if not (torch.backends.mkldnn.enabled and onednn_bf16()):
        return False
    return (not flags or bool(flags & _BF16_FLAGS)) and onednn_isa_cap() not in _ISA_CAPS_WITHOUT_BF16


def bf16_emulated() -> bool:
    """Whether bf16 matmuls on the CPU run as fp32 (``TRACEFP4_CPU_BF16``, else :func:`cpu_bf16_native`)."""
    mode = os.environ.get(CPU_BF16_ENV, "auto")
    if mode not in CPU_BF16_MODES:
        raise ValueError(f"{CPU_BF16_ENV}={mode!r}: expected one of {CPU_BF16_MODES}")
    return mode == "emulate" or (mode == "auto" and not cpu_bf16_native())


def cpu_kind() -> dict:
    """The CPU next to a figure: its model, whether bf16 is native or emulated,
    torch's threads, the vector ISA torch's own kernels run, and oneDNN's ISA
    cap where one is set (a machine standing in for another kind)."""
    return {
        "cpu": cpu_info()[0],
        "cpu_bf16": "emulated" if bf16_emulated() else "native",
        "cpu_threads": torch.get_num_threads(),
        "cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "cpu_onednn_isa_cap": onednn_isa_cap(),
    }


@functools.cache
def keep_freed_memory() -> bool:
    """Keep freed tensors' memory in the process for the next ones (glibc's
    malloc; whether it applies). torch's CPU tensors come from malloc, and
    glibc hands a freed block back to the kernel when it was mapped on its own
    (at first, anything from 128 KB) or when the heap's free top grows past a
    threshold: the next tensor of that size then faults in fresh zeroed pages.
    A decode step of the tiny preset at batch 128 took about 900 page faults
    so; with the thresholds held at 32 MB (own mappings) and 64 MB (trim), the
    ceilings glibc's adaptive ones reach anyway, next to none where the CPU
    computes bf16 natively. Where bf16 is emulated in fp32 (:func:`batch_invariant`)
    the heap's free top passes 64 MB, and a call still faulted about 17,000
    pages in; trimming from 256 MB on leaves next to none there too. The
    process keeps no more than its peak. Process-wide, so each step process
    sets it once (:func:`compute_on`)."""
    if platform.libc_ver()[0] != "glibc":
        return False
    libc = ctypes.CDLL(None)
    return bool(libc.mallopt(_M_MMAP_THRESHOLD, _MMAP_THRESHOLD) and libc.mallopt(_M_TRIM_THRESHOLD, _TRIM_THRESHOLD))


def free_bytes(device: torch.device) -> int | None:
    """Bytes a new tensor on ``device`` may take: on CUDA the driver's free
    memory once torch's caching allocator has handed back its unused blocks
    (a count of those blocks would overstate it: partly used segments and
    CUDA graphs' pools serve no large tensor); None on the CPU, where the
    operating system decides (and may overcommit)."""
    if device.type != "cuda":
        return None
    torch.cuda.empty_cache()
    free, _ = torch.cuda.mem_get_info(device)
    return free


def compute_on(device: torch.device) -> torch.device:
    """Make this process compute on ``device`` (returned): a CUDA device
    becomes the current one (Triton launches its kernels there, and streams
    and CUDA graphs are made there, whatever device their tensors are on:
    ``cuda:1`` would otherwise meet cuda:0); on the CPU the process keeps
    freed tensors' memory (:func:`keep_freed_memory`). Every step process and
    every rank of a distributed one starts so."""
    if device.type == "cuda":
        torch.cuda.set_device(device)
    else:
        keep_freed_memory()
    return device


def hardware(device: torch.device) -> dict:
    """Where a step computed, recorded next to its figures: the device, and the GPU's name or the CPU's kind."""
    if device.type == "cuda":
        return {"device": str(device), "gpu": torch.cuda.get_device_name(device)}
    return {"device": str(device), **cpu_kind()}


def hardware_words(hw: dict) -> str:
    """A :func:`hardware` record in the few words a figure names its machine by:
    the GPU (``cuda:0 (NVIDIA H100 80GB HBM3)``) or the CPU and torch's threads
    (``cpu (AMD EPYC 7B13, 2 threads)``); the CPU's bf16 mode is a field of its own."""
    if "gpu" in hw:
        return f"{hw['device']} ({hw['gpu']})"
    return f"{hw['device']} ({hw['cpu']}, {hw['cpu_threads']} threads)"


def measured_on(device: torch.device) -> dict:
    """What a step records beside its speed figures: ``device``
    (:func:`hardware_words`) and the CPU's bf16 mode, ``cpu_bf16`` (None on a
    GPU). A cluster schedules each step on a node of its own: a rollout's
    tokens/s is its machine's, not the evaluation's."""
    hw = hardware(device)
    return {"device": hardware_words(hw), "cpu_bf16": hw.get("cpu_bf16")}


def _computes_in_bf16(x: Tensor) -> bool:
    """Whether a matmul on the CPU tensor ``x`` computes in bf16: bf16 operands, or a bf16 autocast region."""
    return x.dtype == torch.bfloat16 or (
        torch.is_autocast_enabled("cpu") and torch.get_autocast_dtype("cpu") == torch.bfloat16
    )


def batch_invariant(op, *args: Tensor | None, **kwargs) -> Tensor:
    """``op(*args, **kwargs)``, a matmul (``F.linear``, ``torch.bmm``),
    attention (``F.scaled_dot_product_attention``) or the Gated DeltaNet's
    depthwise ``F.conv1d`` (emulated alike), computed so that on the
    CPU each row's bits do not depend on the other rows of the call: a
    request's bits then do not depend on what shares its batch
    (docs/rollout.md). torch's bf16 kernels give that. Where the CPU computes
    in float32, MKL does not for a few rows: there such a call runs in whole
    blocks of rows (:func:`_in_whole_row_blocks`, :func:`_in_whole_query_blocks`).
    That is a float32 model, and bf16 where it is emulated: a bf16 op on a CPU
    without bf16 units runs in fp32 on the operands rounded to bf16 (as
    autocast rounds them), the output rounded to bf16. Other ops run as they
    are (in fp32 where bf16 is emulated); ``None`` arguments (a missing bias)
    and keyword arguments (SDPA's boolean mask) pass through."""
    x = args[0]
    if x.device.type != "cpu":
        return op(*args, **kwargs)
    if _computes_in_bf16(x):
        if not bf16_emulated():
            return _past_small_gemms(op, args, kwargs)
        args = tuple(None if a is None else a.to(torch.bfloat16).float() for a in args)
        with torch.autocast("cpu", enabled=False):
            return _in_whole_blocks(op, args, kwargs).to(torch.bfloat16)
    if x.dtype == torch.float32:
        return _in_whole_blocks(op, args, kwargs)
    return op(*args, **kwargs)


# MKL's float32 GEMM sums the rows of a matmul of fewer than 12 rows in blocks of 4, and the rows past the last
# whole block in another order; a bmm of fewer than 4 rows a matrix, all of them. A row's bits then depended on how
# many rows shared its matmul (the batch bucket, the padded prefill, the experts' grid width). A linear of one
# output (the shared expert's gate) is MKL's matrix-vector product, whose rows sum in another order at most row
# counts from 13 on too; one of two outputs is not. SDPA's float32 kernel multiplies blocks of up to 32 queries
# (64 or 256 from 192 or 768 queries on), and the queries of a last block of 1-3 summed in another order (at 2-3,
# 33-35, 65-67, ... queries; one query alone did not); whole blocks of 4 do not. Measured on a Zen 4 AMD EPYC, MKL's
# AVX-512 and AVX2 kernels alike, inner sizes 64-2048, 1-1024 outputs, head sizes 32-128 (test_device.py -k
# "row_count or query_count"). On an Intel Xeon in MKL's strict mode (MKL_MODE) only a bmm of one row needed it.
SMALL_GEMM_ROWS, GEMM_ROW_BLOCK = 12, 4


# torch runs a bf16 matmul of rows x inner x outputs up to 16^3 on a kernel of its own, a larger one on oneDNN's
# (aten's checksize, LinearAlgebra.cpp), and the two sum in other orders: a small linear layer's row (the test
# models' output projections and routers; 32 x 32 at 1-4 rows, 128 x 8 at 1-4) moved with the rows beside it
MKLDNN_GEMM_MIN = 16**3


def _past_small_gemms(op, args: tuple, kwargs: dict) -> Tensor:
    """``op(*args, **kwargs)`` in native bf16; a linear layer of too few rows
    for oneDNN padded with zero rows past :data:`MKLDNN_GEMM_MIN`, so that
    every row count takes oneDNN's kernel (``tests/test_device.py -k small_bf16``)."""
    x = args[0]
    per_row = x.shape[-1] * args[1].shape[0]
    rows = x.numel() // max(x.shape[-1], 1)
    if op is not F.linear or rows * per_row > MKLDNN_GEMM_MIN or rows == 0:
        return op(*args, **kwargs)
    padded = F.pad(x.reshape(rows, x.shape[-1]), (0, 0, 0, MKLDNN_GEMM_MIN // per_row + 1 - rows))
    return op(padded, *args[1:], **kwargs)[:rows].reshape(*x.shape[:-1], -1)


def _in_whole_blocks(op, args: tuple, kwargs: dict) -> Tensor:
    """``op(*args, **kwargs)`` in float32, a matmul or SDPA in whole blocks of rows."""
    if op is F.scaled_dot_product_attention:
        return _in_whole_query_blocks(*args, **kwargs)
    if op in (F.linear, torch.bmm):
        return _in_whole_row_blocks(op, args[0], list(args[1:]))
    return op(*args, **kwargs)


def _in_whole_row_blocks(op, x: Tensor, rest: list) -> Tensor:
    """``op(x, *rest)`` for ``F.linear`` (rows: all of ``x``'s but its last
    dim) or ``torch.bmm`` (rows: dim 1), fewer than :data:`SMALL_GEMM_ROWS`
    rows padded with zero rows to a whole number of :data:`GEMM_ROW_BLOCK`
    and the padding's outputs dropped, a linear of one output computed as one
    of two (a zero row of weights): each row then sums as in any larger matmul."""
    if op is F.linear and rest[0].shape[0] == 1:
        weight, bias = rest[0], rest[1] if len(rest) > 1 else None
        two = [F.pad(weight, (0, 0, 0, 1)), None if bias is None else F.pad(bias, (0, 1))]
        return _in_whole_row_blocks(op, x, two)[..., :1]
    rows = x.reshape(1, -1, x.shape[-1]) if op is F.linear else x
    n = rows.shape[1]
    short = -n % GEMM_ROW_BLOCK if n < SMALL_GEMM_ROWS else 0
    if not short:
        return op(x, *rest)
    return op(F.pad(rows, (0, 0, 0, short)), *rest)[:, :n].reshape(*x.shape[:-1], -1)


def _in_whole_query_blocks(q: Tensor, k: Tensor, v: Tensor, attn_mask: Tensor | None = None, **kwargs) -> Tensor:
    """``F.scaled_dot_product_attention(q, k, v, attn_mask, **kwargs)`` with more
    than one query padded with zero queries to a whole number of
    :data:`GEMM_ROW_BLOCK` (each seeing every key: no row wholly masked; a
    causal mask lets them see more than the real queries, never the real
    queries more), the padding's outputs dropped. A single query (a decode
    step's) sums as it does in any block."""
    n = q.shape[-2]
    short = -n % GEMM_ROW_BLOCK if n > 1 else 0
    if not short:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, **kwargs)
    if attn_mask is not None and attn_mask.shape[-2] == n:  # a mask of one row covers every query alike
        attn_mask = F.pad(attn_mask, (0, 0, 0, short), value=True)
    return F.scaled_dot_product_attention(F.pad(q, (0, 0, 0, short)), k, v, attn_mask=attn_mask, **kwargs)[..., :n, :]


def size_independent(fn, x: Tensor) -> Tensor:
    """``fn(x)`` for an elementwise function (``F.softplus``, ``torch.sigmoid``)
    in float64, rounded to ``x``'s dtype: each element's bits do not depend on
    the tensor's size. On a CPU the vector and scalar loops of ``fn`` (module
    docstring) still differ in float64's last bit, but a float32 or bf16
    rounding step is 2^29 or more of those: both round alike unless the value
    lies within that bit of a rounding boundary. For the small per-token
    tensors whose values compound (the Gated DeltaNet's decay gate and write
    strength, the shared expert's gate): a last-bit difference in the decay
    gate moved a request's logprobs with its batch, and with FP4 activations
    such a difference can flip a codeword downstream."""
    return fn(x.double()).to(x.dtype)
