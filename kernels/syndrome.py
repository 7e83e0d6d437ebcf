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

from .formats import E2M1_MAX, E2M1_VALUES, E4M3_MAX, E8M0_NAN, FP4Format
from .reference import blocked, e2m1_encode, e2m1_magnitude, mxfp4_scales, nvfp4_scales, scale_units

MAX_ERASURES = 62  # unknowns per block: one int64 per equation holds them and the right-hand side (bit 62)
_RHS = 62
_MASK32 = 0xFFFFFFFF
_E2M1 = torch.tensor(E2M1_VALUES)


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
    guess: Tensor, reliability: Tensor, parity: Tensor, matrix: Tensor, erasures: int
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
    """
    rows = parity.shape[1]
    erasures = min(erasures, guess.shape[1], MAX_ERASURES)
    if erasures > rows:
        raise ValueError(f"{erasures} erasures need at least as many parity bits, got {rows}")
    target = parity ^ syndrome(guess, matrix)  # [nb, rows]: the parity of the disagreement
    bits = guess.clone()
    ok = torch.ones(len(guess), dtype=torch.bool, device=guess.device)
    needed = torch.zeros(len(guess), dtype=torch.int64, device=guess.device)
    wrong = target.any(1).nonzero()[:, 0]  # blocks whose guess already satisfies every equation are done
    if len(wrong):
        bits[wrong], ok[wrong], needed[wrong] = _solve(
            guess[wrong], reliability[wrong], target[wrong], matrix, erasures
        )
    return bits, ok, needed


def _solve(guess: Tensor, reliability: Tensor, target: Tensor, matrix: Tensor, erasures: int):
    """:func:`solve_erasures` of blocks whose guess violates some equation (``target``: which)."""
    nb, rows = target.shape
    device = guess.device
    order = torch.sort(reliability, dim=1, stable=True).indices[:, :erasures]  # [nb, L], least reliable first
    columns = matrix.to(device).T[order]  # [nb, L, rows]
    weights = torch.ones(erasures, dtype=torch.int64, device=device) << torch.arange(erasures, device=device)
    system = (columns.to(torch.int64) * weights[:, None]).sum(1)  # [nb, rows]: bit k = unknown k's coefficient
    system |= target.to(torch.int64) << _RHS
    used = torch.zeros(nb, rows, dtype=torch.bool, device=device)
    pivot = torch.full((nb, erasures), -1, dtype=torch.int64, device=device)
    arange = torch.arange(rows, device=device)
    for k in range(erasures):  # Gauss-Jordan over GF(2), every block at once
        has = ((system >> k) & 1).bool()
        candidates = has & ~used
        found = candidates.any(1)
        p = candidates.to(torch.uint8).argmax(1)
        prow = system.gather(1, p[:, None])  # [nb, 1]
        clear = has & (arange[None, :] != p[:, None]) & found[:, None]
        system = torch.where(clear, system ^ prow, system)
        used[torch.arange(nb, device=device), p] |= found
        pivot[:, k] = torch.where(found, p, -1)
    # an equation left without a pivot has no unknowns left: its right-hand side must be 0
    ok = ~(((system >> _RHS) & 1).bool() & ~used).any(1)
    solved = (system.gather(1, pivot.clamp(min=0)) >> _RHS) & 1
    flips = (solved.bool() & (pivot >= 0) & ok[:, None]).to(torch.uint8)  # free unknowns stay as guessed
    bits = guess.clone()
    bits.scatter_(1, order, guess.gather(1, order) ^ flips)
    rank = torch.arange(1, erasures + 1, device=device)
    needed = (flips.to(torch.int64) * rank).amax(1) if erasures else torch.zeros(nb, dtype=torch.int64)
    return bits, ok, needed


def code_side_info(x: Tensor, fmt: FP4Format, scales: Tensor, global_scale: Tensor | None) -> tuple[Tensor, Tensor]:
    """The training side's low code bits of ``x [..., K]`` rounded to nearest
    under the given block ``scales``, and their reliability: the distance of
    ``x`` to the rounding boundary between the nearest codeword and its other
    neighbour, relative to the row's largest magnitude (+inf where there is no
    other neighbour: on a codeword, beyond 6, NaN). Relative to the row, not
    the block or the element: the training side's values drift from the
    rollout's by amounts that scale with the row (measured on the tiny preset,
    this ordering put the disagreements in fewer of the least reliable
    positions than either alternative)."""
    xb = blocked(x.float(), fmt.block_size)
    units = scale_units(fmt, scales, global_scale).unsqueeze(-1)
    y = xb / units
    a = torch.clamp(y.abs(), max=E2M1_MAX)
    n = e2m1_magnitude(a)
    grid = _E2M1.to(x.device)
    on_n = grid[n.int()]
    other = (n.int() + (a > on_n).int() - (a < on_n).int()).clamp(0, 7)
    row_amax = x.float().abs().amax(-1, keepdim=True).unsqueeze(-1)  # [..., 1, 1]
    distance = (a - (on_n + grid[other]) / 2).abs() * units / row_amax
    distance = torch.where((other == n.int()) | torch.isnan(distance), torch.inf, distance)
    low = e2m1_encode(y.contiguous()) & 1
    return low.reshape(x.shape), distance.reshape(x.shape)


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
