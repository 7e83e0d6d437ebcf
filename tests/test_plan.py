"""``tracefp4 plan``'s figures are what the steps write: a smoke run's policy,
trainer state, guidance and capture, measured on what prepare, rollout,
compaction and train wrote, against the plan of the same config; a model it
cannot know is an error naming what to give."""

import json
import math
from dataclasses import replace
from pathlib import Path

import pytest
from click.testing import CliRunner

from tracefp4.components import steps
from tracefp4.components.architecture import QWEN35_35B_A3B, get_preset
from tracefp4.components.checkpoint import config_to_hf
from tracefp4.components.guidance import read_step
from tracefp4.components.plan import (
    PlanError,
    chain_rounds_at_once,
    model_config,
    plan,
    rounds_at_once,
    rounds_left,
)
from tracefp4.components.store import open_store
from tracefp4.components.tasks import Problem
from tracefp4.components.tensor_files import tensor_files, tensor_layout
from tracefp4.pipelines.cli import _size, main
from tracefp4.pipelines.local import localize
from tracefp4.schemas import load_config

RUN = "run-a"
SHARD_HEADER = 1 << 16  # a shard's preamble, JSON header and digest: guidance.HEADER_READ bounds a paper preset's


def assert_trajectories_as_planned(path: Path, figures: dict) -> None:
    """A rollout's trajectories file against the plan: what its tokens add to
    its lines (each line less the same line without tokens) within 10% of the
    plan's figure a token for its response tokens (ids, log-probabilities,
    tis_sc's top-k), and no more than the plan's for all its tokens, since a
    prompt token, its id alone, adds less."""
    _, trajectories, problems = steps.read_trajectories(path, RUN, 0)
    lines = path.read_bytes().splitlines(keepends=True)[1:]
    empty = [
        replace(t, prompt=[], response=[], logprobs=[], topk_ids=t.topk_ids and [], topk_logprobs=t.topk_ids and [])
        for t in trajectories
    ]
    added = sum(map(len, lines)) - sum(len(steps.trajectory_line(t, p)) for t, p in zip(empty, problems))
    responses = sum(len(t.response) for t in trajectories)
    assert added / responses == pytest.approx(figures["trajectory_bytes_per_token"], rel=0.1)
    assert added < figures["trajectory_bytes_per_token"] * sum(len(t.tokens) for t in trajectories)
    assert sum(len(t.tokens) for t in trajectories) <= figures["tokens_per_round"]
    # and what its problems add (prompt, answer, meta), sized on a sample of the tasks' problems
    bare = len(steps.trajectory_line(empty[0], Problem("", "", "", {})))
    problem = sum(len(steps.trajectory_line(t, p)) - bare for t, p in zip(empty, problems)) / len(problems)
    assert problem == pytest.approx(figures["problem_bytes_per_trajectory"], rel=0.2)


def tensor_bytes(folder, stem: str) -> int:
    """Bytes of the tensors a folder's safetensors files hold, by their headers (no header counted)."""
    layout = tensor_layout(tensor_files(folder, stem))
    return sum(math.prod(shape) * dtype.itemsize for shape, dtype in layout.values())


@pytest.mark.parametrize(
    "overrides",
    [
        {},  # inline R-1bit guidance, a float32 policy: no master weights in the trainer state
        {"model.dtype": "bfloat16", "guidance.compaction": "offline"},  # a full capture; bf16 policy, float32 masters
        {"guidance.codec": "syndrome"},  # parity at the first step's rate, from a 1-bit capture
    ],
    ids=["inline", "offline-bf16", "syndrome"],
)
def test_plan_predicts_what_the_steps_write(tmp_path, overrides):
    config = localize(load_config(None, preset="smoke", overrides=overrides or None), tmp_path)
    figures = plan(config, model_config(config))
    policy, state, trajectories = tmp_path / "policy", tmp_path / "state", tmp_path / "trajectories.jsonl"
    steps.prepare(config, policy, RUN, state)
    steps.rollout(config, policy, 0, trajectories, RUN)
    assert_trajectories_as_planned(trajectories, figures)
    ref, size = steps.compaction(config, policy, trajectories, 0, RUN)
    steps.train(config, policy, state, trajectories, ref, tmp_path / "next", tmp_path / "next-state", RUN, {})
    # the weights and the trainer state's tensors, exactly; their files add only safetensors' JSON headers
    assert tensor_bytes(policy, "model") == tensor_bytes(tmp_path / "next", "model") == figures["policy_bytes"]
    assert tensor_bytes(tmp_path / "next-state", "state") == figures["trainer_state_bytes"]
    # guidance: compaction's count of the step's table bytes, a token's times the tokens captured (a row each at
    # moe_in); the shards add a header each
    store = open_store(config.store.uri)
    prefix = steps.store_prefix(config, RUN, "guidance")
    tables = read_step(store, 0, prefix).tables
    tokens = len(next(t for (_, site), t in tables.items() if site == "moe_in").traj)
    predicted = figures["guidance_bytes_per_token"] * tokens
    if config.guidance.codec == "syndrome":  # narrow rows share a block: each trajectory's last may be part empty
        trajectories = len(set(tables[next(iter(tables))].traj.tolist()))
        block = sum(t.rate.code_bits + t.rate.scale_bits for t in tables.values()) // 8  # a block of each table
        assert 0 <= size["guidance_bytes"] - predicted <= trajectories * block
    else:
        assert size["guidance_bytes"] == predicted
    shards = {key: n for key, n in store.sizes(prefix + "/").items() if not key.endswith("manifest.json")}
    assert 0 < sum(shards.values()) - size["guidance_bytes"] < len(shards) * SHARD_HEADER
    # what the rollout shipped for compaction besides: a full capture (offline), the 1-bit capture the syndrome
    # codec codes, nothing where its shards are the guidance
    capture = read_step(store, 0, steps.store_prefix(config, RUN, "capture")).nbytes if overrides else 0
    assert capture == figures["capture_bytes_per_token"] * tokens
    if config.guidance.compaction == "offline":
        assert size["capture_bytes"] == capture and capture == figures["full_capture_bytes_per_token"] * tokens
    assert tokens <= figures["tokens_per_round"]  # the plan's bound: every trajectory at model.max_seq_len


def test_tis_sc_trajectories_carry_the_samplers_top_k_as_planned(tmp_path):
    config = localize(load_config(None, preset="smoke", overrides={"method": "tis_sc"}), tmp_path)
    figures = plan(config, model_config(config))
    steps.prepare(config, tmp_path / "policy", RUN, tmp_path / "state")
    steps.rollout(config, tmp_path / "policy", 0, tmp_path / "trajectories.jsonl", RUN)
    assert_trajectories_as_planned(tmp_path / "trajectories.jsonl", figures)
    plain = plan(config.model_copy(update={"method": "qat"}), model_config(config))
    assert figures["trajectory_bytes_per_token"] > 8 * plain["trajectory_bytes_per_token"]  # 8 ids and values more


def test_a_problem_scored_by_a_reward_of_its_own_is_planned_with_its_whole_line(tmp_path):
    """Such a problem's line goes into the trajectories file with each of its responses: lines of test cases
    made a round's file 122 times what the plan said, which counted the tokens alone."""
    data = tmp_path / "sums.jsonl"
    data.write_text(
        "".join(json.dumps({"prompt": f"{a}+1=", "answer": a + 1, "tests": "x" * 20_000}) + "\n" for a in range(20))
    )
    (tmp_path / "rewards.py").write_text("def score(response, answer, line):\n    return 1\n")
    task = {"name": "sums", "data": str(data), "train_size": 16, "test_size": 4}
    config = load_config(None, preset="smoke", overrides={"tasks": [task]})
    plain = plan(config, model_config(config))
    task["reward"] = f"{tmp_path}/rewards.py:score"
    rewarded = plan(load_config(None, preset="smoke", overrides={"tasks": [task]}), model_config(config))
    assert 0 < plain["problem_bytes_per_trajectory"] < 100
    assert 20_000 < rewarded["problem_bytes_per_trajectory"] < 20_200
    grown = rewarded["trajectories_bytes_per_round"] - plain["trajectories_bytes_per_round"]
    assert grown > rewarded["trajectories_per_round"] * 20_000
    data.unlink()  # a file the plan cannot read is named, as the run's first task would
    result = CliRunner().invoke(main, ["plan", "--preset", "smoke", "--set", f"tasks={json.dumps([task])}"])
    assert result.exit_code == 1 and f"tasks.0.data: {data}: no such file" in result.output, result.output


@pytest.mark.parametrize("keep", [False, True])
def test_the_store_holds_the_rounds_of_guidance_and_capture_the_plan_says(tmp_path, keep):
    """Three rounds with offline compaction (a capture and guidance each):
    after every step, the rounds whose steps are in the store; at most what
    plan counts at once in a run, and after it what it counts until runs
    clean (two and one, round r's train deleting round r-1's; every round's
    with guidance.keep_steps)."""
    overrides = {"rl.rounds": 3, "guidance.compaction": "offline", "guidance.keep_steps": keep}
    config = localize(load_config(None, preset="smoke", overrides=overrides), tmp_path)
    store = open_store(config.store.uri)
    prefix = f"{config.name}/{RUN}/{config.method}/"

    def rounds_stored() -> set[str]:
        return {key.split("/step-")[1][:6] for key in store.list(prefix) if "/step-" in key}

    steps.prepare(config, tmp_path / "p0", RUN, tmp_path / "s0")
    held = []
    for r in range(3):
        p, t = tmp_path / f"p{r}", tmp_path / f"t{r}.jsonl"
        steps.rollout(config, p, r, t, RUN)
        held.append(len(rounds_stored()))
        ref, _ = steps.compaction(config, p, t, r, RUN)
        held.append(len(rounds_stored()))
        steps.train(config, p, tmp_path / f"s{r}", t, ref, tmp_path / f"p{r + 1}", tmp_path / f"s{r + 1}", RUN, {})
        held.append(len(rounds_stored()))
    assert max(held) == rounds_at_once(config, 3) == (3 if keep else 2)
    assert held[-1] == rounds_left(config, 3) == (3 if keep else 1)
    figures = plan(config, model_config(config))
    per_round = figures["guidance_bytes_per_round"] + figures["capture_bytes_per_round"]
    assert (figures["store_bytes_per_run"], figures["store_bytes_after_run"]) == (
        max(held) * per_round,
        held[-1] * per_round,
    )


def test_a_chain_holds_what_each_run_before_left_and_the_running_runs_rounds():
    """100 rounds in runs of 14 (7 runs, and 2 rounds in the 8th), none cleaned: 7 last rounds and the 8th run's
    2; with guidance.keep_steps every round's."""
    config = load_config(None, preset="smoke", overrides={"rl.rounds": 100, "rl.rounds_per_run": 14})
    assert chain_rounds_at_once(config, 14) == 9 and chain_rounds_at_once(config, 100) == 2
    assert chain_rounds_at_once(config, 1) == 100  # each run one round, and its last
    kept = load_config(None, preset="smoke", overrides={"rl.rounds": 100, "guidance.keep_steps": True})
    assert chain_rounds_at_once(kept, 14) == chain_rounds_at_once(kept, 1) == 100


def test_a_model_that_cannot_be_known_is_an_error_naming_what_to_give(tmp_path):
    config = load_config(None, preset="paper-nvfp4-wa-kv")
    with pytest.raises(
        PlanError, match="model.checkpoint s3://models/qwen3.5-35b-a3b: .*give a copy of it with --model-config"
    ):
        model_config(config)
    garbled = tmp_path / "config.json"
    garbled.write_text('{"model_type": "llama"}')
    result = CliRunner().invoke(main, ["plan", "--preset", "paper-nvfp4-wa-kv", "--model-config", str(garbled)])
    assert result.exit_code == 1 and f"--model-config {garbled}: " in result.output
    small = tmp_path / "small.json"  # a 2-layer model for a config that guides the deepest 20: refused as prepare would
    small.write_text(json.dumps(config_to_hf(get_preset("smoke"))))
    result = CliRunner().invoke(main, ["plan", "--preset", "paper-nvfp4-wa-kv", "--model-config", str(small)])
    assert result.exit_code == 1 and "guidance.layers: the deepest 20 layers with FP4 sites; the model (" in (
        result.output
    )
    result = CliRunner().invoke(main, ["plan", "--preset", "smoke", "--tokens-per-trajectory", "65"])
    assert result.exit_code == 1 and "must be 1 to model.max_seq_len (64)" in result.output
    result = CliRunner().invoke(main, ["plan", "--preset", "smoke", "--model-config", str(small)])  # a preset's own
    assert result.exit_code == 1 and f"--model-config {small}: the config's model is the preset smoke" in result.output


def test_plan_prints_a_table_and_one_json_line_of_its_figures(tmp_path):
    hf = tmp_path / "config.json"
    hf.write_text(json.dumps(config_to_hf(QWEN35_35B_A3B)))
    args = ["plan", "--preset", "paper-nvfp4-wa-kv", "--model-config", str(hf), "--tokens-per-trajectory", "10000"]
    result = CliRunner().invoke(main, args)
    assert result.exit_code == 0, result.output
    *table, last = result.output.splitlines()
    figures = json.loads(last)
    assert figures["policy_bytes"] == 2 * figures["parameters"] and "policy" in table[1]
    assert figures["guidance_bytes_per_round"] == round(figures["guidance_bytes_per_token"] * 16384 * 10000)


def test_the_deploy_docs_sizes_are_the_commands():
    """docs/deploy.md's "Sizes" table is what ``tracefp4 plan`` prints for the paper presets at 10,000 tokens a
    trajectory, on the architecture the code holds for their checkpoint."""
    rows = {
        "policy": "policy_bytes",
        "trainer state": "trainer_state_bytes",
        "guidance a token": "guidance_bytes_per_token",
        "guidance a round": "guidance_bytes_per_round",
        "store, a run of 14 rounds": "store_bytes_per_run",
        "store, after the run": "store_bytes_after_run",
        "store, the chain's 100 rounds": "store_bytes_per_chain",
        "trajectories a round": "trajectories_bytes_per_round",
        "store, a TrainJob's trajectories": "store_trajectories_bytes",
        "pipeline root, a run": "pipeline_root_bytes_per_run",
        "pipeline root, the chain": "pipeline_root_bytes_per_chain",
    }
    text = (Path(__file__).parents[1] / "docs" / "deploy.md").read_text()
    cells = {line.split(" | ")[0].strip("| "): line.split(" | ")[1:3] for line in text.splitlines() if line[:2] == "| "}
    for column, preset in enumerate(("paper-nvfp4-wa-kv", "paper-w4a8-mxfp4-kv")):
        figures = plan(load_config(None, preset=preset), QWEN35_35B_A3B, 10000)
        assert cells["parameters"][0] == f"{figures['parameters']:,}"
        for row, key in rows.items():
            assert cells[row][column] == _size(figures[key]), (preset, row)
