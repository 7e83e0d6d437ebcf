"""The run report, from run artifacts only: the training history (one JSON
line per RL step) and the evaluation rows, as markdown tables that name the
run and its configuration."""

import json
from pathlib import Path

from tracefp4.schemas import RunConfig

HISTORY_COLUMNS = ("round", "step", "reward_mean", "accuracy", "logprob_abs_diff_mean", "k3_kl", "guidance_coverage")


def _table(rows: list[dict], columns: list[str]) -> list[str]:
    def cell(v):
        return f"{v:.4g}" if isinstance(v, float) else str(v)

    return ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)] + [
        "| " + " | ".join(cell(r.get(c, "")) for c in columns) + " |" for r in rows
    ]


def markdown(config: RunConfig, history_file: str | Path, evaluation_file: str | Path) -> str:
    history = [json.loads(line) for line in Path(history_file).read_text().splitlines() if line.strip()]
    evaluation = json.loads(Path(evaluation_file).read_text())
    lines = [
        f"# tracefp4 run `{config.name}`",
        "",
        f"Method `{config.method}`, rollout `{config.rollout.config}` ({config.rollout.fmt}), guidance "
        f"R-{config.guidance.bits}bit on layers `{config.guidance.layers}`, model "
        f"`{config.model.preset or config.model.checkpoint}`, seed {config.seed}.",
        "",
        "## Training, per RL step",
        "",
        *_table(history, list(HISTORY_COLUMNS)),
        "",
        "## Evaluation of the final policy",
        "",
        *_table(evaluation, list(evaluation[0]) if evaluation else ["rollout"]),
        "",
    ]
    return "\n".join(lines)
