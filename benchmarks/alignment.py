"""Layer coverage x bit depth x training precision: what decides how far the
training path rounds from its FP4 rollout, measured two ways side by side.

From one bootstrapped base, each seed rolls out a batch under NVFP4 W/A + KV
with a full capture (codes, scales and the values before quantization). Then,
under each ``train.precision`` (bf16 parameters, fp32 master weights under
autocast), the training path runs over the same tokens without an update
(``Trainer.teacher_force``), for RTN (vanilla QAT: no guidance) and for R-1
and R-4 guidance on four layer coverages:

- ``all``, ``deeper`` (the deeper half of the layers), ``shallow`` (the
  shallow half);
- ``adaptive``: the layers with the highest LOCAL RTN flip rate (below), taken
  in that order while the guided elements stay within half of all captured
  elements: the budget of a half, so it costs what ``deeper`` and ``shallow``
  cost (equal layers: the half with the most own flips). Its rates come from
  the same rollout here; in a run they would come from an earlier step.

END TO END: the training path's codes against the rollout's (the share of
captured elements on another codeword) and the train-rollout |logprob diff|.
A flip in one layer changes every later layer's inputs, so this counts
inherited flips too.

LOCAL: each layer's inputs held to the rollout's values. One forward is
guided with the rollout's full codes at every site (R-4 on all layers), so
every FP4 site hands the next layer the rollout's values (except the rare
element the rollout put two or more codewords away, which R-4 cannot reach:
the R-4 ``all`` row's local mismatch is that share); its inputs at each site
are then re-rounded RTN or under each configuration's guidance
(``mismatch.rounded``) and compared with the rollout's codes: a site's own
flip rate, and the share of those flips one codeword apart.

    python benchmarks/alignment.py [--preset tiny] [--seeds 2] [--prompts 8] [--group 4]
        [--new-tokens 24] [--bootstrap-steps 0] [--precision bf16 fp32_master]
    python benchmarks/alignment.py --quick   # CI: the smoke model, one seed

Prints the table, the per-layer audit (local RTN flips against end-to-end QAT
mismatch per layer: the cascade), then one JSON line, which names its command;
``--output FILE`` also writes it there (docs/results/alignment.json feeds
benchmarks/results_page.py).
"""

import argparse
import copy
import json
import sys
import tempfile
from dataclasses import replace
from pathlib import Path

import torch

from tracefp4.components import steps
from tracefp4.components.capture import CaptureConfig, CaptureRecords
from tracefp4.components.checkpoint import load_model
from tracefp4.components.choices import PRECISIONS
from tracefp4.components.device import cpu_kind
from tracefp4.components.guidance import GuidanceLoader, compact, write_step
from tracefp4.components.mismatch import MismatchTally, compare, rounded
from tracefp4.components.rollout import TorchEngine
from tracefp4.components.stats import paired_bootstrap
from tracefp4.components.store import LocalStore, write_atomic
from tracefp4.components.tasks import format_example
from tracefp4.components.tokenizer import load_tokenizer
from tracefp4.components.trainer import Trainer
from tracefp4.schemas import RunConfig, get_preset

COVERAGES = ("all", "deeper", "shallow", "adaptive")
BITS = (1, 4)
RUN_ID = "alignment"


def bench_config(args) -> RunConfig:
    data = get_preset(args.preset).model_dump()
    data.update(name="alignment", method="trace")
    data["model"]["dtype"] = "bfloat16"  # the rollout's compute dtype, against which both precisions train
    if args.bootstrap_steps:
        data["bootstrap"].update(steps=args.bootstrap_steps, warmup=min(30, args.bootstrap_steps // 10))
    data["rollout"].update(prompts_per_step=args.prompts, group_size=args.group, max_new_tokens=args.new_tokens)
    return RunConfig.model_validate(data)


def adaptive_layers(local_rates: dict[int, float], elements: dict[int, int]) -> tuple[int, ...]:
    """The rule of ``adaptive``: layers by descending local RTN flip rate (the
    shallower first on a tie), each taken while the guided elements stay
    within half of all captured elements."""
    budget, chosen, used = sum(elements.values()) / 2, [], 0
    for layer in sorted(local_rates, key=lambda n: (-local_rates[n], n)):
        if used + elements[layer] <= budget:
            chosen.append(layer)
            used += elements[layer]
    return tuple(sorted(chosen))


def coverage_layers(name: str, layers: list[int], adaptive: tuple[int, ...]) -> tuple[int, ...]:
    half = len(layers) // 2
    return {"all": tuple(layers), "deeper": tuple(layers[-half:]), "shallow": tuple(layers[:half])}.get(name, adaptive)


def rollout(config: RunConfig, policy: Path, seed: int):
    """One seed's batch under the config's FP4 rollout, with a full capture that keeps the inputs."""
    tokenizer = load_tokenizer(policy)
    r = config.rollout
    problems = steps.training_problems(config, seed, r.prompts_per_step)
    prompts = [tokenizer.encode_prompt(format_example(p)) for p in problems for _ in range(r.group_size)]
    engine = TorchEngine(
        load_model(policy),
        steps.rollout_quant(config),
        dtype=steps.compute_dtype(config),
        device=steps.step_device(config),
        capture=CaptureConfig(max_tokens=r.max_tokens_per_forward, inputs=True),
        calibration_seed=config.seed,
    )
    trajectories = engine.generate(prompts, steps.sampling(config, tokenizer, "alignment", seed))
    return engine, trajectories, engine.drain_capture()


def summary(records: CaptureRecords, training: CaptureRecords) -> dict:
    """Mismatch of ``training``'s codes against the rollout's: overall, by layer, one-codeword share."""
    tally = MismatchTally()
    tally.add(compare(records, training))
    out = tally.summary()
    flips = sum(out["codeword_diff_hist"].values())
    out["one_codeword_share"] = out["codeword_diff_hist"].get(1, 0) / flips if flips else None
    return out


def measure_seed(config: RunConfig, policy: Path, seed: int, precisions: list[str], store: LocalStore) -> dict:
    """Every (precision, guidance) row of one seed: local and end-to-end mismatch."""
    engine, trajectories, records = rollout(config, policy, seed)
    layers = sorted({layer for layer, _ in records.tables})
    elements = {n: sum(t.codes.shape[0] * t.width for (m, _), t in records.tables.items() if m == n) for n in layers}
    microbatches = None
    loaders = 0

    def loader(bits: int, chosen: tuple[int, ...]) -> GuidanceLoader:
        nonlocal loaders
        loaders += 1  # one store step per guidance written
        step = seed * 1000 + loaders
        write_step(store, compact(records, bits, chosen), rl_step=step, policy_version=0, top_k=engine.model.cfg.top_k)
        return GuidanceLoader(store, step, microbatches)

    out = {"seed": seed, "trajectories": len(trajectories), "layers": layers, "elements_by_layer": elements, "rows": []}
    base = load_model(policy)
    for precision in precisions:
        trainers = {
            method: Trainer(
                copy.deepcopy(base),
                replace(steps.train_config(config), method=method, precision=precision),
                engine.quant,
                engine.global_scales,
            )
            for method in ("qat", "trace")
        }
        microbatches = [[t.id for t in mb] for mb in trainers["trace"].microbatches(trajectories)]
        held = trainers["trace"].teacher_force(trajectories, loader(4, tuple(layers)), records).records
        codes_only = CaptureRecords({k: replace(t, inputs=None) for k, t in records.tables.items()})
        rtn_local = summary(codes_only, rounded(held, CaptureRecords()))
        adaptive = adaptive_layers(rtn_local["code_mismatch_by_layer"], elements)
        configs = [("rtn", 0, ())] + [
            (coverage, bits, coverage_layers(coverage, layers, adaptive)) for bits in BITS for coverage in COVERAGES
        ]
        for coverage, bits, chosen in configs:
            guidance = compact(records, bits, chosen) if bits else CaptureRecords()
            local = rtn_local if not bits else summary(codes_only, rounded(held, guidance))
            trainer = trainers["trace" if bits else "qat"]
            forward = trainer.teacher_force(trajectories, loader(bits, chosen) if bits else None, codes_only)
            e2e = summary(codes_only, forward.records)
            alignment = forward.alignment(trainer.config.tis_cap)
            per_sequence = ((forward.logprobs - forward.rollout_logprobs).abs() * forward.mask).sum(1)
            out["rows"].append(
                {
                    "precision": precision,
                    "coverage": coverage,
                    "bits": bits,
                    "guided_layers": list(chosen),
                    "local_mismatch": local["code_mismatch"],
                    "local_mismatch_by_layer": local["code_mismatch_by_layer"],
                    "local_one_codeword_share": local["one_codeword_share"],
                    "e2e_mismatch": e2e["code_mismatch"],
                    "e2e_mismatch_by_layer": e2e["code_mismatch_by_layer"],
                    "e2e_one_codeword_share": e2e["one_codeword_share"],
                    "guidance_coverage": forward.guidance_coverage,
                    "logprob_abs_diff_per_sequence": (per_sequence / forward.mask.sum(1)).tolist(),
                    **{k: alignment[k] for k in ("logprob_abs_diff_mean", "logprob_abs_diff_max", "k3_kl")},
                }
            )
    return out


def label(row: dict) -> str:
    return "RTN (qat)" if not row["bits"] else f"R-{row['bits']} {row['coverage']}"


def prompt_clusters(seeds: list[dict], group: int) -> list[str]:
    """The prompt of each sequence :func:`aggregate` pools (seed by seed, in
    request order, a prompt's ``group`` responses together), as "seed/prompt":
    responses to one prompt are alike, so the paired bootstrap resamples
    prompts, then their responses, rather than counting each response as
    independent evidence."""
    return [
        f"{s}/{i // group}"
        for s, run in enumerate(seeds)
        for i in range(len(run["rows"][0]["logprob_abs_diff_per_sequence"]))
    ]


def aggregate(seeds: list[dict]) -> list[dict]:
    """One row per (precision, guidance): each figure's mean over the seeds, the per-sequence |logprob diff| pooled."""
    pooled = {}
    for run in seeds:
        for row in run["rows"]:
            pooled.setdefault((row["precision"], label(row)), []).append(row)
    out = []
    for (precision, name), rows in pooled.items():
        out.append(
            {
                "precision": precision,
                "guidance": name,
                "guided_layers": sorted({tuple(r["guided_layers"]) for r in rows}),
                **{
                    key: _mean(rows, key)
                    for key in (
                        "local_mismatch",
                        "local_one_codeword_share",
                        "e2e_mismatch",
                        "e2e_one_codeword_share",
                        "logprob_abs_diff_mean",
                        "k3_kl",
                        "guidance_coverage",
                    )
                },
                "per_sequence": [x for r in rows for x in r["logprob_abs_diff_per_sequence"]],
                "local_by_layer": _mean_by_layer(rows, "local_mismatch_by_layer"),
                "e2e_by_layer": _mean_by_layer(rows, "e2e_mismatch_by_layer"),
            }
        )
    return out


def _mean(rows: list[dict], key: str) -> float | None:
    values = [r[key] for r in rows if r[key] is not None]
    return sum(values) / len(values) if values else None


def _mean_by_layer(rows: list[dict], key: str) -> dict:
    layers = sorted({layer for r in rows for layer in r[key]})
    return {n: sum(r[key].get(n, 0.0) for r in rows) / len(rows) for n in layers}


def fmt(x, spec=".4f") -> str:
    return "-" if x is None else format(x, spec)


def report(table: list[dict], precisions: list[str], clusters: list[str]) -> dict:
    """Prints the tables; returns the paired comparisons (|logprob diff| per sequence, 95% bootstrap over
    the sequences' prompts, ``clusters``: :func:`prompt_clusters`)."""
    print(
        "| precision | guidance | guided layers | local mismatch | local 1-codeword share | e2e mismatch | "
        "e2e 1-codeword share | logprob abs diff mean | k3 KL | e2e reduction kept (of R-4 all) |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|")
    by = {(r["precision"], r["guidance"]): r for r in table}
    for r in table:
        rtn, r4 = by[(r["precision"], "RTN (qat)")], by[(r["precision"], "R-4 all")]
        span = rtn["e2e_mismatch"] - r4["e2e_mismatch"]
        kept = (rtn["e2e_mismatch"] - r["e2e_mismatch"]) / span if span else None
        r["e2e_reduction_kept"] = kept
        layers = "; ".join(str(list(g)) for g in r["guided_layers"])
        print(
            f"| {r['precision']} | {r['guidance']} | {layers} | {fmt(r['local_mismatch'])} | "
            f"{fmt(r['local_one_codeword_share'], '.3f')} | {fmt(r['e2e_mismatch'])} | "
            f"{fmt(r['e2e_one_codeword_share'], '.3f')} | {fmt(r['logprob_abs_diff_mean'], '.5f')} | "
            f"{fmt(r['k3_kl'], '.2e')} | {fmt(kept, '.1%')} |"
        )
    print("\nPer layer, RTN (vanilla QAT): its own flips (local) against what it meets end to end (the cascade):\n")
    print("| precision | layer | local RTN flip rate | e2e QAT mismatch |")
    print("|---|---|---|---|")
    for precision in precisions:
        rtn = by[(precision, "RTN (qat)")]
        for layer, rate in rtn["local_by_layer"].items():
            print(f"| {precision} | {layer} | {rate:.4f} | {rtn['e2e_by_layer'].get(layer, 0.0):.4f} |")
    print("\n|logprob diff| per sequence, paired over the same sequences (mean difference, 95% bootstrap interval):\n")
    pairs = {}
    for precision in precisions:
        for a, b in (("R-1 shallow", "R-1 deeper"), ("R-1 adaptive", "R-1 deeper"), ("R-1 all", "RTN (qat)")):
            x, y = by[(precision, a)]["per_sequence"], by[(precision, b)]["per_sequence"]
            diff, low, high = paired_bootstrap(x, y, clusters=clusters)
            pairs[f"{precision}: {a} - {b}"] = {"difference": diff, "ci95": [low, high], "sequences": len(x)}
            print(f"- {precision}: {a} - {b}: {diff:+.5f} [{low:+.5f}, {high:+.5f}] over {len(x)} sequences")
    if {"bf16", "fp32_master"} <= set(precisions):
        x, y = by[("fp32_master", "RTN (qat)")]["per_sequence"], by[("bf16", "RTN (qat)")]["per_sequence"]
        diff, low, high = paired_bootstrap(x, y, clusters=clusters)
        pairs["RTN (qat): fp32_master - bf16"] = {"difference": diff, "ci95": [low, high], "sequences": len(x)}
        print(f"- RTN (qat): fp32_master - bf16: {diff:+.5f} [{low:+.5f}, {high:+.5f}] over {len(x)} sequences")
    return pairs


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--preset", default="tiny")
    parser.add_argument("--seeds", type=int, default=2)
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--group", type=int, default=4)
    parser.add_argument("--new-tokens", type=int, default=24)
    parser.add_argument("--bootstrap-steps", type=int, default=0, help="SFT steps of the base (0: the preset's)")
    parser.add_argument("--precision", nargs="+", choices=PRECISIONS, default=list(PRECISIONS))
    parser.add_argument("--quick", action="store_true", help="the smoke model, one seed, 2 prompts x 2 (CI)")
    parser.add_argument("--output", type=Path, help="also write the JSON line to this file")
    args = parser.parse_args(argv)
    command = " ".join(["python benchmarks/alignment.py", *(sys.argv[1:] if argv is None else argv)])
    if args.quick:
        args.preset, args.seeds, args.prompts, args.group, args.new_tokens = "smoke", 1, 2, 2, 8
    if args.seeds < 1:
        parser.error("--seeds must be at least 1")
    config = bench_config(args)
    torch.manual_seed(config.seed)
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        bootstrap = steps.prepare(config, work / "base", RUN_ID)
        store = LocalStore(work / "store")
        seeds = [measure_seed(config, work / "base", seed, args.precision, store) for seed in range(args.seeds)]
    print(
        f"Base: preset {args.preset} after bootstrap SFT ({bootstrap}); {args.seeds} seed(s) x "
        f"{args.prompts} prompts x {args.group} responses, {args.new_tokens} new tokens, rollout "
        f"{config.rollout.config} ({config.rollout.fmt}). Means over seeds:\n"
    )
    table = aggregate(seeds)
    pairs = report(table, args.precision, prompt_clusters(seeds, args.group))
    for row in table:
        del row["per_sequence"]
    result = {
        "command": command,
        "machine": cpu_kind(),  # the CPU's kernels set the bits: docs/results.md names it beside each figure
        "preset": args.preset,
        "group": args.group,  # responses a prompt: they sit together in each row's per-sequence list
        "bootstrap": bootstrap,
        "table": table,
        "paired": pairs,
    }
    line = json.dumps(result | {"seeds": seeds})
    if args.output:
        write_atomic(args.output, lambda f: f.write(f"{line}\n".encode()))
    print(line)


if __name__ == "__main__":
    main()
