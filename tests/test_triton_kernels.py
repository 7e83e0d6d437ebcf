"""Every Triton kernel equals the torch reference bit for bit. Without a GPU the
kernels run in Triton's interpreter on CPU tensors (see conftest.py), so the
tensors stay small and the grids short."""

import math

import pytest
import torch

from tracefp4.kernels import HAS_TRITON, MXFP4, NVFP4, reference

pytestmark = pytest.mark.skipif(not HAS_TRITON, reason="triton is not installed on this platform")

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
MODES = [(NVFP4, "floor"), (MXFP4, "floor"), (MXFP4, "rceil")]


@pytest.fixture(scope="module")
def tk():
    from tracefp4.kernels import triton_kernels

    return triton_kernels


def assert_same_bits(a: torch.Tensor, b: torch.Tensor):
    """Equal bits, where any NaN matches any NaN (payloads differ by platform)."""
    assert a.shape == b.shape and a.dtype == b.dtype
    if a.is_floating_point():
        nan = a.isnan()
        assert torch.equal(nan, b.isnan())
        a, b = a[~nan], b[~nan]
    as_int = {torch.float32: torch.int32, torch.float8_e4m3fn: torch.uint8}
    assert torch.equal(a.view(as_int.get(a.dtype, a.dtype)), b.view(as_int.get(b.dtype, b.dtype)))


def sample(rows: int, cols: int, seed: int, dtype=torch.float32, specials: bool = True) -> torch.Tensor:
    """Normal values at scales from subnormal to huge, exact ties, zeros and
    (unless they would poison a default NVFP4 global scale) NaN and Inf."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, cols, generator=g) * 10.0 ** torch.randint(-40, 30, (rows, 1), generator=g).float()
    x[0, :32] = 0.0
    x[1, :8] = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, -6.0])
    x[1, 8:32] = 0.0
    x[1, 15] = 6.0  # unit 1 for the first NVFP4 block, 2^0 for MXFP4's
    if specials:
        x[2, 40] = math.nan
        x[3, 70] = -math.inf
    return x.to(DEVICE, dtype)


@pytest.mark.parametrize("fmt,mode,global_scale", [m + (None,) for m in MODES] + [(NVFP4, "floor", 0.05)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_quantize_and_fake_quantize(tk, fmt, mode, global_scale, dtype):
    g = None if global_scale is None else torch.tensor(global_scale, device=DEVICE)
    specials = g is not None or not fmt.has_global_scale
    x = sample(6, 160, seed=1, dtype=dtype, specials=specials)  # 60 NVFP4 blocks: one partial program of 64
    e_codes, e_scales, e_global = reference.quantize(x, fmt, g, mode)
    codes, scales, global_out = tk.quantize(x, fmt, g, mode)
    assert_same_bits(e_codes, codes)
    assert_same_bits(e_scales, scales)
    if fmt.has_global_scale:
        assert_same_bits(e_global, global_out)
    assert_same_bits(reference.fake_quantize(x, fmt, g, mode), tk.fake_quantize(x, fmt, g, mode))


@pytest.mark.parametrize("fmt,mode", MODES)
def test_dequantize(tk, fmt, mode):
    x = sample(4, 2048, seed=2, specials=not fmt.has_global_scale)  # more blocks than one program holds
    codes, scales, g = reference.quantize(x, fmt, None, mode)
    assert_same_bits(reference.dequantize(codes, fmt, scales, g), tk.dequantize(codes, fmt, scales, g))


@pytest.mark.parametrize("fmt", [NVFP4, MXFP4])
@pytest.mark.parametrize("bits", [1, 2, 3, 4])
def test_guided_quantize_and_fake_quantize(tk, fmt, bits):
    x = sample(6, 128, seed=3)
    g = torch.tensor(1e-3, device=DEVICE) if fmt.has_global_scale else None
    codes, scales, g = reference.quantize(x, fmt, g, "floor")
    low = reference.unpack_nibbles(codes) & ((1 << bits) - 1)
    train = x + torch.randn(x.shape, generator=torch.Generator().manual_seed(4)).to(DEVICE) * x.abs() * 0.05
    train[5, 3] = math.nan
    assert_same_bits(
        reference.quantize_guided(train, fmt, scales, g, low, bits),
        tk.quantize_guided(train, fmt, scales, g, low, bits),
    )
    assert_same_bits(
        reference.fake_quantize_guided(train, fmt, scales, g, low, bits),
        tk.fake_quantize_guided(train, fmt, scales, g, low, bits),
    )


@pytest.mark.parametrize("bits", [1, 2, 3, 4])
@pytest.mark.parametrize("n", [1, 13, 64, 2051])
def test_compact_and_expand(tk, bits, n):
    c = torch.randint(0, 16, (3, n), dtype=torch.uint8, generator=torch.Generator().manual_seed(n)).to(DEVICE)
    packed = reference.compact_codes(c, bits)
    assert_same_bits(packed, tk.compact_codes(c, bits))
    assert_same_bits(reference.expand_codes(packed, bits, n), tk.expand_codes(packed, bits, n))


def test_e4m3_encoder_covers_every_scale(tk):
    # every float32 that is an E4M3 value, every midpoint between two, and beyond 448
    values = torch.arange(0x7F, dtype=torch.uint8).view(torch.float8_e4m3fn).float()
    mids = (values[1:] + values[:-1]) / 2
    amax = torch.cat([values, mids, torch.tensor([464.0, 465.0, 1e30, math.inf, 2.0**-10, 2.0**-10 + 2.0**-30])])
    x = torch.zeros(amax.numel(), 16)
    x[:, 0] = amax * 6  # global scale 1: block scale e4m3(amax)
    x = x.to(DEVICE)
    one = torch.tensor(1.0, device=DEVICE)
    assert_same_bits(reference.quantize(x, NVFP4, one, "floor")[1], tk.quantize(x, NVFP4, one, "floor")[1])


def test_every_scale_byte_is_read_as_torch_reads_it(tk):
    """Scales handed in (a rollout's, read back from a store) are read as
    torch reads them, every byte: E4M3 0x80..0xFE are the negatives (the
    kernel read them as positive) and 0xFF is NaN (it read 480), E8M0 0 is
    2^-127, 254 is 2^127 and 0xFF NaN. Dequantized and as guided rounding's units."""
    codes = torch.tensor([0x73, 0x9A], dtype=torch.uint8).repeat(256, 8).to(DEVICE)  # 3, 7, 10, 9: both signs
    every = torch.arange(256, dtype=torch.uint8).to(DEVICE)[:, None]  # one block a row
    g = torch.tensor(0.75, device=DEVICE)
    train = sample(256, 32, seed=7, specials=False)
    for fmt, scales, global_scale in ((NVFP4, every.view(torch.float8_e4m3fn), g), (MXFP4, every, None)):
        packed = codes[:, : fmt.block_size // 2]
        assert_same_bits(
            reference.dequantize(packed, fmt, scales, global_scale), tk.dequantize(packed, fmt, scales, global_scale)
        )
        x = train[:, : fmt.block_size]
        low = reference.unpack_nibbles(packed) & 1
        assert_same_bits(
            reference.fake_quantize_guided(x, fmt, scales, global_scale, low, 1),
            tk.fake_quantize_guided(x, fmt, scales, global_scale, low, 1),
        )


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_per_row_global_scales(tk, dtype):
    """One NVFP4 global scale per row (per-token activation scales), rows of
    several blocks spread over two programs; a NaN row scale poisons its row."""
    x = sample(8, 160, seed=5, specials=False).reshape(2, 4, 160)  # 80 blocks: a program and a half
    if dtype == torch.bfloat16:  # the interpreter reads bf16 subnormals wrong (a GPU reads them exactly)
        x = torch.where(x.abs().amax(-1, keepdim=True) < 1e-30, x * 1e20, x)
    x = x.to(dtype)
    g = reference.per_token_global_scale(x)
    g[1, 2, 0] = math.nan
    e_codes, e_scales, _ = reference.quantize(x, NVFP4, g, "floor")
    codes, scales, g_out = tk.quantize(x, NVFP4, g, "floor")
    assert_same_bits(e_codes, codes)
    assert_same_bits(e_scales, scales)
    assert g_out is g
    assert_same_bits(reference.dequantize(codes, NVFP4, scales, g), tk.dequantize(codes, NVFP4, scales, g))
    assert_same_bits(reference.fake_quantize(x, NVFP4, g, "floor"), tk.fake_quantize(x, NVFP4, g, "floor"))
    train = x * (1 + 0.05 * torch.randn(x.shape, generator=torch.Generator().manual_seed(6)).to(DEVICE, dtype))
    low = reference.unpack_nibbles(codes) & 1
    assert_same_bits(
        reference.fake_quantize_guided(train, NVFP4, scales, g, low, 1),
        tk.fake_quantize_guided(train, NVFP4, scales, g, low, 1),
    )


@pytest.fixture(scope="module")
def ts():
    from tracefp4.kernels import triton_syndrome

    return triton_syndrome


@pytest.fixture(scope="module")
def runtime_loops():
    """Skips where Triton's interpreter cannot loop to a bound passed as a kernel argument, as the erasure solver
    does: Triton 3.6's takes ``int()`` of a one-element array, which numpy 2 refuses. Compiled kernels, on a GPU,
    are not affected, so there nothing is probed."""
    if DEVICE == "cuda":
        return
    import triton
    import triton.language as tl

    @triton.jit
    def count(out_ptr, n):
        total = tl.zeros((1,), dtype=tl.int32)
        for _ in range(0, n):
            total += 1
        tl.store(out_ptr + tl.arange(0, 1), total)

    out = torch.zeros(1, dtype=torch.int32)
    try:
        count[(1,)](out, 3)
    except Exception as e:  # the interpreter wraps numpy's TypeError in its own error type
        if "0-dimensional arrays" not in str(e):
            raise
        pytest.skip(f"Triton {triton.__version__}'s interpreter cannot loop to a runtime bound here: {e}")
    assert out.item() == 3


@pytest.mark.parametrize("rows,n", [(8, 16), (40, 100), (64, 256), (24, 1000)])
def test_syndrome_words(ts, rows, n):
    """Blocks of a few to a thousand elements (one block per program), odd sizes, a 64-bit word's sign bit."""
    from tracefp4.kernels.syndrome import parity_matrix, syndrome_words

    bits = torch.randint(0, 2, (37, n), generator=torch.Generator().manual_seed(n), dtype=torch.uint8).to(DEVICE)
    h = parity_matrix(rows, n, 1)
    assert_same_bits(syndrome_words(bits.cpu(), h).to(DEVICE), ts.syndrome_words(bits, h))


def erasure_blocks(nb: int, n: int, seed: int, deepest: int):
    """Truth, a guess with flips at reliability ranks below ``deepest`` (some
    blocks also one flip at a sure position: those fail), distinct reliabilities."""
    g = torch.Generator().manual_seed(seed)
    truth = torch.randint(0, 2, (nb, n), generator=g, dtype=torch.uint8)
    reliability = torch.randperm(nb * n, generator=g).float().view(nb, n) / (nb * n)
    rank = reliability.argsort(1).argsort(1)
    flips = (rank < torch.randint(0, deepest + 1, (nb, 1), generator=g)) & (torch.rand(nb, n, generator=g) < 0.3)
    flips[: nb // 5] |= rank[: nb // 5] == n - 1  # beyond every tier's unknowns
    return truth, truth ^ flips.to(torch.uint8), reliability


@pytest.mark.parametrize(
    "n,rows,erasures",
    [(256, 64, 56), (256, 16, 8), (96, 40, 30), (600, 32, 24), (20, 64, 56), (64, 8, 0), (8, 8, 8), (9, 16, 9)],
)
def test_solve_erasures(ts, runtime_loops, n, rows, erasures):
    """Bits, failures and erasures needed as the reference's, over every tier
    (flips at reliability ranks up to the last unknown) and blocks that fail;
    several blocks a program and one wide block a program; fewer elements than
    unknowns; bits sent as themselves (an MXFP4 block's 8 scales in 8 bits)."""
    from tracefp4.kernels.syndrome import parity_matrix, solve_erasures, syndrome

    truth, guess, reliability = erasure_blocks(32, n, seed=n + rows, deepest=min(erasures, n))
    h = parity_matrix(rows, n, 3)
    parity = syndrome(truth, h)
    expected = solve_erasures(guess, reliability, parity, h, erasures)
    got = ts.solve_erasures(guess.to(DEVICE), reliability.to(DEVICE), parity.to(DEVICE), h, erasures)
    for e, t in zip(expected, got):
        assert_same_bits(e.to(DEVICE), t)
    bits, ok, needed = expected
    assert ok.sum() >= 16 and ((~ok).sum() >= 4 or n <= erasures)  # both kinds of block, unless all are unknowns
    assert (needed > 8).any() or erasures <= 8
    assert erasures or torch.equal(ok, (parity == syndrome(guess, h)).all(1))  # no unknowns: the check alone


def test_solve_erasures_with_equal_reliabilities(ts, runtime_loops):
    """Unknown (-inf) and certain (+inf) positions tie among themselves: the
    blocks decode to the same bits (the order of tied unknowns is free)."""
    from tracefp4.kernels.syndrome import parity_matrix, solve_erasures, syndrome

    truth, guess, reliability = erasure_blocks(32, 256, seed=9, deepest=20)
    reliability[:, :5] = -math.inf
    guess[:, :5] = 0
    reliability[:, 200:] = math.inf
    h = parity_matrix(64, 256, 1)
    parity = syndrome(truth, h)
    e_bits, e_ok, _ = solve_erasures(guess, reliability, parity, h, 56)
    bits, ok, _ = ts.solve_erasures(guess.to(DEVICE), reliability.to(DEVICE), parity.to(DEVICE), h, 56)
    assert_same_bits(e_bits.to(DEVICE), bits)
    assert_same_bits(e_ok.to(DEVICE), ok)
    assert e_ok.sum() >= 12 and (~e_ok).sum() >= 5
