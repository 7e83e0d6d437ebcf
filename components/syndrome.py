"""The ``syndrome`` guidance codec: R-1 guidance (the low bit of every code and
the block scales) sent as parity bits that the training side decodes with its
own values as side information (docs/guidance-format.md, "Codec syndrome").

The rollout side (:func:`encode_table`) sees only its own codes and scales.
Rows are grouped into blocks of about :data:`~.syndrome_rate.BLOCK_ELEMENTS` elements, never
across trajectories (the loader selects by trajectory), and a wider row is cut
into segments of at most that many, the last padded (:func:`block_layout`); per block it sends
``scale_bits`` parity bits of the scales' low bits and ``code_bits`` parity
bits of the codes' low bits. The training side (:func:`decode_rows`), inline
in its forward and so with the layers below already guided, first recovers the
block scales from its own (:func:`~tracefp4.kernels.scale_side_info`),
then the low code bits under them
(:func:`~tracefp4.kernels.code_side_info`); guided rounding then
reads them exactly like R-1 guidance. A block that fails either check rounds
to nearest and is counted.

Rate control (:func:`choose_rates`): per ``(layer, site)`` and stage, the
erasures at which the previous step's need distribution, failed blocks counted
as needing more than they had, leaves :data:`~.syndrome_rate.TARGET_FAILED_SHARE` of the
blocks undecoded (:func:`~.syndrome_rate.erasures_for`); the first step of a run uses a
configured rate.
"""

from collections.abc import Iterator
from dataclasses import dataclass, field, replace
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor

from tracefp4.kernels import (
    MAX_ERASURES,
    code_side_info,
    compact_codes,
    expand_codes,
    get_format,
    parity_matrix,
    scale_side_info,
    solve_erasures,
    syndrome,
    to_device,
    unknowns,
)

from .capture import SiteTable, expert_bytes, rows_of_groups
from .syndrome_rate import (
    BLOCK_ELEMENTS,
    CODE_CHECK_BITS,
    MAX_FALL_BITS,
    SCALE_CHECK_BITS,
    Rate,
    erasures_for,
    first_rate,
    rate_bounds,
    whole_bytes,
)

CODE_SALT, SCALE_SALT = 1, 2  # parity matrices of the two stages differ


class BlockLayout(NamedTuple):
    """How rows of one width make blocks: ``group`` rows per block, or a row cut
    into ``segments`` blocks (one of the two is 1), ``elements`` per block, in
    ``scales`` scale blocks (the scales a block's first stage codes)."""

    group: int
    segments: int
    elements: int
    scales: int


def block_layout(width: int, block_size: int) -> BlockLayout:
    """Blocks for rows of ``width`` elements in whole scale blocks of
    ``block_size``: as many whole rows as fit :data:`BLOCK_ELEMENTS`, or a
    wider row cut into the fewest segments of at most that many, of equal
    whole scale blocks (the last padded with known zeros: 272 elements make
    two blocks of 144). Why cut: a block's parity is at most 64 + 16 bits
    (:data:`MAX_CODE_BITS`, :data:`MAX_SCALE_BITS`), so a whole 2048-wide row
    (Qwen3.5-35B-A3B's ``moe_in``) as one block got a sixteenth of the rate
    asked for and every block failed its decode."""
    if width <= BLOCK_ELEMENTS:
        group = max(1, BLOCK_ELEMENTS // width)
        return BlockLayout(group, 1, group * width, group * width // block_size)
    scales = width // block_size
    per = -(-scales // -(-width // BLOCK_ELEMENTS))  # scale blocks per segment
    return BlockLayout(1, -(-scales // per), per * block_size, per)


def layout_of(table: "SiteTable | SyndromeTable") -> BlockLayout:
    """The blocks of a table's rows, captured or coded: by its width and format."""
    return block_layout(table.width, get_format(table.fmt).block_size)


@dataclass
class SyndromeTable:
    """The syndrome-coded guidance of one ``(layer, site)``: the rows' keys (as
    :class:`~.capture.SiteTable`'s) and per block (``group`` consecutive rows of
    one trajectory, or one of a row's ``segments``) the parity bits of its
    scales' and codes' low bits."""

    layer: int
    site: str
    fmt: str
    width: int
    global_scale: float | None
    traj: Tensor
    pos: Tensor
    slot: Tensor
    expert: Tensor
    group: int
    rate: Rate
    code_parity: Tensor  # uint8 [blocks, code_bits / 8], bits packed LSB first (compact_codes with k = 1)
    scale_parity: Tensor  # uint8 [blocks, scale_bits / 8]

    bits = 1  # the guidance it carries: the low code bit, as R-1

    @property
    def nbytes(self) -> int:
        """Bytes the table ships: the parity, and the routed site's experts (training routes by them)."""
        return self.code_parity.numel() + self.scale_parity.numel() + expert_bytes(self.site, len(self.traj))

    @property
    def elements(self) -> int:
        return len(self.traj) * self.width

    @property
    def segments(self) -> int:
        """Blocks per row (``group`` is then 1), as :func:`block_layout` cuts rows of this width."""
        return layout_of(self).segments

    @property
    def block_elements(self) -> int:
        return layout_of(self).elements

    def block_of_rows(self) -> tuple[Tensor, Tensor]:
        """Each row's (first) block and place in it: blocks run over trajectories
        in row order (a trajectory's rows are contiguous), a new one at every
        ``group``-th row of a trajectory, a row of ``segments`` taking that
        many. Shapes are the table's: nothing reads values back, so that it
        runs on the device without a host sync."""
        index = torch.arange(len(self.traj), device=self.traj.device)
        starts = torch.ones_like(self.traj, dtype=torch.bool)
        starts[1:] = self.traj[1:] != self.traj[:-1]
        within = index - torch.where(starts, index, 0).cummax(0).values  # the row's place in its trajectory
        place = within % self.group
        return ((place == 0).cumsum(0) - 1) * self.segments, place

    def for_trajectories(self, ids: Tensor) -> "SyndromeTable":
        """The rows and blocks of trajectories ``ids`` (a block never spans two)."""
        return next(self.split_by_trajectories([ids]))

    def split_by_trajectories(self, groups: list[Tensor]) -> Iterator["SyndromeTable"]:
        """The table cut into one per group of trajectory ids (:func:`~.capture.rows_of_groups`),
        each made as it is asked for."""
        block, _ = self.block_of_rows()
        return (self._rows(rows, block) for rows in rows_of_groups(self.traj, groups))

    def _rows(self, rows: Tensor, block: Tensor) -> "SyndromeTable":
        """The table of ``rows`` (indices, in order) and of the blocks holding them."""
        blocks = torch.unique((block[rows, None] + torch.arange(self.segments, device=block.device)).flatten())
        pick = {f: getattr(self, f)[rows] for f in ("traj", "pos", "slot", "expert")}
        return replace(self, **pick, code_parity=self.code_parity[blocks], scale_parity=self.scale_parity[blocks])

    @staticmethod
    def concat(tables: list["SyndromeTable"]) -> "SyndromeTable":
        """Tables of one site (of other trajectories, of one rate) as one, in the given order."""
        if len({t.rate for t in tables}) != 1:
            raise ValueError(f"layer {tables[0].layer} {tables[0].site}: cannot join tables of different rates")
        cat = {f: torch.cat([getattr(t, f) for t in tables]) for f in SYNDROME_FIELDS}
        return replace(tables[0], **cat)

    def to(self, device) -> "SyndromeTable":
        """The table on ``device``, copied there without waiting (:func:`tracefp4.kernels.to_device`)."""
        return replace(self, **{f: to_device(getattr(self, f), device) for f in SYNDROME_FIELDS})


SYNDROME_FIELDS = ("traj", "pos", "slot", "expert", "code_parity", "scale_parity")


@dataclass(frozen=True)
class _Layout:
    """Where a table's rows sit in its blocks (:meth:`SyndromeTable.block_of_rows`)."""

    group: int
    segments: int
    segment_share: tuple[int, int]  # (a segment's scale blocks, padding included; a row's): its share of a row
    n_blocks: int
    block: Tensor
    within: Tensor

    @classmethod
    def of(cls, table: SyndromeTable, n_blocks: int | None = None) -> "_Layout":
        """``n_blocks``: the table's, where its parity is not there to count them (encoding)."""
        block, within = table.block_of_rows()
        if n_blocks is None:
            n_blocks = int(block[-1]) + table.segments if len(block) else 0
        share = (layout_of(table).scales, table.width // get_format(table.fmt).block_size)
        return cls(table.group, table.segments, share, n_blocks, block, within)

    def blocks(self, rows: Tensor, fill) -> Tensor:
        """Rows ``[N, m]`` (elements, or scales) laid out as blocks; missing rows,
        and the padding of a row's last segment, hold ``fill``."""
        if self.group == 1:  # a row a block, or its segments one each
            columns = rows.shape[1] * self.segment_share[0] // self.segment_share[1]  # a segment's (padded)
            padded = F.pad(rows, (0, columns * self.segments - rows.shape[1]), value=fill)
            return padded.reshape(self.n_blocks, columns)
        out = torch.full((self.n_blocks, self.group, rows.shape[1]), fill, dtype=rows.dtype, device=rows.device)
        out[self.block, self.within] = rows
        return out.reshape(self.n_blocks, self.group * rows.shape[1])

    def unblock(self, blocks: Tensor) -> Tensor:
        """Inverse of :meth:`blocks` (the padding dropped)."""
        if self.group == 1:
            columns = blocks.shape[1] * self.segment_share[1] // self.segment_share[0]  # a row's
            return blocks.reshape(len(self.block), blocks.shape[1] * self.segments)[:, :columns]
        return blocks.reshape(blocks.shape[0], self.group, blocks.shape[1] // self.group)[self.block, self.within]

    def of_rows(self, rows: Tensor) -> Tensor:
        """Per block, whether any of its rows is set in ``rows [N]``."""
        if self.group == 1:
            return rows.repeat_interleave(self.segments)
        return self.blocks(rows[:, None], False).any(1)

    def rows_of(self, blocks: Tensor) -> Tensor:
        """Per row, whether all of its blocks are set in ``blocks``."""
        if self.group == 1:
            return blocks.view(-1, self.segments).all(1)
        return blocks[self.block]


def _low_code_bits(table: SiteTable) -> Tensor:
    """Each element's low code bit, one uint8 per element ``[N, width]``
    (from the FP4 nibble layout directly: the low bit of each nibble)."""
    if table.bits != 4:
        return table.low_bits() & 1
    c = table.codes
    return torch.stack((c & 1, (c >> 4) & 1), -1).reshape(len(c), table.width)


def encode_table(table: SiteTable, rate: Rate) -> SyndromeTable:
    """The syndrome coding of a captured table (any ``bits``: only the low code bit and the scales are read)."""
    f = get_format(table.fmt)
    if table.width % f.block_size:
        raise ValueError(f"layer {table.layer} {table.site}: width {table.width} is not whole {f.block_size}-blocks")
    if table.row_global_scales is not None:  # the side information would need each row's scale: not coded
        raise ValueError(f"layer {table.layer} {table.site}: the syndrome codec carries static global scales only")
    out = SyndromeTable(
        table.layer,
        table.site,
        table.fmt,
        table.width,
        table.global_scale,
        table.traj,
        table.pos,
        table.slot,
        table.expert,
        layout_of(table).group,
        rate,
        torch.empty(0, dtype=torch.uint8),
        torch.empty(0, dtype=torch.uint8),
    )
    layout = _Layout.of(out)
    codes = layout.blocks(_low_code_bits(table), 0)
    scales = layout.blocks(table.scales & 1, 0)
    code_h = parity_matrix(rate.code_bits, codes.shape[1], CODE_SALT)
    scale_h = parity_matrix(rate.scale_bits, scales.shape[1], SCALE_SALT)
    return replace(
        out,
        code_parity=compact_codes(syndrome(codes, code_h), 1),
        scale_parity=compact_codes(syndrome(scales, scale_h), 1),
    )


@dataclass
class DecodeStats:
    """What decoding one ``(layer, site)`` found: blocks tried, and per stage
    the blocks that failed it and a histogram of the erasures the blocks it
    decoded needed. Per stage, because rate control sets each stage's rate from
    its own censored distribution (:func:`erasures_for`): a block that failed
    the scale stage counts there only (its code stage ran under wrong scales,
    so what it would have needed there is unknown, not censored)."""

    rate: Rate
    blocks: int = 0
    scale_failed: int = 0  # blocks whose scale stage failed
    code_failed: int = 0  # blocks whose scales decoded and codes did not
    code_needed: list[int] = field(default_factory=lambda: [0] * (MAX_ERASURES + 1))
    scale_needed: list[int] = field(default_factory=lambda: [0] * (MAX_ERASURES + 1))

    @property
    def failed(self) -> int:
        return self.scale_failed + self.code_failed

    @classmethod
    def from_tally(cls, rate: Rate, tally: list) -> "DecodeStats":
        """The statistics of a :func:`decode_rows` tally (summed over decodes), read from the device."""
        counts = [int(v) for v in tally]
        hist = MAX_ERASURES + 1
        return cls(rate, *counts[:3], counts[3 : 3 + hist], counts[3 + hist :])

    def merge(self, other: "DecodeStats") -> None:
        self.blocks += other.blocks
        self.scale_failed += other.scale_failed
        self.code_failed += other.code_failed
        self.code_needed = [a + b for a, b in zip(self.code_needed, other.code_needed)]
        self.scale_needed = [a + b for a, b in zip(self.scale_needed, other.scale_needed)]

    @classmethod
    def from_json(cls, data: dict) -> "DecodeStats":
        keys = ("code_bits", "scale_bits", "blocks", "scale_failed", "code_failed", "code_needed", "scale_needed")
        if missing := [k for k in keys if k not in data]:
            raise ValueError(f"decode statistics lack {missing} (written by an older tracefp4?)")
        stats = cls(
            Rate(data["code_bits"], data["scale_bits"]),
            data["blocks"],
            data["scale_failed"],
            data["code_failed"],
            list(data["code_needed"]),
            list(data["scale_needed"]),
        )
        if data.get("failed", stats.failed) != stats.failed:
            raise ValueError(f"decode statistics: failed {data['failed']} is not the stages' sum {stats.failed}")
        return stats

    def to_json(self) -> dict:
        return {
            "code_bits": self.rate.code_bits,
            "scale_bits": self.rate.scale_bits,
            "blocks": self.blocks,
            "failed": self.failed,
            "scale_failed": self.scale_failed,
            "code_failed": self.code_failed,
            "code_needed": self.code_needed,
            "scale_needed": self.scale_needed,
        }


def decode_rows(table: SyndromeTable, x: Tensor, available: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Decode a table from the training side's values ``x [rows, width]`` of its
    rows (``available``: rows the training forward holds; the others are
    unknown). Returns, per row, the recovered scale bytes and low code bits,
    whether the row's block decoded, and the statistics as a tally on the
    device (:func:`_tally`, read with the step's figures: nothing here reads
    the device, which on CUDA would make the host wait for it).

    A scale block holding a NaN or Inf of the training side's (a bf16
    overflow, say) is guessed as the training side quantizes it (its own
    scale; a NaN's codes 0), its scale and codes unknowns of their block
    where the block's unknowns hold them all, else taken as guessed
    (:func:`_lost`); the rest of its row keeps its reliabilities
    (:func:`~tracefp4.kernels.code_side_info`). A NaN had made its whole
    row's NaN, and its block failed, the finite rows coded beside it with
    it. Training rounds the row itself to nearest (:class:`~.qat.TrainingSites`)."""
    f = get_format(table.fmt)
    table = table.to(x.device)
    layout = _Layout.of(table, len(table.code_parity))
    g = None if table.global_scale is None else torch.full((), table.global_scale, device=x.device)  # no host copy
    rate, unknown = table.rate, ~available[:, None]
    blocks = x.unflatten(-1, (-1, f.block_size))
    # [rows, scale blocks] holding a NaN or Inf: times 0 those are NaN, every finite value 0 (two cheap passes;
    # isfinite().all() took three times as long, a sum alone overflows)
    lost = (blocks * 0).sum(-1).isnan()
    lost_blocks = layout.blocks(lost, False)  # [blocks, scales]: a block's scales, its codes scale block by scale block
    # stage 1: the block scales (a block's side information is its own values')
    own, neighbour, distance = scale_side_info(x, f, g)
    distance = distance.masked_fill_(unknown, -torch.inf)
    n_scales = layout_of(table).scales
    scale_h = parity_matrix(rate.scale_bits, n_scales, SCALE_SALT)
    parity = expand_codes(table.scale_parity, 1, rate.scale_bits)
    erasures = unknowns(rate.scale_bits, n_scales, SCALE_CHECK_BITS)
    reliability = _lost(layout.blocks(distance, torch.inf), lost_blocks, erasures, 1)
    low, ok_s, scale_needed = solve_erasures(layout.blocks(own & 1, 0), reliability, parity, scale_h, erasures)
    scales = torch.where(layout.unblock(low) == (own & 1), own, neighbour)
    # stage 2: the low code bits under the recovered scales
    low_code, distance = code_side_info(x, f, scales.view(f.scale_dtype), g)
    distance = distance.masked_fill_(unknown, -torch.inf)
    code_h = parity_matrix(rate.code_bits, table.block_elements, CODE_SALT)
    parity = expand_codes(table.code_parity, 1, rate.code_bits)
    erasures = unknowns(rate.code_bits, table.block_elements, CODE_CHECK_BITS)
    reliability = _lost(layout.blocks(distance, torch.inf), lost_blocks, erasures, f.block_size)
    low, ok_c, code_needed = solve_erasures(layout.blocks(low_code, 0), reliability, parity, code_h, erasures)
    tried = layout.of_rows(available)  # blocks with rows in this forward
    ok = ok_s & ok_c
    return (
        scales,
        layout.unblock(low),
        layout.rows_of(ok) & available,
        _tally(tried, ok_s, ok_c, code_needed, scale_needed),
    )


def _lost(reliability: Tensor, lost: Tensor, erasures: int, per: int) -> Tensor:
    """Blocks' ``reliability [blocks, scales * per]``, in place, with the
    ``per`` positions of each ``lost`` scale (``[blocks, scales]``: the
    training side's non-finite values, :func:`decode_rows`; ``per`` 1: the
    scale, or its block's elements) unknowns where the block's ``erasures``
    hold them all, so that a block whose rollout values were finite there
    decodes; else taken as guessed (certain), so that a row non-finite on
    both sides (the rollout quantized the same NaN: a NaN scale, codes 0)
    leaves the rows beside it their guidance. One-sided, that many lost
    positions are more than the block's parity solves for either way.
    Counted per scale and filled through a broadcast mask: a sixteenth of
    the work of a mask per position, on the decode's hot path."""
    many = (lost.sum(1, keepdim=True) * per > erasures)[..., None]
    positions = reliability.view(*lost.shape, per)
    positions.masked_fill_(lost[..., None], -torch.inf).masked_fill_(lost[..., None] & many, torch.inf)
    return reliability


def add_tally(tallies: dict, key, rate: Rate, tally: Tensor) -> None:
    """Sum a decode's ``tally`` (:func:`decode_rows`) into ``tallies``: ``(layer, site) -> (rate, tally)``."""
    previous = tallies.get(key)
    tallies[key] = (rate, tally if previous is None else previous[1] + tally)


def _tally(tried: Tensor, ok_s: Tensor, ok_c: Tensor, code_needed: Tensor, scale_needed: Tensor) -> Tensor:
    """A decode's statistics as one int64 tensor on the device, summed over a
    step's decodes and read once (:meth:`DecodeStats.from_tally`): blocks tried,
    failed at the scale stage, failed at the code stage, then the histograms of
    the erasures that the decoded blocks needed, codes then scales."""
    counts = torch.stack([tried.sum(), (tried & ~ok_s).sum(), (tried & ok_s & ~ok_c).sum()])
    hists = [
        torch.zeros(MAX_ERASURES + 1, dtype=torch.int64, device=tried.device).scatter_add_(0, needed, chosen.long())
        for needed, chosen in ((code_needed, tried & ok_s & ok_c), (scale_needed, tried & ok_s))
    ]
    return torch.cat([counts.long(), *hists])


def decode_summary(decode: dict) -> dict:
    """A step's decode figures: blocks tried, failed and their share (None
    without syndrome-coded guidance), and ``guidance_decode`` per ``"layer/site"``
    (:meth:`DecodeStats.to_json`): what the next step's rate control reads."""
    blocks = sum(d.blocks for d in decode.values())
    failed = sum(d.failed for d in decode.values())
    return {
        "guidance_decode_blocks": blocks if decode else None,
        "guidance_decode_failures": failed if decode else None,
        "guidance_decode_failed_share": failed / blocks if blocks else None,
        "guidance_decode": {f"{layer}/{site}": d.to_json() for (layer, site), d in sorted(decode.items())},
    }


def merge_decodes(parts: list[dict]) -> dict:
    """Per ``(layer, site)``, the :class:`DecodeStats` of every share of a step
    (one per training process, each decoding its own microbatches) summed."""
    total: dict = {}
    for part in parts:
        for key, stats in part.items():
            if key in total:
                total[key].merge(stats)
            else:
                total[key] = replace(stats)  # merge replaces its lists, so the copy need not copy them
    return total


def merge_decode_json(a: dict | None, b: dict) -> dict:
    """Two :meth:`DecodeStats.to_json` of one ``(layer, site)`` and rate (a round's steps) summed."""
    if a is None:
        return b
    total = DecodeStats.from_json(a)
    total.merge(DecodeStats.from_json(b))
    return total.to_json()


def choose_rates(keys, previous: dict | None, first: Rate, elements: int = BLOCK_ELEMENTS, scales: int = 16) -> dict:
    """Per ``(layer, site)`` in ``keys``, the rate for this step: from the
    previous step's decode statistics (``{"layer/site": DecodeStats.to_json()}``)
    where there are any, else ``first``. Per stage, the erasures
    :func:`erasures_for` reads from that stage's censored need distribution
    (its blocks of ``elements`` codes and ``scales`` scales needed at most the
    unknowns the previous rate solved for: all of them where it sent them raw),
    rounded up to whole bytes with the check bits, capped at
    :data:`MAX_CODE_BITS` / :func:`scale_bits_cap`, and at most
    :data:`MAX_FALL_BITS` below the previous rate: a rate rises as far as the
    failures ask at once but falls a byte a step, because one step's few
    hundred blocks a site can look thinner-tailed than the site is, and a rate
    that follows each such step down fails the blocks of the next (the former
    rule fell from 0.25 to 0.14 bit per element over four RL steps while
    failures rose from 0.3% to 1.4% of blocks)."""
    rates = {}
    for layer, site in keys:
        seen = (previous or {}).get(f"{layer}/{site}")
        if not seen or not seen["blocks"]:
            rates[(layer, site)] = first
            continue
        stats = DecodeStats.from_json(seen)
        bits, rate, bounds = [], stats.rate, rate_bounds(scales)
        for needed, failed, had, n, check, (floor, cap) in (
            (stats.code_needed, stats.code_failed, rate.code_bits, elements, CODE_CHECK_BITS, bounds["code_bits"]),
            (stats.scale_needed, stats.scale_failed, rate.scale_bits, scales, SCALE_CHECK_BITS, bounds["scale_bits"]),
        ):
            erasures = erasures_for(needed, failed, unknowns(had, n, check))
            chosen = had if erasures is None else min(cap, max(floor, whole_bytes(erasures + check)))
            bits.append(max(chosen, had - MAX_FALL_BITS))
        rates[(layer, site)] = Rate(*bits)
    return rates


def site_rates(tables: dict, previous: dict | None, bits_per_element: float) -> dict:
    """:func:`choose_rates` for each ``(layer, site)`` of ``tables``, with a first
    step's rate and a scale cap sized to that site's blocks (:func:`layout_of`: a
    row's segments may hold fewer than :data:`BLOCK_ELEMENTS`; MXFP4 blocks hold
    half NVFP4's scales)."""
    rates = {}
    for key, t in sorted(tables.items()):
        layout = layout_of(t)
        first = first_rate(bits_per_element, layout.elements, layout.scales)
        rates[key] = choose_rates([key], previous, first, layout.elements, layout.scales)[key]
    return rates
