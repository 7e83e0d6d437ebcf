"""Two runs with the same name and method sharing one S3 store (a real
SeaweedFS on loopback) never meet: each reads only its own guidance, and
every step refuses the other run's inputs by name."""

import pytest

from tracefp4.components import steps
from tracefp4.components.guidance import GuidanceError, read_manifest
from tracefp4.components.store import open_store
from tracefp4.components.trainer_state import StateMismatch
from tracefp4.schemas import RunConfig, get_preset


def test_two_runs_with_one_name_share_a_store_and_never_meet(s3_env, tmp_path):
    data = get_preset("smoke").model_dump()
    data["store"]["uri"] = s3_env.uri("shared")
    config = RunConfig.model_validate(data)
    refs = {}
    for run in ("run-a", "run-b"):
        folder = tmp_path / run
        steps.prepare(config, folder / "p0", run, folder / "s0")
        steps.rollout(config, folder / "p0", 0, folder / "t0.jsonl", run)
        refs[run], _ = steps.compaction(config, folder / "p0", folder / "t0.jsonl", 0, run)
        (row,) = steps.train(
            config, folder / "p0", folder / "s0", folder / "t0.jsonl", refs[run], folder / "p1", folder / "s1", run
        )
        assert row["guidance_coverage"] > 0.9
    store = open_store(config.store.uri)
    for run in ("run-a", "run-b"):
        assert read_manifest(store, 0, steps.store_prefix(config, run, "guidance"))["run_id"] == run
    assert {key.split("/")[1] for key in store.list("smoke/")} == {"run-a", "run-b"}
    b = tmp_path / "run-b"
    with pytest.raises(GuidanceError, match="guidance of run 'run-a' handed to run 'run-b'"):
        steps.train(config, b / "p0", b / "s0", b / "t0.jsonl", refs["run-a"], b / "p-x", b / "s-x", "run-b")
    with pytest.raises(steps.RunMismatch, match="trajectories of run 'run-a' round 0, expected run 'run-b'"):
        a = tmp_path / "run-a"
        steps.train(config, b / "p0", b / "s0", a / "t0.jsonl", refs["run-b"], b / "p-x", b / "s-x", "run-b")
    with pytest.raises(StateMismatch, match="trainer state of run 'run-a', this is run 'run-b'"):
        steps.train(config, b / "p0", a / "s0", b / "t0.jsonl", refs["run-b"], b / "p-x", b / "s-x", "run-b")
    with pytest.raises(StateMismatch, match="saved with another policy folder"):  # same run, another version's state
        steps.train(config, b / "p0", b / "s1", b / "t0.jsonl", refs["run-b"], b / "p-x", b / "s-x", "run-b")
    assert not (b / "p-x").exists() and not (b / "s-x").exists()
    with pytest.raises(steps.RunMismatch, match="policy of run 'run-a', this is run 'run-b'"):
        steps.rollout(config, tmp_path / "run-a" / "p1", 1, b / "t1.jsonl", "run-b")
