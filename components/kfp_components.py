"""One thin Kubeflow component per pipeline step: parse the config, call
:mod:`.steps`, write artifacts and metrics. Imports live inside the bodies, as
KFP lightweight components require; the container image comes from the run
config, so the components are made per image by :func:`make_components`.
"""

from dataclasses import dataclass
from typing import List

from kfp import dsl
from kfp.dsl import HTML, Dataset, Input, Markdown, Metrics, Model, Output


def prepare(config_json: str, policy: Output[Model], history: Output[Dataset]):
    """The initial policy and tokenizer; an empty training history."""
    from tracefp4.components import steps
    from tracefp4.schemas import RunConfig

    steps.prepare(RunConfig.model_validate_json(config_json), policy.path)
    open(history.path, "w").close()


def rollout(config_json: str, round_index: int, policy: Input[Model], trajectories: Output[Dataset]):
    """A round of FP4 rollout; the full capture goes to the store."""
    from tracefp4.components import steps
    from tracefp4.schemas import RunConfig

    steps.rollout(RunConfig.model_validate_json(config_json), policy.path, round_index, trajectories.path)
    trajectories.metadata["round"] = round_index


def compaction(config_json: str, round_index: int, trajectories: Input[Dataset], report: Output[Metrics]):
    """Offline compaction of the round's capture into guidance (layers, bits)."""
    from tracefp4.components import steps
    from tracefp4.schemas import RunConfig

    size = steps.compaction(RunConfig.model_validate_json(config_json), round_index)
    report.log_metric("guidance_bytes", size["bytes"])
    if size["full_bytes"]:  # known when compacting offline
        report.log_metric("compaction_ratio", size["bytes"] / size["full_bytes"])


def train(
    config_json: str,
    round_index: int,
    policy: Input[Model],
    trajectories: Input[Dataset],
    guidance: Input[Metrics],  # the compaction report: orders this step after the guidance is written
    previous: Input[Dataset],
    new_policy: Output[Model],
    history: Output[Dataset],
    metrics: Output[Metrics],
):
    """Guided QAT over the round's trajectories; appends to the training history."""
    import json
    import shutil

    from tracefp4.components import steps
    from tracefp4.schemas import RunConfig

    rows = steps.train(RunConfig.model_validate_json(config_json), policy.path, trajectories.path, round_index, new_policy.path)
    shutil.copyfile(previous.path, history.path)
    with open(history.path, "a") as f:
        for row in rows:
            f.write(json.dumps(row) + "\n")
    for key in ("reward_mean", "accuracy", "logprob_abs_diff_mean", "k3_kl", "guidance_coverage"):
        metrics.log_metric(key, rows[-1][key])


def evaluate(config_json: str, policy: Input[Model], results: Output[Dataset], metrics: Output[Metrics]):
    """Accuracy per task under BF16 and each FP4 rollout configuration."""
    import json

    from tracefp4.components import steps
    from tracefp4.schemas import RunConfig

    rows = steps.evaluate(RunConfig.model_validate_json(config_json), policy.path)
    with open(results.path, "w") as f:
        json.dump(rows, f)
    for row in rows:
        metrics.log_metric(f"{row['rollout']}.{row['task']}.pass_at_1", row["pass@1"])


def report(config_json: str, history: Input[Dataset], evaluation: Input[Dataset], markdown: Output[Markdown],
           page: Output[HTML]):  # fmt: skip
    """The run's tables as markdown, and as an HTML page with the plots."""
    from tracefp4.components import report as run_report
    from tracefp4.schemas import RunConfig

    config = RunConfig.model_validate_json(config_json)
    with open(markdown.path, "w") as f:
        f.write(run_report.markdown(config, history.path, evaluation.path))
    with open(page.path, "w") as f:
        f.write(run_report.html_report(config, history.path, evaluation.path))


def set_method(config_json: str, method: str) -> str:
    """The config with another training method (a branch of the comparison pipeline)."""
    from tracefp4.schemas import RunConfig

    config = RunConfig.model_validate_json(config_json)
    return config.model_copy(update={"method": method}).model_dump_json()


def compare(config_json: str, evaluations: Input[List[Dataset]], markdown: Output[Markdown]):
    """One table of every method's final accuracy, from the collected evaluations."""
    import json

    from tracefp4.components import report as run_report
    from tracefp4.schemas import RunConfig

    rows = [row for dataset in evaluations for row in json.load(open(dataset.path))]
    with open(markdown.path, "w") as f:
        f.write(run_report.comparison(RunConfig.model_validate_json(config_json), rows))


@dataclass(frozen=True)
class Components:
    prepare: object
    rollout: object
    compaction: object
    train: object
    evaluate: object
    report: object
    set_method: object
    compare: object


def make_components(image: str) -> Components:
    """The components, built on ``image`` (which holds tracefp4 and its dependencies)."""
    make = dsl.component(base_image=image, install_kfp_package=False)
    return Components(*(make(f) for f in (prepare, rollout, compaction, train, evaluate, report, set_method, compare)))
