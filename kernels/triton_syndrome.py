"""Triton kernels for the syndrome codec (:mod:`.syndrome`), its path for CUDA tensors.

On a GPU the torch reference's elimination is a Python loop of small ops per
unknown and per tier: hundreds of kernel launches per decoded site. Here each
program takes a group of blocks and does the whole decode in registers: the
least reliable positions, the GF(2) elimination with the tiers' checkpoints,
and the flips. :func:`syndrome_words` and :func:`solve_erasures` have the
reference's signatures and return the same bits (tests/test_triton_kernels.py,
under ``TRITON_INTERPRET=1`` on CPU tensors; tests/test_triton_compile.py
compiles them for sm_90 and sm_100).

Ties: the reference takes the least reliable positions with ``torch.topk``,
which orders equal reliabilities in no specified way; here equal reliabilities
go in position order. Where ties decide which positions are unknowns, both
solve the same system restricted to different, equally reliable positions.
"""

import torch
import triton
import triton.language as tl
from torch import Tensor

from .reference import to_device
from .syndrome import TIERS, check_parity_rows, checked_erasures, pack_words

TILE = 4096  # block elements a program holds at once: several blocks of a few hundred elements, or one wide block
_INT64_MAX = tl.constexpr(0x7FFFFFFFFFFFFFFF)  # a kernel reads a global only as a constexpr


@triton.jit
def _syndrome_kernel(bits_ptr, columns_ptr, out_ptr, nb, n, BLOCKS: tl.constexpr, N_POW2: tl.constexpr):
    blk = tl.program_id(0).to(tl.int64) * BLOCKS + tl.arange(0, BLOCKS)
    pos = tl.arange(0, N_POW2)
    inside = (blk[:, None] < nb) & (pos[None, :] < n)
    bits = tl.load(bits_ptr + blk[:, None] * n + pos[None, :], mask=inside, other=0)
    columns = tl.load(columns_ptr + pos, mask=pos < n, other=0)
    words = tl.where(bits != 0, columns[None, :], 0)
    tl.store(out_ptr + blk, tl.xor_sum(words, axis=1), mask=blk < nb)


@triton.jit
def _solve_kernel(
    target_ptr,
    reliability_ptr,
    columns_ptr,
    guess_ptr,
    bits_ptr,
    ok_ptr,
    needed_ptr,
    nb,
    n,
    erasures,
    TIER1: tl.constexpr,
    TIER2: tl.constexpr,
    BLOCKS: tl.constexpr,
    N_POW2: tl.constexpr,
    L_POW2: tl.constexpr,
):
    blk = tl.program_id(0).to(tl.int64) * BLOCKS + tl.arange(0, BLOCKS)
    live = blk < nb
    pos = tl.arange(0, N_POW2)
    inside = live[:, None] & (pos[None, :] < n)
    offsets = blk[:, None] * n + pos[None, :]

    # sort keys: the reliability's float32 bits read as int32, as the reference orders them, then the position
    raw = tl.load(reliability_ptr + offsets, mask=inside, other=0.0).to(tl.int32, bitcast=True)
    keys = tl.where(inside, (raw.to(tl.int64) << 32) | pos[None, :], _INT64_MAX)

    col = tl.arange(0, L_POW2).to(tl.int64)
    work = tl.zeros((BLOCKS, L_POW2), dtype=tl.int64)  # reduced columns of the unknowns, in reliability order
    # which original columns each reduced column sums: column k alone, to start with
    combos = tl.where(col[None, :] < erasures, tl.full((BLOCKS, L_POW2), 1, tl.int64) << col[None, :], 0)
    rank = tl.full((BLOCKS, N_POW2), L_POW2, tl.int32)  # each position's place among the unknowns
    for k in range(0, erasures):  # the k-th least reliable position and its column of the parity matrix
        least = tl.min(keys, axis=1)
        chosen = keys == least[:, None]
        rank = tl.where(chosen, k, rank)
        keys = tl.where(chosen, _INT64_MAX, keys)
        column = tl.load(columns_ptr + (least & 0xFFFFFFFF), mask=live, other=0)
        work = tl.where(col[None, :] == k, column[:, None], work)

    target = tl.load(target_ptr + blk, mask=live, other=0)
    tcombo = tl.zeros((BLOCKS,), dtype=tl.int64)  # which columns the target's reductions summed
    found = tl.zeros((BLOCKS,), dtype=tl.int64)  # the unknowns to flip, once a checkpoint solved the block
    done = (target == 0).to(tl.int32)  # the guess satisfies every equation already: nothing to flip
    for k in range(0, erasures):  # column elimination, the target as one more column (reference: _solve)
        head = tl.xor_sum(tl.where(col[None, :] == k, work, 0), axis=1)
        head_combo = tl.xor_sum(tl.where(col[None, :] == k, combos, 0), axis=1)
        pivot = head & -head
        hit = (col[None, :] > k) & ((work & pivot[:, None]) != 0)
        work = tl.where(hit, work ^ head[:, None], work)
        combos = tl.where(hit, combos ^ head_combo[:, None], combos)
        clears = (target & pivot) != 0
        target = tl.where(clears, target ^ head, target)
        tcombo = tl.where(clears, tcombo ^ head_combo, tcombo)
        # the reference's tiers: solved with the first TIER1, TIER2, then all unknowns
        checkpoint = (k + 1 == TIER1) | (k + 1 == TIER2) | (k + 1 == erasures)
        solved = checkpoint & (target == 0) & (done == 0)
        found = tl.where(solved, tcombo, found)
        done = tl.where(solved, 1, done)

    flips = ((found[:, None] >> col[None, :]) & 1) != 0
    needed = tl.max(tl.where(flips, col[None, :] + 1, 0), axis=1)
    unknown = rank < L_POW2
    flip = unknown & (((found[:, None] >> tl.where(unknown, rank, 0).to(tl.int64)) & 1) != 0)
    guess = tl.load(guess_ptr + offsets, mask=inside, other=0)
    tl.store(bits_ptr + offsets, guess ^ flip.to(tl.uint8), mask=inside)
    tl.store(ok_ptr + blk, done.to(tl.uint8), mask=live)
    tl.store(needed_ptr + blk, needed.to(tl.int64), mask=live)


def _blocks_per_program(n: int) -> tuple[int, int]:
    n_pow2 = triton.next_power_of_2(max(n, 1))
    return max(1, TILE // n_pow2), n_pow2


def syndrome_words(bits: Tensor, matrix: Tensor) -> Tensor:
    rows, n = matrix.shape
    check_parity_rows(rows)
    bits = bits.contiguous()
    columns = pack_words(to_device(matrix, bits.device).T).contiguous()
    out = torch.empty(len(bits), dtype=torch.int64, device=bits.device)
    blocks, n_pow2 = _blocks_per_program(n)
    _syndrome_kernel[(triton.cdiv(len(bits), blocks),)](bits, columns, out, len(bits), n, BLOCKS=blocks, N_POW2=n_pow2)
    return out


def solve_erasures(
    guess: Tensor, reliability: Tensor, parity: Tensor, matrix: Tensor, erasures: int, chunk: int = 8192
) -> tuple[Tensor, Tensor, Tensor]:
    del chunk  # the reference's cache blocking; a program here holds its blocks in registers
    erasures = checked_erasures(guess, reliability, parity, erasures)
    nb, n = guess.shape
    guess = guess.contiguous()
    target = pack_words(parity) ^ syndrome_words(guess, matrix)
    bits = torch.empty_like(guess)
    ok = torch.empty(nb, dtype=torch.uint8, device=guess.device)
    needed = torch.empty(nb, dtype=torch.int64, device=guess.device)
    blocks, n_pow2 = _blocks_per_program(n)
    tier1, tier2 = TIERS
    _solve_kernel[(triton.cdiv(nb, blocks),)](
        target,
        reliability.contiguous(),
        pack_words(to_device(matrix, guess.device).T).contiguous(),
        guess,
        bits,
        ok,
        needed,
        nb,
        n,
        erasures,
        TIER1=tier1,
        TIER2=tier2,
        BLOCKS=blocks,
        N_POW2=n_pow2,
        L_POW2=triton.next_power_of_2(max(erasures, 1)),
    )
    return bits, ok.bool(), needed
