"""Triton kernels for the FP4 numerics, the default path for CUDA tensors.

Every launcher here has the signature of the function of the same name in
:mod:`reference` and returns the same bits; the tests check that on CPU
tensors under ``TRITON_INTERPRET=1``, and compile every kernel for sm_90 and
sm_100 (tests/test_triton_compile.py: the interpreter never runs the compiler,
which rejects code the interpreter runs). E4M3 and E8M0 are encoded and decoded
with integer bit operations only (the interpreter's float8 casts are wrong),
divisions use ``div_rn`` so that they round as torch's do, signs are set
as bits, never by negating a float (:func:`_e2m1_signed` says why), and
offsets are int64 (a KV cache dequantized whole can pass 2^31 elements).

One kernel, :func:`_fp4_block_kernel`, serves quantize+pack, guided quantize
and both fake-quant paths; compile-time flags pick where scales come from and
what is written. An NVFP4 global scale is a scalar or one per row
(``PER_ROW``: block ``b`` reads the scale of row ``b // blocks_per_row``).
"""

import torch
import triton
import triton.language as tl
from torch import Tensor

from .formats import FP4Format
from .reference import nvfp4_global_scale

BLOCKS_PER_PROGRAM = 64
GROUPS_PER_PROGRAM = 256


@triton.jit
def _e2m1_magnitude(a):
    # round |y| to nearest, ties to the even code (formats.E2M1_VALUES midpoints)
    m = (a > 0.25).to(tl.int32)
    m += (a >= 0.75).to(tl.int32)
    m += (a > 1.25).to(tl.int32)
    m += (a >= 1.75).to(tl.int32)
    m += (a > 2.5).to(tl.int32)
    m += (a >= 3.5).to(tl.int32)
    m += (a > 5.0).to(tl.int32)
    return m


@triton.jit
def _e2m1_value(m):
    # magnitude index -> 0, .5, 1, 1.5 | 2, 3 | 4, 6
    return tl.where(m < 4, m * 0.5, tl.where(m < 6, m - 2.0, (m - 4) * 2.0))


@triton.jit
def _e2m1_signed(m, negative):
    # magnitude index and sign -> the code's value, code 8 being -0.0: the sign bit is set, never negated (Triton
    # 3.6, the one torch 2.11 pins, compiles a float's unary minus as 0 - x, which is +0.0 where x is 0.0)
    magnitude = _e2m1_value(m).to(tl.int32, bitcast=True)
    return (magnitude | (negative.to(tl.int32) << 31)).to(tl.float32, bitcast=True)


@triton.jit
def _e4m3_encode(v):
    # float32 v >= 0 (or NaN) -> E4M3 bits, round to nearest even, saturating at 448
    bits = v.to(tl.int32, bitcast=True)
    exponent = (bits >> 23) & 0xFF
    # normal range (v >= 2^-6): round the 23-bit mantissa to 3 bits, carry into the exponent
    normal = ((bits + 0x7FFFF + ((bits >> 20) & 1)) >> 20) - ((127 - 7) << 3)
    # subnormal range: m * 2^-9 with m = RNE(v * 2^9); m = 8 is the code of 2^-6
    full = tl.where(exponent > 0, (bits & 0x7FFFFF) | 0x800000, bits & 0x7FFFFF)
    shift = tl.minimum(tl.maximum(141 - exponent, 1), 30)
    q = full >> shift
    rem = full & ((1 << shift) - 1)
    half = 1 << (shift - 1)
    q += ((rem > half) | ((rem == half) & ((q & 1) == 1))).to(tl.int32)
    code = tl.minimum(tl.where(exponent >= 121, normal, q), 0x7E)
    return tl.where(v != v, 0x7F, code)


@triton.jit
def _e4m3_decode(b):
    # E4M3 bits -> float32, as torch reads float8_e4m3fn: a byte with the sign bit set (never a scale quantize
    # makes, but a scale handed in may hold one) is the negative value, and 0xFF is NaN like 0x7F
    e = (b >> 3) & 0xF
    m = b & 0x7
    normal = (((e + 120) << 23) | (m << 20)).to(tl.float32, bitcast=True)
    magnitude = tl.where(e == 0, m.to(tl.float32) * 0.001953125, normal).to(tl.int32, bitcast=True)
    value = (magnitude | ((b & 0x80) << 24)).to(tl.float32, bitcast=True)
    return tl.where((b & 0x7F) == 0x7F, float("nan"), value)


@triton.jit
def _e8m0_decode(b):
    # biased exponent -> 2^(b - 127); 0 is the subnormal 2^-127, 0xFF is NaN
    bits = tl.where(b == 0, 0x400000, b << 23)
    return tl.where(b == 0xFF, 0x7FC00000, bits).to(tl.float32, bitcast=True)


@triton.jit
def _mxfp4_exponent(amax, RCEIL: tl.constexpr):
    if RCEIL:
        v = tl.div_rn(amax, 6.0).to(tl.int32, bitcast=True)
        exponent = (v >> 23) & 0xFF
        mantissa = v & 0x7FFFFF
        biased = tl.where(exponent == 0, (mantissa > 0x400000).to(tl.int32), exponent + (mantissa != 0).to(tl.int32))
    else:
        exponent = (amax.to(tl.int32, bitcast=True) >> 23) & 0xFF
        biased = tl.maximum(exponent - 2, 0)
    return tl.where(exponent == 0xFF, 0xFF, biased)


@triton.jit
def _global(global_ptr, blk, blk_ok, blocks_per_row, PER_ROW: tl.constexpr):
    # the NVFP4 global scale of each block: its row's, or the one scalar. One return: the compiler goes on past a
    # return inside a constexpr branch, so both returns would have to be of one type (the interpreter returns)
    if PER_ROW:
        g = tl.load(global_ptr + blk // blocks_per_row, mask=blk_ok, other=1.0)
    else:
        g = tl.load(global_ptr)
    return g


@triton.jit
def _fp4_block_kernel(
    x_ptr,
    scales_ptr,  # uint8 [n_blocks]: written unless GUIDED, read if GUIDED
    global_ptr,  # float32 scalar, or [n_rows] with PER_ROW (NVFP4)
    guidance_ptr,  # uint8 [n_blocks * BS]: low bits of the rollout codes (GUIDED)
    codes_ptr,  # uint8 [n_blocks * BS // 2] (WRITE_CODES)
    values_ptr,  # float32 [n_blocks * BS] (WRITE_VALUES)
    n_blocks,
    blocks_per_row,
    BS: tl.constexpr,
    NVFP4: tl.constexpr,
    PER_ROW: tl.constexpr,
    RCEIL: tl.constexpr,
    GUIDED: tl.constexpr,
    BITS: tl.constexpr,
    WRITE_CODES: tl.constexpr,
    WRITE_VALUES: tl.constexpr,
    BLOCKS: tl.constexpr,
):
    blk = tl.program_id(0).to(tl.int64) * BLOCKS + tl.arange(0, BLOCKS)
    blk_ok = blk < n_blocks
    offs = blk[:, None] * BS + tl.arange(0, BS)[None, :]
    ok = blk_ok[:, None]
    x = tl.load(x_ptr + offs, mask=ok, other=0.0).to(tl.float32)
    if NVFP4:
        g = _global(global_ptr, blk, blk_ok, blocks_per_row, PER_ROW)

    if GUIDED:
        s = tl.load(scales_ptr + blk, mask=blk_ok, other=0).to(tl.int32)
    else:
        amax = tl.max(tl.abs(x), axis=1)
        amax = tl.where(tl.max((x != x).to(tl.int32), axis=1) > 0, float("nan"), amax)
        if NVFP4:
            s = _e4m3_encode(tl.div_rn(amax, 6.0 * g))
            s = tl.where(s == 0, 0x38, s)  # a zero scale becomes 1.0
        else:
            s = _mxfp4_exponent(amax, RCEIL)
        tl.store(scales_ptr + blk, s.to(tl.uint8), mask=blk_ok)
    if NVFP4:
        unit = _e4m3_decode(s) * g
    else:
        unit = _e8m0_decode(s)

    y = tl.div_rn(x, unit[:, None])
    a = tl.abs(y)
    a = tl.where(a > 6.0, 6.0, a)  # saturate; NaN stays NaN and rounds to 0
    n = _e2m1_magnitude(a)
    sign = (y < 0).to(tl.int32) << 3
    if GUIDED:
        guide = tl.load(guidance_ptr + offs, mask=ok, other=0).to(tl.int32)
        on_n = _e2m1_value(n)
        other = n + (a > on_n).to(tl.int32) - (a < on_n).to(tl.int32)
        if BITS == 4:
            rollout = _e2m1_signed(guide & 7, (guide & 8) != 0)
            signed = tl.where(y < 0, -1.0, 1.0)
            pick = tl.abs(signed * _e2m1_value(other) - rollout) < tl.abs(signed * on_n - rollout)
        else:
            mask: tl.constexpr = (1 << BITS) - 1
            pick = (((sign | other) & mask) == guide) & (((sign | n) & mask) != guide)
        n = tl.where(pick, other, n)
    codes = n | sign

    if WRITE_CODES:
        lo, hi = tl.split(tl.reshape(codes, (BLOCKS, BS // 2, 2)))
        pair_offs = blk[:, None] * (BS // 2) + tl.arange(0, BS // 2)[None, :]
        tl.store(codes_ptr + pair_offs, (lo | (hi << 4)).to(tl.uint8), mask=ok)
    if WRITE_VALUES:
        v = _e2m1_signed(n, sign != 0) * unit[:, None]
        if GUIDED:
            v = tl.where(x != x, x, v)  # the rollout's scale cannot carry a NaN
        tl.store(values_ptr + offs, v, mask=ok)


@triton.jit
def _dequantize_kernel(
    codes_ptr,
    scales_ptr,
    global_ptr,
    out_ptr,
    n_blocks,
    blocks_per_row,
    BS: tl.constexpr,
    NVFP4: tl.constexpr,
    PER_ROW: tl.constexpr,
    BLOCKS: tl.constexpr,
):
    blk = tl.program_id(0).to(tl.int64) * BLOCKS + tl.arange(0, BLOCKS)
    blk_ok = blk < n_blocks
    pair_offs = blk[:, None] * (BS // 2) + tl.arange(0, BS // 2)[None, :]
    packed = tl.load(codes_ptr + pair_offs, mask=blk_ok[:, None], other=0).to(tl.int32)
    codes = tl.reshape(tl.join(packed & 0xF, packed >> 4), (BLOCKS, BS))
    s = tl.load(scales_ptr + blk, mask=blk_ok, other=0).to(tl.int32)
    if NVFP4:
        unit = _e4m3_decode(s) * _global(global_ptr, blk, blk_ok, blocks_per_row, PER_ROW)
    else:
        unit = _e8m0_decode(s)
    v = _e2m1_signed(codes & 7, (codes & 8) != 0)
    offs = blk[:, None] * BS + tl.arange(0, BS)[None, :]
    tl.store(out_ptr + offs, v * unit[:, None], mask=blk_ok[:, None])


@triton.jit
def _compact_kernel(codes_ptr, out_ptr, n, n_bytes, BITS: tl.constexpr, GROUPS: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    group = tl.program_id(1) * GROUPS + tl.arange(0, GROUPS)
    col = group[:, None] * 8 + tl.arange(0, 8)[None, :]
    c = tl.load(codes_ptr + row * n + col, mask=col < n, other=0).to(tl.int64)
    word = tl.sum((c & ((1 << BITS) - 1)) << (tl.arange(0, 8)[None, :] * BITS), axis=1)
    for b in tl.static_range(BITS):
        byte = group * BITS + b
        tl.store(out_ptr + row * n_bytes + byte, ((word >> (8 * b)) & 0xFF).to(tl.uint8), mask=byte < n_bytes)


@triton.jit
def _expand_kernel(packed_ptr, out_ptr, n, n_bytes, BITS: tl.constexpr, GROUPS: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    group = tl.program_id(1) * GROUPS + tl.arange(0, GROUPS)
    word = tl.zeros((GROUPS,), dtype=tl.int64)
    for b in tl.static_range(BITS):
        byte = group * BITS + b
        word |= tl.load(packed_ptr + row * n_bytes + byte, mask=byte < n_bytes, other=0).to(tl.int64) << (8 * b)
    col = group[:, None] * 8 + tl.arange(0, 8)[None, :]
    codes = (word[:, None] >> (tl.arange(0, 8)[None, :] * BITS)) & ((1 << BITS) - 1)
    tl.store(out_ptr + row * n + col, codes.to(tl.uint8), mask=col < n)


def _launch(
    x: Tensor,
    fmt: FP4Format,
    *,
    scales: Tensor | None = None,
    global_scale: Tensor | None = None,
    scale_mode: str = "floor",
    guidance: Tensor | None = None,
    bits: int = 4,
    write_codes: bool,
    write_values: bool,
):
    bs = fmt.block_size
    xf = x.contiguous().reshape(-1, bs)
    n_blocks = xf.shape[0]
    guided = guidance is not None
    if fmt.has_global_scale and global_scale is None:
        global_scale = nvfp4_global_scale(x.abs().amax() if x.numel() else x.new_zeros(()))
    if scales is None:
        scales = torch.empty(x.shape[:-1] + (x.shape[-1] // bs,), dtype=fmt.scale_dtype, device=x.device)
    else:  # the rollout's, which the kernel reads as one flat array
        scales = scales.contiguous()
    codes = torch.empty(x.shape[:-1] + (x.shape[-1] // 2,), dtype=torch.uint8, device=x.device) if write_codes else x
    values = torch.empty(x.shape, dtype=torch.float32, device=x.device) if write_values else x
    g = global_scale.contiguous() if fmt.has_global_scale else x
    grid = (triton.cdiv(n_blocks, BLOCKS_PER_PROGRAM),)
    _fp4_block_kernel[grid](
        xf,
        scales.view(torch.uint8),
        g,
        guidance.contiguous() if guided else x,
        codes,
        values,
        n_blocks,
        x.shape[-1] // bs,
        BS=bs,
        NVFP4=fmt.has_global_scale,
        PER_ROW=fmt.has_global_scale and global_scale.dim() > 0,
        RCEIL=scale_mode == "rceil",
        GUIDED=guided,
        BITS=bits,
        WRITE_CODES=write_codes,
        WRITE_VALUES=write_values,
        BLOCKS=BLOCKS_PER_PROGRAM,
    )
    return codes, values, scales, global_scale


def quantize(x: Tensor, fmt: FP4Format, global_scale: Tensor | None, scale_mode: str):
    codes, _, scales, g = _launch(
        x, fmt, global_scale=global_scale, scale_mode=scale_mode, write_codes=True, write_values=False
    )
    return codes, scales, g


def quantize_guided(
    x: Tensor, fmt: FP4Format, scales: Tensor, global_scale: Tensor | None, guidance: Tensor, bits: int
):
    codes, *_ = _launch(
        x,
        fmt,
        scales=scales,
        global_scale=global_scale,
        guidance=guidance,
        bits=bits,
        write_codes=True,
        write_values=False,
    )
    return codes


def fake_quantize(x: Tensor, fmt: FP4Format, global_scale: Tensor | None, scale_mode: str) -> Tensor:
    return _launch(x, fmt, global_scale=global_scale, scale_mode=scale_mode, write_codes=False, write_values=True)[1]


def fake_quantize_guided(
    x: Tensor, fmt: FP4Format, scales: Tensor, global_scale: Tensor | None, guidance: Tensor, bits: int
) -> Tensor:
    return _launch(
        x,
        fmt,
        scales=scales,
        global_scale=global_scale,
        guidance=guidance,
        bits=bits,
        write_codes=False,
        write_values=True,
    )[1]


def dequantize(packed: Tensor, fmt: FP4Format, scales: Tensor, global_scale: Tensor | None) -> Tensor:
    bs = fmt.block_size
    n_blocks = packed.numel() * 2 // bs
    out = torch.empty(packed.shape[:-1] + (packed.shape[-1] * 2,), dtype=torch.float32, device=packed.device)
    g = global_scale.contiguous() if fmt.has_global_scale else packed
    grid = (triton.cdiv(n_blocks, BLOCKS_PER_PROGRAM),)
    _dequantize_kernel[grid](
        packed.contiguous(),
        scales.contiguous().view(torch.uint8),
        g,
        out,
        n_blocks,
        packed.shape[-1] * 2 // bs,
        BS=bs,
        NVFP4=fmt.has_global_scale,
        PER_ROW=fmt.has_global_scale and global_scale.dim() > 0,
        BLOCKS=BLOCKS_PER_PROGRAM,
    )
    return out


def _rows(t: Tensor) -> Tensor:
    return t.contiguous().reshape(-1, t.shape[-1]) if t.dim() else t.reshape(1, 1)


def compact_codes(codes: Tensor, bits: int) -> Tensor:
    n = codes.shape[-1]
    n_bytes = -(-n * bits // 8)
    rows = _rows(codes)
    out = torch.empty(codes.shape[:-1] + (n_bytes,), dtype=torch.uint8, device=codes.device)
    grid = (rows.shape[0], triton.cdiv(-(-n // 8), GROUPS_PER_PROGRAM))
    _compact_kernel[grid](rows, out, n, n_bytes, BITS=bits, GROUPS=GROUPS_PER_PROGRAM)
    return out


def expand_codes(packed: Tensor, bits: int, n: int) -> Tensor:
    n_bytes = packed.shape[-1]
    rows = _rows(packed)
    out = torch.empty(packed.shape[:-1] + (n,), dtype=torch.uint8, device=packed.device)
    grid = (rows.shape[0], triton.cdiv(-(-n // 8), GROUPS_PER_PROGRAM))
    _expand_kernel[grid](rows, out, n, n_bytes, BITS=bits, GROUPS=GROUPS_PER_PROGRAM)
    return out
