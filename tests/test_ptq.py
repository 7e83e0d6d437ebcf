"""PTQ baselines on routed-expert weights: vanilla NVFP4, Four Over Six, H-Scale."""

import pytest
import torch

from tracefp4.components.model import build_model
from tracefp4.components.ptq import (
    apply_ptq,
    block_error,
    calibration_hessians,
    four_over_six,
    h_scale,
    hessian_diag,
    vanilla_nvfp4,
)
from tracefp4.components.quant import quantize_expert_weights_
from tracefp4.kernels import dequantize, fake_quantize, unpack_codes
from tracefp4.kernels.reference import e2m1_decode, e2m1_encode


def weight(out=32, inp=128, seed=0):
    """Heavy-tailed rows and columns, so blocks differ in scale and shape."""
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(out, inp, generator=g) * torch.rand(1, inp, generator=g) * 3
    return w * torch.distributions.StudentT(3.0).sample((out, inp)).abs().clamp(max=5)


def calib(n=64, inp=128, seed=1):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, inp, generator=g) * torch.rand(inp, generator=g).pow(3) * 8


def candidate(w, ratio_factor):
    """One Four Over Six candidate, straight from the formula: s = e4m3(f * block_amax * 256 / amax)."""
    wb = w.reshape(w.shape[0], -1, 16)
    amax = wb.abs().amax()
    s = (wb.abs().amax(-1) * 256 / amax * ratio_factor).to(torch.float8_e4m3fn).float()
    s = torch.where(s == 0, 1.0, s)
    unit = (s * (amax / 1536))[..., None]
    return (e2m1_decode(e2m1_encode(wb / unit)) * unit).reshape(w.shape), s


def test_vanilla_is_the_kernels_fake_quantize():
    w = weight()
    r = vanilla_nvfp4(w)
    assert r.values.dtype == torch.float32 and r.choice is None
    assert torch.equal(r.values, fake_quantize(w, "nvfp4"))
    assert torch.equal(dequantize(r.q), r.values)
    assert torch.equal(vanilla_nvfp4(w.bfloat16()).values, fake_quantize(w.bfloat16().float(), "nvfp4"))


def test_four_over_six_never_worse_than_either_candidate():
    for seed in range(3):
        w = weight(seed=seed)
        r = four_over_six(w)
        (v6, s6), (v4, s4) = candidate(w, 1.0), candidate(w, 1.5)
        err, err6, err4 = block_error(w, r.values), block_error(w, v6), block_error(w, v4)
        assert (err <= err6).all() and (err <= err4).all()
        assert torch.equal(err, torch.minimum(err6, err4))
        four = r.choice
        assert 0 < four.float().mean() < 1  # both kinds occur on this weight
        assert torch.equal(four, err4 < err6)  # 4 only when strictly better
        keep6 = ~four[..., None].expand(-1, -1, 16).reshape(w.shape)
        assert torch.equal(r.values[keep6], v6[keep6])  # where 6 wins it is scale-to-6 exactly
        assert torch.equal(r.q.scales.float(), torch.where(four, s4, s6))


def test_four_over_six_lies_on_its_grid():
    w = weight()
    r = four_over_six(w)
    g = w.abs().amax() / (6 * 256)
    assert r.q.global_scale.dtype == torch.float32 and torch.equal(r.q.global_scale, g)
    assert r.q.scales.dtype == torch.float8_e4m3fn and r.q.scales.float().max() <= 384
    grid = e2m1_decode(unpack_codes(r.q)).reshape(w.shape[0], -1, 16) * (r.q.scales.float() * g)[..., None]
    assert torch.equal(r.values, grid.reshape(w.shape))
    assert torch.equal(dequantize(r.q), r.values)


def test_four_over_six_crafted_blocks_ties_and_zeros():
    w = torch.zeros(4, 16)
    w[0, 0], w[0, 1:] = 6.0, 4.5  # unit 1 rounds 4.5 to 4; unit 1.5 holds 6 and 4.5 exactly: 4 wins
    w[1, :3] = torch.tensor([6.0, 3.0, 1.5])  # exact under both: a tie keeps scale-to-6
    w[2, :2] = torch.tensor([6.0, 0.5])  # 0.5 / 1.5 rounds to 0.5 (0.75): 6 wins
    r = four_over_six(w)  # row 3 is an all-zero block
    assert r.choice.flatten().tolist() == [True, False, False, False]
    assert r.q.scales.float().flatten().tolist() == [384.0, 256.0, 256.0, 1.0]
    assert torch.equal(r.values, w)  # all three are exact under the kept scale
    assert (unpack_codes(r.q)[3] == 0).all()
    z = four_over_six(torch.zeros(2, 32))  # all-zero weight: global scale 1.0, scale 1.0, codes 0
    assert z.q.global_scale == 1.0 and (z.q.scales.float() == 1.0).all() and (z.values == 0).all()
    assert not z.choice.any()


def test_h_scale_never_worse_than_rtn_and_scales_are_valid():
    w, x = weight(), calib()
    h = hessian_diag(x)
    assert torch.allclose(h, (x.double() ** 2).mean(0))
    rtn = vanilla_nvfp4(w)
    r = h_scale(w, x, k=4)
    assert (block_error(w, r.values, h) <= block_error(w, rtn.values, h)).all()
    assert block_error(w, r.values, h).sum() < block_error(w, rtn.values, h).sum()
    bits = r.q.scales.view(torch.uint8)
    assert r.q.scales.dtype == torch.float8_e4m3fn and ((bits >= 1) & (bits <= 0x7E)).all()
    assert torch.isfinite(r.q.scales.float()).all() and (r.q.scales.float() > 0).all()
    assert torch.equal(bits.short() - rtn.q.scales.view(torch.uint8).short(), r.choice)
    assert r.choice.abs().max() <= 4 and (r.choice != 0).any()
    assert torch.equal(r.q.global_scale, rtn.q.global_scale)  # ModelOpt's
    assert torch.equal(dequantize(r.q), r.values)


def test_h_scale_strictly_better_on_a_crafted_block():
    # global scale 6/2688 and RTN block scale 448 give unit 1: 0.7 -> 0.5 (error 0.04);
    # only column 1 matters (h), and scale 384 (unit 6/7) gives 0.857 (error 0.0247)
    w = torch.zeros(1, 16)
    w[0, 0], w[0, 1] = 6.0, 0.7
    h = torch.zeros(16)
    h[1] = 1.0
    rtn, r = vanilla_nvfp4(w), h_scale(w, h=h)
    e_rtn, e = block_error(w, rtn.values, h).item(), block_error(w, r.values, h).item()
    assert e_rtn == pytest.approx(0.04, rel=1e-5) and e < e_rtn
    assert r.q.scales.float().item() < 448 and r.choice.item() < 0


def test_h_scale_with_uniform_h_is_the_mse_optimal_search():
    w = weight(out=4, inp=64, seed=3)
    r = h_scale(w, x_calib=torch.ones(5, 64), k=3)
    assert torch.equal(r.values, h_scale(w, h=torch.ones(64), k=3).values)
    g = w.abs().amax() / (6 * 448)
    rtn_bits = vanilla_nvfp4(w).q.scales.view(torch.uint8)
    for o in range(4):
        for b in range(4):
            blk = w[o, 16 * b : 16 * b + 16]
            c0 = int(rtn_bits[o, b])
            best = None
            for code in sorted(range(max(1, c0 - 3), min(0x7E, c0 + 3) + 1), key=lambda c: (abs(c - c0), c)):
                unit = torch.tensor(code, dtype=torch.uint8).view(torch.float8_e4m3fn).float() * g
                q = e2m1_decode(e2m1_encode(blk / unit)) * unit
                mse = ((q.double() - blk.double()) ** 2).sum().item()
                if best is None or mse < best[0]:
                    best = (mse, code, q)
            assert int(r.q.scales[o, b].view(torch.uint8)) == best[1], (o, b)
            assert torch.equal(r.values[o, 16 * b : 16 * b + 16], best[2])


def test_h_scale_falls_back_to_rtn_exactly():
    w = weight()
    rtn = vanilla_nvfp4(w).values
    assert torch.equal(h_scale(w, calib(), k=0).values, rtn)
    assert torch.equal(h_scale(w, torch.zeros(0, 128)).values, rtn)  # no rows: h = 0
    w[:, :16] = 0  # all-zero blocks keep scale 1.0
    r = h_scale(w, calib())
    assert (r.q.scales[:, 0].float() == 1.0).all() and (r.choice[:, 0] == 0).all()


def test_errors_are_clear():
    w = weight()
    with pytest.raises(ValueError, match="exactly one of"):
        h_scale(w)
    with pytest.raises(ValueError, match="exactly one of"):
        h_scale(w, calib(), h=torch.ones(128))
    with pytest.raises(ValueError, match="one entry per input"):
        h_scale(w, calib(inp=64))
    with pytest.raises(ValueError, match="k "):
        h_scale(w, calib(), k=-1)
    with pytest.raises(ValueError, match="multiple of 16"):
        four_over_six(torch.ones(4, 24))
    with pytest.raises(ValueError, match="2-D"):
        four_over_six(torch.ones(2, 4, 16))
    with pytest.raises(ValueError, match="NaN or Inf"):
        four_over_six(torch.full((1, 16), float("nan")))
    model = build_model("smoke")
    with pytest.raises(ValueError, match="unknown PTQ method 'gptq'.*four_over_six"):
        apply_ptq(model, "gptq")
    with pytest.raises(ValueError, match="h_scale needs calibration"):
        apply_ptq(model, "h_scale")
    with pytest.raises(ValueError, match="token ids must lie"):
        apply_ptq(model, "h_scale", torch.tensor([[0, 256]]))


def _tokens():
    return torch.randint(0, 256, (3, 16), generator=torch.Generator().manual_seed(0))


@pytest.mark.parametrize("preset", ["smoke", "tiny-qwen35"])
@pytest.mark.parametrize("method", ["nvfp4", "four_over_six", "h_scale"])
def test_apply_ptq_touches_routed_experts_only(method, preset):
    model = build_model(preset, seed=0)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    apply_ptq(model, method, _tokens())
    expert = [n for n in before if ".experts." in n]
    assert len(expert) == 2 * len(model.moe_blocks())
    for n, p in model.named_parameters():
        if n in expert:
            assert not torch.equal(p, before[n]), n
            assert (p - before[n]).norm() < 0.2 * before[n].norm()  # a quantized copy, not noise
        else:
            assert torch.equal(p, before[n]), n
    tokens = _tokens()
    logits = model(tokens, torch.arange(16).expand(3, 16))
    assert logits.shape == (3, 16, model.cfg.vocab_size) and torch.isfinite(logits).all()
    if method == "nvfp4":
        ref = build_model(preset, seed=0)
        quantize_expert_weights_(ref, "nvfp4")
        for (n, p), q in zip(model.named_parameters(), ref.parameters()):
            assert torch.equal(p, q), n


def test_calibration_hessians_follow_the_routing():
    model = build_model("smoke", seed=0)
    tokens = _tokens()
    seen = {}
    hooks = [
        b.mlp.register_forward_pre_hook(lambda m, args, layer=b.layer: seen.__setitem__(layer, args[0]))
        for b in model.model.layers
    ]
    hess = calibration_hessians(model, tokens)
    for hk in hooks:
        hk.remove()
    for b in model.model.layers:
        moe, x = b.mlp, seen[b.layer].reshape(-1, 64)
        _, experts = moe.route(x)
        for e in range(model.cfg.num_experts):
            rows = x[(experts == e).any(-1)]
            gate, up = (rows @ moe.experts.gate_up[e]).chunk(2, -1)
            inter = torch.nn.functional.silu(gate) * up
            h_gu, n_gu = hess[(b.layer, "gate_up")]
            h_dn, n_dn = hess[(b.layer, "down")]
            assert n_gu[e] == n_dn[e] == rows.shape[0]
            assert torch.allclose(h_gu[e], hessian_diag(rows), rtol=1e-5)
            assert torch.allclose(h_dn[e], hessian_diag(inter), rtol=1e-4, atol=1e-12)


def test_calibration_sequences_of_several_lengths_count_every_token_and_no_padding():
    """Prompts of several lengths calibrate whole (they had been cut to the
    shortest): right-padded, the padding's rows left out, each expert's rows
    are those of the prompts run one by one. Their values agree to float32's
    rounding, not bit for bit: on some CPUs (an AMD EPYC with AVX2 only) the
    causal attention's float32 kernel sums a query's keys in another order
    when the batch is padded to another length."""
    model = build_model("smoke", seed=0)
    g = torch.Generator().manual_seed(3)
    sequences = [torch.randint(0, 256, (n,), generator=g).tolist() for n in (5, 9, 2)]
    together = calibration_hessians(model, sequences)
    alone = [calibration_hessians(model, [s]) for s in sequences]
    for key, (h, n) in together.items():
        assert torch.equal(n, sum(a[key][1] for a in alone)) and n.sum() == 16 * model.cfg.top_k
        summed = sum(a[key][0] * a[key][1][:, None] for a in alone)
        torch.testing.assert_close(h * n[:, None], summed, rtol=1e-5, atol=0)
    with pytest.raises(ValueError, match="each hold a token"):
        calibration_hessians(model, [[1, 2], []])


def test_apply_ptq_h_scale_uses_each_experts_own_hessian_and_rtn_for_an_unrouted_one():
    """One calibration token reaches top_k of each layer's experts: those take H-Scale
    under their own matrix's Hessian diagonal, the others (no rows, h = 0) RTN exactly,
    what quantize_expert_weights_ gives."""
    model, ref, rtn = (build_model("smoke", seed=0) for _ in range(3))
    quantize_expert_weights_(rtn, "nvfp4")
    tokens = torch.tensor([[7]])
    hess = calibration_hessians(ref, tokens)
    apply_ptq(model, "h_scale", tokens)
    searched = 0
    for b, rb, qb in zip(model.model.layers, ref.model.layers, rtn.model.layers):
        for matrix in ("gate_up", "down"):
            h, n = hess[(b.layer, matrix)]
            assert n.sum() == model.cfg.top_k and (n == 0).sum() == model.cfg.num_experts - model.cfg.top_k
            got, w, q = (getattr(x.mlp.experts, matrix) for x in (b, rb, qb))
            for e in range(model.cfg.num_experts):
                if n[e] == 0:
                    assert torch.equal(got[e], q[e]), (b.layer, matrix, e)
                    continue
                assert torch.equal(got[e], h_scale(w[e].T, h=h[e]).values.T), (b.layer, matrix, e)
                searched += not torch.equal(got[e], q[e])
    assert searched  # the search moved some scale off RTN: the test tells the Hessians apart
