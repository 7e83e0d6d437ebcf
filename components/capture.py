"""Rollout-side capture of FP4 outcomes: what TRACE ships to training.

For every captured activation site the engine records the codes and block
scales it produced, keyed by ``(trajectory, position, layer, site, slot)``;
for the KV cache, the codes and scales of every position when the request
ends. Writes go into preallocated per-site buffers (two, used in turn), and a
background thread offloads each filled buffer to host memory while the next
forward runs (on CUDA: into pinned host memory on a side stream that waits
for the buffer's writes, so that the copy overlaps the next forwards).
Inline compaction keeps only the low ``bits`` of each code and only the
selected layers, with the foundation's codec, before offload.
"""

import contextlib
import functools
import queue
import threading
import time
import weakref
from collections.abc import Iterator
from dataclasses import dataclass, field, replace

import torch
from torch import Tensor

from tracefp4.kernels import (
    GUIDANCE_BITS,
    FP4Tensor,
    Guidance,
    compact_codes,
    dequantize,
    expand_codes,
    get_format,
    to_device,
    unpack_nibbles,
)

from .architecture import ModelConfig
from .quant_config import ACTIVATION_SITES, QuantConfig


@dataclass(frozen=True)
class CaptureConfig:
    """What is kept: the low ``bits`` of each code (4 = all), of ``layers``
    (None = every layer), for forwards of up to ``max_tokens`` tokens; with
    ``inputs``, the unquantized values too."""

    bits: int = 4
    layers: tuple[int, ...] | None = None
    max_tokens: int = 4096
    inputs: bool = False  # also keep the values before quantization (for analysis: excess MSE, fidelity)

    def keeps(self, layer: int) -> bool:
        return self.layers is None or layer in self.layers


# The capture row key: one int64 per row, ordered as (trajectory, position, slot),
# that sorts a table (Capture.drain) and joins two (mismatch.join_rows).
KEY_SLOT_BITS = 8  # slots per position: 1, or a MoE's top_k expert slots
KEY_POS_BITS = 24  # positions in a sequence
KEY_TRAJ_BITS = 31  # trajectory ids; 8 + 24 + 31 = 63 bits leave the sign bit clear
ROW_FIELDS = ("traj", "pos", "slot", "expert", "codes", "scales")  # a SiteTable's tensors, one row each
# The routed site: its rows are (token, expert slot) pairs, and their shards carry each row's expert, which training
# matches slots by (and, with syndrome-coded guidance, routes by); other sites' rows have none
ROUTED_SITE, EXPERT_DTYPE = "moe_down_in", torch.int16


def expert_bytes(site: str, rows: int) -> int:
    """Bytes of the expert column that ``rows`` rows of ``site`` ship with."""
    return rows * EXPERT_DTYPE.itemsize if site == ROUTED_SITE else 0


def site_shape(cfg: ModelConfig, site: str) -> tuple[int, int]:
    """Elements per captured row of ``site`` and rows per token (a routed site's
    ``top_k`` expert slots) in a model of ``cfg``: what a capture holds, and
    what ``tracefp4 plan`` sizes guidance by (:mod:`.plan`)."""
    kv_width = cfg.num_kv_heads * cfg.head_dim
    shapes = {
        "moe_in": (cfg.hidden_size, 1),
        ROUTED_SITE: (cfg.moe_intermediate_size, cfg.top_k),
        "k_cache": (kv_width, 1),
        "v_cache": (kv_width, 1),
    }
    return shapes[site]


def row_key(traj: Tensor, pos: Tensor, slot: Tensor) -> Tensor:
    """``(traj << 32) | (pos << 8) | slot`` of captured rows (none of them
    padding), after checking that every field fits its bits: a field that
    overflowed would silently sort and join rows of other tokens together."""
    fields = (("trajectory id", traj, KEY_TRAJ_BITS), ("position", pos, KEY_POS_BITS), ("slot", slot, KEY_SLOT_BITS))
    for name, t, bits in fields:
        if not t.numel():
            continue
        low, high = int(t.min()), int(t.max())
        if low < 0 or high >= 1 << bits:
            bad = low if low < 0 else high
            raise ValueError(f"{name} {bad} does not fit the capture row key's {bits} bits (0..{(1 << bits) - 1})")
    return (traj << (KEY_POS_BITS + KEY_SLOT_BITS)) | (pos << KEY_SLOT_BITS) | slot


@dataclass
class TokenMap:
    """Trajectory id and position of each token row of one forward (``traj`` -1: padding)."""

    traj: Tensor
    pos: Tensor

    @classmethod
    def of(cls, ids, positions: Tensor, lengths: Tensor) -> "TokenMap":
        """The token rows of a batch ``positions [B, S]`` whose row b holds
        trajectory ``ids[b]`` up to position ``lengths[b]`` (exclusive) and
        padding, which nothing captures, after it."""
        ids = torch.as_tensor(ids, device=positions.device)
        traj = torch.where(positions < lengths[:, None], ids[:, None], -1)
        return cls(traj.reshape(-1), positions.reshape(-1))


@dataclass
class SiteTable:
    """The captured outcomes of one ``(layer, site)``, one row per captured
    vector, sorted by ``(traj, pos, slot)``. ``codes`` holds the low ``bits``
    of each code packed by ``compact_codes`` (bits = 4 is the FP4 nibble
    layout); ``scales`` the raw E4M3 / E8M0 scale bytes. NVFP4 global scales:
    ``global_scale``, one static scale for every row, or (per-token activation
    scales) ``row_global_scales``, float32 ``[N, 1]``, one per row."""

    layer: int
    site: str
    fmt: str
    bits: int
    width: int  # elements per row
    global_scale: float | None
    traj: Tensor
    pos: Tensor
    slot: Tensor
    expert: Tensor  # routed expert of the slot, -1 where the site has none
    codes: Tensor
    scales: Tensor
    inputs: Tensor | None = None  # float32 [N, width], the values before quantization (CaptureConfig.inputs)
    row_global_scales: Tensor | None = None  # float32 [N, 1], per-token NVFP4 global scales

    @property
    def nbytes(self) -> int:
        """Bytes the table ships: codes, scales, per-row global scales and the routed site's experts."""
        extra = 0 if self.row_global_scales is None else self.row_global_scales.numel() * 4
        return self.codes.numel() + self.scales.numel() + extra + expert_bytes(self.site, len(self.traj))

    def _rows_fields(self) -> tuple[str, ...]:
        """The per-row tensors this table holds (row_global_scales where it has them)."""
        return ROW_FIELDS + (() if self.row_global_scales is None else ("row_global_scales",))

    def global_scales(self, rows: Tensor | None = None) -> Tensor | None:
        """The NVFP4 global scale of ``rows`` (None: all): the static scalar, or
        float32 ``[n, 1]`` per row; None for MXFP4."""
        if self.row_global_scales is not None:
            return self.row_global_scales if rows is None else self.row_global_scales[rows]
        if self.global_scale is None:
            return None
        return torch.full((), self.global_scale, dtype=torch.float32, device=self.codes.device)  # no host copy

    def select(self, rows: Tensor) -> "SiteTable":
        """The table restricted to ``rows`` (a bool mask or indices), in that order."""
        pick = {f: getattr(self, f)[rows] for f in self._rows_fields()}
        inputs = None if self.inputs is None else self.inputs[rows]
        return replace(self, **pick, inputs=inputs)

    def for_trajectories(self, ids: Tensor) -> "SiteTable":
        """The rows of trajectories ``ids``."""
        return next(self.split_by_trajectories([ids]))

    def split_by_trajectories(self, groups: list[Tensor]) -> Iterator["SiteTable"]:
        """The table cut into one per group of trajectory ids (:func:`rows_of_groups`),
        each made as it is asked for: one part at a time in memory."""
        return (self.select(rows) for rows in rows_of_groups(self.traj, groups))

    @staticmethod
    def concat(tables: list["SiteTable"]) -> "SiteTable":
        """Tables of one site (of other trajectories) as one, in the given order."""
        modes = {t.row_global_scales is None for t in tables}
        if len(modes) > 1:
            raise ValueError(f"layer {tables[0].layer} {tables[0].site}: tables of static and per-token global scales")
        cat = {f: torch.cat([getattr(t, f) for t in tables]) for f in tables[0]._rows_fields()}
        return replace(tables[0], **cat, inputs=None)

    def to(self, device) -> "SiteTable":
        """The table on ``device``, copied there without waiting (:func:`tracefp4.kernels.to_device`)."""
        moved = {f: to_device(getattr(self, f), device) for f in self._rows_fields()}
        return replace(self, **moved, inputs=None if self.inputs is None else to_device(self.inputs, device))

    def compacted(self, bits: int) -> "SiteTable":
        """The same rows keeping only the low ``bits`` of each code."""
        if bits > self.bits:
            raise ValueError(f"cannot widen a {self.bits}-bit table to {bits} bits")
        return replace(self, bits=bits, codes=compact_codes(self.low_bits(), bits))

    def values(self) -> Tensor:
        """Float32 dequantized rows ``[N, width]`` (a full 4-bit table)."""
        if self.bits != 4:
            raise ValueError(f"dequantizing needs full codes; this table keeps {self.bits} bits")
        f = get_format(self.fmt)
        return dequantize(
            FP4Tensor(
                self.codes,
                self.scales.view(f.scale_dtype),
                self.global_scales(),
                self.fmt,
                (len(self.codes), self.width),
            )
        )

    def low_bits(self) -> Tensor:
        """One uint8 per element ``[N, width]``: the low ``bits`` of each code."""
        return expand_codes(self.codes, self.bits, self.width)

    def guidance(self, rows: Tensor | None = None) -> Guidance:
        """Guidance for the selected rows (None: all; training-side guided rounding)."""
        f = get_format(self.fmt)
        codes = self.codes if rows is None else self.codes[rows]
        scales = (self.scales if rows is None else self.scales[rows]).view(f.scale_dtype)
        g = self.global_scales(rows)
        return Guidance(codes, self.bits, scales, g, self.fmt, torch.Size((len(codes), self.width)))


def group_of_rows(traj: Tensor, groups: list[Tensor]) -> Tensor:
    """For each row, the index of the group of trajectory ids (the groups
    disjoint) that holds its ``traj``, ``len(groups)`` where none does: one
    sorted lookup for every row and group, where a scan per group would take
    time quadratic in a step's trajectories."""
    # made where the groups are (the host), then moved without waiting: the training forward asks per microbatch
    ids = torch.cat([g.reshape(-1) for g in groups]).long() if groups else torch.zeros(0, dtype=torch.long)
    sizes = torch.tensor([g.numel() for g in groups], dtype=torch.long)
    group_of_id = torch.repeat_interleave(torch.arange(len(groups)), sizes)
    ids, order = to_device(ids, traj.device).sort()
    group_of_id = to_device(group_of_id, traj.device)[order]
    none = torch.full_like(traj, len(groups), dtype=torch.long)
    if not len(ids):
        return none
    at = torch.searchsorted(ids, traj.long().contiguous()).clamp(max=len(ids) - 1)
    return torch.where(ids[at] == traj, group_of_id[at], none)


def rows_of_groups(traj: Tensor, groups: list[Tensor]) -> list[Tensor]:
    """For each group of trajectory ids (the groups disjoint), the indices of the
    rows whose ``traj`` is in it, in row order: what ``torch.isin(traj, group)``
    selects, for all the groups in one sort of the rows (:func:`group_of_rows`;
    a step's shards, a microbatch's trajectories in a shard)."""
    if not groups:
        return []
    group = group_of_rows(traj, groups)
    rows = torch.argsort(group, stable=True)
    counts = torch.bincount(group, minlength=len(groups) + 1)
    return list(rows.split(counts.tolist()))[: len(groups)]


@dataclass
class CaptureRecords:
    """Everything captured over a batch of rollouts."""

    tables: dict[tuple[int, str], SiteTable] = field(default_factory=dict)

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in self.tables.values())

    @staticmethod
    def concat(parts: "list[CaptureRecords]") -> "CaptureRecords":
        """Records of other trajectories (a step's shards, say) as one, each site's tables in the given order."""
        tables: dict = {}
        for part in parts:
            for key, table in part.tables.items():
                tables.setdefault(key, []).append(table)
        return CaptureRecords({key: type(same[0]).concat(same) for key, same in tables.items()})


class _Buffer:
    """Preallocated rows for many forwards: a token table ``(traj, pos)`` and,
    per captured site, codes, scale bytes and (expert slots) routing."""

    def __init__(
        self,
        shapes: dict[tuple[int, str], tuple[int, int, int, int]],
        max_tokens: int,
        device,
        keep_inputs: bool,
        per_token: set,
    ):
        def rows(per_token: int, width: int, dtype=torch.uint8) -> Tensor:
            return torch.empty(max_tokens * per_token, width, dtype=dtype, device=device)

        self.tokens = torch.empty(max_tokens, 2, dtype=torch.int64, device=device)
        self.codes = {k: rows(per, nbytes) for k, (per, nbytes, _, _) in shapes.items()}
        self.scales = {k: rows(per, nscales) for k, (per, _, nscales, _) in shapes.items()}
        # the per-row NVFP4 global scales of sites with per-token activation scales
        self.globals = {k: rows(per, 1, torch.float32) for k, (per, _, _, _) in shapes.items() if k in per_token}
        self.inputs = {}  # the unquantized rows, when asked for (teacher forcing)
        if keep_inputs:
            self.inputs = {k: rows(per, nbytes * 2, torch.float32) for k, (per, nbytes, _, _) in shapes.items()}
        # (token row in this buffer, slot, expert) of rows that belong to expert slots
        self.routing = {k: rows(per, 3, torch.int64) for k, (per, _, _, routed) in shapes.items() if routed}
        self.n_tokens = 0
        self.rows = dict.fromkeys(shapes, 0)
        self.free = threading.Event()
        self.free.set()


def _timed(method):
    """Counts a rollout-thread method's wall time as capture time (the capture overhead's numerator)."""

    @functools.wraps(method)
    def timed(self, *args, **kwargs):
        start = time.perf_counter()
        try:
            return method(self, *args, **kwargs)
        finally:
            self.seconds["capture"] += time.perf_counter() - start

    return timed


class Capture:
    """Records FP4 outcomes during rollout (a :class:`~.quant.Recorder`).

    The engine captures KV when a request ends (:meth:`record_kv`); with
    ``kv_from_forward`` (teacher forcing) K/V rows arrive through :meth:`record`
    like activations. A buffer holds ``max_tokens`` token rows of as many
    forwards as fit; a full buffer goes to the offload thread while the other
    one fills.
    """

    def __init__(
        self,
        model_cfg: ModelConfig,
        quant: QuantConfig,
        config: CaptureConfig,
        global_scales: dict,
        device="cpu",
        kv_from_forward: bool = False,
    ):
        if config.bits not in GUIDANCE_BITS:
            raise ValueError(f"capture bits must be {GUIDANCE_BITS[0]}..{GUIDANCE_BITS[-1]}, got {config.bits}")
        if model_cfg.top_k > 1 << KEY_SLOT_BITS:
            raise ValueError(f"top_k {model_cfg.top_k} exceeds the capture row key's {1 << KEY_SLOT_BITS} slots")
        self.cfg, self.quant, self.config, self.device = model_cfg, quant, config, device
        self.global_scales = {k: float(v) for k, v in global_scales.items()}
        self._widths, shapes = {}, {}
        for layer in filter(config.keeps, range(model_cfg.num_layers)):
            for site in quant.fp4_sites(model_cfg, layer):
                fmt, (width, per_token) = quant.site_format(site), site_shape(model_cfg, site)
                self._widths[(layer, site)] = width
                if site in ACTIVATION_SITES or kv_from_forward:
                    nscales = width // get_format(fmt).block_size
                    shapes[(layer, site)] = (per_token, width // 2, nscales, site == ROUTED_SITE)
        per_token = {k for k in shapes if quant.per_token(k[1])}
        self._buffers = [_Buffer(shapes, config.max_tokens, device, config.inputs, per_token) for _ in range(2)]
        self._turn = 0
        self._forward_tokens = 0  # tokens of the forward in flight, 0 between forwards
        self._chunks: dict[tuple[int, str], list[dict[str, Tensor]]] = {}
        self._jobs: queue.Queue = queue.Queue()
        self._error: BaseException | None = None
        # host time spent capturing on the rollout thread, and busy time of the offload thread
        self.seconds = {"capture": 0.0, "offload": 0.0}
        threads, single = torch.get_num_threads(), threading.Event()
        self._worker = threading.Thread(target=self._offload_loop, args=(single,), name="capture-offload", daemon=True)
        self._worker.start()
        single.wait()
        # torch.set_num_threads also sets the count each thread started later takes at its first op (the guidance
        # prefetch's, the store writer's): set back here, to this thread's own, which the offload thread's left alone
        torch.set_num_threads(threads)
        # stop the thread before the interpreter tears torch down under it
        weakref.finalize(self, _stop_worker, self._jobs, self._worker)

    # -- the forward side -------------------------------------------------
    @_timed
    def begin(self, tokens: TokenMap) -> None:
        """Start a forward whose token rows are ``tokens``."""
        self._raise_worker_error()
        n = tokens.traj.numel()
        if n > self.config.max_tokens:
            raise ValueError(f"a forward of {n} tokens exceeds capture max_tokens={self.config.max_tokens}")
        buf = self._buffers[self._turn]
        if buf.n_tokens + n > self.config.max_tokens:
            buf = self._flush()
        buf.tokens[buf.n_tokens : buf.n_tokens + n] = torch.stack([tokens.traj, tokens.pos], 1)
        self._forward_tokens = n

    @_timed
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
        buf, key = self._buffers[self._turn], (layer, site)
        if not self._forward_tokens or key not in buf.codes:
            return  # not kept, or KV that is captured when its request ends
        start, n = buf.rows[key], q.codes.shape[0]
        buf.codes[key][start : start + n] = q.codes
        buf.scales[key][start : start + n] = q.scales.view(torch.uint8)
        if buf.inputs:
            buf.inputs[key][start : start + n] = x
        if key in buf.globals:
            if q.global_scale is None or tuple(q.global_scale.shape) != (n, 1):
                shape = None if q.global_scale is None else tuple(q.global_scale.shape)
                raise ValueError(f"layer {layer} {site} takes per-token global scales ({n}, 1), got {shape}")
            buf.globals[key][start : start + n] = q.global_scale
        if key in buf.routing:
            buf.routing[key][start : start + n] = torch.stack([token + buf.n_tokens, slot, expert], 1)
        buf.rows[key] = start + n

    @_timed
    def end(self) -> None:
        self._buffers[self._turn].n_tokens += self._forward_tokens
        self._forward_tokens = 0

    def _flush(self) -> "_Buffer":
        """Send the current buffer to the offload thread; return the other, once it is free."""
        self._jobs.put(("buffer", self._buffers[self._turn], _written(self.device)))
        self._turn = 1 - self._turn
        buf = self._buffers[self._turn]
        buf.free.wait()
        buf.free.clear()
        buf.n_tokens, buf.rows = 0, dict.fromkeys(buf.rows, 0)
        return buf

    @_timed
    def record_kv(self, traj: int, layer: int, site: str, codes: Tensor, scales: Tensor) -> None:
        """The KV codes ``[length, width/2]`` and scales of a finished request."""
        if (layer, site) not in self._widths:
            return
        n = codes.shape[0]
        meta = torch.stack(
            [torch.full((n,), traj), torch.arange(n), torch.zeros(n, dtype=torch.int64), torch.full((n,), -1)], 1
        )
        job = ((layer, site), codes.clone(), scales.clone(), meta.to(codes.device))
        self._jobs.put(("kv", job, _written(codes.device)))

    # -- the offload side -------------------------------------------------
    def _offload_loop(self, single: threading.Event) -> None:
        # one thread for this thread's ops: the forward keeps the cores. Its count is first made its own (else its
        # first op would take the process's, which the capture sets back once ``single`` is set)
        torch.get_num_threads()
        torch.set_num_threads(1)
        single.set()
        while True:
            kind, job, written = self._jobs.get()
            if kind == "stop":
                self._jobs.task_done()
                return
            start = time.perf_counter()
            try:
                with _side_stream(written):
                    if kind == "buffer":
                        self._offload(job)
                    else:
                        self._append(*job)
            except BaseException as e:  # surfaced on the forward side
                self._error = e
            finally:
                if kind == "buffer":
                    job.free.set()
                self.seconds["offload"] += time.perf_counter() - start
                self._jobs.task_done()

    def _offload(self, buf: _Buffer) -> None:
        tokens = buf.tokens[: buf.n_tokens].to("cpu", copy=True)
        for key, n in buf.rows.items():
            if not n:
                continue
            if key in buf.routing:
                routing = buf.routing[key][:n].to("cpu")
                token, slot, expert = routing.unbind(1)
            else:
                token, slot, expert = torch.arange(n), torch.zeros(n, dtype=torch.int64), torch.full((n,), -1)
            meta = torch.stack([tokens[token, 0], tokens[token, 1], slot, expert], 1)
            extra = {"inputs": buf.inputs[key][:n]} if buf.inputs else {}
            if key in buf.globals:
                extra["row_global_scales"] = buf.globals[key][:n]
            self._append(key, buf.codes[key][:n], buf.scales[key][:n], meta, **extra)

    def _append(self, key, codes: Tensor, scales: Tensor, meta: Tensor, **extra: Tensor) -> None:
        """Keep a chunk of rows on the host; ``extra``: their inputs and per-row global scales, where kept."""
        if self.config.bits < 4:  # compact on the device, before the copy to host
            codes = compact_codes(unpack_nibbles(codes), self.config.bits)
        parts = {"codes": codes, "scales": scales, "meta": meta, **extra}
        self._chunks.setdefault(key, []).append({name: _to_host(t) for name, t in parts.items()})

    @property
    def buffer_bytes(self) -> int:
        """Bytes of the two preallocated buffers on the capture's device."""
        return sum(
            t.numel() * t.element_size()
            for b in self._buffers
            for part in (b.codes, b.scales, b.globals, b.inputs, b.routing, {"tokens": b.tokens})
            for t in part.values()
        )

    def pending(self) -> bool:
        """Whether anything was captured since the last drain."""
        return bool(self._buffers[self._turn].n_tokens or self._chunks or self._jobs.unfinished_tasks)

    def set_global_scales(self, global_scales: dict) -> None:
        """New static scales after a weight sync; only between drains, so no record mixes policies."""
        if self.pending():
            raise RuntimeError("capture holds records of the previous weights: drain it before a weight sync")
        self.global_scales = {k: float(v) for k, v in global_scales.items()}

    def _raise_worker_error(self) -> None:
        if self._error is not None:
            raise RuntimeError("capture offload failed") from self._error

    @_timed
    def drain(self, trajectories: Tensor | None = None) -> CaptureRecords:
        """Wait for the offload thread, then return everything captured since
        the last drain, or (``trajectories``) the rows of those trajectories
        alone, the others kept for a later drain: a rollout hands the
        trajectories that finished to the store while the rest decode, so that
        the host never holds more than the running ones' capture and those
        waiting for their shard's others. A trajectory's rows are all in once
        its request retired (its KV is captured then, and nothing after)."""
        if self._buffers[self._turn].n_tokens:
            self._flush()
        self._jobs.join()
        self._raise_worker_error()
        chunks, self._chunks = self._chunks, {}
        records = CaptureRecords()
        for (layer, site), parts in sorted(chunks.items()):
            cat = {name: torch.cat([p[name] for p in parts]) for name in parts[0]}
            traj = cat["meta"][:, 0]
            if trajectories is not None:  # the others' rows (not padding) stay, as one chunk
                taken = group_of_rows(traj, [trajectories]) == 0
                left = ~taken & (traj >= 0)
                if left.any():
                    self._chunks[(layer, site)] = [{name: t[left] for name, t in cat.items()}]
                cat = {name: t[taken] for name, t in cat.items()}
            codes, scales, meta = cat["codes"], cat["scales"], cat["meta"]
            order = (meta[:, 0] >= 0).nonzero()[:, 0]  # padding rows go
            order = order[torch.argsort(row_key(*meta[order, :3].unbind(1)), stable=True)]
            traj, pos, slot, expert = (meta[order, i] for i in range(4))
            records.tables[(layer, site)] = SiteTable(
                layer,
                site,
                self.quant.site_format(site),
                self.config.bits,
                self._widths[(layer, site)],
                self.global_scales.get((layer, site)),
                traj,
                pos,
                slot,
                expert,
                codes[order],
                scales[order],
                cat["inputs"][order] if "inputs" in cat else None,
                cat["row_global_scales"][order] if "row_global_scales" in cat else None,
            )
        return records


def _written(device) -> "tuple[torch.device, torch.cuda.Event] | None":
    """On CUDA, the device and an event after the work queued on it so far (the
    capture writes an offload job copies); None on the CPU. The event is
    recorded on ``device``'s current stream, which need not be the current
    device's (``resources.device=cuda:1`` without ``torch.cuda.set_device``)."""
    device = torch.device(device)
    if device.type != "cuda":
        return None
    if device.index is None:  # "cuda" is this thread's current device, which the offload thread's need not be
        device = torch.device("cuda", torch.cuda.current_device())
    event = torch.cuda.Event()
    event.record(torch.cuda.current_stream(device))
    return device, event


@contextlib.contextmanager
def _side_stream(written):
    """On CUDA, run the offload on a side stream of the written device that
    starts after the writes and is finished on exit, so that copies to host
    overlap the next forwards on the rollout's stream; nothing on the CPU. The
    device is set for the block: the offload thread's current device is its
    own (cuda:0 unless set), and a device-to-host copy runs on the current
    stream of the source's device."""
    if written is None:
        yield
        return
    device, event = written
    with torch.cuda.device(device):
        stream = torch.cuda.Stream()
        stream.wait_event(event)
        with torch.cuda.stream(stream):
            yield
        stream.synchronize()


def _to_host(t: Tensor) -> Tensor:
    """A host copy of ``t``: from CUDA into pinned memory, asynchronously on the current (side) stream."""
    if not t.is_cuda:
        return t.to("cpu", copy=True)
    host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
    host.copy_(t, non_blocking=True)
    return host


def _stop_worker(jobs: queue.Queue, worker: threading.Thread) -> None:
    jobs.put(("stop", None, None))
    worker.join()
