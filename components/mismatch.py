"""The phenomenon TRACE fixes, measured: the training path rounds some values
to other FP4 codewords than the rollout did.

``teacher_force`` runs the rollout's tokens through the training path (one
full-sequence forward, the same weights, round-to-nearest, the same static
scales) and captures its codes like the rollout; ``compare`` joins both
captures on ``(trajectory, position, slot)`` and counts, per ``(layer, site)``,
the elements whose codeword differs and by how many codewords.
"""

from collections import Counter
from dataclasses import dataclass, field

import torch
from torch import Tensor

from .capture import Capture, CaptureConfig, CaptureRecords, SiteTable, TokenMap
from .model import CausalAttention
from .quant import QuantSites
from .rollout import TorchEngine, Trajectory


def teacher_force(engine: TorchEngine, trajectories: list[Trajectory], keep_inputs: bool = False) -> CaptureRecords:
    """Full 4-bit capture of the training path over the trajectories' tokens;
    with ``keep_inputs`` the tables also hold the values before quantization."""
    dev = engine.device
    lengths = torch.tensor([len(t.tokens) for t in trajectories], device=dev)
    b, width = len(trajectories), int(lengths.max())
    tokens = torch.zeros(b, width, dtype=torch.long, device=dev)
    for i, t in enumerate(trajectories):
        tokens[i, : len(t.tokens)] = torch.tensor(t.tokens)
    positions = torch.arange(width, device=dev).expand(b, width)
    traj = torch.tensor([t.id for t in trajectories], device=dev)[:, None].expand(b, width)
    traj = torch.where(positions < lengths[:, None], traj, -1)
    capture = Capture(
        engine.model.cfg, engine.quant, CaptureConfig(bits=4, max_tokens=b * width), engine.global_scales, dev,
        kv_from_forward=True, keep_inputs=keep_inputs,
    )  # fmt: skip
    capture.begin(TokenMap(traj.reshape(-1), positions.reshape(-1)))
    with torch.no_grad():
        engine.model(tokens, positions, CausalAttention(lengths), QuantSites(engine.quant, engine.global_scales, capture))
    capture.end()
    return capture.drain()


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


def _row_keys(t: SiteTable) -> Tensor:
    return (t.traj << 40) + (t.pos << 6) + t.slot


def compare(rollout: CaptureRecords, training: CaptureRecords) -> dict[tuple[int, str], SiteMismatch]:
    """Per ``(layer, site)`` mismatch between two full (4-bit) captures, on the
    rows both hold (for ``moe_down_in``: the same expert in the same slot)."""
    out = {}
    for key in sorted(rollout.tables.keys() & training.tables.keys()):
        r, t = rollout.tables[key], training.tables[key]
        if r.bits != 4 or t.bits != 4:
            raise ValueError(f"comparing codes needs full 4-bit captures; {key} has {r.bits} and {t.bits} bits")
        r_keys, t_keys = _row_keys(r), _row_keys(t)
        at = torch.searchsorted(t_keys, r_keys).clamp(max=len(t_keys) - 1)
        hit = (t_keys[at] == r_keys) & (t.expert[at] == r.expert)
        r_rows, t_rows = hit.nonzero()[:, 0], at[hit]
        diff = (signed_rank(r.low_bits()[r_rows]) - signed_rank(t.low_bits()[t_rows])).abs()
        m = SiteMismatch(*key)
        m.unmatched_rows = len(r_keys) - len(r_rows)
        m.elements = diff.numel()
        m.mismatched = int((diff != 0).sum())
        m.blocks = r.scales[r_rows].numel()
        m.scale_mismatched = int((r.scales[r_rows] != t.scales[t_rows]).sum())
        values, counts = torch.unique(diff[diff != 0], return_counts=True)
        m.distance.update(dict(zip(values.tolist(), counts.tolist())))
        out[key] = m
    return out
