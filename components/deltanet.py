"""Gated DeltaNet: the linear-attention mixer of Qwen3.5's hybrid layers
(Yang et al., "Gated Delta Networks", 2024; Hugging Face ``qwen3_5_moe``
``linear_attention`` layers), written from the published recurrence.

Per value head the layer keeps a matrix state ``S [Dk, Dv]``. Each token
decays it by ``exp(g_t)`` (``g_t <= 0``), reads what it predicts for the key,
and writes a ``beta_t``-weighted correction (the delta rule)::

    S' = exp(g_t) * S
    S_t = S' + k_t (beta_t * (v_t - S'^T k_t))^T
    o_t = S_t^T q_t

q, k and v come out of a short causal depthwise convolution (kernel 4) over
the token projections, with SiLU; q and k are L2-normalized and q is scaled by
``Dk**-0.5``. The output goes through an RMSNorm gated by ``silu(z)``.

Two forms compute the same outputs: :func:`recurrent_delta_rule`, one token at
a time (the rollout's decode step: O(1) per token), and
:func:`chunked_delta_rule`, which solves each chunk of tokens with a few
matmuls and carries the state between chunks (prefill and training). They
differ only in rounding; ``benchmarks/deltanet_mismatch.py`` measures what
that does to the FP4 codes downstream.

The strategy objects in :mod:`.model` (``CausalAttention``) and
:mod:`.rollout` (``KVCache``) decide which form runs and where the conv and
recurrent states live; this module holds the parameters and the math.
"""

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .device import batch_invariant, size_independent

CHUNK = 64  # tokens per chunk of the chunked form


def causal_conv(x: Tensor, weight: Tensor, history: Tensor | None = None) -> Tensor:
    """SiLU of the depthwise causal convolution of ``x [B, S, C]`` with
    ``weight [C, K]``, continuing ``history [B, C, K-1]`` (the inputs before
    ``x``; zeros when None). Returns ``[B, S, C]`` in ``x``'s dtype, laid out
    as such: as the convolution's ``[B, C, S]`` transposed, each head's
    channels lie ``S`` apart, and the L2 norm of q and k summed them in an
    order that changed with ``S`` (a prefill's longest prompt), so that a
    request's bits moved with the prompts beside it."""
    c, k = weight.shape
    seq = x.transpose(1, 2).to(weight.dtype)  # [B, C, S]
    if history is None:
        history = seq.new_zeros(seq.shape[0], c, k - 1)
    full = torch.cat([history.to(weight.dtype), seq], -1)  # [B, C, K-1+S]
    # where the CPU emulates bf16 (torch's bf16 depthwise conv is as slow there as its bf16 matmuls): same values
    out = batch_invariant(F.conv1d, full, weight[:, None], groups=c)  # [B, C, S]
    return F.silu(out).to(x.dtype).transpose(1, 2).contiguous()


def conv_history(x: Tensor, history: Tensor, valid: Tensor) -> Tensor:
    """The inputs the next token's convolution needs, ``[B, C, K-1]``: the last
    K-1 of ``history [B, C, K-1]`` followed by row b's first ``valid[b]`` tokens
    of ``x [B, S, C]``."""
    k1 = history.shape[-1]
    full = torch.cat([history, x.transpose(1, 2).to(history.dtype)], -1)  # [B, C, K-1+S]
    idx = (valid[:, None] + torch.arange(k1, device=x.device))[:, None].expand(-1, full.shape[1], -1)
    return full.gather(2, idx)


def _l2norm(x: Tensor) -> Tensor:
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + 1e-6)


def _prepare(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor) -> tuple[Tensor, ...]:
    """fp32, heads first (``[B, H, S, .]``), q/k L2-normalized (q scaled by
    ``Dk**-0.5``), and each key head repeated for the value heads it serves."""
    rep = v.shape[2] // k.shape[2]
    q, k = (_l2norm(t.float()).repeat_interleave(rep, 2) for t in (q, k))
    q = q * q.shape[-1] ** -0.5
    return tuple(t.transpose(1, 2).float() for t in (q, k, v, g, beta))


def recurrent_delta_rule(
    q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, state: Tensor | None = None
) -> tuple[Tensor, Tensor]:
    """The delta rule token by token. ``q, k [B, S, Hk, Dk]``, ``v [B, S, Hv, Dv]``,
    ``g, beta [B, S, Hv]``, ``state [B, Hv, Dk, Dv]`` (zeros when None).
    Returns ``o [B, S, Hv, Dv]`` (``v``'s dtype) and the final state (fp32)."""
    dtype = v.dtype
    q, k, v, g, beta = _prepare(q, k, v, g, beta)
    b, h, s, dk = k.shape
    state = q.new_zeros(b, h, dk, v.shape[-1]) if state is None else state.float()
    out = []
    for t in range(s):
        state = state * g[:, :, t, None, None].exp()
        kt = k[:, :, t]  # [B, H, Dk]
        error = v[:, :, t] - (state * kt[..., None]).sum(-2)  # what the state mispredicts for this key
        state = state + kt[..., None] * (beta[:, :, t, None] * error)[:, :, None]
        out.append((state * q[:, :, t, :, None]).sum(-2))
    o = torch.stack(out, 2) if out else v.new_zeros(b, h, 0, v.shape[-1])  # [B, H, S, Dv]
    return o.transpose(1, 2).to(dtype), state


def chunked_delta_rule(
    q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, state: Tensor | None = None, chunk: int = CHUNK
) -> tuple[Tensor, Tensor]:
    """The delta rule chunk by chunk, same arguments and results as
    :func:`recurrent_delta_rule`.

    Within a chunk, with ``c_i`` the cumulative log decay up to token i and
    ``S0`` the state the chunk starts from, the corrections ``u_i`` solve the
    unit lower-triangular system ``u_i + sum_{j<i} beta_i e^(c_i-c_j) (k_i.k_j) u_j
    = beta_i (v_i - e^(c_i) S0^T k_i)``; then ``o_i = e^(c_i) S0^T q_i +
    sum_{j<=i} e^(c_i-c_j) (q_i.k_j) u_j`` and the chunk hands on
    ``e^(c_n) S0 + sum_j e^(c_n-c_j) k_j u_j^T``.

    In fp32 under autocast too, as the recurrent form computes: a bf16
    autocast (training's ``fp32_master``) rounded every matmul's operands,
    the state carried from chunk to chunk included, to bf16."""
    with torch.autocast(q.device.type, enabled=False):
        return _chunks(q, k, v, g, beta, state, chunk)


def _chunks(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, state: Tensor | None, chunk: int):
    """:func:`chunked_delta_rule`, computed in the dtypes its tensors have."""
    dtype = v.dtype
    q, k, v, g, beta = _prepare(q, k, v, g, beta)
    b, h, s, dk = k.shape
    dv = v.shape[-1]
    pad = -s % chunk  # zero tokens at the end: no decay (g = 0), no write (k = 0, beta = 0)
    q, k, v = (F.pad(t, (0, 0, 0, pad)) for t in (q, k, v))
    g, beta = (F.pad(t, (0, pad)) for t in (g, beta))
    n = (s + pad) // chunk
    q, k, v = (t.reshape(b, h, n, chunk, t.shape[-1]) for t in (q, k, v))  # [B, H, N, C, D]
    g, beta = (t.reshape(b, h, n, chunk) for t in (g, beta))
    c = g.cumsum(-1)  # [B, H, N, C]
    causal = torch.ones(chunk, chunk, dtype=torch.bool, device=q.device).tril()
    decay = (c[..., :, None] - c[..., None, :]).masked_fill(~causal, float("-inf")).exp()  # e^(c_i-c_j), j <= i
    kb = k * beta[..., None]
    system = (kb @ k.transpose(-1, -2)) * decay  # unit diagonal (k normalized) is replaced below
    system = system.tril(-1) + torch.eye(chunk, device=q.device)
    u_v = torch.linalg.solve_triangular(system, v * beta[..., None], upper=False, unitriangular=True)
    u_s = torch.linalg.solve_triangular(system, kb * c.exp()[..., None], upper=False, unitriangular=True)
    scores = (q @ k.transpose(-1, -2)) * decay  # [B, H, N, C, C]
    q_decayed = q * c.exp()[..., None]
    k_to_end = k * (c[..., -1:] - c).exp()[..., None]
    state = q.new_zeros(b, h, dk, dv) if state is None else state.float()
    out = []
    for i in range(n):
        u = u_v[:, :, i] - u_s[:, :, i] @ state  # [B, H, C, Dv]
        out.append(q_decayed[:, :, i] @ state + scores[:, :, i] @ u)
        state = state * c[:, :, i, -1, None, None].exp() + k_to_end[:, :, i].transpose(-1, -2) @ u
    o = torch.stack(out, 2).reshape(b, h, n * chunk, dv)[:, :, :s] if out else v.new_zeros(b, h, 0, dv)
    return o.transpose(1, 2).to(dtype), state


class GatedRMSNorm(nn.Module):
    """RMSNorm over each head's values, then times ``silu(gate)`` (in fp32)."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: Tensor, gate: Tensor) -> Tensor:
        normed = self.weight * F.rms_norm(x.float(), x.shape[-1:], eps=self.eps).to(x.dtype)
        return (normed * F.silu(gate.float())).to(x.dtype)


class GatedDeltaNet(nn.Module):
    """The mixer of a ``linear_attention`` layer; parameter names follow the
    Hub layout (``linear_attn.in_proj_qkv``, ``conv1d``, ``A_log``, ...).

    ``forward`` asks ``past`` (the model's attention strategy) for the two
    stateful steps, ``past.conv(layer, x, weight)`` and ``past.delta(layer, q,
    k, v, g, beta)``, so that the rollout engine can keep their states per
    sequence while training runs them over whole sequences."""

    def __init__(self, hidden: int, k_heads: int, v_heads: int, k_dim: int, v_dim: int, kernel: int, eps: float):
        super().__init__()
        if v_heads % k_heads:
            raise ValueError(f"linear value heads {v_heads} must be a multiple of linear key heads {k_heads}")
        self.k_heads, self.v_heads, self.k_dim, self.v_dim = k_heads, v_heads, k_dim, v_dim
        channels = 2 * k_heads * k_dim + v_heads * v_dim  # q, k, v side by side
        self.in_proj_qkv = nn.Linear(hidden, channels, bias=False)
        self.in_proj_z = nn.Linear(hidden, v_heads * v_dim, bias=False)  # the output gate
        self.in_proj_b = nn.Linear(hidden, v_heads, bias=False)  # beta, the write strength
        self.in_proj_a = nn.Linear(hidden, v_heads, bias=False)  # the decay's input
        self.conv1d = nn.Conv1d(channels, channels, kernel, groups=channels, bias=False)  # weight [C, 1, K]
        self.dt_bias = nn.Parameter(torch.ones(v_heads))
        self.A_log = nn.Parameter(torch.zeros(v_heads))
        self.norm = GatedRMSNorm(v_dim, eps)
        self.out_proj = nn.Linear(v_heads * v_dim, hidden, bias=False)

    def forward(self, x: Tensor, layer: int, past) -> Tensor:
        b, s, _ = x.shape
        qkv = past.conv(layer, batch_invariant(F.linear, x, self.in_proj_qkv.weight), self.conv1d.weight[:, 0])
        key_width = self.k_heads * self.k_dim
        q, k, v = qkv.split([key_width, key_width, self.v_heads * self.v_dim], -1)
        beta = size_independent(torch.sigmoid, batch_invariant(F.linear, x, self.in_proj_b.weight))  # [B, S, Hv]
        a = batch_invariant(F.linear, x, self.in_proj_a.weight).float()
        g = -self.A_log.float().exp() * size_independent(F.softplus, a + self.dt_bias.float())  # log decay, <= 0
        o = past.delta(
            layer,
            q.reshape(b, s, self.k_heads, self.k_dim),
            k.reshape(b, s, self.k_heads, self.k_dim),
            v.reshape(b, s, self.v_heads, self.v_dim),
            g,
            beta,
        )  # [B, S, Hv, Dv]
        z = batch_invariant(F.linear, x, self.in_proj_z.weight).view(b, s, self.v_heads, self.v_dim)
        return batch_invariant(F.linear, self.norm(o, z).reshape(b, s, -1), self.out_proj.weight)
