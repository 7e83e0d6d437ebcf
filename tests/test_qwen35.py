"""Qwen3.5-MoE (``qwen3_5_moe``): logits equal transformers' in both
directions on random small configs with both layer types, and the Gated
DeltaNet's chunked and recurrent forms agree."""

import dataclasses
import importlib.util
import json
import logging

import pytest
import torch
import transformers
from safetensors.torch import save_file
from test_model import assert_logits_equal_transformers

from tracefp4.components.architecture import PRESETS, QWEN35_35B_A3B
from tracefp4.components.checkpoint import config_from_hf, config_to_hf, load_model, save_model
from tracefp4.components.deltanet import causal_conv, chunked_delta_rule, recurrent_delta_rule
from tracefp4.components.export import export
from tracefp4.components.model import CausalAttention, build_model, right_pad
from tracefp4.components.quant_config import rollout_config

logging.getLogger("transformers").setLevel(logging.ERROR)

TEXT = {
    "vocab_size": 96,
    "hidden_size": 32,
    "num_hidden_layers": 4,
    "layer_types": ["linear_attention", "full_attention", "linear_attention", "full_attention"],
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "linear_conv_kernel_dim": 4,
    "linear_key_head_dim": 8,
    "linear_value_head_dim": 12,
    "linear_num_key_heads": 2,
    "linear_num_value_heads": 4,
    "moe_intermediate_size": 16,
    "shared_expert_intermediate_size": 24,
    "num_experts": 4,
    "num_experts_per_tok": 2,
}
VISION = {
    "depth": 1,
    "hidden_size": 16,
    "intermediate_size": 32,
    "num_heads": 2,
    "out_hidden_size": 32,
    "patch_size": 4,
    "temporal_patch_size": 1,
    "num_position_embeddings": 16,
}


def randomize(model: torch.nn.Module, seed: int) -> None:
    """Every parameter random (norms included, so that the 1 + weight form
    matters), except the decays, which keep their (valid, negative) init."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if not name.endswith("A_log"):
                p.copy_(torch.randn(p.shape, generator=gen) * 0.1)


def test_transformers_runs_its_torch_reference():
    """transformers' fast paths (flash-linear-attention, causal-conv1d) are not
    installed, so the oracle below is its plain PyTorch implementation."""
    assert importlib.util.find_spec("fla") is None
    assert importlib.util.find_spec("causal_conv1d") is None


def test_multimodal_checkpoint_logits_equal_transformers(tmp_path, caplog):
    config = transformers.Qwen3_5MoeConfig(text_config=TEXT, vision_config=VISION)
    reference = transformers.Qwen3_5MoeForConditionalGeneration(config).eval()
    randomize(reference, 0)
    reference.save_pretrained(tmp_path / "hf", max_shard_size="40KB")  # sharded, with an index
    index_file = tmp_path / "hf" / "model.safetensors.index.json"
    index = json.loads(index_file.read_text())
    assert any(k.startswith("model.visual.") for k in index["weight_map"])
    # the Hub's checkpoints also carry a multi-token-prediction head
    save_file({"mtp.fc.weight": torch.zeros(4, 4)}, tmp_path / "hf" / "mtp.safetensors")
    index["weight_map"]["mtp.fc.weight"] = "mtp.safetensors"
    index_file.write_text(json.dumps(index))
    config_file = tmp_path / "hf" / "config.json"  # and, as the Hub's configs say, one MTP layer
    hub_config = json.loads(config_file.read_text())
    hub_config["text_config"]["mtp_num_hidden_layers"] = 1
    config_file.write_text(json.dumps(hub_config))
    with caplog.at_level(logging.INFO, "tracefp4.checkpoint"):
        ours = load_model(tmp_path / "hf").eval()
    assert "vision tower is skipped" in caplog.text and "model.visual.*, mtp.*" in caplog.text
    assert ours.cfg.model_type == "qwen3_5_moe" and ours.cfg.linear_layers == [0, 2]
    # saved without the MTP head, and saying so (a server's MTP speculative decoding would look for it)
    assert ours.cfg.extra["mtp_num_hidden_layers"] == 1 and config_to_hf(ours.cfg)["mtp_num_hidden_layers"] == 0
    # 150 tokens: the chunked form runs three chunks of 64, the last one padded
    tokens = torch.randint(0, 96, (2, 150), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected = reference(input_ids=tokens).logits
        got = ours(tokens, torch.arange(150).expand(2, -1))
    assert (got - expected).abs().max().item() < 1e-4
    # exported straight from the Hub folder: the language model, with none of the folder's other weight files
    # (an engine that globs *.safetensors would read the MTP head's)
    export(tmp_path / "hf", tmp_path / "served", rollout_config("bf16"))
    assert sorted(p.name for p in (tmp_path / "served").iterdir()) == [
        "checksums.json", "config.json", "generation_config.json", "model.safetensors",
    ]  # fmt: skip


@pytest.mark.parametrize(
    "changes",
    [
        # full attention first, whole heads rotated at another base, attention biases, tied embeddings, a
        # conv of 2
        {
            "num_hidden_layers": 3,
            "layer_types": ["full_attention", "linear_attention", "linear_attention"],
            "rope_parameters": {"rope_type": "default", "rope_theta": 1e6, "partial_rotary_factor": 1.0},
            "attention_bias": True,
            "tie_word_embeddings": True,
            "linear_conv_kernel_dim": 2,
        },
        # the layer types from full_attention_interval, half of each head rotated (the top-level spelling), as
        # many linear value heads as key heads, a conv of 6, every expert routed
        {
            "layer_types": None,
            "full_attention_interval": 2,
            "partial_rotary_factor": 0.5,
            "linear_num_value_heads": 2,
            "linear_conv_kernel_dim": 6,
            "num_experts_per_tok": 4,
        },
        # linear attention alone (transformers' cache then fails: no decode), heads of hidden_size / heads
        {"layer_types": ["linear_attention"] * 4, "head_dim": 8},
        {"layer_types": ["full_attention"] * 4},
    ],
    ids=["full-first", "interval", "all-linear", "all-full"],
)
def test_config_edge_cases_give_transformers_logits(changes, tmp_path):
    """Past the chunked form's chunk of 64 tokens, in a right-padded batch,
    and against transformers' own cached decode (``assert_logits_equal_transformers``)."""
    reference = transformers.Qwen3_5MoeForCausalLM(transformers.Qwen3_5MoeTextConfig(**TEXT | changes)).eval()
    randomize(reference, 0)
    reference.save_pretrained(tmp_path / "hf")
    ours = load_model(tmp_path / "hf").eval()
    assert ours.cfg.layer_types == tuple(reference.config.layer_types)
    assert_logits_equal_transformers(reference, ours, (150, 5, 64, 65), cached_decode=bool(ours.cfg.attention_layers))


def test_saved_checkpoint_loads_in_transformers(tmp_path):
    model = build_model(dataclasses.replace(PRESETS["tiny-qwen35"], vocab_size=128), seed=3)
    randomize(model, 4)
    save_model(model, tmp_path / "ours", max_shard_bytes=400_000)
    index = json.loads((tmp_path / "ours" / "model.safetensors.index.json").read_text())["weight_map"]
    assert "model.layers.0.linear_attn.in_proj_qkv.weight" in index
    assert "model.layers.3.self_attn.q_proj.weight" in index and "model.layers.0.mlp.experts.0.up_proj.weight" in index
    reference = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "ours").eval()
    assert type(reference).__name__ == "Qwen3_5MoeForCausalLM"
    tokens = torch.randint(0, 128, (2, 70), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        expected = reference(tokens).logits
        got = model(tokens, torch.arange(70).expand(2, -1))
    assert (got - expected).abs().max().item() < 1e-4
    again = load_model(tmp_path / "ours")
    for (name, a), b in zip(model.state_dict().items(), again.state_dict().values()):
        assert torch.equal(a, b), name


def test_config_round_trip_and_paper_model():
    cfg = PRESETS["tiny-qwen35"]
    assert config_from_hf(config_to_hf(cfg)) == cfg
    # the paper's model is transformers' documented Qwen3.5-35B-A3B default
    defaults = transformers.Qwen3_5MoeTextConfig().to_dict()
    facts = config_to_hf(QWEN35_35B_A3B)
    for key in ("vocab_size", "hidden_size", "num_hidden_layers", "layer_types", "num_experts", "head_dim"):
        assert facts[key] == defaults[key], key
    assert QWEN35_35B_A3B.attention_layers == list(range(3, 40, 4))


def test_bad_hybrid_config_is_refused():
    hf = config_to_hf(PRESETS["tiny-qwen35"])
    with pytest.raises(ValueError, match="layer_types"):
        config_from_hf({**hf, "layer_types": ["linear_attention"] * 3})
    with pytest.raises(ValueError, match="text_config"):
        config_from_hf({"model_type": "qwen3_5_moe"})


def delta_inputs(b: int, s: int, seed: int):
    gen = torch.Generator().manual_seed(seed)
    q, k = (torch.randn(b, s, 2, 8, generator=gen) for _ in range(2))
    v = torch.randn(b, s, 4, 6, generator=gen)
    g = -torch.rand(b, s, 4, generator=gen) * 0.5
    beta = torch.rand(b, s, 4, generator=gen)
    return q, k, v, g, beta


@pytest.mark.parametrize("length", [1, 7, 64, 150])
def test_chunked_form_equals_recurrent_form(length):
    q, k, v, g, beta = delta_inputs(2, length, 0)
    start = torch.randn(2, 4, 8, 6, generator=torch.Generator().manual_seed(9))
    o_chunked, s_chunked = chunked_delta_rule(q, k, v, g, beta, start, chunk=16)
    o_recurrent, s_recurrent = recurrent_delta_rule(q, k, v, g, beta, start)
    assert (o_chunked - o_recurrent).abs().max() < 1e-4
    assert (s_chunked - s_recurrent).abs().max() < 1e-4
    # and the state carries: two halves equal the whole
    half = length // 2
    o1, s1 = chunked_delta_rule(*(t[:, :half] for t in (q, k, v, g, beta)), start)
    o2, s2 = chunked_delta_rule(*(t[:, half:] for t in (q, k, v, g, beta)), s1)
    assert (torch.cat([o1, o2], 1) - o_recurrent).abs().max() < 1e-4 and (s2 - s_recurrent).abs().max() < 1e-4
    # in fp32 under training's bf16 autocast (fp32_master) too: autocast rounded the chunked form's matmuls
    with torch.autocast("cpu", dtype=torch.bfloat16):
        o_autocast, s_autocast = chunked_delta_rule(q, k, v, g, beta, start, chunk=16)
    assert (o_autocast - o_recurrent).abs().max() < 1e-4 and (s_autocast - s_recurrent).abs().max() < 1e-4


def test_a_prompts_delta_rule_does_not_depend_on_the_prompts_beside_it():
    """A prefill's longest prompt sets its length S. The causal conv's output
    keeps each head's channels side by side whatever S, so q and k are
    normalized, and the delta rule run, in the same order for a prompt alone
    as beside longer ones: bit for bit, float32 (laid out S apart, the L2
    norm's sums changed with S)."""
    gen = torch.Generator().manual_seed(0)
    x, weight = torch.randn(8, 90, 128, generator=gen), torch.randn(128, 4, generator=gen) * 0.3
    g, beta = -torch.rand(8, 90, 2, generator=gen), torch.rand(8, 90, 2, generator=gen)

    def delta_rule(s):
        q, k, v = causal_conv(x[:, :s], weight).split([32, 32, 64], -1)
        heads = (t.reshape(8, s, 2, -1) for t in (q, k, v))
        return chunked_delta_rule(*heads, g[:, :s], beta[:, :s])[0]

    beside_longer = delta_rule(90)
    for s in (1, 2, 3, 5, 17, 64):
        assert torch.equal(delta_rule(s), beside_longer[:, :s]), s


def test_training_form_switch():
    """The cache-less pass runs either form; both give the model's logits."""
    model = build_model("tiny-qwen35", seed=0)
    tokens = torch.randint(0, 512, (2, 20), generator=torch.Generator().manual_seed(2))
    positions = torch.arange(20).expand(2, -1)
    with torch.no_grad():
        chunked = model(tokens, positions, CausalAttention())
        recurrent = model(tokens, positions, CausalAttention(delta_form="recurrent"))
    assert (chunked - recurrent).abs().max() < 1e-4
    with pytest.raises(ValueError, match="delta_form"):
        CausalAttention(delta_form="fast")


def test_right_padded_batch_equals_each_sequence_alone():
    """Training batches are right-padded: padding comes after each sequence,
    so the causal conv and the delta rule never see it."""
    model = build_model("tiny-qwen35", seed=1)
    gen = torch.Generator().manual_seed(3)
    sequences = [torch.randint(0, 512, (n,), generator=gen).tolist() for n in (5, 12, 70)]
    tokens, positions, lengths = right_pad(sequences)
    with torch.no_grad():
        batch = model(tokens, positions, CausalAttention())
        for row, seq in enumerate(sequences):
            alone = model(torch.tensor([seq]), torch.arange(len(seq))[None])
            assert (batch[row, : len(seq)] - alone[0]).abs().max() < 1e-5


def test_a_multimodal_config_ties_by_its_top_level():
    """transformers ties a Qwen3_5MoeForConditionalGeneration's embeddings as the
    top level's tie_word_embeddings says, whatever its text_config's (it writes both)."""
    wrapper = transformers.Qwen3_5MoeConfig(text_config=TEXT, vision_config=VISION).to_dict()
    for top, text in ((False, True), (True, False)):
        wrapper["tie_word_embeddings"], wrapper["text_config"]["tie_word_embeddings"] = top, text
        assert config_from_hf(wrapper).tie_word_embeddings is top
    # without a top-level value, the wrapper's default (False), not the text_config's: a checkpoint's own
    # lm_head was dropped for the embedding
    del wrapper["tie_word_embeddings"]
    wrapper["text_config"]["tie_word_embeddings"] = True
    assert transformers.Qwen3_5MoeConfig(**wrapper).tie_word_embeddings is False
    assert config_from_hf(wrapper).tie_word_embeddings is False


def test_qwen35_routes_every_layer_whatever_dense_layer_keys_say():
    """transformers' Qwen3.5 has no dense MLP layers: decoder_sparse_step and
    mlp_only_layers (left by a Qwen3-style config) built dense layers its weights lack."""
    cfg = config_from_hf({**transformers.Qwen3_5MoeTextConfig(**TEXT).to_dict(), "decoder_sparse_step": 2})
    assert cfg.sparse_layers == list(range(cfg.num_layers))
    cfg = config_from_hf({**transformers.Qwen3_5MoeTextConfig(**TEXT).to_dict(), "mlp_only_layers": [0]})
    assert cfg.sparse_layers == list(range(cfg.num_layers))
