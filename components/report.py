"""The run report, from run artifacts only: the training history (one JSON
line per RL step; round-level keys repeated in every row of the round) and the
evaluation (one JSON object: accuracy, throughput, discrepancy and
guidance-sensitivity rows). It renders the paper's tables and figures as
markdown and as one self-contained HTML page (plots embedded as PNG data
URIs), for one run or side by side for several methods.

How it works: section builders turn the artifacts into a list of blocks
(headings, paragraphs, bullet lists, `Table`s and `Plot`s, all plain data);
`_markdown` and `_html` render the same blocks, so each table is built once.
Plots are drawn (matplotlib, Agg) for the HTML page only. Every table and plot
carries the source line of the run(s) it came from. A missing or null key
skips its cell, its column, its series or the whole plot.
"""

import base64
import html
import io
import json
import textwrap
from dataclasses import dataclass
from pathlib import Path
from typing import get_args

import matplotlib

matplotlib.use("Agg")  # files only, no display
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.ticker import MaxNLocator  # noqa: E402

from tracefp4.schemas import (  # noqa: E402
    Method,
    RolloutConfigName,
    RunConfig,
    TaskConfig,
    changed_settings,
    settings_yaml,
)

from .device import hardware_words  # noqa: E402
from .stats import paired_difference  # noqa: E402
from .store import write_atomic  # noqa: E402

ROLLOUTS = get_args(RolloutConfigName)  # row order of every table: bf16 first, as in the paper
METHODS = get_args(Method)
STEP_COLUMNS = (
    "round",
    "step",
    "reward_mean",
    "accuracy",
    "logprob_abs_diff_mean",
    "logprob_abs_diff_max",
    "k3_kl",
    "guidance_coverage",
    "train_seconds",
)
# the per-step table's caption: each column in words (with "staleness", shown where a round trains several steps)
STEP_WORDS = {
    "round": "the round whose rollout the step trained on",
    "step": "the RL step (the policy version it made)",
    "staleness": "RL steps the policy took since that rollout",
    "reward_mean": "mean reward of the step's sampled responses (rollout.prompts_per_step x rollout.group_size)",
    "accuracy": "share of them solved (reward 1)",
    "logprob_abs_diff_mean": (
        "|log pi_train - log pi_rollout| of a response token, the policy the step started from through the "
        "method's training path against the rollout's log-prob, mean over the step's response tokens"
    ),
    "logprob_abs_diff_max": "the same, largest",
    "k3_kl": "k3 estimate of KL(rollout || train), mean over the step's response tokens",
    "guidance_coverage": (
        "share of the guidance's values that rounded a training value (one of a token training routed to "
        "another expert than the rollout did guides nothing: it rounds to nearest)"
    ),
    "train_seconds": "wall seconds of the step's forwards, backwards and optimizer steps, its wait for guidance "
    "and its scoring of the responses (reward) left out",
    "train on": "the machine it trained on",
}
DIFF_SERIES = (("mean", "logprob_abs_diff_mean"), ("max", "logprob_abs_diff_max"), ("min", "logprob_abs_diff_min"))
ROUND_TIMES = (("rollout", "rollout_seconds"), ("upload", "upload_seconds"), ("compaction", "compaction_seconds"))
# summed over the round's steps
STEP_TIMES = (("reward", "reward_seconds"), ("train", "train_seconds"), ("reload", "reload_seconds"))
# where a step measured its figures (steps record device.measured_on after the step's name):
# column -> (the step, in words)
MEASURED_BY = {
    "rollout on": ("rollout", "rollout"),
    "compaction on": ("compaction", "compaction"),
    "train on": ("train", "training"),
}
DISCREPANCY = (
    ("code mismatch", "code_mismatch"),
    ("logprob |diff| mean", "logprob_abs_diff_mean"),
    ("logprob |diff| max", "logprob_abs_diff_max"),
    ("k3 KL", "k3_kl"),
)
DISCREPANCY_COUNTS = {"trajectories": "trajectories", "response tokens": "response_tokens"}  # what it covered
DISCREPANCY_NOTE = (
    "code mismatch: share of the captured FP4 values (activations and KV, at prompt and response positions) the "
    "training path rounds to another code than the rollout; logprob |diff|: |log pi_train - log pi_rollout| of a "
    "response token, mean and largest; k3 KL: k3 estimate of KL(rollout || train), mean over the response tokens."
)


# A report is a list of blocks: Heading, paragraph (str), bullet list (list[str]), Code, Table or Plot.


@dataclass
class Heading:
    level: int
    text: str


@dataclass
class Code:
    language: str
    text: str


@dataclass
class Table:
    columns: list[str]
    rows: list[list]  # cells, one list per row; None is an empty cell
    source: str  # the run(s) and config the numbers came from
    title: str = ""
    note: str = ""


@dataclass
class Series:
    label: str
    x: list
    y: list  # None where absent
    band: tuple[list, list] | None = None  # (low, high) shaded around a line


@dataclass
class Plot:
    title: str  # also the <img> alt
    xlabel: str
    ylabel: str
    series: list[Series]
    source: str
    kind: str = "lines"  # lines | bars (grouped) | stacked
    logy: bool = False
    note: str = ""


def load(history_file: str | Path, evaluation_file: str | Path) -> tuple[list[dict], dict]:
    history = [json.loads(line) for line in Path(history_file).read_text().splitlines() if line.strip()]
    return history, json.loads(Path(evaluation_file).read_text())


def describe(config: RunConfig, methods: list[str] | None = None) -> str:
    """The run and its configuration in one line; with `methods`, the runs of a comparison (one per method)."""
    who = f"method `{config.method}`" if methods is None else "methods " + ", ".join(f"`{m}`" for m in methods)
    guidance = f"R-{config.guidance.bits}bit on {guided_layers(config.guidance.layers)}"
    if methods is None:
        guidance = f"guidance {guidance}, " if config.method == "trace" else ""
    else:  # only trace's run is guided
        guidance = f"`trace` guided {guidance}, " if "trace" in methods else ""
    return (
        f"run `{config.name}`: {who}, rollout `{config.rollout.config}` ({config.rollout.fmt}), {guidance}"
        f"model `{config.model.preset or config.model.checkpoint}`, seed {config.seed}"
    )


def guided_layers(layers: str | int | list[int]) -> str:
    """``guidance.layers`` in words: 'all', N or a list of indices would read alike as "layers `2`"."""
    if layers == "all":
        return "every layer with FP4 sites"
    if isinstance(layers, int):
        return f"the deepest {layers} layer{'s' * (layers != 1)} with FP4 sites"
    return f"layers {list(layers)}"


# -- small helpers over rows -------------------------------------------------------------------------------------


def _rank(value, canonical) -> int:
    return canonical.index(value) if value in canonical else len(canonical)


def _ordered(values, canonical=()) -> list:
    """Distinct non-null values, those in `canonical` first in its order, the rest in order of appearance."""
    seen = list(dict.fromkeys(v for v in values if v is not None))
    return sorted(seen, key=lambda v: (_rank(v, canonical), seen.index(v)))


def _mean(values) -> float | None:
    """Mean of all values, or None if any is missing (an average over part of the tasks would mislead)."""
    values = list(values)
    return None if not values or any(v is None for v in values) else sum(values) / len(values)


def _first(rows: list[dict], key: str):
    return next((r[key] for r in rows if r.get(key) is not None), None)


def _last(rows: list[dict], key: str):
    return _first(rows[::-1], key)


def _col(rows: list[dict], key: str) -> list:
    return [r.get(key) for r in rows]


def _sum(rows: list[dict], key: str):
    values = [r[key] for r in rows if r.get(key) is not None]
    return sum(values) if values else None


def _max(rows: list[dict], key: str):
    return max((r[key] for r in rows if r.get(key) is not None), default=None)


def _rewards_are_accuracy(history: list[dict]) -> bool:
    """Whether a history has steps and every one's mean reward equals its accuracy (rewards of 0 or 1): a table then
    shows one column for the two, not two equal ones that read as two measurements."""
    return bool(history) and all(
        h.get("reward_mean") is not None and h.get("reward_mean") == h.get("accuracy") for h in history
    )


def _steps(history: list[dict]) -> list:
    """x axis of per-step plots: the step numbers when they increase throughout, else 1..N."""
    steps = [h.get("step") for h in history]
    if all(isinstance(s, int) for s in steps) and all(a < b for a, b in zip(steps, steps[1:])):
        return steps
    return list(range(1, len(history) + 1))


def _by_int_key(d: dict | None) -> dict:
    """A by-layer / histogram dict (JSON keys are strings) with int keys, in numeric order."""
    return dict(sorted((int(k), v) for k, v in (d or {}).items()))


def _table(rows: list[dict], columns, source: str, keep: int = 1, **kw) -> Table:
    """Rows of dicts as a Table; a column past the first `keep` that no row fills is dropped."""
    columns = [c for i, c in enumerate(columns) if i < keep or any(r.get(c) is not None for r in rows)]
    return Table(columns, [[r.get(c) for c in columns] for r in rows], source, **kw)


def _on(device: str | None, cpu_bf16: str | None) -> str | None:
    """A machine as a figure measured on it names it: its device in words (:func:`.device.hardware_words`)
    and, on a CPU, its bf16 mode (native, or emulated in fp32: docs/performance.md)."""
    return None if device is None else device + (f", bf16 {cpu_bf16}" if cpu_bf16 else "")


def _measured_on(rows: list[dict], column: str) -> str | None:
    """Where the step of a :data:`MEASURED_BY` ``column`` measured the figures of history ``rows``, each machine
    once (a round's steps resumed on another): None where no row says (written before it was recorded)."""
    step, _ = MEASURED_BY[column]
    return "; ".join(_ordered(_on(r.get(f"{step}_device"), r.get(f"{step}_cpu_bf16")) for r in rows)) or None


def _speed_table(rows: list[dict], columns: list[str], source: str, keep: int, note: str = "", **kw) -> Table:
    """:func:`_table` of figures beside where they were measured (:data:`MEASURED_BY` columns): a machine
    every row shares is said once, in the note, with every step it measured ("Rollout and training measured
    on ..."), and its column left out; others stay per row."""
    shared: dict[str, list[str]] = {}  # machine -> the steps every row measured on it
    for column in MEASURED_BY:
        machines = {r.get(column) for r in rows}
        if column in columns and len(machines) == 1 and None not in machines:
            shared.setdefault(machines.pop(), []).append(column)
    columns = [c for c in columns if c not in {c for steps in shared.values() for c in steps}]
    said = []
    for machine, steps in shared.items():
        names = [MEASURED_BY[c][1] for c in steps]
        listed = names[0] if len(names) == 1 else f"{', '.join(names[:-1])} and {names[-1]}"
        said.append(f"{listed.capitalize()} measured on {machine}.")
    return _table(rows, columns, source, keep=keep, note=" ".join([note, *said]).strip(), **kw)


def _plot(title: str, xlabel: str, ylabel: str, series: list[Series], source: str, **kw) -> Plot | None:
    """A Plot of the series that hold data; None (no plot) when none does."""
    series = [s for s in series if any(y is not None for y in s.y)]
    return Plot(title, xlabel, ylabel, series, source, **kw) if series else None


# -- tables and plots ----------------------------------------------------------------------------------------------


def _discrepancy(row: dict) -> dict:
    """An evaluation's discrepancy record as table cells: what it covered (counts absent from older records are
    left out with their column), then its figures."""
    return {label: row.get(key) for label, key in (*DISCREPANCY_COUNTS.items(), *DISCREPANCY)}


def _exact(row: dict) -> str | None:
    """What a discrepancy record's figures of exactly 0 mean, in words, so that they do not read as a measurement
    that failed; None where its code mismatch is not 0 (or not measured: a training path that does not quantize)."""
    if row.get("code_mismatch") != 0:
        return None
    tokens, trajectories = row.get("response_tokens"), row.get("trajectories")
    said = f"Under `{row.get('rollout')}` the training path rounded every captured FP4 value to the rollout's code"
    if all(row.get(key) == 0 for _, key in DISCREPANCY):
        covered = f"the {tokens} response tokens" if tokens is not None else "the response tokens"
        if tokens is not None and trajectories:
            covered += f" ({tokens / trajectories:.3g} a trajectory)"
        said += f" and reproduced the rollout's log-prob of each of {covered}: every figure is exactly 0"
    return said + "."


def _accuracy_rows(rows: list[dict], methods=METHODS) -> tuple[list[str], list[dict]]:
    """One dict per (method, policy, rollout): per task pass@1 and mean@k, and their averages over tasks."""
    tasks = _ordered(r.get("task") for r in rows)
    rank = {
        "rollout": _ordered((r.get("rollout") for r in rows), ROLLOUTS),
        "method": _ordered((r.get("method") for r in rows), tuple(methods)),
        "policy": _ordered((r.get("policy") for r in rows), ("initial", "trained")),
    }
    cells: dict[tuple, dict] = {}
    for r in sorted(rows, key=lambda r: tuple(_rank(r.get(k), rank[k]) for k in rank)):
        cells.setdefault((r.get("method"), r.get("policy"), r.get("rollout")), {})[r.get("task")] = r
    out = []
    for (method, policy, rollout), by_task in cells.items():
        row = {"method": method, "policy": policy, "rollout": rollout}
        for metric in ("pass@1", "mean@k"):
            row |= {f"{t} {metric}": by_task.get(t, {}).get(metric) for t in tasks}
            row[f"avg {metric}"] = _mean(row[f"{t} {metric}"] for t in tasks)
        row |= {f"{t} pass@1 95% CI": _interval(by_task.get(t, {}).get("pass@1_ci95")) for t in tasks}
        out.append(row)
    return tasks, out


def _interval(bounds) -> str | None:
    return f"[{bounds[0]:.3f}, {bounds[1]:.3f}]" if bounds else None


def _accuracy_table(rows: list[dict], source: str, bootstrapped: bool, methods=METHODS) -> Table:
    """The paper's main table: a row per (method, policy, rollout), a column group per task, then the average."""
    tasks, out = _accuracy_rows(rows, methods)
    metrics = ("pass@1", "pass@1 95% CI", "mean@k")
    columns = ["method", "policy", "rollout", *(f"{t} {m}" for t in tasks for m in metrics)]
    ks = ", ".join(map(str, _ordered(r.get("k") for r in rows))) or "?"
    counts = {r.get("task"): r.get("prompts") or "?" for r in rows}  # each its whole test split: test_prompts 0
    if len(set(counts.values())) == 1:
        prompts = f"{next(iter(counts.values()))} test prompts per task"
    else:
        prompts = ", ".join(f"{n} ({task})" for task, n in counts.items()) + " test prompts"
    note = (
        f"pass@1 (greedy; 95% Wilson interval) and mean@k (k = {ks}) over {prompts}; "
        "avg is the mean over tasks. "
        f"Policy initial: where RL started{' (after bootstrap)' * bootstrapped}; trained: after RL; "
        "ptq:<scheme>: post-training FP4."
    )
    if not any(r.get("pass@1") or r.get("mean@k") for r in rows):  # a zero interval and "alike" read as a failure
        note += (
            " No policy solved a test prompt: the accuracies and their comparisons say nothing of the methods here "
            "(a policy as small or as briefly trained as the smoke preset's solves none)."
        )
    return _table(out, [*columns, "avg pass@1", "avg mean@k"], source, keep=3, note=note)


def _ablation_table(evaluation: dict, source: str, fmt: str) -> Table | None:
    """The trained policy under each rollout config (their FP4 in the run's
    ``fmt``): accuracy, throughput and discrepancy side by side."""
    method = evaluation.get("method")
    acc = [r for r in evaluation.get("accuracy") or [] if r.get("policy", "trained") == "trained"]
    acc = [r for r in acc if r.get("method", method) == method]
    throughput = {r.get("rollout"): r for r in evaluation.get("throughput") or []}
    discrepancy = {r.get("rollout"): r for r in evaluation.get("discrepancy") or []}
    rollouts = _ordered([r.get("rollout") for r in acc] + list(throughput) + list(discrepancy), ROLLOUTS)
    if not rollouts:
        return None
    tasks = _ordered(r.get("task") for r in acc)
    bf16 = throughput.get("bf16", {}).get("tokens_per_second")
    rows = []
    for rollout in rollouts:
        pass1 = {r.get("task"): r.get("pass@1") for r in acc if r.get("rollout") == rollout}
        tps = throughput.get(rollout, {}).get("tokens_per_second")
        rows.append(
            {
                "rollout": rollout,
                **{f"{t} pass@1": pass1.get(t) for t in tasks},
                "avg pass@1": _mean(map(pass1.get, tasks)),
                "tokens/s": tps,
                "tokens/s vs bf16": tps / bf16 if tps and bf16 else None,
                **_discrepancy(discrepancy.get(rollout, {})),
            }
        )
    columns = ["rollout", *(f"{t} pass@1" for t in tasks), "avg pass@1", "tokens/s", "tokens/s vs bf16"]
    note = (
        f"Policy trained with `{method}`; each config's FP4 in {fmt} (rollout.fmt); discrepancy: its FP4 rollout "
        "against its training forward. tokens/s: this "
        "engine's, which computes FP4 in the compute dtype (expert weights held as their FP4 values, activations and "
        "KV quantized and dequantized): what simulating FP4's rounding costs, not the speed of native FP4 kernels "
        "(Blackwell GPUs under SGLang or vLLM), which the paper's rollout speedups come from."
    )
    return _table(rows, [*columns, *(label for label, _ in DISCREPANCY)], source, note=note)


def _sensitivity_table(rows: list[dict], source: str) -> Table | None:
    """A row per R-k bits, a fidelity and a bits/element column per guided-layer count (the paper's R-kbit-Ln)."""
    rows = [r for r in rows if isinstance(r.get("bits"), int) and isinstance(r.get("layers"), int)]
    if not rows:
        return None
    counts = sorted({r["layers"] for r in rows})
    cells = {(r["bits"], r["layers"]): r for r in rows}
    metrics = (("fidelity", "fidelity"), ("bits/element", "bits_per_element"))
    out = [
        {"guidance": f"R-{b}bit"}
        | {f"L{n} {label}": cells.get((b, n), {}).get(key) for n in counts for label, key in metrics}
        for b in sorted({r["bits"] for r in rows})
    ]
    indices = {n: _first([r for r in rows if r["layers"] == n], "layer_indices") for n in counts}
    layers = "; ".join(f"L{n} = layers {indices[n]}" for n in counts)
    columns = ["guidance", *(f"L{n} {label}" for n in counts for label, _ in metrics)]
    note = (
        f"Ln guides n layers ({layers}); bits/element: the guidance's bits over every captured FP4 element, guided "
        "or not (the compaction's guidance_bits_per_element divides by the guided elements alone)."
    )
    return _table(out, columns, source, note=note)


def _ptq_table(evaluation: dict, source: str) -> Table | None:
    """Post-training FP4 quantization of the BF16-trained policy (ptq:* rows) vs training, FP4 rollouts only."""
    is_ptq = lambda r: str(r.get("policy")).startswith("ptq:")  # noqa: E731
    fp4 = [r for r in evaluation.get("accuracy") or [] if r.get("rollout") != "bf16"]
    fp4 = [r for r in fp4 if is_ptq(r) or r.get("policy") == "trained"]
    if not any(map(is_ptq, fp4)):
        return None
    tasks, rows = _accuracy_rows(fp4)
    trained = {r["rollout"]: r["avg pass@1"] for r in rows if r["policy"] == "trained"}
    for r in rows:
        avg, base = r["avg pass@1"], trained.get(r["rollout"])
        r["avg pass@1 vs trained"] = avg - base if avg is not None and base is not None else None
    rows.sort(key=lambda r: r["policy"] == "trained")  # stable: baselines first, the trained policy last (the paper)
    columns = ["method", "policy", "rollout", *(f"{t} pass@1" for t in tasks), "avg pass@1", "avg pass@1 vs trained"]
    return _table(rows, columns, source, keep=3, note="ptq:<scheme> is the trained policy quantized after training.")


def _discrepancy_blocks(evaluation: dict, source: str) -> list:
    """A summary row per FP4 rollout config, then its per-layer and codeword-difference tables, then the plots."""
    rows = sorted(evaluation.get("discrepancy") or [], key=lambda r: _rank(r.get("rollout"), ROLLOUTS))
    if not rows:
        return ["No FP4 rollout configuration was evaluated."]
    summary = [{"rollout": r.get("rollout"), **_discrepancy(r)} for r in rows]
    columns = ["rollout", *DISCREPANCY_COUNTS, *(label for label, _ in DISCREPANCY)]
    note = f"Final policy: FP4 rollout vs training forward over the same tokens. {DISCREPANCY_NOTE}"
    blocks = [_table(summary, columns, source, note=note), *filter(None, map(_exact, rows))]
    mse_series, hist_series = [], []
    for r in rows:
        rollout = r.get("rollout")
        mismatch = _by_int_key(r.get("code_mismatch_by_layer"))
        mse = _by_int_key(r.get("relative_excess_mse_by_layer"))
        hist = _by_int_key(r.get("codeword_diff_hist"))
        blocks.append(Heading(3, f"`{rollout}`"))
        if not (mismatch or mse or hist):
            blocks.append(f"No per-layer codes: the training path of `{evaluation.get('method')}` does not quantize.")
            continue
        if layers := sorted(set(mismatch) | set(mse)):
            columns = ["layer", "code mismatch", "relative excess MSE"]
            per_layer = [dict(zip(columns, (n, mismatch.get(n), mse.get(n)))) for n in layers]
            blocks.append(_table(per_layer, columns, source, title=f"Per layer, `{rollout}`"))
            blocks.append(
                "Relative excess MSE: (MSE between the two paths' FP4 values - MSE between their values before "
                "quantization) / the latter; -1 where the FP4 values agree exactly, - where the values before "
                "quantization do (no ratio)."
            )
        if total := sum(hist.values()):
            counts = [{"codeword difference": d, "count": c, "share": c / total} for d, c in hist.items()]
            columns = ["codeword difference", "count", "share"]
            blocks.append(_table(counts, columns, source, title=f"Codeword-difference histogram, `{rollout}`"))
        else:
            blocks.append(f"No code differs between the two paths under `{rollout}`: no codeword-difference histogram.")
        mse_series.append(Series(rollout, list(mse), list(mse.values())))
        hist_series.append(Series(rollout, list(hist), list(hist.values())))
    return blocks + [
        _plot(
            "Relative excess MSE per layer",
            "layer",
            "relative excess train-rollout MSE",
            mse_series,
            source,
            kind="bars",
        ),
        _plot(
            "Codeword-difference histogram",
            "codeword difference (mismatched values)",
            "count",
            hist_series,
            source,
            kind="bars",
            logy=True,
        ),
    ]


def _step_blocks(history: list[dict], source: str, steps_per_round: int) -> list:
    """The per-step table, captioned column by column, and its plots. Where every step's mean reward equals its
    accuracy (0/1 rewards) one column shows both. Where a round trains several steps on one rollout, a step's
    train-rollout figures also hold how far the policy moved since: the caption says so, beside each step's staleness.
    """
    if not history:
        return ["No RL steps recorded."]
    x = _steps(history)
    diffs = [Series(label, x, _col(history, key)) for label, key in DIFF_SERIES]
    columns = [*STEP_COLUMNS[:2], "staleness", *STEP_COLUMNS[2:]] if steps_per_round > 1 else list(STEP_COLUMNS)
    words = dict(STEP_WORDS)
    if _rewards_are_accuracy(history):
        columns.remove("accuracy")
        words["reward_mean"] += (
            ", which equals the share of them solved (accuracy) at every step: every reward was 0 or 1"
        )
        rewards = [Series("reward mean = train accuracy (sampled)", x, _col(history, "reward_mean"))]
    else:
        rewards = [
            Series("reward mean", x, _col(history, "reward_mean")),
            Series("train accuracy (sampled)", x, _col(history, "accuracy")),
        ]
    mix = _ordered(task for h in history for task in h.get("task_solved") or {})
    mix = mix if len(mix) > 1 else []  # each task of a mix at its own pace, in the table and the plot
    for task in mix:
        rewards.append(Series(f"{task} train accuracy (sampled)", x, [_solved_share(h, task) for h in history]))
        words[f"{task} accuracy"] = f"share of the step's responses to {task} problems solved"
    after = columns.index("accuracy" if "accuracy" in columns else "reward_mean") + 1
    columns[after:after] = [f"{task} accuracy" for task in mix]
    rows = [
        {**h, "train on": _measured_on([h], "train on"), **{f"{t} accuracy": _solved_share(h, t) for t in mix}}
        for h in history
    ]
    table = _speed_table(rows, [*columns, "train on"], source, keep=2)
    note = "; ".join(f"{c}: {words[c]}" for c in table.columns if c in words) + "."
    if steps_per_round > 1:
        note += (
            f" A round rolls out {steps_per_round} steps' batches from one policy and trains them in turn "
            "(rl.steps_per_round), so a step's train-rollout figures (logprob |diff|, k3 KL) add how far the policy "
            f"moved since the rollout to the FP4 train-rollout mismatch: each round's first step"
            f"{' (staleness 0)' * ('staleness' in table.columns)} measures the mismatch alone."
        )
    table.note = f"{note} {table.note}".strip()
    drift = "Each round's first step is on-policy; the k-th after it trains k policy updates after the round's rollout."
    return [
        table,
        _plot(
            "Train-rollout log-prob |diff|",
            "RL step",
            "|logprob diff|",
            diffs,
            source,
            note=drift if steps_per_round > 1 else "",
        ),
        _plot("Reward and accuracy", "RL step", "per response", rewards, source),
    ]


def _rounds(history: list[dict]) -> dict:
    rounds: dict = {}
    for h in history:
        rounds.setdefault(h.get("round"), []).append(h)
    return rounds


def _time_blocks(history: list[dict], source: str) -> list:
    """Seconds per round (round-level keys once, step-level ones summed), guidance sizes, the stacked plot."""
    if not history:
        return ["No RL steps recorded."]
    times, sizes = [], []
    for rnd, steps in _rounds(history).items():
        row = {"round": rnd, "steps": len(steps)}
        row |= {f"{label} s": _first(steps, key) for label, key in ROUND_TIMES}
        row |= {f"{label} s": _sum(steps, key) for label, key in STEP_TIMES}
        parts = [row[f"{label} s"] for label, _ in (*ROUND_TIMES, *STEP_TIMES) if row[f"{label} s"] is not None]
        row |= {
            "total s": sum(parts) if parts else None,
            "offload s": _first(steps, "offload_seconds"),
            "rollout tokens": _first(steps, "rollout_tokens"),
            "rollout tokens/s": _first(steps, "rollout_tokens_per_second"),
            "capture overhead": _first(steps, "capture_overhead_ratio"),
            **{column: _measured_on(steps, column) for column in MEASURED_BY},
        }
        times.append(row)
        coverage = [c for c in _col(steps, "guidance_coverage") if c is not None]
        sizes.append(
            {
                "round": rnd,
                "guidance bytes": _first(steps, "guidance_bytes"),
                "capture bytes": _first(steps, "capture_bytes"),
                "compaction fidelity": _first(steps, "compaction_fidelity"),
                "guidance coverage (mean)": sum(coverage) / len(coverage) if coverage else None,
                # trajectories without guidance, rounded RTN (guidance.allow_rtn_fallback): shown where there were
                "RTN fallback trajectories": _sum(steps, "guidance_fallback_trajectories") or None,
            }
        )
    parts = [f"{label} s" for label, _ in (*ROUND_TIMES, *STEP_TIMES)]
    note = (
        "rollout, upload and compaction per round; reward (scoring the responses), train and reload summed over "
        "the round's steps; total is their sum. Offload runs asynchronously during the rollout and is not in the total."
    )
    columns = ["round", "steps", *parts, "total s", "offload s", "rollout tokens", "rollout tokens/s"]
    blocks = [_speed_table(times, [*columns, "capture overhead", *MEASURED_BY], source, keep=2, note=note)]
    columns = ["round", "guidance bytes", "capture bytes", "compaction fidelity", "guidance coverage (mean)"]
    columns += ["RTN fallback trajectories"]
    if len((table := _table(sizes, columns, source, title="Guidance data per round")).columns) > 1:
        blocks.append(table)
    stacks = [Series(part.removesuffix(" s"), _col(times, "round"), _col(times, part)) for part in parts]
    return blocks + [_plot("Time breakdown per round", "round", "seconds", stacks, source, kind="stacked")]


# -- the reports --------------------------------------------------------------------------------------------------


def _hardware(evaluations: list[dict]) -> list[str]:
    """Where the evaluations computed, once per distinct machine kind; on a CPU
    that emulates bf16, what that does to the train-rollout figures."""
    lines = []
    for hw in (e.get("hardware") for e in evaluations):
        if not hw:  # an evaluation written before the field
            continue
        line = f"Evaluated on {_on(hardware_words(hw), hw.get('cpu_bf16'))}."
        if hw.get("cpu_bf16") == "emulated":
            line += (
                " This CPU runs bf16 matmuls in fp32, whose sums hardly depend on the batch's shape: training and"
                " rollout round alike, so the train-rollout discrepancy can vanish (`TRACEFP4_CPU_BF16=native`"
                " brings it back, slowly; docs/performance.md)."
            )
        if line not in lines:
            lines.append(line)
    return lines


def _settings_blocks(config: RunConfig, comparison: bool = False) -> list:
    """The run's settings, where they differ from the schema's defaults: two
    reports of one preset otherwise read alike whatever ``--set`` changed. A
    comparison's are every method's run's, but for the method."""
    changed = changed_settings(config)
    if comparison:
        changed.pop("method", None)
    text = (
        "The settings that differ from the schema's defaults: a config file holding them, given to `--config` "
        "alone" + " with `--compare` and the methods above" * comparison + ", asks for these settings again (a "
        "local run's store and metrics file as its run folder made them, its cluster-only settings at their defaults)."
    )
    return [Heading(2, "Settings"), text, Code("yaml", settings_yaml(changed) if changed else "{}\n")]


def _continue_blocks(config: RunConfig, continue_with: dict | None) -> list:
    """How a next run goes on from this one's last round (docs/deploy.md, "Known limit")."""
    if not continue_with:
        return []
    text = (
        "A next run goes on from this one's final policy and trainer state, optimizer and round count "
        "included, with these settings over its config (added to its config file, or as a file for `--config` "
        "beside its `--preset`: a file alone goes over the schema's defaults; `rl.rounds` as many more as it "
        "should run). Locally, `tracefp4 run --continue-from` with this run's folder sets them itself, given the "
        "`--preset`, `--config` and `--set` this run was started with but a `--set` of these (it notes a setting "
        "that differs from this run's)."
    )
    if config.rl.chained:
        text += f" This run's last task, `chain`, submits that run for the {config.rl.rounds_left} rounds left."
    return [Heading(2, "Continue this run"), text, Code("yaml", settings_yaml(continue_with))]


def _solved_share(row: dict, task: str) -> float | None:
    """The share of a step's responses to ``task``'s prompts solved (None where it drew none)."""
    k, n = (row.get("task_solved") or {}).get(task, (0, 0))
    return k / n if n else None


def _tasks_line(config: RunConfig) -> str:
    return f"tasks: {', '.join(map(_task_source, config.tasks))}."


def _task_source(t: TaskConfig) -> str:
    """A task as the report names it: a file's with the file and the bytes it read (their pinned sha256), and
    the reward of its own that scored it; one that is only trained or only evaluated on, saying so."""
    where = [] if t.data is None else [f"`{t.data}`"] + [f"sha256 {t.sha256[:12]}"] * bool(t.sha256)
    if t.reward is not None:
        where += [f"rewarded by `{t.reward}`" + f" (sha256 {t.reward_sha256[:12]})" * bool(t.reward_sha256)]
    where += ["evaluated on only"] * (t.train_size == 0) + ["trained on only"] * (t.test_size == 0)
    return t.name + f" ({', '.join(where)})" * bool(where)


def _run_blocks(config: RunConfig, history: list[dict], evaluation: dict, continue_with: dict | None = None) -> list:
    source = describe(config)
    acc = evaluation.get("accuracy") or []
    rollouts = ", ".join(_ordered((r.get("rollout") for r in acc), ROLLOUTS)) or "none"
    summary = f"RL steps: {len(history)}, rounds: {len(_rounds(history))}; evaluated rollout configs: {rollouts}; "
    summary += _tasks_line(config)
    blocks = [Heading(1, f"tracefp4 run `{config.name}`"), source + ".", summary, *_hardware([evaluation])]
    if config.rl.first_round:  # else only the policy's long path, in the captions, tells two such reports apart
        blocks.insert(
            2,
            f"A continuation: rounds from {config.rl.first_round} (counted from the first run's first), going on "
            f"from the policy `{config.model.checkpoint}` and its trainer state.",
        )
    blocks += [
        Heading(2, "Accuracy: method x task"),
        _accuracy_table(acc, source, config.bootstrap.enabled) if acc else "No accuracy rows.",
    ]
    if gain := _paired_table(acc, source, "policy", ("trained", "initial")):
        blocks += [Heading(2, "RL gain: trained vs initial policy"), gain]
    elif not config.evaluation.initial:
        blocks += [
            Heading(2, "RL gain: trained vs initial policy"),
            "Not measured here: this run leaves out the policy it started from (`evaluation.initial: false`; in a "
            "chain of runs, the run before evaluated it as its trained policy).",
        ]
    blocks += [
        Heading(2, "Rollout configuration ablation"),
        _ablation_table(evaluation, source, config.rollout.fmt) or "No evaluation.",
    ]
    if sensitivity := _sensitivity_table(evaluation.get("guidance_sensitivity") or [], source):
        blocks += [Heading(2, "Guidance sensitivity: R-k bits x layers"), sensitivity]
    if ptq := _ptq_table(evaluation, source):
        blocks += [Heading(2, "PTQ baselines vs training"), ptq]
    blocks += [Heading(2, "Train-rollout discrepancy"), *_discrepancy_blocks(evaluation, source)]
    blocks += [Heading(2, "Training, per RL step"), *_step_blocks(history, source, config.rl.steps_per_round)]
    blocks += [Heading(2, "Time breakdown per round"), *_time_blocks(history, source)]
    blocks += _settings_blocks(config)
    blocks += _continue_blocks(config, continue_with)
    return [b for b in blocks if b is not None]


def _paired_table(rows: list[dict], source: str, by: str, order) -> Table | None:
    """Each value of ``by`` (method, or policy) against every later one in
    ``order``, per rollout config and task, on the same prompts: pass@1
    difference with its 95% paired-bootstrap interval. Rows without per-prompt
    scores (older evaluations) give no table."""
    scored = [r for r in rows if r.get("pass@1_per_prompt") is not None]
    cells = {(r.get(by), r.get("rollout"), r.get("task")): r for r in scored}
    out = []
    for rollout in _ordered((r.get("rollout") for r in scored), ROLLOUTS):
        for task in _ordered(r.get("task") for r in scored):
            here = [v for v in order if (v, rollout, task) in cells]
            for i, a in enumerate(here):
                for b in here[i + 1 :]:
                    pair = cells[a, rollout, task], cells[b, rollout, task]
                    d = paired_difference(*pair)
                    low, high = d["ci95"]
                    verdict = "a > b" if low > 0 else "a < b" if high < 0 else "not separated"
                    # every paired difference 0: the resamples' interval is [0, 0], which reads as a broken measurement
                    alike = pair[0]["pass@1_per_prompt"] == pair[1]["pass@1_per_prompt"]
                    out.append(
                        {
                            "rollout": rollout,
                            "task": task,
                            "a": a,
                            "b": b,
                            "pass@1 a - b": d["difference"],
                            "95% CI": "none: no prompt differs" if alike else _interval(d["ci95"]),
                            "prompts": d["prompts"],
                            "verdict": "alike" if alike else verdict,
                        }
                    )
    if not out:
        return None
    note = (
        "Paired bootstrap over the prompts both answered (10,000 resamples, seed 0); "
        "'not separated' when the interval contains 0."
    )
    if any(r["verdict"] == "alike" for r in out):
        note += (
            " 'alike': a and b scored every prompt the same (each right under both or wrong under both), so every "
            "paired difference is 0 and the resamples have no spread to give an interval."
        )
    return _table(out, list(out[0]), source, keep=8, note=note)


def _comparison_blocks(config: RunConfig, evaluations: list[dict], histories: list[list[dict]]) -> list:
    histories = list(histories) + [[]] * (len(evaluations) - len(histories))
    methods = [e.get("method") or _first(h, "method") or "?" for e, h in zip(evaluations, histories)]
    source = describe(config, methods)
    runs = [describe(config.model_copy(update={"method": m})) for m in methods]
    blocks = [Heading(1, f"tracefp4 comparison `{config.name}`"), f"{len(methods)} methods; each method's run:", runs]
    blocks += [_tasks_line(config), *_hardware(evaluations)]

    acc = [r for e in evaluations for r in e.get("accuracy") or []]
    blocks += [
        Heading(2, "Accuracy: method x task"),
        _accuracy_table(acc, source, config.bootstrap.enabled, methods) if acc else "No accuracy.",
    ]

    trained = [r for r in acc if r.get("policy") == "trained"]
    if paired := _paired_table(trained, source, "method", methods):
        blocks += [Heading(2, "Paired differences between methods"), paired]

    diffs = [
        {"method": m, "rollout": r.get("rollout"), **_discrepancy(r)}
        for m, e in zip(methods, evaluations)
        for r in e.get("discrepancy") or []
    ]
    columns = ["method", "rollout", *DISCREPANCY_COUNTS, *(label for label, _ in DISCREPANCY)]
    table = (
        _table(diffs, columns, source, keep=2, note=DISCREPANCY_NOTE)
        if diffs
        else "No FP4 rollout configuration was evaluated."
    )
    blocks += [Heading(2, "FP4 train-rollout log-prob |diff| per method"), table]

    binary = _rewards_are_accuracy([step for h in histories for step in h])
    rewards = (
        {"reward mean = train accuracy (last, sampled)": "reward_mean"}
        if binary
        else {"train accuracy (last, sampled)": "accuracy", "reward_mean (last)": "reward_mean"}
    )
    training = [
        {
            "method": m,
            "steps": len(h),
            **{label: _last(h, key) for label, key in rewards.items()},
            "logprob |diff| mean (last)": _last(h, "logprob_abs_diff_mean"),
            "logprob |diff| max (all steps)": _max(h, "logprob_abs_diff_max"),
            "k3 KL (last)": _last(h, "k3_kl"),
        }
        for m, h in zip(methods, histories)
    ]
    note = "Every method's mean reward equals its train accuracy at every step: every reward was 0 or 1." * binary
    if training:
        blocks += [Heading(2, "Training per method"), _table(training, list(training[0]), source, keep=2, note=note)]

    def lines(key: str) -> list[Series]:
        return [Series(m, _steps(h), _col(h, key)) for m, h in zip(methods, histories)]

    diff_lines = [
        Series(
            m,
            _steps(h),
            _col(h, "logprob_abs_diff_mean"),
            band=(_col(h, "logprob_abs_diff_min"), _col(h, "logprob_abs_diff_max")),
        )
        for m, h in zip(methods, histories)
    ]
    blocks += [
        _plot(
            "Train-rollout log-prob |diff| per method",
            "RL step",
            "|logprob diff|",
            diff_lines,
            source,
            logy=True,
            note="Line: mean |diff| per step; band: min to max.",
        ),
        _plot("Train accuracy per method", "RL step", "train accuracy (sampled)", lines("accuracy"), source, note=note),
        None if binary else _plot("Reward per method", "RL step", "reward mean", lines("reward_mean"), source),
        *_settings_blocks(config, comparison=True),
    ]
    return [b for b in blocks if b is not None]


# -- rendering: one block list, two formats ----------------------------------------------------------------------


def _cell(v) -> str:
    if v is None:
        return "-"
    return f"{v:.4g}" if isinstance(v, float) else str(v)


def _markdown(blocks: list) -> str:
    row = lambda cells: "| " + " | ".join(_cell(c).replace("|", "\\|") for c in cells) + " |"  # noqa: E731
    lines = []
    for b in blocks:
        if isinstance(b, Heading):
            lines += ["#" * b.level + " " + b.text, ""]
        elif isinstance(b, Table):
            lines += [f"**{b.title}**", ""] if b.title else []
            lines += [row(b.columns), "|" + "---|" * len(b.columns), *map(row, b.rows), ""]
            lines += [f"_{b.note + ' ' if b.note else ''}Source: {b.source}._", ""]
        elif isinstance(b, list):
            lines += [f"- {item}" for item in b] + [""]
        elif isinstance(b, Code):
            lines += [f"```{b.language}", b.text.rstrip("\n"), "```", ""]
        elif isinstance(b, str):
            lines += [b, ""]
        # plots: in the HTML page only
    return "\n".join(lines)


def _png(plot: Plot) -> str:
    fig, ax = plt.subplots(figsize=(6.4, 3.6), dpi=100)
    if plot.kind == "lines":
        for s in plot.series:
            points = [(x, y) for x, y in zip(s.x, s.y) if y is not None]
            (line,) = ax.plot(*zip(*points), marker="o", markersize=3, label=s.label)
            band = [(x, lo, hi) for x, lo, hi in zip(s.x, *s.band) if None not in (lo, hi)] if s.band else []
            if band:
                ax.fill_between(*zip(*band), color=line.get_color(), alpha=0.15, linewidth=0)
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    else:
        cats = list(dict.fromkeys(x for s in plot.series for x in s.x))
        try:
            cats.sort()
        except TypeError:  # mixed types: keep the order of appearance
            pass
        width = 0.8 if plot.kind == "stacked" else 0.8 / len(plot.series)
        bottom = [0.0] * len(cats)
        for i, s in enumerate(plot.series):
            values = dict(zip(s.x, s.y))
            ys = [values.get(c) or 0.0 for c in cats]
            if plot.kind == "stacked":
                ax.bar(range(len(cats)), ys, width, bottom=bottom, label=s.label)
                bottom = [b + y for b, y in zip(bottom, ys)]
            else:
                ax.bar([j - 0.4 + width * (i + 0.5) for j in range(len(cats))], ys, width, label=s.label)
        ax.set_xticks(range(len(cats)), [str(c) for c in cats])
    if plot.logy:  # lines may touch 0 (a min |diff|): linear near 0, log above
        ax.set_yscale("symlog", linthresh=1e-3) if plot.kind == "lines" else ax.set_yscale("log")
    ax.set(title=plot.title, xlabel=plot.xlabel, ylabel=plot.ylabel)
    ax.legend(fontsize=7)
    source = textwrap.wrap("Source: " + plot.source.replace("`", ""), 120)
    fig.text(0.01, 0.01, "\n".join(source), fontsize=6, color="gray", va="bottom")
    fig.tight_layout(rect=(0, 0.03 * (len(source) + 1), 1, 1))
    buf = io.BytesIO()
    fig.savefig(buf, format="png")
    plt.close(fig)
    return base64.b64encode(buf.getvalue()).decode()


def _text(s: str) -> str:
    return html.escape(s.replace("`", ""))


def _html(title: str, blocks: list) -> str:
    """One self-contained page: no external resources, plots as PNG data URIs."""
    parts = []
    for b in blocks:
        if isinstance(b, Heading):
            parts.append(f"<h{b.level}>{_text(b.text)}</h{b.level}>")
        elif isinstance(b, Table):
            head = "".join(f"<th>{_text(c)}</th>" for c in b.columns)
            body = "".join("<tr>" + "".join(f"<td>{_text(_cell(c))}</td>" for c in r) + "</tr>" for r in b.rows)
            caption = f"<caption>{_text(b.title)}</caption>" if b.title else ""
            parts.append(f"<table>{caption}<thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>")
            parts.append(f'<p class="source">{_text(b.note + " " if b.note else "")}Source: {_text(b.source)}.</p>')
        elif isinstance(b, Plot):
            series = ", ".join(s.label for s in b.series)
            caption = f"{b.title}. {b.note + ' ' if b.note else ''}Series: {series}. Source: {b.source}."
            parts.append(
                f'<figure><img alt="{html.escape(b.title)}" src="data:image/png;base64,{_png(b)}">'
                f"<figcaption>{_text(caption)}</figcaption></figure>"
            )
        elif isinstance(b, list):
            parts.append("<ul>" + "".join(f"<li>{_text(item)}</li>" for item in b) + "</ul>")
        elif isinstance(b, Code):
            parts.append(f"<pre>{html.escape(b.text)}</pre>")
        else:
            parts.append(f"<p>{_text(b)}</p>")
    return (
        "<!doctype html><html><head><meta charset='utf-8'>"
        f"<title>{_text(title)}</title>"
        "<style>body{font-family:sans-serif;margin:2em}table{border-collapse:collapse;margin:1em 0 0.2em}"
        "caption{font-weight:bold;text-align:left}td,th{border:1px solid #ccc;padding:2px 8px;text-align:right}"
        ".source,figcaption{color:#666;font-size:0.8em;max-width:60em}figure{display:inline-block;margin:0.5em}</style>"
        f"</head><body>{''.join(parts)}</body></html>"
    )


def write(markdown_path: str | Path, page_path: str | Path, text: str, page: str) -> None:
    """A report's markdown ``text`` and HTML ``page``, each written whole (a
    temp file renamed), the markdown last: ``tracefp4 report`` reads a report
    by its markdown, and a killed task leaves neither half-written."""
    for path, written in ((page_path, page), (markdown_path, text)):
        write_atomic(Path(path), lambda f, written=written: f.write(written.encode()))


def markdown(
    config: RunConfig, history_file: str | Path, evaluation_file: str | Path, continue_with: dict | None = None
) -> str:
    """The run's report as markdown (tables only; the plots are in `html_report`),
    ending with the settings ``continue_with`` of a run that goes on from it."""
    return _markdown(_run_blocks(config, *load(history_file, evaluation_file), continue_with))


def html_report(
    config: RunConfig, history_file: str | Path, evaluation_file: str | Path, continue_with: dict | None = None
) -> str:
    """The run's report as one self-contained HTML page: the tables and the PNG plots."""
    blocks = _run_blocks(config, *load(history_file, evaluation_file), continue_with)
    return _html(f"tracefp4 run {config.name}", blocks)


def comparison(config: RunConfig, evaluations: list[dict], histories: list[list[dict]]) -> str:
    """Several methods side by side, as markdown; `histories[i]` belongs to the method of `evaluations[i]`."""
    return _markdown(_comparison_blocks(config, evaluations, histories))


def comparison_html(config: RunConfig, evaluations: list[dict], histories: list[list[dict]]) -> str:
    """Several methods side by side, as one self-contained HTML page with the per-method plots."""
    return _html(f"tracefp4 comparison {config.name}", _comparison_blocks(config, evaluations, histories))
