"""fake_quantize: FP4 and FP8 values in the input's dtype, straight-through gradient."""

import math

import pytest
import torch

from tracefp4.kernels import dequantize, fake_quantize, quantize


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
