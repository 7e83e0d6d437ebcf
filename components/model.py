"""The policy: a decoder-only MoE transformer (Hugging Face ``qwen3_moe``,
``qwen2_moe`` and ``qwen3_5_moe``) in one readable file, after gpt-fast's
``model.py``.

RMSNorm, GQA attention with RoPE (and q/k-norm for qwen3_moe), a top-k softmax
router, SwiGLU routed experts stacked per layer, and for qwen2_moe a shared
expert behind a sigmoid gate. qwen3_5_moe is hybrid: its ``linear_attention``
layers mix tokens with Gated DeltaNet (:mod:`.deltanet`), its
``full_attention`` layers gate the attention output per channel
(``attn_output_gate``) and rotate only part of each head
(``partial_rotary_factor``), and its RMSNorms scale by ``1 + weight``
(``norm_unit_offset``). Parameter names follow transformers' layout,
except that routed experts are stacked per layer
(``model.layers.{i}.mlp.experts.gate_up``); :mod:`.checkpoint` maps the Hub's
per-expert weights onto them.

The forward takes two strategies, so that rollout and training share every
line of the model:

- ``attend(layer, q, k, v, sites)``: how attention reads K/V, a full causal
  pass (:class:`CausalAttention`) or the rollout engine's KV cache; for the
  linear-attention layers the same object runs the stateful steps
  (``attend.conv``, ``attend.delta``): over whole sequences, or from the
  engine's per-sequence states;
- ``sites``: what happens at the quantization sites (routed-expert inputs,
  K/V); ``None`` leaves them in the compute dtype.

Its matmuls (:class:`Linear`, the experts' ``bmm``: :class:`ExpertRows`), its
attention (:func:`attention`, for both strategies) and Gated DeltaNet's conv go through
:func:`.device.batch_invariant`: on a CPU a row's bits do not depend on the
rows computed beside it, and a bf16 model on a CPU without bf16 units
computes them in fp32 and rounds to bf16 instead of crawling.
"""

import contextlib
import functools
from dataclasses import dataclass
from typing import Protocol

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint

from tracefp4.kernels import graph_capturing

from .architecture import ModelConfig, get_preset
from .deltanet import GatedDeltaNet, causal_conv, chunked_delta_rule, recurrent_delta_rule
from .device import batch_invariant, size_independent


class RMSNorm(nn.Module):
    """``unit_offset`` (qwen3_5_moe) scales by ``1 + weight`` in float32 before
    rounding; otherwise the float32 result is rounded first and then scaled
    (each as transformers does for that model)."""

    def __init__(self, dim: int, eps: float, unit_offset: bool = False):
        super().__init__()
        self.eps, self.unit_offset = eps, unit_offset
        self.weight = nn.Parameter(torch.zeros(dim) if unit_offset else torch.ones(dim))

    def forward(self, x: Tensor) -> Tensor:
        return scale_normed(F.rms_norm(x.float(), x.shape[-1:], eps=self.eps), self.weight, self.unit_offset, x.dtype)


def scale_normed(normed: Tensor, weight: Tensor, unit_offset: bool, dtype: torch.dtype) -> Tensor:
    """An RMSNorm's float32 ``normed`` values times its ``weight``, in ``dtype``."""
    if unit_offset:
        return (normed * (1.0 + weight.float())).to(dtype)
    return weight * normed.to(dtype)


def rope_cos_sin(positions: Tensor, dim: int, theta: float, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    """cos, sin ``[B, 1, S, dim]`` for integer positions ``[B, S]`` (float32
    math); ``dim`` is the rotated part of a head. The first half of sin is
    negated: :func:`apply_rope` carries the sign of its half swap there."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.float32, device=positions.device) / dim))
    freqs = positions[..., None].float() * inv_freq
    emb = torch.cat([freqs, freqs], -1)[:, None]
    sin = emb.sin()
    return emb.cos().to(dtype), torch.cat([-sin[..., : dim // 2], sin[..., dim // 2 :]], -1).to(dtype)


def apply_rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Rotate the first ``cos.shape[-1]`` dims of each head (all of them unless
    RoPE is partial): ``x * cos + rotate_half(x) * sin``, where rotate_half
    (``[-x2, x1]``) is the roll ``[x2, x1]`` times :func:`rope_cos_sin`'s signed
    sin; the same values (a product's sign is exact), in two ops fewer per layer."""
    dim = cos.shape[-1]
    if dim == x.shape[-1]:
        return x * cos + x.roll(dim // 2, -1) * sin
    rotary, rest = x[..., :dim], x[..., dim:]
    return torch.cat([rotary * cos + rotary.roll(dim // 2, -1) * sin, rest], -1)


class Linear(nn.Linear):
    """``nn.Linear`` (the same parameters) whose rows do not depend on each
    other on a CPU, and whose bf16 matmul runs in fp32 on a CPU without bf16
    units (:func:`.device.batch_invariant` says why)."""

    def forward(self, x: Tensor) -> Tensor:
        return batch_invariant(F.linear, x, self.weight, self.bias)


class Sites(Protocol):
    """What happens at the quantization sites of one forward."""

    def moe_in(self, layer: int, x: Tensor) -> Tensor:
        """Input of the gate/up projections, ``x [T, hidden]`` (one row per token)."""

    def moe_down_in(self, layer: int, h: Tensor, rows: "ExpertRows") -> Tensor:
        """Input of the down projections ``h``, in ``rows``' expert layout (and
        returned in it): a site that acts on it sees it in row order, row r
        ``token[r]``'s slot ``slot[r]``, routed to ``expert[r]``, through
        :meth:`ExpertRows.per_row`; one that leaves it as is costs nothing."""

    def kv(self, layer: int, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        """K (after RoPE) and V ``[B, kv_heads, S, head_dim]`` on a cache-less pass."""

    def expert_weights(self, layer: int, gate_up: Tensor, down: Tensor) -> tuple[Tensor, Tensor]:
        """The routed experts' weights as this forward uses them (training
        fake-quantizes them; rollout quantized them in place at weight sync)."""

    def routing(self, layer: int, experts: Tensor) -> Tensor:
        """The experts ``[T, k]`` each token goes to, given the router's own
        top-k choice: that choice, or (training under syndrome-coded guidance)
        the rollout's, whose side information needs the rollout's routing."""

    def replaying(self) -> contextlib.AbstractContextManager:
        """A context in which a layer runs again with the same values (its
        activations recomputed in the backward: ``Transformer.recompute_layers``)
        and whatever the sites record or count is not recorded or counted twice.
        Only training's sites are recomputed."""


class Attend(Protocol):
    """How the mixers read the past: attention over K/V, and the linear-attention layers' two stateful steps."""

    def __call__(self, layer: int, q: Tensor, k: Tensor, v: Tensor, sites: Sites | None) -> Tensor: ...

    def conv(self, layer: int, x: Tensor, weight: Tensor) -> Tensor:
        """The causal conv (with SiLU) of ``x [B, S, C]`` after what came before it."""

    def delta(self, layer: int, q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor) -> Tensor:
        """The gated delta rule's output ``[B, S, Hv, Dv]`` after what came before it."""


@dataclass
class CausalAttention:
    """Full-sequence causal attention. Batches are right-padded (:func:`right_pad`:
    the padding comes after each sequence), so causality alone keeps the
    padding out of every real position, in softmax and linear attention alike:
    no mask is built, and SDPA runs its causal kernel (on CUDA flash attention,
    whose memory grows with the sequence; a boolean ``[S, S]`` mask alone
    would be 69 GB at 262,144 tokens). The delta rule runs ``chunked``
    (training, prefill) or ``recurrent`` token by token (the rollout's decode
    form, for measuring their mismatch)."""

    delta_form: str = "chunked"

    def __post_init__(self):
        if self.delta_form not in ("chunked", "recurrent"):
            raise ValueError(f"delta_form must be 'chunked' or 'recurrent', got {self.delta_form!r}")

    def conv(self, layer: int, x: Tensor, weight: Tensor) -> Tensor:
        return causal_conv(x, weight)

    def delta(self, layer: int, q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor) -> Tensor:
        rule = chunked_delta_rule if self.delta_form == "chunked" else recurrent_delta_rule
        return rule(q, k, v, g, beta)[0]

    def __call__(self, layer: int, q: Tensor, k: Tensor, v: Tensor, sites: Sites | None) -> Tensor:
        if sites is not None:
            k, v = sites.kv(layer, k, v)
        return attention(q, k, v)


def attention(q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None = None) -> Tensor:
    """Softmax attention of ``q [B, H, S, D]`` over ``k, v [B, KV, L, D]``
    (grouped when KV < H) where the boolean ``mask [B or 1, 1, S, L]`` allows,
    or without one causally (queries and keys at the same positions): one
    SDPA call, the same in training and in the rollout's prefill and decode
    steps; on a CPU a query's bits do not depend on the queries beside it,
    and it runs in fp32 where the CPU has no bf16 units (:func:`.device.batch_invariant`).

    A decode step's single query per head is grouped: the heads that share a
    KV head go in as that KV head's rows of queries (``[B, KV, H/KV, D]``),
    which the mask, one row per sequence, covers alike. One SDPA task per
    KV head instead of per head: on a CPU the bf16 kernel took 3x as long
    for the same values at batch 128 (docs/rollout.md)."""
    b, heads, s, d = q.shape
    grouped = heads // k.shape[1]
    if s == 1 and grouped > 1 and mask is not None and mask.shape[-2] == 1:
        out = attention(q.view(b, k.shape[1], grouped, d), k, v, mask)
        return out.reshape(b, heads, 1, d)  # CUDA's memory-efficient kernel returns [B, G, KV, D] memory transposed
    return batch_invariant(
        F.scaled_dot_product_attention, q, k, v, attn_mask=mask, is_causal=mask is None, enable_gqa=grouped > 1
    )


def right_pad(sequences: list[list[int]], pad: int = 0, device="cpu") -> tuple[Tensor, Tensor, Tensor]:
    """Token sequences as one batch: ``tokens [B, S]`` (``pad`` after each
    sequence's end), ``positions [B, S]`` (0.. on every row) and ``lengths
    [B]``, which tell the real positions from the padding (capture's token
    map, the engine's KV cache). Causal attention keeps the padding out of
    every real position, so no logit of one depends on ``pad``; callers holding the tokenizer pass its
    pad id, so that the batches read as the policy's own."""
    rows = [torch.tensor(s, dtype=torch.long) for s in sequences]
    tokens = nn.utils.rnn.pad_sequence(rows, batch_first=True, padding_value=pad).to(device)
    positions = torch.arange(tokens.shape[1], device=device).expand_as(tokens)
    return tokens, positions, torch.tensor([len(s) for s in sequences], device=device)


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        # q, k and v projections fused into one matmul; the checkpoint splits them. With the output
        # gate, q_proj yields each head's query followed by its gate ([H, 2 * head_dim]).
        q_width = cfg.num_heads * cfg.head_dim * (2 if cfg.attn_output_gate else 1)
        self.qkv_proj = Linear(cfg.hidden_size, q_width + 2 * cfg.num_kv_heads * cfg.head_dim, bias=cfg.qkv_bias)
        # transformers' qwen3_moe and qwen3_5_moe give o_proj the attention_bias too, qwen2_moe's qkv_bias does not
        o_bias = cfg.qkv_bias and cfg.model_type != "qwen2_moe"
        self.o_proj = Linear(cfg.num_heads * cfg.head_dim, cfg.hidden_size, bias=o_bias)
        if cfg.qk_norm:
            self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps, cfg.norm_unit_offset)
            self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps, cfg.norm_unit_offset)

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor, layer: int, attend: Attend, sites: Sites | None) -> Tensor:
        b, s, _ = x.shape
        cfg = self.cfg
        qkv, gate = self.qkv_proj(x), None
        if cfg.attn_output_gate:
            q_gate, kv = qkv.split([2 * cfg.num_heads * cfg.head_dim, 2 * cfg.num_kv_heads * cfg.head_dim], -1)
            q, gate = q_gate.view(b, s, cfg.num_heads, 2 * cfg.head_dim).chunk(2, -1)
            qkv = torch.cat([q, kv.view(b, s, 2 * cfg.num_kv_heads, cfg.head_dim)], 2)
        qkv = qkv.view(b, s, cfg.num_heads + 2 * cfg.num_kv_heads, cfg.head_dim)
        qk, v = qkv.split([cfg.num_heads + cfg.num_kv_heads, cfg.num_kv_heads], dim=2)  # [B, S, heads, D]
        if cfg.qk_norm:  # q and k heads normalized together, each with its own weight
            weight = torch.cat(
                [self.q_norm.weight.expand(cfg.num_heads, -1), self.k_norm.weight.expand(cfg.num_kv_heads, -1)]
            )
            normed = F.rms_norm(qk.float(), qk.shape[-1:], eps=cfg.rms_norm_eps)
            qk = scale_normed(normed, weight, cfg.norm_unit_offset, x.dtype)
        q, k = apply_rope(qk.transpose(1, 2), cos, sin).split([cfg.num_heads, cfg.num_kv_heads], dim=1)
        out = attend(layer, q, k, v.transpose(1, 2), sites)  # q [B, H, S, D], k/v [B, KV, S, D]
        out = out.transpose(1, 2).reshape(b, s, -1)
        if gate is not None:
            out = out * torch.sigmoid(gate.reshape(b, s, -1))
        return self.o_proj(out)


class MLP(nn.Module):
    def __init__(self, hidden: int, intermediate: int):
        super().__init__()
        self.gate_proj = Linear(hidden, intermediate, bias=False)
        self.up_proj = Linear(hidden, intermediate, bias=False)
        self.down_proj = Linear(intermediate, hidden, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Experts(nn.Module):
    """Routed SwiGLU experts, stacked in ``x @ w`` layout: ``gate_up [E, H, 2I]``
    (gate columns first), ``down [E, I, H]``. These are the W4 weights of FP4
    rollout; their quantization blocks run along the input dimension (dim 1)."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        e, h, i = cfg.num_experts, cfg.hidden_size, cfg.moe_intermediate_size
        self.gate_up = nn.Parameter(torch.empty(e, h, 2 * i))
        self.down = nn.Parameter(torch.empty(e, i, h))


def grouped_matmuls(x: Tensor, weights: Tensor) -> bool:
    """Whether a MoE layer multiplies its rows by their experts' weights with
    ``F.grouped_mm``: where torch runs it as one CUTLASS kernel, bf16 on a CUDA
    device of SM 9.x or 10.x (H100/H200, B200), with rows of whole 16 bytes
    (the hidden and intermediate sizes multiples of 8). On other GPUs torch's fallback copies the
    group offsets to the host and loops over the groups: a host sync per MoE
    layer, which a CUDA graph cannot capture; the padded ``bmm`` serves there."""
    bf16 = x.dtype == weights.dtype == torch.bfloat16
    # gate_up [E, H, 2I]: H and the down matmul's row width I (so 2I in 16s) whole multiples of 8
    aligned = weights.shape[-1] % 16 == 0 and weights.shape[-2] % 8 == 0
    return x.is_cuda and bf16 and aligned and torch.cuda.get_device_capability(x.device)[0] in (9, 10)


class ExpertRows:
    """The rows of a MoE layer, one per (token, slot) (row r = token r // k,
    slot r % k), laid out for one batched matmul by expert, and kept in that
    layout from the gate/up matmul through the down matmul: the rows are
    gathered in and read out once per layer, not around each matmul (two
    copies of every row fewer, and fewer calls: docs/rollout.md).

    Where :func:`grouped_matmuls` (CUDA): the rows sorted by expert, one
    ``F.grouped_mm`` over the jagged groups; the group offsets never leave the
    device, so a step needs no host sync and a CUDA graph captures it without
    room to spare. Elsewhere: a grid ``[E, width, .]`` (each row at its expert
    and its rank among that expert's rows; ``width`` the busiest expert's
    rows; the cells no row takes are zero and stay zero through SwiGLU) and one
    ``bmm`` (on the CPU faster than ``grouped_mm``, which runs there expert by
    expert); a CUDA graph capture cannot read the width from the device, so
    there every expert gets room for every row."""

    def __init__(self, experts: Tensor, n_experts: int, grouped: bool):
        self.expert, self.n_experts, self.grouped = experts.reshape(-1), n_experts, grouped
        self.k, flat, device = experts.shape[1], self.expert, experts.device
        if grouped:
            self.order = torch.argsort(flat, stable=True)  # rows by expert, in row order within each
            self.unsort = torch.empty_like(self.order)
            self.unsort[self.order] = torch.arange(len(flat), device=device)
            counts = torch.zeros(n_experts, dtype=torch.int32, device=device)
            self.offsets = counts.index_add_(0, flat, torch.ones_like(flat, dtype=torch.int32)).cumsum(
                0, dtype=torch.int32
            )
            self.sources = self.order // self.k  # the token of each sorted row
        else:
            # each row's rank among its expert's rows (one_hot would check its input's range on the CPU, a device read)
            rank = (flat[:, None] == torch.arange(n_experts, device=device)).cumsum(0).gather(1, flat[:, None])[:, 0]
            self.width = len(flat) if graph_capturing(flat) else int(rank.max())
            self.place = flat * self.width + rank - 1  # each row's cell in the grid, flattened
            tokens = len(flat) // self.k  # the token of each cell; a free cell reads the zero row after the last
            self.sources = torch.full((n_experts * self.width,), tokens, device=device).index_copy_(
                0, self.place, self.token
            )

    @functools.cached_property
    def token(self) -> Tensor:
        """Each row's token, in row order."""
        return torch.arange(len(self.expert), device=self.expert.device) // self.k

    @functools.cached_property
    def slot(self) -> Tensor:
        """Each row's slot among its token's k experts, in row order."""
        return torch.arange(len(self.expert), device=self.expert.device) % self.k

    def gather(self, tokens: Tensor) -> Tensor:
        """Each row's token of ``tokens [T, in]``, in the expert layout."""
        if self.grouped:
            return tokens.index_select(0, self.sources)
        padded = F.pad(tokens, (0, 0, 0, 1))  # the zero row of the free cells
        return padded.index_select(0, self.sources).view(self.n_experts, self.width, -1)

    def matmul(self, h: Tensor, weights: Tensor) -> Tensor:
        """``h`` (the expert layout) times each row's expert's ``weights [E, in, out]``, in the expert layout."""
        if self.grouped:
            return F.grouped_mm(h, weights, offs=self.offsets)
        return batch_invariant(torch.bmm, h, weights)

    def rows(self, h: Tensor) -> Tensor:
        """``h`` from the expert layout to row order, ``[T*k, .]``."""
        if self.grouped:
            return h.index_select(0, self.unsort)
        return h.reshape(-1, h.shape[-1]).index_select(0, self.place)  # on the CPU far faster than h[e, r]

    def layout(self, rows: Tensor) -> Tensor:
        """``rows [T*k, .]`` from row order to the expert layout."""
        if self.grouped:
            return rows.index_select(0, self.order)
        grid = rows.new_zeros(self.n_experts * self.width, rows.shape[-1]).index_copy(0, self.place, rows)
        return grid.view(self.n_experts, self.width, -1)

    def per_row(self, site, h: Tensor) -> Tensor:
        """``site(rows, token, slot, expert)`` of ``h``'s rows in row order (what
        a site acting on rows sees), back in the expert layout."""
        return self.layout(site(self.rows(h), self.token, self.slot, self.expert))


class MoE(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        self.gate = Linear(cfg.hidden_size, cfg.num_experts, bias=False)  # the router
        self.experts = Experts(cfg)
        if cfg.shared_expert_intermediate_size:
            self.shared_expert = MLP(cfg.hidden_size, cfg.shared_expert_intermediate_size)
            self.shared_expert_gate = Linear(cfg.hidden_size, 1, bias=False)

    def route(self, x: Tensor, sites: Sites | None = None, layer: int = 0) -> tuple[Tensor, Tensor]:
        """Top-k experts ``[T, k]`` and their weights, from a float32 softmax
        (``sites`` may replace the experts: :meth:`Sites.routing`; the weights
        are then the chosen experts' probabilities)."""
        probs = F.softmax(self.gate(x), dim=-1, dtype=torch.float32)
        weights, experts = torch.topk(probs, self.cfg.top_k, dim=-1)
        if sites is not None:
            chosen = sites.routing(layer, experts)
            if chosen is not experts:
                weights, experts = probs.gather(1, chosen), chosen
        if self.cfg.norm_topk_prob:
            weights = weights / weights.sum(-1, keepdim=True)
        return weights.to(x.dtype), experts

    def forward(self, x: Tensor, layer: int, sites: Sites | None) -> Tensor:
        b, s, h = x.shape
        x = x.reshape(-1, h)  # T = B * S tokens
        weights, experts = self.route(x, sites, layer)  # [T, k]
        w_gate_up, w_down = self.experts.gate_up, self.experts.down
        xq = x
        if sites is not None:
            w_gate_up, w_down = sites.expert_weights(layer, w_gate_up, w_down)
            xq = sites.moe_in(layer, x)
        k = self.cfg.top_k
        expert_rows = ExpertRows(experts, self.cfg.num_experts, grouped_matmuls(xq, w_gate_up))
        gate, up = expert_rows.matmul(expert_rows.gather(xq), w_gate_up).chunk(2, dim=-1)
        inter = F.silu(gate) * up  # in the expert layout
        if sites is not None:
            inter = sites.moe_down_in(layer, inter, expert_rows)
        out = expert_rows.rows(expert_rows.matmul(inter, w_down)).view(-1, k, h) * weights[..., None]  # [T, k, H]
        routed = out[:, 0]
        for slot in range(1, k):  # slot by slot: on the CPU a sum over the small middle axis is slow
            routed = routed + out[:, slot]
        if self.cfg.shared_expert_intermediate_size:
            routed = routed + size_independent(torch.sigmoid, self.shared_expert_gate(x)) * self.shared_expert(x)
        return routed.reshape(b, s, h)


class Block(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int):
        super().__init__()
        self.layer = layer
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, cfg.norm_unit_offset)
        if cfg.is_linear(layer):
            self.linear_attn = GatedDeltaNet(
                cfg.hidden_size,
                cfg.linear_num_key_heads,
                cfg.linear_num_value_heads,
                cfg.linear_key_head_dim,
                cfg.linear_value_head_dim,
                cfg.linear_conv_kernel_dim,
                cfg.rms_norm_eps,
            )
        else:
            self.self_attn = Attention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, cfg.norm_unit_offset)
        self.mlp = MoE(cfg) if cfg.is_sparse(layer) else MLP(cfg.hidden_size, cfg.intermediate_size)

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor, attend: Attend, sites: Sites | None) -> Tensor:
        h = self.input_layernorm(x)
        if hasattr(self, "linear_attn"):
            x = x + self.linear_attn(h, self.layer, attend)
        else:
            x = x + self.self_attn(h, cos, sin, self.layer, attend, sites)
        h = self.post_attention_layernorm(x)
        return x + (self.mlp(h, self.layer, sites) if isinstance(self.mlp, MoE) else self.mlp(h))


class Transformer(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        self.model = nn.Module()
        # left uninitialized (build_model and load_model fill every parameter): normal_ on the meta
        # device would import torch's Python decompositions and sympy, ~150 MB in every loading process
        self.model.embed_tokens = nn.Embedding(
            cfg.vocab_size, cfg.hidden_size, _weight=torch.empty(cfg.vocab_size, cfg.hidden_size)
        )
        self.model.layers = nn.ModuleList(Block(cfg, i) for i in range(cfg.num_layers))
        self.model.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, cfg.norm_unit_offset)
        self.lm_head = Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        self.tie_weights()
        # activation checkpointing (train.activation_checkpointing): a forward that builds a graph keeps each
        # layer's input alone and the backward runs the layer again
        self.recompute_layers = False

    def tie_weights(self) -> None:
        """Share the embedding with ``lm_head`` (``tie_word_embeddings``). Again
        after ``to_empty``: materializing a model built on the meta device
        gives each module its own tensor."""
        if self.cfg.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def forward(
        self,
        tokens: Tensor,
        positions: Tensor,
        attend: Attend | None = None,
        sites: Sites | None = None,
        logits_at: Tensor | None = None,
        head=None,
    ):
        """Logits ``[B, S, vocab]`` of ``tokens [B, S]`` at ``positions [B, S]``;
        with ``logits_at [B]``, only those after row b's token ``logits_at[b]``:
        ``[B, vocab]``. A prefill needs each prompt's last alone, and at a
        248,320-token vocabulary (Qwen3.5-35B-A3B) the logits of every position
        of 256 prompts of 1,024 tokens would take 130 GB in bf16. ``head(h,
        lm_head)`` replaces the logits with what its caller computes from the
        final normed hidden states ``h`` and ``lm_head``, inside this call,
        where FSDP has gathered the parameters (training's log-probabilities, a
        chunk of logits at a time: :func:`.rl.token_logprobs`)."""
        x = self.hidden_states(tokens, positions, attend, sites)
        if logits_at is not None:
            x = x[torch.arange(len(x), device=x.device), logits_at]
        x = self.model.norm(x)
        return self.lm_head(x) if head is None else head(x, self.lm_head)

    def hidden_states(
        self, tokens: Tensor, positions: Tensor, attend: Attend | None = None, sites: Sites | None = None
    ) -> Tensor:
        """The last layer's output ``[B, S, hidden]``, before the final norm: a
        forward without logits, for callers that only watch its ``sites``.
        With ``recompute_layers``, each layer runs again in the backward, its
        sites replaying (:meth:`Sites.replaying`)."""
        x = self.model.embed_tokens(tokens)
        cos, sin = rope_cos_sin(positions, self.cfg.rotary_dim, self.cfg.rope_theta, x.dtype)
        attend = attend or CausalAttention()
        recompute = self.recompute_layers and torch.is_grad_enabled()
        contexts = functools.partial(_recomputation_contexts, sites)
        for block in self.model.layers:
            if recompute:
                x = checkpoint(block, x, cos, sin, attend, sites, use_reentrant=False, context_fn=contexts)
            else:
                x = block(x, cos, sin, attend, sites)
        return x

    def moe_blocks(self) -> list[MoE]:
        return [b.mlp for b in self.model.layers if isinstance(b.mlp, MoE)]


def _recomputation_contexts(sites: Sites | None):
    """torch.utils.checkpoint's contexts of a layer's forward and of its run again in the backward."""
    return contextlib.nullcontext(), contextlib.nullcontext() if sites is None else sites.replaying()


def empty_model(cfg: ModelConfig, dtype: torch.dtype, device: str | torch.device = "cpu") -> Transformer:
    """A model whose parameters are allocated in ``dtype`` on ``device`` but not
    initialized: built on the meta device, so that no init runs and no float32
    copy exists; the caller fills every parameter. The model has no buffers
    (RoPE is computed per forward), so parameters are all there is to fill."""
    with torch.device("meta"):
        model = Transformer(cfg)
    model = model.to(dtype).to_empty(device=device)
    model.tie_weights()
    return model


def build_model(cfg: ModelConfig | str, seed: int = 0, dtype: torch.dtype = torch.float32) -> Transformer:
    """A model with seeded random weights (normal, std 0.02; norms scale by 1;
    Gated DeltaNet's decay as transformers initializes it: ``dt_bias`` 1,
    ``A = exp(A_log)`` uniform in [0.01, 16])."""
    cfg = get_preset(cfg) if isinstance(cfg, str) else cfg
    gen = torch.Generator().manual_seed(seed)
    model = empty_model(cfg, dtype)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight") or name.endswith("layernorm.weight"):
                unit_offset = cfg.norm_unit_offset and not name.endswith("linear_attn.norm.weight")
                p.fill_(0.0 if unit_offset else 1.0)
            elif name.endswith(".bias") or name.endswith(".dt_bias"):
                p.fill_(1.0 if name.endswith(".dt_bias") else 0.0)
            elif name.endswith(".A_log"):
                p.copy_((torch.rand(p.shape, generator=gen) * 15.99 + 0.01).log())
            else:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.02)  # drawn in float32, rounded to dtype
    return model
