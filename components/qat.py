"""The training side of FP4 RL: the policy's forward with FP4 fake quantization
at the rollout's sites, straight-through backward, and TRACE's guided rounding
where the rollout left guidance.

Methods (the paper's comparison):

- ``bf16``: no quantization (the reference);
- ``qat``: vanilla QAT, round-to-nearest at every site the rollout quantizes;
- ``quads``: asymmetric QAT, weights fake-quantized, activations and KV left in
  BF16 (QUADS, arXiv 2607.15810; its rollout-side compensation is not modelled);
- ``trace``: as ``qat``, but each captured value rounds to the neighbouring
  codeword the rollout's code points at, under the rollout's block scales;
- ``tis_sc``: BF16 training that corrects for the FP4 rollout in the loss
  alone (truncated importance sampling with score centering, see :mod:`.rl`).

QaRL (TBPO) is not offered: its sequence-level objective is not specified
precisely enough in the sources we have to implement it faithfully.

All methods share the rollout's static global scales, so that the only
differences are the rounding and, for guided rows, the block scales. Under
per-token activation global scales (``QuantConfig.activation_global_scale``)
RTN computes each row's scale from the training values, as the serving engine
computes it from the rollout's; guided rows take the rollout's own, captured.
"""

import contextlib
from dataclasses import dataclass, field

import torch
from torch import Tensor

from tracefp4.kernels import (
    FP4Tensor,
    Guidance,
    compact_codes,
    dequantize,
    fake_quantize,
    get_format,
    quantize,
    straight_through,
    to_device,
)

from .capture import group_of_rows
from .choices import METHODS
from .guidance import GuidanceError, MicrobatchGuidance
from .mismatch import guidable
from .quant import Recorder, fp4_expert_weights, global_scale, kv_from_rows, kv_rows
from .quant_config import ACTIVATION_SITES, QuantConfig
from .syndrome import SyndromeTable, add_tally, decode_rows


@dataclass
class Coverage:
    """Captured elements that were rounded with guidance, per ``(layer, site)``:
    ``guided`` counts are 0-dim tensors on the forward's device (counting reads
    nothing from it), ``total`` counts are the tables' sizes, known on the host."""

    guided: dict = field(default_factory=dict)
    total: dict = field(default_factory=dict)
    decode: dict = field(default_factory=dict)  # syndrome-coded guidance: (layer, site) -> (rate, tally on the device)

    def add(self, key, guided: Tensor, total: int) -> None:
        self.guided[key] = self.guided.get(key, 0) + guided
        self.total[key] = self.total.get(key, 0) + total

    @property
    def rate(self) -> float:
        total = sum(self.total.values())
        return float(sum(self.guided.values())) / total if total else 0.0


def _take_rows(q: FP4Tensor, guided: FP4Tensor, train: Tensor, ok: Tensor) -> None:
    """Row ``train[i]`` of ``q`` replaced, in place, by row i of ``guided`` where
    ``ok[i]`` (each row of ``q`` guided by one row at most). Each row of ``q``
    looks up the row guiding it, rows ``ok`` leaves out landing on a spare slot
    past the end: selecting the ``ok`` rows instead would give a shape read
    from the device (a host sync on CUDA)."""
    n = q.codes.shape[0]
    source = torch.full((n + 1,), -1, dtype=torch.long, device=train.device)
    source = source.index_copy_(0, torch.where(ok, train, n), torch.arange(len(train), device=train.device))[:n]
    hit, source = (source >= 0)[:, None], source.clamp(min=0)
    q.codes.copy_(torch.where(hit, guided.codes[source], q.codes))
    scales = q.scales.view(torch.uint8)
    scales.copy_(torch.where(hit, guided.scales.view(torch.uint8)[source], scales))
    if q.global_scale is not None and q.global_scale.dim():  # per-token: the rollout's row scales too
        q.global_scale.copy_(torch.where(hit, guided.global_scale[source], q.global_scale))


class TrainingSites:
    """Fake quantization for one training forward of a microbatch whose rows
    are ``trajectories`` (row b holds trajectory ``trajectories[b]``, positions
    0.., padded to ``seq_len``)."""

    def __init__(
        self,
        quant: QuantConfig,
        method: str,
        global_scales: dict,
        *,
        trajectories: list[int] | None = None,
        seq_len: int = 0,
        guidance: MicrobatchGuidance | None = None,
        recorder: Recorder | None = None,
        compute_dtype: torch.dtype | None = None,
        scale_values: dict[tuple[int, str], float] | None = None,
    ):
        if method not in METHODS:
            raise ValueError(f"unknown training method {method!r}; implemented: {METHODS}")
        if method == "trace" and guidance is None:
            raise ValueError("method 'trace' needs the microbatch's guidance")
        self.quant, self.method, self.global_scales = quant, method, global_scales
        self.guidance, self.recorder, self.seq_len = guidance, recorder, seq_len
        self.compute_dtype = compute_dtype  # weights are rounded to it first, as the rollout's copy is
        self.trajectories = torch.tensor(trajectories or [], dtype=torch.long)
        self.scale_values = scale_values or {}  # global_scales as host floats: checked without reading the device
        self.coverage = Coverage()
        self.replay = False  # the forward running is a layer's recomputation (replaying)

    @contextlib.contextmanager
    def replaying(self):
        """A layer's recomputation in the backward: the same rounding, but the
        coverage, decode tallies and recorded codes were taken in its forward."""
        self.replay = True
        try:
            yield
        finally:
            self.replay = False

    def _rows(self, key, x: Tensor, expert: Tensor | None):
        """The guidance table on ``x``'s device (the loader yields CPU tables) and,
        per table row, the row of ``x`` it guides (``train``, clamped into ``x``)
        and whether it guides one (``ok``: not a row of another microbatch, nor
        past its sequence, nor of an expert training did not route the token to).
        Every table row is kept, so shapes are the table's, known on the host:
        selecting the valid rows would read their count from the device (a host sync on CUDA)."""
        table, n_rows = self.guidance.tables[key], x.shape[0]
        b = to_device(self._sequences(table), x.device)
        table = table.to(x.device)
        token = b * self.seq_len + table.pos
        ok = (b >= 0) & (table.pos < self.seq_len)
        if expert is None:  # a row per token
            return table, token.clamp(0, n_rows - 1), ok & (token < n_rows)
        # a row per (token, slot), k slots per token: the rollout's row of the token's expert guides the slot where
        # training sent the token to that expert, whichever it is (near-tied router scores can order the two
        # paths' top-k differently; the expert's input is the same)
        k = n_rows // (len(self.trajectories) * self.seq_len)
        tokens = n_rows // k
        same = expert.view(tokens, k)[token.clamp(0, tokens - 1)] == table.expert[:, None]  # [rows, k]
        return table, token.clamp(0, tokens - 1) * k + same.int().argmax(1), ok & (token < tokens) & same.any(1)

    def _sequences(self, table) -> Tensor:
        """Per row of a (host) guidance table, the microbatch sequence of its trajectory (-1: another microbatch's)."""
        sequence = group_of_rows(table.traj, list(self.trajectories.view(-1, 1)))
        return torch.where(sequence < len(self.trajectories), sequence, -1)

    def _keeps(self, site: str) -> bool:
        """Whether this method leaves ``site``'s values as they are."""
        if self.method in ("bf16", "tis_sc") or (self.method == "quads" and site != "expert_weights"):
            return True
        return self.quant.site_format(site) is None and not self._fp8(site)

    def _fp8(self, site: str) -> bool:
        return site in ACTIVATION_SITES and self.quant.activations == "fp8"

    def _fp4(self, layer: int, site: str, x: Tensor, expert: Tensor | None = None, token=None, slot=None) -> Tensor:
        if self._keeps(site):
            return x
        if self._fp8(site):
            return fake_quantize(x, "fp8")
        fmt = self.quant.site_format(site)
        g = global_scale(self.quant, site, x.detach(), self.global_scales, layer)
        # unchecked (checking reads the device): static scales were checked where made, per-token ones are valid as made
        q = quantize(x.detach(), fmt, global_scale=g, check_scale=False)
        key = (layer, site)
        if self.method == "trace" and key in self.guidance.tables:
            table, train, ok = self._rows(key, x, expert)
            self._check_scales(key, table, g, self.quant.per_token(site))
            if isinstance(table, SyndromeTable):
                ok, guide = self._decode(table, x.detach(), train, ok, g)
            else:
                guide = table.guidance()
            if len(table.traj):
                rows = x.detach()[train]
                ok = ok & guidable(rows)  # a row holding NaN or Inf rounds to nearest
                _take_rows(q, quantize(rows, fmt, guide=guide), train, ok)
            if not self.replay:
                self.coverage.add(key, ok.sum() * table.width, len(table.traj) * table.width)
        if self.recorder is not None and not self.replay:
            self.recorder.record(layer, site, x.detach(), q, token, slot, expert)
        return straight_through(x, dequantize(q))

    def _check_scales(self, key, table, g, per_token: bool) -> None:
        """Guidance must come from a rollout with this path's global scales: the
        same static scale, or per-token scales on both sides. The static scale
        is compared as a host float (``scale_values`` where given: reading ``g``
        from the device would be a host sync)."""
        where = f"guidance for layer {table.layer} {table.site}"
        captured_per_token = getattr(table, "row_global_scales", None) is not None
        if captured_per_token != per_token:
            modes = {True: "per-token", False: "static"}
            raise GuidanceError(
                f"{where} was captured under {modes[captured_per_token]} global scales, "
                f"training uses {modes[per_token]} ones"
            )
        if per_token:
            return
        if g is None:
            static = None
        else:  # callers without host copies (benchmarks, mismatch tools) read g
            static = self.scale_values[key] if key in self.scale_values else float(g)
        if table.global_scale != static:
            raise GuidanceError(f"{where} was captured under another static scale")

    def _decode(self, table: SyndromeTable, x: Tensor, train: Tensor, ok: Tensor, g):
        """Decode syndrome-coded guidance with this forward's values (the layers
        below already guided) as side information: which table rows guide their
        training row (``ok`` and decoded), and every row's guidance. Failed
        blocks round to nearest, counted."""
        values = torch.where(ok[:, None], x[train].float(), 0.0)
        scales, low, decoded, tally = decode_rows(table, values, ok)
        if not self.replay:
            add_tally(self.coverage.decode, (table.layer, table.site), table.rate, tally)
        f = get_format(table.fmt)
        guide = Guidance(
            compact_codes(low, 1), 1, scales.view(f.scale_dtype), g, f.name, torch.Size((len(low), table.width))
        )
        return ok & decoded, guide

    def routing(self, layer: int, experts: Tensor) -> Tensor:
        """Under syndrome-coded guidance, each guided token goes to the experts
        the rollout chose (the ``expert`` its ``moe_down_in`` rows carry): a
        near-tie the two numerics break differently would send the token to
        another expert, so every later site of that token, and of the positions
        attending to it, disagrees with the rollout in most elements, which no
        fraction of a bit per element recovers (docs/guidance-format.md)."""
        table = self.guidance.tables.get((layer, "moe_down_in")) if self.method == "trace" else None
        if not isinstance(table, SyndromeTable):
            return experts
        b = self._sequences(table)
        token = b * self.seq_len + table.pos.long()
        n = experts.shape[0]
        spare = torch.where((b >= 0) & (token < n), token, n)  # a table row of no token here writes a spare row
        chosen = torch.cat([experts, experts.new_zeros(1, experts.shape[1])])
        rows, slots, rollout = (to_device(t.long(), experts.device) for t in (spare, table.slot, table.expert))
        chosen[rows, slots] = rollout  # every table row written: selecting the valid ones would read them
        return chosen[:n]

    def moe_in(self, layer, x):
        return self._fp4(layer, "moe_in", x)

    def moe_down_in(self, layer, h, rows):
        if self._keeps("moe_down_in"):
            return h
        return rows.per_row(lambda r, token, slot, expert: self._fp4(layer, "moe_down_in", r, expert, token, slot), h)

    def kv(self, layer, k, v):
        return self._kv(layer, "k_cache", k), self._kv(layer, "v_cache", v)

    def _kv(self, layer: int, site: str, t: Tensor) -> Tensor:
        return kv_from_rows(self._fp4(layer, site, kv_rows(t)), t.shape[0], t.shape[1])

    def expert_weights(self, layer, gate_up, down):
        fmt = self.quant.weights
        if self.method in ("bf16", "tis_sc") or fmt is None:
            return gate_up, down

        def fp4(w: Tensor) -> Tensor:  # as the rollout's: from the weights rounded to the compute dtype
            return straight_through(w, fp4_expert_weights(w.detach().to(self.compute_dtype or w.dtype), fmt))

        return fp4(gate_up), fp4(down)
