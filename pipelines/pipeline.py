"""The DAG, built from a validated run config and read as a picture:

    prepare -> R x (rollout -> compaction -> guided QAT) -> evaluate -> report

and, for a comparison, that chain per method under ``dsl.ParallelFor``,
collected into one table.

Every task gets the config's resources, the store's credentials from a
Kubernetes secret (S3 stores), retries, and no caching (steps write to the
store). Name and version: the run name; the package version and a hash of the
config schema.
"""

from importlib.metadata import version

from kfp import compiler, dsl, kubernetes
from kfp.dsl import Markdown

from tracefp4.components.kfp_components import make_components
from tracefp4.schemas import RunConfig, schema_hash

SECRET_KEYS = {"accesskey": "TRACEFP4_S3_ACCESS_KEY", "secretkey": "TRACEFP4_S3_SECRET_KEY"}  # KFP's MinIO secret layout


def pipeline_name(config: RunConfig) -> str:
    return f"tracefp4-{config.name}"


def pipeline_version() -> str:
    return f"{version('tracefp4')}-{schema_hash()}"


def _configure(task, config: RunConfig):
    r = config.resources
    task.set_cpu_limit(r.cpu).set_memory_limit(r.memory).set_retry(num_retries=2).set_caching_options(False)
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


def build_pipeline(config: RunConfig):
    """The pipeline function for ``config`` (rounds unrolled; the config is its one parameter's default)."""
    c = make_components(config.image)
    default = config.model_dump_json()

    @dsl.pipeline(name=pipeline_name(config), description=f"TRACE FP4 RL ({config.method}, {config.rollout.config})")
    def tracefp4_pipeline(config_json: str = default) -> Markdown:
        history, evaluation = _train_and_evaluate(c, config, config_json)
        rep = _configure(c.report(config_json=config_json, history=history, evaluation=evaluation), config)
        return rep.outputs["markdown"]

    return tracefp4_pipeline


def _train_and_evaluate(c, config: RunConfig, config_json):
    """prepare -> R x (rollout -> compaction -> guided QAT) -> evaluate: (history, evaluation) artifacts."""
    run_id = dsl.PIPELINE_JOB_ID_PLACEHOLDER  # with the round and component, the key of the pushed metrics
    prep = _configure(c.prepare(config_json=config_json, run_id=run_id), config)
    policy, history = prep.outputs["policy"], prep.outputs["history"]
    for r in range(config.rl.rounds):
        roll = _configure(c.rollout(config_json=config_json, run_id=run_id, round_index=r, policy=policy), config)
        trajectories = roll.outputs["trajectories"]
        guide = _configure(c.compaction(config_json=config_json, run_id=run_id, round_index=r, policy=policy,
                                        trajectories=trajectories), config)  # fmt: skip
        step = _configure(c.train(config_json=config_json, run_id=run_id, round_index=r, policy=policy, trajectories=trajectories,
                                  guidance=guide.outputs["report"], previous=history), config)  # fmt: skip
        policy, history = step.outputs["new_policy"], step.outputs["history"]
    ev = _configure(c.evaluate(config_json=config_json, run_id=run_id, policy=policy, initial=prep.outputs["policy"]), config)
    return history, ev.outputs["results"]


def build_comparison_pipeline(config: RunConfig, methods: list[str]):
    """The same run for each of ``methods`` in parallel, each with its report, collected into one comparison."""
    c = make_components(config.image)
    default = config.model_dump_json()

    @dsl.pipeline(name=pipeline_name(config) + "-compare", description=f"TRACE FP4 RL: {', '.join(methods)} side by side")
    def comparison_pipeline(config_json: str = default, methods: list = list(methods)) -> Markdown:
        with dsl.ParallelFor(methods) as method:
            branch = _configure(c.set_method(config_json=config_json, method=method), config).output
            history, evaluation = _train_and_evaluate(c, config, branch)
            _configure(c.report(config_json=branch, history=history, evaluation=evaluation), config)  # each method's own
        rep = _configure(c.compare(config_json=config_json, evaluations=dsl.Collected(evaluation),
                                   histories=dsl.Collected(history)), config)  # fmt: skip
        return rep.outputs["markdown"]

    return comparison_pipeline


def compile_pipeline(config: RunConfig, path) -> str:
    """KFP IR YAML at ``path``."""
    compiler.Compiler().compile(build_pipeline(config), str(path), pipeline_parameters={"config_json": config.model_dump_json()})
    return str(path)
