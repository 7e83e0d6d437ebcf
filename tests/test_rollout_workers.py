"""Rollout workers: a round's prompts split over N workers, each with its own
engine and capture shards, give the trajectories one worker gives (each
response is numbered and seeded by its place in the round), and compaction
reads every worker's shards."""

import pytest

from tracefp4.components import evaluation, steps
from tracefp4.components.guidance import GuidanceError, merge_steps, read_manifest
from tracefp4.components.rollout import TorchEngine
from tracefp4.components.store import open_store
from tracefp4.schemas import RunConfig, get_preset

RUN = "run-w"


def config(tmp_path, workers: int, dtype: str = "bfloat16", **guidance) -> RunConfig:
    data = get_preset("smoke").model_dump()
    data["store"]["uri"] = (tmp_path / f"store-{workers}").as_uri()
    data["model"]["dtype"] = dtype
    data["rollout"].update(workers=workers, prompts_per_step=3)  # 6 responses per step: uneven over 4 workers
    data["rl"].update(microbatch_size=2, steps_per_round=2, schedule="off_policy")
    data["guidance"].update(guidance)
    data["bootstrap"]["enabled"] = False
    return RunConfig.model_validate(data)


@pytest.fixture(scope="module")
def policy(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("workers")
    steps.prepare(config(tmp, 1), tmp / "policy", RUN)
    return tmp / "policy"


def roll(tmp_path, policy, workers: int, dtype: str = "bfloat16", **guidance):
    c = config(tmp_path, workers, dtype, **guidance)
    if workers == 1:
        stats = steps.rollout(c, policy, 0, tmp_path / "one.jsonl", RUN)
        return c, tmp_path / "one.jsonl", stats
    parts = [tmp_path / f"part-{w}.jsonl" for w in range(workers)]
    part_stats = [steps.rollout(c, policy, 0, part, RUN, worker=w) for w, part in enumerate(parts)]
    stats = steps.gather(c, parts[::-1], part_stats[::-1], 0, tmp_path / "all.jsonl", RUN)  # any order
    return c, tmp_path / "all.jsonl", stats


@pytest.mark.parametrize("compaction, dtype", [("inline", "bfloat16"), ("offline", "bfloat16"), ("inline", "float32")])
def test_four_workers_roll_out_what_one_does_and_compaction_reads_all_their_shards(tmp_path, policy, compaction, dtype):
    c1, one, _ = roll(tmp_path, policy, 1, dtype, compaction=compaction)
    c4, four, stats = roll(tmp_path, policy, 4, dtype, compaction=compaction)
    _, a, pa = steps.read_trajectories(one, RUN, 0)
    _, b, pb = steps.read_trajectories(four, RUN, 0)
    assert len(a) == 12 and a == b and pa == pb  # ids, tokens, log-probs (exact), problems
    assert stats["rollout_tokens"] == sum(len(t.response) for t in a)
    # every worker wrote its own shards; compaction's step lists all of them, none copied
    store = open_store(c4.store.uri)
    kind = "guidance" if compaction == "inline" else "capture"
    for w in range(4):
        assert read_manifest(store, 0, steps.worker_prefix(steps.store_prefix(c4, RUN, kind), c4, w))["shards"]
    ref1, s1 = steps.compaction(c1, policy, one, 0, RUN)
    ref4, s4 = steps.compaction(c4, policy, four, 0, RUN)
    assert (ref4.layers, ref4.sites, s4["guidance_bytes"]) == (ref1.layers, ref1.sites, s1["guidance_bytes"])
    merged = read_manifest(store, 0, steps.store_prefix(c4, RUN, kind))
    assert sorted(t for e in merged["shards"] for t in e["trajectories"]) == list(range(12))
    assert any("/worker-003/" in e["key"] for e in merged["shards"])
    loader = ref4.loader(store, [[t.id for t in b[:6]], [t.id for t in b[6:]]])
    assert [len(mb.trajectories) for mb in loader] == [6, 6] and loader.fallback_trajectories == 0


def test_a_missing_or_mismatched_worker_is_refused(tmp_path, policy):
    c, _, _ = roll(tmp_path, policy, 2)
    store = open_store(c.store.uri)
    kind = steps.store_prefix(c, RUN, "guidance")
    sources = [steps.worker_prefix(kind, c, w) for w in range(2)]
    with pytest.raises(GuidanceError, match="no manifest"):
        merge_steps(store, 0, sources + [f"{kind}/worker-002"], kind)
    with pytest.raises(GuidanceError, match="appears in two sources"):
        merge_steps(store, 0, [sources[0], sources[0]], kind)
    with pytest.raises(steps.RunMismatch, match="expected 0..11 once each"):
        steps.gather(
            c, [tmp_path / "part-0.jsonl"], [{"rollout_seconds": 1, "rollout_tokens": 1}], 0, tmp_path / "x", RUN
        )


def test_a_retried_worker_takes_the_merged_step_with_its_own(tmp_path, policy, monkeypatch):
    """Compaction's merged step lists every worker's shards. A worker retried
    after it (its task's retry, or the run's) deleted its own manifest before
    rewriting its shards, but not the merged one, which went on vouching for
    shards being rewritten: a reader failed on their checksums. The merged
    step is missing now until compaction merges the workers' steps again."""
    c, gathered, _ = roll(tmp_path, policy, 2)
    steps.compaction(c, policy, gathered, 0, RUN)
    store, kind = open_store(c.store.uri), steps.store_prefix(c, RUN, "guidance")
    assert read_manifest(store, 0, kind)["shards"]

    def killed(*args, **kwargs):
        raise RuntimeError("killed")

    with monkeypatch.context() as patch:
        patch.setattr(TorchEngine, "generate", killed)
        with pytest.raises(RuntimeError, match="killed"):
            steps.rollout(c, policy, 0, tmp_path / "part-1.jsonl", RUN, worker=1)
    for prefix in (kind, steps.worker_prefix(kind, c, 1)):
        with pytest.raises(GuidanceError, match="no manifest, so step 0 is missing"):
            read_manifest(store, 0, prefix)
    steps.rollout(c, policy, 0, tmp_path / "part-1.jsonl", RUN, worker=1)
    steps.compaction(c, policy, gathered, 0, RUN)
    assert sorted(t for e in read_manifest(store, 0, kind)["shards"] for t in e["trajectories"]) == list(range(12))


def test_more_workers_than_responses_are_refused_by_the_schema(tmp_path):
    data = config(tmp_path, 1).model_dump()
    data["rollout"]["workers"] = 7
    with pytest.raises(ValueError, match="a worker would have none"):
        RunConfig.model_validate(data)


def test_a_worker_rolls_out_at_most_max_running_requests_at_once(tmp_path, policy, monkeypatch):
    """``rollout.max_running_requests`` reaches the engine: an RL step's 6
    responses are prefilled 4 and then 2 at a time (tests/test_capture.py shows
    the bounded call gives the responses and capture of one call)."""
    prefilled, prefill = [], TorchEngine._prefill
    monkeypatch.setattr(
        TorchEngine, "_prefill", lambda self, tokens, *a: prefilled.append(len(tokens)) or prefill(self, tokens, *a)
    )
    c = config(tmp_path, 1)
    steps.rollout(c, policy, 0, tmp_path / "whole.jsonl", RUN)
    assert prefilled == [6, 6]
    prefilled.clear()
    bounded = c.model_copy(update={"rollout": c.rollout.model_copy(update={"max_running_requests": 4})})
    steps.rollout(bounded, policy, 0, tmp_path / "bounded.jsonl", RUN)
    assert prefilled == [4, 2, 4, 2]


def test_the_rollout_writes_each_shard_once_its_trajectories_finish(tmp_path, policy, monkeypatch):
    """Not a round's capture held at once (at the paper's scale, terabytes on
    the host), nor an RL step's: the shards whose trajectories all finished go
    to the store from a stop check of the generate call, once they hold as
    many trajectories as run at once (2 here); offline compaction reads and
    writes the round shard by shard."""
    added, add = [], steps.StepWriter.add
    monkeypatch.setattr(
        steps.StepWriter, "add", lambda self, records: added.append(_trajectories(records)) or add(self, records)
    )
    generating, generate = [], TorchEngine.generate
    monkeypatch.setattr(TorchEngine, "generate", lambda *a, **kw: generating.append(len(added)) or generate(*a, **kw))
    c = config(tmp_path, 1, compaction="offline")
    c = c.model_copy(update={"rollout": c.rollout.model_copy(update={"max_running_requests": 2})})
    steps.rollout(c, policy, 0, tmp_path / "one.jsonl", RUN)
    # steps_per_round 2 of 6 responses, 2 at a time, trajectories_per_shard 2: written as the calls run
    assert generating[0] == 0 and generating[1] >= 2 and sorted(t for part in added for t in part) == list(range(12))
    manifest = read_manifest(open_store(c.store.uri), 0, steps.store_prefix(c, RUN, "capture"))
    assert sorted(e["trajectories"] for e in manifest["shards"]) == [[i, i + 1] for i in range(0, 12, 2)]
    added.clear()
    steps.compaction(c, policy, tmp_path / "one.jsonl", 0, RUN)
    assert sorted(added) == [[i, i + 1] for i in range(0, 12, 2)]  # shard by shard
    assert steps.read_trajectories(tmp_path / "one.jsonl", RUN, 0)[1]  # the trajectories as ever


def _trajectories(records) -> list[int]:
    return sorted({t for table in records.tables.values() for t in table.traj.tolist()})


class Prefilled(Exception):
    """Raised at an evaluation engine's first prefill, with its size: the evaluation stops there."""


def test_evaluation_engines_roll_out_at_most_max_running_requests_at_once(tmp_path, policy, monkeypatch):
    """The evaluation's engines take ``rollout.max_running_requests`` too: its
    first pass over the 4 test prompts is prefilled 3 at a time, all 4 without it."""

    def first_prefill(self, tokens, *args):
        raise Prefilled(len(tokens))

    monkeypatch.setattr(TorchEngine, "_prefill", first_prefill)
    for bound, size in ((0, 4), (3, 3)):
        c = config(tmp_path, 1)
        c = c.model_copy(update={"rollout": c.rollout.model_copy(update={"max_running_requests": bound})})
        with pytest.raises(Prefilled) as prefilled:
            evaluation.evaluate(c, policy)
        assert prefilled.value.args == (size,)
