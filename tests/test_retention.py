"""How long the store keeps a round's guidance and capture: round r's train,
once it has saved its outputs, deletes round r-1's (every rollout worker's
shards, the merged step, the decode statistics), so that a run holds about
two rounds of them instead of every round's until ``runs clean`` (at the
paper presets 4 TB of guidance a round); ``guidance.keep_steps`` keeps them
all. Rounds of the smoke preset, in a ``file://`` store and the real S3 server."""

import pytest
from test_checkpoint_fetch import killed_after_one_deletion

from tracefp4.components import steps
from tracefp4.components.guidance import GuidanceError, read_manifest
from tracefp4.components.store import open_store
from tracefp4.schemas import RunConfig, get_preset

RUN = "run-r"


def config(uri: str, workers: int = 1, **guidance) -> RunConfig:
    data = get_preset("smoke").model_dump()
    data["store"]["uri"] = uri
    data["rollout"]["workers"] = workers
    data["guidance"].update(guidance)
    data["bootstrap"]["enabled"] = False
    data["train"]["precision"] = "fp32_master"  # the smoke policy rolls out in float32 (the syndrome codec decodes)
    return RunConfig.model_validate(data)


def roll_out(c: RunConfig, tmp, r: int):
    """Round ``r``'s rollout (by each worker, gathered) and compaction from policy ``p{r}``."""
    policy, trajectories = tmp / f"p{r}", tmp / f"t{r}.jsonl"
    if c.rollout.workers == 1:
        stats = steps.rollout(c, policy, r, trajectories, RUN)
    else:
        parts = [tmp / f"t{r}-{w}.jsonl" for w in range(c.rollout.workers)]
        part_stats = [steps.rollout(c, policy, r, part, RUN, worker=w) for w, part in enumerate(parts)]
        stats = steps.gather(c, parts, part_stats, r, trajectories, RUN)
    ref, size = steps.compaction(c, policy, trajectories, r, RUN)
    return ref, {**stats, **size}


def train(c: RunConfig, tmp, r: int, ref, stats) -> list[dict]:
    """Round ``r``'s train: policy ``p{r}`` and state ``s{r}`` to ``p{r+1}`` and ``s{r+1}``."""
    p, s = tmp / f"p{r}", tmp / f"s{r}"
    return steps.train(c, p, s, tmp / f"t{r}.jsonl", ref, tmp / f"p{r + 1}", tmp / f"s{r + 1}", RUN, stats)


def step_keys(c: RunConfig, r: int) -> list[str]:
    """Every key of round ``r``'s steps in the store, whichever kind and worker."""
    store = open_store(c.store.uri)
    return [key for key in store.list(f"{c.name}/{RUN}/") if f"/step-{r:06d}/" in key]


@pytest.mark.parametrize("keep", [False, True])
def test_round_r_deletes_round_r_minus_1s_guidance_capture_and_decode_statistics(tmp_path, keep):
    """Offline compaction with the syndrome codec writes all three kinds: the
    full capture, the guidance compaction coded from it and, from training,
    the decode statistics the next round's compaction chooses its rates by."""
    c = config((tmp_path / "store").as_uri(), compaction="offline", codec="syndrome", keep_steps=keep)
    steps.prepare(c, tmp_path / "p0", RUN, tmp_path / "s0")
    for r in range(2):
        train(c, tmp_path, r, *roll_out(c, tmp_path, r))
    store = open_store(c.store.uri)
    guidance, capture = (steps.store_prefix(c, RUN, kind) for kind in ("guidance", "capture"))
    for r in (0, 1) if keep else (1,):  # the last round's stay until runs clean
        assert [read_manifest(store, r, prefix)["rl_step"] for prefix in (guidance, capture)] == [r, r]
        assert steps.read_decode_stats(store, guidance, r) is not None
    if not keep:
        assert step_keys(c, 0) == []
        assert steps.read_decode_stats(store, guidance, 0) is None


def test_a_deletion_cut_short_reads_as_missing_and_the_retried_train_finishes_it(s3_env, tmp_path, monkeypatch):
    """Two rollout workers, inline compaction, the real S3 server: each worker
    wrote its own step of round 0's guidance, which compaction's merged step
    lists. Round 1's train killed right after its deletion's first key left
    the merged step missing (its manifest went first), never one whose shards
    fail their checksums; the train retried on the same inputs trains again,
    its own round's guidance whole, and deletes the rest."""
    c = config(s3_env.uri("retention"), workers=2)
    steps.prepare(c, tmp_path / "p0", RUN, tmp_path / "s0")
    train(c, tmp_path, 0, *roll_out(c, tmp_path, 0))
    ref, stats = roll_out(c, tmp_path, 1)
    guidance = steps.store_prefix(c, RUN, "guidance")
    workers = [steps.worker_prefix(guidance, c, w) for w in range(2)]
    assert all(read_manifest(open_store(c.store.uri), 0, prefix)["shards"] for prefix in [guidance, *workers])
    store = open_store(c.store.uri)
    deleted = killed_after_one_deletion(monkeypatch, type(store), lambda: train(c, tmp_path, 1, ref, stats))
    assert deleted == [f"{guidance}/step-000000/manifest.json"]
    with pytest.raises(GuidanceError, match=f"{guidance}/step-000000/manifest.json: no manifest, so step 0 is missing"):
        read_manifest(store, 0, guidance)
    assert len([key for key in step_keys(c, 0) if key.endswith("/shard-00000.bin")]) == 2  # each worker's, left
    (row,) = train(c, tmp_path, 1, ref, stats)
    assert row["guidance_coverage"] > 0.9 and row["round"] == 1
    assert step_keys(c, 0) == []
    assert read_manifest(store, 1, guidance)["shards"] and all(read_manifest(store, 1, w) for w in workers)
