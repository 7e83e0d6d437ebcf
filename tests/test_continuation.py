"""A continuation (model.trainer_state, rl.first_round): a long schedule run
as several runs, each going on from the last one's final policy and trainer
state, loses nothing: the same policy, optimizer state and history, bit for
bit, as one run of all the rounds."""

import json

import pytest
import torch
import yaml

from tracefp4.components import steps
from tracefp4.components.checkpoint import (
    LOCATION,
    MANIFEST,
    CheckpointError,
    commit_folder,
    fetch,
    folder_digest,
    load_model,
    provenance,
    write_location,
)
from tracefp4.components.guidance import read_manifest
from tracefp4.components.store import open_store
from tracefp4.components.trainer_state import StateMismatch, read_meta, state_tensors
from tracefp4.schemas import ConfigError, RunConfig, get_preset, load_config


def smoke(tmp_path, **settings) -> dict:
    data = get_preset("smoke").model_dump()
    data["bootstrap"]["enabled"] = False
    data["guidance"].update(codec="syndrome")  # its rates come from the previous round's decode statistics
    data["train"]["precision"] = "fp32_master"  # the smoke policy rolls out in float32: so does its training
    data["store"]["uri"] = (tmp_path / "store").as_uri()
    for path, value in settings.items():
        section, key = path.split(".")
        data[section][key] = value
    return data


def continuing(tmp_path, policy, state, first_round: int, **settings) -> RunConfig:
    """The smoke config of a run that goes on from ``policy`` and ``state`` after ``first_round`` rounds."""
    data = smoke(tmp_path, **settings)
    data["model"].update(preset=None, checkpoint=str(policy), trainer_state=str(state))
    data["rl"]["first_round"] = first_round
    return RunConfig.model_validate(data)


def timeless(rows: list[dict]) -> list[dict]:
    """History rows without what the clock decides."""
    timed = ("seconds", "per_second", "overhead")
    return [{k: v for k, v in row.items() if not any(t in k for t in timed)} for row in rows]


def test_two_rounds_are_one_round_and_a_continuation_of_one_bit_for_bit(tmp_path):
    config = RunConfig.model_validate(smoke(tmp_path))
    steps.prepare(config, tmp_path / "p0", "whole", tmp_path / "s0")
    rows = []
    for r in range(2):
        policy, state = tmp_path / f"p{r}", tmp_path / f"s{r}"
        out, out_state = tmp_path / f"p{r + 1}", tmp_path / f"s{r + 1}"
        rows += steps.run_round(config, policy, state, r, out, out_state, tmp_path / "whole", "whole")

    # the second run goes on from the first round's policy and state, as a run of its own; the state where a
    # TrainJob round leaves it, in the store, with a folder standing for it (what the chain's next run gets)
    store = open_store(config.store.uri)
    for f in sorted((tmp_path / "s1").iterdir()):
        store.upload(f"trainjob/new-state/{f.name}", f)
    standing = write_location(
        tmp_path / "s1-location", f"{config.store.uri}/trainjob/new-state", (tmp_path / "s1" / MANIFEST).read_bytes()
    )
    # in a store of its own (a local continuation's, in its own output folder): the trainer state carries the
    # decode statistics round 1's syndrome rates are chosen from
    then = continuing(tmp_path / "next", tmp_path / "p1", standing, first_round=1)
    assert steps.prepare(then, tmp_path / "q1", "then", tmp_path / "t1") == {}
    assert provenance(tmp_path / "q1") == {"run_id": "then", "policy_version": 1}
    assert read_meta(tmp_path / "t1")["run_id"] == "then"
    again = steps.run_round(
        then, tmp_path / "q1", tmp_path / "t1", 1, tmp_path / "q2", tmp_path / "t2", tmp_path, "then"
    )

    assert timeless(again) == timeless(rows[1:])  # prompts, rewards, loss, guidance: the same round
    whole, split = load_model(tmp_path / "p2").state_dict(), load_model(tmp_path / "q2").state_dict()
    assert whole.keys() == split.keys() and all(torch.equal(whole[k], split[k]) for k in whole)
    ends = state_tensors(tmp_path / "s2"), state_tensors(tmp_path / "t2")
    assert ends[0].keys() == ends[1].keys() and all(torch.equal(ends[0][k], ends[1][k]) for k in ends[0])
    assert provenance(tmp_path / "q2") == {"run_id": "then", "policy_version": 2}
    # round 1 chose its syndrome rates from round 0's statistics in both runs
    manifests = [
        read_manifest(open_store(c.store.uri), 1, steps.store_prefix(c, run, "guidance"))
        for c, run in ((config, "whole"), (then, "then"))
    ]
    assert manifests[0]["syndrome"]["previous_decode"] is not None
    assert manifests[0]["syndrome"] == manifests[1]["syndrome"]


def test_a_continuation_is_refused_where_it_could_not_go_on_losslessly(tmp_path):
    config = RunConfig.model_validate(smoke(tmp_path, **{"guidance.codec": "bits"}))
    steps.prepare(config, tmp_path / "p0", "first", tmp_path / "s0")
    steps.run_round(config, tmp_path / "p0", tmp_path / "s0", 0, tmp_path / "p1", tmp_path / "s1", tmp_path, "first")

    # the state is at policy version 1: one round of one step
    wrong_round = continuing(tmp_path, tmp_path / "p1", tmp_path / "s1", 2, **{"guidance.codec": "bits"})
    with pytest.raises(
        ValueError, match="rl.first_round: 2 rounds of 1 step.* make policy version 2, but .* version 1"
    ):
        steps.prepare(wrong_round, tmp_path / "x", "next", tmp_path / "xs")
    same_run = continuing(tmp_path, tmp_path / "p1", tmp_path / "s1", 1, **{"guidance.codec": "bits"})
    with pytest.raises(ValueError, match="run id 'first': .* saved by the run of that id.* a run of its own"):
        steps.prepare(same_run, tmp_path / "x", "first", tmp_path / "xs")
    other_policy = continuing(tmp_path, tmp_path / "p0", tmp_path / "s1", 1, **{"guidance.codec": "bits"})
    with pytest.raises(StateMismatch, match="saved with another policy folder"):
        steps.prepare(other_policy, tmp_path / "x", "next", tmp_path / "xs")
    # the run went with the bits codec: a syndrome continuation has no statistics to choose its rates from
    no_statistics = continuing(tmp_path, tmp_path / "p1", tmp_path / "s1", 1)
    with pytest.raises(steps.GuidanceError, match="round 1's rates from round 0's decode statistics.*'first'"):
        steps.prepare(no_statistics, tmp_path / "x", "next", tmp_path / "xs")
    assert not (tmp_path / "x").exists() and not (tmp_path / "xs").exists()  # nothing half-written


@pytest.mark.parametrize(
    "settings, problem",
    [
        ({"rl": {"first_round": 3}}, "rl.first_round: 3 continues a run: set model.checkpoint and model.trainer_state"),
        ({"model": {"trainer_state": "s"}}, "model.trainer_state: a continuation goes on from the policy saved"),
        (
            {"model": {"preset": None, "checkpoint": "p", "trainer_state": "s"}},
            "compile it with rl.first_round set to their number",
        ),
        (
            {"model": {"preset": None, "checkpoint": "p", "trainer_state": "s"}, "rl": {"first_round": 1}},
            "bootstrap.enabled: a continuation",
        ),
        ({"model": {"preset": None, "checkpoint": "p", "trainer_state": "ftp://s"}}, "must start with file://"),
    ],
)
def test_a_continuation_names_its_state_policy_and_round_together(settings, problem):
    data = get_preset("tiny").model_dump()
    for section, values in settings.items():
        data[section].update(values)
    with pytest.raises(ValueError, match=problem):
        RunConfig.model_validate(data)


def test_the_continuation_pipeline_numbers_its_rounds_on_and_a_comparison_refuses_one(tmp_path):
    from tracefp4.pipelines.pipeline import build_comparison_pipeline, compile_pipeline, compiled_documents

    (tmp_path / "cont.yaml").write_text(
        "model: {checkpoint: s3://runs/first/policy, trainer_state: s3://runs/first/state}\n"
        "rl: {rounds: 2, first_round: 15}\nbootstrap: {enabled: false}\n"
    )
    config = load_config(tmp_path / "cont.yaml", preset="tiny")
    compile_pipeline(config, tmp_path / "p.yaml")
    spec = compiled_documents((tmp_path / "p.yaml").read_bytes())[0]
    tasks = spec["root"]["dag"]["tasks"]
    rounds = sorted(
        t["inputs"]["parameters"]["round_index"]["runtimeValue"]["constant"]
        for name, t in tasks.items()
        if name.startswith("rollout")
    )
    assert rounds == [15, 16]
    assert "rounds 2 from round 15" in spec["pipelineInfo"]["description"]
    assert "rl_first_round" not in spec["root"]["inputDefinitions"]["parameters"]  # compile-time: it numbers tasks
    assert "model_trainer_state" in spec["root"]["inputDefinitions"]["parameters"]
    with pytest.raises(ConfigError, match="model.trainer_state: a continuation goes on with one method"):
        build_comparison_pipeline(config, ["trace", "qat"])


def test_a_run_that_leaves_rounds_ends_by_submitting_the_next(tmp_path):
    """rl.rounds_per_run: the pipeline unrolls that many rounds, and once its report is written a last task (its
    pod labelled for multi-user KFP's token) submits the next run from the last train task's history; a
    comparison refuses to chain, and a local run executes every round."""
    from tracefp4.pipelines.local import localize
    from tracefp4.pipelines.pipeline import (
        KFP_TOKEN_LABEL,
        build_comparison_pipeline,
        compile_pipeline,
        compiled_documents,
        run_tasks,
    )

    config = load_config(preset="tiny", overrides={"rl.rounds": 7, "rl.rounds_per_run": 3})
    assert list(config.rl.run_rounds()) == [0, 1, 2] and config.rl.chained
    compile_pipeline(config, tmp_path / "p.yaml")
    package = (tmp_path / "p.yaml").read_bytes()
    spec = compiled_documents(package)[0]
    tasks = spec["root"]["dag"]["tasks"]
    assert sorted(n for n in tasks if n.startswith("train")) == ["train", "train-2", "train-3"]
    chain = tasks["chain"]
    assert {"report", "train-3"} <= set(chain["dependentTasks"])
    assert chain["inputs"]["artifacts"]["history"]["taskOutputArtifact"]["producerTask"] == "train-3"
    assert "rounds 3, the 4 left to the next run" in spec["pipelineInfo"]["description"]
    assert "rl_rounds_per_run" not in spec["root"]["inputDefinitions"]["parameters"]
    assert run_tasks(spec, config) == 15  # configure, prepare, 3 x 3, export, evaluate, report, chain
    platform = [doc for doc in yaml.safe_load_all(package) if doc][1]["platforms"]["kubernetes"]
    executors = platform["deploymentSpec"]["executors"]
    assert executors["exec-chain"]["podMetadata"]["labels"] == {KFP_TOKEN_LABEL: "true"}
    assert sum("podMetadata" in e for e in executors.values()) == 1

    assert tasks["evaluate"]["inputs"]["artifacts"]["initial"]["taskOutputArtifact"]["producerTask"] == "prepare"

    whole = load_config(preset="tiny", overrides={"rl.rounds": 3, "rl.rounds_per_run": 3, "evaluation.initial": False})
    assert not whole.rl.chained
    compile_pipeline(whole, tmp_path / "whole.yaml")
    tasks = compiled_documents((tmp_path / "whole.yaml").read_bytes())[0]["root"]["dag"]["tasks"]
    assert "chain" not in tasks and set(tasks["evaluate"]["inputs"]["artifacts"]) == {"policy"}
    with pytest.raises(ConfigError, match="rl.rounds_per_run: a comparison runs its 7 rounds in one run"):
        build_comparison_pipeline(config, ["trace", "qat"])
    local = localize(config, tmp_path)
    assert list(local.rl.run_rounds()) == list(range(7)) and not local.rl.chained


def test_other_weights_behind_the_same_state_uri_make_another_local_run(tmp_path):
    from tracefp4.pipelines.resume import request

    config = RunConfig.model_validate(smoke(tmp_path))
    steps.prepare(config, tmp_path / "p0", "first", tmp_path / "s0")
    (tmp_path / "s").mkdir()
    then = continuing(tmp_path, tmp_path / "p0", tmp_path / "s", 1)
    store = open_store(then.store.uri)
    before = request(then, None, store)
    meta = json.loads((tmp_path / "s0" / "checksums.json").read_text())
    (tmp_path / "s" / "checksums.json").write_text(json.dumps(meta))
    assert request(then, None, store) != before


def test_run_continue_from_needs_a_finished_train_task_and_another_output(tmp_path):
    from click.testing import CliRunner

    from tracefp4.pipelines.cli import main

    same = CliRunner().invoke(
        main, ["run", "--preset", "smoke", "--continue-from", str(tmp_path), "--output", str(tmp_path)]
    )
    assert same.exit_code == 2 and "continue into another --output, so that a rerun resumes" in same.output
    empty = CliRunner().invoke(
        main, ["run", "--preset", "smoke", "--continue-from", str(tmp_path), "--output", str(tmp_path / "next")]
    )
    assert empty.exit_code == 1 and "no train task of a run finished there" in empty.output
    assert "name the --output of a `tracefp4 run` that trained" in empty.output
    compared = CliRunner().invoke(
        main, ["run", "--preset", "smoke", "--continue-from", str(tmp_path), "--compare", "trace,qat", "--output", "n"]
    )
    assert compared.exit_code == 2 and "--continue-from goes on with one method's optimizer: leave out --compare" in (
        compared.output
    )
    assert not (tmp_path / "next").exists()
    # a --set the command's own settings would replace is refused (a continuation's checkpoint, say)
    off = CliRunner().invoke(
        main, ["bootstrap", "--preset", "smoke", "--set", "bootstrap.enabled=false", "--output", str(tmp_path / "b")]
    )
    assert off.exit_code == 2 and "--set bootstrap.enabled=false: bootstrap sets bootstrap.enabled to true" in (
        off.output
    )


def test_a_train_step_in_its_own_pod_hands_its_trainer_state_on_through_the_store(tmp_path):
    """What the train component does with the state it (or its torchrun ranks) wrote: the store keeps it, and
    KFP a folder standing for it (its manifest and a location), which fetch follows to the same files; a
    round's state leaves the store two rounds later, once the round after it has trained from it and a retry
    of the next round no longer needs it."""
    config = get_preset("smoke")
    config.store.uri = (tmp_path / "store").as_uri()
    folders = []
    for r in range(3):
        staged = tmp_path / f"staged-{r}"
        staged.mkdir()
        (staged / "tensors.bin").write_bytes(bytes([r]) * 100)
        folder = commit_folder(staged, tmp_path / f"state-{r}", {"round": r})
        digest = folder_digest(folder)
        steps.hand_on_state(config, "run-1", r, folder)
        assert (
            sorted(p.name for p in folder.iterdir()) == sorted([LOCATION, MANIFEST]) and folder_digest(folder) == digest
        )
        assert (fetch(folder) / "tensors.bin").read_bytes() == bytes([r]) * 100
        folders.append(folder)
    with pytest.raises(CheckpointError, match="which is gone .* once a later round has trained from it"):
        fetch(folders[0])
    assert [(fetch(f) / "tensors.bin").read_bytes()[0] for f in folders[1:]] == [1, 2]
    assert open_store(config.store.uri).list() == sorted(
        f"{steps.state_key(config, 'run-1', r)}/{name}" for r in (1, 2) for name in ("tensors.bin", MANIFEST)
    )
    # a local run's store is a folder of its run folder, named by its path: the run folder moved, a run that
    # goes on from its last state is refused before it starts (its first step said the state had left the store)
    from tracefp4.pipelines.resume import request

    (tmp_path / "store").rename(tmp_path / "moved")
    (tmp_path / "policy").mkdir()
    then = continuing(tmp_path, tmp_path / "policy", folders[-1], 3)
    with pytest.raises(ConfigError, match="model.trainer_state: .* which is gone .* run folder was moved or copied"):
        request(then, None, open_store(then.store.uri))
