"""fake_quantize: FP4 and FP8 values in the input's dtype, straight-through gradient."""

import math

import pytest
import torch

from tracefp4.kernels import (
    Guidance,
    code_values,
    dequantize,
    fake_quantize,
    per_token_global_scale,
    quantize,
    unpack_codes,
)


@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_values_are_the_dequantized_codes(fmt, dtype):
    x = torch.randn(4, 64, generator=torch.Generator().manual_seed(0)).to(dtype)
    out = fake_quantize(x, fmt)
    assert out.dtype == dtype
    assert torch.equal(out, dequantize(quantize(x, fmt)).to(dtype))


@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4", "fp8"])
def test_straight_through_gradient(fmt):
    x = torch.randn(2, 64, requires_grad=True)
    upstream = torch.randn(2, 64)
    (fake_quantize(x, fmt) * upstream).sum().backward()
    assert torch.equal(x.grad, upstream)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("bits", [1, 4])
def test_guided_straight_through_gradient_is_the_identity_everywhere(dtype, bits):
    """The guided fake quantization's backward is the documented estimator, the
    identity, not clipped: also where training's values lie beyond the
    rollout's range (saturated to +-6 units of its scale), far below it, or are
    Inf, NaN or -0; in bf16 the gradient is bf16 and exactly the upstream one.
    The forward is the guided codes' values in ``x``'s dtype, NaN kept."""
    gen = torch.Generator().manual_seed(bits)
    rollout = quantize(torch.randn(4, 64, generator=gen), "nvfp4", global_scale=0.01)
    x = (torch.randn(4, 64, generator=gen) * torch.tensor([1.0, 8.0, 1e-3, 1.0])[:, None]).to(dtype)
    x[3, :4] = torch.tensor([math.inf, -math.inf, math.nan, -0.0], dtype=dtype)
    x.requires_grad_(True)
    upstream = torch.randn(4, 64, generator=gen).to(dtype)
    guide = Guidance.from_rollout(rollout, bits)
    out = fake_quantize(x, "nvfp4", guide=guide)
    (out * upstream).sum().backward()
    assert out.dtype == x.grad.dtype == dtype
    assert torch.equal(x.grad, upstream)
    guided = quantize(x.detach(), "nvfp4", guide=guide)
    assert ((unpack_codes(guided)[1] & 7) == 7).float().mean() > 0.5  # most of row 1 saturated
    assert torch.equal(out.detach().isnan(), x.detach().isnan())
    assert torch.equal(out.detach().nan_to_num(), dequantize(guided).to(dtype).nan_to_num())


def test_fp8_per_token_values_lie_on_the_e4m3_grid():
    x = torch.randn(8, 64, generator=torch.Generator().manual_seed(1)) * torch.logspace(-3, 3, 8)[:, None]
    out = fake_quantize(x, "fp8")
    scale = x.abs().amax(-1, keepdim=True) / 448
    on_grid = (out / scale).to(torch.float8_e4m3fn).float() * scale
    assert torch.equal(out, on_grid)
    assert torch.equal(out.abs().amax(-1), x.abs().amax(-1))  # the row maximum is exact
    rel = ((out - x).abs() / x.abs().clamp_min(1e-12 * scale)).max()
    assert rel <= 2**-4  # three mantissa bits


def test_fp8_per_block_and_special_rows():
    x = torch.randn(3, 64)
    x[1] = 0.0
    x[2, 5] = math.nan
    out = fake_quantize(x, "fp8", block_size=32)
    assert (out[1] == 0).all() and not out[0].isnan().any()
    assert out[2, :32].isnan().all() and not out[2, 32:].isnan().any()  # NaN stays in its block
    left = fake_quantize(x[:1, :32], "fp8")
    assert torch.equal(out[:1, :32], left)  # a block is quantized on its own


def test_fp8_block_size_errors():
    with pytest.raises(ValueError, match="fp8 block_size 24 does not divide the last dimension 64"):
        fake_quantize(torch.ones(1, 64), "fp8", block_size=24)
    with pytest.raises(ValueError, match="block_size applies to fp8 only"):
        fake_quantize(torch.ones(1, 64), "nvfp4", block_size=16)


@pytest.mark.parametrize("bits", [1, 4])
def test_guided_rounding_under_per_token_global_scales_reproduces_the_rollout(bits):
    """The rollout quantizes with per-token global scales; training, whose values
    differ a little (so its own per-token amax differs too), rounds under the
    rollout's per-row global and block scales to the rollout's codes wherever
    the rollout's code is one of its two neighbours."""
    gen = torch.Generator().manual_seed(7)
    rollout_x = torch.randn(6, 64, generator=gen) * torch.logspace(-2, 2, 6)[:, None]
    rollout = quantize(rollout_x, "nvfp4", global_scale=per_token_global_scale(rollout_x))
    guide = Guidance.from_rollout(rollout, bits)
    assert guide.global_scale.shape == (6, 1)
    assert torch.equal(quantize(rollout_x, "nvfp4", guide=guide).codes, rollout.codes)

    train_x = rollout_x * (1 + 0.02 * torch.randn(6, 64, generator=gen))
    guided = quantize(train_x, "nvfp4", guide=guide)
    assert torch.equal(guided.global_scale, rollout.global_scale) and torch.equal(
        guided.scales.view(torch.uint8), rollout.scales.view(torch.uint8)
    )
    # the neighbours of each training value under the rollout's units
    units = (rollout.scales.float() * rollout.global_scale).repeat_interleave(16, -1)
    y = train_x / units
    grid = code_values(torch.arange(16, dtype=torch.uint8))
    lower = torch.where(grid[None, None, :] <= y[..., None], grid, -math.inf).amax(-1)
    upper = torch.where(grid[None, None, :] >= y[..., None], grid, math.inf).amin(-1)
    rollout_values = code_values(unpack_codes(rollout))
    neighbour = (rollout_values == lower) | (rollout_values == upper)
    same = code_values(unpack_codes(guided)) == rollout_values
    assert neighbour.float().mean() > 0.9
    assert same[neighbour].all()
    rtn = quantize(train_x, "nvfp4", global_scale=per_token_global_scale(train_x))
    assert (code_values(unpack_codes(rtn)) * rtn.global_scale != rollout_values * rollout.global_scale).any()
    values = fake_quantize(train_x, "nvfp4", guide=guide)
    assert torch.equal(values, dequantize(guided))


def test_guidance_with_a_global_scale_of_another_shape_is_refused():
    x = torch.randn(4, 32)
    q = quantize(x, "nvfp4", global_scale=per_token_global_scale(x))
    bad = Guidance(q.codes[:2], 4, q.scales[:2], q.global_scale, "nvfp4", torch.Size((2, 32)))
    with pytest.raises(ValueError, match=r"global scale must be a scalar or one per row \(2, 1\), got \(4, 1\)"):
        quantize(x[:2], "nvfp4", guide=bad)
