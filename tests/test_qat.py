"""The training path: each method's fake quantization, TRACE's guided rounding
against the rollout's captures, and the GRPO / TIS loss."""

import copy
from dataclasses import replace
from types import SimpleNamespace

import pytest
import torch

from tracefp4.components import quant, rl, steps
from tracefp4.components.capture import Capture, CaptureConfig, CaptureRecords, SiteTable, TokenMap
from tracefp4.components.guidance import GuidanceError, GuidanceLoader, MicrobatchGuidance, read_step, write_step
from tracefp4.components.mismatch import compare, join_rows, rounded
from tracefp4.components.model import ExpertRows, build_model
from tracefp4.components.qat import TrainingSites
from tracefp4.components.quant import fp4_expert_weights
from tracefp4.components.quant_config import QuantConfig, rollout_config
from tracefp4.components.rl import (
    SequenceBatch,
    alignment_metrics,
    group_advantages,
    grpo_loss,
    score_centering,
    token_logprobs,
)
from tracefp4.components.rollout import SamplingParams, TorchEngine, Trajectory
from tracefp4.components.store import open_store
from tracefp4.kernels import dequantize, fake_quantize, quantize
from tracefp4.schemas import RunConfig, get_preset


@pytest.fixture(scope="module", params=["tiny", "tiny-qwen35"])
def step(tmp_path_factory, request, native_bf16):
    """A rollout of the tiny preset (and of its hybrid Qwen3.5-MoE flavour)
    with full capture, its guidance written and loaded back."""
    return captured_step(tmp_path_factory, request.param, rollout_config("fp4_wa_kv"))


def captured_step(tmp_path_factory, preset, quant):
    """Eight seeded prompts rolled out under ``quant`` with full capture; the
    guidance written to a fresh store and loaded back as one microbatch."""
    engine = TorchEngine(build_model(preset, seed=0), quant, capture=CaptureConfig())
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, 512, (8,), generator=g).tolist() for _ in range(8)]
    out = engine.generate(prompts, SamplingParams(max_new_tokens=12, seed=0))
    records = engine.drain_capture()
    store = open_store(str(tmp_path_factory.mktemp("store")))
    write_step(store, records, rl_step=0, policy_version=0, top_k=engine.model.cfg.top_k)
    (mb,) = GuidanceLoader(store, 0, [[t.id for t in out]])
    return engine, out, records, mb


def training_pass(engine, out, mb, method, record=False):
    batch = SequenceBatch.of(out)
    s = batch.tokens.shape[1]
    capture = None
    if record:
        config = CaptureConfig(max_tokens=batch.tokens.numel())
        capture = Capture(engine.model.cfg, engine.quant, config, engine.global_scales, kv_from_forward=True)
        # the positions the rollout fed: all but each sequence's last token
        capture.begin(TokenMap.of(batch.trajectories, batch.positions, batch.lengths - 1))
    sites = TrainingSites(
        engine.quant,
        method,
        engine.global_scales,
        trajectories=batch.trajectories,
        seq_len=s,
        guidance=mb,
        recorder=capture,
    )
    with torch.no_grad():
        logprobs = token_logprobs(engine.model, batch, sites)
    if capture is not None:
        capture.end()
    return batch, sites, logprobs, capture.drain() if capture else None


def against_rollout(engine, out, records, mb, method) -> SimpleNamespace:
    """One training pass of ``method`` set against the rollout it replays: its
    alignment metrics, the share of captured codes it rounded differently, its
    guidance coverage and its own capture."""
    batch, sites, logprobs, codes = training_pass(engine, out, mb, method, record=True)
    report = compare(records, codes)
    return SimpleNamespace(
        metrics=alignment_metrics(logprobs, batch.rollout_logprobs, batch.response),
        mismatched=sum(m.mismatched for m in report.values()) / sum(m.elements for m in report.values()),
        coverage=sites.coverage,
        codes=codes,
    )


def test_trace_aligns_training_with_rollout_better_than_qat(step):
    engine, out, records, mb = step
    qat, trace = (against_rollout(engine, out, records, mb, method) for method in ("qat", "trace"))
    assert trace.coverage.rate > 0.9 and qat.coverage.rate == 0.0  # guided wherever the same expert was routed
    assert trace.mismatched < 0.1 * qat.mismatched  # codes: the training path now rounds as the rollout did
    assert trace.metrics["logprob_abs_diff_mean"] < qat.metrics["logprob_abs_diff_mean"]
    assert trace.metrics["k3_kl"] < qat.metrics["k3_kl"]


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_a_value_training_cannot_round_finitely_is_not_guided(bad):
    """A NaN or Inf where training's values are guided (a bf16 overflow in
    SwiGLU, say) rounds as under qat (a NaN to a NaN block that shows at once)
    instead of to a finite codeword under the rollout's scale; its row counts
    as unguided."""
    rollout = torch.randn(8, 64, generator=torch.Generator().manual_seed(0))
    scale = torch.tensor(0.0123)
    q = quantize(rollout, "nvfp4", global_scale=scale)
    rows, none = torch.arange(8), torch.zeros(8, dtype=torch.long)
    table = SiteTable(0, "moe_in", "nvfp4", 4, 64, float(scale), none, rows, none, none - 1, q.codes, q.scales)
    train = rollout.clone()
    train[3, 5] = bad
    sites = {
        method: TrainingSites(
            QuantConfig("nvfp4", "nvfp4", None),
            method,
            {(0, "moe_in"): scale},
            trajectories=[0],
            seq_len=8,
            guidance=MicrobatchGuidance([0], {(0, "moe_in"): table}, []),
        )
        for method in ("qat", "trace")
    }
    qat, trace = (sites[method].moe_in(0, train) for method in ("qat", "trace"))
    torch.testing.assert_close(trace[3], qat[3], rtol=0, atol=0, equal_nan=True)
    assert trace[3].isnan().any() == (bad != bad)  # a NaN's block is NaN; an Inf saturates its block's scale
    assert torch.equal(trace[[0, 1, 2, 4, 5, 6, 7]], dequantize(q)[[0, 1, 2, 4, 5, 6, 7]])  # the rest as rolled out
    assert sites["trace"].coverage.rate == 7 / 8
    # mismatch.rounded, re-rounding a capture of these inputs under the same guidance, rounds as the trace path does
    t = quantize(train, "nvfp4", global_scale=scale)
    captured = replace(table, codes=t.codes, scales=t.scales, inputs=train)
    again = rounded(CaptureRecords({(0, "moe_in"): captured}), CaptureRecords({(0, "moe_in"): table}))
    rerounded = again.tables[(0, "moe_in")].values()
    torch.testing.assert_close(rerounded, trace, rtol=0, atol=0, equal_nan=True)


def test_recomputed_layers_train_and_count_as_kept_ones(step):
    """Activation checkpointing (``recompute_layers``) runs each layer again in
    the backward: the same log-probabilities and, to rounding, gradients, and
    the guidance coverage and recorded codes of the forward alone."""
    engine, out, _, mb = step
    model = copy.deepcopy(engine.model).requires_grad_(True)
    batch = SequenceBatch.of(out)
    results = {}
    for recompute in (False, True):
        model.recompute_layers = recompute
        model.zero_grad()
        config = CaptureConfig(max_tokens=batch.tokens.numel())
        capture = Capture(model.cfg, engine.quant, config, engine.global_scales, kv_from_forward=True)
        capture.begin(TokenMap.of(batch.trajectories, batch.positions, batch.lengths - 1))
        sites = TrainingSites(
            engine.quant,
            "trace",
            engine.global_scales,
            trajectories=batch.trajectories,
            seq_len=batch.tokens.shape[1],
            guidance=mb,
            recorder=capture,
        )
        runs = []
        hook = model.model.layers[0].register_forward_pre_hook(lambda *args, runs=runs: runs.append(1))
        logprobs = token_logprobs(model, batch, sites)
        logprobs[batch.response].sum().backward()
        hook.remove()
        capture.end()
        results[recompute] = SimpleNamespace(
            logprobs=logprobs.detach(),
            grads=[p.grad.clone() for p in model.parameters()],
            total=dict(sites.coverage.total),
            rate=sites.coverage.rate,
            codes=capture.drain(),
            runs=len(runs),
        )
    kept, recomputed = results[False], results[True]
    assert (kept.runs, recomputed.runs) == (1, 2)
    assert torch.equal(kept.logprobs, recomputed.logprobs)
    assert all((a - b).abs().max() <= 1e-5 * a.abs().max() for a, b in zip(kept.grads, recomputed.grads))
    assert kept.total == recomputed.total and kept.rate == recomputed.rate > 0.9
    report = compare(kept.codes, recomputed.codes)
    assert sum(m.elements for m in report.values()) > 0 and sum(m.mismatched for m in report.values()) == 0
    assert sum(m.elements for m in report.values()) == sum(m.elements for m in compare(kept.codes, kept.codes).values())


@pytest.mark.parametrize("preset", ["smoke", "tiny-qwen35"])
@pytest.mark.parametrize("method", ["bf16", "qat", "quads", "trace"])
def test_every_method_trains_through_fake_quantization(method, preset, tmp_path):
    model = build_model(preset, seed=0)
    smoke = TorchEngine(model, rollout_config("fp4_wa_kv"), capture=CaptureConfig())
    trajectories = smoke.generate([[1, 2, 3], [4, 5]], SamplingParams(max_new_tokens=4))
    store = open_store(str(tmp_path))
    write_step(store, smoke.drain_capture(), rl_step=0, policy_version=0, top_k=2)
    (guidance,) = GuidanceLoader(store, 0, [[t.id for t in trajectories]])
    batch = SequenceBatch.of(trajectories)
    sites = TrainingSites(
        smoke.quant,
        method,
        smoke.global_scales,
        trajectories=batch.trajectories,
        seq_len=batch.tokens.shape[1],
        guidance=guidance,
    )
    logprobs = token_logprobs(model, batch, sites)
    loss, _ = grpo_loss(logprobs, logprobs.detach(), batch.rollout_logprobs, torch.tensor([1.0, -1.0]), batch.response)
    loss.backward()
    grads = {n: p.grad for n, p in model.named_parameters()}
    assert grads["model.layers.0.mlp.experts.gate_up"].abs().sum() > 0  # straight through the FP4 weights
    assert all(g is not None for n, g in grads.items() if "layers" in n)
    if model.cfg.linear_layers:  # through the chunked delta rule, the conv and the decay
        for name in ("in_proj_qkv.weight", "conv1d.weight", "A_log", "dt_bias", "in_proj_b.weight"):
            assert grads[f"model.layers.0.linear_attn.{name}"].abs().sum() > 0, name


def test_methods_quantize_what_they_should():
    x = torch.randn(4, 64)
    q = rollout_config("fp4_wa_kv")
    for method, changed in [("bf16", False), ("tis_sc", False), ("quads", False), ("qat", True)]:
        sites = TrainingSites(q, method, {})
        assert (not torch.equal(sites.moe_in(0, x), x)) == changed, method
    w = torch.randn(2, 64, 32)
    assert torch.equal(TrainingSites(q, "bf16", {}).expert_weights(0, w, w)[0], w)
    assert not torch.equal(TrainingSites(q, "quads", {}).expert_weights(0, w, w)[0], w)
    with pytest.raises(ValueError, match="needs the microbatch's guidance"):
        TrainingSites(q, "trace", {})
    with pytest.raises(ValueError, match="unknown training method 'fp2'"):
        TrainingSites(q, "fp2", {})


@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_experts_weights_round_at_once_as_each_alone(fmt, dtype, monkeypatch):
    """fp4_expert_weights quantizes the experts together, in calls of at most
    quant.EXPERT_SLICE_WEIGHTS weights (all 5 here; 2, 2 and 1 under a bound
    of two experts' weights, which bounds the calls' temporaries): the values
    of quantizing each expert's matrix on its own (its own NVFP4 global scale,
    blocks along the input dim), an all-zero expert and one holding NaN
    included; the training sites' weights are them, straight through."""
    w = torch.randn(5, 64, 48) * torch.tensor([1.0, 1e-3, 30.0, 0.0, 1.0])[:, None, None]
    w[4, 3, 7] = float("nan")
    w = w.to(dtype)
    alone = torch.stack([fake_quantize(w[e].T, fmt).T for e in range(len(w))])
    calls = []
    monkeypatch.setattr(quant, "quantize", lambda rows, *a, **kw: calls.append(len(rows)) or quantize(rows, *a, **kw))
    at_once = fp4_expert_weights(w, fmt)
    assert at_once.dtype == dtype and at_once[4].isnan().any() and calls == [5]
    torch.testing.assert_close(at_once, alone, rtol=0, atol=0, equal_nan=True)
    monkeypatch.setattr(quant, "EXPERT_SLICE_WEIGHTS", 2 * 64 * 48 + 1)
    torch.testing.assert_close(fp4_expert_weights(w, fmt), alone, rtol=0, atol=0, equal_nan=True)
    assert calls[1:] == [2, 2, 1]
    in_place = w.clone()  # weight sync rounds the model's own tensors
    assert fp4_expert_weights(in_place, fmt, out=in_place) is in_place
    torch.testing.assert_close(in_place, alone, rtol=0, atol=0, equal_nan=True)
    assert at_once[4].isnan().all() == (fmt == "nvfp4")  # its global scale NaN; MXFP4: the NaN's block alone
    sites = TrainingSites(QuantConfig(weights=fmt), "quads", {}, compute_dtype=dtype)
    master = w[:4].float().requires_grad_(True)
    gate_up, _ = sites.expert_weights(0, master, master)
    assert torch.equal(gate_up, alone[:4].float())
    gate_up.sum().backward()
    assert torch.equal(master.grad, torch.ones_like(master))


def test_grpo_loss_and_advantages():
    adv = group_advantages(torch.tensor([1.0, 0.0, 1.0, 1.0, 0.0, 0.0]), group_size=3)
    assert torch.allclose(adv.view(2, 3).mean(1), torch.zeros(2), atol=1e-6)
    assert adv[0] > 0 > adv[1]
    # by the sample standard deviation, as verl, slime and TRL: a group of two rewards 1 and 0 gives +-1/sqrt(2)
    assert group_advantages(torch.tensor([1.0, 0.0]), 2).tolist() == pytest.approx([0.5**0.5, -(0.5**0.5)], abs=1e-5)
    lp = torch.zeros(2, 3)
    mask = torch.ones(2, 3, dtype=torch.bool)
    a = torch.tensor([1.0, -1.0])
    loss, stats = grpo_loss(lp, lp, lp, a, mask)
    assert loss.item() == pytest.approx(0.0) and stats["tis_weight_mean"] == 1.0
    # the rollout thought the tokens far less likely: weights truncated at the cap
    loss, stats = grpo_loss(lp, lp, lp - 3.0, torch.tensor([1.0, 1.0]), mask, tis_cap=2.0)
    assert loss.item() == pytest.approx(-2.0)
    # a large ratio is clipped for a positive advantage
    loss, stats = grpo_loss(lp + 1.0, lp, lp, torch.tensor([1.0, 1.0]), mask, clip=0.2)
    assert loss.item() == pytest.approx(-1.2) and stats["clip_fraction"] == 1.0
    # clipped only where the clipped term is taken (verl's pg_clipfrac): a ratio below the band with a positive
    # advantage, or above it with a negative one, keeps its gradient
    ratios = torch.tensor([[1.5, 0.5], [1.5, 0.5]]).log()
    _, stats = grpo_loss(ratios, torch.zeros(2, 2), torch.zeros(2, 2), torch.tensor([1.0, -1.0]), torch.ones(2, 2) > 0)
    assert stats["clip_fraction"] == 0.5
    with pytest.raises(ValueError, match="do not split into groups of 4"):
        group_advantages(torch.zeros(6), 4)
    with pytest.raises(ValueError, match="groups of at least 2, got 1"):
        group_advantages(torch.zeros(6), 1)


def test_score_centering_vanishes_on_policy():
    model = build_model("smoke", seed=0)
    engine = TorchEngine(model, dtype=torch.float32)
    trajectories = engine.generate([[1, 2, 3], [4, 5]], SamplingParams(max_new_tokens=4, record_topk=5, seed=1))
    batch = SequenceBatch.of(trajectories)
    assert batch.topk_ids.shape == (2, batch.tokens.shape[1] - 1, 5)
    _, log_p = token_logprobs(model, batch, topk=True)
    centered = score_centering(log_p, batch, tis_cap=2.0)[batch.response]
    assert centered.abs().max() < 1e-4  # training policy = sampler: nothing to correct
    shifted = SequenceBatch.of(trajectories)
    shifted.topk_logprobs = shifted.topk_logprobs - 1.5  # the sampler gave its top-k a fifth of the mass: IS truncates
    assert score_centering(log_p, shifted, tis_cap=2.0)[batch.response].abs().max() > 1e-3
    # a sampler whose top-k sums above 1 (float32 rounding of a peaked distribution) leaves no tail: a is 0, and
    # the correction is m log p, as where the tail is empty (it had gone negative, pushing p up past m)
    peaked = SequenceBatch.of(trajectories)
    peaked.topk_logprobs = peaked.topk_logprobs - peaked.topk_logprobs.logsumexp(-1, keepdim=True) + 1e-6
    m = torch.minimum(log_p.exp(), 2.0 * peaked.topk_logprobs.exp())
    expected = (m * log_p).sum(-1)[batch.response]
    assert torch.equal(score_centering(log_p, peaked, tis_cap=2.0)[batch.response], expected)
    with pytest.raises(ValueError, match="record_topk"):
        token_logprobs(model, SequenceBatch.of(engine.generate([[1, 2]], SamplingParams(max_new_tokens=2))), topk=True)


def test_token_logprobs_hold_one_chunk_of_logits_at_a_time(monkeypatch):
    """Chunked, the same log-probabilities (and top-k ones) and gradients, to
    rounding; lm_head never yields more positions than a chunk,
    once per chunk in the forward and once again in the backward."""
    model = build_model("smoke", seed=0)
    engine = TorchEngine(model, dtype=torch.float32)
    batch = SequenceBatch.of(engine.generate([[1, 2, 3], [4, 5]], SamplingParams(max_new_tokens=8, record_topk=3)))

    def logprobs_and_grads():
        model.zero_grad()
        picked, at_topk = token_logprobs(model, batch, temperature=0.7, topk=True)
        (picked.sum() + at_topk.sum()).backward()
        return picked.detach(), at_topk.detach(), [p.grad.clone() for p in model.parameters()]

    whole = logprobs_and_grads()
    monkeypatch.setattr(rl, "LOGITS_CHUNK", 3)
    widths = []
    model.lm_head.register_forward_hook(lambda module, args, out: widths.append(out.shape[1]))
    chunked = logprobs_and_grads()
    positions = batch.tokens.shape[1] - 1  # each predicts the next token
    per_chunk = [3] * (positions // 3) + ([positions % 3] if positions % 3 else [])
    assert len(per_chunk) > 2 and sorted(widths) == sorted(2 * per_chunk)
    # lm_head's matmul over fewer rows may round a logit differently in its last bit
    assert all(torch.allclose(a, b, rtol=1e-6, atol=1e-6) for a, b in zip(whole[:2], chunked[:2]))
    assert all((a - b).abs().max() <= 1e-5 * a.abs().max() for a, b in zip(whole[2], chunked[2]))
    one_token = SequenceBatch.of([Trajectory(0, [1], [], [], "length"), Trajectory(1, [2], [], [], "length")])
    assert token_logprobs(model, one_token).shape == (2, 0)  # nothing to predict: one empty chunk


@pytest.fixture(scope="module")
def per_token_step(tmp_path_factory, native_bf16):
    """The tiny preset's rollout with per-token NVFP4 activation global scales
    (SGLang nvfp4_online), fully captured, its guidance written and loaded back."""
    quant = replace(rollout_config("fp4_wa_kv"), activation_global_scale="per_token")
    return captured_step(tmp_path_factory, "tiny", quant)


def test_per_token_rollout_captures_each_rows_global_scale(per_token_step):
    engine, out, records, mb = per_token_step
    assert not any(site in ("moe_in", "moe_down_in") for _, site in engine.global_scales)  # none calibrated
    for (layer, site), table in records.tables.items():
        if site in ("moe_in", "moe_down_in"):
            assert table.global_scale is None and table.row_global_scales.shape == (len(table.traj), 1)
            # each row's scale is its own amax / (6 * 448): the largest block scale of every row is 448
            assert (table.scales.view(torch.float8_e4m3fn).float().amax(-1) == 448).all()
            assert torch.equal(mb.tables[(layer, site)].row_global_scales, table.row_global_scales)
        else:  # the KV cache keeps its static scale
            assert table.row_global_scales is None and table.global_scale == float(engine.global_scales[(layer, site)])


def test_trace_reproduces_a_per_token_rollout(per_token_step):
    """RTN recomputes each row's scale from the training values; guided rounding
    takes the rollout's row scales and codes, and so rounds as the rollout did."""
    engine, out, records, mb = per_token_step
    qat, trace = (against_rollout(engine, out, records, mb, method) for method in ("qat", "trace"))
    assert trace.mismatched < 0.1 * qat.mismatched
    assert trace.metrics["logprob_abs_diff_mean"] < qat.metrics["logprob_abs_diff_mean"]
    for (layer, site), table in trace.codes.tables.items():  # the training capture holds the scales it used
        if site == "moe_in":  # every row guided: the rollout's own scales
            rollout = records.tables[(layer, site)]
            assert torch.equal(table.row_global_scales, rollout.row_global_scales)


def test_guidance_of_another_global_scale_mode_is_refused(per_token_step):
    engine, out, _, mb = per_token_step
    batch = SequenceBatch.of(out)
    sites = TrainingSites(
        replace(engine.quant, activation_global_scale="static"),
        "trace",
        engine.global_scales,
        trajectories=batch.trajectories,
        seq_len=batch.tokens.shape[1],
        guidance=mb,
    )
    with pytest.raises(GuidanceError, match="captured under per-token global scales, training uses static ones"):
        token_logprobs(engine.model, batch, sites)


def test_a_round_with_per_token_global_scales(tmp_path):
    """End to end (steps.run_round, the pipeline's three steps in one process):
    the rollout's per-token scales reach the store, training is guided under
    them, and its code mismatch against the rollout's full capture is far below
    RTN's (qat), which recomputes each row's scale from the training values."""
    base = get_preset("smoke").model_dump()
    base["bootstrap"]["enabled"] = False
    base["rollout"]["activation_global_scale"] = "per_token"
    base["guidance"].update(layers="all", bits=4, compaction="offline")
    base["rl"]["measure_mismatch"] = True
    base["train"]["precision"] = "bf16"  # against the float32 rollout: other numerics, so RTN's codes flip
    history = {}
    for method in ("qat", "trace"):
        config = RunConfig.model_validate({**base, "method": method, "store": {"uri": (tmp_path / "s").as_uri()}})
        work = tmp_path / method
        steps.prepare(config, work / "p0", "run", work / "s0")
        (history[method],) = steps.run_round(config, work / "p0", work / "s0", 0, work / "p1", work / "s1", work, "run")
        records = read_step(steps._store(config), 0, steps.store_prefix(config, "run", "capture"))
        scales = {site: t.row_global_scales is not None for (_, site), t in records.tables.items()}
        assert scales == {"moe_in": True, "moe_down_in": True, "k_cache": False, "v_cache": False}
    assert history["trace"]["guidance_coverage"] > 0.9 and history["qat"]["guidance_coverage"] is None
    assert history["trace"]["code_mismatch"] < 0.1 * history["qat"]["code_mismatch"]


def guided_by(table: SiteTable, scale: torch.Tensor, seq_len: int) -> TrainingSites:
    """TRACE's NVFP4 sites for a microbatch of trajectory 0 alone, guided by ``table``."""
    key = (table.layer, table.site)
    guidance = MicrobatchGuidance([0], {key: table}, [])
    quant = QuantConfig("nvfp4", "nvfp4", None)
    return TrainingSites(quant, "trace", {key: scale}, trajectories=[0], seq_len=seq_len, guidance=guidance)


def test_guided_values_in_float32_are_exactly_the_guided_codes():
    """Training values far from the rollout's (some guided to the farther neighbour)
    come out of the guided forward as the dequantized guided codes, bit for bit."""
    gen = torch.Generator().manual_seed(0)
    rollout = torch.randn(512, 64, generator=gen)
    scale = torch.tensor(0.0123)
    q = quantize(rollout, "nvfp4", global_scale=scale)
    n = len(rollout)
    zeros = torch.zeros(n, dtype=torch.long)
    table = SiteTable(
        0, "moe_in", "nvfp4", 4, 64, float(scale), zeros, torch.arange(n), zeros, torch.full((n,), -1),
        q.codes, q.scales.view(torch.uint8),
    )  # fmt: skip
    sites = guided_by(table, scale, n)
    train = rollout + torch.randn(512, 64, generator=gen) * 0.3
    expected = dequantize(quantize(train, "nvfp4", guide=table.guidance()))
    assert torch.equal(sites.moe_in(0, train), expected)


def test_an_experts_guidance_follows_it_to_another_slot():
    """A token training routes to the rollout's two experts in the other order
    (near-tied router scores) is guided all the same: a ``moe_down_in`` row is
    the token's input to an expert, whichever slot holds it; and the captures of
    the two paths join on the same rows."""
    tokens, k, width = 4, 2, 32
    scale = torch.tensor(0.01)
    h = torch.randn(tokens * k, width, generator=torch.Generator().manual_seed(0))
    q = quantize(h, "nvfp4", global_scale=scale)
    pos, slot = torch.arange(tokens).repeat_interleave(k), torch.arange(k).repeat(tokens)
    zeros = torch.zeros(tokens * k, dtype=torch.long)
    rollout = SiteTable(
        0, "moe_down_in", "nvfp4", 4, width, float(scale), zeros, pos, slot, torch.tensor([3, 5] * tokens),
        q.codes, q.scales.view(torch.uint8),
    )  # fmt: skip
    sites = guided_by(rollout, scale, tokens)
    swapped = h.view(tokens, k, width).flip(1).reshape(-1, width)  # expert 5's input first
    expert_rows = ExpertRows(torch.tensor([[5, 3]] * tokens), 8, grouped=False)
    out = expert_rows.rows(sites.moe_down_in(0, expert_rows.layout(swapped), expert_rows))
    assert sites.coverage.rate == 1.0
    assert torch.equal(out.view(tokens, k, width).flip(1).reshape(-1, width), dequantize(q))
    training = replace(rollout, slot=slot, expert=torch.tensor([5, 3] * tokens))
    rows, train_rows = join_rows(rollout, training)
    assert rows.tolist() == list(range(tokens * k)) and train_rows.tolist() == [1, 0, 3, 2, 5, 4, 7, 6]
