"""Syndrome coding of guidance bits with side information at the decoder
(Slepian-Wolf): the rollout sends ``r`` parity bits of a block's bit vector,
the training side recovers the vector from its own guess of it and a
reliability per bit.

Why: the training side already knows almost every bit the rollout would send
(its own round-to-nearest code agrees for ~97-99% of elements, and where it
disagrees the value sits near a rounding boundary). Sending parity bits of the
rollout's bits costs ``r`` bits per block instead of one bit per element.

How it decodes (erasure decoding, ordered by reliability): the ``L = r - c``
least reliable positions of the training side's guess are treated as unknown,
every other position as known. The parity equations restricted to the unknown
positions, ``H[:, E] e = H u_rollout ^ H u_train``, are solved over GF(2) by
Gaussian elimination (one batched elimination over every block at once). The
``c`` equations beyond the unknowns are the block's check: a block whose
disagreements are not all among its ``L`` least reliable positions gives an
inconsistent system with probability ``1 - 2^-c`` and is reported as failed
(never silently wrong with a higher probability than that).

The parity matrix ``H`` is a fixed pseudo-random 0/1 matrix computed from
integer hashes (:func:`parity_matrix`), so encoder and decoder agree on every
platform and torch version. The FP4 side information (round-to-nearest code
and scale, and their distance to the rounding boundary) is
:func:`code_side_info` and :func:`scale_side_info`.
"""

import functools

import torch
from torch import Tensor

from .formats import E2M1_MAX, E4M3_MAX, E8M0_NAN, FP4Format
from .reference import blocked, mxfp4_scales, nvfp4_scales, scale_units

MAX_ERASURES = 62  # unknowns per block: a bit mask of them fits a non-negative int64
_MASK32 = 0xFFFFFFFF


def _hash32(v: Tensor) -> Tensor:
    """A 32-bit integer mixing function (xorshift-multiply, constants below 2^31
    so every product fits int64), applied elementwise to int64 values < 2^32."""
    v = v & _MASK32
    v = v ^ (v >> 16)
    v = (v * 0x7FEB352D) & _MASK32
    v = v ^ (v >> 15)
    v = (v * 0x046B6A1B) & _MASK32  # second multiplier kept below 2^31 as well
    return v ^ (v >> 16)


@functools.cache
def parity_matrix(rows: int, n: int, salt: int) -> Tensor:
    """The 0/1 parity matrix ``[rows, n]`` (uint8) of a code over ``n`` bits:
    entry ``(j, i)`` is bit 15 of ``hash32(hash32(salt * 2^20 + j) ^ i)``."""
    j = torch.arange(rows, dtype=torch.int64)[:, None]
    i = torch.arange(n, dtype=torch.int64)[None, :]
    h = _hash32(_hash32(salt * (1 << 20) + j) ^ i)
    return ((h >> 15) & 1).to(torch.uint8)


def syndrome(bits: Tensor, matrix: Tensor) -> Tensor:
    """Parity bits ``matrix @ bits mod 2`` of blocks ``bits [nb, n]`` (0/1 uint8): ``[nb, rows]`` uint8.
    A float32 matmul counts the ones exactly (n < 2^24)."""
    counts = bits.float() @ matrix.to(bits.device).float().T
    return (counts.to(torch.int64) & 1).to(torch.uint8)


def solve_erasures(
    guess: Tensor, reliability: Tensor, parity: Tensor, matrix: Tensor, erasures: int, chunk: int = 4096
) -> tuple[Tensor, Tensor, Tensor]:
    """Recover blocks ``[nb, n]`` of bits from the training side's ``guess``
    (0/1 uint8), the ``reliability`` of each guessed bit (float; lower is less
    sure, -inf: unknown, +inf: certain) and the rollout's ``parity`` bits
    ``[nb, rows]`` under ``matrix``. The ``erasures`` least reliable positions
    are solved for; ``rows - erasures`` equations are left to check.

    Returns ``(bits, ok, needed)``: the decoded blocks, whether each block's
    system was consistent (a failed block's bits are the guess), and per block
    the erasures it needed (1 + the reliability rank of its last corrected
    position; 0 when the guess was right): what rate control learns from.
    Blocks are solved ``chunk`` at a time, so that the elimination's working
    set stays in the CPU's cache.
    """
    rows = parity.shape[1]
    erasures = min(erasures, guess.shape[1], MAX_ERASURES)
    if erasures > rows:
        raise ValueError(f"{erasures} erasures need at least as many parity bits, got {rows}")
    if rows > 64:
        raise ValueError(f"at most 64 parity bits a block (one int64 word), got {rows}")
    target = pack_words(parity ^ syndrome(guess, matrix))  # [nb]: the parity of the disagreement
    bits = guess.clone()
    ok = torch.ones(len(guess), dtype=torch.bool, device=guess.device)
    needed = torch.zeros(len(guess), dtype=torch.int64, device=guess.device)
    wrong = (target != 0).nonzero()[:, 0]  # blocks whose guess already satisfies every equation are done
    if not len(wrong):
        return bits, ok, needed
    columns = pack_words(matrix.to(guess.device).T)  # [n]: column i of the matrix as a word, bit j = row j
    reliability, target = reliability[wrong], target[wrong]
    order = torch.zeros(len(wrong), erasures, dtype=torch.int64, device=guess.device)
    flips = torch.zeros(len(wrong), erasures, dtype=torch.uint8, device=guess.device)
    solved = torch.zeros(len(wrong), dtype=torch.bool, device=guess.device)
    pending = torch.arange(len(wrong), device=guess.device)
    for tier in _tiers(erasures):  # most blocks need few unknowns: solve for fewer first (cost grows as L^2)
        # the tier's least reliable positions, least first (a prefix of the next tier's)
        order[pending, :tier] = torch.topk(reliability[pending], tier, dim=1, largest=False).indices
        for part in pending.split(chunk):
            flips[part, :tier], solved[part], needed[wrong[part]] = _solve(columns[order[part, :tier]], target[part])
        pending = pending[~solved[pending]]
    ok[wrong] = solved
    # entries past a block's last tier point at position 0 with no flip: add, so that they change nothing
    flipped = torch.zeros(len(wrong), guess.shape[1], dtype=torch.int32, device=guess.device)
    bits[wrong] ^= flipped.scatter_add_(1, order, flips.to(torch.int32)).to(torch.uint8)
    return bits, ok, needed


def _tiers(erasures: int) -> list[int]:
    """The unknowns tried in turn: 8, 24, then all. A block consistent with
    fewer unknowns has the same solution as with all (the system's solution is
    unique when consistent, up to the check's 2^-check), and more of its
    equations checked it."""
    return [t for t in (8, 24) if t < erasures] + [erasures]


def pack_words(bits: Tensor) -> Tensor:
    """0/1 ``[..., r]`` (r <= 64) as one int64 word each, bit j = entry j (bit 63 is the sign bit)."""
    shifts = torch.arange(bits.shape[-1], dtype=torch.int64, device=bits.device)
    return (bits.to(torch.int64) << shifts).sum(-1)  # distinct powers of two: the sum is their OR


def _solve(columns: Tensor, target: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """Solve ``sum_k e_k columns[:, k] = target`` over GF(2) for each block
    (``columns [b, L]``, ``target [b]``: int64 words of parity bits).

    Column elimination: column k's lowest set bit (after the earlier columns'
    pivots were cleared from it) is its pivot, cleared from every later column;
    ``combo`` tracks which original columns each reduced column sums. Back
    substitution from the last column reads each pivot bit off the target; a
    target left non-zero means the system is inconsistent. Unknowns whose
    column became zero stay 0 (the guess). Returns ``(flips [b, L] uint8, ok, needed)``.
    """
    b, erasures = columns.shape
    device = columns.device
    columns = columns.clone()
    unit = torch.ones(erasures, dtype=torch.int64, device=device) << torch.arange(erasures, device=device)
    combo = unit.expand(b, -1).clone()
    pivots = torch.zeros(b, erasures, dtype=torch.int64, device=device)
    for k in range(erasures):
        col = columns[:, k]
        p = col & -col  # the lowest set bit; 0 for a dependent column
        pivots[:, k] = p
        later = columns[:, k + 1 :]
        hit = (later & p[:, None]) != 0
        later ^= torch.where(hit, col[:, None], 0)
        combo[:, k + 1 :] ^= torch.where(hit, combo[:, k : k + 1], 0)
    t = target.clone()
    solution = torch.zeros(b, dtype=torch.int64, device=device)
    for k in range(erasures):  # pivot bit k is in no later column, and the earlier ones were taken out of t
        use = (t & pivots[:, k]) != 0
        t ^= torch.where(use, columns[:, k], 0)
        solution ^= torch.where(use, combo[:, k], 0)
    ok = t == 0
    solution = torch.where(ok, solution, 0)
    flips = ((solution[:, None] & unit) != 0).to(torch.uint8)
    return flips, ok, _bit_length(solution)


def _bit_length(words: Tensor) -> Tensor:
    """1 + the index of the highest set bit of non-negative int64 words (0 for 0)."""
    length = torch.zeros_like(words)
    for step in (32, 16, 8, 4, 2, 1):
        up = (words >> (length + step)) != 0
        length += step * up
    return length + (words != 0)


def code_side_info(x: Tensor, fmt: FP4Format, scales: Tensor, global_scale: Tensor | None) -> tuple[Tensor, Tensor]:
    """The training side's low code bits of ``x [..., K]`` rounded to nearest
    under the given block ``scales``, and their reliability: the distance of
    ``x`` to the nearest rounding boundary (crossing either one flips the low
    bit), relative to the row's largest magnitude. Relative to the row, not the
    block or the element: the training side's values drift from the rollout's
    by amounts that scale with the row (measured on the tiny preset, this
    ordering put the disagreements in fewer of the least reliable positions
    than either alternative).

    How: ``q(a)`` maps the E2M1 magnitudes 0, .5, 1, 1.5, 2, 3, 4, 6 onto
    0..7 piecewise linearly (slope 2 below 2, 1 up to 4, 1/2 above), so every
    rounding boundary lands on a half-integer; ``round(q)`` (half to even, as
    E2M1 rounds its ties) is the magnitude index, and the boundaries either
    side are ``round(q) -+ 0.5`` mapped back (magnitudes clamp at 6)."""
    xb = blocked(x.float(), fmt.block_size)
    units = scale_units(fmt, scales, global_scale).unsqueeze(-1)  # [..., blocks, 1]
    a = (xb / units).abs_().clamp_(max=E2M1_MAX)
    n = torch.round(2 * a - (a - 2).clamp_(min=0) - 0.5 * (a - 4).clamp_(min=0))
    distance = torch.minimum(a - _magnitude_at(n - 0.5), _magnitude_at(n + 0.5) - a)
    row_amax = x.float().abs().amax(-1, keepdim=True).unsqueeze(-1)  # [..., 1, 1]
    distance *= units / row_amax
    return (n.to(torch.uint8) & 1).reshape(x.shape), distance.reshape(x.shape)


def _magnitude_at(q: Tensor) -> Tensor:
    """The inverse of ``code_side_info``'s map: the magnitude whose ``q`` this is."""
    return q / 2 + (q - 4).clamp(min=0) / 2 + (q - 6).clamp(min=0)


def scale_side_info(x: Tensor, fmt: FP4Format, global_scale: Tensor | None) -> tuple[Tensor, Tensor, Tensor]:
    """The training side's own block scales of ``x [..., K]`` (raw bytes, as
    quantize computes them), the neighbouring scale byte on the other side of
    the nearest rounding boundary, and the relative distance to that boundary
    (+inf where no other scale is possible: all-zero or non-finite blocks,
    saturation). Adjacent scale bytes differ in their lowest bit, so the
    rollout's low scale bit picks one of the two."""
    amax = blocked(x.float(), fmt.block_size).abs().amax(-1)
    if fmt.has_global_scale:
        v = amax / (E2M1_MAX * global_scale)
        own = nvfp4_scales(amax, global_scale).view(torch.uint8)
        s = own.view(torch.float8_e4m3fn).float()
        step = torch.where(v > s, 1, -1)
        neighbour = (own.int() + step).clamp(1, 0x7E).to(torch.uint8)
        mid = (s + neighbour.view(torch.float8_e4m3fn).float()) / 2
        distance = (v - mid).abs() / mid
        certain = (amax == 0) | ~torch.isfinite(v) | (v == s) | (neighbour == own) | (v >= E4M3_MAX)
    else:
        own = mxfp4_scales(amax)
        fraction = torch.log2(amax) - torch.floor(torch.log2(amax))
        up = fraction >= 0.5
        neighbour = (own.int() + torch.where(up, 1, -1)).clamp(0, 254).to(torch.uint8)
        distance = torch.where(up, 1 - fraction, fraction)
        certain = (amax == 0) | (own == E8M0_NAN) | (own == 0) | ~torch.isfinite(amax)
    return own, neighbour, torch.where(certain, torch.inf, distance)
