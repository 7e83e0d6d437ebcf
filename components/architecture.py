"""The policy's architecture (:class:`ModelConfig`) and the named presets,
without torch: the run config (:mod:`tracefp4.schemas`) checks a preset's
layers and the CLI lists presets without loading the model code
(:mod:`.model`), and :mod:`.checkpoint` maps a config to and from Hugging
Face config.json."""

from dataclasses import dataclass, field

MODEL_TYPES = ("qwen3_moe", "qwen2_moe", "qwen3_5_moe")
LAYER_TYPES = ("full_attention", "linear_attention")


@dataclass(frozen=True)
class ModelConfig:
    """Architecture of the policy (:mod:`.checkpoint` maps it to and from Hugging Face config.json)."""

    model_type: str = "qwen3_moe"
    vocab_size: int = 512
    hidden_size: int = 256
    num_layers: int = 4
    num_heads: int = 4
    num_kv_heads: int = 2
    head_dim: int = 64
    num_experts: int = 8
    top_k: int = 2
    moe_intermediate_size: int = 256
    intermediate_size: int = 512  # dense MLP layers (mlp_only_layers, decoder_sparse_step)
    shared_expert_intermediate_size: int = 0  # qwen2_moe's shared expert
    norm_topk_prob: bool = True
    decoder_sparse_step: int = 1
    mlp_only_layers: tuple[int, ...] = ()
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    max_position_embeddings: int = 4096
    tie_word_embeddings: bool = False
    qkv_bias: bool = False
    qk_norm: bool = True
    # qwen3_5_moe: per-layer mixer ("full_attention" | "linear_attention"; empty: all full attention),
    # the gated full attention, and the Gated DeltaNet sizes
    layer_types: tuple[str, ...] = ()
    attn_output_gate: bool = False
    partial_rotary_factor: float = 1.0
    norm_unit_offset: bool = False  # RMSNorm scales by 1 + weight
    linear_num_key_heads: int = 0
    linear_num_value_heads: int = 0
    linear_key_head_dim: int = 0
    linear_value_head_dim: int = 0
    linear_conv_kernel_dim: int = 4
    extra: dict = field(default_factory=dict, compare=False)  # other config.json keys, kept on save

    def __post_init__(self):
        if self.model_type not in MODEL_TYPES:
            raise ValueError(f"unsupported model_type {self.model_type!r}; expected one of {MODEL_TYPES}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_heads {self.num_heads} is not a multiple of num_kv_heads {self.num_kv_heads}")
        if not 0 < self.top_k <= self.num_experts:
            raise ValueError(f"top_k {self.top_k} must lie in 1..num_experts ({self.num_experts})")
        if self.layer_types and len(self.layer_types) != self.num_layers:
            raise ValueError(f"layer_types lists {len(self.layer_types)} layers, num_layers is {self.num_layers}")
        if not set(self.layer_types) <= set(LAYER_TYPES):
            raise ValueError(f"layer_types {sorted(set(self.layer_types))} must be among {LAYER_TYPES}")
        if not 0 < self.partial_rotary_factor <= 1 or int(self.head_dim * self.partial_rotary_factor) % 2:
            raise ValueError(f"partial_rotary_factor {self.partial_rotary_factor} must rotate an even part of a head")
        sizes = (self.linear_num_key_heads, self.linear_num_value_heads, self.linear_key_head_dim)
        if self.linear_layers and min(*sizes, self.linear_value_head_dim, self.linear_conv_kernel_dim - 1) < 1:
            raise ValueError("linear_attention layers need linear head counts and dims >= 1 and a conv kernel >= 2")

    def is_linear(self, layer: int) -> bool:
        """Whether a layer mixes tokens with Gated DeltaNet instead of softmax attention."""
        return bool(self.layer_types) and self.layer_types[layer] == "linear_attention"

    @property
    def attention_layers(self) -> list[int]:
        """The full-attention layers: the ones with a KV cache."""
        return [i for i in range(self.num_layers) if not self.is_linear(i)]

    @property
    def linear_layers(self) -> list[int]:
        return [i for i in range(self.num_layers) if self.is_linear(i)]

    @property
    def rotary_dim(self) -> int:
        return int(self.head_dim * self.partial_rotary_factor)

    def is_sparse(self, layer: int) -> bool:
        """Whether a layer's MLP is the routed MoE (transformers' rule)."""
        return (
            layer not in self.mlp_only_layers and self.num_experts > 0 and (layer + 1) % self.decoder_sparse_step == 0
        )

    @property
    def sparse_layers(self) -> list[int]:
        return [i for i in range(self.num_layers) if self.is_sparse(i)]


# Named presets: seeded random weights, no downloads.
PRESETS = {
    # ~7.35M parameters: 4 layers, 8 experts top-2; the default for `make run`
    "tiny": ModelConfig(),
    # ~0.16M parameters for fast tests
    "smoke": ModelConfig(
        vocab_size=256,
        hidden_size=64,
        num_layers=2,
        num_heads=2,
        num_kv_heads=1,
        head_dim=32,
        num_experts=4,
        top_k=2,
        moe_intermediate_size=64,
        intermediate_size=128,
    ),
    # qwen2_moe flavour of tiny: shared expert with a sigmoid gate, qkv bias
    "tiny-qwen2": ModelConfig(
        model_type="qwen2_moe",
        shared_expert_intermediate_size=256,
        qkv_bias=True,
        qk_norm=False,
        norm_topk_prob=False,
    ),
    # qwen3_5_moe flavour, 2.2M parameters: 3 Gated DeltaNet layers then 1 gated full-attention layer (the
    # published 3:1 pattern), shared expert, a quarter of each head rotated
    "tiny-qwen35": ModelConfig(
        model_type="qwen3_5_moe",
        hidden_size=128,
        num_heads=4,
        num_kv_heads=2,
        head_dim=32,
        moe_intermediate_size=128,
        intermediate_size=128,  # no dense layers: transformers reads none, config_from_hf defaults it to this
        shared_expert_intermediate_size=128,
        rope_theta=10_000_000.0,
        layer_types=("linear_attention",) * 3 + ("full_attention",),
        attn_output_gate=True,
        partial_rotary_factor=0.25,
        norm_unit_offset=True,
        linear_num_key_heads=2,
        linear_num_value_heads=4,
        linear_key_head_dim=32,
        linear_value_head_dim=32,
    ),
}

# The paper's policy, Qwen3.5-35B-A3B (described, never built here: the paper presets load its checkpoint).
# Sources: transformers 5.24 Qwen3_5MoeTextConfig, whose defaults document "Qwen/Qwen3.5-35B-A3B" (40 layers,
# hidden 2048, 16 heads / 2 KV heads of 256, Gated DeltaNet 16 key / 32 value heads of 128, 256 experts top-8 of
# 512 plus a 512 shared expert, vocab 248320, full attention every 4th layer); the transformers model doc
# (docs/source/en/model_doc/qwen3_5_moe.md: "3:1 Gated DeltaNet/Gated Attention", "8 routed experts ... plus 1
# shared expert"); rope theta 1e7 and rotary percent 0.25 from the miles recipe
# (https://www.radixark.com/miles/docs/models/qwen/qwen3-5-moe); context 262144 as in the Qwen3.5 configs on the Hub.
# Special tokens, from a transcript of the checkpoint's Qwen3_5MoeForConditionalGeneration config.json (public
# code search): top level eos_token_id 248046, pad_token_id 248044, image 248056, video 248057, vision start/end
# 248053/248054; text_config bos/eos 248044.
QWEN35_35B_A3B = ModelConfig(
    model_type="qwen3_5_moe",
    vocab_size=248320,
    hidden_size=2048,
    num_layers=40,
    num_heads=16,
    num_kv_heads=2,
    head_dim=256,
    num_experts=256,
    top_k=8,
    moe_intermediate_size=512,
    intermediate_size=512,
    shared_expert_intermediate_size=512,
    rope_theta=10_000_000.0,
    max_position_embeddings=262144,
    layer_types=tuple("full_attention" if (i + 1) % 4 == 0 else "linear_attention" for i in range(40)),
    attn_output_gate=True,
    partial_rotary_factor=0.25,
    norm_unit_offset=True,
    linear_num_key_heads=16,
    linear_num_value_heads=32,
    linear_key_head_dim=128,
    linear_value_head_dim=128,
    extra={"bos_token_id": 248044, "eos_token_id": 248044},
)


def get_preset(name: str) -> ModelConfig:
    try:
        return PRESETS[name]
    except KeyError:
        raise ValueError(f"unknown model preset {name!r}; expected one of {sorted(PRESETS)}") from None
