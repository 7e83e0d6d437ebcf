"""The DAG, built from a validated run config and read as a picture:

    configure -> prepare -> R x (rollout -> compaction -> guided QAT) -> evaluate -> report
                                                                      -> export (for serving)

The run-time fields of the config are typed pipeline parameters
(:mod:`.parameters`); ``configure`` merges them over the compiled config and
validates it, and every later task reads its output.

and, for a comparison, that chain per method under ``dsl.ParallelFor``,
collected into one table.

The guidance of a round is an artifact on the edge compaction -> train; the
run id comes out of prepare (the local runner's, or KFP's job id) and keys
every store prefix, so no step ever reads another run's data.

Every task gets the store's credentials from a Kubernetes secret (optional
with a file:// store), its endpoint, region and CA bundle where the config
names them, the config's node selector and tolerations, and no
caching (steps write to the store); its resources and retries depend on its
role (:data:`COMPUTE`, :data:`HOST`, :data:`CONTROL`, :data:`SUBMIT`). Name and version: the
run name; the package version, a hash of the config schema and, as uploaded
(:func:`version_name`), a hash of the compiled YAML.
"""

import concurrent.futures
import functools
import hashlib
import inspect
import json
from importlib.metadata import version
from typing import get_args

import yaml
from kfp import compiler, dsl, kubernetes
from kfp.dsl import Markdown

from tracefp4.schemas import ConfigError, Method, RunConfig, schema_hash
from tracefp4.schemas.config import CA_BUNDLE_MOUNT, SECRET_KEYS

from . import parameters as run_parameters
from .components import make_components


def pipeline_name(config: RunConfig) -> str:
    return f"tracefp4-{config.name}"


def comparison_name(config: RunConfig) -> str:
    return pipeline_name(config) + "-compare"


def pipeline_version() -> str:
    return f"{version('tracefp4')}-{schema_hash()}"


def version_name(documents: list[dict]) -> str:
    """The name a compiled pipeline (its :func:`compiled_documents`) is uploaded under: :func:`pipeline_version`
    and a hash of the documents, since the DAG depends on the config too (rounds, image, resources): a name
    reused for another DAG would run the old one. The documents, not the file's bytes: KFP's compiler heads the
    file with a comment that prints a list parameter's dicts in an order that changes from one process to the
    next, so the same config uploaded a new version at every submit."""
    text = json.dumps(documents, sort_keys=True)
    return f"{pipeline_version()}-{hashlib.sha256(text.encode()).hexdigest()[:8]}"


# A task's role decides its resources and retries.
# - COMPUTE: the model on the device (prepare, rollout, compaction, train, evaluate, export): all of `resources`, but
#   one GPU: a step computes on one device, save a train step whose torchrun runs its ranks in the pod, which gets
#   `resources.gpus` (a training node's).
# - HOST: moves a round's data, computes nothing on the device (gather; train when its ranks run in a TrainJob):
#   `resources` without the GPUs, which the TrainJob's ranks would otherwise wait for, and with `host_cpu` and
#   `host_memory` where set (on a node the ranks share, a step's full share could keep a rank from scheduling).
# - CONTROL: configure, rollout_workers, report, compare: small whatever the model, and their failures are
#   deterministic (a bad run parameter), so they are not retried: a retry would only delay the error.
# - SUBMIT: chain, which submits a chained run's next run through the KFP API: small, and retried, since its
#   failures are mostly the API server's (restarting, out of reach) and a retry finds a run it submitted before.
COMPUTE, HOST, CONTROL, SUBMIT = "compute", "host", "control", "submit"
CONTROL_CPU, CONTROL_MEMORY = "1", "2Gi"
# The pod label of the task that submits a chain's next run: in multi-user Kubeflow, the profile's PodDefault of that
# name (manifests/overlays/multi-user/profile) mounts a token the KFP API accepts (audience pipelines.kubeflow.org)
KFP_TOKEN_LABEL = "tracefp4-kfp-api-token"


def _off_the_callers_stack(function):
    """``function`` run on a thread of its own, whose stack is a few frames. KFP's task setters
    (``set_cpu_limit``, ``set_env_variable``, ...) each call ``inspect.stack()`` to name themselves in an error,
    reading every frame's source; a frame of no file (a notebook cell's, ``<frozen runpy>``) makes Python search
    every loaded module's file. From a shell that is half a millisecond a setter, but from pytest's or a
    notebook's stack tens of milliseconds: a 305-task pipeline took a minute to build under pytest."""

    @functools.wraps(function)
    def run(*args, **kwargs):
        with concurrent.futures.ThreadPoolExecutor(max_workers=1) as thread:
            return thread.submit(function, *args, **kwargs).result()

    return run


@_off_the_callers_stack
def _configure(task, config: RunConfig, retries: bool, role: str = COMPUTE, node: bool = False):
    """``task`` given its ``role``'s resources and retries, the config's node
    placement and the store's credentials; ``node``: the task is a training
    node (all of ``resources.gpus``), not a step on one device."""
    r = config.resources
    cpu, memory = {
        CONTROL: (CONTROL_CPU, CONTROL_MEMORY),
        SUBMIT: (CONTROL_CPU, CONTROL_MEMORY),
        HOST: (r.host_cpu or r.cpu, r.host_memory or r.memory),
    }.get(role, (r.cpu, r.memory))
    task.set_cpu_limit(cpu).set_memory_limit(memory).set_caching_options(False)
    if retries and role != CONTROL:  # Argo retries any failure: a pod evicted, a node lost, but also an error
        task.set_retry(num_retries=2, backoff_duration="30s", backoff_factor=2.0)
    if r.gpus and role == COMPUTE:
        task.set_accelerator_type(r.accelerator_type).set_accelerator_limit(r.gpus if node else 1)
    if r.node_selector:
        for label, value in r.node_selector.items():
            kubernetes.add_node_selector(task, label_key=label, label_value=value)
    for t in r.tolerations:
        kubernetes.add_toleration(task, key=t.key, operator=t.operator, value=t.value, effect=t.effect)
    for label, value in r.labels.items():
        kubernetes.add_pod_label(task, label, value)
    # the store's credentials; optional with a file:// store, for an s3:// checkpoint set at run time
    optional = config.store.uri.startswith("file://")
    kubernetes.use_secret_as_env(
        task, secret_name=config.store.secret_name, secret_key_to_env=SECRET_KEYS, optional=optional
    )
    if config.store.ca_bundle_secret:  # the CA bundle its pod_environment names
        kubernetes.use_secret_as_volume(task, secret_name=config.store.ca_bundle_secret, mount_path=CA_BUNDLE_MOUNT)
    for name, value in config.store.pod_environment().items():
        task.set_env_variable(name, value)
    return task


RUN_ID = inspect.Parameter("run_id", inspect.Parameter.POSITIONAL_OR_KEYWORD, default="", annotation=str)
RUN_ID_HELP = "Run id the steps key the store with; empty: KFP's job id (a local run passes its folder's)."


def fixed_fields(config: RunConfig, methods: list[str] | None = None) -> str:
    """What the compiled pipeline fixes (not run parameters), for its description."""
    r = config.resources
    rounds = config.rl.run_rounds()
    fixed = [
        f"rounds {len(rounds)}"
        + (f" from round {rounds.start}" if rounds.start else "")
        + (f", the {config.rl.rounds_left} left to the next run" if config.rl.chained else ""),
        f"rollout workers {config.rollout.workers}",
        f"image {config.image}",
        f"store {config.store.uri}",
        f"resources cpu {r.cpu}, memory {r.memory}, gpus {r.gpus} a training node",
        f"training {config.train.nodes} x {config.train.processes_per_node} processes by {config.train.launcher}",
    ]
    if methods:
        fixed.append(f"methods {', '.join(methods)}")
    return "Fixed at compile time: " + "; ".join(fixed) + "."


def _configure_component(config: RunConfig, params: list, methods: list[str] | None = None, reach: bool = True):
    """The ``configure`` task's component for these parameters (its first input: the compiled config), a
    comparison's with its ``methods``; ``reach``: the task asks the store and the Kubernetes API first
    (a comparison's branches leave that to the task they wait for)."""
    function = run_parameters.configure_function(params, methods, reach)
    return dsl.component(base_image=config.image, install_kfp_package=False)(function)


def _typed_pipeline(body, config: RunConfig, params: list, name: str, summary: str):
    """A KFP pipeline whose inputs are ``run_id`` and ``params``, the config's
    run-time fields; ``body(values, run_id)`` wires the tasks, ``values`` the
    parameters by name."""

    def pipeline_function(*args):
        values = dict(zip([RUN_ID.name] + [p.name for p in params], args))
        run_id = values.pop(RUN_ID.name)
        return body(values, run_id)

    signature = run_parameters.pipeline_signature(params, config, [RUN_ID])
    pipeline_function.__signature__ = signature.replace(return_annotation=Markdown)
    pipeline_function.__annotations__ = {
        **{k: v.annotation for k, v in signature.parameters.items()},
        "return": Markdown,
    }
    pipeline_function.__doc__ = run_parameters.docstring(summary, params, {RUN_ID.name: RUN_ID_HELP})
    pipeline_function.__name__ = pipeline_function.__qualname__ = name.replace("-", "_")
    return dsl.pipeline(name=name, description=summary)(pipeline_function)


def build_pipeline(config: RunConfig, retries: bool = True):
    """The pipeline for ``config``: rounds unrolled; the config's run-time
    fields typed parameters with its values as defaults; ``run_id`` empty means KFP's job id."""
    run_parameters.check_servable(config)
    c = make_components(config.image)
    configure = lambda task, role=COMPUTE, node=False: _configure(task, config, retries, role, node)  # noqa: E731
    params = run_parameters.parameters()
    configure_op = _configure_component(config, params)

    def body(values, run_id):
        config_json = configure(configure_op(config_json=config.model_dump_json(), **values), CONTROL).output
        history, evaluation = _train_and_evaluate(c, configure, config, config_json, run_id)
        report = configure(c.report(config_json=config_json, history=history, evaluation=evaluation), CONTROL)
        if config.rl.chained:  # once this run is through, the next takes the rounds left
            chain = c.chain(config_json=config_json, history=history, job_id=dsl.PIPELINE_JOB_ID_PLACEHOLDER)
            kubernetes.add_pod_label(configure(chain, SUBMIT).after(report), KFP_TOKEN_LABEL, "true")
        return report.outputs["markdown"]

    summary = f"TRACE FP4 RL ({config.method}, {config.rollout.config}). {fixed_fields(config)}"
    return _typed_pipeline(body, config, params, pipeline_name(config), summary)


def _train_and_evaluate(c, configure, config: RunConfig, config_json, run_id):
    """prepare -> R x (rollout -> compaction -> guided QAT) -> evaluate, and the
    final policy exported for serving: (history, evaluation) artifacts."""
    prep = configure(c.prepare(config_json=config_json, run_id=run_id, job_id=dsl.PIPELINE_JOB_ID_PLACEHOLDER))
    run_id = prep.outputs["Output"]  # resolved once; with the round and component, the key of the pushed metrics
    policy, history = prep.outputs["policy"], prep.outputs["history"]
    state = prep.outputs["trainer_state"]  # optimizer and step: only train reads it
    for r in config.rl.run_rounds():
        trajectories = _rollout(c, configure, config, config_json, run_id, r, policy)
        guide = configure(
            c.compaction(
                config_json=config_json, run_id=run_id, round_index=r, policy=policy, trajectories=trajectories
            )
        )
        step = configure(
            c.train(
                config_json=config_json,
                run_id=run_id,
                policy=policy,
                trainer_state=state,
                trajectories=trajectories,
                guidance=guide.outputs["guidance"],
                previous=history,
            ),
            HOST if config.train.in_trainjob else COMPUTE,
            node=config.train.ranks_in_pod,
        )
        if config.train.ranks_in_pod:  # its processes share the pod
            kubernetes.empty_dir_mount(step, volume_name="dshm", mount_path="/dev/shm", medium="Memory")
        policy, history = step.outputs["new_policy"], step.outputs["history"]
        state = step.outputs["new_trainer_state"]
    configure(c.export(config_json=config_json, policy=policy))
    initial = {"initial": prep.outputs["policy"]} if config.evaluation.initial else {}
    ev = configure(c.evaluate(config_json=config_json, run_id=run_id, policy=policy, **initial))
    return history, ev.outputs["results"]


def _rollout(c, configure, config: RunConfig, config_json, run_id, round_index: int, policy):
    """Round ``round_index``'s trajectories artifact: one rollout task, or
    ``rollout.workers`` in parallel gathered into one."""
    if config.rollout.workers == 1:
        return configure(
            c.rollout(config_json=config_json, run_id=run_id, round_index=round_index, policy=policy)
        ).outputs["trajectories"]
    workers = configure(c.rollout_workers(config_json=config_json, run_id=run_id, round_index=round_index), CONTROL)
    with dsl.ParallelFor(workers.output) as item:  # the config and run id ride on the item (see rollout_workers)
        part = configure(
            c.rollout(
                config_json=item.config_json,
                run_id=item.run_id,
                round_index=item.round_index,
                worker=item.worker,
                policy=policy,
            )
        )
    parts = dsl.Collected(part.outputs["trajectories"])
    merged = configure(c.gather(config_json=config_json, run_id=run_id, round_index=round_index, parts=parts), HOST)
    return merged.outputs["trajectories"]


# A KFP run is one Argo Workflow object, and Argo records in it, as the run goes, each task's pods with their inputs
# and outputs: a KFP v2 run of 56 tasks made one of 1.95 MiB (kubeflow/pipelines#13738). Argo stops a run whose
# object, that record compressed, passes 1 MiB (its MAX_WORKFLOW_SIZE), and KFP cannot retry a run whose object,
# the record not compressed, passes etcd's 1.5 MiB (docs/deploy.md, "Known limit").
RUN_TASKS_WARN = 50


def compiled_documents(package: bytes) -> list[dict]:
    """The documents of a compiled pipeline file: its pipeline spec, then the Kubernetes platform spec."""
    return [doc for doc in yaml.safe_load_all(package) if doc]


def run_tasks(spec: dict, config: RunConfig) -> int:
    """The tasks a run of the pipeline ``spec`` (the first of :func:`compiled_documents`)
    compiled from ``config`` executes: a loop's body once per item
    (``rollout.workers`` times where the items come at run time)."""

    def tasks_in(dag: dict) -> int:
        total = 0
        for task in dag["tasks"].values():
            component = spec["components"][task["componentRef"]["name"]]
            body = tasks_in(component["dag"]) if "dag" in component else 0
            times = 1
            if iterator := task.get("parameterIterator") or task.get("artifactIterator"):
                raw = iterator["items"].get("raw")  # items written into the spec, else the workers' at run time
                times = len(json.loads(raw)) if raw else config.rollout.workers
            total += 1 + times * body
        return total

    return tasks_in(spec["root"]["dag"])


def run_size_problem(tasks: int) -> str | None:
    """Why a run of ``tasks`` tasks may stop partway on a cluster, if it may."""
    if tasks <= RUN_TASKS_WARN:
        return None
    return (
        f"{tasks} tasks in a run, more than {RUN_TASKS_WARN}: KFP keeps a run in one Argo Workflow object that grows "
        "with every task (a run of 56 tasks made one of 1.95 MiB, kubeflow/pipelines#13738); Argo stops a run whose "
        "object, compressed, passes 1 MiB, and KFP cannot retry one past etcd's 1.5 MiB; run fewer rounds per run "
        "(rl.rounds_per_run: each run submits the next, which continues it; docs/deploy.md, 'Known limit')"
    )


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
    """The same run for each of ``methods`` in parallel, each with its report,
    collected into one comparison. Each branch configures itself with its
    method: kfp.local replaces any task output passed into a loop by the loop
    item, so no task output crosses into the loop."""
    methods = check_methods(list(methods))
    if config.model.trainer_state:
        reason = "a continuation goes on with one method's optimizer; a comparison starts every method afresh"
        raise ConfigError([("model.trainer_state", reason)])
    if config.rl.chained:
        reason = (
            f"a comparison runs its {config.rl.rounds} rounds in one run (a next run would continue one method); "
            "run the methods one by one to chain them"
        )
        raise ConfigError([("rl.rounds_per_run", reason)])
    run_parameters.check_servable(config)
    run_parameters.apply_to_methods(config.model_dump_json(), {}, methods)  # what the run's configure checks
    c = make_components(config.image)
    configure = lambda task, role=COMPUTE, node=False: _configure(task, config, retries, role, node)  # noqa: E731
    params = run_parameters.parameters(comparison=True)
    method_param = next(p for p in run_parameters.parameters() if p.name == "method")
    configure_op = _configure_component(config, params, methods)
    configure_branch_op = _configure_component(config, params + [method_param], reach=False)
    compiled = config.model_dump_json()

    def body(values, run_id):
        # the run's values checked for every method before any branch starts: a value one branch refuses
        # would otherwise fail it while the others train on, and no comparison come out
        checked = configure(configure_op(config_json=compiled, **values), CONTROL)
        with dsl.ParallelFor(methods) as method:
            branch = configure(configure_branch_op(config_json=compiled, method=method, **values), CONTROL)
            branch = branch.after(checked).output
            history, evaluation = _train_and_evaluate(c, configure, config, branch, run_id)
            configure(c.report(config_json=branch, history=history, evaluation=evaluation), CONTROL)  # its own
        config_json = checked.output
        evaluations, histories = dsl.Collected(evaluation), dsl.Collected(history)
        rep = configure(c.compare(config_json=config_json, evaluations=evaluations, histories=histories), CONTROL)
        return rep.outputs["markdown"]

    summary = f"TRACE FP4 RL: {', '.join(methods)} side by side. {fixed_fields(config, methods)}"
    return _typed_pipeline(body, config, params, comparison_name(config), summary)


def compile_pipeline(config: RunConfig, path, methods: list[str] | None = None) -> str:
    """KFP IR YAML at ``path``: the run pipeline, or with ``methods`` the comparison pipeline."""
    pipeline = build_comparison_pipeline(config, methods) if methods else build_pipeline(config)
    compiler.Compiler().compile(pipeline, str(path))
    return str(path)
