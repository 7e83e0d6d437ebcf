"""The decode loop on CUDA's terms, on the CPU: no device reads between stop
checks, and the CUDA-graph decode (``DecodeGraphs``) with torch.cuda's graph
API emulated here: what a capture records is the list of ops it
dispatched, and a replay runs that list again on the same tensors.

The emulation keeps the contract a real graph holds a step to: a capture
runs nothing (whatever its ops wrote is put back, and what they made holds
garbage until the first replay), no op may read the device (what
tests/device_reads.py counts: ``item``, ``nonzero``, boolean-mask indexing; a
capture error on CUDA, an error here; ``tolist`` dispatches nothing on the CPU
and goes unseen), and a replay sees only what was copied into the captured
tensors. It is not a GPU: it
cannot show that CUDA kernels capture, only that the step's own logic fits a
graph, which is what ``make gpu-check`` then takes to the hardware."""

import contextlib
from dataclasses import replace

import pytest
import torch
from device_reads import DeviceReads, reads_device
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

import tracefp4.components.model as model_module
import tracefp4.components.rollout as rollout_module
import tracefp4.kernels.fp4 as fp4_module
from tracefp4.components.capture import CaptureConfig
from tracefp4.components.model import build_model
from tracefp4.components.quant_config import rollout_config
from tracefp4.components.rollout import DecodeGraphs, SamplingParams, TorchEngine, _Decode


def garbage(t: torch.Tensor) -> None:
    """What memory a capture allocated holds before the first replay."""
    if t.is_floating_point():
        t.fill_(float("nan"))
    elif t.dtype == torch.bool:
        t.fill_(True)
    else:
        t.fill_(torch.iinfo(t.dtype).max)


class EmulatedGraph:
    """``torch.cuda.CUDAGraph`` on the CPU: the recorded ops, rerun in order by :meth:`replay`."""

    def __init__(self):
        self.ops: list[tuple] = []

    def replay(self) -> None:
        for func, args, kwargs, made in self.ops:
            fresh = [t for t in tree_leaves(func(*args, **kwargs)) if isinstance(t, torch.Tensor)]
            for old, new in zip(made, fresh):
                if old is not None:
                    old.copy_(new)


class Capture(TorchDispatchMode):
    """Records every op into ``graph``; undoes, at the end, what the ops wrote."""

    active: "Capture | None" = None

    def __init__(self, graph: EmulatedGraph):
        super().__init__()
        self.graph, self.written = graph, []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if reads_device(func, args):
            raise RuntimeError(f"{func} reads the device inside a CUDA graph capture")
        schema = func._schema
        if any(a.alias_info is not None and a.alias_info.is_write for a in schema.arguments):
            self.written += [(t, t.clone()) for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
        out = func(*args, **kwargs)
        outs = [t for t in tree_leaves(out) if isinstance(t, torch.Tensor)]
        # outputs that share an input's memory (views, in-place results) need no copy at replay. Told by the
        # memory, not the schema: under inference mode composite ops arrive whole, and one whose schema says
        # "may alias" (to, reshape) makes a copy when it must
        inputs = {t.untyped_storage().data_ptr() for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)}
        fresh = [t.untyped_storage().data_ptr() not in inputs for t in outs]
        self.graph.ops.append((func, args, kwargs, [t if f else None for t, f in zip(outs, fresh)]))
        return out

    def __enter__(self):
        Capture.active = self
        return super().__enter__()

    def __exit__(self, *exc):
        super().__exit__(*exc)
        Capture.active = None
        for t, before in reversed(self.written):
            t.copy_(before)
        for _, _, _, made in self.graph.ops:
            for t in made:
                if t is not None:
                    garbage(t)


class Stream:
    def wait_stream(self, other) -> None:
        pass


@contextlib.contextmanager
def graph(g: EmulatedGraph, pool=None):
    with Capture(g):
        yield


@pytest.fixture
def emulated_cuda_graphs(monkeypatch):
    """torch.cuda's graph API as the emulation above, and engines that use it on the CPU."""
    for name, value in {
        "CUDAGraph": EmulatedGraph,
        "graph": graph,
        "graph_pool_handle": lambda: None,
        "Stream": Stream,
        "current_stream": Stream,
        "stream": lambda s: contextlib.nullcontext(),
    }.items():
        monkeypatch.setattr(torch.cuda, name, value)
    for module in (model_module, fp4_module):  # the two places that ask
        monkeypatch.setattr(module, "graph_capturing", lambda x: Capture.active is not None)
    captured = []
    capture = DecodeGraphs._capture
    monkeypatch.setattr(DecodeGraphs, "_capture", lambda self, *a: captured.append(a[0].shape[0]) or capture(self, *a))
    monkeypatch.setattr(TorchEngine, "uses_cuda_graphs", lambda self: self.cuda_graphs and self.capture is None)
    return captured


def test_the_emulation_holds_a_graphs_contract(emulated_cuda_graphs):
    static, state = torch.ones(3), torch.zeros(3)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        out = static * 2
        state.add_(out)
    assert out.isnan().all() and torch.equal(state, torch.zeros(3))  # the capture ran nothing
    static.copy_(torch.full((3,), 5.0))
    g.replay()
    assert torch.equal(out, torch.full((3,), 10.0)) and torch.equal(state, torch.full((3,), 10.0))
    with pytest.raises(RuntimeError, match="reads the device"), torch.cuda.graph(torch.cuda.CUDAGraph()):
        static.sum().item()


def prompts(n: int, vocab: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (int(k),), generator=g).tolist() for k in torch.randint(1, 40, (n,), generator=g)]


@pytest.mark.parametrize(
    "preset, config",
    [("smoke", "bf16"), ("smoke", "fp4_wa_kv"), ("smoke", "fp4_wa_kv/per_token"), ("tiny-qwen35", "bf16")],
)
def test_decode_replayed_from_graphs_gives_the_eager_results(
    emulated_cuda_graphs, native_bf16, preset, config, monkeypatch
):
    """A batch of 12 whose requests stop at different steps: decoding by graph
    replays (one graph per batch bucket, captured over the cache's whole
    length and every expert's room for every row) gives the tokens and
    logprobs of the eager decode, bit for bit; sampling a token reads nothing
    from the device (a replay cannot), so between stop checks nothing does."""
    model = build_model(preset, seed=0)
    name, _, scales = config.partition("/")
    quant = replace(rollout_config(name), activation_global_scale=scales or "static")
    eager = TorchEngine(model, quant, cuda_graphs=False)
    replayed = TorchEngine(model, quant, stop_check_every=4)
    batch = prompts(12, model.cfg.vocab_size, seed=3)
    first = eager.generate(batch, SamplingParams(max_new_tokens=20, seed=1))
    stops = tuple({t.response[i] for t, i in zip(first, (1, 3, 6, 9, 13)) if i < len(t.response)})
    params = SamplingParams(max_new_tokens=20, seed=1, stop_tokens=stops, record_topk=2)
    want = eager.generate(batch, params)
    reads, sample = DeviceReads(watching=True), _Decode.sample

    def counted(self, *args):
        with reads:
            sample(self, *args)

    monkeypatch.setattr(_Decode, "sample", counted)
    snapshots, snapshot = [], rollout_module.KVCache.snapshot_states

    def recorded(self, rows):  # a capture's warm-up keeps the linear-attention states of its bucket's rows alone
        states = snapshot(self, rows)
        snapshots.append({len(t) for t in states})
        return states

    monkeypatch.setattr(rollout_module.KVCache, "snapshot_states", recorded)
    got = replayed.generate(batch, params)
    assert reads.reads == []
    assert len(emulated_cuda_graphs) > 1  # the batch moved to smaller buckets, each captured on first use
    if model.cfg.linear_layers:
        assert snapshots == [{bucket} for bucket in emulated_cuda_graphs]
    assert {t.finish_reason for t in want} == {"stop", "length"}
    assert [(t.response, t.logprobs, t.topk_ids, t.finish_reason) for t in got] == [
        (t.response, t.logprobs, t.topk_ids, t.finish_reason) for t in want
    ]


@pytest.mark.parametrize("config", ["bf16", "fp4_wa_kv"])
def test_a_cache_grown_mid_call_is_decoded_by_graphs_captured_anew(
    emulated_cuda_graphs, native_bf16, config, monkeypatch
):
    """The KV cache doubles while the batch decodes (``KV_HEADROOM`` of one
    position): the graphs, captured on the old tensors, are captured again on
    the new ones, and the replayed decode still gives the eager one's tokens and
    logprobs bit for bit."""
    monkeypatch.setattr(rollout_module, "KV_HEADROOM", 1)
    model = build_model("smoke", seed=0)
    batch = prompts(12, model.cfg.vocab_size, seed=3)  # at most 39 tokens: 64 positions, then 96 (all 79 need)
    params = SamplingParams(max_new_tokens=40, seed=1)
    want = TorchEngine(model, rollout_config(config), cuda_graphs=False).generate(batch, params)
    got = TorchEngine(model, rollout_config(config), stop_check_every=4).generate(batch, params)
    assert emulated_cuda_graphs == [12, 12]
    assert [(t.response, t.logprobs) for t in got] == [(t.response, t.logprobs) for t in want]


@pytest.mark.parametrize("config", ["bf16", "fp4_wa_kv"])
def test_requests_prefilled_between_replays_decode_by_the_same_graph(
    emulated_cuda_graphs, native_bf16, config, monkeypatch
):
    """``max_running_requests`` 5 of 12: waiting requests are prefilled
    (eagerly) into the rows of finished ones between replays of the 5-row
    graph, which reads them from the same cache tensors: the tokens and
    logprobs of the eager decode of one batch of all 12, bit for bit."""
    model = build_model("smoke", seed=0)
    batch = prompts(12, model.cfg.vocab_size, seed=3)
    eager = TorchEngine(model, rollout_config(config), cuda_graphs=False)
    first = eager.generate(batch, SamplingParams(max_new_tokens=20, seed=1))
    stops = tuple({t.response[i] for t, i in zip(first, (1, 3, 6, 9, 13)) if i < len(t.response)})
    params = SamplingParams(max_new_tokens=20, seed=1, stop_tokens=stops)
    want = eager.generate(batch, params)
    got = TorchEngine(model, rollout_config(config), stop_check_every=4, max_running_requests=5).generate(batch, params)
    assert emulated_cuda_graphs[0] == 5 and emulated_cuda_graphs.count(5) == 1  # one graph while requests wait
    assert {t.finish_reason for t in want} == {"stop", "length"}
    assert [(t.response, t.logprobs, t.finish_reason) for t in got] == [
        (t.response, t.logprobs, t.finish_reason) for t in want
    ]


def test_a_capturing_fp4_rollout_reads_the_device_only_at_stop_checks():
    """With capture on there are no graphs, and every decode step runs eagerly:
    still nothing in it reads the device (quantizing under static or
    per-token global scales included), but the CPU's padded expert grid,
    which reads its width where CUDA's ``F.grouped_mm`` reads nothing."""
    reads = DeviceReads(watching=True)
    model = build_model("smoke", seed=0)
    for scales in ("static", "per_token"):
        quant = replace(rollout_config("fp4_wa_kv"), activation_global_scale=scales)
        engine = TorchEngine(model, quant, capture=CaptureConfig(bits=4), stop_check_every=4)
        batch = prompts(12, model.cfg.vocab_size, seed=3)
        with reads:
            out = engine.generate(batch, SamplingParams(max_new_tokens=12, seed=1))
        assert reads.reads == [], scales
        assert engine.drain_capture().nbytes > 0 and len(out) == 12
