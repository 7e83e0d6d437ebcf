"""The DAG, built from a validated run config and read as a picture:

    prepare -> R x (rollout -> compaction -> guided QAT) -> evaluate -> report

and, for a comparison, that chain per method under ``dsl.ParallelFor``,
collected into one table.

The guidance of a round is an artifact on the edge compaction -> train; the
run id comes out of prepare (the local runner's, or KFP's job id) and keys
every store prefix, so no step ever reads another run's data.

Every task gets the config's resources, the store's credentials from a
Kubernetes secret (S3 stores), retries with backoff on a cluster (none for a
local run, where a failure is deterministic), and no caching (steps write to
the store). Name and version: the run name; the package version and a hash of
the config schema.
"""

from importlib.metadata import version
from typing import get_args

from kfp import compiler, dsl, kubernetes
from kfp.dsl import Markdown

from tracefp4.schemas import Method, RunConfig, schema_hash

from .components import make_components

SECRET_KEYS = {"accesskey": "TRACEFP4_S3_ACCESS_KEY", "secretkey": "TRACEFP4_S3_SECRET_KEY"}  # KFP's MinIO secret layout


def pipeline_name(config: RunConfig) -> str:
    return f"tracefp4-{config.name}"


def pipeline_version() -> str:
    return f"{version('tracefp4')}-{schema_hash()}"


def _configure(task, config: RunConfig, retries: bool):
    r = config.resources
    task.set_cpu_limit(r.cpu).set_memory_limit(r.memory).set_caching_options(False)
    if retries:  # a pod evicted or a node lost: try again later
        task.set_retry(num_retries=2, backoff_duration="30s", backoff_factor=2.0)
    if r.gpus:
        task.set_accelerator_type(r.accelerator_type).set_accelerator_limit(r.gpus)
    if r.node_selector:
        for label, value in r.node_selector.items():
            kubernetes.add_node_selector(task, label_key=label, label_value=value)
    for t in r.tolerations:
        kubernetes.add_toleration(task, key=t.key, operator=t.operator, value=t.value, effect=t.effect)
    if not config.store.uri.startswith("file://"):
        kubernetes.use_secret_as_env(task, secret_name=config.store.secret_name, secret_key_to_env=SECRET_KEYS)
        if config.store.endpoint:
            task.set_env_variable("TRACEFP4_S3_ENDPOINT", config.store.endpoint)
    return task


def build_pipeline(config: RunConfig, retries: bool = True):
    """The pipeline function for ``config`` (rounds unrolled; the config is its
    first parameter's default; ``run_id`` empty means KFP's job id)."""
    c = make_components(config.image)
    configure = lambda task: _configure(task, config, retries)  # noqa: E731
    default = config.model_dump_json()

    @dsl.pipeline(name=pipeline_name(config), description=f"TRACE FP4 RL ({config.method}, {config.rollout.config})")
    def tracefp4_pipeline(config_json: str = default, run_id: str = "") -> Markdown:
        history, evaluation = _train_and_evaluate(c, configure, config, config_json, run_id)
        rep = configure(c.report(config_json=config_json, history=history, evaluation=evaluation))
        return rep.outputs["markdown"]

    return tracefp4_pipeline


def _train_and_evaluate(c, configure, config: RunConfig, config_json, run_id):
    """prepare -> R x (rollout -> compaction -> guided QAT) -> evaluate: (history, evaluation) artifacts."""
    prep = configure(c.prepare(config_json=config_json, run_id=run_id, job_id=dsl.PIPELINE_JOB_ID_PLACEHOLDER))
    run_id = prep.outputs["Output"]  # resolved once; with the round and component, the key of the pushed metrics
    policy, history = prep.outputs["policy"], prep.outputs["history"]
    for r in range(config.rl.rounds):
        roll = configure(c.rollout(config_json=config_json, run_id=run_id, round_index=r, policy=policy))
        trajectories = roll.outputs["trajectories"]
        guide = configure(c.compaction(config_json=config_json, run_id=run_id, round_index=r, policy=policy,
                                       trajectories=trajectories))  # fmt: skip
        step = configure(c.train(config_json=config_json, run_id=run_id, policy=policy, trajectories=trajectories,
                                 guidance=guide.outputs["guidance"], previous=history))  # fmt: skip
        policy, history = step.outputs["new_policy"], step.outputs["history"]
    ev = configure(c.evaluate(config_json=config_json, run_id=run_id, policy=policy, initial=prep.outputs["policy"]))
    return history, ev.outputs["results"]


def check_methods(methods: list[str]) -> list[str]:
    """The methods of a comparison: known ones, each once (two branches of one method would share a store prefix)."""
    known = get_args(Method)
    unknown = [m for m in methods if m not in known]
    if unknown:
        raise ValueError(f"unknown method(s) {', '.join(unknown)}; choose from {', '.join(known)}")
    repeated = sorted({m for m in methods if methods.count(m) > 1})
    if repeated:
        raise ValueError(f"method(s) {', '.join(repeated)} named more than once")
    if not methods:
        raise ValueError("a comparison needs at least one method")
    return methods


def build_comparison_pipeline(config: RunConfig, methods: list[str], retries: bool = True):
    """The same run for each of ``methods`` in parallel, each with its report, collected into one comparison."""
    methods = check_methods(list(methods))
    c = make_components(config.image)
    configure = lambda task: _configure(task, config, retries)  # noqa: E731
    default = config.model_dump_json()

    @dsl.pipeline(name=pipeline_name(config) + "-compare", description=f"TRACE FP4 RL: {', '.join(methods)} side by side")
    def comparison_pipeline(config_json: str = default, methods: list = list(methods), run_id: str = "") -> Markdown:
        with dsl.ParallelFor(methods) as method:
            branch = configure(c.set_method(config_json=config_json, method=method)).output
            history, evaluation = _train_and_evaluate(c, configure, config, branch, run_id)
            configure(c.report(config_json=branch, history=history, evaluation=evaluation))  # each method's own
        rep = configure(c.compare(config_json=config_json, evaluations=dsl.Collected(evaluation),
                                  histories=dsl.Collected(history)))  # fmt: skip
        return rep.outputs["markdown"]

    return comparison_pipeline


def compile_pipeline(config: RunConfig, path) -> str:
    """KFP IR YAML at ``path``."""
    compiler.Compiler().compile(build_pipeline(config), str(path), pipeline_parameters={"config_json": config.model_dump_json()})
    return str(path)
