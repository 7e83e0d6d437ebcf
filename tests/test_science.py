"""benchmarks/science.py: the claims' verdicts from a results JSON (synthetic scores with known differences),
and its --quick mode end to end (the smoke model, one seed, one round), resumed without redoing finished runs."""

import argparse
import importlib.util
import json
import random
import subprocess
import sys
from pathlib import Path

import pytest

from tracefp4.components.stats import accuracy_row

ROOT = Path(__file__).resolve().parents[1]
spec = importlib.util.spec_from_file_location("science", ROOT / "benchmarks" / "science.py")
science = importlib.util.module_from_spec(spec)
spec.loader.exec_module(science)

BF16_ONLY = [("trained", "bf16", 0.555), ("ptq:nvfp4", "fp4_wa_kv", 0.45)]  # the bf16 run's extra arms
RATES = {"bf16": 0.55, "qat": 0.35, "quads": 0.5, "trace": 0.55, "tis_sc": 0.5}  # under the FP4 rollout


def scored(policy: str, rollout: str, rate: float, difficulty: list[float], texts: list[str]) -> dict:
    greedy = [float(d < rate) for d in difficulty]
    return {"policy": policy, "rollout": rollout, **accuracy_row("arithmetic", texts, greedy, greedy, 1)}


def synthetic(prompts: int) -> dict:
    """Two seeds; each prompt has a difficulty every method shares, so paired differences are tight."""
    runs = []
    for seed in (0, 1):
        rng = random.Random(seed)
        difficulty = [rng.random() for _ in range(prompts)]
        texts = [f"seed {seed} prompt {i}" for i in range(prompts)]
        for method in RATES:
            arms = [("trained", "fp4_wa_kv", RATES[method]), ("initial", "fp4_wa_kv", 0.3)] + BF16_ONLY * (
                method == "bf16"
            )
            accuracy = [scored(*arm, difficulty, texts) for arm in arms]
            history = [
                {"logprob_abs_diff_mean": 0.01 * (1 + i * (method == "qat")), "accuracy": 0.4} for i in range(10)
            ]
            runs.append({"seed": seed, "method": method, "history": history, "accuracy": accuracy})
    return {"command": "synthetic", "config": {"evaluation": {"rollout_configs": ["bf16", "fp4_wa_kv"]}}, "runs": runs}


def test_verdicts_follow_the_paired_intervals(tmp_path):
    data = synthetic(300)
    verdicts = {c["claim"]: c for c in science.claims(data)}
    assert verdicts["TRACE > QAT (FP4 rollout)"]["verdict"] == "holds"
    assert verdicts["TRACE > QAT (FP4 rollout)"]["difference"] == pytest.approx(0.2, abs=0.05)
    assert verdicts["TRACE > QAT (FP4 rollout)"]["pairs"] == 600  # (seed, prompt) pairs over both seeds
    assert verdicts["TRACE >= QUADS"]["verdict"] == "holds"  # 0.55 vs 0.5 on shared difficulties: always ahead
    assert verdicts["QUADS > QAT"]["verdict"] == "holds"
    assert verdicts["TRACE close to BF16 (BF16 rollout)"]["verdict"] == "holds"  # 0.55 vs 0.555: within 1 point
    assert verdicts["TRACE > ptq:nvfp4"]["verdict"] == "holds"
    dynamics = {d["method"]: d for d in science.dynamics(data)}
    assert dynamics["qat"]["last"] > 5 * dynamics["qat"]["first"] and dynamics["trace"]["last"] == 0.01
    page = science.render(data, tmp_path)
    assert "| TRACE > QAT (FP4 rollout) | +15.7 avg (75.3 vs 59.6) | +0." in page
    assert {p.name for p in tmp_path.glob("*.png")} == {"science-logprob_abs_diff_mean.png", "science-accuracy.png"}


def test_a_no_worse_claim_holds_on_a_tie():
    """A >= claim is non-inferiority (the interval above -1 point): TRACE scoring as TIS + score centering holds it,
    where a > claim would call it not separable."""
    tie = synthetic(300)
    trace = {r["seed"]: r["accuracy"] for r in tie["runs"] if r["method"] == "trace"}
    for run in tie["runs"]:
        if run["method"] == "tis_sc":
            run["accuracy"] = trace[run["seed"]]
    verdicts = {c["claim"]: c for c in science.claims(tie)}
    assert verdicts["TRACE >= TIS + score centering"]["ci95"] == [0.0, 0.0]
    assert verdicts["TRACE >= TIS + score centering"]["verdict"] == "holds"


@pytest.mark.parametrize(
    "claim, ci, verdict",
    [
        ("TRACE >= QUADS", [-0.012, -0.002], science.NOT_SEPARABLE),  # the shortfall may lie within 1 point
        ("TRACE >= QUADS", [-0.03, -0.011], science.NOT_HELD),  # worse by more than 1 point
        ("TRACE >= QUADS", [-0.009, 0.02], "holds"),
        ("TRACE close to BF16 (BF16 rollout)", [0.005, 0.02], science.NOT_SEPARABLE),  # holds the 1-point bound
        ("TRACE close to BF16 (BF16 rollout)", [0.011, 0.02], science.NOT_HELD),
        ("TRACE close to BF16 (BF16 rollout)", [-0.009, 0.009], "holds"),
    ],
)
def test_a_threshold_inside_the_interval_is_not_separable(monkeypatch, claim, ci, verdict):
    """docs/results.md's rule: an interval holding 0 or the claim's threshold
    (1 point for >= and close) is not separable; one past it does not hold."""
    monkeypatch.setattr(science, "difference", lambda data, a, b: {"difference": sum(ci) / 2, "ci95": ci, "pairs": 600})
    verdicts = {c["claim"]: c["verdict"] for c in science.claims(synthetic(20))}
    assert verdicts[claim] == verdict


def test_too_few_prompts_give_no_verdict():
    assert {c["verdict"] for c in science.claims(synthetic(20))} == {"too few prompts (40 < 100)"}


def test_quick_mode_runs_every_method_and_resumes(tmp_path):
    output = tmp_path / "science.json"
    command = [sys.executable, "benchmarks/science.py", "--quick", "--output", str(output)]
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    figures = json.loads(done.stdout.strip().splitlines()[-1])
    data = json.loads(output.read_text())
    assert sorted(r["method"] for r in data["runs"]) == sorted(science.METHODS)
    assert all(r["history"] and r["accuracy"] for r in data["runs"])
    assert {a["policy"] for a in figures["accuracy"]} >= {*science.METHODS, "ptq:nvfp4", "initial (base)"}
    assert {c["claim"] for c in figures["claims"]} >= {
        "TRACE > QAT (FP4 rollout)",
        "TRACE close to BF16 (BF16 rollout)",
    }
    assert output.with_suffix(".md").read_text().startswith("Command: `python benchmarks/science.py --quick")
    again = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert again.returncode == 0 and "seed 0" not in again.stdout  # every (seed, method) was done: nothing reruns
    assert json.loads(output.read_text())["runs"] == data["runs"]


def test_bootstrap_probe_names_its_levers_and_renders_a_results_section():
    args = argparse.Namespace(
        seeds=1,
        rounds=12,
        bootstrap_only=True,
        quick=False,
        train_size=2353,
        sft_steps=1000,
        sft_lr=0.001,
        sft_weight_decay=0.0,
        sft_extra=0,
        output=Path("docs/results/bootstrap_probe.json"),
    )
    command = science.command_of(args)
    assert command == (
        "python benchmarks/science.py --bootstrap-only --seeds 1 --train-size 2353 --sft-lr 0.001 "
        "--output docs/results/bootstrap_probe.json"
    )
    boot = {"steps": 2000, "learning_rate": 0.001, "eval_prompts": 64, "target_accuracy": 0.4}
    data = {
        "command": command,
        "config": {"tasks": [{"train_size": 2353, "test_size": 500}], "bootstrap": boot},
        "bootstraps": {
            "0": {"bootstrap_accuracy": 0.32, "bootstrap_steps": 700, "bootstrap_loss": 0.5, "train_accuracy": 0.9}
        },
    }
    section = science.probe_section(data)
    assert section["command"] == command and section["title"] == (
        "Bootstrap probe: 2353 training problems, 2000 SFT steps at most, learning rate 0.001"
    )
    assert "| 0 | 700 | 0.500 | 32.0% | [28.1, 36.2] | yes | 90.0% |" in section["markdown"]  # 160 of 500
    assert "reaches 40%" in section["markdown"]

    args.train_size, args.sft_lr, args.sft_weight_decay, args.sft_extra = 2000, None, 0.1, 20000
    command = science.command_of(args)
    assert command == (
        "python benchmarks/science.py --bootstrap-only --seeds 1 --sft-weight-decay 0.1 --sft-extra 20000 "
        "--output docs/results/bootstrap_probe.json"
    )
    config = science.science_config(0, 12, sft_weight_decay=0.1, sft_extra=20000)
    assert config.bootstrap.weight_decay == 0.1 and [e.model_dump() for e in config.bootstrap.extra_problems] == [
        {"name": "countdown", "difficulty": 2, "size": 20000}
    ]
    data["config"] = json.loads(config.model_dump_json(include={"tasks", "bootstrap"}))
    section = science.probe_section(data)
    assert section["title"] == (
        "Bootstrap probe: 2000 training problems + 20000 extra, 1000 SFT steps at most, learning rate 0.003, "
        "AdamW weight decay 0.1"
    )
    assert "and 20000 countdown problems at difficulty 2" in section["markdown"]


def test_a_resumed_run_with_other_settings_is_refused_before_any_work(tmp_path):
    """Finished (seed, method) runs are skipped on a resume: with other settings they would be pooled with the new
    ones under the new command."""
    output = tmp_path / "science.json"
    recorded = science.settings(science.quick_config(0, 2))  # two rounds; --quick runs one
    output.write_text(json.dumps({"runs": [], "config": recorded, "command": "python benchmarks/science.py --x"}))
    command = [sys.executable, "benchmarks/science.py", "--quick", "--output", str(output)]
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 1 and "holds runs made with other settings (rl differ)" in done.stderr
    assert "resume with their command (python benchmarks/science.py --x)" in done.stderr
    assert "seed 0" not in done.stdout


def test_bootstrap_probe_refuses_the_science_runs_output():
    command = [sys.executable, "benchmarks/science.py", "--bootstrap-only"]
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and "not the science run's docs/results/science.json" in done.stderr
