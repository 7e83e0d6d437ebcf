"""The phenomenon TRACE fixes, measured: the training path rounds some values
to other FP4 codewords than the rollout did.

``teacher_force`` runs the rollout's tokens through the training path
(full-sequence forwards, the same weights, round-to-nearest, the same static
scales) and captures its codes like the rollout; ``compare`` joins both
captures on ``(trajectory, position, slot)`` and counts, per ``(layer, site)``,
the elements whose codeword differs and by how many codewords.

End to end, a flip in one layer changes every later layer's inputs, so the
mismatch of a deep layer is mostly inherited. ``rounded`` separates a site's
own flips from the cascade: given a training capture whose forward was guided
with the rollout's full codes at every site (each site's inputs then follow
the rollout's values), it re-rounds those inputs RTN or under compacted
guidance, and ``compare`` against the rollout counts the local flips.
"""

from collections import Counter
from dataclasses import dataclass, field, replace

import torch
from torch import Tensor

from tracefp4.kernels import per_token_global_scale, quantize

from .capture import Capture, CaptureConfig, CaptureRecords, SiteTable, TokenMap, row_key
from .model import CausalAttention, right_pad
from .quant import QuantSites
from .rollout import TorchEngine, Trajectory


def teacher_force(
    engine: TorchEngine,
    trajectories: list[Trajectory],
    keep_inputs: bool = False,
    delta_form: str = "chunked",
    max_tokens: int | None = None,
) -> CaptureRecords:
    """Full 4-bit capture of the training path over the trajectories' tokens;
    with ``keep_inputs`` the tables also hold the values before quantization.
    ``delta_form`` is the Gated DeltaNet form of a hybrid model's
    linear-attention layers: training's ``chunked``, or the rollout's
    ``recurrent`` one (everything else the same), which isolates what the two
    forms alone do to the codes. The trajectories run in right-padded forwards
    of at most ``max_tokens`` token rows each (default: the engine's capture
    buffer, else one forward; a longer trajectory alone), as training's
    microbatches do: the capture of every long response at once would not fit."""
    if max_tokens is None and engine.capture is not None:
        max_tokens = engine.capture.config.max_tokens
    groups = token_groups([len(t.tokens) for t in trajectories], max_tokens)
    largest = max(len(group) * max(len(trajectories[i].tokens) for i in group) for group in groups)
    config = CaptureConfig(bits=4, max_tokens=largest, inputs=keep_inputs)
    capture = Capture(engine.model.cfg, engine.quant, config, engine.global_scales, engine.device, kv_from_forward=True)
    sites = QuantSites(engine.quant, engine.global_scales, capture)
    for group in groups:
        tokens, positions, lengths = right_pad([trajectories[i].tokens for i in group], device=engine.device)
        capture.begin(TokenMap.of([trajectories[i].id for i in group], positions, lengths))
        with torch.no_grad():
            engine.model.hidden_states(tokens, positions, CausalAttention(delta_form), sites)
        capture.end()
    return capture.drain()


def token_groups(lengths: list[int], max_tokens: int | None) -> list[list[int]]:
    """Consecutive indices of sequences of ``lengths``, grouped so that each
    group right-padded holds at most ``max_tokens`` token rows (a longer
    sequence alone; None: one group)."""
    groups: list[list[int]] = []
    for i, n in enumerate(lengths):
        if groups:
            group = groups[-1]
            padded = (len(group) + 1) * max(n, *(lengths[j] for j in group))
            if max_tokens is None or padded <= max_tokens:
                group.append(i)
                continue
        groups.append([i])
    return groups


@dataclass
class SiteMismatch:
    """Train-vs-rollout codes of one ``(layer, site)``."""

    layer: int
    site: str
    elements: int = 0  # elements compared
    mismatched: int = 0  # elements whose codeword differs (-0 and +0 are one codeword)
    blocks: int = 0
    scale_mismatched: int = 0  # blocks whose scale differs
    distance: Counter = field(default_factory=Counter)  # |codeword difference| -> elements
    unmatched_rows: int = 0  # rollout rows training lacks (moe_down_in: the slot went to another expert)
    mse_quantized: float | None = None  # between the two paths' FP4 values (when both kept their inputs)
    mse_unquantized: float | None = None  # between the two paths' values before quantization

    @property
    def rate(self) -> float:
        return self.mismatched / self.elements if self.elements else 0.0

    @property
    def one_codeword_share(self) -> float:
        return self.distance[1] / self.mismatched if self.mismatched else 1.0


def signed_rank(codes: Tensor) -> Tensor:
    """Position of each code on the signed E2M1 grid (-7..7; both zeros are 0)."""
    magnitude = (codes & 7).to(torch.int16)
    return torch.where((codes & 8) != 0, -magnitude, magnitude)


def guidable(rows: Tensor) -> Tensor:
    """Which training-side ``rows [N, W]`` the rollout's guidance rounds:
    those holding no NaN or Inf, which the rollout's scale cannot carry (the
    training path rounds them to nearest, which shows them). The one rule of
    the training path (:class:`~.qat.TrainingSites`) and of what re-enacts
    it (:func:`rounded`, :func:`.guidance.compaction_report`)."""
    return rows.isfinite().all(-1)


def join_rows(rollout: SiteTable, train: SiteTable) -> tuple[Tensor, Tensor]:
    """Row indices of the rows both tables hold: the same (trajectory, position)
    and, for expert slots, the same expert, in whichever slot each path put it
    (near-tied router scores can order the two top-k differently; the expert's
    input is the same)."""
    r_tokens, t_tokens = (row_key(t.traj, t.pos, torch.zeros_like(t.slot)) for t in (rollout, train))
    if not len(t_tokens):
        return torch.zeros(0, dtype=torch.long), torch.zeros(0, dtype=torch.long)
    # the tables are in key order: a token's rows lie together, at most one per slot
    slots = torch.arange(int(train.slot.max()) + 1)
    candidates = (torch.searchsorted(t_tokens, r_tokens)[:, None] + slots).clamp(max=len(t_tokens) - 1)
    same = (t_tokens[candidates] == r_tokens[:, None]) & (train.expert[candidates] == rollout.expert[:, None])
    hit = same.any(1)
    return hit.nonzero()[:, 0], candidates[hit, same[hit].int().argmax(1)]


def compare(rollout: CaptureRecords, training: CaptureRecords) -> dict[tuple[int, str], SiteMismatch]:
    """Per ``(layer, site)`` mismatch between two full (4-bit) captures, on the
    rows both hold (for ``moe_down_in``: the same token's input to the same expert)."""
    out = {}
    for key in sorted(rollout.tables.keys() & training.tables.keys()):
        r, t = rollout.tables[key], training.tables[key]
        if r.bits != 4 or t.bits != 4:
            raise ValueError(f"comparing codes needs full 4-bit captures; {key} has {r.bits} and {t.bits} bits")
        r_rows, t_rows = join_rows(r, t)
        diff = (signed_rank(r.low_bits()[r_rows]) - signed_rank(t.low_bits()[t_rows])).abs()
        m = SiteMismatch(*key)
        m.unmatched_rows = len(r.traj) - len(r_rows)
        m.elements = diff.numel()
        m.mismatched = int((diff != 0).sum())
        m.blocks = r.scales[r_rows].numel()
        m.scale_mismatched = int((r.scales[r_rows] != t.scales[t_rows]).sum())
        values, counts = torch.unique(diff[diff != 0], return_counts=True)
        m.distance.update(dict(zip(values.tolist(), counts.tolist())))
        if r.inputs is not None and t.inputs is not None and len(r_rows):
            m.mse_quantized = (r.values()[r_rows] - t.values()[t_rows]).pow(2).mean().item()
            m.mse_unquantized = (r.inputs[r_rows] - t.inputs[t_rows]).pow(2).mean().item()
        out[key] = m
    return out


def rounded(training: CaptureRecords, guidance: CaptureRecords) -> CaptureRecords:
    """The codes the training path rounds ``training``'s captured inputs to
    (a capture that kept them): guided rounding where ``guidance`` (compacted
    rollout codes and scales) has the row, round-to-nearest under the
    training path's own block scales and global scale elsewhere (the static
    one, or per token each row's own) and in rows holding NaN or Inf, as
    :class:`~.qat.TrainingSites` rounds; a guided row takes the rollout's
    per-token global scale too."""
    out = CaptureRecords()
    for key, t in training.tables.items():
        if t.inputs is None:
            raise ValueError(f"re-rounding needs the training capture's inputs; layer {key[0]} {key[1]} has none")
        per_token = t.row_global_scales is not None
        g = per_token_global_scale(t.inputs) if per_token else t.global_scale if t.fmt == "nvfp4" else None
        q = quantize(t.inputs, t.fmt, global_scale=g)
        codes, scales, row_scales = q.codes, q.scales.view(torch.uint8), g if per_token else None
        if (small := guidance.tables.get(key)) is not None:
            rows, train_rows = join_rows(small, t)
            finite = guidable(t.inputs[train_rows])
            rows, train_rows = rows[finite], train_rows[finite]
            if len(rows):
                guided = quantize(t.inputs[train_rows], t.fmt, guide=small.guidance(rows))
                codes.index_copy_(0, train_rows, guided.codes)
                scales.index_copy_(0, train_rows, guided.scales.view(torch.uint8))
                if per_token:
                    row_scales = row_scales.index_copy(0, train_rows, small.row_global_scales[rows])
        out.tables[key] = replace(t, bits=4, codes=codes, scales=scales, row_global_scales=row_scales)
    return out


@dataclass
class MismatchTally:
    """Per-layer mismatch summed over several comparisons (a step's microbatches)."""

    elements: Counter = field(default_factory=Counter)
    mismatched: Counter = field(default_factory=Counter)
    sq_quantized: Counter = field(default_factory=Counter)
    sq_unquantized: Counter = field(default_factory=Counter)
    distance: Counter = field(default_factory=Counter)

    def add(self, report: dict[tuple[int, str], SiteMismatch]) -> None:
        for (layer, _), m in report.items():
            self.elements[layer] += m.elements
            self.mismatched[layer] += m.mismatched
            self.distance.update(m.distance)
            if m.mse_quantized is not None:
                self.sq_quantized[layer] += m.mse_quantized * m.elements
                self.sq_unquantized[layer] += m.mse_unquantized * m.elements

    @classmethod
    def merged(cls, tallies: "list[MismatchTally]") -> "MismatchTally":
        """One tally of several (the ranks' of a distributed step)."""
        total = cls()
        for t in tallies:
            for name in ("elements", "mismatched", "sq_quantized", "sq_unquantized", "distance"):
                getattr(total, name).update(getattr(t, name))
        return total

    def summary(self) -> dict:
        layers = sorted(layer for layer, n in self.elements.items() if n)
        total = sum(self.elements.values())
        return {
            "code_mismatch": sum(self.mismatched.values()) / total if total else None,
            "code_mismatch_by_layer": {layer: self.mismatched[layer] / self.elements[layer] for layer in layers},
            "relative_excess_mse_by_layer": {
                layer: (self.sq_quantized[layer] - self.sq_unquantized[layer]) / self.sq_unquantized[layer]
                for layer in layers
                if self.sq_unquantized[layer]
            },
            "codeword_diff_hist": dict(sorted(self.distance.items())),
        }
