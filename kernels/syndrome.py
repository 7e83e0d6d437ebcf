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
Gaussian elimination, batched over blocks (vectorized torch ops over all
blocks of a tier at once; no Python loop over blocks). The
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
from .fp4 import HAS_TRITON
from .reference import _each_chunk, block_amaxes, blocked, mxfp4_scales, nvfp4_scales, on_device, scale_units

MAX_ERASURES = 62  # unknowns per block: a bit mask of them fits a non-negative int64
TIERS = (8, 24)  # unknowns tried before all of them (:func:`_tiers`)
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
    entry ``(j, i)`` is bit 15 of ``hash32(hash32(salt * 2^20 + j) ^ i)``,
    except that where ``rows >= n`` the first ``n`` rows are the identity.

    Why: ``n`` parity bits of ``n`` bits are best spent on the bits themselves,
    which the decoder reads whatever its guess (:func:`unknowns`: all ``n``);
    hashed rows as many as the bits leave some unknowns to the guess, and an
    MXFP4 block's 8 scales got 16 hashed parity bits where 8 raw bits are
    exact. Rows past ``n`` stay hashed: checks, consistent by construction."""
    j = torch.arange(rows, dtype=torch.int64)[:, None]
    i = torch.arange(n, dtype=torch.int64)[None, :]
    h = ((_hash32(_hash32(salt * (1 << 20) + j) ^ i) >> 15) & 1).to(torch.uint8)
    if rows >= n:
        h[:n] = torch.eye(n, dtype=torch.uint8)
    return h


def unknowns(rows: int, n: int, check: int) -> int:
    """The unknowns a decode of ``rows`` parity bits over ``n`` bits solves for
    (the ``erasures`` of :func:`solve_erasures`): ``rows - check``, the other
    ``check`` equations left to catch a wrong guess among the known bits; or
    all ``n`` where the parity holds the bits themselves (:func:`parity_matrix`,
    ``rows >= n``), which no guess can contradict."""
    return n if rows >= n else rows - check


def syndrome(bits: Tensor, matrix: Tensor) -> Tensor:
    """Parity bits ``matrix @ bits mod 2`` of blocks ``bits [nb, n]`` (0/1 uint8): ``[nb, rows]`` uint8."""
    shifts = torch.arange(matrix.shape[0], device=bits.device)
    return ((syndrome_words(bits, matrix)[:, None] >> shifts) & 1).to(torch.uint8)


_GATHER_BITS = 0x0102040810204080  # times 8 bytes of 0/1 (one int64): byte j's bit lands at bit 56 + j, no carries


def syndrome_words(bits: Tensor, matrix: Tensor) -> Tensor:
    """:func:`syndrome` as one int64 word per block (bit j = parity bit j; at most 64 rows).

    How: every 8 entries (read as one int64 of 0/1 bytes) packed into a byte
    value by one multiply, a table of the parity word of every value at every
    byte position (the XOR of the matrix columns its set bits name), one lookup
    per byte, and an XOR over a block's bytes: integer work on an eighth of the
    elements (a float matmul over every bit cost as much as the rest of the
    encoder). CUDA tensors go to :mod:`.triton_syndrome`."""
    if bits.is_cuda and HAS_TRITON:
        from . import triton_syndrome

        return triton_syndrome.syndrome_words(bits, matrix)
    rows, n = matrix.shape
    check_parity_rows(rows)
    device = bits.device
    nbytes = -(-n // 8)
    bits = torch.nn.functional.pad(bits, (0, 8 * nbytes - n)) if n % 8 else bits.contiguous()
    byte_values = ((bits.view(torch.int64) * _GATHER_BITS) >> 56) & 0xFF  # [nb, nbytes]
    columns = torch.nn.functional.pad(pack_words(matrix.to(device).T), (0, 8 * nbytes - n)).view(nbytes, 8)
    value_bits = (torch.arange(256, device=device)[:, None] >> torch.arange(8, device=device)) & 1  # [256, 8]
    table = torch.zeros(nbytes, 256, dtype=torch.int64, device=device)  # [byte position, byte value]
    for j in range(8):
        table ^= columns[:, j : j + 1] * value_bits[:, j]
    offsets = torch.arange(0, 256 * nbytes, 256, device=device)[:, None]
    # [nbytes, nb]: byte positions as rows, so that the XOR below folds contiguous halves
    index = (byte_values.T + offsets).contiguous().view(-1)
    words = table.view(-1).index_select(0, index).view(nbytes, len(bits))
    while len(words) > 1:  # XOR the halves (an odd last row into the first)
        half = len(words) // 2
        folded = words[:half] ^ words[half : 2 * half]
        if len(words) % 2:
            folded[0] ^= words[-1]
        words = folded
    return words[0] if nbytes else torch.zeros(len(bits), dtype=torch.int64, device=device)


def solve_erasures(
    guess: Tensor, reliability: Tensor, parity: Tensor, matrix: Tensor, erasures: int, chunk: int = 8192
) -> tuple[Tensor, Tensor, Tensor]:
    """Recover blocks ``[nb, n]`` of bits from the training side's ``guess``
    (0/1 uint8), the ``reliability`` of each guessed bit (float32 distances,
    lower is less sure, -inf: unknown, +inf: certain) and the rollout's
    ``parity`` bits ``[nb, rows]`` under ``matrix``. The ``erasures`` least
    reliable positions are solved for; ``rows - erasures`` equations are left
    to check.

    The least reliable are chosen on the float32 bit patterns read as int32
    (a ``topk`` over ints is about 15% cheaper, and the selection is the
    decoder's largest cost): for non-negative floats, +inf and NaN that order
    is the values' order, and every negative value (-inf) ranks below them.

    Returns ``(bits, ok, needed)``: the decoded blocks, whether each block's
    system was consistent (a failed block's bits are the guess), and per block
    the erasures it needed (1 + the reliability rank of its last corrected
    position; 0 when the guess was right): what rate control learns from.
    Blocks are solved ``chunk`` at a time, so that the elimination's working
    set stays in the CPU's cache. CUDA tensors go to :mod:`.triton_syndrome`.
    """
    if guess.is_cuda and HAS_TRITON:
        from . import triton_syndrome

        return triton_syndrome.solve_erasures(guess, reliability, parity, matrix, erasures)
    erasures = checked_erasures(guess, reliability, parity, erasures)
    target = pack_words(parity) ^ syndrome_words(guess, matrix)  # [nb]: the parity of the disagreement
    bits = guess.clone()
    ok = torch.ones(len(guess), dtype=torch.bool, device=guess.device)
    needed = torch.zeros(len(guess), dtype=torch.int64, device=guess.device)
    wrong = (target != 0).nonzero()[:, 0]  # blocks whose guess already satisfies every equation are done
    if not len(wrong):
        return bits, ok, needed
    columns = pack_words(matrix.to(guess.device).T)  # [n]: column i of the matrix as a word, bit j = row j
    pending, tiers = wrong, _tiers(erasures)
    selected = None  # [pending, width]: each pending block's least reliable positions, least first
    for i, tier in enumerate(tiers):  # most blocks need few unknowns: solve for fewer first (cost grows as L^2)
        if selected is None or selected.shape[1] < tier:  # the first selection serves the second tier too
            width = tiers[min(i + 1, len(tiers) - 1)] if i == 0 else tier
            keys = reliability.view(torch.int32)[pending]  # float32 bits: ordered as the values (docstring)
            selected = torch.topk(keys, width, dim=1, largest=False).indices  # least reliable first
        order = selected[:, :tier]
        for blocks, positions in zip(pending.split(chunk), order.split(chunk)):
            solution, ok[blocks] = _solve(columns[positions], target[blocks])
            needed[blocks] = _bit_length(solution)
            block, rank = (((solution[:, None] >> torch.arange(tier, device=guess.device)) & 1) != 0).nonzero().T
            bits[blocks[block], positions[block, rank]] ^= 1  # flips land on distinct positions
        still = ~ok[pending]
        pending, selected = pending[still], selected[still]
        if not len(pending):
            break
    return bits, ok, needed


def checked_erasures(guess: Tensor, reliability: Tensor, parity: Tensor, erasures: int) -> int:
    """The unknowns :func:`solve_erasures` solves for (at most a block's elements
    and :data:`MAX_ERASURES`), once its inputs are checked."""
    if reliability.dtype != torch.float32:
        raise ValueError(f"reliability must be float32 (its bits are compared as int32), got {reliability.dtype}")
    rows = parity.shape[1]
    erasures = min(erasures, guess.shape[1], MAX_ERASURES)
    if erasures > rows:
        raise ValueError(f"{erasures} erasures need at least as many parity bits, got {rows}")
    check_parity_rows(rows)
    return erasures


def check_parity_rows(rows: int) -> None:
    """A block's parity bits are one int64 word: at most 64."""
    if rows > 64:
        raise ValueError(f"at most 64 parity bits a block (one int64 word), got {rows}")


def _tiers(erasures: int) -> list[int]:
    """The unknowns tried in turn: 8, 24, then all. A block consistent with
    fewer unknowns has the same solution as with all (the system's solution is
    unique when consistent, up to the check's 2^-check), and more of its
    equations checked it."""
    return [t for t in TIERS if t < erasures] + [erasures]


def pack_words(bits: Tensor) -> Tensor:
    """0/1 ``[..., r]`` (r <= 64) as one int64 word each, bit j = entry j (bit 63 is the sign bit)."""
    shifts = torch.arange(bits.shape[-1], dtype=torch.int64, device=bits.device)
    return (bits.to(torch.int64) << shifts).sum(-1)  # distinct powers of two: the sum is their OR


def _solve(columns: Tensor, target: Tensor) -> tuple[Tensor, Tensor]:
    """Solve ``sum_k e_k columns[:, k] = target`` over GF(2) for each block
    (``columns [b, L]``, ``target [b]``: int64 words of parity bits).

    Column elimination with the target as one more column: column k's lowest
    set bit (after the earlier columns' pivots were cleared from it) is its
    pivot, cleared from every later column and the target; each column carries,
    as a second word, which original columns it sums (one op updates both),
    the target's starting empty. Clearing the pivots from the target in column
    order is the substitution, so its second word ends as the solution, and a
    target left non-zero is an inconsistent system (any non-zero sum of the
    reduced columns holds the pivot of its first). Unknowns whose column became
    zero stay 0 (the guess). Returns ``(solution, ok)``: per block the word of
    unknowns to flip (0 where inconsistent) and whether the system was
    consistent.
    """
    b, erasures = columns.shape
    device = columns.device
    unit = torch.ones(erasures, dtype=torch.int64, device=device) << torch.arange(erasures, device=device)
    words = torch.cat((columns, target[:, None]), 1)
    combos = torch.cat((unit.expand(b, -1), torch.zeros(b, 1, dtype=torch.int64, device=device)), 1)
    work = torch.stack((words, combos), -1)  # [b, L + 1, 2]: reduced column, the original columns it sums
    for k in range(erasures):
        head = work[:, k]
        col = head[:, 0]
        p = col & -col  # the lowest set bit; 0 for a dependent column
        later = work[:, k + 1 :]
        later ^= head[:, None] * ((later[..., 0] & p[:, None]) != 0)[..., None]
    ok = work[:, erasures, 0] == 0
    return torch.where(ok, work[:, erasures, 1], 0), ok


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
    and, as E2M1 rounds ties to the even code, low bit 0. A NaN's block
    (or one under a NaN scale) gets low bits 0, as quantizing it gives its
    codes, and is left out of its row's largest magnitude (a NaN there made
    every distance of the row NaN). Rows are done in cache-sized chunks
    (:func:`~.reference._each_chunk`)."""
    shape = x.shape
    x2 = x.reshape(-1, shape[-1])
    quarter = (
        scale_units(fmt, scales.reshape(len(x2), x2.shape[-1] // fmt.block_size), global_scale).div_(4).unsqueeze(-1)
    )  # [rows, blocks, 1]
    low = torch.empty(x2.shape, dtype=torch.uint8, device=x.device)
    distance = torch.empty(x2.shape, dtype=torch.float32, device=x.device)
    tables = [on_device(t, x.device) for t in (_CELL_LOW, _CELL_HIGH, _CELL_BIT)]

    def chunk(rows: slice) -> None:
        b = torch.div(blocked(x2[rows], fmt.block_size), quarter[rows]).abs_()  # float32 for any x dtype
        # the row's amax (|x| to within a rounding of each element): relative distances; a block holding a NaN
        # or Inf (or under a NaN scale) left out, so that the rest of its row keeps its reliabilities
        block_amax = (b.amax(-1, keepdim=True) * quarter[rows]).nan_to_num_(0, 0, 0)
        relative = quarter[rows] / block_amax.amax(-2, keepdim=True)
        cell = b.clamp_(max=4 * E2M1_MAX).int().clamp_(0, 4 * int(E2M1_MAX)).view(-1)  # NaN: any int, clamped
        under, over, bit = (t.index_select(0, cell).view(b.shape) for t in tables)
        d = torch.minimum(torch.sub(b, under, out=under), torch.sub(over, b, out=over), out=under)
        torch.mul(bit, d > 0, out=low[rows].view(b.shape))
        torch.mul(d, relative, out=distance[rows].view(b.shape))

    _each_chunk(chunk, x2)
    return low.view(shape), distance.view(shape)


def scale_side_info(x: Tensor, fmt: FP4Format, global_scale: Tensor | None) -> tuple[Tensor, Tensor, Tensor]:
    """The training side's own block scales of ``x [..., K]`` (raw bytes, as
    quantize computes them), the neighbouring scale byte on the other side of
    the nearest rounding boundary, and the relative distance to that boundary
    (+inf where no other scale is possible: all-zero or non-finite blocks,
    saturation). Adjacent scale bytes differ in their lowest bit, so the
    rollout's low scale bit picks one of the two.

    An NVFP4 scale that rounds to zero is written as 1.0 (``0x38``, low bit
    0): below the smallest subnormal ``0x01`` lies that zero, so the two
    neighbour each other across the boundary 2^-10, and their bytes still
    differ in the low bit. MXFP4's byte 0 holds every amax below 2^-124, so
    its neighbour is byte 1, at the distance in binades to 2^-124 (it was
    taken below unless the amax lay in the upper half of its float32 binade,
    clamped to byte 0 itself, and a rollout's byte 1 came back as byte 0)."""
    amax = block_amaxes(blocked(x, fmt.block_size).reshape(-1, fmt.block_size)).view(
        *x.shape[:-1], x.shape[-1] // fmt.block_size
    )
    if fmt.has_global_scale:
        v = amax / (E2M1_MAX * global_scale)
        own = nvfp4_scales(amax, global_scale).view(torch.uint8)
        # each scale's rung on the E4M3 ladder: its byte, 0 where it rounded to zero (at most 2^-10, the tie
        # to even included), written 0x38
        rung = torch.where(v <= 2.0**-10, 0, own.int())
        s = _e4m3_rung(rung)
        # the nearer boundary, relative to it, on either side: not the side v lies on, since a power of two
        # has a rung below half as far as the one above (just above 1.0, 0.96875 is nearer than 1.0625)
        sides = [(rung + step).clamp(0, 0x7E) for step in (1, -1)]
        mids = [(s + _e4m3_rung(side)) / 2 for side in sides]
        up, down = ((mid - v).abs() / mid for mid in mids)
        up, down = torch.where(rung >= 0x7E, torch.inf, up), torch.where(rung == 0, torch.inf, down)  # ends
        neighbour_rung = torch.where(up <= down, *sides)
        neighbour = torch.where(neighbour_rung == 0, 0x38, neighbour_rung).to(torch.uint8)
        distance = torch.minimum(up, down)
        certain = (amax == 0) | ~torch.isfinite(v) | (v == s) | (v >= E4M3_MAX)
    else:
        own = mxfp4_scales(amax)
        # where amax lies in its binade [2^k, 2^(k+1)), from its bits: log2 of a float32 a few ulps below 2^k
        # rounds to k, which put the nearest boundary below it, 4x away from the one just above
        significand = ((amax.view(torch.int32) & 0x7FFFFF) | 0x3F800000).view(torch.float32)  # in [1, 2)
        fraction = torch.log2(significand)
        # byte 0 holds every amax below 2^-124 (the exponent clamps there, subnormal float32 amaxes too): its
        # one boundary is 2^-124 above, to byte 1, however many binades below it the amax lies
        bottom = own == 0
        up = (fraction >= 0.5) | bottom
        neighbour = (own.int() + torch.where(up, 1, -1)).clamp(max=E8M0_NAN - 1).to(torch.uint8)
        distance = torch.where(bottom, -124 - torch.log2(amax), torch.where(up, 1 - fraction, fraction))
        certain = (amax == 0) | (own == E8M0_NAN) | ~torch.isfinite(amax)
    return own, neighbour, torch.where(certain, torch.inf, distance)


def _e4m3_rung(rung: Tensor) -> Tensor:
    """The float32 value of E4M3 bytes ``rung`` (int; 0 is zero)."""
    return rung.to(torch.uint8).view(torch.float8_e4m3fn).float()
