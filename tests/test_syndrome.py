"""The syndrome guidance codec: exact recovery when the training side knows the
truth or disagrees in a few unreliable places, detected and counted failure
otherwise, rate control, and the shard round trip with corruption caught."""

import hashlib
import json
import math
import random
import struct

import pytest
import torch

from tracefp4.components.architecture import PRESETS
from tracefp4.components.capture import CaptureRecords, SiteTable
from tracefp4.components.guidance import (
    GuidanceError,
    GuidanceLoader,
    StepWriter,
    _manifest_digest,
    decode_shard,
    encode_shard,
    iter_step_tables,
    write_step,
)
from tracefp4.components.store import open_store
from tracefp4.components.syndrome import (
    DecodeStats,
    SyndromeTable,
    choose_rates,
    decode_rows,
    decode_summary,
    encode_table,
    layout_of,
    site_rates,
)
from tracefp4.components.syndrome_rate import (
    CODE_CHECK_BITS,
    MAX_SCALE_BITS,
    MIN_CODE_BITS,
    TARGET_FAILED_SHARE,
    Rate,
    erasures_for,
    first_rate,
)
from tracefp4.kernels import (
    MAX_ERASURES,
    compact_codes,
    dequantize,
    get_format,
    parity_matrix,
    quantize,
    scale_side_info,
    solve_erasures,
    syndrome,
    unknowns,
    unpack_nibbles,
)


def test_parity_matrix_is_fixed():
    # computed from integer hashes: the same bits on every platform and torch version
    assert parity_matrix(2, 16, 0).flatten().tolist() == [int(b) for b in "01000111010110110001010111100000"]
    assert not torch.equal(parity_matrix(4, 64, 1), parity_matrix(4, 64, 2))  # the stages' matrices differ


def blocks(nb=400, n=256, seed=0):
    g = torch.Generator().manual_seed(seed)
    truth = torch.randint(0, 2, (nb, n), generator=g, dtype=torch.uint8)
    reliability = torch.rand(nb, n, generator=g)
    return truth, reliability


def test_side_information_equal_to_the_truth_decodes_exactly():
    truth, reliability = blocks()
    h = parity_matrix(32, 256, 1)
    bits, ok, needed = solve_erasures(truth, reliability, syndrome(truth, h), h, 32 - CODE_CHECK_BITS)
    assert ok.all() and torch.equal(bits, truth) and (needed == 0).all()


def test_one_percent_flips_at_unreliable_positions_decode_exactly():
    truth, reliability = blocks()
    flips = (reliability < 0.01).to(torch.uint8)  # ~2.6 per block, among the least reliable
    h = parity_matrix(64, 256, 1)
    bits, ok, needed = solve_erasures(truth ^ flips, reliability, syndrome(truth, h), h, 56)
    assert flips.sum() > 500 and ok.all() and torch.equal(bits, truth)
    assert (needed == (flips.bool() * (reliability.argsort(1).argsort(1) + 1)).amax(1)).all()


def test_disagreements_beyond_the_erasures_fail_detectably():
    truth, reliability = blocks()
    flips = torch.zeros_like(truth)
    flips[:, reliability.argsort(1)[0, -1]] = 1  # one flip in a place each block is sure of
    flips = torch.where(reliability >= 0.5, flips, 0)
    h = parity_matrix(64, 256, 1)
    bits, ok, _ = solve_erasures(truth ^ flips, reliability, syndrome(truth, h), h, 56)
    wrong = flips.bool().any(1)
    assert wrong.sum() > 100
    # 8 check equations: a wrong block passes with probability 2^-8, so at most a few of ~200
    assert (ok & wrong).sum() <= 3 and torch.equal(bits[~wrong], truth[~wrong])
    assert torch.equal(bits[ok & ~wrong], truth[ok & ~wrong])


def test_a_flipped_parity_bit_is_detected():
    truth, reliability = blocks(nb=200)
    h = parity_matrix(64, 256, 1)
    parity = syndrome(truth, h)
    parity[:, 5] ^= 1
    _, ok, _ = solve_erasures(truth, reliability, parity, h, 56)
    assert (~ok).sum() >= 195  # a consistent wrong solution needs the flipped row in the erasures' span: 2^-8


def test_as_many_parity_bits_as_bits_are_the_bits_themselves():
    """From ``n`` parity rows over ``n`` bits on, the matrix's first ``n`` rows
    are the identity and the decode solves for all ``n``: the bits come back
    whatever the guess, even one wrong everywhere and sure of itself. (An MXFP4
    block's 8 scales were sent as 16 hashed parity bits, where 8 raw bits are exact.)"""
    assert torch.equal(parity_matrix(8, 8, 2), torch.eye(8, dtype=torch.uint8))
    nine = parity_matrix(16, 9, 2)  # 9 scales (a 144-element NVFP4 segment) in two bytes: 7 hashed checks
    assert torch.equal(nine[:9], torch.eye(9, dtype=torch.uint8)) and torch.equal(
        nine[9:], parity_matrix(16, 17, 2)[9:, :9]
    )
    assert [unknowns(8, 8, 4), unknowns(16, 9, 4), unknowns(16, 16, 4), unknowns(16, 17, 4)] == [8, 9, 16, 12]
    for rows, n in ((8, 8), (16, 9), (16, 16)):
        truth, reliability = blocks(n=n, seed=n)
        reliability[:, 0] = torch.inf
        h = parity_matrix(rows, n, 2)
        bits, ok, _ = solve_erasures(1 - truth, reliability, syndrome(truth, h), h, unknowns(rows, n, 4))
        assert ok.all() and torch.equal(bits, truth)


def table_from(x: torch.Tensor, traj: torch.Tensor, fmt="nvfp4") -> SiteTable:
    finite = x[x.isfinite()]  # a non-finite value's block is NaN (or saturates) under any scale
    g = torch.tensor(finite.abs().amax().item() / (6 * 448) if len(finite) else 1.0)
    q = quantize(x, fmt, global_scale=g if fmt == "nvfp4" else None)
    n = len(traj)
    counts = torch.unique_consecutive(traj, return_counts=True)[1]
    pos = torch.cat([torch.arange(int(c)) for c in counts]) if n else traj
    return SiteTable(
        0,
        "moe_in",
        fmt,
        4,
        x.shape[1],
        float(g) if fmt == "nvfp4" else None,
        traj,
        pos,
        torch.zeros(n, dtype=torch.long),
        torch.full((n,), -1),
        q.codes,
        q.scales.view(torch.uint8),
    )


def rows(n=120, width=128, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, width, generator=g) * torch.rand(n, 1, generator=g).add(0.5)
    traj = torch.arange(n) // 17  # trajectories of 17 rows: blocks of 2 rows, a short last block each
    return x, traj


def decode(coded, x, available):
    """:func:`decode_rows` with its tally read as statistics."""
    scales, low, ok, tally = decode_rows(coded, x, available)
    return scales, low, ok, DecodeStats.from_tally(coded.rate, tally.tolist())


@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4"])
def test_table_round_trip_with_the_rollouts_own_values(fmt):
    x, traj = rows()
    table = table_from(x, traj, fmt)
    coded = encode_table(table, Rate(32, 8))
    per_trajectory = torch.unique_consecutive(traj, return_counts=True)[1]
    assert coded.group == 2 and coded.code_parity.shape == (int(((per_trajectory + 1) // 2).sum()), 4)
    scales, low, ok, stats = decode(coded, x, torch.ones(len(x), dtype=torch.bool))
    assert ok.all() and stats.failed == 0 and stats.blocks == coded.code_parity.shape[0]
    assert torch.equal(scales, table.scales) and torch.equal(low, unpack_nibbles(table.codes) & 1)


def test_one_codeword_flips_decode_and_failures_are_counted():
    x, traj = rows(seed=1)
    table = table_from(x, traj)
    g = torch.Generator().manual_seed(2)
    train = x * (1 + 2e-3 * torch.randn(x.shape, generator=g))  # the training side's values drift a little
    rtn = unpack_nibbles(quantize(train, "nvfp4", global_scale=torch.tensor(table.global_scale)).codes)
    disagree = ((rtn & 1) != (unpack_nibbles(table.codes) & 1)).float().mean()
    assert 0.002 < disagree < 0.03
    coded = encode_table(table, Rate(64, 16))
    scales, low, ok, stats = decode(coded, train, torch.ones(len(x), dtype=torch.bool))
    truth = (low == unpack_nibbles(table.codes) & 1).all(1) & (scales == table.scales).all(1)
    assert ok.float().mean() > 0.9 and truth[ok].all()  # decoded rows are exact
    # far from the rollout's values most blocks fail, and each failure is counted
    far = x + 0.5 * torch.randn(x.shape, generator=g)
    _, low, ok, stats = decode(coded, far, torch.ones(len(x), dtype=torch.bool))
    block, _ = coded.block_of_rows()
    assert stats.failed == len(torch.unique(block[~ok])) and stats.failed > 0.9 * stats.blocks


@pytest.mark.parametrize(
    "fmt, width, segments, block",
    [
        ("nvfp4", 1024, 4, 256),
        ("mxfp4", 2048, 8, 256),
        ("nvfp4", 384, 2, 192),
        ("nvfp4", 272, 2, 144),
        ("mxfp4", 288, 2, 160),
    ],
)
def test_rows_wider_than_a_block_are_cut_into_blocks_and_decode_at_the_rate_asked(fmt, width, segments, block):
    """A whole 2048-wide row (Qwen3.5-35B-A3B's moe_in) was one block, capped at
    64 + 16 parity bits: 0.03 bit per element at a rate of 0.25, and every
    block failed. Cut into segments, a row gets the rate, and they decode. A
    width of 17 scale blocks makes two segments of 9 (the last padded), not 17
    of one (4 bits per element at that rate)."""
    x, traj = rows(n=34, width=width, seed=4)
    table = table_from(x, traj, fmt)
    layout = layout_of(table)
    assert layout == (1, segments, block, block // get_format(fmt).block_size)
    coded = encode_table(table, first_rate(0.25, layout.elements, layout.scales))  # as the pipeline sizes it per site
    assert (coded.group, coded.segments, coded.block_elements) == (1, segments, block)
    assert coded.code_parity.shape[0] == 34 * segments and 0.25 <= coded.nbytes * 8 / coded.elements < 0.3
    g = torch.Generator().manual_seed(5)
    train = x * (1 + 2e-3 * torch.randn(x.shape, generator=g))
    scales, low, ok, stats = decode(coded, train, torch.ones(len(x), dtype=torch.bool))
    truth = (low == unpack_nibbles(table.codes) & 1).all(1) & (scales == table.scales).all(1)
    assert stats.blocks == 34 * segments and ok.float().mean() > 0.9 and truth[ok].all()
    available = torch.arange(len(x)) % 17 != 3  # a row the forward lacks fails all its blocks, and only it
    _, _, ok, stats = decode(coded, x, available)
    assert ok.tolist() == available.tolist() and stats.blocks == int(available.sum()) * segments
    # through a shard and the loader's selection by trajectory
    header, back = decode_shard(
        encode_shard(CaptureRecords({(0, "moe_in"): coded}), rl_step=0, policy_version=0, top_k=1), "s"
    )
    second = back.tables[(0, "moe_in")].for_trajectories(torch.tensor([1]))
    assert second.segments == segments and torch.equal(second.code_parity, coded.code_parity[17 * segments :])
    assert decode(second, x[17:], torch.ones(17, dtype=torch.bool))[2].all()


def test_rows_the_training_forward_lacks_are_unknowns():
    x, traj = rows(seed=3)
    table = table_from(x, traj)
    coded = encode_table(table, Rate(64, 16))
    available = torch.ones(len(x), dtype=torch.bool)
    available[::17] = False  # the first row of every trajectory: its block cannot decode
    _, _, ok, stats = decode(coded, x, available)
    assert not ok[::17].any() and ok[available & (torch.arange(len(x)) % 17 >= 2)].all()


def test_first_rate():
    first = first_rate(0.25)
    assert first == Rate(48, 16)  # a quarter of the block's 64 bits for its 16 scales
    assert first_rate(0.0625) == Rate(16, 8) and first_rate(0.3125) == Rate(64, 16)
    assert choose_rates([(0, "moe_in")], None, first) == {(0, "moe_in"): first}


def test_mxfp4_scales_take_their_own_bits_and_always_decode():
    """A 256-element MXFP4 block has 8 scales: 8 scale bits, sent raw, and the
    rest of the rate to the codes, at the first step and under rate control;
    its scale stage cannot fail, however far the training side's values are."""
    x, traj = rows(n=34, width=256, seed=6)
    table = table_from(x, traj, "mxfp4")
    first = first_rate(0.25, 256, 8)
    assert first == Rate(56, 8) and site_rates({(0, "moe_in"): table}, None, 0.25) == {(0, "moe_in"): first}
    nvfp4 = site_rates({(0, "moe_in"): table_from(x, traj)}, None, 0.25)
    assert nvfp4 == {(0, "moe_in"): Rate(48, 16)}  # 16 scales: a quarter of the bits, below their own 16
    # statistics asking for more scale bits (or a rate from before the cap) stay at the cap
    failing = stats_of(Rate(56, 16), {0: 200}, scale={0: 100, 8: 100}, scale_failed=20).to_json()
    assert site_rates({(0, "moe_in"): table}, {"0/moe_in": failing}, 0.25)[(0, "moe_in")].scale_bits == 8
    coded = encode_table(table, first)
    g = torch.Generator().manual_seed(7)
    far = x + 0.5 * torch.randn(x.shape, generator=g)  # most code stages fail here (NVFP4: every stage)
    scales, _, _, stats = decode(coded, far, torch.ones(len(x), dtype=torch.bool))
    assert stats.scale_failed == 0 and torch.equal(scales & 1, table.scales & 1) and stats.code_failed > 0


def test_an_nvfp4_scale_that_rounds_to_zero_and_the_smallest_subnormal_neighbour_each_other():
    """A block scale that rounds to zero is written 1.0 (0x38); one a little
    above the boundary 2^-10 rounds to 2^-9 (0x01). Each side's neighbour is
    the other's, so a rollout's zero scale is recovered where the training
    side's rounded up (it was taken for 0x01 as certain, and the block's
    guided values were non-zero where the rollout's are zero)."""
    x = torch.zeros(1, 256)
    x[0, 16:] = torch.linspace(-3, 3, 240)  # g = 3 / (6 * 448)
    x[0, 0] = 0.9 * 2.0**-10 * 3 / 448  # block 0: amax / (6 g) = 0.9 * 2^-10, a zero scale
    train = x.clone()
    train[0, 0] *= 1.1 / 0.9  # 1.1 * 2^-10: 0x01
    table = table_from(x, torch.zeros(1, dtype=torch.long))
    g, nvfp4 = torch.tensor(table.global_scale), get_format("nvfp4")
    assert table.scales[0, 0] == 0x38
    own, neighbour, distance = scale_side_info(train, nvfp4, g)
    assert (own[0, 0], neighbour[0, 0]) == (0x01, 0x38) and distance[0, 0] == pytest.approx(0.1, rel=1e-3)
    own, neighbour, distance = scale_side_info(x, nvfp4, g)
    assert (own[0, 0], neighbour[0, 0]) == (0x38, 0x01) and distance[0, 0] == pytest.approx(0.1, rel=1e-3)
    scales, _, ok, stats = decode(encode_table(table, Rate(48, 16)), train, torch.ones(1, dtype=torch.bool))
    assert ok.all() and stats.failed == 0 and torch.equal(scales, table.scales)


def test_an_nvfp4_scale_just_above_a_power_of_two_neighbours_the_one_below():
    """Just above 1.0 the rung below (0.9375) is half as far as the one above
    (1.125), so the nearer boundary is 0.96875 below: the neighbour had been
    taken on the side the value lies on (0x39), and a rollout one rung below
    (0x37, low bit 1 as well) decoded as 0x39, 20% off, where its codes did
    not fail the block (silently wrong guidance). Each side's distance is
    relative to its boundary, so just below 1.125 the one above is the nearer."""
    x = torch.randn(17, 128, generator=torch.Generator().manual_seed(0))
    x[0, 127] = 6 * 448 / 64  # the global scale g = 1/64
    g = 1 / 64
    train = x.clone()
    train[:, :16] *= 1.005 * 6 * g / train[:, :16].abs().amax(1, keepdim=True)  # every row's block 0: 1.005
    nvfp4 = get_format("nvfp4")
    own, neighbour, distance = scale_side_info(train, nvfp4, torch.tensor(g))
    assert (own[0, 0], neighbour[0, 0]) == (0x38, 0x37)
    assert distance[0, 0] == pytest.approx((1.005 - 0.96875) / 0.96875, rel=1e-4)
    for v, expected in ((1.02, 0x39), (1.12, 0x38), (1.124, 0x3A)):
        _, neighbour, _ = scale_side_info(torch.full((1, 16), v * 6 * g), nvfp4, torch.tensor(g))
        assert neighbour[0, 0] == expected
    rollout = train.clone()
    rollout[:, :16] *= 0.96 / 1.005  # 0.96: the rung below, 0x37
    table = table_from(rollout, torch.zeros(17, dtype=torch.long))
    assert table.global_scale == g and (table.scales[:, 0] == 0x37).all()
    scales, low, ok, stats = decode(encode_table(table, Rate(48, 16)), train, torch.ones(17, dtype=torch.bool))
    assert ok.all() and stats.failed == 0 and torch.equal(scales, table.scales)
    assert torch.equal(low, unpack_nibbles(table.codes) & 1)


def below(value: float, ulps: int) -> float:
    """The float32 ``ulps`` steps below ``value``."""
    t = torch.tensor(value, dtype=torch.float32)
    for _ in range(ulps):
        t = torch.nextafter(t, torch.tensor(0.0))
    return float(t)


@pytest.mark.parametrize("k, ulps", [(3, 1), (5, 2), (10, 4), (-10, 4), (20, 8), (100, 16)])
def test_an_mxfp4_scale_just_below_a_power_of_two_neighbours_the_one_above(k, ulps):
    """A float32 block amax a few ulps below 2^k (log2 of it rounds to k): its
    nearest scale boundary is 2^k just above, so its neighbour is the scale of
    an amax at or above it, a hair away (it had been the scale below, 4x off,
    at distance 0: the first erased, and decoded wrong)."""
    x = torch.zeros(1, 32)
    x[0, 0] = below(2.0**k, ulps)
    own, neighbour, distance = scale_side_info(x, get_format("mxfp4"), None)
    above = quantize(torch.full((1, 32), 2.0**k), "mxfp4").scales[0, 0]
    assert int(neighbour[0, 0]) == int(own[0, 0]) + 1 == int(above) and 0 < float(distance[0, 0]) < 1e-5


def test_an_mxfp4_block_just_below_a_power_of_two_decodes_the_rollouts_scale():
    """End to end: the rollout's block amax is 1024 (its scale byte 135), the
    training side's the float32 just below (134): the scale parity says not
    134, and the decode takes 135."""
    x = torch.randn(17, 128, generator=torch.Generator().manual_seed(0))
    x[0, 0] = 1024.0
    train = x.clone()
    train[0, 0] = below(1024.0, 1)
    table = table_from(x, torch.zeros(17, dtype=torch.long), "mxfp4")
    scales, _, ok, _ = decode(encode_table(table, Rate(64, 16)), train, torch.ones(17, dtype=torch.bool))
    assert int(scales[0, 0]) == int(table.scales[0, 0]) == 135 and ok[0]


@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4"])
@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
@pytest.mark.parametrize("width, group", [(64, 4), (1024, 1)])
def test_a_non_finite_value_of_the_training_side_is_an_unknown_of_its_block_only(fmt, bad, width, group):
    """A NaN or Inf where the training side's values are guided (a bf16
    overflow the rollout did not have, say) made its whole row's side
    information unreliable (a NaN scale, every distance of the row NaN), so
    its block failed and the finite rows coded beside it lost their guidance
    (rows of 64: four a block; a row of 1024: its four segments). Its scale
    block's scale and codes are now unknowns of the block, which the parity
    recovers; the row itself is left to training, which rounds a non-finite
    row to nearest (``qat``)."""
    x, traj = rows(n=34, width=width, seed=9)
    table = table_from(x, traj, fmt)
    coded = encode_table(table, site_rates({(0, "moe_in"): table}, None, 0.25)[(0, "moe_in")])
    g = torch.Generator().manual_seed(10)
    train = x * (1 + 2e-3 * torch.randn(x.shape, generator=g))  # the usual drift besides
    train[5, 3] = bad
    scales, low, ok, stats = decode(coded, train, torch.ones(34, dtype=torch.bool))
    assert coded.group == group and ok.all() and stats.failed == 0
    assert torch.equal(low, unpack_nibbles(table.codes) & 1)  # the bad scale block's codes too
    finite = torch.ones_like(table.scales, dtype=torch.bool)
    finite[5, 0] = False  # its scale is not the training side's to recover
    assert torch.equal(scales[finite], table.scales[finite])
    # the rollout's own non-finite value (the same overflow on both sides) decodes as well
    rollout = x.clone()
    rollout[5, 3] = bad
    table = table_from(rollout, traj, fmt)
    train = rollout * (1 + 2e-3 * torch.randn(x.shape, generator=g))
    _, low, ok, stats = decode(encode_table(table, coded.rate), train, torch.ones(34, dtype=torch.bool))
    assert ok.all() and stats.failed == 0 and torch.equal(low, unpack_nibbles(table.codes) & 1)


@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4"])
@pytest.mark.parametrize("rate", [Rate(48, 16), Rate(40, 8)])
def test_a_row_non_finite_on_both_sides_leaves_the_rows_beside_it_their_guidance(fmt, rate):
    """A NaN that reached a whole row on both sides (the rollout quantized it
    too: a NaN scale, codes 0) is more positions than a block's unknowns: they
    are taken as the training side quantizes them, not as unknowns (which a
    scale block's few non-finite values are), and the block decodes, however
    many scales its rate leaves to the guess."""
    x, traj = rows(n=34, width=128, seed=12)
    x[5] = float("nan")
    table = table_from(x, traj, fmt)
    train = x * (1 + 2e-3 * torch.randn(x.shape, generator=torch.Generator().manual_seed(13)))
    _, low, ok, stats = decode(encode_table(table, rate), train, torch.ones(34, dtype=torch.bool))
    assert ok.all() and stats.failed == 0 and torch.equal(low, unpack_nibbles(table.codes) & 1)


def test_training_guides_every_row_but_a_non_finite_one_beside_it():
    """What a user saw: under the syndrome codec one NaN of the training
    side's took its block's four rows off guidance (coverage 30/34); now only
    its own row rounds to nearest, the rest train on the rollout's values."""
    from tracefp4.components.guidance import MicrobatchGuidance
    from tracefp4.components.qat import TrainingSites
    from tracefp4.components.quant_config import QuantConfig

    x, traj = rows(n=34, width=64, seed=9)
    table = table_from(x, traj)
    g = torch.tensor(table.global_scale)
    coded = encode_table(table, site_rates({(0, "moe_in"): table}, None, 0.25)[(0, "moe_in")])
    train = x * (1 + 2e-3 * torch.randn(x.shape, generator=torch.Generator().manual_seed(10)))
    train[5, 3] = float("nan")
    sites = TrainingSites(
        QuantConfig("nvfp4", "nvfp4", None),
        "trace",
        {(0, "moe_in"): g},
        trajectories=[0, 1],
        seq_len=17,
        guidance=MicrobatchGuidance([0, 1], {(0, "moe_in"): coded}, []),
    )
    out = sites.moe_in(0, train)
    assert sites.coverage.rate == 33 / 34 and out[5].isnan().any()
    rollout = dequantize(quantize(x, "nvfp4", global_scale=g))
    assert torch.equal(out[torch.arange(34) != 5], rollout[torch.arange(34) != 5])


BOTTOM = 2.0**-124  # the smallest amax of E8M0 scale byte 1 (2^-126); every smaller one is byte 0


@pytest.mark.parametrize(
    "train_amax, rollout_amax",
    [
        # training byte 0 anywhere in its range (subnormal float32 amaxes included), the rollout's byte 1
        (2.0**-149, 1.01 * BOTTOM),
        (2.0**-136, 1.01 * BOTTOM),
        (2.0**-127, 1.5 * BOTTOM),
        (2.0**-126, 1.01 * BOTTOM),
        (1.3 * 2.0**-126, 1.01 * BOTTOM),
        (2.0**-125, 1.9 * BOTTOM),
        (0.99 * BOTTOM, 1.01 * BOTTOM),
        # and the other bottom bytes, each side of their boundaries
        (1.01 * BOTTOM, 0.99 * BOTTOM),
        (1.2 * BOTTOM, 0.7 * BOTTOM),
        (1.99 * BOTTOM, 2.01 * BOTTOM),
        (2.01 * BOTTOM, 1.99 * BOTTOM),
        (3.99 * BOTTOM, 4.01 * BOTTOM),
        (4.01 * BOTTOM, 3.99 * BOTTOM),
    ],
    ids=lambda amax: f"2^{math.log2(amax):.2f}",
)
def test_mxfp4_scales_at_the_bottom_of_the_range_decode_the_rollouts(train_amax, rollout_amax):
    """E8M0 byte 0 holds every amax below 2^-124 (``floor(log2 amax) - 2``
    clamps there): its only rounding boundary is the one above, to byte 1.
    Its neighbour was taken below unless the amax lay in the upper half of its
    float32 binade, clamped to byte 0 itself, so a rollout scale of byte 1
    could not be recovered, and the block decoded under scale byte 0 (its
    codes agreeing there: silently half the rollout's scale). Byte 0's
    neighbour is byte 1, at the distance in binades to 2^-124."""
    x = torch.randn(17, 256, generator=torch.Generator().manual_seed(11))
    x[0, :32] = 0
    x[0, 0] = rollout_amax
    train = x.clone()
    train[0, 0] = train_amax
    mxfp4 = get_format("mxfp4")
    own, neighbour, distance = scale_side_info(train, mxfp4, None)
    assert (own[0, 0] == 0) == (train_amax < BOTTOM)
    assert 0 <= float(distance[0, 0]) < math.inf
    table = table_from(x, torch.zeros(17, dtype=torch.long), "mxfp4")
    assert int(table.scales[0, 0]) == int(neighbour[0, 0])  # the rollout's scale: the training side's neighbour
    scales, low, ok, stats = decode(encode_table(table, Rate(56, 8)), train, torch.ones(17, dtype=torch.bool))
    assert ok.all() and stats.failed == 0 and torch.equal(scales, table.scales)
    assert torch.equal(low, unpack_nibbles(table.codes) & 1)


def test_an_all_zero_mxfp4_block_is_certain_of_byte_0_and_neighbours_byte_1():
    own, neighbour, distance = scale_side_info(torch.zeros(1, 32), get_format("mxfp4"), None)
    assert (int(own[0, 0]), int(neighbour[0, 0]), float(distance[0, 0])) == (0, 1, math.inf)


def stats_of(rate: Rate, code: dict, code_failed=0, scale: dict | None = None, scale_failed=0) -> DecodeStats:
    """Hand-made decode statistics: ``{need: blocks}`` per stage (the scale stage: every block needing 0 by default)."""
    seen = DecodeStats(rate, scale_failed=scale_failed, code_failed=code_failed)
    for n, count in code.items():
        seen.code_needed[n] += count
    for n, count in (scale or {0: sum(code.values()) + code_failed}).items():
        seen.scale_needed[n] += count
    seen.blocks = sum(seen.scale_needed) + scale_failed
    return seen


def geometric(rho: float, total: int, erasures: int) -> tuple[dict, int]:
    """Expected histogram of ``total`` needs with ``P(need > n) = rho^(n + 1)``, censored at ``erasures``."""
    code = {n: round(total * (1 - rho) * rho**n) for n in range(erasures + 1)}
    return code, round(total * rho ** (erasures + 1))


def test_rate_control_reads_failed_blocks_as_the_top_of_the_distribution():
    # a step at 16 code erasures failed 2.3% of blocks; geometric needs: P(need > n) = 0.8^(n + 1)
    code, failed = geometric(0.8, 100_000, 16)
    assert 0.02 < failed / 100_000 < 0.025
    erasures = erasures_for(list_of(code), failed, 16)
    # the true tail leaves 0.1% undecoded above n = 29.96: the chosen erasures reach it, with the margin on top
    assert 29.96 < erasures < 29.96 * 1.3
    rates = choose_rates(
        [(0, "moe_in")], {"0/moe_in": stats_of(Rate(24, 16), code, failed).to_json()}, first_rate(0.25)
    )
    assert rates[(0, "moe_in")] == Rate(48, 8)  # 34.4 erasures + 8 check bits, in bytes; scales fall a byte
    # the former rule (1.25 x the 98th percentile of the decoded blocks, plus 2) left over 3x the target undecoded
    decoded = sorted(n for n, c in code.items() for _ in range(c))
    former = 8 * math.ceil((1.25 * decoded[int(0.98 * len(decoded))] + 2 + CODE_CHECK_BITS) / 8) - CODE_CHECK_BITS
    assert 0.8 ** (former + 1) > 3 * TARGET_FAILED_SHARE


def list_of(code: dict) -> list[int]:
    return [code.get(n, 0) for n in range(MAX_ERASURES + 1)]


def test_rate_control_meets_the_target_on_a_known_tail():
    # no failures at 56 erasures; P(need > n) = 0.75^(n + 1): 0.1% is left above n = 23.0
    code, failed = geometric(0.75, 50_000, 56)
    assert failed == 0
    erasures = erasures_for(list_of(code), failed, 56)
    assert 0.75 ** (erasures + 1) <= TARGET_FAILED_SHARE and erasures < 23 + 0.3 * 23


def test_rate_control_with_a_tail_of_failed_blocks_only_grows():
    # every block beyond the 8 the rate solved for failed: nothing bounds the tail
    code = {0: 50, 1: 20, 2: 10}
    assert erasures_for(list_of(code), 40, 8) == 12.0  # 1.5 x 8
    assert erasures_for([0] * (MAX_ERASURES + 1), 0, 8) is None


@pytest.mark.parametrize("fmt, scales", [("nvfp4", 16), ("mxfp4", 8)])
def test_rate_control_counts_every_need_of_a_scale_stage_sent_raw(fmt, scales):
    """A scale stage at its cap sends the scales raw and solves for all of
    them, more than a hashed stage of as many bits: blocks needing more than
    that (a training side far off the rollout's scales) hold the stage at its
    cap instead of being left out of the tail (where all of them were, a
    ZeroDivisionError)."""
    x, traj = rows(n=34, width=256, seed=6)
    table = table_from(x, traj, fmt)
    rate = site_rates({(0, "moe_in"): table}, None, 0.25)[(0, "moe_in")]
    assert rate.scale_bits == scales  # raw
    for far in ({scales - 2: 300}, {0: 250, scales - 1: 50}):
        seen = stats_of(rate, {0: 300}, scale=far).to_json()
        assert site_rates({(0, "moe_in"): table}, {"0/moe_in": seen}, 0.25)[(0, "moe_in")].scale_bits == scales


def test_rate_control_falls_a_byte_a_step_and_keeps_the_floor():
    first = first_rate(0.25)
    clean = stats_of(first, {0: 300})  # the training side guessed every block: zero erasures needed
    rates = choose_rates([(0, "moe_in"), (1, "moe_in")], {"0/moe_in": clean.to_json()}, first)
    assert rates[(0, "moe_in")] == Rate(40, 8) and rates[(1, "moe_in")] == first  # layer 1 had no statistics
    rate = first
    for _ in range(6):
        rate = choose_rates([(0, "moe_in")], {"0/moe_in": stats_of(rate, {0: 300}).to_json()}, first)[(0, "moe_in")]
    assert rate == Rate(MIN_CODE_BITS, 8)


def test_rate_control_censors_each_stage_on_its_own():
    # 5% of blocks failed their scales, every scale-decoded block decoded its codes needing at most 3
    seen = stats_of(Rate(32, 8), {3: 950}, scale={0: 700, 2: 150, 4: 100}, scale_failed=50)
    rate = choose_rates([(0, "moe_in")], {"0/moe_in": seen.to_json()}, first_rate(0.25))[(0, "moe_in")]
    assert rate.scale_bits == MAX_SCALE_BITS and rate.code_bits == 24  # codes fall a byte, scales rise to the cap
    summary = decode_summary({(0, "moe_in"): seen})
    assert summary["guidance_decode_failures"] == 50 and summary["guidance_decode_failed_share"] == 0.05


def test_decode_statistics_of_another_version_are_refused():
    data = stats_of(Rate(32, 8), {0: 10}).to_json()
    del data["code_failed"]
    with pytest.raises(ValueError, match="code_failed"):
        choose_rates([(0, "moe_in")], {"0/moe_in": data}, first_rate(0.25))
    data = stats_of(Rate(32, 8), {0: 10}, code_failed=2).to_json() | {"failed": 5}
    with pytest.raises(ValueError, match="failed 5"):
        DecodeStats.from_json(data)


def coded_records(seed=0) -> CaptureRecords:
    x, traj = rows(seed=seed)
    return CaptureRecords({(0, "moe_in"): encode_table(table_from(x, traj), Rate(40, 8))})


def test_shard_and_loader_round_trip(tmp_path):
    records = coded_records()
    data = encode_shard(records, rl_step=1, policy_version=1, top_k=1)
    header, back = decode_shard(data, "shard")
    assert header["codec"] == ["syndrome"]
    a, b = records.tables[(0, "moe_in")], back.tables[(0, "moe_in")]
    assert isinstance(b, SyndromeTable) and a.rate == b.rate and a.group == b.group
    for name in ("traj", "pos", "slot", "expert", "code_parity", "scale_parity"):
        assert torch.equal(getattr(a, name), getattr(b, name)), name
    store = open_store(str(tmp_path))
    manifest = write_step(
        store, records, rl_step=1, policy_version=1, top_k=1, trajectories_per_shard=3, syndrome={"first_rate": 0.25}
    )
    assert manifest["codec"] == ["syndrome"] and manifest["syndrome"] == {
        "first_rate": 0.25,
        "rates": {"0/moe_in": [40, 8]},
    }
    (mb,) = GuidanceLoader(store, 1, [[5, 0, 4]])
    t = mb.tables[(0, "moe_in")]
    expected = torch.cat([a.for_trajectories(torch.tensor([i])).code_parity for i in (5, 0, 4)])
    assert torch.equal(t.code_parity, expected) and t.traj.unique_consecutive().tolist() == [5, 0, 4]


def test_a_corrupt_shard_is_a_guidance_error():
    data = encode_shard(coded_records(), rl_step=0, policy_version=0, top_k=1)
    rng = random.Random(0)
    for _ in range(200):
        bad = bytearray(data)
        bit = rng.randrange(len(data) * 8)
        bad[bit // 8] ^= 1 << (bit % 8)
        with pytest.raises(GuidanceError, match="shard-y"):
            decode_shard(bytes(bad), "shard-y")


def test_parity_arrays_of_the_wrong_shape_are_refused():
    records = coded_records()
    table = records.tables[(0, "moe_in")]
    records.tables[(0, "moe_in")] = SyndromeTable(
        **{**table.__dict__, "code_parity": table.code_parity[:-1]}  # a block's parity missing
    )
    data = encode_shard(records, rl_step=0, policy_version=0, top_k=1)
    with pytest.raises(GuidanceError, match=r"code_parity has shape \(63, 5\), its 64 blocks of 40 bits"):
        decode_shard(data, "shard-z")


def test_a_version_4_table_coded_at_its_scales_own_bits_is_refused():
    """Before version 5 a scale stage with as many parity bits as scales was
    hashed parity, which a version 5 reader reads as the scale bits: such a
    table is refused by name, and one below that rate still reads."""
    x, traj = rows(seed=8)

    def as_version_4(table, rate):
        data = encode_shard(
            CaptureRecords({(0, "moe_in"): encode_table(table, rate)}), rl_step=0, policy_version=0, top_k=1
        )
        magic, _, head_len = struct.unpack_from("<8sHI", data)
        header = json.loads(data[14 : 14 + head_len]) | {"format_version": 4}
        head = json.dumps(header, sort_keys=True).encode()
        body = struct.pack("<8sHI", magic, 4, len(head)) + head + data[14 + head_len : -32]
        return body + hashlib.sha256(body).digest()

    with pytest.raises(GuidanceError, match="v4: layer 0 moe_in: format version 4 coded its 8 scales a block in 8"):
        decode_shard(as_version_4(table_from(x, traj, "mxfp4"), Rate(32, 8)), "v4")
    header, back = decode_shard(as_version_4(table_from(x, traj), Rate(32, 8)), "v4")  # NVFP4: 8 bits, 16 scales
    assert header["format_version"] == 4 and back.tables[(0, "moe_in")].rate == Rate(32, 8)


def with_header(data: bytes, edit) -> bytes:
    """A shard's bytes with its header edited by ``edit(header)``, checksum renewed."""
    magic, version, head_len = struct.unpack_from("<8sHI", data)
    header = json.loads(data[14 : 14 + head_len])
    edit(header)
    head = json.dumps(header, sort_keys=True).encode()
    body = struct.pack("<8sHI", magic, version, len(head)) + head + data[14 + head_len : -32]
    return body + hashlib.sha256(body).digest()


@pytest.mark.parametrize(
    "fmt, field, bits, allowed",
    [
        ("nvfp4", "code_bits", 44, "16 to 64"),  # parity of 5 bytes either way: the shapes passed, the decode failed
        ("nvfp4", "code_bits", 72, "16 to 64"),
        ("nvfp4", "scale_bits", 12, "8 to 16"),
        ("mxfp4", "scale_bits", 0, "8 to 8"),
    ],
)
def test_a_shard_rate_no_decoder_takes_is_refused_naming_it(fmt, field, bits, allowed):
    """A table's rate must be one its block's decode takes: whole bytes, the
    code stage from 16 to 64 bits, the scale stage from 8 to its scales' own.
    Parity bits of a byte count the reader rounds down (44 bits in 5 bytes)
    passed its shape check and failed in the training forward, naming no shard."""
    x, traj = rows(seed=14)
    table = encode_table(table_from(x, traj, fmt), Rate(40, 8))
    data = encode_shard(CaptureRecords({(0, "moe_in"): table}), rl_step=0, policy_version=0, top_k=1)

    def edit(header):
        (spec,) = header["tables"]
        spec[field] = bits

    with pytest.raises(GuidanceError, match=rf"shard-r: layer 0 moe_in: {field} is {bits}; .* from {allowed}"):
        decode_shard(with_header(data, edit), "shard-r")


def test_a_shard_coded_at_another_rate_than_its_manifest_records_is_refused(tmp_path):
    """The rates a syndrome step's manifest records are its tables' (the
    writer takes them from the tables it writes, and refuses a part coded at
    other rates); a shard whose table disagrees is refused by its name and
    field, never decoded at a rate the step does not state."""
    records = coded_records()
    store = open_store(str(tmp_path))
    manifest = write_step(store, records, rl_step=1, policy_version=1, top_k=1, trajectories_per_shard=3)
    assert manifest["syndrome"] == {"rates": {"0/moe_in": [40, 8]}}
    with pytest.raises(GuidanceError, match=r"step-000002: a part coded at rates \{'0/moe_in': \[32, 8\]\}"):
        x, traj = rows(seed=15)
        other = CaptureRecords({(0, "moe_in"): encode_table(table_from(x, traj + 100), Rate(32, 8))})
        writer = StepWriter(store, rl_step=2, policy_version=1, top_k=1)
        writer.add(records)
        writer.add(other)
    with pytest.raises(
        GuidanceError, match=r"rates \{'0/moe_in': \[48, 8\]\} given for guidance/step-000003 are not its"
    ):
        write_step(store, records, rl_step=3, policy_version=1, top_k=1, syndrome={"rates": {"0/moe_in": [48, 8]}})
    key = "guidance/step-000001/manifest.json"
    for recorded, error in (
        ({"0/moe_in": [48, 8]}, "shard-00000.bin: layer 0 moe_in has code_bits 40, the step's manifest records 48"),
        ({"0/moe_in": [40, 16]}, "shard-00000.bin: layer 0 moe_in has scale_bits 8, the step's manifest records 16"),
        ({}, "shard-00000.bin: layer 0 moe_in is syndrome-coded; the step's manifest records no rate for it"),
    ):
        forged = {**manifest, "syndrome": {"rates": recorded}}
        forged["sha256"] = _manifest_digest(forged)  # a consistent forgery: only the rates disagree
        store.put_bytes(key, json.dumps(forged).encode())
        with pytest.raises(GuidanceError, match=error):
            list(GuidanceLoader(store, 1, [[0]]))
        with pytest.raises(GuidanceError, match=error):
            list(iter_step_tables(store, 1))


def test_compact_parity_layout():
    # parity bits travel packed LSB first, as R-1 codes do
    bits = torch.tensor([[1, 0, 0, 0, 0, 0, 0, 1, 1, 0, 0, 0, 0, 0, 0, 0]], dtype=torch.uint8)
    assert compact_codes(bits, 1).tolist() == [[0b1000_0001, 0b1]]


def test_rounds_decode_inline_and_the_next_round_chooses_its_rates(tmp_path):
    from tracefp4.components import steps
    from tracefp4.components.guidance import read_manifest
    from tracefp4.schemas import get_preset

    data = get_preset("smoke").model_dump()
    data["bootstrap"]["enabled"] = False
    data["guidance"].update(codec="syndrome", syndrome_rate=0.25)
    data["train"]["precision"] = "fp32_master"  # the smoke policy rolls out in float32: a bf16 trainer disagrees more
    data["store"]["uri"] = (tmp_path / "store").as_uri()
    config = steps.RunConfig.model_validate(data)
    steps.prepare(config, tmp_path / "p0", "run", tmp_path / "s0")
    first = steps.run_round(
        config, tmp_path / "p0", tmp_path / "s0", 0, tmp_path / "p1", tmp_path / "s1", tmp_path, "run"
    )
    store = open_store(config.store.uri)
    prefix = steps.store_prefix(config, "run", "guidance")
    m0, decoded = read_manifest(store, 0, prefix), steps.read_decode_stats(store, prefix, 0)  # round 1's train deletes
    second = steps.run_round(
        config, tmp_path / "p1", tmp_path / "s1", 1, tmp_path / "p2", tmp_path / "s2", tmp_path, "run"
    )
    # the experts of the routed rows: 16 bits for each of a token's top_k moe_down_in rows, per element it has at
    # a layer's sites (moe_in, moe_down_in, k_cache, v_cache); 0.125 bit at the smoke preset's sizes
    cfg = PRESETS["smoke"]
    per_token = cfg.hidden_size + cfg.top_k * cfg.moe_intermediate_size + 2 * cfg.num_kv_heads * cfg.head_dim
    routing = 16 * cfg.top_k / per_token
    for row in first + second:
        assert row["guidance_decode_blocks"] > 0 and row["guidance_decode_failures"] == 0
        assert row["guidance_coverage"] == 1.0 and row["guidance_bits_per_element"] <= 0.35 + routing
    m1 = read_manifest(store, 1, prefix)
    assert m0["codec"] == ["syndrome"] and m0["syndrome"]["previous_decode"] is None
    assert all(rate == [48, 16] for rate in m0["syndrome"]["rates"].values())
    # the smoke model's training side agrees with its rollout: round 1 needs (and pays) far less
    assert decoded is not None and m1["syndrome"]["previous_decode"] == decoded
    assert all(code < 48 for code, _ in m1["syndrome"]["rates"].values())
    assert second[0]["guidance_bits_per_element"] < first[0]["guidance_bits_per_element"]


def test_the_evaluations_discrepancy_guides_with_the_runs_codec(monkeypatch):
    """The evaluation measured a syndrome run's training path under exact R-1
    guidance (compacted bits), not the parity-coded guidance that run trains
    with, decoded in its forward."""
    from tracefp4.components import evaluation, steps
    from tracefp4.components.model import build_model
    from tracefp4.components.tokenizer import build_tokenizer
    from tracefp4.schemas import load_config

    config = load_config(None, preset="smoke", overrides={"guidance.codec": "syndrome", "guidance.bits": 1})
    written, real = [], evaluation.write_step
    monkeypatch.setattr(evaluation, "write_step", lambda store, records, **kw: written.append(records) or real(
        store, records, **kw))  # fmt: skip
    tokenizer = build_tokenizer()
    prompts = steps.encode_prompts(config, tokenizer, steps.problems(config)[1][:2])
    quant = steps.rollout_quant(config, "fp4_wa_kv")
    out = evaluation._discrepancy(
        config, build_model("smoke"), "fp4_wa_kv", quant, tokenizer, prompts, sensitivity=False
    )
    ((records,),) = [written]
    assert records.tables and all(isinstance(t, SyndromeTable) for t in records.tables.values())
    assert 0 <= out["discrepancy"]["code_mismatch"] < 0.5  # measured through the decoding forward


def test_blocks_needing_every_tier_decode_exactly():
    # flips at reliability ranks up to 50: solved with 8, 24 or all 56 unknowns
    truth, reliability = blocks(nb=300, seed=4)
    rank = reliability.argsort(1).argsort(1)
    g = torch.Generator().manual_seed(5)
    deepest = torch.randint(0, 50, (300, 1), generator=g)
    flips = ((rank == deepest) | (rank == deepest // 2)).to(torch.uint8)
    h = parity_matrix(64, 256, 1)
    bits, ok, needed = solve_erasures(truth ^ flips, reliability, syndrome(truth, h), h, 56)
    assert ok.all() and torch.equal(bits, truth)
    assert torch.equal(needed, deepest[:, 0] + 1) and (needed > 24).sum() > 50 and (needed <= 8).sum() > 20


def test_code_side_information_is_the_round_to_nearest_low_bit():
    from tracefp4.kernels import code_side_info

    g = torch.Generator().manual_seed(6)
    x = torch.randn(500, 256, generator=g) * 3
    for fmt in ("nvfp4", "mxfp4"):
        gs = torch.tensor(x.abs().max().item() / (6 * 448)) if fmt == "nvfp4" else None
        q = quantize(x, fmt, global_scale=gs)
        low, distance = code_side_info(x, get_format(fmt), q.scales, gs)
        assert (low == (unpack_nibbles(q.codes) & 1)).float().mean() > 0.99999
        assert (distance >= 0).all() and torch.isfinite(distance).all()
        # a value moved by less than its distance keeps its low bit
        nudged, _ = code_side_info(x + 0.9 * distance * x.abs().amax(1, keepdim=True), get_format(fmt), q.scales, gs)
        assert (nudged == low).float().mean() > 0.999


def test_code_side_information_at_ties_and_saturation():
    from tracefp4.kernels import code_side_info

    # one NVFP4 block whose unit is 1 (scale 1.0 as E4M3 0x38, global scale 1): values are E2M1 magnitudes
    boundaries = [0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0]
    x = torch.tensor([[*boundaries, 0.0, 0.5, 1.6, 2.2, 4.4, 6.0, 7.5, -5.0, -0.7]])
    one = torch.tensor([[0x38]], dtype=torch.uint8).view(torch.float8_e4m3fn)
    low, distance = code_side_info(x, get_format("nvfp4"), one, torch.tensor(1.0))
    assert low[0, :7].tolist() == [0] * 7 and distance[0, :7].tolist() == [0.0] * 7  # ties: the even code, no margin
    # 0 -> 0, 0.5 -> 1, 1.6 -> 1.5 (3), 2.2 -> 2 (4), 4.4 -> 4 (6), 6 and 7.5 -> 6 (7), -5 -> 4 (tie), -0.7 -> 0.5
    assert low[0, 7:].tolist() == [0, 1, 1, 0, 0, 1, 1, 0, 1]
    margins = torch.tensor([0.25, 0.25, 0.15, 0.3, 0.6, 1.0, 1.0, 0.0, 0.05]) / 7.5  # relative to the row's amax
    assert torch.allclose(distance[0, 7:], margins, atol=1e-6)


def test_syndrome_words_are_the_matrix_product():
    from tracefp4.kernels.syndrome import syndrome_words

    g = torch.Generator().manual_seed(7)
    for n, rows in ((256, 64), (16, 16), (24, 8), (13, 40), (1, 8)):  # whole and partial bytes, up to 64 rows
        bits = torch.randint(0, 2, (50, n), generator=g, dtype=torch.uint8)
        h = parity_matrix(rows, n, 1)
        product = (bits.float() @ h.float().T).long() & 1
        assert torch.equal(syndrome(bits, h), product.to(torch.uint8))
        assert torch.equal(syndrome_words(bits, h), (product << torch.arange(rows)).sum(1))


def test_training_under_syndrome_guidance_routes_as_the_rollout():
    from tracefp4.components.guidance import MicrobatchGuidance
    from tracefp4.components.qat import TrainingSites
    from tracefp4.components.quant_config import rollout_config

    n = 6  # trajectory 7's positions 0..5, two slots each
    traj, pos = torch.full((2 * n,), 7), torch.arange(n).repeat_interleave(2)
    slot = torch.arange(2).repeat(n)
    rollout = torch.tensor([[3, 1], [0, 2], [5, 4], [1, 0], [2, 3], [4, 5]])
    table = SyndromeTable(
        0, "moe_down_in", "nvfp4", 16, 1.0, traj, pos, slot, rollout.flatten(), 1, Rate(16, 8), *[torch.empty(0)] * 2
    )
    own = torch.zeros(2 * 8, 2, dtype=torch.long)  # 2 sequences of 8 positions; trajectory 7 is the second
    guidance = MicrobatchGuidance([3, 7], {(0, "moe_down_in"): table}, [])
    sites = TrainingSites(rollout_config("fp4_wa_kv"), "trace", {}, trajectories=[3, 7], seq_len=8, guidance=guidance)
    chosen = sites.routing(0, own)
    assert torch.equal(chosen[8:14], rollout) and (chosen[:8] == 0).all() and (chosen[14:] == 0).all()
    assert sites.routing(1, own) is own  # no guidance for layer 1: the router's own choice
    qat = TrainingSites(rollout_config("fp4_wa_kv"), "qat", {}, trajectories=[3, 7], seq_len=8)
    assert qat.routing(0, own) is own


def test_least_reliable_positions_are_chosen_by_value():
    # the solver compares reliabilities as int32 bit patterns: the same order as the float values it is given
    values = torch.tensor([-torch.inf, 0.0, 1e-30, 1e-3, 0.5, 1.0, 3.0, 1e30, torch.inf])
    keys = values.view(torch.int32)
    assert torch.equal(keys.argsort(), values.argsort())
    truth, reliability = blocks(nb=50)
    flips = (reliability < 0.02).to(torch.uint8)
    h = parity_matrix(32, 256, 1)
    with pytest.raises(ValueError, match="float32"):
        solve_erasures(truth ^ flips, reliability.double(), syndrome(truth, h), h, 24)
    bits, ok, _ = solve_erasures(truth ^ flips, reliability.mul(1e-20), syndrome(truth, h), h, 24)  # tiny values too
    assert ok.all() and torch.equal(bits, truth)


def test_no_unknowns_is_the_check_alone():
    truth, reliability = blocks(nb=40)
    h = parity_matrix(16, 256, 1)
    guess = truth.clone()
    guess[::2, 0] ^= 1  # every other block disagrees once
    bits, ok, needed = solve_erasures(guess, reliability, syndrome(truth, h), h, 0)
    assert torch.equal(ok, torch.arange(40) % 2 == 1) and torch.equal(bits, guess) and (needed == 0).all()


@pytest.mark.parametrize("width", [64, 256, 1024])
def test_a_table_of_no_rows_codes_and_decodes_to_nothing(width):
    x, traj = rows(n=0, width=width)
    coded = encode_table(table_from(x, traj), first_rate(0.25))
    scales, low, ok, stats = decode(coded, x, torch.zeros(0, dtype=torch.bool))
    assert coded.code_parity.shape[0] == 0 and low.shape == (0, width) and ok.shape == (0,) and stats.blocks == 0


def test_workers_of_other_codecs_do_not_merge(tmp_path):
    from tracefp4.components.guidance import compact, merge_steps

    x, traj = rows(n=34)
    bits = compact(CaptureRecords({(0, "moe_in"): table_from(x[:17], traj[:17])}), 1, [0])  # R-1, as syndrome
    coded = CaptureRecords({(0, "moe_in"): encode_table(table_from(x[17:], traj[17:]), Rate(40, 8))})
    store = open_store(str(tmp_path))
    for worker, records in enumerate((bits, coded)):
        write_step(store, records, rl_step=0, policy_version=0, top_k=1, prefix=f"capture/worker-{worker}")
    with pytest.raises(GuidanceError, match=r"differs from capture/worker-0's in \['codec'\]"):
        merge_steps(store, 0, ["capture/worker-0", "capture/worker-1"], "capture")
