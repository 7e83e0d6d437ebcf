"""One thin Kubeflow component per pipeline step: parse the config, call
:mod:`tracefp4.components.steps`, write artifacts and metrics. Imports live
inside the bodies, as KFP lightweight components require; the container image
comes from the run config, so the components are made per image by
:func:`make_components`.
"""

from dataclasses import dataclass

from kfp import dsl
from kfp.dsl import HTML, Artifact, Dataset, Input, Markdown, Metrics, Model, Output


class Guidance(dsl.Artifact):
    """A round's guidance: a JSON :class:`tracefp4.components.guidance.GuidanceRef`
    (store URI and prefix, step, run and policy version, codec, bits, layers,
    sites, the rollout's quantization config and static global scales); the
    shards stay in the store. KFP admits only its own artifact namespaces, so
    in the IR it is a ``system.Artifact``; its metadata holds the compaction figures."""

    schema_title = "system.Artifact"
    schema_version = "0.0.1"


def prepare(
    config_json: str,
    run_id: str,
    job_id: str,
    policy: Output[Model],
    trainer_state: Output[Artifact],
    history: Output[Dataset],
    metrics: Output[Metrics],
) -> str:
    """The initial policy and tokenizer (bootstrapped when configured), a clean
    Hugging Face folder; its trainer state (a fresh optimizer, policy version 0),
    a separate artifact that only train reads; an empty training history.
    Returns the run id every later step checks its inputs against: ``run_id``
    when given (a local run's, stable across resumes), else KFP's job id."""
    from tracefp4.components import metrics as run_metrics
    from tracefp4.components import steps
    from tracefp4.pipelines.resume import write_metrics
    from tracefp4.schemas import RunConfig

    config = RunConfig.model_validate_json(config_json)
    run_id = run_id or job_id
    stats = steps.prepare(config, policy.path, run_id, trainer_state.path)
    open(history.path, "w").close()
    for key, value in stats.items():
        metrics.log_metric(key, value)
    write_metrics(metrics)  # resume: kfp.local's cache needs a file behind every output artifact
    run_metrics.publish(config, run_id, "prepare", None, stats)
    return run_id


def rollout(
    config_json: str,
    run_id: str,
    round_index: int,
    policy: Input[Model],
    trajectories: Output[Dataset],
    worker: int = 0,
):
    """A round of FP4 rollout (with ``rollout.workers`` > 1, worker ``worker``'s
    share); the capture goes to the store, the figures to the trajectories' metadata."""
    from tracefp4.components import metrics as run_metrics
    from tracefp4.components import steps
    from tracefp4.schemas import RunConfig

    config = RunConfig.model_validate_json(config_json)
    stats = steps.rollout(config, policy.path, round_index, trajectories.path, run_id, worker)
    trajectories.metadata.update(round=round_index, worker=worker, **stats)
    if config.rollout.workers == 1:  # workers' figures are published once combined, by gather
        run_metrics.publish(config, run_id, "rollout", round_index, stats)


def rollout_workers(config_json: str, run_id: str, round_index: int) -> list:
    """The round's rollout workers, one loop item each. The items carry the
    config and run id themselves: kfp.local hands a loop's tasks the loop item
    in place of any other task's parameter output passed into the loop."""
    import json

    workers = json.loads(config_json)["rollout"]["workers"]
    return [
        {"config_json": config_json, "run_id": run_id, "round_index": round_index, "worker": w} for w in range(workers)
    ]


def gather(
    config_json: str,
    run_id: str,
    round_index: int,
    parts: Input[list[Dataset]],
    trajectories: Output[Dataset],
):
    """The round's trajectories from every rollout worker, in one worker's order, with their figures combined."""
    from tracefp4.components import metrics as run_metrics
    from tracefp4.components import steps
    from tracefp4.schemas import RunConfig

    config = RunConfig.model_validate_json(config_json)
    part_stats = [dict(part.metadata) for part in parts]
    stats = steps.gather(config, [part.path for part in parts], part_stats, round_index, trajectories.path, run_id)
    trajectories.metadata.update(round=round_index, **stats)
    run_metrics.publish(config, run_id, "rollout", round_index, stats)


def compaction(
    config_json: str,
    run_id: str,
    round_index: int,
    policy: Input[Model],
    trajectories: Input[Dataset],
    guidance: Output[Guidance],
    report: Output[Metrics],
):
    """The round's guidance (layers, bits) as the artifact train reads; its size and (offline) its fidelity."""
    from tracefp4.components import metrics as run_metrics
    from tracefp4.components import steps
    from tracefp4.pipelines.resume import write_metrics
    from tracefp4.schemas import RunConfig

    config = RunConfig.model_validate_json(config_json)
    ref, stats = steps.compaction(config, policy.path, trajectories.path, round_index, run_id)
    with open(guidance.path, "w") as f:
        f.write(ref.to_json())
    guidance.metadata.update({key: stats[key] for key in steps.ROUND_KEYS if key in stats})
    guidance.metadata.update(layers=list(ref.layers), bits=ref.bits, policy_version=ref.policy_version)
    for key in steps.ROUND_KEYS:
        if stats.get(key) is not None:
            report.log_metric(key, stats[key])
    write_metrics(report)
    run_metrics.publish(config, run_id, "compaction", round_index, stats)


def train(
    config_json: str,
    run_id: str,
    policy: Input[Model],
    trainer_state: Input[Artifact],
    trajectories: Input[Dataset],
    guidance: Input[Guidance],
    previous: Input[Dataset],
    new_policy: Output[Model],
    new_trainer_state: Output[Artifact],
    history: Output[Dataset],
    metrics: Output[Metrics],
):
    """Guided QAT over the round's trajectories, quantizing with the guidance's
    numerics, resumed from the policy and its trainer state (refused unless this
    run saved them together); the new policy and its state; appends to the
    history. One process trains here; more run under torchrun beside this step
    or as a Kubeflow Trainer TrainJob (``train.launcher``)."""
    import json
    import shutil
    from pathlib import Path

    from tracefp4.components import metrics as run_metrics
    from tracefp4.components import steps
    from tracefp4.components.checkpoint import fetch
    from tracefp4.components.guidance import GuidanceRef
    from tracefp4.pipelines.resume import write_metrics
    from tracefp4.schemas import RunConfig, continuation

    config = RunConfig.model_validate_json(config_json)
    with open(guidance.path) as f:
        ref = GuidanceRef.from_json(f.read(), guidance.uri)
    round_stats = {**trajectories.metadata, **guidance.metadata}
    if config.train.world_size == 1:
        rows = steps.train(
            config,
            policy.path,
            fetch(trainer_state.path),  # the round before's, which its folder stands for in the store
            trajectories.path,
            ref,
            new_policy.path,
            new_trainer_state.path,
            run_id,
            round_stats,
        )
    else:  # torchrun or a TrainJob (train.launcher)
        from tracefp4.pipelines.trainjob import distributed_train

        rows = distributed_train(
            config,
            policy.path,
            trainer_state.path,
            trajectories.path,
            guidance.path,
            new_policy.path,
            new_trainer_state.path,
            run_id,
            round_stats,
        )
    if config.train.world_size == 1 or config.train.launcher == "torchrun":  # written here, not by a TrainJob's ranks
        steps.hand_on_state(config, run_id, ref.rl_step, Path(new_trainer_state.path))
    shutil.copyfile(previous.path, history.path)
    with open(history.path, "a") as f:
        for row in rows:
            f.write(json.dumps(row) + "\n")
    # how a next run goes on from here, for the report (the policy and state's URIs are known only here); as
    # JSON text, which metadata keeps as it is (its numbers come back as doubles: the round count as 1.0)
    settings = continuation(new_policy.uri, new_trainer_state.uri, ref.rl_step + 1)
    history.metadata["continue_with"] = json.dumps({"method": config.method, **settings})
    for key, value in run_metrics.round_means(rows).items():
        metrics.log_metric(key, value)
    write_metrics(metrics)
    run_metrics.publish(config, run_id, "train", ref.rl_step, rows)


def export(config_json: str, policy: Input[Model], exported: Output[Model]):
    """The final policy for serving as the run's rollout served it: a
    compressed-tensors FP4 checkpoint (routed experts as the rollout quantized
    them, with their activations' scheme; the rest BF16) that vLLM and SGLang
    load, or BF16 where the rollout left the weights BF16."""
    from tracefp4.components import steps
    from tracefp4.schemas import RunConfig

    config = RunConfig.model_validate_json(config_json)
    stats = steps.export_policy(config, policy.path, exported.path)
    exported.metadata.update({k: v for k, v in stats.items() if k != "input_global_scales"})


def evaluate(
    config_json: str,
    run_id: str,
    policy: Input[Model],
    results: Output[Dataset],
    metrics: Output[Metrics],
    initial: Input[Model] = None,
):
    """Accuracy (of the ``initial`` policy too, where given), throughput and
    train-rollout discrepancy under each rollout config."""
    import json

    from tracefp4.components import evaluation
    from tracefp4.components import metrics as run_metrics
    from tracefp4.pipelines.resume import write_metrics
    from tracefp4.schemas import RunConfig

    config = RunConfig.model_validate_json(config_json)
    result = evaluation.evaluate(config, policy.path, None if initial is None else initial.path)
    with open(results.path, "w") as f:
        json.dump(result, f)
    for row in result["accuracy"]:
        metrics.log_metric(f"{row['policy']}.{row['rollout']}.{row['task']}.pass_at_1", row["pass@1"])
    write_metrics(metrics)
    run_metrics.publish(config, run_id, "evaluate", None, result)


def report(
    config_json: str,
    history: Input[Dataset],
    evaluation: Input[Dataset],
    markdown: Output[Markdown],
    page: Output[HTML],
):
    """The run's tables as markdown, and as an HTML page with the plots."""
    import json

    from tracefp4.components import report as run_report
    from tracefp4.schemas import RunConfig

    config = RunConfig.model_validate_json(config_json)
    continue_with = json.loads(history.metadata.get("continue_with", "null"))  # the last train task's
    run_report.write(
        markdown.path,
        page.path,
        run_report.markdown(config, history.path, evaluation.path, continue_with),
        run_report.html_report(config, history.path, evaluation.path, continue_with),
    )


def chain(config_json: str, history: Input[Dataset], job_id: str) -> str:
    """Submit the run that continues this one for the rounds it leaves
    (rl.rounds_per_run), from its last train task's policy and trainer state;
    returns that run's id. The submission compiles the next run, which KFP's
    runtime mode of this process cannot: it runs in a process of its own
    (:mod:`tracefp4.pipelines.chain` says why)."""
    import json
    import os
    import subprocess
    import sys

    continue_with = json.loads(history.metadata["continue_with"])  # the last train task's
    request = json.dumps({"config_json": config_json, "continue_with": continue_with, "job_id": job_id})
    env = {k: v for k, v in os.environ.items() if k != "_KFP_RUNTIME"}
    command = [sys.executable, "-P", "-m", "tracefp4.pipelines.chain"]  # -P: no kernels/ of a working directory
    done = subprocess.run(command, input=request, env=env, capture_output=True, text=True)
    print(done.stdout + done.stderr, end="")
    if done.returncode:
        raise RuntimeError(f"submitting the next run failed (exit status {done.returncode}, its output above)")
    return json.loads(done.stdout.splitlines()[-1])["run_id"]


def compare(
    config_json: str,
    evaluations: Input[list[Dataset]],
    histories: Input[list[Dataset]],
    markdown: Output[Markdown],
    page: Output[HTML],
):
    """Every method's final accuracy and alignment side by side, from the collected evaluations and histories."""
    import json

    from tracefp4.components import report as run_report
    from tracefp4.schemas import RunConfig

    config = RunConfig.model_validate_json(config_json)
    results = [json.load(open(dataset.path)) for dataset in evaluations]
    runs = [[json.loads(line) for line in open(dataset.path) if line.strip()] for dataset in histories]
    by_method = {r[0]["method"]: r for r in runs if r}  # the collections' orders are not promised to agree
    ordered = [by_method.get(result["method"], []) for result in results]
    run_report.write(
        markdown.path,
        page.path,
        run_report.comparison(config, results, ordered),
        run_report.comparison_html(config, results, ordered),
    )


@dataclass(frozen=True)
class Components:
    prepare: object
    rollout: object
    rollout_workers: object
    gather: object
    compaction: object
    train: object
    export: object
    evaluate: object
    report: object
    chain: object
    compare: object


def make_components(image: str) -> Components:
    """The components, built on ``image`` (which holds tracefp4 and its dependencies)."""
    make = dsl.component(base_image=image, install_kfp_package=False)
    functions = (prepare, rollout, rollout_workers, gather, compaction, train, export, evaluate, report, chain, compare)
    return Components(*(make(f) for f in functions))
