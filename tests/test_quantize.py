"""quantize/dequantize against the spec: exact encodings one value at a time,
agreement with an independent model on varied inputs, special values, errors."""

import math
import re

import pytest
import spec_model
import torch

from tracefp4.kernels import FP4Tensor, dequantize, fake_quantize, per_token_global_scale, quantize, unpack_codes
from tracefp4.kernels.formats import E2M1_ENCODINGS, E2M1_VALUES, E4M3_ENCODINGS


def unit_block(values, block=16):
    """A block whose NVFP4 unit is exactly 1 under global scale 1: its amax is 6."""
    row = torch.zeros(block)
    row[: len(values)] = torch.tensor(values, dtype=torch.float32)
    row[-1] = 6.0
    return row


@pytest.mark.parametrize("value,code", E2M1_ENCODINGS)
def test_e2m1_encodings(value, code):
    q = quantize(unit_block([value]).unsqueeze(0), "nvfp4", global_scale=1.0)
    assert q.scales.view(torch.uint8).item() == 0x38  # scale 1.0
    assert unpack_codes(q)[0, 0].item() == code


@pytest.mark.parametrize(
    "value,rounded",
    [(0.25, 0.0), (0.75, 1.0), (1.25, 1.0), (1.75, 2.0), (2.5, 2.0), (3.5, 4.0), (5.0, 4.0), (5.01, 6.0)],
)
def test_ties_go_to_the_even_code(value, rounded):
    for sign in (1, -1):
        q = quantize(unit_block([sign * value]).unsqueeze(0), "nvfp4", global_scale=1.0)
        assert dequantize(q)[0, 0].item() == sign * rounded


def test_e2m1_encode_of_every_float32_exponent_and_leading_mantissa_bits():
    """The reference encodes float32 by a table over its top 11 bits: every such
    bucket, at its start, just inside, in the middle and at its end, both signs,
    NaN and Inf included, against the independent model."""
    from tracefp4.kernels.reference import e2m1_encode

    keys = torch.arange(1 << 11, dtype=torch.int64) << 21
    bits = torch.stack([keys, keys | 1, keys | 0x100000, keys | 0x1FFFFF], -1).flatten()
    y = bits.to(torch.int32).view(torch.float32)  # int64 -> int32 wraps the sign bit in
    assert y.isnan().any() and y.isinf().any() and (y == 0.25).any() and (y == -5.0).any()
    assert e2m1_encode(y).tolist() == [spec_model.e2m1_encode(v) for v in y.tolist()]


def test_mxfp4_elements_saturate_at_6():
    # amax 7.9: scale 2^(floor(log2 7.9) - 2) = 1, so 7.9 itself lies beyond the grid
    x = torch.full((1, 32), 7.9)
    assert dequantize(quantize(x, "mxfp4")).unique().tolist() == [6.0]


def test_rceil_near_the_float32_limit_rounds_beyond_it():
    # docs/fp4-formats.md, "Special values": amax 3e38 gets scale 2^126 under
    # rceil, and 3e38 / 2^126 = 3.53 rounds to the codeword 4: 2^128 is Inf in
    # float32; floor takes scale 2^125 and saturates the element at 6
    x = torch.zeros(1, 32)
    x[0, 0] = 3e38
    assert dequantize(quantize(x, "mxfp4", scale_mode="rceil"))[0, 0].item() == math.inf
    assert dequantize(quantize(x, "mxfp4"))[0, 0].item() == 6 * 2.0**125


@pytest.mark.parametrize("value,bits", sorted(E4M3_ENCODINGS.items()))
def test_e4m3_block_scale_encodings(value, bits):
    # block amax 6 * value under global scale 1 makes the block scale exactly `value`
    q = quantize(torch.full((1, 16), 6.0 * value), "nvfp4", global_scale=1.0)
    assert q.scales.view(torch.uint8).item() == bits


def _inputs(kind: str, rows: int, cols: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(hash(kind) % 2**31)
    if kind == "normal":
        return torch.randn(rows, cols, generator=g) * 3
    if kind == "heavy":  # Student-t with 1.5 degrees of freedom: rare huge outliers
        normal = torch.randn(rows, cols, generator=g)
        chi = torch.distributions.Chi2(1.5).sample((rows, cols))
        return normal / (chi / 1.5).sqrt()
    if kind == "tiny":  # float32 subnormals and values near the E4M3 floor
        return torch.randn(rows, cols, generator=g) * torch.tensor([1e-40, 1e-30, 1e-3, 1.0]).repeat(rows // 4)[:, None]
    if kind == "ties":  # exact midpoints of the E2M1 grid at power-of-two units
        mids = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 6.0])
        idx = torch.randint(0, len(mids), (rows, cols), generator=g)
        sign = torch.randint(0, 2, (rows, cols), generator=g) * 2 - 1
        return mids[idx] * sign * 2.0 ** torch.randint(-4, 5, (rows, 1), generator=g)
    raise ValueError(kind)


@pytest.mark.parametrize("kind", ["normal", "heavy", "tiny", "ties"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_nvfp4_matches_the_independent_model(kind, dtype):
    x = _inputs(kind, 8, 64).to(dtype)
    q = quantize(x, "nvfp4")
    blocks = x.float().reshape(-1, 16).tolist()
    codes, scales, g = spec_model.nvfp4(blocks)
    assert q.global_scale.item() == g
    assert q.scales.view(torch.uint8).reshape(-1).tolist() == scales
    assert unpack_codes(q).reshape(-1, 16).tolist() == codes


@pytest.mark.parametrize("kind", ["normal", "heavy", "tiny", "ties"])
@pytest.mark.parametrize("scale_mode", ["floor", "rceil"])
def test_mxfp4_matches_the_independent_model(kind, scale_mode):
    x = _inputs(kind, 8, 64)
    q = quantize(x, "mxfp4", scale_mode=scale_mode)
    assert q.global_scale is None and q.scales.dtype == torch.uint8
    codes, scales = spec_model.mxfp4(x.reshape(-1, 32).tolist(), scale_mode)
    assert q.scales.reshape(-1).tolist() == scales
    assert unpack_codes(q).reshape(-1, 32).tolist() == codes


def test_nvfp4_with_a_given_global_scale_matches_the_model():
    x = _inputs("normal", 4, 32)
    q = quantize(x, "nvfp4", global_scale=0.01)
    codes, scales, _ = spec_model.nvfp4(x.reshape(-1, 16).tolist(), global_scale=0.01)
    assert q.scales.view(torch.uint8).reshape(-1).tolist() == scales
    assert unpack_codes(q).reshape(-1, 16).tolist() == codes


def test_layout_two_codes_per_byte_even_element_low():
    x = unit_block([1.0, -3.0, 0.5]).unsqueeze(0)  # codes 0b0010, 0b1101, 0b0001
    q = quantize(x, "nvfp4", global_scale=1.0)
    assert q.codes.shape == (1, 8) and q.codes.dtype == torch.uint8
    assert q.codes[0, 0].item() == 0b1101_0010
    assert q.codes[0, 1].item() == 0b0000_0001
    assert q.shape == x.shape and q.fmt == "nvfp4"


@pytest.mark.parametrize("fmt,min_sqnr_db", [("nvfp4", 18.0), ("mxfp4", 14.0)])
def test_round_trip_error_is_that_of_fp4(fmt, min_sqnr_db):
    x = torch.randn(64, 256, generator=torch.Generator().manual_seed(0))
    err = dequantize(quantize(x, fmt)) - x
    sqnr = 10 * math.log10(x.pow(2).mean() / err.pow(2).mean())
    assert min_sqnr_db < sqnr < 30.0


def test_dequantize_is_exactly_code_times_unit():
    x = torch.randn(4, 64, generator=torch.Generator().manual_seed(1))
    q = quantize(x, "nvfp4")
    grid = torch.tensor(E2M1_VALUES + tuple(-v for v in E2M1_VALUES))
    units = q.scales.float() * q.global_scale
    expected = grid[unpack_codes(q).long()].reshape(4, 4, 16) * units[..., None]
    assert torch.equal(dequantize(q), expected.reshape(4, 64))
    again = quantize(dequantize(q), "nvfp4", global_scale=q.global_scale)
    assert torch.equal(dequantize(again), dequantize(q))  # values on the grid stay put


class TestSpecialValues:
    def test_all_zero_blocks(self):
        q = quantize(torch.zeros(2, 32), "nvfp4")
        assert q.global_scale.item() == 1.0
        assert (q.scales.float() == 1.0).all() and (q.codes == 0).all()
        m = quantize(torch.zeros(2, 32), "mxfp4")
        assert (m.scales == 0).all() and (m.codes == 0).all()
        assert (dequantize(m) == 0).all()

    def test_nan_poisons_its_block_under_a_given_global_scale(self):
        x = torch.ones(2, 32)
        x[0, 3] = math.nan
        for fmt, kwargs, nan_scale in [("nvfp4", {"global_scale": 1.0}, 0x7F), ("mxfp4", {}, 0xFF)]:
            q = quantize(x, fmt, **kwargs)
            out = dequantize(q)
            assert q.scales.view(torch.uint8)[0, 0].item() == nan_scale
            assert out[0, : q.shape[-1] // q.scales.shape[-1]].isnan().all()
            assert not out[1].isnan().any()

    @pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf])
    def test_non_finite_with_the_default_global_scale_poisons_the_tensor(self, bad):
        x = torch.ones(2, 32)
        x[1, 5] = bad
        q = quantize(x, "nvfp4")
        assert q.global_scale.isnan()
        assert dequantize(q).isnan().all()

    def test_inf_saturates_at_the_largest_scale_under_a_given_global_scale(self):
        x = torch.ones(1, 16)
        x[0, 0], x[0, 1] = math.inf, -math.inf
        q = quantize(x, "nvfp4", global_scale=1.0)
        assert q.scales.view(torch.uint8).item() == 0x7E  # 448
        assert dequantize(q)[0, :2].tolist() == [6 * 448.0, -6 * 448.0]

    def test_inf_makes_an_mxfp4_block_nan(self):
        x = torch.ones(1, 32)
        x[0, 0] = math.inf
        q = quantize(x, "mxfp4")
        assert q.scales.item() == 0xFF and dequantize(q).isnan().all()

    def test_subnormal_inputs(self):
        x = torch.full((1, 32), 1e-42)
        q = quantize(x, "mxfp4")
        assert q.scales.item() == 0  # clamped to 2^-127
        assert torch.equal(dequantize(q), torch.zeros(1, 32))  # 1e-42 / 2^-127 < 0.25
        n = quantize(x, "nvfp4")  # the global scale underflows to 0, so it is 1.0
        assert n.global_scale.item() == 1.0 and (dequantize(n) == 0).all()

    def test_signs_of_zero(self):
        x = unit_block([-0.0, -0.1, 0.1]).unsqueeze(0)
        codes = unpack_codes(quantize(x, "nvfp4", global_scale=1.0))[0, :3].tolist()
        assert codes == [0b0000, 0b1000, 0b0000]  # -0.0 gives +0; a small negative gives -0


class TestErrors:
    def test_unknown_format(self):
        with pytest.raises(ValueError, match="unknown FP4 format 'fp5'"):
            quantize(torch.ones(1, 16), "fp5")

    def test_block_size(self):
        with pytest.raises(ValueError, match="multiple of 32"):
            quantize(torch.ones(2, 48), "mxfp4")

    def test_dtype(self):
        with pytest.raises(TypeError, match="float32 or bfloat16, got torch.float16"):
            quantize(torch.ones(1, 16, dtype=torch.float16), "nvfp4")

    def test_global_scale_misuse(self):
        with pytest.raises(ValueError, match="mxfp4 has no global scale"):
            quantize(torch.ones(1, 32), "mxfp4", global_scale=1.0)
        with pytest.raises(ValueError, match="positive and finite"):
            quantize(torch.ones(1, 16), "nvfp4", global_scale=0.0)
        quantize(torch.ones(1, 16), "nvfp4", global_scale=0.0, check_scale=False)  # the caller's word: not read back

    def test_scale_mode_misuse(self):
        with pytest.raises(ValueError, match="mxfp4 only"):
            quantize(torch.ones(1, 16), "nvfp4", scale_mode="rceil")
        with pytest.raises(ValueError, match="unknown MXFP4 scale mode 'even'"):
            quantize(torch.ones(1, 32), "mxfp4", scale_mode="even")


def test_fp4tensor_fields():
    q = quantize(torch.randn(3, 5, 64), "mxfp4")
    assert isinstance(q, FP4Tensor)
    assert q.codes.shape == (3, 5, 32) and q.scales.shape == (3, 5, 2)
    assert unpack_codes(q).shape == (3, 5, 64)


class TestPerTokenGlobalScale:
    """NVFP4 with one global scale per row: FlashInfer's per-token activation
    scales (SGLang ``nvfp4_online``), ``amax(row) / (6 * 448)``."""

    @pytest.mark.parametrize("kind", ["normal", "heavy", "tiny", "ties"])
    @pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
    def test_each_row_matches_the_model_with_its_own_amax(self, kind, dtype):
        x = _inputs(kind, 8, 64).to(dtype).reshape(2, 4, 64)
        g = per_token_global_scale(x)
        assert g.shape == (2, 4, 1) and g.dtype == torch.float32
        q = quantize(x, "nvfp4", global_scale=g)
        assert q.global_scale.shape == (2, 4, 1)
        for r, row in enumerate(x.float().reshape(8, 64)):
            # the model's default global scale of a one-row tensor is that row's amax / (6 * 448)
            codes, scales, row_g = spec_model.nvfp4(row.reshape(-1, 16).tolist())
            assert g.reshape(-1)[r].item() == row_g
            assert q.scales.view(torch.uint8).reshape(8, 4)[r].tolist() == scales
            assert unpack_codes(q).reshape(8, 4, 16)[r].tolist() == codes

    def test_dequantize_multiplies_each_row_by_its_own_scale(self):
        x = torch.randn(3, 32, generator=torch.Generator().manual_seed(5)) * torch.tensor([[1e-3], [1.0], [1e3]])
        q = quantize(x, "nvfp4", global_scale=per_token_global_scale(x))
        grid = torch.tensor(E2M1_VALUES + tuple(-v for v in E2M1_VALUES))
        units = q.scales.float() * q.global_scale  # [3, 2] * [3, 1]
        expected = grid[unpack_codes(q).long()].reshape(3, 2, 16) * units[..., None]
        assert torch.equal(dequantize(q), expected.reshape(3, 32))
        assert torch.equal(fake_quantize(x, "nvfp4", global_scale=q.global_scale), dequantize(q))
        # each row's largest value lands on +-6 at block scale 448: the row's own range, up to float32 rounding
        assert q.scales.float().amax(-1).tolist() == [448.0] * 3
        torch.testing.assert_close(dequantize(q).abs().amax(-1), x.abs().amax(-1), rtol=1e-6, atol=0)

    def test_special_rows(self):
        x = torch.ones(3, 16)
        x[0] = 0.0
        x[2, 4] = math.nan
        g = per_token_global_scale(x)
        assert g[:2, 0].tolist() == [1.0, float(torch.tensor(1.0) / 2688)] and math.isnan(g[2, 0])
        out = dequantize(quantize(x, "nvfp4", global_scale=g))
        assert (out[0] == 0).all() and (out[1] == 1).all() and out[2].isnan().all()

    def test_misuse(self):
        x = torch.ones(2, 3, 16)
        with pytest.raises(ValueError, match=r"scalar or one per row, shape \(2, 3, 1\).*got shape \(2, 1\)"):
            quantize(x, "nvfp4", global_scale=torch.ones(2, 1))
        with pytest.raises(ValueError, match=r"positive and finite .* got 0.0 at row \(1, 2\)"):
            g = torch.ones(2, 3, 1)
            g[1, 2] = 0.0
            quantize(x, "nvfp4", global_scale=g)
        with pytest.raises(ValueError, match="got inf"):
            quantize(x, "nvfp4", global_scale=torch.full((2, 3, 1), math.inf))
        with pytest.raises(ValueError, match="mxfp4 has no global scale"):
            quantize(torch.ones(2, 32), "mxfp4", global_scale=torch.ones(2, 1))
        with pytest.raises(TypeError, match="float32 or bfloat16"):
            per_token_global_scale(torch.ones(2, 16, dtype=torch.int32))


def test_scales_never_divide_by_a_host_number():
    """CUDA divides a tensor by a host number as a multiplication by its
    reciprocal, one ulp off the CPU's division for many values, so a scale
    computed that way would differ between a CPU and a CUDA run (and with it
    the codes under it). Every scale divides by a tensor on the data's device,
    or by a power of two, which both round alike; checked here on the CPU by
    watching every division the quantizers dispatch."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from tracefp4.components.ptq import four_over_six, h_scale

    host_divisors = []

    class WatchDivisions(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            divisor = args[1] if len(args) > 1 else None
            if func.overloadpacket in (torch.ops.aten.div, torch.ops.aten.div_) and isinstance(divisor, float):
                if not math.log2(abs(divisor)).is_integer():
                    host_divisors.append((str(func), divisor))
            return func(*args, **(kwargs or {}))

    x = torch.randn(8, 64, generator=torch.Generator().manual_seed(0))
    with WatchDivisions():
        quantize(x, "nvfp4")
        quantize(x, "mxfp4", scale_mode="rceil")
        per_token_global_scale(x)
        fake_quantize(x, "fp8")
        fake_quantize(x, "fp8", block_size=32)
        four_over_six(x)
        h_scale(x, torch.randn(16, 64, generator=torch.Generator().manual_seed(1)))
    assert host_divisors == []


@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4"])
def test_a_tensor_of_no_rows_quantizes_to_no_rows(fmt):
    """The CPU path inferred sizes with -1, which a tensor of no elements
    cannot give (the Triton path and a MoE layer no token went to can)."""
    for shape in ((0, 64), (2, 0, 64)):
        for dtype in (torch.float32, torch.bfloat16):
            x = torch.zeros(shape, dtype=dtype)
            q = quantize(x, fmt)
            assert q.codes.shape == (*shape[:-1], 32) and dequantize(q).shape == shape
            assert fake_quantize(x, fmt).shape == shape
    assert quantize(torch.zeros(0, 64), "nvfp4", global_scale=per_token_global_scale(torch.zeros(0, 64))).shape == (
        0,
        64,
    )


def test_scales_of_another_dtype_or_blocks_are_refused():
    """Scale bytes of another dtype read differently on the two backends (the
    CPU took NVFP4's E4M3 0x38, 1.0, for 56): a tensor or guidance holding
    them is refused where it is made."""
    from tracefp4.kernels import Guidance

    q = quantize(torch.randn(2, 64), "nvfp4")
    with pytest.raises(TypeError, match=r"nvfp4 scales must be torch.float8_e4m3fn .* got torch.uint8"):
        FP4Tensor(q.codes, q.scales.view(torch.uint8), q.global_scale, "nvfp4", q.shape)
    with pytest.raises(ValueError, match=r"do not cover shape \(2, 64\) in blocks of 16"):
        FP4Tensor(q.codes, q.scales[:, :2], q.global_scale, "nvfp4", q.shape)
    # another row count (a slice's guidance with the batch's scales: the CPU broadcast them, Triton read rows
    # past them), or the rows laid out otherwise
    for scales in (q.scales[:1], torch.cat([q.scales, q.scales]), q.scales.reshape(1, 2, 4)):
        with pytest.raises(
            ValueError, match=rf"scales {re.escape(str(tuple(scales.shape)))} do not cover shape \(2, 64\)"
        ):
            FP4Tensor(q.codes, scales, q.global_scale, "nvfp4", q.shape)
        with pytest.raises(ValueError, match="do not cover"):
            Guidance(q.codes, 4, scales, q.global_scale, "nvfp4", q.shape)
    m = quantize(torch.randn(2, 64), "mxfp4")
    with pytest.raises(TypeError, match="mxfp4 scales must be torch.uint8"):
        Guidance.from_rollout(FP4Tensor(m.codes, m.scales.view(torch.float8_e4m3fn), None, "mxfp4", m.shape), 1)


def test_fp8_refuses_what_only_fp4_takes():
    x = torch.randn(2, 64)
    for option in ({"global_scale": 1.0}, {"scale_mode": "rceil"}):
        with pytest.raises(ValueError, match="global_scale, scale_mode and guide are FP4's"):
            fake_quantize(x, "fp8", **option)
    with pytest.raises(TypeError, match="float32 or bfloat16, got torch.float16"):
        fake_quantize(x.half(), "fp8")


def test_chunks_spread_over_threads_on_the_cpu_and_run_in_order_on_a_device(monkeypatch):
    """The reference's cache-sized chunks go to single-threaded workers on the
    CPU (none waits on a descheduled core); a device's run in order on the
    caller's thread, whose stream they must launch on (a worker's is the
    device's default). The meta device stands in for a GPU."""
    import threading

    from tracefp4.kernels import reference

    monkeypatch.setattr(reference, "CHUNK_ELEMENTS", 64)
    previous = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        for device, ours in (("cpu", False), ("meta", True)):
            seen = []
            reference._each_chunk(
                lambda rows, seen=seen: seen.append((rows, threading.current_thread())),
                torch.empty(40, 16, device=device),
            )
            assert sorted(r.start for r, _ in seen) == list(range(0, 40, 4))
            assert all(t is threading.current_thread() for _, t in seen) == ours
            if ours:
                assert [r.start for r, _ in seen] == list(range(0, 40, 4))  # in order
    finally:
        torch.set_num_threads(previous)
