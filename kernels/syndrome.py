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
from .reference import _each_chunk, blocked, mxfp4_scales, nvfp4_scales, scale_units

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
    guess: Tensor, reliability: Tensor, parity: Tensor, matrix: Tensor, erasures: int, chunk: int = 8192
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
    pending = wrong
    for tier in _tiers(erasures):  # most blocks need few unknowns: solve for fewer first (cost grows as L^2)
        order = least_reliable(reliability, pending, tier)
        for blocks, positions in zip(pending.split(chunk), order.split(chunk)):
            solution, ok[blocks] = _solve(columns[positions], target[blocks])
            needed[blocks] = _bit_length(solution)
            block, rank = (((solution[:, None] >> torch.arange(tier, device=guess.device)) & 1) != 0).nonzero().T
            bits[blocks[block], positions[block, rank]] ^= 1  # flips land on distinct positions
        pending = pending[~ok[pending]]
        if not len(pending):
            break
    return bits, ok, needed


def least_reliable(reliability: Tensor, rows: Tensor, k: int) -> Tensor:
    """Positions ``[len(rows), k]`` of the ``k`` least reliable entries of
    ``reliability[rows]``, least first (as ``topk(largest=False)``; equal
    reliabilities may come in another order).

    Why not topk alone: it partially sorts every row (about 11 ns an entry on
    this CPU), and on CPU that was the decoder's largest cost. Here a
    threshold (from a sample of the rows) leaves about ``2k`` candidates a row
    (one compare and one nonzero pass, about 4 ns an entry); they are packed,
    in position order, into a ``[rows, 4k]`` table that topk sorts at a
    fraction of the cost. A row with fewer than ``k`` candidates, or more than
    the table holds, takes plain topk.
    """
    n, width = len(rows), reliability.shape[1]
    cap = 4 * k
    if cap >= width or n < 256:
        return torch.topk(reliability[rows], k, dim=1, largest=False).indices
    if 2 * n < len(reliability):  # a few of the rows: copy them rather than pass over all
        return least_reliable(reliability[rows], torch.arange(n, device=rows.device), k)
    device = rows.device
    sample = reliability[rows[:: n // 64]].flatten()
    threshold = torch.kthvalue(sample, 2 * k * len(sample) // width).values
    row, col = (reliability < threshold).nonzero().unbind(1)  # every row's candidates, row-major
    if n < len(reliability):
        within = torch.full((len(reliability),), -1, dtype=torch.int64, device=device)
        within[rows] = torch.arange(n, device=device)  # a candidate's row among ``rows`` (-1: not asked for)
        row = within[row]
        row, col = row[row >= 0], col[row >= 0]
    count = torch.bincount(row, minlength=n)
    slot = torch.arange(len(row), device=device) - (torch.cumsum(count, 0) - count)[row]
    keep = slot < cap
    row, col, slot = row[keep], col[keep], slot[keep]
    values = torch.full((n, cap), torch.inf, device=device)
    values[row, slot] = reliability[rows[row], col]
    positions = torch.zeros(n, cap, dtype=torch.int64, device=device)
    positions[row, slot] = col
    out = torch.gather(positions, 1, torch.topk(values, k, dim=1, largest=False).indices)
    short = ((count < k) | (count > cap)).nonzero()[:, 0]
    if len(short):
        out[short] = torch.topk(reliability[rows[short]], k, dim=1, largest=False).indices
    return out


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


def _solve(columns: Tensor, target: Tensor) -> tuple[Tensor, Tensor]:
    """Solve ``sum_k e_k columns[:, k] = target`` over GF(2) for each block
    (``columns [b, L]``, ``target [b]``: int64 words of parity bits).

    Column elimination: column k's lowest set bit (after the earlier columns'
    pivots were cleared from it) is its pivot, cleared from every later column;
    each reduced column carries, as a second word, which original columns it
    sums (one op updates both). Back substitution from the first column reads
    each pivot bit off the target; a target left non-zero means the system is
    inconsistent. Unknowns whose column became zero stay 0 (the guess).
    Returns ``(solution, ok)``: per block the word of unknowns to flip (0 where
    inconsistent) and whether the system was consistent.
    """
    b, erasures = columns.shape
    device = columns.device
    unit = torch.ones(erasures, dtype=torch.int64, device=device) << torch.arange(erasures, device=device)
    work = torch.stack((columns, unit.expand(b, -1)), -1)  # [b, L, 2]: reduced column, its original columns
    pivots = torch.empty(b, erasures, dtype=torch.int64, device=device)
    for k in range(erasures):
        head = work[:, k]
        col = head[:, 0]
        p = col & -col  # the lowest set bit; 0 for a dependent column
        pivots[:, k] = p
        later = work[:, k + 1 :]
        later ^= head[:, None] * ((later[..., 0] & p[:, None]) != 0)[..., None]
    state = torch.stack((target, torch.zeros_like(target)), -1)  # [b, 2]: what is left of the target, the solution
    for k in range(erasures):  # pivot bit k is in no later column, and the earlier ones were taken out of t
        state ^= work[:, k] * ((state[:, 0] & pivots[:, k]) != 0)[:, None]
    ok = state[:, 0] == 0
    return torch.where(ok, state[:, 1], 0), ok


def _bit_length(words: Tensor) -> Tensor:
    """1 + the index of the highest set bit of non-negative int64 words (0 for 0)."""
    length = torch.zeros_like(words)
    for step in (32, 16, 8, 4, 2, 1):
        up = (words >> (length + step)) != 0
        length += step * up
    return length + (words != 0)


# Cells of ``b = 4 |y|`` (``y = x / unit``, clamped at 4 * 6): every E2M1
# rounding boundary (the midpoints of E2M1_VALUES, x4: 1, 3, 5, 7, 10, 14, 20) is
# an integer, so on cell ``k = floor(b)`` the rounded magnitude index and the
# boundaries either side are constant: one table lookup each instead of a
# dozen elementwise passes. Below 0 and above 24 the "boundaries" -1 and 28
# are never nearer than the real one on the other side.
_BOUNDARIES4 = [2 * (lo + hi) for lo, hi in zip(E2M1_VALUES, E2M1_VALUES[1:])]
_CELL_INDEX = [sum(boundary <= k for boundary in _BOUNDARIES4) for k in range(4 * int(E2M1_MAX) + 1)]
_CELL_LOW = torch.tensor([([-1.0] + _BOUNDARIES4)[n] for n in _CELL_INDEX])
_CELL_HIGH = torch.tensor([(_BOUNDARIES4 + [4 * E2M1_MAX + 4])[n] for n in _CELL_INDEX])
_CELL_BIT = torch.tensor([n & 1 for n in _CELL_INDEX], dtype=torch.uint8)


def code_side_info(x: Tensor, fmt: FP4Format, scales: Tensor, global_scale: Tensor | None) -> tuple[Tensor, Tensor]:
    """The training side's low code bits of ``x [..., K]`` rounded to nearest
    under the given block ``scales``, and their reliability: the distance of
    ``x`` to the nearest rounding boundary (crossing either one flips the low
    bit), relative to the row's largest magnitude. Relative to the row, not the
    block or the element: the training side's values drift from the rollout's
    by amounts that scale with the row (measured on the tiny preset, this
    ordering put the disagreements in fewer of the least reliable positions
    than either alternative).

    How: in ``b = 4 |x / unit|`` every rounding boundary is an integer, so the
    cell ``floor(b)`` gives the low bit and both boundaries by table lookup
    (:data:`_CELL_LOW`, ...). A value exactly on a boundary is a tie: distance 0
    and, as E2M1 rounds ties to the even code, low bit 0. Rows are done in
    cache-sized chunks (:func:`~.reference._each_chunk`)."""
    shape = x.shape
    x2 = x.reshape(-1, shape[-1])
    quarter = scale_units(fmt, scales.reshape(len(x2), -1), global_scale).div_(4).unsqueeze(-1)  # [rows, blocks, 1]
    low = torch.empty(x2.shape, dtype=torch.uint8, device=x.device)
    distance = torch.empty(x2.shape, dtype=torch.float32, device=x.device)
    tables = [t.to(x.device) for t in (_CELL_LOW, _CELL_HIGH, _CELL_BIT)]

    def chunk(rows: slice) -> None:
        b = torch.div(blocked(x2[rows], fmt.block_size), quarter[rows]).abs_()  # float32 for any x dtype
        # the row's amax (|x| to within a rounding of each element): relative distances
        relative = quarter[rows] / (b.amax(-1, keepdim=True) * quarter[rows]).amax(-2, keepdim=True)
        cell = b.clamp_(max=4 * E2M1_MAX).int().clamp_(0, 4 * int(E2M1_MAX)).view(-1)  # NaN: any int, clamped
        under, over, bit = (t.index_select(0, cell).view(b.shape) for t in tables)
        d = torch.minimum(torch.sub(b, under, out=under), torch.sub(over, b, out=over), out=under)
        torch.mul(bit, d > 0, out=low[rows].view(b.shape))
        torch.mul(d, relative, out=distance[rows].view(b.shape))

    _each_chunk(chunk, *x2.shape)
    return low.view(shape), distance.view(shape)


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
