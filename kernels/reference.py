"""Plain-PyTorch reference of the FP4 numerics: the CPU path, and the source of
truth every Triton kernel is tested against bit for bit.

Everything works on a blocked view ``[..., n_blocks, block_size]`` of the input
and in float32: a block's *unit* is the factor its E2M1 codes are multiplied by
(``scale * global_scale`` for NVFP4, ``2^e`` for MXFP4), and ``y = x / unit``
is what gets rounded onto the E2M1 grid.
"""

import functools
import os
from concurrent.futures import ThreadPoolExecutor

import torch
from torch import Tensor

from .formats import E2M1_MAX, E2M1_VALUES, E4M3_MAX, E8M0_NAN, FP4Format

CHUNK_ELEMENTS = 1 << 19
_E2M1_SIGNED = torch.tensor([v for v in E2M1_VALUES] + [-v for v in E2M1_VALUES])
# value pairs of every byte (low nibble first), read as one int64 per byte
_BYTE_PAIRS = torch.stack([_E2M1_SIGNED.repeat(16), _E2M1_SIGNED.repeat_interleave(16)], -1)
_BYTE_PAIRS_I64 = _BYTE_PAIRS.contiguous().view(torch.int64).view(-1)


def to_device(t: Tensor, device: torch.device | str) -> Tensor:
    """``t`` (a host tensor) on ``device`` without making the host wait: a plain
    copy onto a GPU synchronizes its stream (PyTorch waits for the copy, and so
    for every kernel queued before it), which inside a training or decode step
    stalls the host. A copy from pageable memory is staged before the call
    returns, so ``t`` may go at once."""
    device = torch.device(device)
    return t.to(device, non_blocking=device.type == "cuda")


@functools.cache
def on_device(table: Tensor, device: torch.device) -> Tensor:
    """A constant lookup table on ``device``, copied there once (not at every call)."""
    return to_device(table, device)


def blocked(x: Tensor, block_size: int) -> Tensor:
    """View ``[..., K]`` as ``[..., K // block_size, block_size]``."""
    if x.shape[-1] % block_size:
        raise ValueError(f"last dimension {x.shape[-1]} is not a multiple of the block size {block_size}")
    return x.reshape(*x.shape[:-1], x.shape[-1] // block_size, block_size)


def block_amax(xb: Tensor) -> Tensor:
    """Largest magnitude of each block, float32; NaN if the block holds one."""
    return xb.abs().amax(-1).float()


def divide(x: Tensor, c: float) -> Tensor:
    """``x / c`` correctly rounded on every device. CUDA divides a tensor by a
    host number as ``x * (1 / c)`` (PyTorch's true-division kernel), which
    lands one ulp off the CPU's ``x / c`` for a quarter to a half of all values
    (``c`` 2688 or 448), and with it a scale, and the codes under it; a divisor
    on ``x``'s own device is divided exactly. ``torch.full`` makes it without a
    host copy, so that a CUDA graph captures it."""
    return x / torch.full((), c, dtype=x.dtype, device=x.device)


def nvfp4_global_scale(amax: Tensor) -> Tensor:
    """``amax / (6 * 448)`` as ModelOpt and torchao define it, float32, of each
    amax given (a scalar for a tensor, ``[..., 1]`` for rows).

    A non-finite amax (the tensor holds NaN or Inf) gives NaN, so that every
    element dequantizes to NaN instead of to a silently wrong finite value; a
    zero one (an all-zero tensor, or one too small for float32) gives 1.0.
    """
    g = divide(amax.float(), E2M1_MAX * E4M3_MAX)
    g = torch.where(g == 0, 1.0, g)
    return torch.where(torch.isfinite(g), g, torch.nan)


def per_token_global_scale(x: Tensor) -> Tensor:
    """One NVFP4 global scale per row ``[..., 1]``: ``amax(row) / (6 * 448)``, as
    FlashInfer's per-token NVFP4 quantizer (SGLang's ``nvfp4_online``) computes
    it at run time instead of a static per-tensor ``input_scale``."""
    return nvfp4_global_scale(x.abs().amax(-1, keepdim=True))


def per_block(global_scale: Tensor | None, shape: torch.Size, block_size: int) -> Tensor | None:
    """The global scale of each block of a ``shape`` tensor, flat ``[n_blocks]``
    (a per-row ``[..., 1]`` scale repeated over the row's blocks), or the
    scalar (or None) as it is."""
    if global_scale is None or global_scale.dim() == 0:
        return global_scale
    return global_scale.expand(*shape[:-1], shape[-1] // block_size).reshape(-1)


def nvfp4_scales(amax: Tensor, global_scale: Tensor) -> Tensor:
    """E4M3 block scales ``e4m3(amax / (6 * g))``: round to nearest even,
    saturating at 448; a zero scale becomes 1.0; a NaN block keeps a NaN scale."""
    s = torch.clamp(amax / (E2M1_MAX * global_scale), max=E4M3_MAX).to(torch.float8_e4m3fn)
    bits = s.view(torch.uint8)
    return torch.where(bits == 0, 0x38, bits).view(torch.float8_e4m3fn)


def mxfp4_scales(amax: Tensor, scale_mode: str = "floor") -> Tensor:
    """Biased E8M0 block exponents, read off the float32 bits of ``amax``.

    floor (OCP MX v1.0): ``floor(log2(amax)) - 2``; rceil: ``ceil(log2(amax / 6))``.
    Both clamp to the smallest exponent (2^-127, also used for all-zero
    blocks); a block holding NaN or Inf gets 0xFF (NaN).
    """
    if scale_mode == "floor":
        exponent = (amax.view(torch.int32) >> 23) & 0xFF
        biased = torch.clamp(exponent - 2, min=0)
    elif scale_mode == "rceil":
        v = divide(amax, E2M1_MAX).view(torch.int32)
        exponent, mantissa = (v >> 23) & 0xFF, v & 0x7FFFFF
        # ceil(log2 v): the exponent, plus one unless v is an exact power of two;
        # below the normal range only values above 2^-127 need 2^-126
        biased = torch.where(exponent == 0, (mantissa > 0x400000).int(), exponent + (mantissa != 0).int())
    else:
        raise ValueError(f"unknown MXFP4 scale mode {scale_mode!r}; expected 'floor' or 'rceil'")
    return torch.where(exponent == 0xFF, E8M0_NAN, biased).to(torch.uint8)


def scale_units(fmt: FP4Format, scales: Tensor, global_scale: Tensor | None) -> Tensor:
    """Float32 factor of each block: ``scale * global_scale`` (NVFP4) or ``2^(e - 127)`` (MXFP4)."""
    if fmt.has_global_scale:
        return scales.float() * global_scale
    e = scales.int()
    bits = torch.where(e == 0, 0x400000, e << 23)  # 2^-127 is subnormal in float32
    bits = torch.where(e == E8M0_NAN, 0x7FC00000, bits)
    return bits.view(torch.float32)


def e2m1_magnitude(a: Tensor) -> Tensor:
    """Magnitude index 0..7 of ``a = |y|`` rounded to nearest, ties to the even
    code, saturating at 6; NaN gives 0.

    Up to 2 the grid steps by 0.5, so ``round(2a)`` (half to even) is the
    index; above 2 three midpoints remain (2.5 and 5 tie down, 3.5 ties up).
    """
    idx = torch.clamp(a, max=2.0).mul_(2.0).round_().nan_to_num_(0.0).to(torch.uint8)
    idx += a > 2.5
    idx += a >= 3.5
    idx += a > 5.0
    return idx


def _e2m1_encode_rule(y: Tensor) -> Tensor:
    """:func:`e2m1_encode` as the rule says it, op by op."""
    return e2m1_magnitude(y.abs()) | ((y < 0).to(torch.uint8) << 3)


# E2M1 codes of float32 values by their top 11 bits (sign, exponent, 2 mantissa
# bits) and whether the other 21 bits are zero: every rounding boundary (0.25,
# 0.75, 1.25, 1.75, 2.5, 3.5, 5), 0 and Inf sit at a bucket's start, so the code
# is constant on the rest of the bucket. Index ``key * 2 + (rest != 0)``.
_KEYS = torch.arange(1 << 11, dtype=torch.int32) << 21
_ENCODE_TABLE = _e2m1_encode_rule(torch.stack([_KEYS, _KEYS | 1], -1).view(torch.float32)).flatten()


def e2m1_encode(y: Tensor) -> Tensor:
    """Round-to-nearest-even E2M1 codes of ``y`` (uint8, one per element).

    The sign bit is set for ``y < 0``, so a small negative value gives -0
    (0b1000) as in ModelOpt, while -0.0 and NaN give +0. Float32 goes through
    one table lookup on its bits (the same codes as the rule, in 7 ops instead
    of 16: the CPU quantize's hot loop); other dtypes through the rule.
    """
    if y.dtype != torch.float32:
        return _e2m1_encode_rule(y)
    bits = y.contiguous().view(torch.int32)
    index = ((bits >> 20) & 0xFFE) | ((bits & 0x1FFFFF) != 0)
    return torch.index_select(on_device(_ENCODE_TABLE, y.device), 0, index.view(-1)).view(y.shape)


def e2m1_encode_guided(y: Tensor, guidance: Tensor, bits: int) -> Tensor:
    """E2M1 codes of ``y`` rounded as the rollout did (TRACE's guided rounding).

    ``y`` lies between two neighbouring codewords; ``guidance`` holds the low
    ``bits`` of the rollout's code for the same element. The neighbour the
    guidance points at is chosen:

    - bits < 4: the neighbour whose low bits equal the guidance, when exactly
      one does (adjacent codes differ in their lowest bit, so one bit tells the
      two apart whenever the rollout code is one of them); RTN otherwise.
    - bits = 4: the rollout code is known, so the neighbour closest to its
      value (-0 and +0 are the same codeword).

    Values on a codeword, beyond +-6, or NaN have one candidate and keep it.
    """
    a = torch.clamp(y.abs(), max=E2M1_MAX)  # beyond 6 the only candidate is 6
    n = e2m1_magnitude(a)
    grid = on_device(_E2M1_SIGNED, a.device)
    on_n = grid[n.int()]
    other = (n.int() + (a > on_n).int() - (a < on_n).int()).to(torch.uint8)
    sign = (y < 0).to(torch.uint8) << 3
    if bits == 4:
        rollout = grid[guidance.int()]
        signed = torch.where(y < 0, -1.0, 1.0)
        pick_other = (signed * grid[other.int()] - rollout).abs() < (signed * on_n - rollout).abs()
    else:
        mask = (1 << bits) - 1
        pick_other = (((sign | other) & mask) == guidance) & (((sign | n) & mask) != guidance)
    return torch.where(pick_other, other, n) | sign


def pack_nibbles(codes: Tensor) -> Tensor:
    """Two codes per byte, the even element in the low nibble."""
    pairs = codes.reshape(*codes.shape[:-1], codes.shape[-1] // 2, 2)
    return pairs[..., 0] | (pairs[..., 1] << 4)


def unpack_nibbles(packed: Tensor) -> Tensor:
    """Inverse of :func:`pack_nibbles`: one code per element."""
    return torch.stack([packed & 0xF, packed >> 4], -1).flatten(-2)


def e2m1_decode_packed(packed: Tensor) -> Tensor:
    """Float32 values of packed codes, ``[..., K//2] -> [..., K]``, one lookup per byte."""
    table = on_device(_BYTE_PAIRS_I64, packed.device)
    return torch.take(table, packed.long()).view(torch.float32).reshape(*packed.shape[:-1], packed.shape[-1] * 2)


@functools.cache
def _pool(workers: int) -> ThreadPoolExecutor:
    """Threads that each run whole chunks with one intra-op thread."""
    return ThreadPoolExecutor(
        workers, thread_name_prefix="fp4-chunks", initializer=torch.set_num_threads, initargs=(1,)
    )


os.register_at_fork(after_in_child=_pool.cache_clear)  # a forked child has none of the parent's threads


def _each_chunk(fn, blocks: Tensor) -> None:
    """``fn(rows)`` for slices of the rows of ``blocks`` ``[n, width]`` of about
    CHUNK_ELEMENTS elements (each pass then stays in cache), on the CPU spread
    over torch's thread count by chunk, not by op.

    Why: a chunk is a dozen small ops, and torch splits each op over its
    threads and waits for all of them. With another process on one of the
    cores, every op then waits for a descheduled thread: on 2 cores with one
    kept busy, quantize ran 2-10x slower on 2 threads than on 1. Whole chunks
    taken from a queue by single-threaded workers never wait on each other:
    the worker on the busy core simply takes fewer of them. A GPU's chunks
    run in order on the caller's thread: a worker thread would launch them
    on the device's default stream, not the caller's.
    """
    n_blocks, block_size = blocks.shape
    rows = max(1, CHUNK_ELEMENTS // block_size)
    chunks = [slice(i, i + rows) for i in range(0, n_blocks, rows)]
    workers = torch.get_num_threads()
    if workers < 2 or len(chunks) < 2 or blocks.device.type != "cpu":
        for chunk in chunks:
            fn(chunk)
        return
    # thread-local: the workers take the caller's (tensors made under inference mode refuse in-place writes outside it)
    grad, inference = torch.is_grad_enabled(), torch.is_inference_mode_enabled()

    def run(chunk: slice) -> None:
        with torch.set_grad_enabled(grad), torch.inference_mode(inference):
            fn(chunk)

    for _ in _pool(workers).map(run, chunks):  # re-raises a chunk's exception here
        pass


def block_amaxes(xb: Tensor) -> Tensor:
    """:func:`block_amax` of flat blocks ``[n_blocks, block_size]``, a cache-sized chunk at a time: ``[n_blocks]``."""
    amax = torch.empty(xb.shape[0], dtype=torch.float32, device=xb.device)

    def chunk(rows: slice) -> None:
        amax[rows] = block_amax(xb[rows])

    _each_chunk(chunk, xb)
    return amax


def _encode(xb: Tensor, units: Tensor, encode) -> Tensor:
    """Packed codes ``encode(x / unit, rows)`` of flat blocks ``[n_blocks, block_size]``."""
    codes = torch.empty(xb.shape[0], xb.shape[1] // 2, dtype=torch.uint8, device=xb.device)

    def chunk(rows: slice) -> None:
        codes[rows] = pack_nibbles(encode(xb[rows] / units[rows, None], rows))

    _each_chunk(chunk, xb)
    return codes


def quantize(
    x: Tensor, fmt: FP4Format, global_scale: Tensor | None, scale_mode: str
) -> tuple[Tensor, Tensor, Tensor | None]:
    """RTN quantization: ``(packed codes, block scales, global scale)``; the
    global scale is a scalar or one per row ``[..., 1]`` (NVFP4)."""
    xb = blocked(x, fmt.block_size).reshape(-1, fmt.block_size)
    amax = block_amaxes(xb)
    if fmt.has_global_scale:
        if global_scale is None:
            global_scale = nvfp4_global_scale(amax.amax() if amax.numel() else amax.new_zeros(()))
        scales = nvfp4_scales(amax, per_block(global_scale, x.shape, fmt.block_size))
    else:
        scales = mxfp4_scales(amax, scale_mode)
    units = scale_units(fmt, scales, per_block(global_scale, x.shape, fmt.block_size))
    codes = _encode(xb, units, lambda y, rows: e2m1_encode(y))
    k = x.shape[-1]  # sizes, not -1: a tensor of no rows has no size to infer
    return codes.reshape(*x.shape[:-1], k // 2), scales.reshape(*x.shape[:-1], k // fmt.block_size), global_scale


def quantize_guided(
    x: Tensor, fmt: FP4Format, scales: Tensor, global_scale: Tensor | None, guidance: Tensor, bits: int
) -> Tensor:
    """Packed codes of ``x`` rounded under the rollout's scales as its guidance says."""
    xb = blocked(x, fmt.block_size).reshape(-1, fmt.block_size)
    guidance = guidance.reshape(xb.shape)
    units = scale_units(fmt, scales.reshape(-1), per_block(global_scale, x.shape, fmt.block_size))
    codes = _encode(xb, units, lambda y, rows: e2m1_encode_guided(y, guidance[rows], bits))
    return codes.reshape(*x.shape[:-1], x.shape[-1] // 2)


def e2m1_decode(codes: Tensor) -> Tensor:
    """Float32 values of unpacked codes (no scale)."""
    return on_device(_E2M1_SIGNED, codes.device)[codes.int()]


def dequantize(packed: Tensor, fmt: FP4Format, scales: Tensor, global_scale: Tensor | None) -> Tensor:
    """Float32 values ``e2m1(code) * unit``, a cache-sized chunk of blocks at a
    time (as :func:`quantize` encodes them); a per-row global scale ``[..., 1]``
    broadcasts over the row's blocks ``[..., n_blocks]``."""
    n_blocks = packed.shape[-1] * 2 // fmt.block_size
    units = scale_units(fmt, scales, global_scale).expand(*packed.shape[:-1], n_blocks).reshape(-1)
    packed_blocks = packed.reshape(-1, fmt.block_size // 2)
    values = torch.empty(packed_blocks.shape[0], fmt.block_size, dtype=torch.float32, device=packed.device)

    def chunk(rows: slice) -> None:
        torch.mul(e2m1_decode_packed(packed_blocks[rows]), units[rows, None], out=values[rows])

    _each_chunk(chunk, values)
    return values.reshape(*packed.shape[:-1], packed.shape[-1] * 2)


def fake_quantize(x: Tensor, fmt: FP4Format, global_scale: Tensor | None, scale_mode: str) -> Tensor:
    """Float32 values of ``x`` after RTN quantization."""
    codes, scales, global_scale = quantize(x, fmt, global_scale, scale_mode)
    return dequantize(codes, fmt, scales, global_scale)


def fake_quantize_guided(
    x: Tensor, fmt: FP4Format, scales: Tensor, global_scale: Tensor | None, guidance: Tensor, bits: int
) -> Tensor:
    """Float32 values of ``x`` after guided quantization under the rollout's scales;
    NaN stays NaN (the rollout's scale cannot carry it)."""
    values = dequantize(quantize_guided(x, fmt, scales, global_scale, guidance, bits), fmt, scales, global_scale)
    return torch.where(torch.isnan(x), torch.nan, values.reshape(x.shape))


def fp8_fake_quantize(x: Tensor, block_size: int | None = None) -> Tensor:
    """Float32 values of ``x`` through FP8 E4M3 with a scale per row (token), or
    per block of ``block_size`` along the last dimension: ``amax / 448``, 1.0
    for an all-zero row. A row (block) holding NaN or Inf becomes NaN."""
    xb = blocked(x, block_size or x.shape[-1]).float()
    scale = divide(xb.abs().amax(-1, keepdim=True), E4M3_MAX)
    scale = torch.where(scale == 0, 1.0, scale)
    q = (xb / scale).to(torch.float8_e4m3fn).float() * scale
    return q.flatten(-2)


def _bit_fields(bits: int):
    """Where code j of a group of 8 lands: (byte, bit offset, spill into the next byte)."""
    for j in range(8):
        byte, offset = divmod(j * bits, 8)
        yield j, byte, offset, offset + bits > 8


def compact_codes(codes: Tensor, bits: int) -> Tensor:
    """Keep the low ``bits`` of every code, packed densely along the last dim.

    Each group of 8 codes becomes ``bits`` bytes: code j of a group sits at bit
    ``j * bits`` of a little-endian bit stream (so k = 1 puts eight codes in a
    byte). ``[..., n] -> [..., ceil(n * bits / 8)]``; a short last group is
    zero-padded.
    """
    n = codes.shape[-1]
    groups = -(-n // 8)
    c = torch.nn.functional.pad(codes & ((1 << bits) - 1), (0, groups * 8 - n))
    c = c.reshape(*codes.shape[:-1], groups, 8)
    out = torch.zeros(*codes.shape[:-1], groups, bits, dtype=torch.uint8, device=codes.device)
    for j, byte, offset, spills in _bit_fields(bits):
        out[..., byte] |= c[..., j] << offset  # uint8: bits past 7 fall off here...
        if spills:
            out[..., byte + 1] |= c[..., j] >> (8 - offset)  # ...and land in the next byte
    return out.flatten(-2)[..., : -(-n * bits // 8)]


def expand_codes(packed: Tensor, bits: int, n: int) -> Tensor:
    """Inverse of :func:`compact_codes`: ``[..., ceil(n * bits / 8)] -> [..., n]``."""
    groups = -(-n // 8)
    b = torch.nn.functional.pad(packed, (0, groups * bits - packed.shape[-1]))
    b = b.reshape(*packed.shape[:-1], groups, bits)
    codes = torch.empty(*packed.shape[:-1], groups, 8, dtype=torch.uint8, device=packed.device)
    for j, byte, offset, spills in _bit_fields(bits):
        codes[..., j] = b[..., byte] >> offset
        if spills:
            codes[..., j] |= b[..., byte + 1] << (8 - offset)
    return (codes & ((1 << bits) - 1)).flatten(-2)[..., :n]
