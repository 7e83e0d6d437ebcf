"""The run report, from run artifacts only: the training history (one JSON
line per RL step) and the evaluation rows, as markdown and as one
self-contained HTML page with its plots embedded as PNG. Every table and plot
names the run and the configuration it came from."""

import base64
import html
import io
import json
from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # files only, no display
import matplotlib.pyplot as plt  # noqa: E402

from tracefp4.schemas import RunConfig  # noqa: E402

HISTORY_COLUMNS = ("round", "step", "reward_mean", "accuracy", "logprob_abs_diff_mean", "k3_kl", "guidance_coverage")
PLOTS = (  # title, y label, series: (history key, label)
    ("Train-rollout log-prob |diff|", "|logprob diff|", (("logprob_abs_diff_mean", "mean"), ("logprob_abs_diff_max", "max"), ("logprob_abs_diff_min", "min"))),
    ("Reward and accuracy", "per response", (("reward_mean", "reward mean"), ("accuracy", "accuracy"))),
    ("Guidance coverage", "share of captured elements guided", (("guidance_coverage", "coverage"),)),
    ("Step time", "seconds", (("train_seconds", "train"), ("reload_seconds", "reload"))),
)  # fmt: skip


def load(history_file: str | Path, evaluation_file: str | Path) -> tuple[list[dict], list[dict]]:
    history = [json.loads(line) for line in Path(history_file).read_text().splitlines() if line.strip()]
    return history, json.loads(Path(evaluation_file).read_text())


def describe(config: RunConfig) -> str:
    return (
        f"run `{config.name}`: method `{config.method}`, rollout `{config.rollout.config}` ({config.rollout.fmt}), "
        f"guidance R-{config.guidance.bits}bit on layers `{config.guidance.layers}`, model "
        f"`{config.model.preset or config.model.checkpoint}`, seed {config.seed}"
    )


def _cell(v) -> str:
    return f"{v:.4g}" if isinstance(v, float) else str(v)


def _table(rows: list[dict], columns: list[str]) -> list[str]:
    return ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)] + [
        "| " + " | ".join(_cell(r.get(c, "")) for c in columns) + " |" for r in rows
    ]


def markdown(config: RunConfig, history_file: str | Path, evaluation_file: str | Path) -> str:
    history, evaluation = load(history_file, evaluation_file)
    return "\n".join([
        f"# tracefp4 run `{config.name}`", "", describe(config) + ".", "",
        "## Training, per RL step", "", *_table(history, list(HISTORY_COLUMNS)), "",
        "## Evaluation of the final policy", "", *_table(evaluation, list(evaluation[0]) if evaluation else ["rollout"]), "",
    ])  # fmt: skip


def _png(title: str, ylabel: str, series, history: list[dict], source: str) -> str | None:
    steps = [h["step"] for h in history]
    lines = [(label, [h.get(key) for h in history]) for key, label in series if any(h.get(key) is not None for h in history)]
    if not lines:
        return None
    fig, ax = plt.subplots(figsize=(6, 3.2), dpi=100)
    for label, values in lines:
        ax.plot(steps, values, marker="o", label=label)
    ax.set(title=title, xlabel="RL step", ylabel=ylabel)
    ax.legend(fontsize=8)
    fig.text(0.01, 0.01, source, fontsize=6, color="gray")
    fig.tight_layout(rect=(0, 0.04, 1, 1))
    buf = io.BytesIO()
    fig.savefig(buf, format="png")
    plt.close(fig)
    return base64.b64encode(buf.getvalue()).decode()


def _html_table(rows: list[dict], columns: list[str]) -> str:
    head = "".join(f"<th>{html.escape(c)}</th>" for c in columns)
    body = "".join("<tr>" + "".join(f"<td>{html.escape(_cell(r.get(c, '')))}</td>" for c in columns) + "</tr>" for r in rows)
    return f"<table><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>"


def html_report(config: RunConfig, history_file: str | Path, evaluation_file: str | Path) -> str:
    """One self-contained page: tables and PNG plots (embedded as data URIs)."""
    history, evaluation = load(history_file, evaluation_file)
    source = describe(config).replace("`", "")
    figures = [(title, _png(title, ylabel, series, history, source)) for title, ylabel, series in PLOTS]
    images = "".join(
        f'<figure><img alt="{html.escape(title)}" src="data:image/png;base64,{png}"><figcaption>{html.escape(title)}: {html.escape(source)}</figcaption></figure>'
        for title, png in figures
        if png
    )  # fmt: skip
    return (
        "<!doctype html><html><head><meta charset='utf-8'>"
        f"<title>tracefp4 run {html.escape(config.name)}</title>"
        "<style>body{font-family:sans-serif;margin:2em}table{border-collapse:collapse;margin:1em 0}"
        "td,th{border:1px solid #ccc;padding:2px 8px;text-align:right}figure{display:inline-block;margin:0.5em}</style>"
        f"</head><body><h1>tracefp4 run {html.escape(config.name)}</h1><p>{html.escape(source)}</p>"
        f"<h2>Training, per RL step</h2>{_html_table(history, list(HISTORY_COLUMNS))}{images}"
        f"<h2>Evaluation of the final policy</h2>{_html_table(evaluation, list(evaluation[0]) if evaluation else [])}"
        "</body></html>"
    )


def comparison(config: RunConfig, rows: list[dict]) -> str:
    """Final accuracy of every method of a comparison run, side by side."""
    rows = sorted(rows, key=lambda r: (r["method"], r["rollout"], r["task"]))
    columns = [c for c in rows[0] if c != "prompts"] if rows else ["method"]
    return "\n".join([f"# tracefp4 comparison `{config.name}`", "", describe(config) + "; methods side by side.", "",
                      *_table(rows, columns), ""])  # fmt: skip
