"""The rollout engine: batched sampling from the policy with a KV cache (BF16,
or packed FP4 codes + scales), FP4 weights/activations, weight sync, and
capture of every FP4 outcome.

``TorchEngine`` (CPU and CUDA) serves a batch as a static-shape engine: one
KV cache allocated per ``generate`` call, a prefill of the right-padded
prompts, then decode steps whose tensors have fixed shapes per batch-size
bucket (on CUDA each bucket's step is a CUDA graph, replayed per token; on
the CPU the same step runs eagerly). The host reads the device only at a stop
check every ``stop_check_every`` tokens: the requests that finished retire
(their KV is captured), requests waiting for a row (``max_running_requests``)
are prefilled into theirs (continuous batching), and once none waits the batch
moves to the smallest bucket that holds the rest.

On a hybrid model (qwen3_5_moe) only the full-attention layers have a KV
cache; each linear-attention layer keeps, per sequence, its conv state (the
last K-1 inputs of the causal conv) and its recurrent state (the delta rule's
``[heads, Dk, Dv]`` matrix, fp32): O(1) memory and work per decoded token.
Prefill runs the chunked form from a zero state, decode the recurrent form.
"""

import copy
import hashlib
import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from tracefp4.kernels import FP4Tensor, dequantize, get_format

from .architecture import ModelConfig
from .capture import Capture, CaptureConfig, CaptureRecords, TokenMap
from .checkpoint import hub_to_stacked, load_model, load_state
from .deltanet import causal_conv, chunked_delta_rule, conv_history, recurrent_delta_rule
from .device import free_bytes
from .model import Transformer, attention, right_pad
from .quant import (
    QuantSites,
    calibrate_global_scales,
    kv_from_rows,
    kv_rows,
    quantize_expert_weights_,
)
from .quant_config import BF16, KV_SITES, QuantConfig


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
        if not 0 <= self.temperature < math.inf or not filters_ok or self.max_new_tokens < 1:  # NaN fails too
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

    @property
    def finished(self) -> bool:
        """Ended by a stop token, not cut by the length limit."""
        return self.finish_reason == "stop"


def derive_seed(seed: int, *stream: int | str) -> int:
    """The seed of the random stream ``stream`` under ``seed``, hashed so that
    no two streams share draws: each request of a batch draws from its own
    generator (``derive_seed(batch_seed, place)``), so its tokens do not depend
    on which other requests share its call (rollout workers); and each sampling
    pass of a run has its own (``derive_seed(run_seed, "rollout", version)``),
    where ``seed + version`` gave replicate seed s + 1 the draws of seed s one
    version later."""
    key = "/".join(map(str, (seed, *stream)))
    return int.from_bytes(hashlib.sha256(key.encode()).digest()[:8], "little") >> 1


def sample(
    logits: Tensor, params: SamplingParams, uniforms: Tensor | None
) -> tuple[Tensor, Tensor, tuple[Tensor, Tensor] | None]:
    """Tokens ``[B]`` drawn from ``logits [B, V]`` by inverse CDF at
    ``uniforms [B]`` in [0, 1) (None when greedy), their log-probabilities,
    and (with ``record_topk``) the ``(logprobs, ids)`` of the k most likely
    tokens. Nothing here reads the device."""
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
            cum = row_cumsum(sorted_logits.softmax(-1))
            drop = cum - sorted_logits.softmax(-1) >= params.top_p  # keep the smallest set reaching top_p
            scaled = scaled.scatter(-1, idx, sorted_logits.masked_fill(drop, float("-inf")))
        cdf = row_cumsum(scaled.softmax(-1))  # inverse-CDF draw: one uniform per row
        u = uniforms[:, None].to(cdf.dtype) * cdf[:, -1:]
        tokens = torch.searchsorted(cdf, u, right=True)[:, 0].clamp(max=cdf.shape[-1] - 1)
    topk = torch.topk(logprobs, params.record_topk, -1) if params.record_topk else None
    return tokens, logprobs.gather(-1, tokens[:, None])[:, 0], topk


def row_cumsum(x: Tensor) -> Tensor:
    """The cumulative sums along each row of ``x [B, V]``, a one-row ``x``
    scanned as two rows. On CUDA torch scans a tensor that is one row with
    CUB, whose float sums come in an order that changes from run to run
    (cumsum is among the operations ``torch.use_deterministic_algorithms``
    makes deterministic), and several rows with a kernel of its own, whose
    order is fixed. The sampler meets one row wherever a request is sampled
    alone (the one admitted into a freed row, the last one running, a
    ``generate`` call of one prompt): there a draw near the boundary of two
    tokens would pick either, and a rerun, a retried rollout or another
    method's branch would go on from another token. On the CPU every row is
    summed in order, so the bits are the same either way."""
    return x.expand(2, -1).cumsum(-1)[:1] if x.shape[0] == 1 else x.cumsum(-1)


# Attention reads the cache in spans of whole 32-position blocks (the rest masked): SDPA's CPU kernel sums in
# an order that depends on the span's length (its vector loop and remainder), and a row's logits must not depend
# on which other rows share its batch, which set the span (with 1 here, tests/test_rollout.py -k whatever_shares
# fails)
SPAN_BLOCK = 32
# The kernel also splits the keys in blocks of 512 and sums a last block of some sizes in another order than one of
# 512: on a Zen 4 AMD EPYC 224-352 keys, for 4 queries or more (AVX-512 and AVX2 alike); on an Intel Xeon with
# MKL's strict mode (device.MKL_MODE) 288-480 keys, for 224 queries or more (float32, head sizes 32-128; all other
# whole-block spans sum as 512 does, below 192 keys on either): a span whose last block would hold more than
# UNEVEN_KEYS reads on to the whole block (-k longer_one)
KV_SPLIT, UNEVEN_KEYS = 512, 192

# Positions past the longest prompt a generate call's KV cache holds at first; it doubles as decoding needs more
KV_HEADROOM = 256


def whole_span_blocks(positions: int) -> int:
    """``positions`` rounded up to a multiple of :data:`SPAN_BLOCK`, and where
    that leaves a last block of keys SDPA may sum in its own order (more than
    :data:`UNEVEN_KEYS`), up to a multiple of :data:`KV_SPLIT`."""
    span = -(-positions // SPAN_BLOCK) * SPAN_BLOCK
    return span + KV_SPLIT - span % KV_SPLIT if span % KV_SPLIT > UNEVEN_KEYS else span


def fillable_length(positions: int) -> int:
    """The longest cache of at most ``positions`` that a span rounded by
    :func:`whole_span_blocks` never overruns (``whole_span_blocks(n) == n``):
    a cache grown to another length (1,280 positions, doubled from 640) took
    a span of 1,217 to 1,536 and refused it."""
    length = positions // SPAN_BLOCK * SPAN_BLOCK
    return length if length % KV_SPLIT <= UNEVEN_KEYS else length - length % KV_SPLIT + UNEVEN_KEYS


class KVCacheFull(RuntimeError):
    """The device has no room for the KV cache a rollout needs."""


class KVCache:
    """K/V of a batch of sequences, ``[rows, length, kv_heads * head_dim]``
    per full-attention layer: in the compute dtype, or (FP4 KV) packed codes +
    scale bytes that are dequantized for attention; and the linear-attention
    layers' conv and recurrent states per sequence, never quantized. The mixers
    read through it (it is the model's ``attend``).

    Allocated once per ``generate`` call for the largest batch bucket: a
    forward uses the first ``active`` rows (views, so a CUDA graph captured on
    them writes into the same memory at every replay), or, a prefill of
    requests that take the rows of finished ones, the rows it names; and
    :meth:`compact` moves the rows that stay to the front when the batch moves
    to a smaller bucket. Every write is in place. It holds ``length`` positions (``max_len``,
    all a call may reach, unless told fewer) and :meth:`grow` doubles them when
    decoding needs more: a call whose responses stop early never holds the KV
    of ``max_new_tokens`` (at the paper presets' 258,048 that alone would not
    fit); a graph captured before a growth reads the old tensors, so the
    decode loop captures anew."""

    def __init__(
        self, cfg: ModelConfig, batch: int, max_len: int, sites: QuantSites, dtype, device, length: int | None = None
    ):
        self.cfg, self.sites, self.dtype = cfg, sites, dtype
        self.fmt = sites.q.kv
        max_len = whole_span_blocks(max_len)  # room for a whole last span block
        self.max_len, self.active = max_len, batch
        self.length = min(max_len, whole_span_blocks(length or max_len))
        self.position_axis = 2 if self.fmt is None else 1
        width = cfg.num_kv_heads * cfg.head_dim
        if self.fmt is None:  # attention's own layout: reads need no copy
            shapes = {"values": ((batch, cfg.num_kv_heads, self.length, cfg.head_dim), dtype)}
        else:  # one FP4 row per (sequence, position), as quant.kv_rows lays K/V out
            block = get_format(self.fmt).block_size
            if cfg.head_dim % block:
                raise ValueError(f"{self.fmt} KV needs head_dim to be a multiple of {block}, got {cfg.head_dim}")
            shapes = {
                "codes": ((batch, self.length, width // 2), torch.uint8),
                "scales": ((batch, self.length, width // block), torch.uint8),
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
        self.decoding = False  # whether that forward is a decode step (else a prefill)

    def start(
        self, positions: Tensor, lengths: Tensor, span: int, rows: Tensor | None = None, decoding: bool = False
    ) -> None:
        """Prepare a forward of the first ``positions.shape[0]`` rows (or of
        ``rows``, cache row indices), a prefill or a decode step
        (``decoding``), that writes ``positions [B, S]`` and
        attends to positions ``< span`` up to its own; row b's tokens at
        positions ``>= lengths[b]`` are padding, which the linear-attention
        states skip. ``span`` comes from the caller, who knows it without
        reading the device; attention reads it rounded up to a whole
        :data:`SPAN_BLOCK`, the rest masked."""
        self.span = whole_span_blocks(span)
        if self.span > self.length:
            raise ValueError(f"a forward attending to {span} positions needs a KV cache grown past its {self.length}")
        self.active = positions.shape[0]
        self.positions, self.decoding = positions, decoding
        self.valid = positions < lengths[:, None]  # [B, S]; right padding: a prefix of each row
        self.batch = slice(0, self.active) if rows is None else rows  # a slice: views; indices: copies
        self.rows = (torch.arange(self.active, device=positions.device) if rows is None else rows)[:, None]
        visible = torch.arange(self.span, device=positions.device) <= positions[..., None]  # [B, S, span]
        self.visible = visible[:, None]

    def grow(self, positions: int) -> bool:
        """Room for ``positions`` positions: the cache's length doubled until it
        holds them (at most ``max_len``; where the device has no room for the
        doubling, as far as it has room for; either down to a length whole
        spans fill: :func:`fillable_length`), what it held copied over;
        whether it grew. Where the device lacks room even for that, a
        :class:`KVCacheFull` names the settings that size the cache, rather
        than an allocator's out-of-memory error."""
        if positions <= self.length:
            return False
        if positions > self.max_len:
            raise ValueError(f"{positions} positions exceed the cache's max_len {self.max_len}")
        needed = whole_span_blocks(positions)
        length = fillable_length(min(self.max_len, max(needed, 2 * self.length), self._room(positions, needed)))
        for key in list(self.store):  # one key at a time: only its old tensor lives beside the new ones
            old = self.store.pop(key)
            shape = list(old.shape)
            shape[self.position_axis] = length
            self.store[key] = old.new_zeros(shape)
            self.store[key].narrow(self.position_axis, 0, self.length).copy_(old)
            del old
        self.length = length
        return True

    def _room(self, positions: int, needed: int) -> int:
        """The longest cache the device has room for (whole span blocks): what
        it holds, and what a new length's tensors take beside it, with one key's
        old tensor (which lives until its new one is filled) counted too;
        unbounded where the device does not say (the CPU)."""
        one = next(iter(self.store.values()), None)
        free = free_bytes(one.device) if one is not None else None
        if free is None:
            return self.max_len
        per_position = sum(t.nbytes // t.shape[self.position_axis] for t in self.store.values())
        largest = max(t.nbytes for t in self.store.values())
        fits = self.length + max(free - largest, 0) // per_position // SPAN_BLOCK * SPAN_BLOCK
        if fits < needed:
            rows, short = one.shape[0], (needed - fits) * per_position
            raise KVCacheFull(
                f"the KV cache of {rows} rows cannot grow to {positions} positions on {one.device}: "
                f"{per_position / rows / 2**10:.1f} KiB a position a row, {fits} positions fit, "
                f"{short / 2**30:.2f} GiB short; lower rollout.max_running_requests (the requests decoded at once, "
                "each row as long as the longest) or rollout.max_new_tokens"
            )
        return fits

    def compact(self, rows: Tensor, active: int) -> None:
        """Move ``rows`` (indices of the current active rows, the ones that
        stay first) to the front, in that order; then use the first ``active``."""
        for states in (self.store, self.conv_states, self.recurrent_states):
            for t in states.values():
                t[: len(rows)] = t.index_select(0, rows)
        self.active = active

    def clear_states(self, rows: Tensor) -> None:
        """Zero the linear-attention states of ``rows``: new sequences take them (a prefill starts from none)."""
        for states in (self.conv_states, self.recurrent_states):
            for t in states.values():
                t[rows] = 0

    def snapshot_states(self, rows: int) -> list[Tensor]:
        """Copies of the first ``rows`` rows' linear-attention states (a CUDA
        graph's warm-up step of a bucket of ``rows`` must not advance them; the
        other rows' it leaves alone, and at Qwen3.5-35B-A3B each row's are 64
        MB, taken beside a cache that may just have grown into the free memory)."""
        return [t[:rows].clone() for t in (*self.conv_states.values(), *self.recurrent_states.values())]

    def restore_states(self, states: list[Tensor]) -> None:
        for t, saved in zip((*self.conv_states.values(), *self.recurrent_states.values()), states):
            t[: len(saved)].copy_(saved)

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
        history = self.conv_states[layer][self.batch]
        out = causal_conv(x, weight, history)
        self.conv_states[layer][self.batch] = conv_history(x, history, self.valid.sum(1))
        return out

    def delta(self, layer: int, q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor) -> Tensor:
        """The delta rule from each sequence's state: one recurrent step per
        decoded token, the chunked form for a prefill (padding neither decays
        nor writes the state), one of one-token prompts too: the two forms
        sum in other orders, and such a prompt beside longer ones is chunked."""
        state = self.recurrent_states[layer][self.batch]
        if self.decoding:
            out, new = recurrent_delta_rule(q, k, v, g, beta, state)
        else:
            valid = self.valid[..., None]
            out, new = chunked_delta_rule(q, k, v, g * valid, beta * valid, state)
        self.recurrent_states[layer][self.batch] = new
        return out

    def _write(self, layer: int, site: str, t: Tensor) -> None:
        """Store K or V ``[B, KV, S, D]`` of the forward in flight at its positions."""
        if self.fmt is None:
            self.store[(layer, site, "values")][self.rows, :, self.positions] = t.transpose(1, 2)
        else:
            b, s = self.positions.shape
            q = self.sites.quantize(layer, site, kv_rows(t))
            codes, scales = (self.store[(layer, site, part)] for part in ("codes", "scales"))
            codes[self.rows, self.positions] = q.codes.view(b, s, -1)
            scales[self.rows, self.positions] = q.scales.view(torch.uint8).view(b, s, -1)

    def _read(self, layer: int, site: str, span: int) -> Tensor:
        """K or V ``[B, KV, span, D]`` of positions ``< span``, in the compute dtype."""
        if self.fmt is None:
            return self.store[(layer, site, "values")][self.batch, :, :span]
        rows = dequantize(self.fp4_rows(layer, site, self.batch, span)).to(self.dtype)
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
        # prefill and decode alike: at a single query SDPA's CPU kernel also beats a matmul, a softmax and a
        # matmul, and sums in fp32 where those round scores and weights to bf16 (docs/rollout.md)
        return attention(q, keys, values, self.visible)


# Tokens decoded between two reads of the device (which requests finished): the only host sync of the decode loop
DEFAULT_STOP_CHECK = 8


class TorchEngine:
    """The torch rollout engine: runs FP4 rollout as the configuration says,
    on its own copy of the policy (``dtype``, default BF16) on ``device``: it
    rounds that copy's routed experts to FP4 in place and loads weight syncs
    into it, so the caller's model is left as it was. A caller that does not
    use the model again hands it over instead (``take``): the engine then
    moves, casts and quantizes that model itself, and no second copy of the
    weights is made (at Qwen3.5-35B-A3B one is 69 GB).

    ``stop_check_every`` (N) is how many tokens it decodes between stop checks,
    the decode loop's only reads of the device; finished requests keep
    decoding into padding until the next check, so N changes speed, never
    results. ``cuda_graphs``: on CUDA, without capture, each batch bucket's
    decode step is a CUDA graph (:class:`DecodeGraphs`).
    ``max_running_requests`` (0: no bound) is how many requests a ``generate``
    call rolls out at once, the others taking the rows of finished ones: the
    KV cache and the linear-attention states are held for that many requests
    (about 64 MB of states per sequence on Qwen3.5-35B-A3B, whatever its
    length)."""

    def __init__(
        self,
        model: Transformer,
        quant: QuantConfig = BF16,
        *,
        dtype: torch.dtype = torch.bfloat16,
        device: str | torch.device = "cpu",
        capture: CaptureConfig | None = None,
        calibration_seed: int = 0,
        stop_check_every: int = DEFAULT_STOP_CHECK,
        cuda_graphs: bool = True,
        max_running_requests: int = 0,
        take: bool = False,
    ):
        if stop_check_every < 1:
            raise ValueError(f"stop_check_every must be >= 1 token, got {stop_check_every}")
        if max_running_requests < 0:
            raise ValueError(f"max_running_requests must be >= 0 (0: no bound), got {max_running_requests}")
        self.stop_check_every, self.cuda_graphs = stop_check_every, cuda_graphs
        self.max_running_requests = max_running_requests
        self.quant, self.dtype, self.device = quant, dtype, torch.device(device)
        self.model = (model.to(device=self.device, dtype=dtype) if take else copied(model, self.device, dtype)).eval()
        self.capture_config = capture
        self.calibration_seed = calibration_seed
        self.policy_version = 0
        self.decode_steps = 0  # run since its creation, each over a whole batch bucket
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

    def uses_cuda_graphs(self) -> bool:
        """Whether decode steps replay CUDA graphs: on CUDA, unless switched
        off, and not while capturing (capture's host-side bookkeeping runs per
        forward)."""
        return self.cuda_graphs and self.device.type == "cuda" and self.capture is None

    def kv_bytes_per_token(self) -> float:
        """Bytes the KV cache holds per cached token, all layers."""
        return KVCache(self.model.cfg, 1, 1, self.sites, self.dtype, "cpu").bytes_per_token()

    def drain_capture(self, trajectories: Tensor | None = None) -> CaptureRecords:
        """Everything captured since the last drain, or the rows of ``trajectories`` alone (:meth:`Capture.drain`)."""
        if self.capture is None:
            raise RuntimeError("this engine captures nothing: no capture config, or no FP4 activation/KV site")
        return self.capture.drain(trajectories)

    @torch.inference_mode()  # no autograd or version-counter work per op: on a CPU ~9% of a small model's decode step
    def generate(
        self,
        prompts: list[list[int]],
        sampling: SamplingParams,
        first: int | None = None,
        place: int = 0,
        finished: Callable[[list[Trajectory]], None] | None = None,
    ) -> list[Trajectory]:
        """Sample one response per prompt. Prompt i gets trajectory id
        ``first + i`` (default: numbered on from the last call) and draws from
        its own generator, seeded by ``sampling.seed`` and its place ``place + i``
        in its batch: a request gives the same response whatever else shares
        the call (a batch split over rollout workers passes each share's place).
        At most ``max_running_requests`` requests run at once, and, capturing,
        as many as whose prefill fits a capture buffer (``CaptureConfig.max_tokens``
        token rows); the others wait, in order, and at each stop check take
        the rows of the requests that finished (continuous batching): the
        same responses as one batch of them all, where the batch does not
        change a request's rounding (docs/rollout.md, "Serving design").
        ``finished`` is called at each stop check with the requests that
        retired there, while the others decode on (a rollout drains their
        capture to the store then)."""
        self._check(prompts, sampling)
        first = self._next_id if first is None else first
        self._next_id = first + len(prompts)
        run = _Decode(self, prompts, sampling, first, place, self.rows_at_once(prompts), finished)
        while run.check_if_due():
            run.sample(run.decode())
        return run.trajectories()

    def rows_at_once(self, prompts: list[list[int]]) -> int:
        """How many of ``prompts`` run at once: all, but ``max_running_requests``
        at most, and, capturing, as many as a prefill of the longest prompts
        fits a capture buffer (a prompt alone too long still fails there)."""
        rows = min(len(prompts), self.max_running_requests or len(prompts))
        if self.capture is None:
            return rows
        return min(rows, max(1, self.capture.config.max_tokens // max(len(p) for p in prompts)))

    def _check(self, prompts: list[list[int]], sampling: SamplingParams) -> None:
        if not prompts or any(len(p) == 0 for p in prompts):
            raise ValueError("every prompt needs at least one token")
        vocab = self.model.cfg.vocab_size
        if any(t < 0 or t >= vocab for p in prompts for t in p):
            raise ValueError(f"prompt token ids must lie in [0, {vocab})")
        if not 0 <= sampling.pad_token < vocab:  # else only a batch of prompts of several lengths would fail
            raise ValueError(f"pad_token {sampling.pad_token} must lie in [0, {vocab})")
        if sampling.record_topk > vocab:
            raise ValueError(f"record_topk {sampling.record_topk} exceeds the vocabulary's {vocab} tokens")

    def _forward(
        self,
        tokens: Tensor,
        positions: Tensor,
        lengths: Tensor,
        ids: Tensor,
        cache: KVCache,
        span: int,
        logits_at: Tensor | None = None,
        rows: Tensor | None = None,
    ) -> Tensor:
        """Logits ``[B, S, V]`` of ``tokens [B, S]`` at ``positions`` (or
        ``[B, V]`` at ``logits_at``: :meth:`Transformer.forward`) attending to
        positions ``< span``, cached (and captured) as row b's trajectory
        ``ids[b]`` (-1: captured as padding) below ``lengths[b]``, in the
        cache's first B rows or ``rows``."""
        # a prefill projects each prompt's last position alone (logits_at), a decode step its one position
        cache.start(positions, lengths, span, rows, decoding=logits_at is None)
        if self.capture is not None:
            self.capture.begin(TokenMap.of(ids, positions, lengths))
        logits = self.model(tokens, positions, cache, self.sites, logits_at)
        if self.capture is not None:
            self.capture.end()
        return logits

    def _prefill(
        self,
        tokens: Tensor,
        positions: Tensor,
        lengths: Tensor,
        ids: Tensor,
        cache: KVCache,
        rows: Tensor | None = None,
    ) -> Tensor:
        """One forward over the right-padded prompts, into the cache's first
        rows or ``rows``; logits ``[B, V]`` after each prompt's last token."""
        return self._forward(tokens, positions, lengths, ids, cache, tokens.shape[1], lengths - 1, rows)

    def _decode(self, new: Tensor, lengths: Tensor, ids: Tensor, cache: KVCache, span: int) -> Tensor:
        """The decode step: logits ``[B, V]`` after each row's ``new`` token,
        at position ``lengths - 1``. Every tensor's shape depends on the batch
        bucket ``B`` and ``span`` alone, and nothing reads the device: on CUDA
        it is what :class:`DecodeGraphs` captures."""
        return self._forward(new[:, None], (lengths - 1)[:, None], lengths, ids, cache, span)[:, 0]

    def _capture_kv(self, cache: KVCache, row: int, traj_id: int, cached: int) -> None:
        """Capture a finished request's KV codes: every position the rollout computed."""
        if self.capture is None or self.quant.kv is None:
            return
        for layer in self.model.cfg.attention_layers:
            for site in KV_SITES:
                q = cache.fp4_rows(layer, site, row, cached)
                self.capture.record_kv(traj_id, layer, site, q.codes, q.scales.view(torch.uint8))


def copied(model: Transformer, device: torch.device, dtype: torch.dtype) -> Transformer:
    """``copy.deepcopy(model).to(device=device, dtype=dtype)`` with each parameter
    and buffer written once, on ``device`` and (floating-point ones, as
    ``Module.to`` casts) in ``dtype``: no whole copy where ``model`` lies first,
    which for a policy on the host bound for a GPU is a second host copy."""
    memo = {}
    for t in (*model.parameters(), *model.buffers()):
        cast = dtype if t.is_floating_point() or t.is_complex() else None
        moved = t.detach().to(device=device, dtype=cast, copy=True)
        memo[id(t)] = torch.nn.Parameter(moved, t.requires_grad) if isinstance(t, torch.nn.Parameter) else moved
    return copy.deepcopy(model, memo)


def batch_buckets(batch: int) -> list[int]:
    """The batch sizes a ``generate`` call of ``batch`` requests decodes at:
    the powers of two below it, and itself. A CUDA graph is captured per
    bucket used; a smaller bucket is taken at a stop check when the requests
    still running fit it."""
    if batch < 1:
        raise ValueError(f"a batch needs at least one request, got {batch}")
    return [1 << i for i in range(batch.bit_length()) if 1 << i < batch] + [batch]


def bucket_for(n: int, buckets: list[int]) -> int:
    """The smallest bucket that holds ``n`` rows."""
    return next(b for b in buckets if b >= n)


class _Decode:
    """The decode loop of one ``generate`` call, with its host and device state.

    Each request, while it runs, holds a row of the batch (the KV cache's) and
    a slot of the per-request device tables (its uniforms, and the tokens and
    logprobs sampled so far); a row and its slot go to the next waiting request
    once it retires. Every step samples a token per row into its slot's
    tables at the request's own step and notes the first stop token, without
    reading the device. At a stop check (:meth:`check`, every
    ``stop_check_every`` tokens, and where a request reaches
    ``max_new_tokens``) the host reads which requests finished: they retire
    (their response is read, their KV captured), waiting requests are
    prefilled into their rows, and, once none waits, the batch moves to the
    smallest bucket that holds the rest. Until then a finished row keeps
    decoding: its extra tokens land past its end and are dropped, and its
    forwards are captured as padding, so results are those of checking every
    token; a retired row that nothing takes decodes from position 0 on, so
    that it never outgrows the cache."""

    def __init__(self, engine, prompts, sampling, first, place, rows, finished=None):
        dev, n_new = engine.device, sampling.max_new_tokens
        self.engine, self.prompts, self.sampling, self.first, self.place = engine, prompts, sampling, first, place
        self.finished = finished  # told the requests each stop check retires
        self.n_new = n_new
        longest = max(len(p) for p in prompts[:rows])  # what the first prefill needs; the cache grows for the rest
        cfg = engine.model.cfg
        self.cache = KVCache(
            cfg, rows, max(map(len, prompts)) + n_new, engine.sites, engine.dtype, dev, longest + KV_HEADROOM
        )
        self.buckets = batch_buckets(rows)
        self.graphs = DecodeGraphs(engine, self.cache) if engine.uses_cuda_graphs() else None
        self.stop = torch.tensor(sampling.stop_tokens or [-1], device=dev)
        # per slot: the request's draws and what it sampled, by its own step
        self.uniforms = torch.zeros(rows, n_new, device=dev) if sampling.temperature > 0 else None
        self.tokens = torch.zeros(rows, n_new, dtype=torch.long, device=dev)
        self.logprobs = torch.zeros(rows, n_new, dtype=torch.float32, device=dev)
        k = sampling.record_topk
        self.top_ids = torch.zeros(rows, n_new, k, dtype=torch.long, device=dev) if k else None
        self.top_logprobs = torch.zeros(rows, n_new, k, dtype=torch.float32, device=dev) if k else None
        self.stopped_at = torch.full((rows,), n_new, device=dev)  # the request's step of its first stop token
        self.ids = torch.full((rows,), -1, device=dev)  # its trajectory id; -1 once retired (captured as padding)
        self.starts = torch.zeros(rows, dtype=torch.long, device=dev)  # the loop step of its first token
        self.slot_request, self.slot_start = [0] * rows, [0] * rows  # the same on the host
        # per row of the batch
        self.slots = torch.arange(rows, device=dev)
        self.host_slots = list(range(rows))
        self.lengths = torch.zeros(rows, dtype=torch.long, device=dev)  # including the newest token once sampled
        self.new = torch.zeros(rows, dtype=torch.long, device=dev)
        self.reach = [0] * rows  # a row's length at loop step t is reach + t
        self.live: list[int] = []  # the rows whose requests have not retired
        self.step = 0  # the loop step of the newest tokens
        self.admitted = 0  # requests admitted so far, in order
        self.results: dict[int, Trajectory] = {}
        self._admit(list(range(rows)))
        self._note_rows()

    def _admit(self, rows: list[int]) -> None:
        """Prefill the next waiting requests into ``rows`` (free ones) and sample their first tokens."""
        dev, n_new = self.engine.device, self.n_new
        requests = list(range(self.admitted, self.admitted + len(rows)))
        self.admitted += len(rows)
        prompts = [self.prompts[i] for i in requests]
        slots = [self.host_slots[r] for r in rows]
        row_index, slot_index = torch.tensor(rows, device=dev), torch.tensor(slots, device=dev)
        if self.uniforms is not None:  # request i's draws, in order: its generator's stream (CPU, on any device)
            seeds = (derive_seed(self.sampling.seed, self.place + i) for i in requests)
            draws = [torch.rand(n_new, generator=torch.Generator().manual_seed(seed)) for seed in seeds]
            self.uniforms[slot_index] = torch.stack(draws).to(dev)
        ids = torch.tensor([self.first + i for i in requests], device=dev)
        self.stopped_at[slot_index], self.ids[slot_index], self.starts[slot_index] = n_new, ids, self.step
        for row, slot, request in zip(rows, slots, requests):
            self.slot_request[slot], self.slot_start[slot] = request, self.step
            self.reach[row] = len(self.prompts[request]) + 1 - self.step
        tokens, positions, lengths = right_pad(prompts, pad=self.sampling.pad_token, device=dev)
        self._room(tokens.shape[1])
        self.cache.clear_states(row_index)
        whole = rows == list(range(len(self.host_slots)))  # the whole batch: the cache's own views
        logits = self.engine._prefill(tokens, positions, lengths, ids, self.cache, None if whole else row_index)
        self.lengths[row_index] = lengths
        self.sample(logits, row_index)
        self.live = sorted(self.live + rows)

    def _room(self, positions: int) -> None:
        """A cache that holds ``positions``: grown if need be (graphs captured on the old one are let go)."""
        if self.cache.grow(positions) and self.graphs is not None:
            self.graphs = DecodeGraphs(self.engine, self.cache)  # the old graphs read the old tensors

    def sample(self, logits: Tensor, rows: Tensor | None = None) -> None:
        """Draw each row's token (of ``rows``, admitted at this step; else of
        every row, at the next step) from its request's uniform at the
        request's own step, and note it."""
        if rows is None:
            self.step += 1
        slots = self.slots if rows is None else self.slots[rows]
        # the request's step; a retired row decoding into padding may run past its old request's last one
        col = (self.step - self.starts[slots]).clamp(max=self.n_new - 1)
        u = None if self.uniforms is None else self.uniforms[slots, col]
        new, logprobs, top = sample(logits, self.sampling, u)
        self.tokens[slots, col] = new
        self.logprobs[slots, col] = logprobs
        if top is not None:
            self.top_ids[slots, col] = top.indices
            self.top_logprobs[slots, col] = top.values
        first_stop = torch.isin(new, self.stop) & (self.stopped_at[slots] == self.n_new)
        self.stopped_at[slots] = torch.where(first_stop, col, self.stopped_at[slots])
        if rows is None:
            self.lengths += 1
            self.new = new
        else:
            self.lengths[rows] += 1
            self.new[rows] = new

    def decode(self) -> Tensor:
        """Logits after each row's newest token; a finished row's forward is captured as padding."""
        traj = torch.where(self.stopped_at[self.slots] < self.n_new, -1, self.ids[self.slots])
        span = self.longest + self.step
        self._room(span)
        self.engine.decode_steps += 1
        if self.graphs is not None:
            return self.graphs(self.new, self.lengths, traj)
        return self.engine._decode(self.new, self.lengths, traj, self.cache, span)

    def check_if_due(self) -> bool:
        """The stop check where one is due: every ``stop_check_every`` steps,
        and at the step where a request takes its last token; whether any
        request runs on."""
        if (self.step + 1) % self.engine.stop_check_every and self.step < self.last:
            return True
        return self.check()

    def check(self) -> bool:
        """Retire the requests that finished, prefill waiting ones into their
        rows, and, once none waits, move to the smallest bucket that holds the
        rest; whether any request runs on."""
        while True:
            self._retire()
            free = [r for r in range(len(self.host_slots)) if r not in self.live]
            admitted = free[: len(self.prompts) - self.admitted]
            if admitted:
                self._admit(admitted)
            if self.n_new > 1 or not admitted:  # with one token each, the admitted requests are done already
                break
        bucket = bucket_for(max(len(self.live), 1), self.buckets)
        if self.live and bucket < len(self.host_slots):  # the running rows first, then retired ones to fill
            order = self.live + [r for r in range(len(self.host_slots)) if r not in self.live]
            index = torch.tensor(order[:bucket], device=self.slots.device)
            self.cache.compact(index, bucket)
            self.slots, self.lengths, self.new = self.slots[index], self.lengths[index], self.new[index]
            self.host_slots = [self.host_slots[r] for r in order[:bucket]]
            self.reach = [self.reach[r] for r in order[:bucket]]
            self.live = list(range(len(self.live)))
        self._note_rows()
        return bool(self.live)

    def _note_rows(self) -> None:
        """What each step reads of the rows, which only admissions, retirements
        and compaction change: the longest row's reach (the decode's span is
        it plus the step) and the step at which a running request takes its
        last token (a check is due there)."""
        self.longest = max(self.reach)
        starts = [self.slot_start[self.host_slots[r]] for r in self.live]
        self.last = min(starts, default=self.step) + self.n_new - 1

    def _retire(self) -> None:
        """Read which requests finished (the host reads the device here, and
        only here), keep their responses, capture their KV; their rows decode
        from position 0 on as padding until a request takes them."""
        stopped_at = self.stopped_at.tolist()
        done = [
            row
            for row in self.live
            if stopped_at[self.host_slots[row]] < self.n_new
            or self.step - self.slot_start[self.host_slots[row]] == self.n_new - 1
        ]
        if not done:
            return
        slots = [self.host_slots[r] for r in done]
        ends = [min(stopped_at[s], self.n_new - 1) + 1 for s in slots]  # the tokens each response keeps
        index, width = torch.tensor(slots, device=self.slots.device), max(ends)
        tokens, logprobs = self.tokens[index, :width].tolist(), self.logprobs[index, :width].tolist()
        top = (
            None
            if self.top_ids is None
            else (self.top_ids[index, :width].tolist(), self.top_logprobs[index, :width].tolist())
        )
        for j, (row, slot, end) in enumerate(zip(done, slots, ends)):
            request = self.slot_request[slot]
            prompt = self.prompts[request]
            t = Trajectory(self.first + request, list(prompt), tokens[j][:end], logprobs[j][:end], "")
            t.finish_reason = "stop" if stopped_at[slot] < self.n_new else "length"
            if top is not None:
                t.topk_ids, t.topk_logprobs = top[0][j][:end], top[1][j][:end]
            self.results[request] = t
            # positions the rollout computed: all but the last token
            self.engine._capture_kv(self.cache, row, self.first + request, len(prompt) + end - 1)
            self.reach[row] = 1 - self.step
        rows = torch.tensor(done, device=self.slots.device)
        self.ids[index] = -1
        self.lengths[rows] = 1
        self.live = [r for r in self.live if r not in done]
        if self.finished is not None:
            self.finished([self.results[self.slot_request[slot]] for slot in slots])

    def trajectories(self) -> list[Trajectory]:
        """Each request's response up to its first stop token (or the length limit), in request order."""
        return [self.results[i] for i in range(len(self.prompts))]


class DecodeGraphs:
    """The decode step replayed as one CUDA graph per batch bucket (CUDA
    only; on the CPU the same step runs eagerly).

    A bucket's graph is captured the first time the loop decodes at that
    size, on static copies of the step's inputs (new tokens, lengths, row
    trajectory ids), attending over the cache's whole length with a mask, so
    that no shape depends on the step; every step copies its inputs in,
    replays, and reads the logits the graph wrote. Graphs share one memory
    pool: buckets only shrink during a call, so a replaced graph never runs
    again."""

    def __init__(self, engine: "TorchEngine", cache: KVCache):
        self.engine, self.cache = engine, cache
        self.pool = torch.cuda.graph_pool_handle()
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, list[Tensor], Tensor]] = {}

    def __call__(self, new: Tensor, lengths: Tensor, traj: Tensor) -> Tensor:
        if new.shape[0] not in self.graphs:
            self.graphs[new.shape[0]] = self._capture(new, lengths, traj)
        graph, inputs, logits = self.graphs[new.shape[0]]
        for static, t in zip(inputs, (new, lengths, traj)):
            static.copy_(t)
        graph.replay()
        return logits

    def _capture(self, new: Tensor, lengths: Tensor, traj: Tensor):
        inputs = [t.clone() for t in (new, lengths, traj)]

        def step() -> Tensor:
            return self.engine._decode(*inputs, self.cache, self.cache.length)

        states = self.cache.snapshot_states(len(new))
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):  # a warm-up outside the graph: lazy initialization, library workspaces
            step()
        torch.cuda.current_stream().wait_stream(side)
        # the warm-up advanced the linear-attention states (restored here); its KV writes are the step's own
        self.cache.restore_states(states)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            logits = step()
        return graph, inputs, logits
