"""Rollout guidance on its way to training: layer selection and bit truncation
(compaction), the shard format, a step's manifest, and the reload iterator.

A step is written as shards plus ``manifest.json``, written last: a reader
that finds the manifest finds every shard it lists, checksummed; a step
without a manifest does not exist. The format is specified in
``docs/guidance-format.md``.
"""

import concurrent.futures
import contextlib
import hashlib
import json
import queue
import struct
import threading
import time
from collections import OrderedDict
from collections.abc import Iterable, Iterator
from dataclasses import asdict, dataclass, field

import torch
from torch import Tensor

from tracefp4.kernels import Guidance, dequantize, get_format, per_token_global_scale, quantize

from .capture import EXPERT_DTYPE, ROUTED_SITE, CaptureRecords, SiteTable, expert_bytes
from .mismatch import guidable, join_rows
from .quant_config import QuantConfig
from .store import ArtifactNotFound
from .syndrome import SyndromeTable, block_layout
from .syndrome_rate import Rate, rate_bounds

MAGIC = b"TFP4GUID"
# 2: a codec per table (bits | syndrome); 3: per-row global scales (per-token activations); 4: syndrome rows
# wider than a block cut into segments; 5: a syndrome stage with as many parity bits as bits sends the bits
FORMAT_VERSION = 5
READ_VERSIONS = (2, 3, 4, 5)  # each an earlier one's superset but for version 4's raw-rate syndrome tables
_PREAMBLE = struct.Struct("<8sHI")  # magic, format version, header length
_DIGEST = 32  # sha256 over everything before it


STEP_MANIFEST = "manifest.json"  # a step's, written last: the step exists once it does


class GuidanceError(ValueError):
    """Guidance that cannot be trusted: names the object and what is wrong."""


# -- compaction --------------------------------------------------------------


def select_layers(spec: "str | int | Iterable[int]", layers: list[int]) -> tuple[int, ...]:
    """Layers to keep guidance for, out of ``layers`` (those with captured sites):
    ``"all"``; an int N: the deepest N; an explicit list."""
    layers = sorted(layers)
    if spec == "all":
        return tuple(layers)
    if isinstance(spec, int):
        if not 0 < spec <= len(layers):
            raise ValueError(f"cannot keep the deepest {spec} of {len(layers)} layers")
        return tuple(layers[-spec:])
    if isinstance(spec, str):
        raise ValueError(f"unknown layer selection {spec!r}; use 'all', N, or a list of layers")
    chosen = tuple(sorted(set(spec)))
    unknown = [layer for layer in chosen if layer not in layers]
    if unknown:
        raise ValueError(f"layers {unknown} have no captured sites (available: {layers})")
    return chosen


def compact(records: CaptureRecords, bits: int, layers: Iterable[int]) -> CaptureRecords:
    """Offline compaction of a full capture: the selected layers, low ``bits`` of
    each code (the same codec the capture uses inline)."""
    keep = set(layers)
    return CaptureRecords({k: t.compacted(bits) for k, t in records.tables.items() if k[0] in keep})


@dataclass
class CompactionReport:
    """Size and fidelity of compacted guidance, per layer and in total."""

    per_layer: dict[int, dict] = field(default_factory=dict)
    total: dict = field(default_factory=dict)


def full_record_bytes(t: "SiteTable | SyndromeTable") -> int:
    """Bytes of the table's rows as full records: 4-bit codes plus one scale byte
    per block (and a float32 global scale per row under per-token scales), and
    the routed site's experts."""
    per_row = 4 if getattr(t, "row_global_scales", None) is not None else 0
    rows = len(t.traj)
    return rows * (t.width // 2 + t.width // get_format(t.fmt).block_size + per_row) + expert_bytes(t.site, rows)


def full_capture_bytes(tables: CaptureRecords, sites: list[str]) -> int | None:
    """The bytes a full 4-bit capture (:func:`full_record_bytes`) of ``sites``
    would hold, one entry per FP4 layer and site, each site's taken from a
    table of it in ``tables``: every layer with a site records the same rows
    (the same tokens pass through every layer) at the same width. None when
    ``tables`` has no table of one of the sites to tell its rows."""
    per_site = {site: full_record_bytes(t) for (_, site), t in sorted(tables.tables.items())}
    if not set(sites) <= set(per_site):
        return None
    return sum(per_site[site] for site in sites)


def compaction_report(full: CaptureRecords, compacted: CaptureRecords, training: CaptureRecords) -> CompactionReport:
    """Bytes, bits per captured element, ratio to the full 4-bit-plus-scales
    record, and fidelity: the share of training-side rounding decisions (on the
    teacher-forced values in ``training``, which must keep its inputs) that
    equal those made with full guidance. Layers without guidance round RTN
    under their own block scales, as vanilla QAT does, and so does a row
    holding a NaN or Inf under any guidance, as the training path rounds it
    (:class:`.qat.TrainingSites`): such a row is the same decision on both
    sides, its NaNs equal where they stand (NaN == NaN is false)."""
    report = CompactionReport()
    sums = {"bytes": 0, "elements": 0, "full_bytes": 0, "same": 0, "decisions": 0}
    for (layer, site), rollout in sorted(full.tables.items()):
        train = training.tables[(layer, site)]
        if train.inputs is None:
            raise ValueError("fidelity needs the training capture's inputs: teacher_force(..., keep_inputs=True)")
        rows, train_rows = join_rows(rollout, train)
        x = train.inputs[train_rows]
        # RTN with the training path's own block scales (and the static, or its own per-token, global scale)
        g = rollout.global_scale if rollout.fmt == "nvfp4" else None
        if rollout.row_global_scales is not None:
            g = per_token_global_scale(x)
        nearest = dequantize(quantize(x, rollout.fmt, global_scale=g))
        reference = _guided(x, rollout, rows, nearest)
        small = compacted.tables.get((layer, site))
        values = _guided(x, small, rows, nearest) if small is not None else nearest
        same = (values == reference) | (values.isnan() & reference.isnan())
        entry = report.per_layer.setdefault(
            layer, {"bytes": 0, "elements": 0, "full_bytes": 0, "same": 0, "decisions": 0}
        )
        for target in (entry, sums):
            target["bytes"] += small.nbytes if small is not None else 0
            target["elements"] += rollout.codes.shape[0] * rollout.width
            target["full_bytes"] += full_record_bytes(rollout)
            target["same"] += int(same.sum())
            target["decisions"] += values.numel()
    for entry in [*report.per_layer.values(), sums]:
        entry["bits_per_element"] = 8 * entry["bytes"] / entry["elements"]
        entry["ratio_to_full"] = entry["bytes"] / entry["full_bytes"]
        entry["fidelity"] = entry["same"] / entry["decisions"]
    report.total = sums
    return report


def compaction_figures(full: CaptureRecords, bits: int, layers: Iterable[int], training: CaptureRecords) -> dict:
    """Bits per element, ratio to the full record and fidelity of ``full``
    compacted to ``bits`` at ``layers`` (:func:`compaction_report`'s totals):
    one cell of the guidance sensitivity table (R-k bits x layers) that the
    evaluation reports and benchmarks/guidance.py measures, each over its own
    choices of bits and layers."""
    total = compaction_report(full, compact(full, bits, layers), training).total
    return {key: total[key] for key in ("bits_per_element", "ratio_to_full", "fidelity")}


def _guided(x: Tensor, table: SiteTable, rows: Tensor, nearest: Tensor) -> Tensor:
    """The training path's values of ``x`` guided by ``table``'s ``rows``: a
    row holding a NaN or Inf takes its round-to-nearest values ``nearest``
    instead, as :class:`.qat.TrainingSites` rounds it (the rollout's scale
    cannot carry it)."""
    guided = dequantize(quantize(x, table.fmt, guide=table.guidance(rows)))
    return torch.where(guidable(x)[..., None], guided, nearest)


# -- shards --------------------------------------------------------------------


def _trajectory_ranges(records: CaptureRecords) -> dict[int, int]:
    """Positions captured per trajectory (0..n-1), checked to be the same at every site."""
    ranges = None
    for (layer, site), t in sorted(records.tables.items()):
        per_token = t.slot == 0
        ids, counts = torch.unique_consecutive(t.traj[per_token], return_counts=True)
        found = dict(zip(ids.tolist(), counts.tolist()))
        if ranges is None:
            ranges = found
        elif found != ranges:
            raise GuidanceError(f"capture of layer {layer} {site} covers other trajectories or positions than the rest")
    return ranges or {}


def _expected_keys(ranges: dict[int, int], slots: int) -> tuple[Tensor, Tensor, Tensor]:
    traj = (
        torch.cat([torch.full((n * slots,), t) for t, n in ranges.items()])
        if ranges
        else torch.zeros(0, dtype=torch.int64)
    )
    pos = torch.cat([torch.arange(n).repeat_interleave(slots) for n in ranges.values()]) if ranges else traj
    slot = torch.arange(slots).repeat(len(traj) // slots) if ranges else traj
    return traj, pos, slot


def encode_shard(records: CaptureRecords, **step) -> bytes:
    """One shard: the given trajectories' rows of every table (``step``: its
    ``rl_step``, ``policy_version`` and ``top_k``)."""
    return _encoded(records, **step)[0]


def _encoded(records: CaptureRecords, *, rl_step: int, policy_version: int, top_k: int) -> tuple[bytes, str]:
    """:func:`encode_shard`'s bytes and their sha256 (the manifest's), hashed
    piece by piece as they are laid out and joined once: the payload is copied
    once, and hashed once for both digests (at the paper's scale a round's
    guidance is terabytes, encoded while the rollout runs)."""
    ranges = _trajectory_ranges(records)
    tables, payload = [], []
    offset = 0
    for (layer, site), t in sorted(records.tables.items()):
        slots = top_k if site == ROUTED_SITE else 1
        traj, pos, slot = _expected_keys(ranges, slots)
        if not (torch.equal(t.traj, traj) and torch.equal(t.pos, pos) and torch.equal(t.slot, slot)):
            raise GuidanceError(f"capture of layer {layer} {site} is not complete: every position needs its rows")
        if isinstance(t, SyndromeTable):
            arrays = {"code_parity": t.code_parity, "scale_parity": t.scale_parity}
            codec = {
                "codec": "syndrome",
                "group": t.group,
                "segments": t.segments,
                "code_bits": t.rate.code_bits,
                "scale_bits": t.rate.scale_bits,
            }
        else:
            arrays, codec = {"codes": t.codes, "scales": t.scales}, {"codec": "bits"}
            if t.row_global_scales is not None:
                arrays["row_global_scales"] = t.row_global_scales
        if site == ROUTED_SITE:
            arrays["expert"] = t.expert.to(EXPERT_DTYPE)
        fields = {}
        for name, a in arrays.items():
            raw = a.contiguous().view(torch.uint8).reshape(-1).numpy()  # the tensor's memory, not a copy
            fields[name] = {
                "dtype": str(a.dtype).removeprefix("torch."),
                "shape": list(a.shape),
                "offset": offset,
                "nbytes": len(raw),
            }
            payload.append(raw)
            offset += len(raw)
        tables.append(
            {
                "layer": layer,
                "site": site,
                "fmt": t.fmt,
                "bits": t.bits,
                "width": t.width,
                "global_scale": t.global_scale,
                "slots": slots,
                "fields": fields,
                **codec,
            }
        )
    header = {
        "format_version": FORMAT_VERSION,
        "rl_step": rl_step,
        "policy_version": policy_version,
        "fmt": sorted({t["fmt"] for t in tables}),
        "bits": sorted({t["bits"] for t in tables}),
        "codec": sorted({t["codec"] for t in tables}),
        "layers": sorted({t["layer"] for t in tables}),
        "sites": sorted({t["site"] for t in tables}),
        "trajectories": [[t, n] for t, n in ranges.items()],  # id and positions 0..n-1
        "payload_bytes": offset,
        "tables": tables,
    }
    head = json.dumps(header, sort_keys=True).encode()
    pieces = [_PREAMBLE.pack(MAGIC, FORMAT_VERSION, len(head)), head, *payload]
    digest = hashlib.sha256()
    for piece in pieces:
        digest.update(piece)
    body_digest = digest.digest()  # the shard's own checksum, of everything before it
    digest.update(body_digest)
    return b"".join([*pieces, body_digest]), digest.hexdigest()


def decode_shard(
    data: bytes, name: str, expect: dict | None = None, body_digest: bytes | None = None
) -> tuple[dict, CaptureRecords]:
    """Verify and read a shard; ``expect`` maps header fields to required values;
    ``body_digest``: the sha256 of all but its last 32 bytes, where the caller
    hashed them already (:func:`read_shard`)."""
    if len(data) < _PREAMBLE.size + _DIGEST:
        raise GuidanceError(f"{name}: truncated ({len(data)} bytes)")
    version, head_len = _preamble(data, name)
    if (body_digest or hashlib.sha256(memoryview(data)[:-_DIGEST]).digest()) != data[-_DIGEST:]:
        raise GuidanceError(f"{name}: checksum mismatch (corrupted or truncated)")
    header = json.loads(data[_PREAMBLE.size : _PREAMBLE.size + head_len])
    payload = memoryview(data)[_PREAMBLE.size + head_len : -_DIGEST]
    if len(payload) != header["payload_bytes"]:
        raise GuidanceError(f"{name}: payload is {len(payload)} bytes, header says {header['payload_bytes']}")
    _check_header(header, name, expect)

    def array(f: dict) -> Tensor:
        data = bytearray(payload[f["offset"] : f["offset"] + f["nbytes"]])
        raw = torch.frombuffer(data, dtype=torch.uint8) if data else torch.empty(0, dtype=torch.uint8)  # no rows
        return raw.view(getattr(torch, f["dtype"])).reshape(f["shape"])

    return header, _records(name, version, header, array)


def _preamble(data: bytes, name: str) -> tuple[int, int]:
    """A shard's format version and header length, from its first bytes."""
    magic, version, head_len = _PREAMBLE.unpack_from(data)
    if magic != MAGIC:
        raise GuidanceError(f"{name}: not a tracefp4 guidance shard (magic {magic!r})")
    if version not in READ_VERSIONS:
        raise GuidanceError(f"{name}: format version {version}, this reader reads {READ_VERSIONS}")
    return version, head_len


def _check_header(header: dict, name: str, expect: dict | None) -> None:
    for key, value in (expect or {}).items():
        if header.get(key) != value:
            raise GuidanceError(f"{name}: {key} is {header.get(key)!r}, expected {value!r}")


def _records(name: str, version: int, header: dict, array) -> CaptureRecords:
    """The tables a shard's ``header`` lists, each field's tensor ``array(field)``."""
    ranges = {t: n for t, n in header["trajectories"]}
    records = CaptureRecords()
    for spec in header["tables"]:
        arrays = {fname: array(f) for fname, f in spec["fields"].items()}
        traj, pos, slot = _expected_keys(ranges, spec["slots"])
        expert = arrays["expert"].long() if "expert" in arrays else torch.full_like(traj, -1)
        if spec.get("codec") == "syndrome":
            table = _syndrome_table(name, version, spec, arrays, traj, pos, slot, expert)
            records.tables[(spec["layer"], spec["site"])] = table
            continue
        records.tables[(spec["layer"], spec["site"])] = SiteTable(
            spec["layer"],
            spec["site"],
            spec["fmt"],
            spec["bits"],
            spec["width"],
            spec["global_scale"],
            traj,
            pos,
            slot,
            expert,
            arrays["codes"],
            arrays["scales"],
            row_global_scales=_row_global_scales(name, spec, arrays, len(traj)),
        )
    return records


def _row_global_scales(name: str, spec: dict, arrays: dict, rows: int) -> Tensor | None:
    """A bits table's per-row global scales (per-token activations), checked: one
    float32 per row, and in place of a static scale, never beside one."""
    g = arrays.get("row_global_scales")
    if g is None:
        return None
    where = f"{name}: layer {spec['layer']} {spec['site']}"
    if spec["global_scale"] is not None or spec["fmt"] != "nvfp4":
        raise GuidanceError(
            f"{where} has per-row global scales beside a static one ({spec['global_scale']}, {spec['fmt']})"
        )
    if g.dtype != torch.float32 or tuple(g.shape) != (rows, 1):
        raise GuidanceError(f"{where}: row_global_scales is {g.dtype} {tuple(g.shape)}, expected float32 ({rows}, 1)")
    return g


def _syndrome_table(name: str, version: int, spec: dict, arrays: dict, traj, pos, slot, expert) -> SyndromeTable:
    """A syndrome table read from a shard, its blocks and parity arrays checked
    against its width and rates. Before version 5 a stage with as many parity
    bits as bits (every MXFP4 table) was coded with hashed parity, which this
    reader would decode as the bits themselves (:func:`~tracefp4.kernels.parity_matrix`): refused.
    So is a rate no decode takes (:func:`~.syndrome_rate.rate_bounds`): the
    parity's shape counts whole bytes, so 44 bits in 5 bytes passed it and
    failed in the training forward, naming no shard."""
    where = f"{name}: layer {spec['layer']} {spec['site']}"
    layout = (spec["group"], spec.get("segments", 1))  # segments: written from format version 4
    coded = block_layout(spec["width"], get_format(spec["fmt"]).block_size)
    if layout != tuple(coded[:2]):
        raise GuidanceError(
            f"{where} has blocks of (rows, segments) {layout}; rows of "
            f"{spec['width']} are coded in {tuple(coded[:2])} (written by an older tracefp4?)"
        )
    if version < 5 and spec["scale_bits"] >= coded.scales:
        raise GuidanceError(
            f"{where}: format version {version} coded its {coded.scales} scales a block in "
            f"{spec['scale_bits']} hashed parity bits, which version 5 reads as the scale bits themselves; "
            "compact the step again with this tracefp4"
        )
    for field_name, (low, high) in rate_bounds(coded.scales).items():
        bits = spec[field_name]
        if not (isinstance(bits, int) and low <= bits <= high and bits % 8 == 0):
            raise GuidanceError(
                f"{where}: {field_name} is {bits!r}; a block of its {coded.scales} scales takes a multiple of 8 "
                f"from {low} to {high}"
            )
    table = SyndromeTable(
        spec["layer"],
        spec["site"],
        spec["fmt"],
        spec["width"],
        spec["global_scale"],
        traj,
        pos,
        slot,
        expert,
        spec["group"],
        Rate(spec["code_bits"], spec["scale_bits"]),
        arrays["code_parity"],
        arrays["scale_parity"],
    )
    blocks = int(table.block_of_rows()[0].max()) + table.segments if len(traj) else 0
    for field_name, bits in (("code_parity", table.rate.code_bits), ("scale_parity", table.rate.scale_bits)):
        if tuple(arrays[field_name].shape) != (blocks, bits // 8):
            raise GuidanceError(
                f"{where} {field_name} has shape {tuple(arrays[field_name].shape)}, "
                f"its {blocks} blocks of {bits} bits need ({blocks}, {bits // 8})"
            )
    return table


def _split(records: CaptureRecords, groups: list[list[int]]) -> Iterator[CaptureRecords]:
    """``records`` cut into one per group of trajectories, in one sort of each
    table's rows, each part made as it is asked for."""
    ids = [torch.tensor(g, dtype=torch.long) for g in groups]
    parts = {k: t.split_by_trajectories(ids) for k, t in records.tables.items()}
    for _ in groups:
        yield CaptureRecords({k: next(tables) for k, tables in parts.items()})


def step_prefix(prefix: str, rl_step: int) -> str:
    return f"{prefix.strip('/')}/step-{rl_step:06d}"


class StepWriter:
    """A step written as its records come: each part's shards at once (of
    ``trajectories_per_shard`` trajectories), the manifest last, by
    :meth:`close`. The rollout adds shards' capture as their requests
    finish (:class:`FinishedShards`), and compaction each shard it reads, so
    that neither holds an RL step's capture at once (at the paper's scale,
    terabytes). A step written before
    (a retried task's) loses its manifest first: while the shards are
    rewritten the step does not exist, rather than fail its checksums.
    ``run_id`` names the run that rolled the step out, so that another run's
    reader refuses it, and ``policy`` the policy folder it rolled out (its
    manifest's sha256), so that a reader of another policy refuses it too.
    ``merged``: the prefix of the step :func:`merge_steps` makes of this one
    and others (a rollout worker's), which lists this step's shards: it
    loses its manifest first too, for the same reason."""

    def __init__(
        self,
        store,
        *,
        rl_step: int,
        policy_version: int,
        top_k: int,
        prefix: str = "guidance",
        trajectories_per_shard: int = 64,
        run_id: str = "",
        policy: str = "",
        merged: str | None = None,
    ):
        self.store, self.base, self.per_shard = store, step_prefix(prefix, rl_step), trajectories_per_shard
        self.header = {"rl_step": rl_step, "policy_version": policy_version, "top_k": top_k}
        self.manifest = {"format_version": FORMAT_VERSION, "run_id": run_id, **self.header, "policy": policy}
        self.shards: list[dict] = []
        self.written: set[int] = set()  # the trajectories in the shards so far
        self.empty: CaptureRecords | None = None  # the tables without rows, for a step of no trajectory
        # a retry's: its shards are overwritten, so the step is gone, and so is the one merged from it
        if merged is not None:
            store.delete(f"{step_prefix(merged, rl_step)}/{STEP_MANIFEST}")
        store.delete(f"{self.base}/{STEP_MANIFEST}")

    def add(self, records: CaptureRecords) -> None:
        """Write the shards of ``records``: trajectories none before held, in the tables the step's first part had."""
        if self.empty is None:
            self.empty = next(_split(records, [[]]))
        elif records.tables.keys() != self.empty.tables.keys():
            raise GuidanceError(
                f"{self.base}: a part of tables {sorted(records.tables)}, the step's are {sorted(self.empty.tables)}"
            )
        elif _rates(records) != _rates(self.empty):
            raise GuidanceError(
                f"{self.base}: a part coded at rates {_rates(records)}, the step's first at {_rates(self.empty)}"
            )
        trajectories = sorted(_trajectory_ranges(records))
        again = self.written.intersection(trajectories)
        if again:
            raise GuidanceError(f"{self.base}: trajectories {sorted(again)[:10]} are in a shard already")
        self.written.update(trajectories)
        for part in _split(
            records, [trajectories[i : i + self.per_shard] for i in range(0, len(trajectories), self.per_shard)]
        ):
            self._put(part)

    def _put(self, part: CaptureRecords) -> None:
        data, sha256 = _encoded(part, **self.header)
        key = f"{self.base}/shard-{len(self.shards):05d}.bin"
        self.store.put_bytes(key, data)
        held = list(_trajectory_ranges(part))  # in the tables' order, as the shard's header lists them
        self.shards.append({"key": key, "bytes": len(data), "sha256": sha256, "trajectories": held})

    def close(self, syndrome: dict | None = None) -> dict:
        """Write the manifest (last) and return it. ``syndrome`` (syndrome-coded
        tables): what their rates were chosen from (the first rate, the
        previous step's decode statistics), carried in the manifest beside the
        rates themselves, which are the tables' (:func:`_rates`; rates given
        there must be them): what a reader checks each shard's tables against."""
        if self.empty is None:
            raise GuidanceError(f"{self.base}: nothing was added to the step")
        if not self.shards:  # a step of no trajectory: one shard of its tables, without rows
            self._put(self.empty)
        tables = list(self.empty.tables.values())
        manifest = {
            **self.manifest,
            "fmt": sorted({t.fmt for t in tables}),
            "bits": sorted({t.bits for t in tables}),
            "codec": sorted({"syndrome" if isinstance(t, SyndromeTable) else "bits" for t in tables}),
            "layers": sorted({t.layer for t in tables}),
            "sites": sorted({t.site for t in tables}),
            "shards": self.shards,
        }
        rates = _rates(self.empty)
        if rates or syndrome is not None:
            given = (syndrome or {}).get("rates", rates)
            if given != rates:
                raise GuidanceError(f"rates {given} given for {self.base} are not its tables' {rates}")
            manifest["syndrome"] = {**(syndrome or {}), "rates": rates}
        manifest["sha256"] = _manifest_digest(manifest)
        self.store.put_bytes(f"{self.base}/{STEP_MANIFEST}", json.dumps(manifest, indent=1).encode())
        return manifest


def _rates(records: CaptureRecords) -> dict[str, list[int]]:
    """The rates of ``records``' syndrome-coded tables, ``{"layer/site": [code_bits, scale_bits]}``
    (a manifest's ``syndrome.rates``)."""
    return {
        f"{layer}/{site}": [t.rate.code_bits, t.rate.scale_bits]
        for (layer, site), t in sorted(records.tables.items())
        if isinstance(t, SyndromeTable)
    }


class BackgroundStepWriter(StepWriter):
    """A :class:`StepWriter` that encodes and stores each part on a thread of
    its own, in order, while its caller goes on: the rollout's decode loop
    hands it the shards that finished and decodes on, where writing them
    itself left the device idle (at the paper's scale, terabytes a round to
    encode, hash and upload). One part is written at a time, and :meth:`add`
    waits for it before handing over the next, so the host holds at most two
    parts besides the running requests' capture. An error of the thread is
    raised by the next :meth:`add` or by :meth:`close`; ``waited`` sums the
    seconds the caller spent waiting for the thread."""

    def __init__(self, store, **step):
        super().__init__(store, **step)
        self._thread = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="guidance-writer")
        self._writing: concurrent.futures.Future | None = None
        self.waited = 0.0

    def add(self, records: CaptureRecords) -> None:
        self._wait()
        self._writing = self._thread.submit(super().add, records)

    def close(self, syndrome: dict | None = None) -> dict:
        try:
            self._wait()
        finally:
            self._thread.shutdown()
        return super().close(syndrome)

    def _wait(self) -> None:
        if self._writing is None:
            return
        start = time.perf_counter()
        try:
            self._writing.result()
        finally:
            self._writing = None
            self.waited += time.perf_counter() - start


class FinishedShards:
    """A rollout's capture handed to ``writer`` shard by shard while it runs:
    the ``generate`` call's ``finished`` callback. Trajectories ``ids`` (a
    range) make shards of ``writer.per_shard`` consecutive ids, the layout a
    step written whole has. A shard is ready once its last trajectory
    finished; the ready ones are drained (``drain``, the engine's) and written
    together once they hold as many trajectories as run at once (``running``)
    or as are left to finish: each drain copies the running requests' capture
    it leaves (:meth:`Capture.drain`), so draining every shard as it came would
    copy that capture once per shard. The host then holds about twice the
    running requests' capture (three times with a :class:`BackgroundStepWriter`,
    whose part being written stays until the next is handed over), never an
    RL step's (at the paper's scale, terabytes)."""

    def __init__(self, writer: StepWriter, drain, ids: range, running: int):
        self.writer, self.drain, self.ids, self.running = writer, drain, ids, running
        self.shards = [ids[i : i + writer.per_shard] for i in range(0, len(ids), writer.per_shard)]
        self.left = [len(shard) for shard in self.shards]
        self.ready: list[range] = []  # shards whose trajectories all finished, not drained yet
        self.unfinished = len(ids)
        self.seconds = 0.0  # the loop held up handing shards to the writer

    def __call__(self, done) -> None:
        for trajectory in done:
            shard = (trajectory.id - self.ids.start) // self.writer.per_shard
            self.left[shard] -= 1
            if not self.left[shard]:
                self.ready.append(self.shards[shard])
        self.unfinished -= len(done)
        if self.ready and sum(map(len, self.ready)) >= min(self.running, self.unfinished):
            records = self.drain(torch.tensor([t for shard in self.ready for t in shard]))
            self.ready = []
            writing = time.perf_counter()
            self.writer.add(records)  # cut into the ready shards: each full but a range's last
            self.seconds += time.perf_counter() - writing

    def check_all_written(self) -> None:
        """After the call: every shard written (a request the engine never reported would leave one behind)."""
        waiting = [i for i, left in enumerate(self.left) if left]
        if waiting or self.ready:
            raise GuidanceError(f"{self.writer.base}: shards {waiting} of trajectories {self.ids} never finished")


def write_step(store, records: CaptureRecords, *, syndrome: dict | None = None, **step) -> dict:
    """A step of ``records`` written whole (:class:`StepWriter`, ``step`` its
    arguments); returns the manifest."""
    writer = StepWriter(store, **step)
    writer.add(records)
    return writer.close(syndrome)


def merge_steps(store, rl_step: int, sources: list[str], prefix: str, expect: dict | None = None) -> dict:
    """One step at ``prefix`` made of the same step at each of ``sources`` (the
    rollout workers' prefixes): a manifest listing every source's shards where
    they lie, so that nothing is copied. The sources must agree on what they
    hold and never share a trajectory. Returns the manifest (written last)."""
    manifests = [read_manifest(store, rl_step, source, expect) for source in sources]
    first = manifests[0]
    same = ("format_version", "run_id", "policy_version", "policy", "top_k", "fmt", "bits", "codec", "layers", "sites")
    for source, m in zip(sources[1:], manifests[1:]):
        differ = [k for k in same if m[k] != first[k]]
        if differ:
            raise GuidanceError(f"{store.uri}/{source}: step {rl_step} differs from {sources[0]}'s in {differ}")
    shards = [entry for m in manifests for entry in m["shards"]]
    trajectories = [t for entry in shards for t in entry["trajectories"]]
    if len(set(trajectories)) != len(trajectories):
        raise GuidanceError(f"{store.uri}: step {rl_step} of {sources}: a trajectory appears in two sources")
    manifest = {**{k: v for k, v in first.items() if k != "sha256"}, "shards": shards}
    manifest["sha256"] = _manifest_digest(manifest)
    store.put_bytes(f"{step_prefix(prefix, rl_step)}/{STEP_MANIFEST}", json.dumps(manifest, indent=1).encode())
    return manifest


def _manifest_digest(manifest: dict) -> str:
    """sha256 of the manifest's canonical JSON without this field: an edited or
    truncated manifest (a shard entry dropped, say) no longer matches."""
    body = {k: v for k, v in manifest.items() if k != "sha256"}
    return hashlib.sha256(json.dumps(body, sort_keys=True).encode()).hexdigest()


def read_manifest(store, rl_step: int, prefix: str = "guidance", expect: dict | None = None) -> dict:
    """A step's manifest, verified; a step without one is missing (or still being written)."""
    key = f"{step_prefix(prefix, rl_step)}/{STEP_MANIFEST}"
    name = f"{store.uri}/{key}"
    try:
        manifest = json.loads(store.get_bytes(key))
    except ArtifactNotFound:
        raise GuidanceError(f"{name}: no manifest, so step {rl_step} is missing or incomplete") from None
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise GuidanceError(f"{name}: not a guidance manifest (unreadable JSON: {e})") from None
    if not isinstance(manifest, dict):
        raise GuidanceError(f"{name}: not a guidance manifest (a JSON {type(manifest).__name__}, not an object)")
    if manifest.get("format_version") not in READ_VERSIONS:
        raise GuidanceError(
            f"{name}: format version {manifest.get('format_version')!r}, this reader reads {READ_VERSIONS}"
        )
    if manifest.get("sha256") != _manifest_digest(manifest):
        raise GuidanceError(f"{name}: checksum mismatch (the manifest was edited or corrupted)")
    for field_name, value in (expect or {}).items():
        if manifest.get(field_name) != value:
            raise GuidanceError(f"{name}: {field_name} is {manifest.get(field_name)!r}, expected {value!r}")
    return manifest


def read_shard(store, manifest: dict, entry: dict) -> CaptureRecords:
    """One shard of a step, checked against the manifest (size, sha256, step, policy, layers, sites)."""
    data = store.get_bytes(entry["key"])
    name = f"{store.uri}/{entry['key']}"
    _check_size(len(data), entry, name)
    digest = hashlib.sha256(memoryview(data)[:-_DIGEST])  # one pass for both checksums
    body_digest = digest.digest()
    digest.update(memoryview(data)[-_DIGEST:])
    if digest.hexdigest() != entry["sha256"]:
        raise GuidanceError(f"{name}: sha256 differs from the manifest's")
    header, records = decode_shard(data, name, _expected(manifest), body_digest)
    _check_trajectories(header, entry, name)
    _check_rates(records, manifest, name)
    return records


HEADER_READ = 1 << 16  # bytes read at once for a shard's header; a paper preset's is a few kilobytes


def read_shard_tables(store, manifest: dict, entry: dict, size: int) -> CaptureRecords:
    """One shard's tables as its header declares them, without their values:
    each array a meta tensor of its shape, so rows, widths and bytes, no
    codes. Only the header is read (a ranged read), checked against the
    manifest as :func:`read_shard` checks it, and ``size`` (the object's
    bytes in the store) against the manifest's. What inline compaction
    measures a round's guidance by: at the paper's scale its shards are
    terabytes, which training reads, each verified."""
    name = f"{store.uri}/{entry['key']}"
    _check_size(size, entry, name)
    head = store.get_range(entry["key"], 0, HEADER_READ)
    if len(head) < _PREAMBLE.size:
        raise GuidanceError(f"{name}: truncated ({len(head)} bytes)")
    version, head_len = _preamble(head, name)
    if len(head) < _PREAMBLE.size + head_len:
        head += store.get_range(entry["key"], len(head), _PREAMBLE.size + head_len - len(head))
    try:  # no checksum covers the header read alone: a damaged one is named, whatever breaks
        header = json.loads(head[_PREAMBLE.size : _PREAMBLE.size + head_len])
        _check_header(header, name, _expected(manifest))
        _check_trajectories(header, entry, name)
        records = _records(
            name, version, header, lambda f: torch.empty(f["shape"], dtype=getattr(torch, f["dtype"]), device="meta")
        )
        _check_rates(records, manifest, name)
        return records
    except GuidanceError:
        raise
    except (ValueError, KeyError, TypeError, AttributeError) as e:
        raise GuidanceError(f"{name}: an unreadable header ({type(e).__name__}: {e})") from None


def _expected(manifest: dict) -> dict:
    """What each shard's header must say, as its step's manifest does."""
    return {k: manifest[k] for k in ("rl_step", "policy_version", "layers", "sites", "codec")}


def _check_size(size: int, entry: dict, name: str) -> None:
    if size != entry["bytes"]:
        raise GuidanceError(f"{name}: {size} bytes, the manifest says {entry['bytes']}")


def _check_trajectories(header: dict, entry: dict, name: str) -> None:
    if [t for t, _ in header["trajectories"]] != entry["trajectories"]:
        raise GuidanceError(
            f"{name}: holds trajectories {header['trajectories']}, the manifest lists {entry['trajectories']}"
        )


def _check_rates(records: CaptureRecords, manifest: dict, name: str) -> None:
    """Each syndrome-coded table of a shard is decoded at its header's rate,
    which must be the one its step's manifest records for its site
    (:meth:`StepWriter.close`): a shard that disagrees is refused, naming
    the field, instead of decoded at a rate the step does not state (its
    decode statistics, which the next step's rates are chosen from, summed
    under one rate whatever each microbatch's was)."""
    recorded = (manifest.get("syndrome") or {}).get("rates", {})
    for key, rate in _rates(records).items():
        layer, site = key.split("/")
        if key not in recorded:
            raise GuidanceError(
                f"{name}: layer {layer} {site} is syndrome-coded; the step's manifest records no rate for it"
            )
        for field_name, bits, want in zip(("code_bits", "scale_bits"), rate, recorded[key]):
            if bits != want:
                raise GuidanceError(
                    f"{name}: layer {layer} {site} has {field_name} {bits}, the step's manifest records {want}"
                )


def _stored_sizes(store, manifest: dict) -> Iterator[tuple[dict, int]]:
    """Each shard of a step's ``manifest`` with its size in the store, from one
    listing per folder the shards lie in (a merged step's lie in its workers'):
    a missing shard is an error naming it."""
    folders = dict.fromkeys(entry["key"].rpartition("/")[0] for entry in manifest["shards"])
    sizes = {key: size for folder in folders for key, size in store.sizes(folder + "/").items()}
    for entry in manifest["shards"]:
        if entry["key"] not in sizes:
            raise GuidanceError(f"{store.uri}/{entry['key']}: missing, the step's manifest lists it")
        yield entry, sizes[entry["key"]]


def iter_step(store, rl_step: int, prefix: str = "guidance", expect: dict | None = None) -> Iterator[CaptureRecords]:
    """A step's shards, each verified, one at a time: what compaction reads, so
    that it never holds a round's capture at once."""
    manifest = read_manifest(store, rl_step, prefix, expect)
    for entry in manifest["shards"]:
        yield read_shard(store, manifest, entry)


def iter_step_tables(
    store, rl_step: int, prefix: str = "guidance", expect: dict | None = None
) -> Iterator[CaptureRecords]:
    """A step's shards' tables without their values (:func:`read_shard_tables`),
    one at a time: what inline compaction measures, each shard's header read
    alone, the shards' sizes from a listing."""
    manifest = read_manifest(store, rl_step, prefix, expect)
    for entry, size in _stored_sizes(store, manifest):
        yield read_shard_tables(store, manifest, entry, size)


def read_step(store, rl_step: int, prefix: str = "guidance", expect: dict | None = None) -> CaptureRecords:
    """A whole step, every shard verified, as one set of tables."""
    return CaptureRecords.concat(list(iter_step(store, rl_step, prefix, expect)))


@dataclass
class StepSize:
    """A step's size, summed shard by shard as compaction reads or writes it:
    the guidance kept (bytes, elements, tables), and what a full 4-bit capture
    of ``sites`` would hold of the same rows (:func:`full_capture_bytes`; None
    when the step has no table of one of them)."""

    sites: list[str]
    guidance_bytes: int = 0
    elements: int = 0
    full_bytes: int | None = 0
    tables: set = field(default_factory=set)

    def add(self, kept: CaptureRecords, rows: CaptureRecords) -> None:
        """A shard's guidance ``kept``, its rows told by ``rows`` (the capture it was made from, or itself)."""
        self.guidance_bytes += kept.nbytes
        self.elements += sum(len(t.traj) * t.width for t in kept.tables.values())
        self.tables |= kept.tables.keys()
        full = full_capture_bytes(rows, self.sites)
        self.full_bytes = None if full is None or self.full_bytes is None else self.full_bytes + full


# -- the artifact compaction hands to training ------------------------------------


def encode_scales(global_scales: dict) -> dict[str, float]:
    """Static global scales ``{(layer, site): tensor}`` as JSON: ``{"layer/site": float}`` (exact for float32)."""
    return {f"{layer}/{site}": float(g) for (layer, site), g in sorted(global_scales.items())}


def decode_scales(encoded: dict[str, float]) -> dict[tuple[int, str], Tensor]:
    out = {}
    for key, value in encoded.items():
        layer, site = key.split("/", 1)
        out[(int(layer), site)] = torch.tensor(value, dtype=torch.float32)
    return out


@dataclass(frozen=True)
class GuidanceRef:
    """A round's guidance as the typed artifact that compaction hands to train:
    where its shards are, which run and policy version rolled it out, its codec,
    and the rollout's numerics (quantization config and static global scales),
    from which the training path quantizes, so that training never needs a
    rollout engine. Methods without guidance carry the numerics and no shards
    (``prefix`` None)."""

    run_id: str
    rl_step: int
    policy_version: int
    quant: QuantConfig
    global_scales: dict[str, float]  # encode_scales
    store_uri: str | None = None
    prefix: str | None = None
    codec: str = "bits"
    bits: int = 4
    layers: tuple[int, ...] = ()
    sites: tuple[str, ...] = ()
    top_k: int = 1
    policy: str = ""  # the sha256 of the rolled-out policy folder's manifest (checkpoint.folder_digest)

    def to_json(self) -> str:
        return json.dumps({**asdict(self), "quant": asdict(self.quant)}, indent=1)

    @classmethod
    def from_json(cls, text: str, name: str) -> "GuidanceRef":
        """Parse an artifact; anything malformed is a :class:`GuidanceError` naming ``name``."""
        try:
            data = json.loads(text)
            data["quant"] = QuantConfig(**data["quant"])
            data["layers"], data["sites"] = tuple(data["layers"]), tuple(data["sites"])
            return cls(**data)
        except (json.JSONDecodeError, TypeError, KeyError, ValueError) as e:
            raise GuidanceError(f"{name}: not a guidance artifact ({type(e).__name__}: {e})") from None

    def scales(self) -> dict[tuple[int, str], Tensor]:
        return decode_scales(self.global_scales)

    def check(self, run_id: str, policy_version: int, policy: str = "") -> None:
        """Refuse guidance of another run, or rolled out by another policy than
        the one about to train: another version, or (``policy``: its folder's
        manifest sha256) another folder at the same version, as another run
        given the same run id rolls out."""
        if self.run_id != run_id:
            raise GuidanceError(f"guidance of run {self.run_id!r} handed to run {run_id!r}")
        if self.policy_version != policy_version:
            raise GuidanceError(
                f"guidance was rolled out by policy version {self.policy_version}, the policy to train is version "
                f"{policy_version}"
            )
        if self.policy and policy and self.policy != policy:
            raise GuidanceError(
                f"guidance was rolled out by another policy folder (digest {self.policy}) than the one to train "
                f"({policy}): is run id {run_id!r} used by two runs?"
            )

    def loader(self, store, microbatches: list[list[int]], **kwargs) -> "GuidanceLoader":
        """The step's guidance per microbatch, its manifest checked against this reference."""
        if self.prefix is None:
            raise GuidanceError(f"run {self.run_id} step {self.rl_step} has no guidance (its method captures none)")
        return GuidanceLoader(store, self.rl_step, microbatches, prefix=self.prefix, expect=self.manifest(), **kwargs)

    def manifest(self) -> dict:
        """What the manifest of the step this refers to must say: its run,
        step, policy version and policy folder, and the tables compaction made (layers,
        sites, codec, R-k bits). A step that says otherwise was written over
        since, by another run given the same run id and name (other guidance
        settings, say), or copied by hand, and would train on guidance the
        reference does not describe."""
        fields = {
            "run_id": self.run_id,
            "rl_step": self.rl_step,
            "policy_version": self.policy_version,
            "top_k": self.top_k,
            "layers": list(self.layers),
            "sites": list(self.sites),
        }
        if self.policy:  # a reference made before the manifest named it names none
            fields["policy"] = self.policy
        if self.layers:  # a step without tables holds no codec
            fields["codec"] = [self.codec]
        if self.layers and self.codec == "bits":  # syndrome tables carry R-1
            fields["bits"] = [self.bits]
        return fields


# -- reload ----------------------------------------------------------------------


@dataclass
class MicrobatchGuidance:
    """The guidance of one training microbatch: per ``(layer, site)`` the rows of
    its trajectories, in microbatch order, positions ascending; ``missing``
    lists trajectories that fall back to RTN."""

    trajectories: list[int]
    tables: dict[tuple[int, str], "SiteTable | SyndromeTable"]
    missing: list[int]

    def guidance(self, layer: int, site: str) -> Guidance | None:
        """The guidance of a bits-coded table (syndrome-coded ones decode in the training forward)."""
        t = self.tables.get((layer, site))
        return None if t is None else t.guidance()


class GuidanceLoader:
    """Iterates over microbatches (lists of trajectory ids) of one step and
    yields their :class:`MicrobatchGuidance`, loading shards in a background
    thread at most ``prefetch`` microbatches ahead (and keeping at most
    ``cached_shards`` decoded shards). Trajectories without guidance raise a
    :class:`GuidanceError` unless ``allow_rtn_fallback``; fallbacks are counted."""

    def __init__(
        self,
        store,
        rl_step: int,
        microbatches: list[list[int]],
        *,
        prefix: str = "guidance",
        expect: dict | None = None,
        prefetch: int = 2,
        cached_shards: int = 2,
        allow_rtn_fallback: bool = False,
    ):
        self.manifest = read_manifest(store, rl_step, prefix, expect)
        self.store, self.microbatches = store, microbatches
        self.where = f"{store.uri}/{step_prefix(prefix, rl_step)}"  # for errors: the step the trainer reads
        self.allow_rtn_fallback = allow_rtn_fallback
        self.fallen_back: set[int] = set()  # trajectories rounded RTN for want of guidance
        self._shard_of = {t: i for i, e in enumerate(self.manifest["shards"]) for t in e["trajectories"]}
        self._cache: OrderedDict[int, dict[int, CaptureRecords]] = OrderedDict()  # shard -> trajectory -> its rows
        self._cached_shards = cached_shards
        self._queue: queue.Queue = queue.Queue(maxsize=prefetch)
        self._stopped = threading.Event()  # the consumer is done: the producer stops instead of waiting on it
        self._thread = threading.Thread(target=self._produce, name="guidance-prefetch", daemon=True)
        self._thread.start()

    @property
    def fallback_trajectories(self) -> int:
        """Trajectories rounded RTN for want of guidance so far (``allow_rtn_fallback``), each once
        (a microbatch whose guidance is loaded twice, for pi_old and for its loss, counts once)."""
        return len(self.fallen_back)

    def _shard(self, index: int) -> dict[int, CaptureRecords]:
        """Shard ``index``'s records of each of its trajectories, cut once when read."""
        if index not in self._cache:
            entry = self.manifest["shards"][index]
            parts = _split(read_shard(self.store, self.manifest, entry), [[t] for t in entry["trajectories"]])
            self._cache[index] = dict(zip(entry["trajectories"], parts))
            while len(self._cache) > self._cached_shards:
                self._cache.popitem(last=False)
        self._cache.move_to_end(index)
        return self._cache[index]

    def _load(self, trajectories: list[int]) -> MicrobatchGuidance:
        missing = [t for t in trajectories if t not in self._shard_of]
        if missing and not self.allow_rtn_fallback:
            raise GuidanceError(
                f"{self.where}: step {self.manifest['rl_step']} has no guidance for trajectories {missing}"
            )
        found = [self._shard(self._shard_of[t])[t] for t in trajectories if t not in missing]
        return MicrobatchGuidance(list(trajectories), CaptureRecords.concat(found).tables, missing)

    def _produce(self) -> None:
        try:
            for mb in self.microbatches:
                if self._stopped.is_set():
                    return
                self._queue.put(self._load(mb))
        except BaseException as e:  # handed to the consumer
            self._queue.put(e)
        self._queue.put(None)

    def __iter__(self) -> Iterator[MicrobatchGuidance]:
        try:
            while (item := self._queue.get()) is not None:
                if isinstance(item, BaseException):
                    raise item
                self.fallen_back.update(item.missing)
                yield item
        finally:  # stopped early (a step that failed, say): free the producer and what it holds
            self.close()

    def close(self) -> None:
        """Stop the prefetch thread and drop what it read ahead. Leaving an
        iteration early does it; a consumer that failed before it began
        iterating (or whose iterator is kept alive by a traceback) must, or the
        thread waits on its full queue for good, holding those microbatches."""
        self._stopped.set()
        while self._thread.is_alive():
            with contextlib.suppress(queue.Empty):
                self._queue.get(timeout=0.1)

    def __enter__(self) -> "GuidanceLoader":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
