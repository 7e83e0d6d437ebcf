"""TRACE against vanilla QAT and QUADS in the same FP4 RL loop, through the
pipeline's own round (components/steps.py run_round: rollout -> compaction ->
guided QAT), on the tiny preset bootstrapped once and forked per method: the
same prompts, seeds and number of on-policy steps for every method. Prints,
per method, the train-rollout log-prob |diff| and the code mismatch of its
training path against each step's rollout (full capture), then what guiding
R-1bit on all layers, the deeper half or the shallow half keeps of R-4bit's
reduction of the mismatch: layer coverage, not bit depth, decides it.

    python benchmarks/repro.py [--steps 4] [--prompts 8] [--group 4] [--new-tokens 24]

Prints a markdown table, then one JSON line.
"""

import argparse
import json
import shutil
import tempfile
from pathlib import Path

from tracefp4.components import steps
from tracefp4.schemas import RunConfig, get_preset

RUNS = {  # label: (method, guidance bits, guided layers of the tiny model's 4)
    "qat": ("qat", 4, "all"),
    "quads": ("quads", 4, "all"),
    "trace, R-4bit all layers": ("trace", 4, "all"),
    "trace, R-1bit all layers": ("trace", 1, "all"),
    "trace, R-1bit deeper half": ("trace", 1, [2, 3]),
    "trace, R-1bit shallow half": ("trace", 1, [0, 1]),
}
RUN_ID = "repro"


def config_for(label: str, args, store: Path) -> RunConfig:
    method, bits, layers = RUNS[label]
    data = get_preset("tiny").model_dump()
    data.update(name=f"repro-{list(RUNS).index(label)}", method=method)
    data["rollout"].update(prompts_per_step=args.prompts, group_size=args.group, max_new_tokens=args.new_tokens)
    data["guidance"].update(bits=bits, layers=layers, compaction="offline")
    data["rl"].update(
        schedule="on_policy", steps_per_round=1, rounds=args.steps, measure_mismatch=True, microbatch_size=16
    )
    data["store"]["uri"] = store.as_uri()
    return RunConfig.model_validate(data)


def run(label: str, args, base: Path, work: Path) -> list[dict]:
    """``args.steps`` on-policy rounds of one method from the bootstrapped base policy."""
    config = config_for(label, args, work / "store")
    folder = work / config.name
    shutil.copytree(base, folder / "policy-0")  # a byte copy: its trainer state still pins it
    shutil.copytree(base.with_name("base-state"), folder / "state-0")
    history = []
    for r in range(config.rl.rounds):
        policy, state = folder / f"policy-{r}", folder / f"state-{r}"
        out, out_state = folder / f"policy-{r + 1}", folder / f"state-{r + 1}"
        history += steps.run_round(config, policy, state, r, out, out_state, folder, RUN_ID)
    return history


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--group", type=int, default=4)
    parser.add_argument("--new-tokens", type=int, default=24)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        base_config = config_for("qat", args, work / "store")
        bootstrap = steps.prepare(base_config, work / "base", RUN_ID, work / "base-state")  # the bootstrap SFT, once
        histories = {label: run(label, args, work / "base", work) for label in RUNS}

    def mean(label, key):
        values = [h[key] for h in histories[label] if h.get(key) is not None]
        return sum(values) / len(values) if values else None

    print(f"Base: tiny preset after bootstrap SFT (greedy test accuracy {bootstrap['bootstrap_accuracy']:.1%}).")
    print(f"Means over {args.steps} on-policy RL steps, each step's training path against that step's rollout:\n")
    print(
        "| method | logprob abs diff mean | logprob abs diff max | k3 KL | code mismatch | guidance coverage | reward |"
    )
    print("|---|---|---|---|---|---|---|")
    for label in RUNS:
        mismatch = mean(label, "code_mismatch")
        shown = "n/a (BF16 activations)" if mismatch is None else f"{mismatch:.4f}"
        print(
            f"| {label} | {mean(label, 'logprob_abs_diff_mean'):.5f} | {mean(label, 'logprob_abs_diff_max'):.4f} | "
            f"{mean(label, 'k3_kl'):.2e} | {shown} | {mean(label, 'guidance_coverage'):.3f} | "
            f"{mean(label, 'reward_mean'):.3f} |"
        )
    qat, r4 = mean("qat", "code_mismatch"), mean("trace, R-4bit all layers", "code_mismatch")
    kept = {}
    for coverage in ("all layers", "deeper half", "shallow half"):
        r1 = mean(f"trace, R-1bit {coverage}", "code_mismatch")
        kept[coverage] = (qat - r1) / (qat - r4)
        print(f"R-1bit on {coverage} keeps {kept[coverage]:.1%} of R-4bit-on-all-layers' code-mismatch reduction")
    print(json.dumps({"bootstrap": bootstrap, "histories": histories, "r1_share_of_r4_reduction": kept}))


if __name__ == "__main__":
    main()
