"""The rollout engine: batched sampling from the policy with a KV cache (BF16,
or packed FP4 codes + scales), FP4 weights/activations, weight sync, and
capture of every FP4 outcome.

``TorchEngine`` (CPU and CUDA) follows gpt-fast's ``generate.py``: a prefill
of the right-padded prompts, then one decode step at a time; after each step
the sequences that finished retire: their KV is captured and they leave the
batch.

On a hybrid model (qwen3_5_moe) only the full-attention layers have a KV
cache; each linear-attention layer keeps, per sequence, its conv state (the
last K-1 inputs of the causal conv) and its recurrent state (the delta rule's
``[heads, Dk, Dv]`` matrix, fp32): O(1) memory and work per decoded token.
Prefill runs the chunked form from a zero state, decode the recurrent form.
"""

import copy
import hashlib
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from tracefp4.kernels import FP4Tensor, dequantize, get_format

from .capture import Capture, CaptureConfig, CaptureRecords, TokenMap
from .checkpoint import hub_to_stacked, load_model, load_state
from .deltanet import causal_conv, chunked_delta_rule, conv_history, recurrent_delta_rule
from .device import bf16_op
from .model import ModelConfig, Transformer, right_pad
from .quant import (
    BF16,
    KV_SITES,
    QuantConfig,
    QuantSites,
    calibrate_global_scales,
    kv_from_rows,
    kv_rows,
    quantize_expert_weights_,
)


@dataclass(frozen=True)
class SamplingParams:
    """How tokens are drawn. ``temperature`` 0 is greedy; ``top_k`` 0 and
    ``top_p`` 1 switch those filters off."""

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    max_new_tokens: int = 64
    stop_tokens: tuple[int, ...] = ()
    pad_token: int = 0  # fills a batch's rows past each prompt; masked, so no logit depends on it
    seed: int = 0
    record_topk: int = 0  # keep the sampler's k most likely tokens per step (score centering needs them)

    def __post_init__(self):
        filters_ok = 0 < self.top_p <= 1 and min(self.top_k, self.record_topk) >= 0
        if self.temperature < 0 or not filters_ok or self.max_new_tokens < 1:
            raise ValueError(f"invalid sampling parameters {self}")


@dataclass
class Trajectory:
    """One sampled response. ``logprobs[i]`` is the log-probability of
    ``response[i]`` under the rollout policy at the sampling temperature
    (before top-k/top-p truncation), which is what training recomputes."""

    id: int
    prompt: list[int]
    response: list[int]
    logprobs: list[float]
    finish_reason: str  # "stop" | "length"
    topk_ids: list[list[int]] | None = None  # with record_topk: the sampler's k most likely tokens per step
    topk_logprobs: list[list[float]] | None = None

    @property
    def tokens(self) -> list[int]:
        return self.prompt + self.response


def request_seed(seed: int, index: int) -> int:
    """The sampling seed of the request at place ``index`` of a batch seeded
    ``seed``: each request draws from its own generator, so that its tokens do
    not depend on which other requests share its call (rollout workers)."""
    return int.from_bytes(hashlib.sha256(f"{seed}/{index}".encode()).digest()[:8], "little") >> 1


def sample(
    logits: Tensor, params: SamplingParams, gens: list[torch.Generator]
) -> tuple[Tensor, Tensor, tuple[Tensor, Tensor] | None]:
    """Tokens ``[B]`` drawn from ``logits [B, V]`` (row b's uniform from
    ``gens[b]``), their log-probabilities, and (with ``record_topk``) the
    ``(logprobs, ids)`` of the k most likely tokens."""
    logits = logits.float()
    scaled = logits / params.temperature if params.temperature > 0 else logits
    logprobs = F.log_softmax(scaled, -1)
    if params.temperature == 0:
        tokens = scaled.argmax(-1)
    else:
        if params.top_k:
            kth = torch.topk(scaled, min(params.top_k, scaled.shape[-1]), -1).values[:, -1:]
            scaled = scaled.masked_fill(scaled < kth, float("-inf"))
        if params.top_p < 1:
            sorted_logits, idx = torch.sort(scaled, -1, descending=True)
            cum = sorted_logits.softmax(-1).cumsum(-1)
            drop = cum - sorted_logits.softmax(-1) >= params.top_p  # keep the smallest set reaching top_p
            scaled = scaled.scatter(-1, idx, sorted_logits.masked_fill(drop, float("-inf")))
        cdf = scaled.softmax(-1).cumsum(-1)  # inverse-CDF draw: one uniform per row
        u = torch.cat([torch.rand(1, 1, generator=g, device=cdf.device) for g in gens]) * cdf[:, -1:]
        tokens = torch.searchsorted(cdf, u, right=True)[:, 0].clamp(max=cdf.shape[-1] - 1)
    topk = torch.topk(logprobs, params.record_topk, -1) if params.record_topk else None
    return tokens, logprobs.gather(-1, tokens[:, None])[:, 0], topk


class KVCache:
    """K/V of a batch of sequences, ``[B, max_len, kv_heads * head_dim]`` per
    full-attention layer: in the compute dtype, or (FP4 KV) packed codes + scale
    bytes that are dequantized for attention; and the linear-attention layers'
    conv and recurrent states per sequence, never quantized. The mixers read
    through it (it is the model's ``attend``)."""

    def __init__(self, cfg: ModelConfig, batch: int, max_len: int, sites: QuantSites, dtype, device):
        self.cfg, self.sites, self.dtype = cfg, sites, dtype
        self.fmt = sites.q.kv
        width = cfg.num_kv_heads * cfg.head_dim
        if self.fmt is None:  # attention's own layout: reads need no copy
            shapes = {"values": ((batch, cfg.num_kv_heads, max_len, cfg.head_dim), dtype)}
        else:  # one FP4 row per (sequence, position), as quant.kv_rows lays K/V out
            block = get_format(self.fmt).block_size
            if cfg.head_dim % block:
                raise ValueError(f"{self.fmt} KV needs head_dim to be a multiple of {block}, got {cfg.head_dim}")
            shapes = {
                "codes": ((batch, max_len, width // 2), torch.uint8),
                "scales": ((batch, max_len, width // block), torch.uint8),
            }
        self.store = {
            (layer, site, part): torch.zeros(shape, dtype=dt, device=device)
            for layer in cfg.attention_layers
            for site in KV_SITES
            for part, (shape, dt) in shapes.items()
        }
        channels = 2 * cfg.linear_num_key_heads * cfg.linear_key_head_dim
        channels += cfg.linear_num_value_heads * cfg.linear_value_head_dim
        state = (batch, cfg.linear_num_value_heads, cfg.linear_key_head_dim, cfg.linear_value_head_dim)
        self.conv_states = {
            layer: torch.zeros(batch, channels, cfg.linear_conv_kernel_dim - 1, dtype=dtype, device=device)
            for layer in cfg.linear_layers
        }  # [B, C, K-1]: the causal conv's last inputs
        self.recurrent_states = {  # [B, Hv, Dk, Dv], fp32 as the delta rule computes
            layer: torch.zeros(state, dtype=torch.float32, device=device) for layer in cfg.linear_layers
        }
        self.positions: Tensor | None = None  # [B, S] of the forward in flight

    def start(self, positions: Tensor, lengths: Tensor) -> None:
        """Prepare a forward that writes ``positions [B, S]`` and attends to
        everything before them; row b's tokens at positions ``>= lengths[b]``
        are padding, which the linear-attention states skip."""
        self.positions = positions
        self.valid = positions < lengths[:, None]  # [B, S]; right padding: a prefix of each row
        self.span = int(positions.max()) + 1  # positions < span are read
        self.rows = torch.arange(positions.shape[0], device=positions.device)[:, None]
        visible = torch.arange(self.span, device=positions.device) <= positions[..., None]  # [B, S, span]
        # a decode step whose rows all sit at the same position sees every cached entry
        self.visible = None if positions.shape[1] == 1 and bool(visible.all()) else visible[:, None]

    def bytes_per_token(self) -> float:
        return sum(
            t[0].numel() * t.element_size() / t.shape[-2 if self.fmt is None else 1] for t in self.store.values()
        )

    def state_bytes_per_sequence(self) -> int:
        """Bytes of the linear-attention layers' states per sequence (independent of its length)."""
        states = [*self.conv_states.values(), *self.recurrent_states.values()]
        return sum(t[0].numel() * t.element_size() for t in states)

    def conv(self, layer: int, x: Tensor, weight: Tensor) -> Tensor:
        """The causal conv after each sequence's cached inputs; keeps the last K-1 valid inputs."""
        history = self.conv_states[layer]
        out = causal_conv(x, weight, history)
        self.conv_states[layer] = conv_history(x, history, self.valid.sum(1))
        return out

    def delta(self, layer: int, q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor) -> Tensor:
        """The delta rule from each sequence's state: one recurrent step per
        decoded token, the chunked form for a prefill (padding neither decays
        nor writes the state)."""
        state = self.recurrent_states[layer]
        if q.shape[1] == 1:
            out, self.recurrent_states[layer] = recurrent_delta_rule(q, k, v, g, beta, state)
        else:
            valid = self.valid[..., None]
            out, self.recurrent_states[layer] = chunked_delta_rule(q, k, v, g * valid, beta * valid, state)
        return out

    def _write(self, layer: int, site: str, t: Tensor) -> None:
        """Store K or V ``[B, KV, S, D]`` of the forward in flight at its positions."""
        if self.fmt is None:
            self.store[(layer, site, "values")][self.rows, :, self.positions] = t.transpose(1, 2)
        else:
            b, s = self.positions.shape
            q = self.sites.quantize(layer, site, kv_rows(t))
            self.store[(layer, site, "codes")][self.rows, self.positions] = q.codes.view(b, s, -1)
            self.store[(layer, site, "scales")][self.rows, self.positions] = q.scales.view(torch.uint8).view(b, s, -1)

    def _read(self, layer: int, site: str, span: int) -> Tensor:
        """K or V ``[B, KV, span, D]`` of positions ``< span``, in the compute dtype."""
        if self.fmt is None:
            return self.store[(layer, site, "values")][:, :, :span]
        rows = dequantize(self.fp4_rows(layer, site, slice(None), span)).to(self.dtype)
        return kv_from_rows(rows, rows.shape[0], self.cfg.num_kv_heads)

    def fp4_rows(self, layer: int, site: str, rows, span: int) -> FP4Tensor:
        """The packed FP4 K or V of ``rows`` (batch index or slice), positions ``< span``."""
        f = get_format(self.fmt)
        codes = self.store[(layer, site, "codes")][rows, :span]
        scales = self.store[(layer, site, "scales")][rows, :span].view(f.scale_dtype)
        g = self.sites.global_scales.get((layer, site)) if f.has_global_scale else None
        shape = codes.shape[:-1] + (codes.shape[-1] * 2,)
        return FP4Tensor(codes, scales, g, self.fmt, shape)

    def __call__(self, layer: int, q: Tensor, k: Tensor, v: Tensor, sites) -> Tensor:
        self._write(layer, "k_cache", k)
        self._write(layer, "v_cache", v)
        keys, values = self._read(layer, "k_cache", self.span), self._read(layer, "v_cache", self.span)
        if q.shape[2] > 1:  # prefill
            gqa = q.shape[1] != keys.shape[1]
            return F.scaled_dot_product_attention(q, keys, values, attn_mask=self.visible, enable_gqa=gqa)
        # one decode step: plain matmuls beat SDPA's CPU kernel at a single query
        b, h, _, d = q.shape
        kv = keys.shape[1]
        # keys and values stay as stored; the small query side is transposed
        scores = bf16_op(torch.matmul, keys, q.view(b, kv, h // kv, d).transpose(-1, -2) * d**-0.5)  # [B, KV, span, G]
        if self.visible is not None:
            scores = scores.masked_fill(~self.visible.view(b, 1, -1, 1), float("-inf"))
        weights = torch.softmax(scores, -2, dtype=torch.float32).to(q.dtype)
        return bf16_op(torch.matmul, weights.transpose(-1, -2), values).view(b, h, 1, d)

    def keep(self, rows: Tensor) -> None:
        """Drop every sequence but ``rows`` (finished requests leave the batch)."""
        for states in (self.store, self.conv_states, self.recurrent_states):
            for key, t in states.items():
                states[key] = t.index_select(0, rows)


class TorchEngine:
    """The torch rollout engine: runs FP4 rollout as the configuration says,
    on its own copy of the policy (``dtype``, default BF16)."""

    def __init__(
        self,
        model: Transformer,
        quant: QuantConfig = BF16,
        *,
        dtype: torch.dtype = torch.bfloat16,
        device: str | torch.device = "cpu",
        capture: CaptureConfig | None = None,
        calibration_seed: int = 0,
    ):
        self.quant, self.dtype, self.device = quant, dtype, torch.device(device)
        self.model = copy.deepcopy(model).to(device=self.device, dtype=dtype).eval()
        self.capture_config = capture
        self.calibration_seed = calibration_seed
        self.policy_version = 0
        self._next_id = 0
        self.capture: Capture | None = None
        self._prepare()

    def _prepare(self) -> None:
        """Quantize expert weights, calibrate static global scales, reset capture."""
        quantize_expert_weights_(self.model, self.quant.weights)
        self.global_scales = calibrate_global_scales(self.model, self.quant, seed=self.calibration_seed)
        if self.capture is not None:
            self.capture.set_global_scales(self.global_scales)
        elif self.capture_config is not None and (self.quant.site_format("moe_in") or self.quant.kv):
            self.capture = Capture(self.model.cfg, self.quant, self.capture_config, self.global_scales, self.device)
        self.sites = QuantSites(self.quant, self.global_scales, self.capture)

    def update_weights(self, source) -> None:
        """Take new policy weights (a checkpoint folder, or a state dict in
        either key layout), re-quantize and recalibrate; bumps ``policy_version``."""
        if isinstance(source, dict):
            state = hub_to_stacked(source, self.model.cfg)  # Hub-style keys are converted, others kept
        else:
            state = load_model(source).state_dict()
        if self.capture is not None and self.capture.pending():
            raise RuntimeError("capture holds records of the previous weights: drain it before a weight sync")
        load_state(self.model, state)
        self.policy_version += 1
        self._prepare()

    def kv_bytes_per_token(self) -> float:
        """Bytes the KV cache holds per cached token, all layers."""
        return KVCache(self.model.cfg, 1, 1, self.sites, self.dtype, "cpu").bytes_per_token()

    def drain_capture(self) -> CaptureRecords:
        """Everything captured since the last drain."""
        if self.capture is None:
            raise RuntimeError("this engine captures nothing: no capture config, or no FP4 activation/KV site")
        return self.capture.drain()

    @torch.no_grad()
    def generate(
        self, prompts: list[list[int]], sampling: SamplingParams, first: int | None = None, place: int = 0
    ) -> list[Trajectory]:
        """Sample one response per prompt. Prompt i gets trajectory id
        ``first + i`` (default: numbered on from the last call) and draws from
        its own generator, seeded by ``sampling.seed`` and its place ``place + i``
        in its batch: a request gives the same response whatever else shares
        the call (a batch split over rollout workers passes each share's place)."""
        self._check(prompts)
        dev, b = self.device, len(prompts)
        first = self._next_id if first is None else first
        ids = torch.arange(first, first + b, device=dev)
        self._next_id = first + b
        out = [Trajectory(i, list(p), [], [], "") for i, p in zip(ids.tolist(), prompts)]  # filled step by step
        if sampling.record_topk:
            for request in out:
                request.topk_ids, request.topk_logprobs = [], []
        tokens, positions, lengths = right_pad(prompts, pad=sampling.pad_token, device=dev)
        cache = KVCache(self.model.cfg, b, tokens.shape[1] + sampling.max_new_tokens, self.sites, self.dtype, dev)
        gens = [torch.Generator(device=dev).manual_seed(request_seed(sampling.seed, place + i)) for i in range(b)]
        stop = torch.tensor(sampling.stop_tokens or [-1], device=dev)

        logits = self._prefill(tokens, positions, lengths, ids, cache)
        rows = torch.arange(b, device=dev)  # the request (index into out) each batch row holds
        for step in range(sampling.max_new_tokens):
            new = self._sample(logits, sampling, [gens[i] for i in rows.tolist()], [out[i] for i in rows.tolist()])
            lengths = lengths + 1  # sequence length including the new token
            stopped = torch.isin(new, stop)
            done = stopped | (step + 1 == sampling.max_new_tokens)
            if done.any():
                keep = self._retire(out, rows, lengths, stopped, done, cache)
                if not len(keep):
                    break
                rows, lengths, new = rows[keep], lengths[keep], new[keep]
            logits = self._decode(new, lengths, ids[rows], cache)
        return out

    def _check(self, prompts: list[list[int]]) -> None:
        if not prompts or any(len(p) == 0 for p in prompts):
            raise ValueError("every prompt needs at least one token")
        vocab = self.model.cfg.vocab_size
        if any(t < 0 or t >= vocab for p in prompts for t in p):
            raise ValueError(f"prompt token ids must lie in [0, {vocab})")

    def _forward(self, tokens: Tensor, positions: Tensor, lengths: Tensor, ids: Tensor, cache: KVCache) -> Tensor:
        """Logits ``[B, S, V]`` of ``tokens [B, S]`` at ``positions``, cached
        (and captured) as row b's trajectory ``ids[b]`` below ``lengths[b]``."""
        cache.start(positions, lengths)
        if self.capture is not None:
            self.capture.begin(TokenMap.of(ids, positions, lengths))
        logits = self.model(tokens, positions, cache, self.sites)
        if self.capture is not None:
            self.capture.end()
        return logits

    def _prefill(self, tokens: Tensor, positions: Tensor, lengths: Tensor, ids: Tensor, cache: KVCache) -> Tensor:
        """One forward over the right-padded prompts; logits ``[B, V]`` after each prompt's last token."""
        logits = self._forward(tokens, positions, lengths, ids, cache)
        return logits[torch.arange(len(tokens), device=tokens.device), lengths - 1]

    def _decode(self, new: Tensor, lengths: Tensor, ids: Tensor, cache: KVCache) -> Tensor:
        """One decode step: logits ``[B, V]`` after each row's ``new`` token, at position ``lengths - 1``."""
        return self._forward(new[:, None], (lengths - 1)[:, None], lengths, ids, cache)[:, 0]

    @staticmethod
    def _sample(
        logits: Tensor, sampling: SamplingParams, gens: list[torch.Generator], requests: list[Trajectory]
    ) -> Tensor:
        """Draw a token per row (from its request's generator) and append it, its logprob and top-k to row r's
        ``requests[r]``."""
        new, logprobs, top = sample(logits, sampling, gens)
        for row, (request, token, logprob) in enumerate(zip(requests, new.tolist(), logprobs.tolist())):
            request.response.append(token)
            request.logprobs.append(logprob)
            if top is not None:
                request.topk_ids.append(top.indices[row].tolist())
                request.topk_logprobs.append(top.values[row].tolist())
        return new

    def _retire(
        self, out: list[Trajectory], rows: Tensor, lengths: Tensor, stopped: Tensor, done: Tensor, cache: KVCache
    ) -> Tensor:
        """Finish the ``done`` rows' requests: capture their KV, set their
        finish reason, and drop them from the cache. Returns the batch rows
        that stay."""
        for row in done.nonzero()[:, 0].tolist():
            request = out[int(rows[row])]
            self._capture_kv(cache, row, request.id, int(lengths[row]) - 1)
            request.finish_reason = "stop" if stopped[row] else "length"
        keep = (~done).nonzero()[:, 0]
        if len(keep):
            cache.keep(keep)
        return keep

    def _capture_kv(self, cache: KVCache, row: int, traj_id: int, cached: int) -> None:
        """Capture a finished request's KV codes: every position the rollout computed."""
        if self.capture is None or self.quant.kv is None:
            return
        for layer in self.model.cfg.attention_layers:
            for site in KV_SITES:
                q = cache.fp4_rows(layer, site, row, cached)
                self.capture.record_kv(traj_id, layer, site, q.codes, q.scales.view(torch.uint8))
