"""The policy model: logits equal transformers' on the same checkpoint, and
checkpoints round-trip in the Hugging Face layout."""

import dataclasses
import json
import logging
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F
import transformers

from tracefp4.components.architecture import PRESETS
from tracefp4.components.checkpoint import config_from_hf, config_to_hf, load_model, save_model
from tracefp4.components.model import CausalAttention, ExpertRows, build_model, grouped_matmuls, right_pad
from tracefp4.components.quant_config import ROLLOUT_CONFIGS, QuantConfig, quant_sites, rollout_config

logging.getLogger("transformers").setLevel(logging.ERROR)


def hf_model(kind: str, **changes):
    """A small random transformers model of ``kind`` (``changes``: config fields over the defaults here)."""
    common = {
        "vocab_size": 96,
        "hidden_size": 64,
        "intermediate_size": 96,
        "moe_intermediate_size": 32,
        "num_hidden_layers": 3,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "num_experts": 4,
        "num_experts_per_tok": 2,
    }
    if kind.startswith("qwen3_moe"):  # qwen3_moe-bias: attention_bias, which gives o_proj a bias too
        bias = kind.endswith("bias")
        fields = {**common, "head_dim": 16, "norm_topk_prob": True, "mlp_only_layers": [1], "attention_bias": bias}
        model = transformers.Qwen3MoeForCausalLM(transformers.Qwen3MoeConfig(**fields | changes))
    else:
        fields = {**common, "shared_expert_intermediate_size": 48, "decoder_sparse_step": 1}
        model = transformers.Qwen2MoeForCausalLM(transformers.Qwen2MoeConfig(**fields | changes))
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():  # non-trivial norms and biases, so that every parameter matters
        for name, p in model.named_parameters():
            if "norm" in name or name.endswith("bias"):
                p.copy_(torch.randn(p.shape, generator=gen) * 0.1 + ("norm" in name))
    return model.eval()


@pytest.mark.parametrize("kind", ["qwen3_moe", "qwen3_moe-bias", "qwen2_moe"])
def test_logits_equal_transformers(kind, tmp_path):
    reference = hf_model(kind)
    reference.save_pretrained(tmp_path / "hf", max_shard_size="60KB")  # sharded, with an index
    assert (tmp_path / "hf" / "model.safetensors.index.json").exists()
    ours = load_model(tmp_path / "hf").eval()
    assert ours.cfg.model_type == kind.removesuffix("-bias")
    tokens = torch.randint(0, 96, (3, 17), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected = reference(tokens).logits
        got = ours(tokens, torch.arange(17).expand(3, 17))
    assert (got - expected).abs().max().item() < 1e-4


def assert_logits_equal_transformers(reference, ours, lengths: tuple[int, ...], cached_decode: bool = True) -> None:
    """``ours`` (loaded from ``reference``'s checkpoint) gives ``reference``'s
    float32 logits on prompts of ``lengths`` in one right-padded batch (the
    batches tracefp4 runs): against each prompt alone, against transformers'
    own left-padded batch with its attention mask (positions counted from each
    prompt's first token, as its generate counts them), and against
    transformers' prefill of the longest prompt but its last 8 tokens, then
    decoded token by token from its KV cache and recurrent states
    (``cached_decode``)."""
    vocab = reference.config.get_text_config().vocab_size
    gen = torch.Generator().manual_seed(1)
    sequences = [torch.randint(0, vocab, (n,), generator=gen).tolist() for n in lengths]
    tokens, positions, _ = right_pad(sequences)
    longest = max(lengths)
    left = torch.zeros(len(lengths), longest, dtype=torch.long)
    mask = torch.zeros_like(left)
    for row, seq in enumerate(sequences):
        left[row, longest - len(seq) :], mask[row, longest - len(seq) :] = torch.tensor(seq), 1
    with torch.no_grad():
        got = ours(tokens, positions)
        left_padded = reference(
            input_ids=left, attention_mask=mask, position_ids=(mask.cumsum(-1) - 1).clamp(min=0), use_cache=False
        ).logits
        for row, seq in enumerate(sequences):
            alone = reference(torch.tensor([seq]), use_cache=False).logits[0]
            torch.testing.assert_close(got[row, : len(seq)], alone, rtol=0, atol=1e-4, msg=f"prompt {row} alone")
            torch.testing.assert_close(
                got[row, : len(seq)], left_padded[row, longest - len(seq) :], rtol=0, atol=1e-4, msg=f"left {row}"
            )
        if cached_decode:
            row, start = lengths.index(longest), longest - 8
            out = reference(tokens[row : row + 1, :start], use_cache=True)
            steps = [out.logits[0]]
            for t in range(start, longest):
                out = reference(tokens[row : row + 1, t : t + 1], cache=out.cache, use_cache=True)
                steps.append(out.logits[0])
            torch.testing.assert_close(got[row], torch.cat(steps), rtol=0, atol=1e-4, msg="transformers' decode")


@pytest.mark.parametrize(
    "kind, changes",
    [
        # dense MLP layers by decoder_sparse_step and mlp_only_layers, top-k weights left unnormalized
        ("qwen3_moe", {"decoder_sparse_step": 2, "mlp_only_layers": [2], "norm_topk_prob": False}),
        # tied embeddings, heads wider than hidden_size / heads, another RoPE base, the router's aux-loss fields
        (
            "qwen3_moe",
            {
                "tie_word_embeddings": True,
                "head_dim": 24,
                "rope_parameters": {"rope_type": "default", "rope_theta": 1e6},
                "output_router_logits": True,
                "router_aux_loss_coef": 0.5,
                "num_key_value_heads": 4,
            },
        ),
        (
            "qwen2_moe",
            {
                "norm_topk_prob": True,
                "decoder_sparse_step": 2,
                "qkv_bias": False,
                "head_dim": 24,
                "tie_word_embeddings": True,
                "num_experts_per_tok": 4,
            },
        ),
    ],
)
def test_config_edge_cases_give_transformers_logits(kind, changes, tmp_path):
    reference = hf_model(kind, **changes)
    reference.save_pretrained(tmp_path / "hf")
    ours = load_model(tmp_path / "hf").eval()
    assert_logits_equal_transformers(reference, ours, (17, 5, 11))


@pytest.mark.parametrize("kind", ["qwen3_moe", "qwen2_moe", "qwen3_5_moe_text"])
def test_a_config_without_head_sizes_reads_transformers_defaults(kind):
    """Where config.json leaves out num_key_value_heads or head_dim,
    transformers reads its config class's defaults: fixed KV head counts, and
    for Qwen3.5 heads of 256, not hidden_size // num_attention_heads. A
    checkpoint so written loaded with the other sizes, or failed naming a
    projection's shape instead."""
    preset = {"qwen3_moe": "tiny", "qwen2_moe": "tiny-qwen2", "qwen3_5_moe_text": "tiny-qwen35"}[kind]
    hf = config_to_hf(dataclasses.replace(PRESETS[preset], num_heads=16, hidden_size=64))
    del hf["num_key_value_heads"], hf["head_dim"]
    reference = transformers.AutoConfig.for_model(kind, **{k: v for k, v in hf.items() if k != "model_type"})
    cfg = config_from_hf(hf)
    assert cfg.num_kv_heads == reference.num_key_value_heads
    assert cfg.head_dim == (getattr(reference, "head_dim", None) or 64 // 16)  # as its attention layers read it


@pytest.mark.parametrize("kind", ["qwen3_moe", "qwen2_moe"])
def test_saved_checkpoints_load_in_transformers(kind, tmp_path):
    model = build_model("smoke" if kind == "qwen3_moe" else "tiny-qwen2", seed=3)
    save_model(model, tmp_path / "ours", max_shard_bytes=200_000)
    index = json.loads((tmp_path / "ours" / "model.safetensors.index.json").read_text())
    assert "model.layers.0.mlp.experts.0.gate_proj.weight" in index["weight_map"]  # the Hub's per-expert layout
    assert "model.layers.0.self_attn.q_proj.weight" in index["weight_map"]
    reference = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "ours").eval()
    tokens = torch.randint(0, model.cfg.vocab_size, (2, 9))
    with torch.no_grad():
        assert (reference(tokens).logits - model(tokens, torch.arange(9).expand(2, 9))).abs().max() < 1e-4
    again = load_model(tmp_path / "ours")
    for (name, a), b in zip(model.state_dict().items(), again.state_dict().values()):
        assert torch.equal(a, b), name


def test_save_replaces_atomically(tmp_path):
    save_model(build_model("smoke", seed=1), tmp_path / "ckpt")
    save_model(build_model("smoke", seed=2), tmp_path / "ckpt")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"]  # no temporary or old folder left
    assert torch.equal(load_model(tmp_path / "ckpt").lm_head.weight, build_model("smoke", seed=2).lm_head.weight)


def test_checkpoint_errors_name_the_problem(tmp_path):
    (tmp_path / "pickled").mkdir()
    (tmp_path / "pickled" / "config.json").write_text(json.dumps(config_to_hf(PRESETS["smoke"])))
    (tmp_path / "pickled" / "pytorch_model.bin").write_bytes(b"")
    with pytest.raises(FileNotFoundError, match=r"pickle files \['pytorch_model.bin'\]"):
        load_model(tmp_path / "pickled")
    with pytest.raises(
        ValueError, match="model_type 'llama'; tracefp4 loads qwen3_moe, qwen2_moe, qwen3_5_moe \\(and qwen3_5_moe_text"
    ):
        config_from_hf({"model_type": "llama"})
    save_model(build_model("smoke"), tmp_path / "small")
    cfg = json.loads((tmp_path / "small" / "config.json").read_text())
    cfg["num_hidden_layers"] = 3
    (tmp_path / "small" / "config.json").write_text(json.dumps(cfg))
    (tmp_path / "small" / "checksums.json").unlink()  # a hand-edited config no longer matches its checksum
    with pytest.raises(ValueError, match="missing .*model.layers.2"):
        load_model(tmp_path / "small")


def test_presets_are_seeded_and_sized():
    tiny = build_model("tiny", seed=0)
    n = sum(p.numel() for p in tiny.parameters())
    assert 5e6 <= n <= 10e6
    assert tiny.cfg.num_experts == 8 and tiny.cfg.top_k == 2
    assert torch.equal(build_model("smoke", seed=7).lm_head.weight, build_model("smoke", seed=7).lm_head.weight)
    assert not torch.equal(build_model("smoke", seed=7).lm_head.weight, build_model("smoke", seed=8).lm_head.weight)
    with pytest.raises(ValueError, match="unknown model preset 'huge'"):
        build_model("huge")


def test_right_padding_does_not_change_real_positions(monkeypatch):
    """Causality alone keeps right padding out of the real positions: the
    full-sequence forward builds no mask and runs SDPA's causal kernel (a mask
    of its S x S positions would take 69 GB at 262,144 tokens)."""
    model = build_model("smoke", seed=0)
    tokens = torch.randint(0, 256, (1, 7))
    padded = torch.cat([tokens, torch.zeros(1, 5, dtype=torch.long)], 1)
    calls = []
    sdpa = F.scaled_dot_product_attention
    monkeypatch.setattr(F, "scaled_dot_product_attention", lambda *a, **kw: calls.append(kw) or sdpa(*a, **kw))
    with torch.no_grad():
        alone = model(tokens, torch.arange(7)[None])
        batch = model(padded, torch.arange(12)[None], CausalAttention())
    assert (alone - batch[:, :7]).abs().max() < 1e-5
    assert calls and all(kw["attn_mask"] is None and kw["is_causal"] for kw in calls)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_logits_at_one_position_per_row_are_those_of_the_full_forward(dtype):
    """``logits_at`` projects one position per row (a prefill's last), the
    rows the full forward gives there up to the lm_head matmul's summation
    order (3 rows against 27: on an AVX512 AMD EPYC the float32 rows differed
    in the last bits); the layers alone (``hidden_states``) are what the final
    norm and lm_head read."""
    model = build_model("smoke", seed=0, dtype=dtype)
    tokens, positions = torch.randint(0, 256, (3, 9)), torch.arange(9).expand(3, 9)
    at = torch.tensor([8, 0, 4])
    with torch.no_grad():
        full = model(tokens, positions)
        picked = model(tokens, positions, logits_at=at)
        hidden = model.hidden_states(tokens, positions)
    assert picked.shape == (3, 256)
    torch.testing.assert_close(picked, full[torch.arange(3), at])
    assert torch.equal(model.lm_head(model.model.norm(hidden)), full)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_a_decode_steps_query_heads_attend_as_rows_of_their_kv_head(monkeypatch, dtype, native_bf16):
    """A single query per head with a mask (a decode step) goes to SDPA as
    its KV head's rows of queries, ``[B, KV, H/KV, D]``: the values of each
    head attending on its own, up to the order of float32 sums (the kernel
    multiplies several rows at once), also where the kernel returns its
    output transposed in memory, as CUDA's memory-efficient kernel does;
    prefill and training (several queries, causal) keep one query row per
    position. torch's bf16 kernel on both sides, also on a CPU without bf16
    units (the reference is SDPA called plainly, which emulation skips)."""
    from tracefp4.components.model import attention

    gen = torch.Generator().manual_seed(0)
    q = torch.randn(5, 8, 1, 32, generator=gen).to(dtype)
    k, v = (torch.randn(5, 2, 40, 32, generator=gen).to(dtype) for _ in range(2))
    mask = torch.rand(5, 1, 1, 40, generator=gen) > 0.3
    mask[:, ..., 0] = True
    calls = []
    sdpa = F.scaled_dot_product_attention
    monkeypatch.setattr(
        F, "scaled_dot_product_attention", lambda q, *a, **kw: calls.append(q.shape) or sdpa(q, *a, **kw)
    )
    out = attention(q, k, v, mask)
    assert calls == [(5, 2, 4, 32)]
    alone = sdpa(q, k, v, attn_mask=mask, enable_gqa=True)
    torch.testing.assert_close(out, alone)
    attention(q.expand(5, 8, 8, 32), k[:, :, :8], v[:, :, :8])  # a whole block of 4 queries: none added
    assert calls[1:] == [(5, 8, 8, 32)]

    def memory_efficient_layout(q, *args, **kw):  # CUDA's kernel writes [B, queries, heads, D] and transposes it
        return sdpa(q, *args, **kw).transpose(1, 2).contiguous().transpose(1, 2)

    monkeypatch.setattr(F, "scaled_dot_product_attention", memory_efficient_layout)
    torch.testing.assert_close(attention(q, k, v, mask), alone)


def test_quantization_sites():
    cfg = PRESETS["smoke"]
    assert quant_sites(cfg, rollout_config("bf16")) == []
    sites = quant_sites(cfg, rollout_config("fp4_wa_kv"))
    assert (0, "expert_weights") in sites and (1, "moe_down_in") in sites and (1, "v_cache") in sites
    assert len(sites) == cfg.num_layers * 5
    assert {s for _, s in quant_sites(cfg, rollout_config("fp4_kv"))} == {"k_cache", "v_cache"}
    assert rollout_config("w4a8_mxfp4_kv", "nvfp4") == QuantConfig("nvfp4", "fp8", "mxfp4")
    assert len(ROLLOUT_CONFIGS) == 6
    with pytest.raises(ValueError, match="unknown rollout config"):
        rollout_config("fp3")
    with pytest.raises(ValueError, match="kv format 'fp8'"):
        QuantConfig(kv="fp8")


@pytest.mark.parametrize("grouped", [False, True])
def test_expert_rows_keep_one_layout_between_the_matmuls(grouped):
    """``ExpertRows`` gathers each (token, slot) row's token into the expert
    layout, multiplies there, and gives rows back in row order (row r: token
    r // k, slot r % k); a site sees the rows in row order with their token,
    slot and expert, and its result goes back into the layout."""
    gen = torch.Generator().manual_seed(0)
    tokens, k, n_experts, width = 5, 2, 4, 8
    experts = torch.stack([torch.randperm(n_experts, generator=gen)[:k] for _ in range(tokens)])
    x = torch.randn(tokens, width, generator=gen)
    weights = torch.randn(n_experts, width, 4, generator=gen)  # grouped_mm: rows of whole 16 bytes
    rows = ExpertRows(experts, n_experts, grouped)
    token_rows = x.repeat_interleave(k, 0)
    assert torch.equal(rows.rows(rows.gather(x)), token_rows)
    assert torch.equal(rows.rows(rows.layout(token_rows)), token_rows)
    expected = torch.stack([token_rows[r] @ weights[e] for r, e in enumerate(experts.reshape(-1).tolist())])
    torch.testing.assert_close(rows.rows(rows.matmul(rows.gather(x), weights)), expected)
    seen = {}

    def site(h, token, slot, expert):
        seen.update(h=h, token=token, slot=slot, expert=expert)
        return h * 2

    doubled = rows.rows(rows.per_row(site, rows.gather(x)))
    assert torch.equal(seen["h"], token_rows) and torch.equal(doubled, 2 * token_rows)
    assert seen["token"].tolist() == [r // k for r in range(tokens * k)]
    assert seen["slot"].tolist() == [r % k for r in range(tokens * k)]
    assert torch.equal(seen["expert"], experts.reshape(-1))
    if not grouped:  # the grid's free cells are zero: SwiGLU keeps them zero, the down matmul reads nothing from them
        assert rows.gather(x).abs().sum(-1).eq(0).sum() == n_experts * rows.width - tokens * k


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_grouped_expert_matmuls_equal_the_padded_grid(monkeypatch, native_bf16, dtype):
    """The CUDA layout of the experts' matmuls (rows sorted by expert, one
    ``F.grouped_mm``; it also runs on the CPU) gives the padded grid's logits
    and gradients up to the order of float32 sums, here forced on the CPU; so
    does the rollout engine with FP4 sites, token for token."""
    from tracefp4.components import model as model_module
    from tracefp4.components.rollout import SamplingParams, TorchEngine

    model = build_model("smoke", seed=3, dtype=dtype)
    tokens = torch.randint(0, model.cfg.vocab_size, (3, 11), generator=torch.Generator().manual_seed(4))
    positions = torch.arange(11).expand(3, -1)
    prompts = tokens[:, :5].tolist()

    def run():
        model.zero_grad()
        logits = model(tokens, positions)
        logits.float().logsumexp(-1).sum().backward()
        grads = {n: p.grad.clone() for n, p in model.named_parameters()}
        engine = TorchEngine(model, rollout_config("fp4_wa_kv"))
        sampled = engine.generate(prompts, SamplingParams(max_new_tokens=6, seed=1))
        return logits.detach(), grads, [(t.response, t.logprobs) for t in sampled]

    grid = run()
    monkeypatch.setattr(model_module, "grouped_matmuls", lambda x, w: True)
    grouped = run()
    # float32 sums may differ in order between the two matmul shapes (MKL's AVX2 kernels do: 1 ulp in 15% of the
    # smoke logits); in bf16 the tolerance is below one ulp, so the bits must be equal
    torch.testing.assert_close(grouped[0], grid[0], rtol=1e-5, atol=1e-6)
    for name in grid[1]:
        torch.testing.assert_close(grouped[1][name], grid[1][name], rtol=1e-5, atol=1e-6, msg=name)
    assert grouped[2] == grid[2]


@pytest.mark.parametrize(
    "capability,grouped", [((8, 0), False), ((8, 9), False), ((9, 0), True), ((10, 0), True), ((12, 0), False)]
)
def test_grouped_matmuls_only_where_torch_has_the_cutlass_kernel(monkeypatch, capability, grouped):
    """Elsewhere torch's grouped_mm syncs with the host at every call (a CUDA graph cannot capture it): bmm serves."""
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)
    x = SimpleNamespace(is_cuda=True, dtype=torch.bfloat16, device="cuda:0")  # a CUDA tensor, as far as it asks
    weights = torch.empty(4, 64, 128, dtype=torch.bfloat16)
    assert grouped_matmuls(x, weights) is grouped
    assert not grouped_matmuls(x, weights.float())
    # rows of whole 16 bytes in both matmuls: the down matmul's are moe_intermediate_size (here 60) wide
    assert not grouped_matmuls(x, torch.empty(4, 64, 120, dtype=torch.bfloat16))
