"""The rollout engine: sampling, logprobs, batching, FP4 KV cache, weight sync."""

import json
import weakref
from dataclasses import replace
from pathlib import Path

import pytest
import torch

import tracefp4.components.rollout as rollout_module
from tracefp4.components import steps
from tracefp4.components.capture import CaptureConfig
from tracefp4.components.checkpoint import save_model
from tracefp4.components.model import CausalAttention, build_model
from tracefp4.components.quant import QuantSites
from tracefp4.components.quant_config import ACTIVATION_SITES, ROLLOUT_CONFIGS, rollout_config
from tracefp4.components.rollout import (
    KV_SPLIT,
    KVCache,
    SamplingParams,
    TorchEngine,
    batch_buckets,
    bucket_for,
    fillable_length,
    whole_span_blocks,
)
from tracefp4.components.tokenizer import build_tokenizer
from tracefp4.kernels import fake_quantize, reference
from tracefp4.schemas import load_config


@pytest.fixture(scope="module")
def model():
    return build_model("smoke", seed=0)


def prompts(n=5, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 256, (int(k),), generator=g).tolist() for k in torch.randint(1, 12, (n,), generator=g)]


def teacher_forced_logprobs(engine: TorchEngine, traj) -> torch.Tensor:
    tokens = torch.tensor([traj.tokens])
    with torch.no_grad():
        logits = engine.model(
            tokens,
            torch.arange(tokens.shape[1])[None],
            CausalAttention(),
            QuantSites(engine.quant, engine.global_scales),
        )
    logprobs = torch.log_softmax(logits[0, len(traj.prompt) - 1 : -1].float(), -1)
    return logprobs.gather(-1, torch.tensor(traj.response)[:, None])[:, 0]


@pytest.mark.parametrize("config", ["bf16", "fp4_wa_kv"])
def test_logprobs_are_those_of_the_rollout_policy(model, config):
    # float32 compute: the incremental and the full-sequence paths agree to rounding
    engine = TorchEngine(model, rollout_config(config), dtype=torch.float32)
    for traj in engine.generate(prompts(), SamplingParams(max_new_tokens=6, seed=3)):
        assert len(traj.response) == len(traj.logprobs) == 6
        assert torch.allclose(torch.tensor(traj.logprobs), teacher_forced_logprobs(engine, traj), atol=2e-3)


def test_the_prefill_projects_each_prompts_last_position_alone(model):
    """lm_head reads one row per prompt in the prefill (at a 248K vocabulary,
    logits at every prompt position would not fit), and one per row decoding."""
    engine = TorchEngine(model)
    rows = []
    engine.model.lm_head.register_forward_hook(lambda module, args, out: rows.append(tuple(args[0].shape)))
    engine.generate(prompts(), SamplingParams(max_new_tokens=3, seed=0))
    n, hidden = len(prompts()), model.cfg.hidden_size
    assert rows == [(n, hidden), (n, 1, hidden), (n, 1, hidden)]


def test_fp4_rollout_quantizes_in_chunk_workers_under_inference_mode(model, monkeypatch):
    """The CPU quantize hands cache-sized chunks to worker threads, and
    generate runs under inference mode, which is thread-local: the workers take
    it (writing a chunk into a tensor made under it failed outside it, in the
    evaluation's prefill of make run). The same responses as unchunked."""
    engine = TorchEngine(model, rollout_config("fp4_wa_kv"))
    params = SamplingParams(max_new_tokens=3, seed=1)
    whole = engine.generate(prompts(), params)
    threads = torch.get_num_threads()
    monkeypatch.setattr(reference, "CHUNK_ELEMENTS", 64)  # every activation site in several chunks
    torch.set_num_threads(2)  # the workers run when torch has 2 threads or more
    try:
        chunked = engine.generate(prompts(), params)
    finally:
        torch.set_num_threads(threads)
    assert [t.response for t in chunked] == [t.response for t in whole]
    assert [t.logprobs for t in chunked] == [t.logprobs for t in whole]


def test_same_seed_same_samples_and_greedy_is_argmax(model):
    engine = TorchEngine(model)
    a = engine.generate(prompts(), SamplingParams(max_new_tokens=5, seed=11))
    b = engine.generate(prompts(), SamplingParams(max_new_tokens=5, seed=11))
    c = engine.generate(prompts(), SamplingParams(max_new_tokens=5, seed=12))
    assert [t.response for t in a] == [t.response for t in b] != [t.response for t in c]
    greedy = engine.generate(prompts(), SamplingParams(temperature=0, max_new_tokens=5))
    top1 = engine.generate(prompts(), SamplingParams(top_k=1, max_new_tokens=5, seed=5))
    nucleus = engine.generate(prompts(), SamplingParams(top_p=1e-6, max_new_tokens=5, seed=6))
    assert [t.response for t in greedy] == [t.response for t in top1] == [t.response for t in nucleus]


def test_no_two_sampling_passes_of_runs_share_a_seed():
    """Every sampling pass (a rollout step at each policy version, evaluation's
    passes) draws from its own stream, across the seeds of a replicate study
    too: ``seed + version`` gave seed 1 at version v the draws of seed 0 at
    version v + 1."""
    tok = build_tokenizer()
    passes = [("rollout", v) for v in range(20)] + [("evaluate", p) for p in ("greedy", "sampled", "discrepancy")]
    seeds = [
        steps.sampling(load_config(None, preset="smoke", overrides={"seed": s}), tok, *stream).seed
        for s in range(4)
        for stream in passes
    ]
    assert len(set(seeds)) == len(seeds) == 4 * len(passes)


def test_no_request_is_sampled_from_a_scan_of_its_row_alone(model, monkeypatch):
    """On CUDA torch scans a tensor of one row with CUB, in an order that
    changes from run to run (``rollout.row_cumsum``): the sampler's
    cumulative sums, top-p's too, never scan a request's row alone, neither
    in a call of one prompt nor for the request admitted alone into a freed
    row and left running alone at the end (5 requests, 2 at a time)."""
    scanned, cumsum = [], torch.Tensor.cumsum

    def watch(self, *args, **kwargs):
        if self.is_floating_point() and self.shape[-1] == model.cfg.vocab_size:
            scanned.append(self.shape[0])
        return cumsum(self, *args, **kwargs)

    monkeypatch.setattr(torch.Tensor, "cumsum", watch)
    engine = TorchEngine(model, max_running_requests=2)
    params = SamplingParams(max_new_tokens=5, seed=3, top_p=0.9)
    engine.generate(prompts(1), params)
    engine.generate(prompts(5), params)
    assert scanned and 1 not in scanned


def test_stop_tokens_end_requests_and_finished_requests_leave_the_batch(model):
    engine = TorchEngine(model, stop_check_every=1)
    first = engine.generate(prompts(), SamplingParams(temperature=0, max_new_tokens=8))
    stop = first[0].response[2]  # request 0 stops at its third token
    batch_sizes = []
    forward = engine._forward
    engine._forward = lambda tokens, *a, **kw: batch_sizes.append(tokens.shape[0]) or forward(tokens, *a, **kw)
    out = engine.generate(prompts(), SamplingParams(temperature=0, max_new_tokens=8, stop_tokens=(stop,)))
    assert out[0].finish_reason == "stop" and out[0].response == first[0].response[:3]
    assert all(t.finish_reason == "length" or t.response[-1] == stop for t in out)
    assert all(len(t.response) == 8 for t in out if t.finish_reason == "length")
    # the stopped request was dropped: the batch moved to the bucket of 4 rows
    assert batch_sizes[0] == 5 and min(batch_sizes) == 4 and set(batch_sizes) <= set(batch_buckets(5))
    assert sorted(batch_sizes, reverse=True) == batch_sizes


def test_batch_buckets():
    assert batch_buckets(1) == [1] and batch_buckets(2) == [1, 2]
    assert batch_buckets(5) == [1, 2, 4, 5] and batch_buckets(8) == [1, 2, 4, 8]
    assert batch_buckets(128) == [1, 2, 4, 8, 16, 32, 64, 128]
    assert [bucket_for(n, batch_buckets(100)) for n in (1, 3, 33, 64, 65, 100)] == [1, 4, 64, 64, 100, 100]
    with pytest.raises(ValueError, match="at least one request"):
        batch_buckets(0)
    with pytest.raises(ValueError, match="stop_check_every"):
        TorchEngine(build_model("smoke"), stop_check_every=0)


def staggered_stops(engine, params: SamplingParams) -> SamplingParams:
    """``params`` with stop tokens that end ``prompts(12, seed=7)``'s requests at
    different steps: tokens the first eight sample at steps 1 to 13 in a run
    without stops, whose draws those of the run with them repeat."""
    first = engine.generate(prompts(12, seed=7), params)
    stops = {t.response[i] for t, i in zip(first, (1, 2, 3, 5, 7, 9, 11, 13)) if i < len(t.response)}
    return replace(params, stop_tokens=tuple(stops))


@pytest.mark.parametrize("config", ["bf16", "fp4_wa_kv", "fp4_wa_kv/per_token"])
def test_stop_check_interval_changes_nothing(model, config, each_dtype):
    """Checking for stops every 8 tokens (finished rows decode into padding
    meanwhile, the batch moves to a smaller bucket later) gives every token,
    logprob, top-k and captured record of checking every token, per-token
    activation global scales included."""
    name, _, scales = config.partition("/")
    quant = replace(rollout_config(name), activation_global_scale=scales or "static")
    runs = {}
    for every in (1, 3, 8):
        engine = TorchEngine(model, quant, capture=CaptureConfig(bits=4), stop_check_every=every, dtype=each_dtype)
        sizes = []
        forward = engine._forward
        engine._forward = lambda tokens, *a, sizes=sizes, forward=forward, **kw: (
            sizes.append(tokens.shape[0]) or forward(tokens, *a, **kw)
        )
        params = staggered_stops(engine, SamplingParams(max_new_tokens=16, seed=2, top_p=0.95, record_topk=3))
        engine.drain_capture() if engine.capture else None
        sizes.clear()
        out = engine.generate(prompts(12, seed=7), params)
        records = engine.drain_capture() if engine.capture else None
        runs[every] = (out, records, sizes)
    out, records, sizes = runs[1]
    assert {t.finish_reason for t in out} == {"stop", "length"} and len({len(t.response) for t in out}) > 2
    assert min(sizes) < 12  # checking every token, the batch shrank
    for every in (3, 8):
        other, other_records, other_sizes = runs[every]
        assert [(t.response, t.logprobs, t.topk_ids, t.topk_logprobs, t.finish_reason) for t in other] == [
            (t.response, t.logprobs, t.topk_ids, t.topk_logprobs, t.finish_reason) for t in out
        ]
        assert sum(other_sizes) >= sum(sizes) and sum(runs[8][2]) > sum(sizes)  # rows decoded into padding
        if records is not None:
            assert records.tables.keys() == other_records.tables.keys()
            for key, table in records.tables.items():
                mine = other_records.tables[key]
                per_row = scales == "per_token" and key[1] in ACTIVATION_SITES  # KV global scales stay static
                assert (table.row_global_scales is not None) == (mine.row_global_scales is not None) == per_row
                for f in ("traj", "pos", "slot", "expert", "codes", "scales") + ("row_global_scales",) * per_row:
                    assert torch.equal(getattr(table, f), getattr(mine, f)), (every, key, f)


GOLDEN = json.loads((Path(__file__).parent / "golden" / "rollout-trajectories.json").read_text())


@pytest.mark.parametrize("every", [1, 8])
@pytest.mark.parametrize("case", sorted(GOLDEN))
def test_same_trajectories_as_the_engine_before_the_static_cache(case, every):
    """tests/golden/rollout-trajectories.json holds what the engine gave before
    the static cache and stop checks (commit da35dc0: a cache that shrank as
    requests finished, one generator draw per row and step), float32, with
    stop tokens that end rows at different steps: same tokens, finish reasons
    and top-k ids, logprobs to float32 rounding."""
    spec = GOLDEN[case]
    engine = TorchEngine(
        build_model(spec["preset"], seed=0), rollout_config(spec["config"]), dtype=torch.float32, stop_check_every=every
    )
    params = SamplingParams(**{**spec["params"], "stop_tokens": tuple(spec["params"]["stop_tokens"])})
    out = engine.generate(spec["prompts"], params)
    for traj, want in zip(out, spec["trajectories"], strict=True):
        assert (traj.response, traj.finish_reason, traj.topk_ids) == (
            want["response"],
            want["finish_reason"],
            want["topk_ids"],
        )
        assert traj.logprobs == pytest.approx(want["logprobs"], abs=1e-5)


def test_a_request_gives_the_same_bits_whatever_shares_its_batch(model, each_dtype):
    """A longer prompt beside a request widens every step's attention span by
    blocks (``SPAN_BLOCK``): the request's tokens and logprobs stay bit for bit
    those it gets alone (BF16 and FP4 KV)."""
    short, long = prompts(1, seed=5)[0][:3], list(range(1, 80))
    for config in ("bf16", "fp4_wa_kv"):
        engine = TorchEngine(model, rollout_config(config), dtype=each_dtype)
        params = SamplingParams(max_new_tokens=12, seed=9)
        alone = engine.generate([short], params)[0]
        shared = engine.generate([short, long], params)[0]
        assert (shared.response, shared.logprobs) == (alone.response, alone.logprobs), config


def test_a_long_prompt_gives_the_same_bits_beside_a_longer_one(model, each_dtype):
    """A prompt of 200-470 tokens alone, and beside one of 512, which widens
    its span past SDPA's key block of 512: the kernel sums a last block of
    some sizes between 224 and 480 keys in another order than a whole one
    (which, by CPU: ``UNEVEN_KEYS``), so such a span rounds on to the whole
    block and the prompt's bits are those it gets alone."""
    engine = TorchEngine(model, dtype=each_dtype)
    params = SamplingParams(max_new_tokens=2, seed=4, record_topk=4)
    g = torch.Generator().manual_seed(3)
    longer = torch.randint(0, 256, (512,), generator=g).tolist()
    for n in (216, 232, 280, 296, 328, 416, 470):
        prompt = torch.randint(0, 256, (n,), generator=g).tolist()
        alone, beside = engine.generate([prompt], params)[0], engine.generate([prompt, longer], params)[0]
        assert (beside.logprobs, beside.topk_logprobs) == (alone.logprobs, alone.topk_logprobs), n
    assert [whole_span_blocks(n) for n in (192, 193, 224, 352, 383, 385, 480, 700, 737, 1000)] == [
        192, 512, 512, 512, 512, 512, 512, 704, 1024, 1024,
    ]  # fmt: skip


def test_the_cache_is_allocated_once_and_compacted_in_place(model, monkeypatch):
    made = []
    init = KVCache.__init__
    monkeypatch.setattr(KVCache, "__init__", lambda self, *a: made.append(self) or init(self, *a))
    engine = TorchEngine(model, stop_check_every=1)
    params = staggered_stops(engine, SamplingParams(max_new_tokens=16, seed=2))
    made.clear()
    pointers = None
    compact = KVCache.compact

    def watch(self, rows, active):
        nonlocal pointers
        pointers = pointers or [t.data_ptr() for t in self.store.values()]
        compact(self, rows, active)
        assert [t.data_ptr() for t in self.store.values()] == pointers and self.active == active

    monkeypatch.setattr(KVCache, "compact", watch)
    engine.generate(prompts(12, seed=7), params)
    assert len(made) == 1 and pointers is not None


@pytest.mark.parametrize("config", ["bf16", "fp4_wa_kv"])
def test_the_cache_grows_as_decoding_needs_and_changes_nothing(model, config, monkeypatch, each_dtype):
    """A cache that starts one span block past the prompts and doubles as
    decoding needs more (``KV_HEADROOM``) gives every token, logprob and
    captured record of one that holds the whole call from the start, requests
    finishing and the batch compacting between growths; and a call whose
    responses all stop early never holds room for ``max_new_tokens``."""
    lengths, grow = [], KVCache.grow
    monkeypatch.setattr(KVCache, "grow", lambda self, n: grow(self, n) and not lengths.append(self.length))
    runs = {}
    for headroom in (1, 1000):
        monkeypatch.setattr(rollout_module, "KV_HEADROOM", headroom)
        engine = TorchEngine(
            model, rollout_config(config), capture=CaptureConfig(bits=4), stop_check_every=4, dtype=each_dtype
        )
        params = staggered_stops(engine, SamplingParams(max_new_tokens=60, seed=2))
        engine.drain_capture() if engine.capture else None
        lengths.clear()
        out = engine.generate(prompts(12, seed=7), params)
        runs[headroom] = (out, engine.drain_capture() if engine.capture else None, list(lengths))
    (out, records, grown), (whole, whole_records, none) = runs[1], runs[1000]
    assert grown == [64, 96] and none == []  # prompts of at most 11 tokens: 32 positions, then 64, then 96
    assert {t.finish_reason for t in out} == {"stop", "length"}
    assert [(t.response, t.logprobs, t.finish_reason) for t in out] == [
        (t.response, t.logprobs, t.finish_reason) for t in whole
    ]
    tables = records.tables if records else {}  # bf16 captures nothing
    assert tables.keys() == (whole_records.tables.keys() if whole_records else set())
    for key, table in tables.items():
        for f in ("traj", "pos", "slot", "expert", "codes", "scales"):
            assert torch.equal(getattr(table, f), getattr(whole_records.tables[key], f)), (key, f)

    monkeypatch.setattr(rollout_module, "KV_HEADROOM", 1)
    held, start = [], KVCache.start
    monkeypatch.setattr(KVCache, "start", lambda self, *a, **kw: held.append(self.length) or start(self, *a, **kw))
    early = SamplingParams(max_new_tokens=2000, seed=2, stop_tokens=tuple(range(0, 256, 2)))
    out = TorchEngine(model, rollout_config(config), dtype=each_dtype).generate(prompts(12, seed=7), early)
    assert all(t.finish_reason == "stop" for t in out)
    assert max(held) < 2000 // 8  # half the vocab stops: every response ends within a few dozen tokens


def forward_sizes(engine: TorchEngine) -> list[tuple[str, int]]:
    """Each forward of ``engine`` from now on, as (prefill | decode, rows)."""
    sizes = []
    for kind in ("prefill", "decode"):
        forward = getattr(engine, f"_{kind}")
        setattr(engine, f"_{kind}", lambda t, *a, kind=kind, f=forward: sizes.append((kind, len(t))) or f(t, *a))
    return sizes


@pytest.mark.parametrize("config", ["bf16", "fp4_wa_kv"])
def test_waiting_requests_take_the_rows_of_finished_ones(model, config, each_dtype):
    """``max_running_requests`` 4 of 12 requests that stop at different steps:
    at stop checks the requests that finished give their rows to waiting
    ones, prefilled there while the others decode on; the batch keeps 4 rows
    while any request waits. Every response, logprob and captured record is
    that of one batch of all 12, whatever the check interval."""
    batch = prompts(12, seed=7)
    runs = {}
    for bound, every in ((0, 1), (4, 1), (4, 3)):
        engine = TorchEngine(
            model,
            rollout_config(config),
            capture=CaptureConfig(bits=4),
            stop_check_every=every,
            max_running_requests=bound,
            dtype=each_dtype,
        )
        params = staggered_stops(engine, SamplingParams(max_new_tokens=16, seed=2, top_p=0.9, record_topk=2))
        engine.drain_capture() if engine.capture else None
        sizes = forward_sizes(engine)
        out = engine.generate(batch, params)
        runs[bound, every] = out, engine.drain_capture() if engine.capture else None, sizes
    whole, records, _ = runs[0, 1]
    assert {t.finish_reason for t in whole} == {"stop", "length"} and len({len(t.response) for t in whole}) > 2
    for key in ((4, 1), (4, 3)):
        out, other_records, sizes = runs[key]
        assert [(t.id, t.response, t.logprobs, t.topk_ids, t.finish_reason) for t in out] == [
            (t.id, t.response, t.logprobs, t.topk_ids, t.finish_reason) for t in whole
        ], key
        prefills = [n for kind, n in sizes if kind == "prefill"]
        assert prefills[0] == 4 and sum(prefills) == 12 and len(prefills) > 3, (key, prefills)  # refills, not waves
        last_prefill = max(i for i, (kind, _) in enumerate(sizes) if kind == "prefill")
        assert {n for kind, n in sizes[:last_prefill] if kind == "decode"} == {4}, key
        if records is not None:
            assert records.tables.keys() == other_records.tables.keys()
            for name, table in records.tables.items():
                for f in ("traj", "pos", "slot", "expert", "codes", "scales"):
                    assert torch.equal(getattr(table, f), getattr(other_records.tables[name], f)), (key, name, f)


def test_one_new_token_each_with_requests_waiting(model, each_dtype):
    """``max_new_tokens`` 1: every admitted request is done at once, and the waiting ones take its rows at once."""
    params = SamplingParams(max_new_tokens=1, seed=4)
    whole = TorchEngine(model, dtype=each_dtype).generate(prompts(7), params)
    engine = TorchEngine(model, max_running_requests=3, dtype=each_dtype)
    sizes = forward_sizes(engine)
    out = engine.generate(prompts(7), params)
    assert [(t.response, t.logprobs, t.finish_reason) for t in out] == [
        (t.response, t.logprobs, t.finish_reason) for t in whole
    ]
    assert sizes == [("prefill", 3), ("prefill", 3), ("prefill", 1)]  # no decode step


def test_a_cache_the_device_has_no_room_to_double_grows_as_far_as_there_is_room_or_says_what_sizes_it(
    model, monkeypatch
):
    """On CUDA the cache asks the device for room before it grows (the probe is
    faked here: on the CPU it says nothing): doubling where it fits, else as
    far as there is room (in whole span blocks; growing by a block at a time
    would copy the whole cache every 32 decode steps), else, where that is
    short of the positions needed, a KVCacheFull naming the settings."""
    engine = TorchEngine(model)
    cache = rollout_module.KVCache(model.cfg, 4, 4096, engine.sites, torch.bfloat16, "cpu", length=64)
    per_position = sum(t.nbytes // t.shape[2] for t in cache.store.values())

    def more(length: int) -> int:  # a key's old tensor lives until its new one is filled
        return (length - cache.length) * per_position + max(t.nbytes for t in cache.store.values())

    room = {"bytes": None}
    monkeypatch.setattr(rollout_module, "free_bytes", lambda device: room["bytes"])
    assert cache.grow(65) and cache.length == 128  # the CPU: no probe, doubled
    room["bytes"] = more(256)
    assert cache.grow(129) and cache.length == 192  # the doubling fits: 256, down to what spans fill
    room["bytes"] = more(512)
    assert cache.grow(193) and cache.length == 512  # 193 positions need 512 (whole_span_blocks)
    room["bytes"] = more(704)
    assert cache.grow(513) and cache.length == 704  # as far as there is room for: 513 positions need 544
    room["bytes"] = more(704 + 31)
    with pytest.raises(rollout_module.KVCacheFull, match="4 rows cannot grow to 705 .* 704 positions fit, 0.00 GiB"):
        cache.grow(705)
    assert cache.length == 704
    # the room counted: an old tensor goes once its key's new one is filled, so beside the new tensors only the
    # olds of the key being grown and of those not grown yet live (holding every old one took twice the room)
    olds = [weakref.ref(t) for t in cache.store.values()]
    alive, new_zeros = [], torch.Tensor.new_zeros
    monkeypatch.setattr(
        torch.Tensor,
        "new_zeros",
        lambda *a, **kw: alive.append(sum(r() is not None for r in olds)) or new_zeros(*a, **kw),
    )
    room["bytes"] = None
    assert cache.grow(705) and alive == list(range(len(olds), 0, -1))
    assert cache.length == 1216  # doubled to 1,408, whose spans from 1,217 on would read 1,536: down to 1,216


def test_a_cache_grows_to_lengths_its_spans_fill(model):
    """A span reads whole 32-position blocks, and the whole 512-key block
    where more than UNEVEN_KEYS of it are read: a cache doubled from 640 to
    1,280 positions took a span of 1,217 to 1,536 and refused it, mid-generate
    (a prompt of 360 tokens and 900 new ones). Grown caches stop at lengths
    their spans fill."""
    assert all(
        whole_span_blocks(fillable_length(n)) == fillable_length(n) <= n < fillable_length(n) + KV_SPLIT
        for n in range(32, 5000)
    )
    engine = TorchEngine(model)
    prompt = torch.randint(0, 256, (360,), generator=torch.Generator().manual_seed(0)).tolist()
    (out,) = engine.generate([prompt], SamplingParams(max_new_tokens=900, seed=0, stop_tokens=[]))
    assert len(out.response) == 900


def test_a_retired_row_that_no_request_takes_never_outgrows_the_cache(model, each_dtype):
    """Four rows, eleven requests of 16 tokens, admitted at steps 0, 15 and
    30: the eighth request (11 prompt tokens, row 3) retires at step 30 with
    three requests left for four rows, so its row decodes into padding until
    they end at step 45. From its own end it would reach position 42 of a
    cache that holds 32 (the longest prompt and 16 tokens, in whole span
    blocks); it restarts from position 0 instead."""
    batch = [list(range(11)), [1], [2], [4], [5], [6], [7], list(range(20, 31)), [8], [9], [10]]
    params = SamplingParams(temperature=0, max_new_tokens=16)
    whole = TorchEngine(model, dtype=each_dtype).generate(batch, params)
    engine = TorchEngine(model, max_running_requests=4, stop_check_every=1, dtype=each_dtype)
    sizes = forward_sizes(engine)
    out = engine.generate(batch, params)
    assert [(t.response, t.logprobs) for t in out] == [(t.response, t.logprobs) for t in whole]
    assert all(t.finish_reason == "length" for t in out)
    assert [n for kind, n in sizes if kind == "prefill"] == [4, 4, 3] and sizes[-1] == ("decode", 4)
    assert engine.decode_steps == 45  # three rounds of 15 decode steps (each request's first token: its prefill)


@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4"])
@pytest.mark.parametrize("config", ROLLOUT_CONFIGS)
def test_every_rollout_config_runs(model, config, fmt):
    out = TorchEngine(model, rollout_config(config, fmt)).generate(prompts(3), SamplingParams(max_new_tokens=3))
    assert all(len(t.response) == 3 for t in out)


def test_activations_without_a_finite_range_stop_the_calibration():
    """A policy whose activations hold NaN gets no static NVFP4 scale: the
    engine stops at calibration and names the sites (quantizing never checks
    the scales again, since on CUDA a check is a host sync)."""
    broken = build_model("smoke", seed=0)
    with torch.no_grad():
        broken.model.embed_tokens.weight[3] = float("nan")
    with pytest.raises(ValueError, match=r"NaN or Inf at \(layer, site\) \[\(0, 'k_cache'\)"):
        TorchEngine(broken, rollout_config("fp4_wa_kv"))


def test_kv_cache_bytes(model):
    bf16 = TorchEngine(model).kv_bytes_per_token()
    cfg = model.cfg
    assert bf16 == cfg.num_layers * 2 * cfg.num_kv_heads * cfg.head_dim * 2
    assert TorchEngine(model, rollout_config("fp4_kv", "nvfp4")).kv_bytes_per_token() / bf16 == pytest.approx(0.28125)
    assert TorchEngine(model, rollout_config("fp4_kv", "mxfp4")).kv_bytes_per_token() / bf16 == pytest.approx(0.265625)


def test_fp4_weights_are_on_the_fp4_grid(model):
    engine = TorchEngine(model, rollout_config("fp4_wa", "nvfp4"), dtype=torch.float32)
    w = engine.model.moe_blocks()[0].experts.gate_up[0]
    assert not torch.equal(w, model.moe_blocks()[0].experts.gate_up[0])
    assert torch.equal(fake_quantize(w.T, "nvfp4").T, w)  # re-quantizing FP4 values changes nothing


def test_weight_sync_from_state_dict_and_checkpoint(model, tmp_path):
    engine = TorchEngine(model, rollout_config("fp4_wa", "nvfp4"))
    before = engine.generate(prompts(), SamplingParams(temperature=0, max_new_tokens=4))
    other = build_model("smoke", seed=1)
    engine.update_weights(other.state_dict())
    assert engine.policy_version == 1
    synced = engine.generate(prompts(), SamplingParams(temperature=0, max_new_tokens=4))
    fresh = TorchEngine(other, rollout_config("fp4_wa", "nvfp4")).generate(
        prompts(), SamplingParams(temperature=0, max_new_tokens=4)
    )
    assert [t.response for t in synced] == [t.response for t in fresh] != [t.response for t in before]
    save_model(model, tmp_path / "back")
    engine.update_weights(tmp_path / "back")
    assert engine.policy_version == 2
    assert [t.response for t in engine.generate(prompts(), SamplingParams(temperature=0, max_new_tokens=4))] == [
        t.response for t in before
    ]


def test_an_engine_takes_a_handed_over_model_itself_and_copies_any_other(model):
    """``take``: the engine runs on the caller's model (its tensors, cast and
    quantized in place), with the same results as on a copy; without it the
    caller's model keeps its dtype and weights through quantization and a weight sync."""
    quant, greedy = rollout_config("fp4_wa", "nvfp4"), SamplingParams(temperature=0, max_new_tokens=4)
    handed = build_model("smoke", seed=0, dtype=torch.bfloat16)
    storage = [p.data_ptr() for p in handed.parameters()]
    taken = TorchEngine(handed, quant, take=True)
    assert taken.model is handed and [p.data_ptr() for p in taken.model.parameters()] == storage
    before = {k: v.clone() for k, v in model.state_dict().items()}
    copying = TorchEngine(model, quant)
    assert not {p.data_ptr() for p in copying.model.parameters()} & {p.data_ptr() for p in model.parameters()}
    assert [t.response for t in taken.generate(prompts(), greedy)] == [
        t.response for t in copying.generate(prompts(), greedy)
    ]
    copying.update_weights(build_model("smoke", seed=1).state_dict())
    assert {p.dtype for p in model.parameters()} == {torch.float32}
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())


def test_a_copy_for_another_device_is_written_there_not_first_where_the_model_lies(model, monkeypatch):
    """No whole copy beside the model before the move (on a GPU's host: a second host copy of the policy)."""

    def refuse(tensor, memo):
        raise AssertionError("a tensor was deep-copied where it lies")

    monkeypatch.setattr(torch.Tensor, "__deepcopy__", refuse)
    monkeypatch.setattr(torch.nn.Parameter, "__deepcopy__", refuse)
    moved = rollout_module.copied(model, torch.device("meta"), torch.bfloat16)
    assert {(p.device.type, p.dtype) for p in moved.parameters()} == {("meta", torch.bfloat16)}
    assert {(p.device.type, p.dtype) for p in model.parameters()} == {("cpu", torch.float32)}


def test_bad_requests(model):
    engine = TorchEngine(model)
    with pytest.raises(ValueError, match="at least one token"):
        engine.generate([[1], []], SamplingParams())
    with pytest.raises(ValueError, match=r"\[0, 256\)"):
        engine.generate([[1, 999]], SamplingParams())
    with pytest.raises(ValueError, match=r"pad_token 256 must lie in \[0, 256\)"):  # even where no row is padded
        engine.generate([[1, 2]], SamplingParams(pad_token=256))
    with pytest.raises(ValueError, match="invalid sampling parameters"):
        SamplingParams(top_p=0)
    with pytest.raises(ValueError, match="invalid sampling parameters"):  # failed in sample() before
        SamplingParams(temperature=float("nan"))
    with pytest.raises(ValueError, match="record_topk 257 exceeds the vocabulary's 256 tokens"):
        engine.generate([[1, 2]], SamplingParams(record_topk=257))
    with pytest.raises(RuntimeError, match="captures nothing"):
        engine.drain_capture()


def test_residual_activation_compensation_brings_fp4_closer_to_bf16(model):
    x = torch.randn(32, 64) * torch.linspace(0.1, 5.0, 64)  # some channels far larger than others
    scale = {(0, "moe_in"): torch.tensor(0.01)}
    plain = QuantSites(rollout_config("fp4_wa"), scale)
    compensated = QuantSites(replace(rollout_config("fp4_wa"), compensated_channels=8), scale)
    err_plain = (plain.moe_in(0, x) - x).abs()
    err_comp = (compensated.moe_in(0, x) - x).abs()
    assert ((err_comp == 0).sum(1) >= 8).all() and err_comp.sum() < err_plain.sum()
    # each row's own channels: a row comes out the same whatever else is in its forward
    assert torch.equal(compensated.moe_in(0, x[:1]), compensated.moe_in(0, x)[:1])
    out = TorchEngine(model, replace(rollout_config("fp4_wa"), compensated_channels=4)).generate(
        [[1, 2]], SamplingParams(max_new_tokens=2)
    )
    assert len(out[0].response) == 2


@pytest.fixture(scope="module")
def hybrid():
    """Qwen3.5-MoE: 3 Gated DeltaNet layers and 1 gated full-attention layer."""
    return build_model("tiny-qwen35", seed=0)


def long_prompts(n=4, seed=0):
    g = torch.Generator().manual_seed(seed)
    lengths = [1, 3, 70, 90][:n]  # the long ones take two chunks of the chunked prefill
    return [torch.randint(0, 512, (k,), generator=g).tolist() for k in lengths]


@pytest.mark.parametrize("config", ["bf16", "fp4_wa_kv"])
def test_hybrid_prefill_and_decode_equal_a_full_forward(hybrid, config):
    """Right-padded chunked prefill, then recurrent decode steps from each
    sequence's conv and recurrent state, while finished rows leave the batch:
    the logprobs are those of one full-sequence forward (fp32)."""
    engine = TorchEngine(hybrid, rollout_config(config), dtype=torch.float32)
    first = engine.generate(long_prompts(), SamplingParams(temperature=0, max_new_tokens=6))
    stop = first[1].response[1]  # request 1 stops after two tokens: the batch shrinks mid-way
    out = engine.generate(long_prompts(), SamplingParams(temperature=0, max_new_tokens=6, stop_tokens=(stop,)))
    assert out[1].finish_reason == "stop" and any(t.finish_reason == "length" for t in out)
    for traj in out:
        expected = teacher_forced_logprobs(engine, traj)
        assert torch.allclose(torch.tensor(traj.logprobs), expected, atol=1e-4), (traj.id, traj.logprobs, expected)


def test_a_prefill_runs_the_chunked_delta_rule_whatever_its_length(hybrid, monkeypatch):
    """A one-token prompt's prefill runs the chunked delta rule, as a longer
    prompt's does, and decode steps the recurrent one: the two forms sum in
    other orders, and a one-token prompt beside longer ones is chunked, so
    its bits would otherwise move with the prompts beside it."""
    forms = []
    for name in ("chunked_delta_rule", "recurrent_delta_rule"):
        rule = getattr(rollout_module, name)
        monkeypatch.setattr(
            rollout_module, name, lambda *a, rule=rule, name=name: forms.append((name, a[0].shape[1])) or rule(*a)
        )
    TorchEngine(hybrid, rollout_config("bf16")).generate([[5]], SamplingParams(max_new_tokens=3))
    linear_layers = len(hybrid.cfg.linear_layers)
    assert forms[:linear_layers] == [("chunked_delta_rule", 1)] * linear_layers
    assert forms[linear_layers:] and set(forms[linear_layers:]) == {("recurrent_delta_rule", 1)}


def test_hybrid_requests_that_take_finished_rows_start_from_clean_states(hybrid):
    """Two rows, eight requests on the hybrid: each waiting request takes the
    row of a finished one with its conv and recurrent states cleared, so its
    logprobs are those of one full-sequence forward (fp32), which no stale
    state could give. That they are the bits of one batch of all eight is
    ``-k refilled_rows``."""
    engine = TorchEngine(hybrid, dtype=torch.float32, max_running_requests=2, stop_check_every=2)
    batch = long_prompts() + prompts(4, seed=3)
    first = engine.generate(batch, SamplingParams(max_new_tokens=8, seed=1))
    stops = tuple({t.response[i] for t, i in zip(first, (1, 3, 5)) if i < len(t.response)})
    out = engine.generate(batch, SamplingParams(max_new_tokens=8, seed=1, stop_tokens=stops))
    assert {t.finish_reason for t in out} == {"stop", "length"}
    for traj in out:
        expected = teacher_forced_logprobs(engine, traj)
        assert torch.allclose(torch.tensor(traj.logprobs), expected, atol=1e-4), (traj.id, traj.logprobs, expected)


def test_hybrid_requests_in_refilled_rows_get_the_bits_of_one_batch(hybrid, each_dtype):
    """FP4 activations on the hybrid (bf16), eight requests on 1, 2 and 3 rows:
    every response and logprob is that of one batch of all eight. The decay
    gate's softplus and the write strength's sigmoid are size-independent
    (``device.size_independent``); with float32's own softplus the first
    request's logprobs moved with the rows here, on the CPU it was written on."""
    batch = long_prompts() + prompts(4, seed=5)
    params = SamplingParams(max_new_tokens=16, seed=2)
    whole = TorchEngine(hybrid, rollout_config("fp4_wa"), dtype=each_dtype).generate(batch, params)
    for rows in (1, 2, 3):
        engine = TorchEngine(
            hybrid, rollout_config("fp4_wa"), max_running_requests=rows, stop_check_every=2, dtype=each_dtype
        )
        out = engine.generate(batch, params)
        assert [(t.response, t.logprobs) for t in out] == [(t.response, t.logprobs) for t in whole], rows


def test_hybrid_requests_keep_their_bits_in_a_float32_batch_of_48(hybrid):
    """float32 (the schema's default ``model.dtype``) with FP4 activations and
    KV on the hybrid: 48 requests of 1-69 prompt tokens (prefills of 2-3,
    33-35 and 65-67 queries among those the batches make) give the same bits
    in one batch as on 5 and on 16 rows, and greedy, each alone (alone, a
    request is the first of its call, so its sampling seed would differ).
    Failed without ``device.batch_invariant``'s float32 blocks."""
    g = torch.Generator().manual_seed(0)
    batch = [torch.randint(1, 512, (int(n),), generator=g).tolist() for n in torch.randint(1, 70, (48,), generator=g)]

    def roll(requests, temperature, **kw):
        engine = TorchEngine(hybrid, rollout_config("fp4_wa_kv"), dtype=torch.float32, **kw)
        params = SamplingParams(max_new_tokens=24, seed=3, temperature=temperature)
        return [(t.response, t.logprobs) for t in engine.generate(requests, params)]

    sampled = roll(batch, 1.0)
    for rows in (5, 16):
        assert roll(batch, 1.0, max_running_requests=rows, stop_check_every=3) == sampled, rows
    assert [roll([p], 0.0)[0] for p in batch[:12]] == roll(batch[:12], 0.0)


def test_hybrid_state_is_constant_per_sequence_and_kv_only_on_full_attention(hybrid):
    from tracefp4.components.rollout import KVCache

    engine = TorchEngine(hybrid)
    cfg = hybrid.cfg
    assert engine.kv_bytes_per_token() == len(cfg.attention_layers) * 2 * cfg.num_kv_heads * cfg.head_dim * 2
    short, long = (KVCache(cfg, 1, n, engine.sites, torch.bfloat16, "cpu") for n in (8, 4096))
    assert short.state_bytes_per_sequence() == long.state_bytes_per_sequence() > 0
    assert {layer for layer, _, _ in long.store} == set(cfg.attention_layers) == {3}


@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4"])
def test_hybrid_fp4_rollout_captures_kv_of_full_attention_layers_only(hybrid, fmt):
    engine = TorchEngine(hybrid, rollout_config("fp4_wa_kv", fmt), capture=CaptureConfig(bits=4))
    out = engine.generate(long_prompts(3), SamplingParams(max_new_tokens=4, seed=1))
    records = engine.drain_capture()
    kv_layers = {layer for layer, site in records.tables if site in ("k_cache", "v_cache")}
    moe_layers = {layer for layer, site in records.tables if site == "moe_in"}
    assert kv_layers == {3} and moe_layers == {0, 1, 2, 3}
    positions = sum(len(t.tokens) - 1 for t in out)
    assert len(records.tables[(3, "k_cache")].traj) == positions
