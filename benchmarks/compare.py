"""The full comparison on the tiny preset: bootstrap the base policy once, then
run every method from it for the same RL steps with the same seeds through the
comparison pipeline (kfp.local), then evaluate each final policy under BF16 and
the FP4 rollout (and, for the bf16 method, the PTQ baselines).

    python benchmarks/compare.py [--methods bf16,qat,quads,trace,tis_sc] [--rounds 3] [--output runs/compare]

Prints the comparison report, then one JSON line: the final FP4 accuracy
(pass@1 under the preset's FP4 rollout config, averaged over tasks) of every
method and PTQ baseline, the bootstrapped base's under each method's rollout,
and the BF16 reference (the bf16 method's policy evaluated under BF16 rollout).
"""

import argparse
import json
import time
from pathlib import Path

from tracefp4.components.steps import prepare
from tracefp4.pipelines.local import run_local
from tracefp4.schemas import get_preset


def _mean_pass1(rows: list[dict], policy: str, rollout: str) -> float | None:
    values = [r["pass@1"] for r in rows if r["policy"] == policy and r["rollout"] == rollout]
    return sum(values) / len(values) if values else None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--methods", default="bf16,qat,quads,trace,tis_sc")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--output", type=Path, default=Path("runs/compare"))
    args = parser.parse_args()
    methods = args.methods.split(",")
    out = args.output.resolve()
    config = get_preset("tiny")
    config.name = "compare"
    config.rl.rounds = args.rounds

    start = time.perf_counter()
    base = out / "base"
    bootstrap = prepare(config, base)  # once, for every method
    config.model = config.model.model_copy(update={"preset": None, "checkpoint": str(base)})
    config.bootstrap.enabled = False
    run = out / "run"  # a run folder of its own: the base beside it is no run's
    report = run_local(config, run, methods=methods)
    print(report.read_text())

    fp4 = next(c for c in config.evaluation.rollout_configs if c != "bf16")
    results = [json.loads(p.read_text()) for p in sorted(run.glob("pipeline_root/**/evaluate*/results"))]
    figures = {
        "preset": "tiny",
        "rounds": args.rounds,
        "steps_per_round": config.rl.steps_per_round,
        "fp4_rollout": fp4,
        "bootstrap_accuracy": bootstrap["bootstrap_accuracy"],
        "seconds": time.perf_counter() - start,
    }
    accuracy = {}
    for result in results:
        policies = sorted({r["policy"] for r in result["accuracy"]})
        for policy in policies:
            # the base under each method's own rollout: quads' compensates activations, so its differs
            initial = f"initial (bootstrapped base, {result['method']}'s rollout)"
            label = {"trained": result["method"], "initial": initial}.get(policy, policy)
            accuracy[label] = _mean_pass1(result["accuracy"], policy, fp4)
        if result["method"] == "bf16":
            figures["bf16_reference"] = _mean_pass1(result["accuracy"], "trained", "bf16")
    figures["fp4_pass@1"] = accuracy
    print(f"report: {report.with_name('page')} (HTML)")
    print(json.dumps(figures))


if __name__ == "__main__":
    main()
