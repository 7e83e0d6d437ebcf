"""Guided rounding: the paper's examples, and the local guarantee that a guided
training value is never farther from the rollout's than round-to-nearest."""

import math

import numpy as np
import pytest
import spec_model
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tracefp4.kernels import (
    HAS_TRITON,
    Guidance,
    compact_codes,
    dequantize,
    fake_quantize,
    get_format,
    quantize,
    reference,
    unpack_codes,
)


def block_with(value: float, amax: float, size: int = 16) -> torch.Tensor:
    row = torch.zeros(1, size)
    row[0, 0], row[0, 1] = value, amax
    return row


def rtn_under(x: torch.Tensor, guide: Guidance) -> torch.Tensor:
    """Dequantized RTN of x under the rollout's scales: what guided rounding replaces."""
    f = get_format(guide.fmt)
    units = reference.scale_units(f, guide.scales, guide.global_scale).unsqueeze(-1)
    y = reference.blocked(x.float(), f.block_size) / units
    return (reference.e2m1_decode(reference.e2m1_encode(y)) * units).reshape(x.shape)


@pytest.mark.parametrize("bits", [1, 2, 3, 4])
def test_paper_amplification_example(bits):
    # block amax 144 under global scale 1 gives block scale e4m3(144 / 6) = 24
    rollout = quantize(block_with(59.76, 144.0), "nvfp4", global_scale=1.0)
    assert rollout.scales.float()[0, 0].item() == 24.0
    guide = Guidance.from_rollout(rollout, bits)
    train = block_with(60.24, 144.0)
    # 60.24 / 24 = 2.51 and 59.76 / 24 = 2.49 straddle the 2/3 boundary: RTN gives 3 and 2
    rtn = rtn_under(train, guide)
    assert rtn[0, 0].item() == 3 * 24 and dequantize(rollout)[0, 0].item() == 2 * 24
    guided = quantize(train, "nvfp4", guide=guide)
    assert unpack_codes(guided)[0, 0] == unpack_codes(rollout)[0, 0] == 0b0100
    assert dequantize(guided)[0, 0].item() - dequantize(rollout)[0, 0].item() == 0.0


@pytest.mark.parametrize("bits", [1, 4])
def test_quads_counterexample_needs_no_correction(bits):
    # train 2.40 and rollout 2.49 both round to 2: plain FP4 has no discrepancy, and guidance keeps it so
    rollout = quantize(block_with(2.49, 6.0), "nvfp4", global_scale=1.0)
    train = block_with(2.40, 6.0)
    guide = Guidance.from_rollout(rollout, bits)
    assert rtn_under(train, guide)[0, 0].item() == dequantize(rollout)[0, 0].item() == 2.0
    assert dequantize(quantize(train, "nvfp4", guide=guide))[0, 0].item() == 2.0


@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4"])
@pytest.mark.parametrize("bits", [1, 2, 3, 4])
def test_identical_values_reproduce_the_rollout_codes(fmt, bits):
    x = torch.randn(4, 64, generator=torch.Generator().manual_seed(bits))
    rollout = quantize(x, fmt)
    guided = quantize(x, fmt, guide=Guidance.from_rollout(rollout, bits))
    assert torch.equal(guided.codes, rollout.codes)


def test_rtn_breaks_ties_where_guidance_is_silent():
    # 1.25 sits between 1 (0b0010) and 1.5 (0b0011); two-bit guidance 0b00 matches neither
    rollout = quantize(block_with(0.0, 6.0), "nvfp4", global_scale=1.0)
    guide = Guidance.from_rollout(rollout, 2)
    assert dequantize(quantize(block_with(1.3, 6.0), "nvfp4", guide=guide))[0, 0].item() == 1.5


def test_the_guarantee_is_local():
    """With k < 4 the low bits only tell the two neighbours apart. A rollout code
    two codewords away can share the far neighbour's low bit: one bit then points
    the wrong way (the paper reports > 99% of mismatches are one codeword apart)."""
    rollout = quantize(block_with(0.5, 6.0), "nvfp4", global_scale=1.0)  # code 0b0001
    train = block_with(1.3, 6.0)  # neighbours 1.0 (0b0010) and 1.5 (0b0011); RTN gives 1.5
    one_bit = dequantize(quantize(train, "nvfp4", guide=Guidance.from_rollout(rollout, 1)))[0, 0].item()
    full = dequantize(quantize(train, "nvfp4", guide=Guidance.from_rollout(rollout, 4)))[0, 0].item()
    assert (one_bit, full) == (1.5, 1.0)


def _rollout_and_train(seed: int, fmt: str, spread: float, near: bool):
    g = torch.Generator().manual_seed(seed)
    block = get_format(fmt).block_size
    rollout_x = torch.randn(4, 2 * block, generator=g) * spread * torch.rand(4, 1, generator=g)
    rollout_x[0, :block] = 0.0  # an all-zero rollout block
    rollout = quantize(rollout_x, fmt)
    if near:  # |train - rollout| < 1/4 of a unit: the rollout code is one of the two neighbours
        units = reference.scale_units(get_format(fmt), rollout.scales, rollout.global_scale)
        units = units.repeat_interleave(block, -1)
        nudge = (torch.rand(rollout_x.shape, generator=g) * 2 - 1) * 0.2499 * units
        train_x = rollout_x + torch.where(units.isfinite(), nudge, 0.0)
    else:
        train_x = torch.randn(rollout_x.shape, generator=g) * spread
    return rollout, train_x


def _assert_never_worse_than_rtn(rollout, train_x, bits):
    guide = Guidance.from_rollout(rollout, bits)
    target = dequantize(rollout)
    guided = dequantize(quantize(train_x, rollout.fmt, guide=guide))
    rtn = rtn_under(train_x, guide)
    assert ((guided - target).abs() <= (rtn - target).abs()).all()


@settings(max_examples=60, deadline=None)
@given(
    seed=st.integers(0, 2**31 - 1),
    fmt=st.sampled_from(["nvfp4", "mxfp4"]),
    bits=st.sampled_from([1, 2, 3, 4]),
    spread=st.sampled_from([1e-3, 1.0, 50.0, 1e5]),
)
def test_guided_is_never_worse_than_rtn_when_the_rollout_is_a_neighbour(seed, fmt, bits, spread):
    _assert_never_worse_than_rtn(*_rollout_and_train(seed, fmt, spread, near=True), bits)


@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 2**31 - 1), fmt=st.sampled_from(["nvfp4", "mxfp4"]), spread=st.sampled_from([1.0, 1e3]))
def test_full_guidance_is_never_worse_than_rtn_for_any_rollout(seed, fmt, spread):
    _assert_never_worse_than_rtn(*_rollout_and_train(seed, fmt, spread, near=False), 4)


@settings(max_examples=40, deadline=None)
@given(
    rollout_values=st.lists(st.floats(-8.0, 8.0, width=32), min_size=15, max_size=15),
    nudges=st.lists(st.floats(-0.2490234375, 0.2490234375, width=32), min_size=15, max_size=15),
    bits=st.sampled_from([1, 2, 3, 4]),
)
def test_guided_on_exact_grid_values_and_ties(rollout_values, nudges, bits):
    # unit 1 (amax 6, global scale 1): hypothesis reaches midpoints and grid points directly
    rollout_x = torch.tensor([rollout_values + [6.0]])
    train_x = rollout_x + torch.tensor([nudges + [0.0]])
    rollout = quantize(rollout_x, "nvfp4", global_scale=1.0)
    _assert_never_worse_than_rtn(rollout, train_x, bits)


def edge_values() -> list[float]:
    """Where guided rounding's candidates change, in units of the rollout's
    scale: every codeword and rounding midpoint of both signs with the float32
    values either side of each, +-0, the smallest float32s, values beyond 6,
    +-Inf and NaN."""
    points = [*spec_model.E2M1, 0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 7.0, 1e30, 1e-30, 2.0**-126, 2.0**-149]
    values = {0.0, -0.0, math.inf, -math.inf}
    for p in np.float32(points):
        for v in (p, -p):
            values |= {float(v), float(np.nextafter(v, np.float32(math.inf))), float(np.nextafter(v, -np.inf))}
    return sorted(values) + [math.nan]


EDGE_UNITS = [  # (format, scale byte, global scale): units 1 and 2^-29 (NVFP4's smallest, subnormal E4M3 scale)
    ("nvfp4", 0x38, 1.0),
    ("nvfp4", 0x01, 2.0**-20),
    ("mxfp4", 127, None),
    ("mxfp4", 98, None),
]


def edge_case(fmt: str, scale: int, global_scale: float | None, bits: int):
    """Rows of :func:`edge_values` times the unit, row c guided by rollout code c
    (every code, both signs), and that guidance under the given block scales."""
    f = get_format(fmt)
    y = torch.tensor(edge_values(), dtype=torch.float32)
    y = torch.cat([y, torch.zeros(-len(y) % f.block_size)])
    scales = torch.full((16, len(y) // f.block_size), scale, dtype=torch.uint8).view(f.scale_dtype)
    g = None if global_scale is None else torch.tensor(global_scale)
    unit = reference.scale_units(f, scales[:1, :1], g).item()
    x = (y * unit).expand(16, -1).contiguous()
    rollout = torch.arange(16, dtype=torch.uint8)[:, None].expand(x.shape)
    return x, Guidance(compact_codes(rollout.contiguous(), bits), bits, scales, g, fmt, x.shape), unit


@pytest.mark.parametrize("fmt,scale,global_scale", EDGE_UNITS)
@pytest.mark.parametrize("bits", [1, 2, 3, 4])
def test_guided_rounding_is_the_documented_rule_at_every_edge(fmt, scale, global_scale, bits):
    """Codes, element by element, equal the independent model's rule
    (``spec_model.e2m1_guided``): at each codeword, midpoint and the float32
    values beside them, signed zeros, subnormal inputs and units, saturation,
    Inf and NaN, for every rollout code under every R-k guidance."""
    x, guide, unit = edge_case(fmt, scale, global_scale, bits)
    codes = unpack_codes(quantize(x, fmt, guide=guide))
    ys = (x.numpy() / np.float32(unit)).astype(np.float32)  # what the rule rounds: x / unit in float32
    expected = [[spec_model.e2m1_guided(float(y), rollout, bits) for y in row] for rollout, row in enumerate(ys)]
    assert codes.tolist() == expected


@pytest.mark.skipif(not HAS_TRITON, reason="triton is not installed on this platform")
@pytest.mark.parametrize("fmt,scale,global_scale", EDGE_UNITS)
def test_triton_guided_rounding_equals_the_reference_at_every_edge(fmt, scale, global_scale):
    """The Triton kernel (the interpreter without a GPU) gives the reference's
    codes and values, bit for bit, on the same edges and guidance."""
    from tracefp4.kernels import triton_kernels

    f = get_format(fmt)
    for bits in (1, 2, 3, 4):
        x, guide, _ = edge_case(fmt, scale, global_scale, bits)
        args = (x, f, guide.scales, guide.global_scale, guide.codes(), bits)
        assert torch.equal(triton_kernels.quantize_guided(*args), reference.quantize_guided(*args))
        values, expected = triton_kernels.fake_quantize_guided(*args), reference.fake_quantize_guided(*args)
        assert torch.equal(values.isnan(), expected.isnan())
        assert torch.equal(values.nan_to_num().view(torch.int32), expected.nan_to_num().view(torch.int32))


def test_fake_quantize_with_guidance_matches_guided_quantize():
    x = torch.randn(4, 64, generator=torch.Generator().manual_seed(3))
    rollout = quantize(x * 1.01, "nvfp4")
    guide = Guidance.from_rollout(rollout, 1)
    assert torch.equal(fake_quantize(x, "nvfp4", guide=guide), dequantize(quantize(x, "nvfp4", guide=guide)))


class TestGuideErrors:
    def test_wrong_shape(self):
        guide = Guidance.from_rollout(quantize(torch.ones(2, 32), "nvfp4"), 1)
        with pytest.raises(ValueError, match=r"guidance covers shape \(2, 32\), input has shape \(4, 32\)"):
            quantize(torch.ones(4, 32), "nvfp4", guide=guide)

    def test_wrong_format(self):
        guide = Guidance.from_rollout(quantize(torch.ones(2, 32), "mxfp4"), 1)
        with pytest.raises(ValueError, match="guidance is mxfp4, but nvfp4 was asked for"):
            quantize(torch.ones(2, 32), "nvfp4", guide=guide)

    def test_scales_come_from_the_rollout(self):
        guide = Guidance.from_rollout(quantize(torch.ones(2, 32), "nvfp4"), 1)
        with pytest.raises(ValueError, match="uses the rollout's scales"):
            quantize(torch.ones(2, 32), "nvfp4", guide=guide, global_scale=1.0)

    def test_bits(self):
        with pytest.raises(ValueError, match=r"guidance bits must be one of \(1, 2, 3, 4\), got 5"):
            Guidance.from_rollout(quantize(torch.ones(2, 32), "nvfp4"), 5)
