"""Capture: complete, keyed, compactable; and the train-rollout code mismatch
it exists to fix, measured on the tiny preset."""

import threading

import pytest
import torch

from tracefp4.components import device
from tracefp4.components.architecture import ModelConfig
from tracefp4.components.capture import (
    KEY_POS_BITS,
    KEY_SLOT_BITS,
    Capture,
    CaptureConfig,
    CaptureRecords,
    TokenMap,
    row_key,
)
from tracefp4.components.mismatch import compare, join_rows, signed_rank, teacher_force, token_groups
from tracefp4.components.model import build_model
from tracefp4.components.quant_config import rollout_config
from tracefp4.components.rollout import KVCache, SamplingParams, TorchEngine
from tracefp4.kernels import quantize


def prompts(n, vocab, seed=0, longest=12):
    g = torch.Generator().manual_seed(seed)
    return [
        torch.randint(0, vocab, (int(k),), generator=g).tolist() for k in torch.randint(2, longest, (n,), generator=g)
    ]


@pytest.fixture(scope="module")
def smoke():
    return build_model("smoke", seed=0)


def rollout(model, capture: CaptureConfig, config="fp4_wa_kv", n=6, new=7, seed=0, **engine_options):
    engine = TorchEngine(model, rollout_config(config), capture=capture, **engine_options)
    out = engine.generate(prompts(n, model.cfg.vocab_size, seed), SamplingParams(max_new_tokens=new, seed=seed))
    return engine, out, engine.drain_capture()


def test_capture_is_complete_and_keyed(smoke):
    # a small buffer: the forwards of one rollout fill it several times over
    engine, out, records = rollout(smoke, CaptureConfig(max_tokens=80))
    cfg = smoke.cfg
    expected = {(t.id, p) for t in out for p in range(len(t.tokens) - 1)}  # the last token is never fed
    for layer in range(cfg.num_layers):
        for site in ("moe_in", "k_cache", "v_cache"):
            table = records.tables[(layer, site)]
            keys = list(zip(table.traj.tolist(), table.pos.tolist()))
            assert sorted(keys) == keys and set(keys) == expected and len(keys) == len(expected), (layer, site)
        down = records.tables[(layer, "moe_down_in")]
        rows = set(zip(down.traj.tolist(), down.pos.tolist(), down.slot.tolist()))
        assert rows == {(t, p, s) for t, p in expected for s in range(cfg.top_k)}
        assert ((down.expert >= 0) & (down.expert < cfg.num_experts)).all()
        assert records.tables[(layer, "moe_in")].codes.shape == (len(expected), cfg.hidden_size // 2)
        assert records.tables[(layer, "k_cache")].width == cfg.num_kv_heads * cfg.head_dim


def test_a_batch_whose_prefill_overflows_a_buffer_rolls_out_two_at_a_time(smoke):
    """Prefill of 6 prompts of up to 11 tokens: 66 rows, over a 24-row buffer.
    The engine rolls out 2 prompts at a time, with the responses and the capture
    of one call (each request draws from its own generator)."""
    _, whole, records = rollout(smoke, CaptureConfig())
    engine, bounded, bounded_records = rollout(smoke, CaptureConfig(max_tokens=24))
    assert max(len(p) for p in prompts(6, smoke.cfg.vocab_size)) == 11 and engine.rows_at_once(prompts(6, 256)) == 2
    assert_same_rollout((whole, records), (bounded, bounded_records))


def test_at_most_max_running_requests_roll_out_at_once(smoke):
    """``max_running_requests`` 4 (``rollout.max_running_requests``): 6 prompts
    in 4 rows (the first 4 prefilled at once, 2 into the rows of the first that
    finish), with the responses and the capture of one call."""
    _, whole, records = rollout(smoke, CaptureConfig())
    engine, bounded, bounded_records = rollout(smoke, CaptureConfig(), max_running_requests=4)
    prefilled = []
    prefill = engine._prefill
    engine._prefill = lambda tokens, *a: prefilled.append(len(tokens)) or prefill(tokens, *a)
    again = engine.generate(prompts(6, smoke.cfg.vocab_size), SamplingParams(max_new_tokens=7), first=0)
    assert prefilled == [4, 2] and [t.id for t in again] == list(range(6))
    assert_same_rollout((whole, records), (bounded, bounded_records))
    with pytest.raises(ValueError, match="max_running_requests"):
        TorchEngine(smoke, max_running_requests=-1)


def assert_same_rollout(one, other) -> None:
    """The same trajectories (ids, tokens, logprobs) and the same captured records."""
    (out, records), (other_out, other_records) = one, other
    assert [(t.id, t.tokens, t.logprobs) for t in other_out] == [(t.id, t.tokens, t.logprobs) for t in out]
    assert records.tables.keys() == other_records.tables.keys()
    for key, table in records.tables.items():
        mine = other_records.tables[key]
        for field in ("traj", "pos", "slot", "codes", "scales"):
            assert torch.equal(getattr(table, field), getattr(mine, field)), (key, field)


def test_trajectories_drained_as_they_finish_are_what_one_drain_gives(smoke):
    """A rollout hands each finished request's capture on at the stop check that
    retires it (``generate``'s ``finished``), the others' rows kept: drained so,
    4 rows at a time over a small buffer, the records are those of one drain."""
    _, whole, records = rollout(smoke, CaptureConfig(max_tokens=80), max_running_requests=4)
    engine = TorchEngine(
        smoke, rollout_config("fp4_wa_kv"), capture=CaptureConfig(max_tokens=80), max_running_requests=4
    )
    parts, retired = [], []

    def finished(done):
        retired.append(sorted(t.id for t in done))
        parts.append(engine.drain_capture(torch.tensor(retired[-1])))

    out = engine.generate(prompts(6, smoke.cfg.vocab_size), SamplingParams(max_new_tokens=7, seed=0), finished=finished)
    assert len(retired) > 1 and sorted(t for ids in retired for t in ids) == list(range(6))
    assert not engine.capture.pending()  # nothing left behind, padding included
    for ids, part in zip(retired, parts):
        assert {t for table in part.tables.values() for t in table.traj.tolist()} == set(ids)
    drained = CaptureRecords.concat(parts)
    for key, table in drained.tables.items():  # in row-key order, as one drain sorts them
        order = torch.argsort(row_key(table.traj, table.pos, table.slot), stable=True)
        drained.tables[key] = table.select(order)
    assert_same_rollout((whole, records), (out, drained))


def test_captured_kv_is_what_the_cache_held(smoke):
    # layer 0's K and V depend on each token alone: recomputing them over the
    # full sequences must give exactly the codes the cache held at request end
    engine, out, records = rollout(smoke, CaptureConfig(), n=3, config="fp4_kv")
    report = compare(records, teacher_force(engine, out))
    for site in ("k_cache", "v_cache"):
        m = report[(0, site)]
        assert m.elements == sum(len(t.tokens) - 1 for t in out) * records.tables[(0, site)].width
        assert m.mismatched == 0 and m.scale_mismatched == 0


def test_requests_stopping_early_and_admitted_into_a_grown_cache_are_captured_whole(smoke, monkeypatch):
    """Requests that stop early, and a 600-token prompt admitted into the row
    (of 2) the first of them frees, past the cache's 512 positions, so that the
    cache grows under the request still decoding: every position the rollout
    fed (each response's last token never is) is captured once at every site,
    and layer 0's K/V, which depend on the token alone, are the codes the
    training path computes (a growth that lost what the cache held would not
    give them)."""
    grown = []
    grow = KVCache.grow
    monkeypatch.setattr(KVCache, "grow", lambda cache, n: grown.append(grow(cache, n)) or grown[-1])
    g = torch.Generator().manual_seed(4)
    batch = [torch.randint(0, 256, (k,), generator=g).tolist() for k in (5, 3, 600, 7, 4)]
    engine = TorchEngine(
        smoke,
        rollout_config("fp4_wa_kv"),
        capture=CaptureConfig(max_tokens=1280),
        max_running_requests=2,
        stop_check_every=1,
    )
    out = engine.generate(batch, SamplingParams(max_new_tokens=8, seed=4, stop_tokens=tuple(range(0, 256, 5))))
    assert any(grown)
    records = engine.drain_capture()
    fed = {(t.id, p) for t in out for p in range(len(t.tokens) - 1)}
    for (layer, site), table in records.tables.items():
        slots = smoke.cfg.top_k if site == "moe_down_in" else 1
        rows = list(zip(table.traj.tolist(), table.pos.tolist(), table.slot.tolist()))
        assert rows == sorted((t, p, s) for t, p in fed for s in range(slots)), (layer, site)
    report = compare(records, teacher_force(engine, out))
    assert report[(0, "k_cache")].mismatched == report[(0, "v_cache")].mismatched == 0
    assert [len(t.response) for t in out][:2] == [4, 8]  # request 1 decoded on as request 2 came


def test_inline_compaction_keeps_low_bits_of_selected_layers(smoke):
    _, _, full = rollout(smoke, CaptureConfig(bits=4), seed=1)
    _, _, r1 = rollout(smoke, CaptureConfig(bits=1, layers=(1,)), seed=1)
    assert {layer for layer, _ in r1.tables} == {1}
    for key, table in r1.tables.items():
        reference = full.tables[key]
        assert torch.equal(table.traj, reference.traj) and torch.equal(table.scales, reference.scales)
        assert torch.equal(table.low_bits(), reference.low_bits() & 1)
        assert table.codes.shape[1] == -(-table.width // 8)  # one bit per element
    assert r1.nbytes < full.nbytes / 4


def test_guidance_from_a_table_guides_rounding(smoke):
    _, _, records = rollout(smoke, CaptureConfig(bits=1), seed=2)
    table = records.tables[(0, "moe_in")]
    rows = torch.arange(5)
    guide = table.guidance(rows)
    assert guide.bits == 1 and guide.shape == (5, table.width) and guide.fmt == "nvfp4"
    values = quantize(torch.randn(5, table.width), "nvfp4", guide=guide)
    assert torch.equal(values.scales.view(torch.uint8), table.scales[rows])


def test_weight_sync_needs_a_drained_capture(smoke):
    engine, _, _ = rollout(smoke, CaptureConfig())
    engine.generate([[1, 2, 3]], SamplingParams(max_new_tokens=2))
    with pytest.raises(RuntimeError, match="drain it before a weight sync"):
        engine.update_weights(build_model("smoke", seed=1).state_dict())
    assert engine.policy_version == 0
    engine.drain_capture()
    engine.update_weights(build_model("smoke", seed=1).state_dict())
    assert engine.policy_version == 1 and not engine.capture.pending()


def test_the_offload_threads_single_thread_stays_its_own(smoke, monkeypatch):
    """The offload thread computes on one thread, and a thread started after a
    capture (the guidance prefetch's, the store writer's) on the process's
    count: torch.set_num_threads sets the count of threads started later too,
    and before, those ran single-threaded after any capture."""
    process = torch.get_num_threads()
    torch.set_num_threads(max(process, 2))  # one thread would not tell them apart
    try:
        offloading, append = [], Capture._append

        def counted(self, *args, **kwargs):  # on the offload thread: each chunk of rows it keeps
            offloading.append(torch.get_num_threads())
            return append(self, *args, **kwargs)

        monkeypatch.setattr(Capture, "_append", counted)
        _, _, records = rollout(smoke, CaptureConfig(max_tokens=80))
        assert records.tables and offloading and set(offloading) == {1}
        later = []
        thread = threading.Thread(target=lambda: later.append(torch.get_num_threads()))
        thread.start()
        thread.join()
        assert later == [torch.get_num_threads()] == [max(process, 2)]
    finally:
        torch.set_num_threads(process)


def test_capture_rejects_bad_configs(smoke):
    with pytest.raises(ValueError, match="capture bits must be 1..4"):
        TorchEngine(smoke, rollout_config("fp4_wa"), capture=CaptureConfig(bits=0))
    engine = TorchEngine(smoke, rollout_config("fp4_wa"), capture=CaptureConfig(max_tokens=8))
    with pytest.raises(ValueError, match="exceeds capture max_tokens=8"):
        engine.generate(prompts(4, 256, longest=12), SamplingParams(max_new_tokens=2))


@pytest.mark.skipif(
    not device.cpu_bf16_native(), reason="no bf16 units: torch's bf16 kernels here sum alike whatever the shape"
)
def test_train_rollout_mismatch_is_rare_present_and_mostly_one_codeword(native_bf16):
    """The phenomenon: the training path (full-sequence forward, same weights,
    RTN) rounds some values to other codewords than the rollout did, where
    the CPU's bf16 kernels sum in an order that depends on the matmul's
    shape. Those of a CPU without bf16 units (torch's own loops, or oneDNN
    capped below them) do not: on the AVX2 stand-in the two paths gave the
    same codes but for a few hundred in the last layer, which MKL's float32
    sums made, and none once MKL ran in its strict mode (``device.MKL_MODE``)."""
    model = build_model("tiny", seed=0)
    engine, out, rollout_codes = rollout(model, CaptureConfig(), n=8, new=16, seed=3)
    report = compare(rollout_codes, teacher_force(engine, out))
    assert set(report) == set(rollout_codes.tables)
    total = sum(m.elements for m in report.values())
    mismatched = sum(m.mismatched for m in report.values())
    one_apart = sum(m.distance[1] for m in report.values())
    for (layer, site), m in report.items():  # every row compared, but for slots training routed elsewhere
        table = rollout_codes.tables[(layer, site)]
        assert m.elements == (table.codes.shape[0] - m.unmatched_rows) * table.width
        assert m.unmatched_rows == 0 or site == "moe_down_in"
        assert m.unmatched_rows < 0.1 * table.codes.shape[0]
    assert 0 < mismatched < 0.5 * total
    assert report[(0, "moe_in")].rate < 0.05  # rare where the paths first diverge
    assert one_apart / mismatched > 0.9
    assert max(m.rate for m in report.values()) > report[(0, "moe_in")].rate  # and amplified with depth


def test_tables_are_in_row_key_order_and_join_on_it(smoke):
    _, _, records = rollout(smoke, CaptureConfig(max_tokens=80))
    for table in records.tables.values():
        rows = list(zip(table.traj.tolist(), table.pos.tolist(), table.slot.tolist()))
        keys = row_key(table.traj, table.pos, table.slot)
        assert rows == sorted(rows) and bool((keys[1:] > keys[:-1]).all())  # one key per row, in drain's order
        some = torch.randperm(len(rows), generator=torch.Generator().manual_seed(0))[: len(rows) // 3].sort().values
        left, right = join_rows(table.select(some), table)  # drain's order is the order join_rows searches in
        assert torch.equal(left, torch.arange(len(some))) and torch.equal(right, some)


def test_row_key_refuses_what_it_cannot_hold(smoke):
    one, zero = torch.ones(1, dtype=torch.long), torch.zeros(1, dtype=torch.long)
    assert row_key(one, one, one) > row_key(one, one, zero) > row_key(one, zero, one) > row_key(zero, one, one)
    with pytest.raises(ValueError, match=f"slot {1 << KEY_SLOT_BITS} does not fit"):
        row_key(one, one, one << KEY_SLOT_BITS)
    with pytest.raises(ValueError, match=f"position {1 << KEY_POS_BITS} does not fit"):
        row_key(one, one << KEY_POS_BITS, one)
    with pytest.raises(ValueError, match="trajectory id -1 does not fit"):
        row_key(-one, one, one)  # padding rows never get a key
    slots = 1 << KEY_SLOT_BITS
    wide = ModelConfig(num_layers=1, num_experts=slots + 1, top_k=slots + 1)
    with pytest.raises(ValueError, match=f"top_k {slots + 1} exceeds the capture row key's {slots} slots"):
        Capture(wide, rollout_config("fp4_wa"), CaptureConfig(), {})


def test_token_map_of_a_padded_batch():
    positions = torch.arange(3).expand(2, 3)
    tokens = TokenMap.of([7, 9], positions, torch.tensor([3, 1]))
    assert tokens.traj.tolist() == [7, 7, 7, 9, -1, -1] and tokens.pos.tolist() == [0, 1, 2, 0, 1, 2]


def test_signed_rank():
    codes = torch.tensor([0, 8, 1, 9, 7, 15], dtype=torch.uint8)
    assert signed_rank(codes).tolist() == [0, 0, 1, -1, 7, -7]


def test_teacher_forcing_in_forwards_of_a_token_budget_captures_what_one_forward_does(smoke):
    """The training path over many trajectories runs in right-padded forwards
    of at most max_tokens token rows (by default the engine's capture
    buffer's): the same rows and codes as one forward of them all."""
    engine, out, _ = rollout(smoke, CaptureConfig(max_tokens=64), n=6, config="fp4_wa_kv")
    assert token_groups([3, 5, 2, 9, 9], 16) == [[0, 1, 2], [3], [4]] and token_groups([3, 5], None) == [[0, 1]]
    whole = teacher_force(engine, out, max_tokens=10_000)
    grouped = teacher_force(engine, out)  # 64 token rows at a time
    assert len(token_groups([len(t.tokens) for t in out], 64)) > 1
    assert whole.tables.keys() == grouped.tables.keys()
    for key, table in whole.tables.items():
        for field in ("traj", "pos", "slot", "codes", "scales"):
            assert torch.equal(getattr(table, field), getattr(grouped.tables[key], field)), (key, field)
