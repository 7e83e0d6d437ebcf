"""Where FP4 rollout quantizes, and what it does there.

Quantization sites, enumerable as ``(layer, site)``:

- ``expert_weights``: routed-expert gate/up and down weights (W4), one global
  scale per expert and matrix; quantized once per weight sync;
- ``moe_in``: the routed experts' gate/up input, one row per token (all of a
  token's experts see the same quantized row, as in FlashInfer/SGLang MoE);
- ``moe_down_in``: the down-projection input, one row per (token, expert slot);
- ``k_cache`` / ``v_cache``: K after RoPE and V, one row per position
  (``kv_heads * head_dim`` elements, blocks along ``head_dim``); full-attention
  layers only: a hybrid model's linear-attention layers have no KV cache, and
  their conv and recurrent states stay in the compute dtype.

Attention projections, router, shared experts, embeddings and lm_head stay in
the compute dtype. NVFP4 global scales of the activation sites come in the two
modes serving engines use (``QuantConfig.activation_global_scale``):

- ``static``: one per ``(layer, site)``, calibrated on a seeded batch at every
  weight sync like a checkpoint's ``input_scale`` (SGLang ``modelopt_fp4``);
- ``per_token``: one per row, ``amax(row) / (6 * 448)`` computed from the
  row itself at run time (FlashInfer's per-token NVFP4 quantizer, SGLang
  ``nvfp4_online``).

KV global scales are static in both; weights use their own amax.

Which sites a rollout makes FP4, and in which format, is a
:class:`~.quant_config.QuantConfig` (torch-free, for the run config's checks).
"""

import functools
import math
from typing import Protocol

import torch
from torch import Tensor

from tracefp4.kernels import (
    FORMATS,
    FP4Tensor,
    dequantize,
    fake_quantize,
    nvfp4_global_scale,
    per_token_global_scale,
    quantize,
    valid_global_scale,
)

from .model import CausalAttention, Transformer
from .quant_config import QuantConfig


def global_scale(q: QuantConfig, site: str, x: Tensor, static: dict, layer: int) -> Tensor | None:
    """The NVFP4 global scale to quantize rows ``x`` of ``(layer, site)`` with
    under ``q``: the rows' own (per_token), else the static one of ``static``,
    None where it has none (the tensor's own amax then) or the site is not NVFP4."""
    if q.site_format(site) != "nvfp4":
        return None
    return per_token_global_scale(x) if q.per_token(site) else static.get((layer, site))


def kv_rows(t: Tensor) -> Tensor:
    """K or V ``[B, H, S, D]`` as the rows FP4 quantizes, ``[B*S, H*D]``: one
    row per (sequence, position), blocks along ``head_dim``; the rollout's KV
    cache, its cache-less pass and training all lay K/V out this way."""
    b, h, s, d = t.shape
    return t.transpose(1, 2).reshape(b * s, h * d)


def kv_from_rows(rows: Tensor, batch: int, heads: int) -> Tensor:
    """Inverse of :func:`kv_rows`: rows ``[B*S, H*D]`` (or ``[B, S, H*D]``) as ``[B, H, S, D]``."""
    return rows.reshape(batch, -1, heads, rows.shape[-1] // heads).transpose(1, 2)


def quantize_expert_weights_(model: Transformer, fmt: str | None) -> None:
    """Replace every routed expert's weights by their FP4 values (in place)."""
    if fmt is None:
        return
    with torch.no_grad():
        for moe in model.moe_blocks():
            for w in (moe.experts.gate_up, moe.experts.down):
                fp4_expert_weights(w, fmt, out=w)


# Experts rounded per quantize call, at most this many weights: a small model's layer in one call, Qwen3.5-35B-A3B's
# 256 experts of 2M weights each in 32; its temporaries (a transposed copy, magnitudes, float32 values) are then a few
# hundred MB where one call for the whole [256, 2048, 1024] matrix would take about 6 GB beside the weights
EXPERT_SLICE_WEIGHTS = 1 << 24


def fp4_expert_weights(w: Tensor, fmt: str, out: Tensor | None = None) -> Tensor:
    """The FP4 values of stacked experts' weights ``w [E, in, out]``, in ``w``'s
    dtype (written to ``out``, which may be ``w`` itself: weight sync rounds
    in place): one NVFP4 global scale per expert and matrix, blocks along the
    input dim. Experts go to quantize together, :data:`EXPERT_SLICE_WEIGHTS`
    at a time: at Qwen3.5-35B-A3B a call per expert would be 256 x 40 x 2 of
    them in every training forward."""
    out = torch.empty_like(w) if out is None else out
    per_call = max(1, EXPERT_SLICE_WEIGHTS // max(1, w.shape[1] * w.shape[2]))
    for start in range(0, len(w), per_call):
        out[start : start + per_call] = _fp4_experts(w[start : start + per_call].detach(), fmt)
    return out


def _fp4_experts(w: Tensor, fmt: str) -> Tensor:
    rows = w.transpose(1, 2).contiguous()  # [E, out, in]: one row per output, blocked along the input
    g = None
    if FORMATS[fmt].has_global_scale:  # amax / (6 * 448) of each expert's matrix, as its own tensor would get
        g = nvfp4_global_scale(rows.abs().amax(dim=(1, 2), keepdim=True)).expand(*rows.shape[:-1], 1)
    # unchecked: a NaN scale marks an expert holding NaN or Inf (it dequantizes to NaN, as alone), and checking reads
    # the device
    return dequantize(quantize(rows, fmt, global_scale=g, check_scale=False)).transpose(1, 2)


class _AmaxRecorder:
    """Sites that leave values alone and keep each site's largest magnitude."""

    def __init__(self):
        self.amax: dict[tuple[int, str], float] = {}

    def _see(self, layer: int, site: str, t: Tensor) -> None:
        key, amax = (layer, site), t.detach().abs().amax().item()
        seen = self.amax.get(key, 0.0)
        self.amax[key] = amax if math.isnan(amax) or amax > seen else seen  # NaN sticks (max() would drop it)

    def moe_in(self, layer, x):
        self._see(layer, "moe_in", x)
        return x

    def moe_down_in(self, layer, h, rows):
        self._see(layer, "moe_down_in", rows.rows(h))
        return h

    def kv(self, layer, k, v):
        self._see(layer, "k_cache", k)
        self._see(layer, "v_cache", v)
        return k, v

    def expert_weights(self, layer, gate_up, down):
        return gate_up, down

    def routing(self, layer, experts):
        return experts


def calibrate_global_scales(
    model: Transformer, q: QuantConfig, *, batch: int = 4, length: int = 64, seed: int = 0
) -> dict[tuple[int, str], Tensor]:
    """Static NVFP4 global scales ``amax / (6 * 448)`` per ``(layer, site)``,
    from one forward of seeded random tokens. Sites in other formats, and
    activation sites with per-token scales, get none."""
    recorder = _AmaxRecorder()
    gen = torch.Generator().manual_seed(seed)
    device = next(model.parameters()).device
    tokens = torch.randint(0, model.cfg.vocab_size, (batch, length), generator=gen).to(device)
    positions = torch.arange(length, device=device).expand(batch, length)
    with torch.no_grad():
        model.hidden_states(tokens, positions, CausalAttention(), recorder)
    scales = {
        key: nvfp4_global_scale(torch.tensor(amax, device=device))
        for key, amax in recorder.amax.items()
        if q.site_format(key[1]) == "nvfp4" and not q.per_token(key[1])
    }
    # checked once here, so that quantizing with them never reads the device to check them again
    bad = sorted(key for key, g in scales.items() if not valid_global_scale(float(g)))
    if bad:
        raise ValueError(
            f"calibration found activations holding NaN or Inf at (layer, site) {bad}: no NVFP4 global scale"
        )
    return scales


class Recorder(Protocol):
    """Receives the FP4 outcome of every captured site (see :mod:`.capture`)."""

    def record(
        self,
        layer: int,
        site: str,
        x: Tensor,
        q: FP4Tensor,
        token: Tensor | None,
        slot: Tensor | None,
        expert: Tensor | None,
    ) -> None:
        """``x`` rows were quantized to ``q``; see :meth:`Sites.moe_down_in` for token/slot/expert."""


class QuantSites:
    """The rollout's sites: quantize round-to-nearest under the static global
    scales, hand the codes to ``recorder``, and compute on the dequantized values."""

    def __init__(self, q: QuantConfig, global_scales: dict[tuple[int, str], Tensor], recorder: Recorder | None = None):
        self.q = q
        self.global_scales = global_scales
        self.recorder = recorder

    def quantize(self, layer: int, site: str, x: Tensor) -> FP4Tensor:
        """Static scales were checked at calibration, per-token ones are valid
        by construction (NaN for a row holding NaN or Inf): no check reads the
        device, which on CUDA would stall every quantize of the rollout."""
        g = global_scale(self.q, site, x, self.global_scales, layer)
        return quantize(x, self.q.site_format(site), global_scale=g, check_scale=False)

    def _activation(self, layer, site, x, token=None, slot=None, expert=None):
        if self.q.activations is None:
            return x
        if self.q.activations == "fp8":
            return fake_quantize(x, "fp8")
        qt = self.quantize(layer, site, x)
        if self.recorder is not None:
            self.recorder.record(layer, site, x, qt, token, slot, expert)
        values = dequantize(qt).to(x.dtype)
        if self.q.compensated_channels and x.shape[0]:
            # each row's own highest-error channels get their residual back: no other row of the forward (another
            # request, padding, a finished row) changes a row's values
            error = (x.float() - values.float()).abs()
            worst = error.topk(min(self.q.compensated_channels, x.shape[-1]), dim=-1).indices
            values.scatter_(-1, worst, x.gather(-1, worst))
        return values

    def moe_in(self, layer, x):
        return self._activation(layer, "moe_in", x)

    def moe_down_in(self, layer, h, rows):
        if self.q.activations is None:  # _activation would return the rows as they are: skip per_row's two copies
            return h
        return rows.per_row(functools.partial(self._activation, layer, "moe_down_in"), h)

    def expert_weights(self, layer, gate_up, down):
        return gate_up, down  # quantized in place at weight sync

    def routing(self, layer, experts):
        return experts

    def kv(self, layer, k, v):
        """Cache-less pass (teacher forcing): K/V through FP4, as the cache would store them."""
        if self.q.kv is None:
            return k, v
        return self._kv(layer, "k_cache", k), self._kv(layer, "v_cache", v)

    def _kv(self, layer: int, site: str, t: Tensor) -> Tensor:
        rows = kv_rows(t)
        qt = self.quantize(layer, site, rows)
        if self.recorder is not None:
            self.recorder.record(layer, site, rows, qt, None, None, None)
        return kv_from_rows(dequantize(qt).to(t.dtype), t.shape[0], t.shape[1])
