"""The public FP4 API: quantize, dequantize, fake-quantize (RTN or guided), and
the guidance codec.

Tensors on CUDA go through the Triton kernels, everything else through the
torch reference; both give the same bits. Input checks live here, once.
"""

import importlib.util
import math
from dataclasses import dataclass

import torch
from torch import Tensor

from . import reference
from .formats import GUIDANCE_BITS, SCALE_MODES, FP4Format, get_format

HAS_TRITON = importlib.util.find_spec("triton") is not None

_FLOAT_INPUTS = (torch.float32, torch.bfloat16)


@dataclass(frozen=True)
class FP4Tensor:
    """A block-scaled FP4 tensor of logical shape ``shape = [..., K]``.

    codes: uint8 ``[..., K//2]``, two E2M1 codes per byte, even element low.
    scales: NVFP4 float8_e4m3fn ``[..., K//16]``; MXFP4 uint8 biased E8M0 ``[..., K//32]``.
    global_scale: NVFP4 float32, a scalar tensor (per tensor) or ``[..., 1]``
    (one per row, per-token activation scales); MXFP4 None.
    """

    codes: Tensor
    scales: Tensor
    global_scale: Tensor | None
    fmt: str
    shape: torch.Size

    def __post_init__(self):
        _check_scales(self.scales, self.fmt, self.shape)


def _check_scales(scales: Tensor, fmt: str, shape: torch.Size) -> None:
    """Scales of the format's dtype, one per block of each of ``shape``'s rows:
    read as another dtype, the CPU path took E4M3 bytes for integers (0x38,
    1.0, as 56) while Triton read their bits; and scales of other rows (a
    slice's guidance carrying the whole batch's) failed deep in the CPU path,
    broadcast there, and were read row for row by Triton's, past their end too.
    Either gave device-dependent values."""
    f = get_format(fmt)
    if scales.dtype != f.scale_dtype:
        raise TypeError(f"{f.name} scales must be {f.scale_dtype} (view the bytes as it), got {scales.dtype}")
    if scales.shape != (*shape[:-1], shape[-1] // f.block_size):
        raise ValueError(
            f"{f.name} scales {tuple(scales.shape)} do not cover shape {tuple(shape)} in blocks of {f.block_size}"
        )


@dataclass(frozen=True)
class Guidance:
    """What training needs to round one tensor the way the rollout did: the
    rollout's scales and the low ``bits`` of each rollout code, packed by
    :func:`compact_codes` (``[..., ceil(K * bits / 8)]``)."""

    low_bits: Tensor
    bits: int
    scales: Tensor
    global_scale: Tensor | None
    fmt: str
    shape: torch.Size

    @classmethod
    def from_rollout(cls, q: FP4Tensor, bits: int) -> "Guidance":
        """Compact a rollout's FP4 outcome to its low ``bits`` plus scales."""
        return cls(compact_codes(unpack_codes(q), bits), bits, q.scales, q.global_scale, q.fmt, q.shape)

    def __post_init__(self):
        _check_scales(self.scales, self.fmt, self.shape)

    def codes(self) -> Tensor:
        """The low bits, one uint8 per element ``[..., K]``."""
        return expand_codes(self.low_bits, self.bits, self.shape[-1])


def graph_capturing(x: Tensor) -> bool:
    """Whether a CUDA graph is being captured on ``x``'s device, when nothing
    may read the device (never for a CPU tensor; torch's CPU builds cannot ask)."""
    return x.is_cuda and torch.cuda.is_current_stream_capturing()


def _backend(t: Tensor):
    if t.is_cuda and HAS_TRITON:
        from . import triton_kernels

        return triton_kernels
    return reference


def _check_input(x: Tensor, fmt: FP4Format) -> None:
    if x.dtype not in _FLOAT_INPUTS:
        raise TypeError(f"{fmt.name} input must be float32 or bfloat16, got {x.dtype}")
    if x.dim() == 0 or x.shape[-1] % fmt.block_size:
        raise ValueError(
            f"{fmt.name} needs a last dimension that is a multiple of {fmt.block_size}, got shape {tuple(x.shape)}"
        )


def _check_bits(bits: int) -> None:
    if bits not in GUIDANCE_BITS:
        raise ValueError(f"guidance bits must be one of {GUIDANCE_BITS}, got {bits!r}")


def valid_global_scale(value: float) -> bool:
    """Whether a static (per-tensor) global scale can scale a tensor: positive and finite."""
    return 0 < value < math.inf


def _global_scale(fmt: FP4Format, global_scale, x: Tensor, check_values: bool = True) -> Tensor | None:
    """A given global scale checked and as float32 on ``x``'s device: a scalar
    (any one-element input), or one per row, shape ``x.shape[:-1] + (1,)``.

    A scalar must be positive and finite. Per-row scales may also be NaN: the
    mark :func:`per_token_global_scale` gives a row holding NaN or Inf, which
    then dequantizes to NaN, as the default per-tensor scale does for a tensor.
    The value checks read the device (a host sync on CUDA); without
    ``check_values``, and inside a CUDA graph capture, which cannot read it,
    only the shape is checked.
    """
    if global_scale is None:
        return None
    if not fmt.has_global_scale:
        raise ValueError(f"{fmt.name} has no global scale; pass global_scale only with nvfp4")
    g = torch.as_tensor(global_scale, dtype=torch.float32, device=x.device)
    check = check_values and not graph_capturing(g)
    rows = tuple(x.shape[:-1]) + (1,)
    if g.numel() == 1 and g.dim() <= 1 and tuple(g.shape) != rows:
        if check and not valid_global_scale(g.item()):
            raise ValueError(f"global_scale must be positive and finite, got {g.item()}")
        return g.reshape(())
    if tuple(g.shape) != rows:
        raise ValueError(
            f"global_scale must be a scalar or one per row, shape {rows} for input shape {tuple(x.shape)}, "
            f"got shape {tuple(g.shape)}"
        )
    if check:
        bad = ~(g > 0) & ~torch.isnan(g) | torch.isinf(g)
        if bool(bad.any()):
            raise ValueError(
                f"per-row global_scale must be positive and finite (or NaN for a row holding NaN/Inf), "
                f"got {g[bad][0].item()} at row {tuple(bad.nonzero()[0].tolist()[:-1])}"
            )
    return g


def _scale_mode(fmt: FP4Format, scale_mode: str | None) -> str:
    if scale_mode is None:
        return "floor"
    if fmt.has_global_scale:
        raise ValueError(f"scale_mode applies to mxfp4 only, got scale_mode={scale_mode!r} for {fmt.name}")
    if scale_mode not in SCALE_MODES:
        raise ValueError(f"unknown MXFP4 scale mode {scale_mode!r}; expected one of {SCALE_MODES}")
    return scale_mode


def _check_guide(x: Tensor, fmt: FP4Format, guide: Guidance, global_scale, scale_mode) -> None:
    if global_scale is not None or scale_mode is not None:
        raise ValueError("guided rounding uses the rollout's scales; do not pass global_scale or scale_mode")
    if guide.fmt != fmt.name:
        raise ValueError(f"guidance is {guide.fmt}, but {fmt.name} was asked for")
    if tuple(guide.shape) != tuple(x.shape):
        raise ValueError(f"guidance covers shape {tuple(guide.shape)}, input has shape {tuple(x.shape)}")
    g = guide.global_scale
    if fmt.has_global_scale and (g is None or (g.dim() and tuple(g.shape) != tuple(x.shape[:-1]) + (1,))):
        shape = None if g is None else tuple(g.shape)
        raise ValueError(
            f"guidance's global scale must be a scalar or one per row {tuple(x.shape[:-1]) + (1,)}, got {shape}"
        )
    _check_bits(guide.bits)


def quantize(
    x: Tensor,
    fmt: str | FP4Format,
    *,
    global_scale: float | Tensor | None = None,
    scale_mode: str | None = None,
    guide: Guidance | None = None,
    check_scale: bool = True,
) -> FP4Tensor:
    """Quantize ``x`` (float32/bfloat16 ``[..., K]``) to NVFP4 or MXFP4.

    Rounding is to nearest, ties to the even code, saturating at +-6; with
    ``guide`` it is TRACE's guided rounding under the rollout's scales.
    ``global_scale`` (NVFP4): a scalar, or one per row ``[..., 1]`` such as
    :func:`per_token_global_scale` gives; by default ``amax / (6 * 448)`` of
    the whole tensor. ``check_scale=False`` skips reading its values back to
    check them (a host sync on CUDA), for callers whose scales were checked
    where they were made.

    Special values: a block holding NaN gets a NaN scale (E4M3 0x7F, E8M0 0xFF)
    and dequantizes to NaN. MXFP4 treats +-Inf the same way. NVFP4 with a
    given finite ``global_scale`` saturates +-Inf to +-6 at block scale 448
    (like hardware ``satfinite`` conversion); with the default global scale,
    NaN or Inf anywhere makes the global scale NaN and the whole tensor
    dequantizes to NaN. All-zero blocks get scale 1.0 (NVFP4) or 2^-127
    (MXFP4) and zero codes; values below the smallest step round to +-0.
    """
    f = get_format(fmt)
    _check_input(x, f)
    backend = _backend(x)
    if guide is not None:
        _check_guide(x, f, guide, global_scale, scale_mode)
        codes = backend.quantize_guided(x, f, guide.scales, guide.global_scale, guide.codes(), guide.bits)
        return FP4Tensor(codes, guide.scales, guide.global_scale, f.name, x.shape)
    g = _global_scale(f, global_scale, x, check_scale)
    codes, scales, g = backend.quantize(x, f, g, _scale_mode(f, scale_mode))
    return FP4Tensor(codes, scales, g, f.name, x.shape)


def per_token_global_scale(x: Tensor) -> Tensor:
    """NVFP4 global scales of ``x``'s rows, float32 ``[..., 1]``: ``amax(row) /
    (6 * 448)``, the per-token activation scale of FlashInfer's per-token NVFP4
    quantizer (SGLang ``nvfp4_online``); 1.0 for an all-zero row, NaN for a row
    holding NaN or Inf."""
    if x.dtype not in _FLOAT_INPUTS or x.dim() == 0:
        raise TypeError(
            f"per-token global scales need a float32 or bfloat16 tensor of rows, got {x.dtype} {tuple(x.shape)}"
        )
    return reference.per_token_global_scale(x)


def dequantize(q: FP4Tensor) -> Tensor:
    """Float32 values ``e2m1(code) * scale * global_scale`` of ``q``."""
    f = get_format(q.fmt)
    return _backend(q.codes).dequantize(q.codes, f, q.scales, q.global_scale).reshape(q.shape)


def unpack_codes(q: FP4Tensor) -> Tensor:
    """One uint8 code per element, ``[..., K]``."""
    return reference.unpack_nibbles(q.codes)


def code_values(codes: Tensor) -> Tensor:
    """Float32 E2M1 values of unpacked codes (no scale)."""
    return reference.e2m1_decode(codes)


class _StraightThrough(torch.autograd.Function):
    """Forward: the quantized values; backward: the gradient unchanged (STE)."""

    @staticmethod
    def forward(ctx, x: Tensor, quantized: Tensor) -> Tensor:
        return quantized

    @staticmethod
    def backward(ctx, grad: Tensor):
        return grad, None


def straight_through(x: Tensor, values: Tensor) -> Tensor:
    """``values`` (as ``x``'s dtype and shape) in the forward, ``x``'s gradient
    passed through unchanged in the backward. Exactly ``values``: the common
    ``x + (values - x).detach()`` rounds twice, one ulp off where ``values`` lies
    far from ``x`` (guided rounding to the farther neighbour, saturation)."""
    return _StraightThrough.apply(x, values.to(x.dtype).reshape(x.shape))


def fake_quantize(
    x: Tensor,
    fmt: str | FP4Format,
    *,
    global_scale: float | Tensor | None = None,
    scale_mode: str | None = None,
    guide: Guidance | None = None,
    block_size: int | None = None,
) -> Tensor:
    """``dequantize(quantize(x, ...))`` in ``x``'s dtype, with a straight-through gradient.

    ``fmt="fp8"`` is the W4A8 activation path: FP8 E4M3 with one scale per
    row (token), or per ``block_size`` elements. ``block_size`` applies to fp8 only.
    """
    with torch.no_grad():
        if fmt == "fp8":
            if global_scale is not None or scale_mode is not None or guide is not None:
                raise ValueError(
                    "fp8 scales each row (or block_size elements) by its own amax: global_scale, "
                    "scale_mode and guide are FP4's"
                )
            if x.dtype not in _FLOAT_INPUTS:
                raise TypeError(f"fp8 fake quantization takes float32 or bfloat16, got {x.dtype}")
            if block_size is not None and (block_size <= 0 or x.shape[-1] % block_size):
                raise ValueError(f"fp8 block_size {block_size} does not divide the last dimension {x.shape[-1]}")
            values = reference.fp8_fake_quantize(x, block_size)
        else:
            if block_size is not None:
                raise ValueError(f"block_size applies to fp8 only; {fmt} blocks are fixed")
            f = get_format(fmt)
            _check_input(x, f)
            backend = _backend(x)
            if guide is not None:
                _check_guide(x, f, guide, global_scale, scale_mode)
                values = backend.fake_quantize_guided(x, f, guide.scales, guide.global_scale, guide.codes(), guide.bits)
            else:
                values = backend.fake_quantize(x, f, _global_scale(f, global_scale, x), _scale_mode(f, scale_mode))
    return straight_through(x, values)


def compact_codes(codes: Tensor, bits: int) -> Tensor:
    """Keep the low ``bits`` (1..4) of each uint8 code, densely packed:
    ``[..., n] -> [..., ceil(n * bits / 8)]`` (k = 1: eight codes per byte)."""
    _check_bits(bits)
    if codes.dtype != torch.uint8:
        raise TypeError(f"codes must be uint8, got {codes.dtype}")
    return _backend(codes).compact_codes(codes, bits)


def expand_codes(packed: Tensor, bits: int, n: int) -> Tensor:
    """Inverse of :func:`compact_codes`: ``[..., ceil(n * bits / 8)] -> [..., n]``."""
    _check_bits(bits)
    if packed.dtype != torch.uint8:
        raise TypeError(f"packed guidance must be uint8, got {packed.dtype}")
    if packed.shape[-1] != -(-n * bits // 8):
        raise ValueError(
            f"packed guidance has {packed.shape[-1]} bytes per row; {n} codes of {bits} bits need {-(-n * bits // 8)}"
        )
    return _backend(packed).expand_codes(packed, bits, n)
