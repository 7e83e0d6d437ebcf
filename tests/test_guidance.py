"""Guidance compaction, shards, manifests and reload: exact round trips, and
every corruption caught with the object named."""

import hashlib
import json
import random
import struct
import threading
import time
from dataclasses import replace

import pytest
import torch

from tracefp4.components import guidance
from tracefp4.components.capture import CaptureConfig, CaptureRecords
from tracefp4.components.guidance import (
    STEP_MANIFEST,
    BackgroundStepWriter,
    GuidanceError,
    GuidanceLoader,
    StepSize,
    StepWriter,
    _manifest_digest,
    compact,
    compaction_report,
    decode_shard,
    encode_shard,
    iter_step,
    iter_step_tables,
    read_manifest,
    read_step,
    select_layers,
    write_step,
)
from tracefp4.components.mismatch import compare, teacher_force
from tracefp4.components.model import build_model
from tracefp4.components.quant_config import rollout_config
from tracefp4.components.rollout import SamplingParams, TorchEngine
from tracefp4.components.store import open_store


def prompts(n=6, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 256, (int(k),), generator=g).tolist() for k in torch.randint(2, 10, (n,), generator=g)]


@pytest.fixture(scope="module")
def captured():
    """A full capture of a small rollout, and the engine and trajectories behind it."""
    engine = TorchEngine(build_model("smoke", seed=0), rollout_config("fp4_wa_kv"), capture=CaptureConfig())
    out = engine.generate(prompts(), SamplingParams(max_new_tokens=6, seed=1))
    return engine, out, engine.drain_capture()


def assert_same_tables(a, b):
    assert a.tables.keys() == b.tables.keys()
    for key, t in a.tables.items():
        u = b.tables[key]
        for name in ("traj", "pos", "slot", "expert", "codes", "scales"):
            assert torch.equal(getattr(t, name), getattr(u, name)), (key, name)
        assert (t.row_global_scales is None) == (u.row_global_scales is None), key
        assert t.row_global_scales is None or torch.equal(t.row_global_scales, u.row_global_scales), key
        assert (t.bits, t.width, t.fmt, t.global_scale) == (u.bits, u.width, u.fmt, u.global_scale)


def test_rows_of_groups_selects_what_isin_selects():
    """A step's shards and a shard's trajectories are cut in one sort of the rows
    (a scan per group took time quadratic in a step's trajectories): the same
    rows, in row order, as ``torch.isin`` per group, rows of no group left out."""
    from tracefp4.components.capture import rows_of_groups

    g = torch.Generator().manual_seed(0)
    traj = torch.randint(0, 40, (500,), generator=g, dtype=torch.int32)
    ids = torch.randperm(50, generator=g)  # 10 of them in no row
    groups = [ids[:7], ids[7:8], ids[8:8], ids[8:30]]  # the rest in no group
    for group, rows in zip(groups, rows_of_groups(traj, groups), strict=True):
        assert torch.equal(rows, torch.isin(traj, group).nonzero().flatten())
    assert [len(r) for r in rows_of_groups(traj, [torch.tensor([], dtype=torch.long)])] == [0]


def test_shard_round_trip(captured):
    engine, _, records = captured
    data = encode_shard(records, rl_step=3, policy_version=7, top_k=engine.model.cfg.top_k)
    header, back = decode_shard(data, "shard")
    assert header["rl_step"] == 3 and header["policy_version"] == 7 and header["bits"] == [4]
    assert header["layers"] == [0, 1] and header["sites"] == ["k_cache", "moe_down_in", "moe_in", "v_cache"]
    assert_same_tables(records, back)


@pytest.mark.parametrize("codec", ["R-1", "R-4", "syndrome"])
def test_a_tables_bytes_are_those_its_shard_ships(captured, codec):
    """What compaction reports (guidance bytes, bits per element) counts every
    byte a shard's payload carries, the routed site's experts too."""
    from tracefp4.components.syndrome import encode_table, site_rates

    engine, _, records = captured
    if codec == "syndrome":
        rates = site_rates(records.tables, None, 0.25)
        kept = CaptureRecords({k: encode_table(t, rates[k]) for k, t in records.tables.items()})
    else:
        kept = compact(records, int(codec[-1]), [0, 1])
    header, _ = decode_shard(encode_shard(kept, rl_step=0, policy_version=0, top_k=engine.model.cfg.top_k), "shard")
    assert kept.nbytes == header["payload_bytes"]
    routed = [t for (_, site), t in kept.tables.items() if site == "moe_down_in"]
    assert routed and all(len(t.traj) for t in routed)


def test_step_round_trip_through_the_loader(captured, tmp_path):
    engine, out, records = captured
    store = open_store(str(tmp_path))
    manifest = write_step(store, records, rl_step=1, policy_version=2, top_k=2, trajectories_per_shard=4)
    keys = [e["key"] for e in manifest["shards"]] + ["guidance/step-000001/manifest.json"]
    assert len(manifest["shards"]) == 2 and sorted(store.list("guidance/step-000001")) == sorted(keys)
    ids = [t.id for t in out]
    microbatches = [ids[4:], ids[:4][::-1]]  # across shards, and out of order
    loaded = list(GuidanceLoader(store, 1, microbatches, expect={"policy_version": 2}))
    assert [mb.trajectories for mb in loaded] == microbatches
    for mb in loaded:
        for key, table in mb.tables.items():
            expected = torch.cat([(records.tables[key].traj == t).nonzero()[:, 0] for t in mb.trajectories])
            assert_same_tables(type(records)({key: records.tables[key].select(expected)}), type(records)({key: table}))
        g = mb.guidance(0, "moe_in")
        assert g.shape[0] == sum(len(t.tokens) - 1 for t in out if t.id in mb.trajectories)


def test_a_step_written_part_by_part_reads_back_as_one_written_whole(captured, tmp_path):
    """The rollout adds each RL step's capture as it drains it, compaction each
    shard it reads (StepWriter): the step is the one written whole, and a part
    that repeats a trajectory, or holds other tables, is refused."""
    engine, out, records = captured
    ids = sorted(t.id for t in out)
    first, second = ([ids[:3]], [ids[3:]])
    store = open_store(str(tmp_path))
    writer = StepWriter(store, rl_step=0, policy_version=0, top_k=2, trajectories_per_shard=2)
    for part in (first, second):
        writer.add(CaptureRecords({k: t.for_trajectories(torch.tensor(part[0])) for k, t in records.tables.items()}))
    manifest = writer.close()
    assert [e["trajectories"] for e in manifest["shards"]] == [ids[0:2], ids[2:3], ids[3:5], ids[5:6]]
    assert_same_tables(records, read_step(store, 0))
    with pytest.raises(GuidanceError, match=rf"trajectories \[{ids[2]}\] are in a shard already"):
        writer.add(CaptureRecords({k: t.for_trajectories(torch.tensor(ids[2:3])) for k, t in records.tables.items()}))
    one_table = dict(list(records.tables.items())[:1])
    with pytest.raises(GuidanceError, match="a part of tables"):
        writer.add(CaptureRecords({k: t.for_trajectories(torch.tensor(ids[:1])) for k, t in one_table.items()}))


def test_a_steps_size_is_measured_by_its_shards_headers_alone(captured, tmp_path, monkeypatch):
    """Inline compaction measures the guidance the rollout wrote (at the paper's
    scale terabytes a round) by each shard's header, read alone, and the sizes a
    listing gives: the same figures as the shards read whole, and no shard's
    payload read; a shard missing, cut short or with a damaged header is an
    error naming it."""
    engine, out, records = captured
    kept = compact(records, 1, [0, 1])
    store = open_store(str(tmp_path))
    manifest = write_step(store, kept, rl_step=2, policy_version=5, top_k=2, trajectories_per_shard=2)
    sites = ["moe_in", "moe_down_in", "moe_in", "moe_down_in"]
    whole, headers = StepSize(sites), StepSize(sites)
    for shard in iter_step(store, 2):
        whole.add(shard, shard)
    read = []
    real_range, real_get = store.get_range, store.get_bytes
    store.get_range = lambda key, offset, length: read.append(length) or real_range(key, offset, length)
    store.get_bytes = lambda key: real_get(key) if key.endswith(STEP_MANIFEST) else pytest.fail(f"{key} read whole")
    for shard in iter_step_tables(store, 2):
        headers.add(shard, shard)
    assert (headers.guidance_bytes, headers.elements, headers.full_bytes, headers.tables) == (
        whole.guidance_bytes,
        whole.elements,
        whole.full_bytes,
        whole.tables,
    )
    assert whole.guidance_bytes == kept.nbytes and len(read) == len(manifest["shards"]) == 3
    monkeypatch.setattr(guidance, "HEADER_READ", 40)  # a header longer than the first read: the rest read next
    again = StepSize(sites)
    for shard in iter_step_tables(store, 2):
        again.add(shard, shard)
    assert (again.guidance_bytes, again.full_bytes, again.tables) == (
        whole.guidance_bytes,
        whole.full_bytes,
        whole.tables,
    )
    assert read[3:] == [40, read[4], 40, read[6], 40, read[8]] and min(read[4::2]) > 40
    store.get_bytes = real_get
    first = manifest["shards"][0]["key"]
    data = store.get_bytes(first)
    store.put_bytes(first, data[:-1])
    with pytest.raises(GuidanceError, match=f"{first}: .* bytes, the manifest says"):
        list(iter_step_tables(store, 2))
    at = guidance._PREAMBLE.size + 7  # inside the header's JSON, which no checksum covers when read alone
    store.put_bytes(first, data[:at] + b"}" + data[at + 1 :])
    with pytest.raises(GuidanceError, match=f"{first}: an unreadable header"):
        list(iter_step_tables(store, 2))
    store.delete(first)
    with pytest.raises(GuidanceError, match=f"{first}: missing, the step's manifest lists it"):
        list(iter_step_tables(store, 2))


def test_a_step_of_no_trajectory_is_one_shard_of_empty_tables(captured, tmp_path):
    engine, out, records = captured
    empty = CaptureRecords(
        {k: t.for_trajectories(torch.tensor([], dtype=torch.long)) for k, t in records.tables.items()}
    )
    store = open_store(str(tmp_path))
    manifest = write_step(store, empty, rl_step=0, policy_version=0, top_k=2)
    assert [e["trajectories"] for e in manifest["shards"]] == [[]]
    back = read_step(store, 0)
    assert back.tables.keys() == records.tables.keys() and all(len(t.traj) == 0 for t in back.tables.values())


def test_the_rollouts_writer_stores_its_shards_on_a_thread_of_its_own_as_a_writer_does(captured, tmp_path):
    """The rollout's decode loop hands finished shards to a BackgroundStepWriter
    and decodes on: the shards are encoded and stored on another thread, one
    part at a time and in order, so the step is the one a StepWriter writes,
    byte for byte; an error of the thread is raised to the caller."""
    _, out, records = captured
    step = dict(rl_step=1, policy_version=2, top_k=2, trajectories_per_shard=2, run_id="r", policy="p")
    halves = [
        CaptureRecords({k: t.for_trajectories(torch.tensor([t.id for t in part])) for k, t in records.tables.items()})
        for part in (out[:3], out[3:])
    ]
    here, there = open_store(str(tmp_path / "here")), open_store(str(tmp_path / "there"))
    writer = StepWriter(here, **step)
    for half in halves:
        writer.add(half)
    putting = []
    real_put = there.put_bytes
    there.put_bytes = lambda key, data: putting.append(threading.current_thread()) or real_put(key, data)
    background = BackgroundStepWriter(there, **step)
    for half in halves:
        background.add(half)
    assert background.close() == writer.close()
    assert all(here.get_bytes(e["key"]) == there.get_bytes(e["key"]) for e in read_manifest(here, 1)["shards"])
    assert putting[-1] is threading.current_thread()  # the manifest, by close
    assert threading.current_thread() not in putting[:-1] and len(putting) == 2 * 2 + 1  # each half: shards of 2, 1
    failing = BackgroundStepWriter(open_store(str(tmp_path / "failing")), **step)
    failing.add(halves[0])
    failing.add(halves[0])  # its trajectories again: refused on the thread
    with pytest.raises(GuidanceError, match="are in a shard already"):
        failing.close()


def test_finished_shards_are_drained_together_once_they_hold_as_many_as_run_at_once():
    """Each drain copies the capture of the requests still running
    (Capture.drain), so shards are not drained one by one as they complete, but
    once the complete ones hold as many trajectories as run at once, or as are
    left: ids 10..19 in shards of 3, 4 running at once."""
    from types import SimpleNamespace

    from tracefp4.components.guidance import FinishedShards

    drained = []
    writer = SimpleNamespace(per_shard=3, base="s", add=lambda records: None)
    shards = FinishedShards(writer, lambda ids: drained.append(ids.tolist()), range(10, 20), running=4)
    finish = lambda *ids: shards([SimpleNamespace(id=i) for i in ids])  # noqa: E731
    finish(10, 11, 12)  # shard 10..12 complete: 3 trajectories, 4 run at once
    assert drained == []
    finish(19)  # the last shard (one trajectory) complete too: 4
    assert drained == [[10, 11, 12, 19]]
    finish(13, 14, 16, 17)  # 13..15 and 16..18 not complete
    assert drained == [[10, 11, 12, 19]]
    finish(15, 18)  # both complete, and nothing is left to finish
    assert drained[1:] == [[13, 14, 15, 16, 17, 18]]
    shards.check_all_written()


@pytest.mark.parametrize("bits", [1, 2, 3, 4])
@pytest.mark.parametrize("scales", ["static", "per_token"])
def test_offline_compaction_equals_inline_capture(captured, per_token_captured, bits, scales):
    engine, out, full = captured if scales == "static" else per_token_captured
    layers = select_layers(1, [0, 1])
    inline_engine = TorchEngine(
        build_model("smoke", seed=0), engine.quant, capture=CaptureConfig(bits=bits, layers=layers)
    )
    inline_engine.generate(prompts(), SamplingParams(max_new_tokens=6, seed=1))
    assert_same_tables(compact(full, bits, layers), inline_engine.drain_capture())


def test_layer_selection():
    layers = [0, 1, 2, 3]
    assert select_layers("all", layers) == (0, 1, 2, 3)
    assert select_layers(2, layers) == (2, 3)
    assert select_layers([3, 1], layers) == (1, 3)
    with pytest.raises(ValueError, match="unknown layer selection 'adaptive:2'"):
        select_layers("adaptive:2", layers)
    with pytest.raises(ValueError, match=r"layers \[7\] have no captured sites"):
        select_layers([7], layers)
    with pytest.raises(ValueError, match="deepest 5 of 4"):
        select_layers(5, layers)


def test_compaction_report_sizes_and_fidelity(captured):
    engine, out, full = captured
    training = teacher_force(engine, out, keep_inputs=True)
    exact = compaction_report(full, compact(full, 4, [0, 1]), training)
    assert exact.total["fidelity"] == 1.0 and exact.total["ratio_to_full"] == 1.0
    r1 = compaction_report(full, compact(full, 1, [0, 1]), training)
    assert 0.99 <= r1.total["fidelity"] <= 1.0
    elements = sum(len(t.traj) * t.width for t in full.tables.values())
    routed = sum(len(t.traj) for (_, site), t in full.tables.items() if site == "moe_down_in")
    # one bit plus an E4M3 byte per 16 elements, and each routed row's int16 expert (in the full record too)
    assert r1.total["bits_per_element"] == pytest.approx(1 + 8 / 16 + 16 * routed / elements)
    assert r1.total["ratio_to_full"] == pytest.approx((1.5 * elements + 16 * routed) / (4.5 * elements + 16 * routed))
    nothing = compaction_report(full, compact(full, 1, []), training)
    # without guidance training rounds RTN: below full fidelity exactly where its codes differ from the rollout's,
    # which depends on the CPU's bf16 kernels (with some, none do for this small model; test_capture pins that
    # some do on the tiny preset)
    mismatched = sum(m.mismatched for m in compare(full, training).values())
    assert nothing.total["bytes"] == 0 and (nothing.total["fidelity"] < 1.0) == (mismatched > 0)
    assert nothing.total["fidelity"] <= r1.total["fidelity"]


def test_compaction_fidelity_counts_a_row_of_nan_or_inf_as_the_same_decision(captured):
    """A teacher-forced row holding a NaN or Inf (a bf16 overflow) is rounded
    to nearest by the training path under any guidance, full or compacted, so
    it is the same decision on both sides. The report compared the guided
    reference with RTN, and NaN with ==, which is never true: every such row
    counted as a miss. At one site whose every row holds one, the fidelity is
    1 with no guidance and with 1-bit guidance."""
    engine, out, full = captured
    training = teacher_force(engine, out, keep_inputs=True)
    key = (0, "k_cache")
    inputs = training.tables[key].inputs
    inputs[0::2, 0], inputs[1::2, -1] = float("nan"), float("inf")
    one = [CaptureRecords({key: records.tables[key]}) for records in (full, training)]
    for layers in ([], [0]):
        report = compaction_report(one[0], compact(one[0], 1, layers), one[1])
        assert report.total["decisions"] == report.total["elements"] and report.total["fidelity"] == 1.0


def test_every_bit_flip_and_truncation_is_caught(captured):
    engine, _, records = captured
    data = encode_shard(records, rl_step=0, policy_version=0, top_k=2)
    rng = random.Random(0)
    for i in range(1000):
        if i % 2:
            bad = bytearray(data)
            bit = rng.randrange(len(data) * 8)
            bad[bit // 8] ^= 1 << (bit % 8)
        else:
            bad = data[: rng.randrange(len(data))]
        with pytest.raises(GuidanceError, match="shard-x"):
            decode_shard(bytes(bad), "shard-x")


def test_mismatched_and_missing_guidance_fail_clearly(captured, tmp_path):
    engine, out, records = captured
    store = open_store(str(tmp_path))
    write_step(store, records, rl_step=5, policy_version=1, top_k=2)
    with pytest.raises(GuidanceError, match="policy_version is 1, expected 2"):
        read_manifest(store, 5, expect={"policy_version": 2})
    with pytest.raises(GuidanceError, match="no manifest, so step 6 is missing or incomplete"):
        read_manifest(store, 6)
    with pytest.raises(
        GuidanceError, match=rf"{store.uri}/guidance/step-000005: .* no guidance for trajectories \[999\]"
    ):
        list(GuidanceLoader(store, 5, [[out[0].id, 999]]))
    loader = GuidanceLoader(store, 5, [[out[0].id, 999]], allow_rtn_fallback=True)
    (mb,) = list(loader)
    assert mb.missing == [999] and loader.fallback_trajectories == 1
    # a shard swapped in from another step is caught by its header
    other = encode_shard(records, rl_step=4, policy_version=1, top_k=2)
    manifest = json.loads(store.get_bytes("guidance/step-000005/manifest.json"))
    entry = manifest["shards"][0]
    store.put_bytes(entry["key"], other)
    entry["bytes"], entry["sha256"] = len(other), hashlib.sha256(other).hexdigest()
    manifest["sha256"] = _manifest_digest(manifest)  # a consistent forgery: only the shard header tells
    store.put_bytes("guidance/step-000005/manifest.json", json.dumps(manifest).encode())
    with pytest.raises(GuidanceError, match="shard-00000.bin: rl_step is 4, expected 5"):
        list(GuidanceLoader(store, 5, [[out[0].id]]))


def test_a_step_being_rewritten_does_not_exist_until_its_new_manifest(captured, tmp_path, monkeypatch):
    """A retried task rewrites its step's shards: if it dies among them, the
    earlier attempt's manifest must not vouch for shards it no longer matches."""
    _, out, records = captured
    store = open_store(str(tmp_path))
    write_step(store, records, rl_step=5, policy_version=1, top_k=2, trajectories_per_shard=1)
    put, written = store.put_bytes, []

    def dies_after_one_shard(key, data):
        if written:
            raise OSError("killed")
        written.append(key)
        put(key, data)

    monkeypatch.setattr(store, "put_bytes", dies_after_one_shard)
    with pytest.raises(OSError, match="killed"):
        write_step(store, records, rl_step=5, policy_version=2, top_k=2, trajectories_per_shard=1)
    with pytest.raises(GuidanceError, match="no manifest, so step 5 is missing or incomplete"):
        read_manifest(store, 5)


def test_a_bad_manifest_is_a_guidance_error_naming_it(captured, tmp_path):
    engine, out, records = captured
    store = open_store(str(tmp_path))
    write_step(store, records, rl_step=5, policy_version=1, top_k=2, trajectories_per_shard=2, run_id="run-a")
    key = "guidance/step-000005/manifest.json"
    good = store.get_bytes(key)
    manifest = json.loads(good)
    dropped = {**manifest, "shards": manifest["shards"][1:]}  # one shard entry gone: its trajectories would vanish
    for bad, reason in [
        (good[: len(good) // 2], "unreadable JSON"),
        (b"\xff\xfe garbage", "unreadable JSON"),
        (b"[1, 2]", "a JSON list"),
        (json.dumps(dropped).encode(), "checksum mismatch"),
    ]:
        store.put_bytes(key, bad)
        with pytest.raises(GuidanceError, match=f"step-000005/manifest.json: .*{reason}"):
            read_manifest(store, 5)
    store.put_bytes(key, good)
    assert read_manifest(store, 5, expect={"run_id": "run-a"})["shards"] == manifest["shards"]
    with pytest.raises(GuidanceError, match="run_id is 'run-a', expected 'run-b'"):
        read_manifest(store, 5, expect={"run_id": "run-b"})


def test_incomplete_capture_is_refused(captured):
    engine, _, records = captured
    table = records.tables[(0, "moe_in")]
    broken = type(records)(dict(records.tables))
    broken.tables[(0, "moe_in")] = table.select(torch.arange(1, table.codes.shape[0]))
    with pytest.raises(GuidanceError, match="layer 0 moe_in covers other trajectories or positions"):
        encode_shard(broken, rl_step=0, policy_version=0, top_k=2)


def test_prefetch_is_bounded(captured, tmp_path):
    engine, out, records = captured
    store = open_store(str(tmp_path))
    write_step(store, records, rl_step=0, policy_version=0, top_k=2, trajectories_per_shard=1)
    loader = GuidanceLoader(store, 0, [[t.id] for t in out], prefetch=1, cached_shards=1)
    it = iter(loader)
    next(it)
    time.sleep(0.3)  # the producer may run ahead, but only by the queue's bound
    assert loader._queue.qsize() <= 1 and len(loader._cache) <= 1
    assert len(list(it)) == len(out) - 1


@pytest.fixture(scope="module")
def per_token_captured():
    """A full capture of a small rollout with per-token NVFP4 activation global scales."""
    quant = replace(rollout_config("fp4_wa_kv"), activation_global_scale="per_token")
    engine = TorchEngine(build_model("smoke", seed=0), quant, capture=CaptureConfig())
    out = engine.generate(prompts(), SamplingParams(max_new_tokens=6, seed=1))
    return engine, out, engine.drain_capture()


def test_shard_round_trip_with_per_token_global_scales(per_token_captured, tmp_path):
    engine, out, records = per_token_captured
    per_token = [key for key, t in records.tables.items() if t.row_global_scales is not None]
    assert sorted({site for _, site in per_token}) == ["moe_down_in", "moe_in"]
    data = encode_shard(records, rl_step=0, policy_version=0, top_k=engine.model.cfg.top_k)
    header, back = decode_shard(data, "shard")
    assert header["format_version"] == 5
    assert_same_tables(records, back)
    for key, t in records.tables.items():
        u = back.tables[key]
        assert (u.row_global_scales is None) == (t.row_global_scales is None)
        if t.row_global_scales is not None:
            assert u.row_global_scales.dtype == torch.float32 and torch.equal(u.row_global_scales, t.row_global_scales)
    # through R-1 compaction, a step and the loader, per microbatch: each row keeps its scale
    store = open_store(str(tmp_path))
    write_step(store, compact(records, 1, [0, 1]), rl_step=0, policy_version=0, top_k=2, trajectories_per_shard=2)
    ids = [t.id for t in out]
    (mb,) = GuidanceLoader(store, 0, [ids[::-1]])
    rows = torch.cat([(records.tables[(1, "moe_in")].traj == t).nonzero()[:, 0] for t in ids[::-1]])
    guide = mb.guidance(1, "moe_in")
    assert guide.bits == 1 and torch.equal(guide.global_scale, records.tables[(1, "moe_in")].row_global_scales[rows])


def test_compaction_fidelity_under_per_token_global_scales(per_token_captured):
    engine, out, full = per_token_captured
    training = teacher_force(engine, out, keep_inputs=True)
    assert training.tables[(0, "moe_in")].row_global_scales is not None  # training computes its own
    exact = compaction_report(full, compact(full, 4, [0, 1]), training)
    assert exact.total["fidelity"] == 1.0 and exact.total["ratio_to_full"] == 1.0
    nothing = compaction_report(full, compact(full, 1, []), training)
    mismatched = sum(m.mismatched for m in compare(full, training).values())
    assert (nothing.total["fidelity"] < 1.0) == (mismatched > 0)  # as above


def test_a_version_2_shard_is_still_read(captured):
    """Version 3 added per-row global scales; a version 2 shard (static scales only) reads as before."""
    engine, _, records = captured
    data = encode_shard(records, rl_step=0, policy_version=0, top_k=2)
    magic, _, head_len = struct.unpack_from("<8sHI", data)
    header = json.loads(data[14 : 14 + head_len])
    header["format_version"] = 2
    head = json.dumps(header, sort_keys=True).encode()
    body = struct.pack("<8sHI", magic, 2, len(head)) + head + data[14 + head_len : -32]
    old, back = decode_shard(body + hashlib.sha256(body).digest(), "v2")
    assert old["format_version"] == 2
    assert_same_tables(records, back)
    body = struct.pack("<8sHI", magic, 1, len(head)) + head + data[14 + head_len : -32]
    with pytest.raises(GuidanceError, match=r"v1: format version 1, this reader reads \(2, 3, 4, 5\)"):
        decode_shard(body + hashlib.sha256(body).digest(), "v1")


def test_a_step_merged_from_workers_holding_interleaved_trajectories_compacts_and_reads_back(captured, tmp_path):
    """With several RL steps per round each rollout worker holds an interleaved
    slice of the ids (worker 0: 0, 1, 4, 5; worker 1: 2, 3), so the merged step
    reads back out of id order. Compaction's rewrite of it listed each shard's
    trajectories sorted while the shard held them in the tables' order, and
    every read of the guidance was refused."""
    from tracefp4.components.capture import CaptureRecords
    from tracefp4.components.guidance import merge_steps, read_step

    _, _, records = captured
    store = open_store(str(tmp_path))
    for worker, ids in enumerate(([0, 1, 4, 5], [2, 3])):
        part = CaptureRecords({k: t.for_trajectories(torch.tensor(ids)) for k, t in records.tables.items()})
        write_step(store, part, rl_step=0, policy_version=0, top_k=2, prefix=f"capture/worker-{worker:03d}")
    merge_steps(store, 0, ["capture/worker-000", "capture/worker-001"], "capture")
    merged = read_step(store, 0, "capture")
    assert torch.unique_consecutive(merged.tables[(0, "moe_in")].traj).tolist() == [0, 1, 4, 5, 2, 3]
    kept = compact(merged, 1, [1])
    write_step(store, kept, rl_step=0, policy_version=0, top_k=2)
    assert_same_tables(kept, read_step(store, 0))


def test_a_loader_left_early_stops_its_prefetch_thread(captured, tmp_path):
    """A consumer that stops (a step that failed, say) left the prefetch thread
    blocked on its full queue for good, holding the microbatches it had read."""
    engine, out, records = captured
    store = open_store(str(tmp_path))
    write_step(store, records, rl_step=0, policy_version=0, top_k=2, trajectories_per_shard=1)
    loader = GuidanceLoader(store, 0, [[t.id] for t in out], prefetch=1)
    batches = iter(loader)
    assert next(batches).trajectories == [out[0].id]
    batches.close()  # what leaving a for loop early does
    assert not loader._thread.is_alive()


def test_a_loader_closed_before_it_was_read_stops_its_prefetch_thread(captured, tmp_path):
    """A train step that fails before its first microbatch never starts the
    loader's iterator, whose ``finally`` then never runs: the prefetch thread
    waited on its full queue for good. Its creator closes it (``with``)."""
    engine, out, records = captured
    store = open_store(str(tmp_path))
    write_step(store, records, rl_step=0, policy_version=0, top_k=2, trajectories_per_shard=1)
    with pytest.raises(RuntimeError, match="failed"):
        with GuidanceLoader(store, 0, [[t.id] for t in out], prefetch=1) as loader:
            iter(loader)
            raise RuntimeError("the step failed")
    loader._thread.join(timeout=5)
    assert not loader._thread.is_alive()
