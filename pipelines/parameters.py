"""The run config as typed KFP pipeline parameters, so the KFP UI gives each
field its own editor (numbers, booleans, JSON for lists) instead of one
minified blob.

Every run-time field of :class:`~tracefp4.schemas.RunConfig` becomes a
pipeline input named by its flattened path (``rl.learning_rate`` ->
``rl_learning_rate``), typed as the field is (int, float, bool, str; a
Literal is a str whose description names the allowed values; a list or a
union as JSON), with the preset's value as default and the field's
description. Fields that shape the DAG or the pods are not parameters: the run
name, ``rl.rounds``, ``rl.first_round`` and ``rl.rounds_per_run`` (rounds are
unrolled, each with its index, and a run that leaves rounds to the next ends
by submitting it), ``evaluation.initial`` (whether evaluate takes the initial
policy), ``rollout.workers`` (a loop of rollout tasks or one), the
image, the resources, the store (its scheme decides whether credentials are
mounted) and, in a comparison, the
method. They stay as compiled, and the pipeline version's description names
them.

The pipeline's first task, ``configure``, merges the parameters over the
compiled config and validates the result, so a bad value fails the run there,
naming the field path, before any work.
"""

import inspect
import json
import linecache
import types
import typing
from dataclasses import dataclass

import pydantic

from tracefp4.schemas import ConfigError, RunConfig

# Dotted paths (or section prefixes) fixed at compile time: what shapes the DAG, and what places its pods (the
# train step's GPUs and /dev/shm follow how its processes are started)
DAG_FIELDS = (
    "name",
    "image",
    "rl.rounds",
    "rl.first_round",
    "rl.rounds_per_run",
    "evaluation.initial",
    "rollout.workers",
    "resources",
    "store",
    "train.launcher",
    "train.nodes",
    "train.processes_per_node",
)


@dataclass(frozen=True)
class Parameter:
    """One run-time field as a pipeline input."""

    path: str  # dotted, e.g. "rl.learning_rate"
    annotation: type  # what KFP sees: int, float, bool, str, list or dict
    optional: bool  # an empty string means none (KFP's local runner cannot pass a null)
    json: bool  # the value travels as JSON text (a union of several kinds; a bare word stays a string)
    description: str

    @property
    def name(self) -> str:
        return self.path.replace(".", "_")


def _kind(annotation) -> tuple[type, bool, bool, str]:
    """(KFP type, optional?, JSON-encoded?, note on allowed values) of a field's annotation."""
    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if origin is typing.Annotated:
        return _kind(args[0])
    if origin is typing.Literal:
        return str, False, False, f" One of: {', '.join(map(str, args))}."
    if origin in (typing.Union, types.UnionType):
        members = [a for a in args if a is not type(None)]
        if len(members) == 1:  # Optional[X]: a string, empty for none
            kind, _, encoded, note = _kind(members[0])
            return str, True, encoded or kind is not str, note + " Empty: none."
        return str, False, True, " A bare word or JSON: " + " or ".join(_describe(m) for m in members) + "."
    if origin in (list, tuple) or annotation in (list, tuple):
        return list, False, False, ""
    if origin is dict or annotation is dict:
        return dict, False, False, ""
    if annotation in (int, float, bool, str):
        return annotation, False, False, ""
    raise TypeError(f"no KFP parameter type for {annotation!r}")


def _describe(annotation) -> str:
    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if origin is typing.Annotated:
        return _describe(args[0])
    if origin is typing.Literal:
        return " or ".join(json.dumps(a) for a in args)
    if origin is list:
        return "a list"
    return getattr(annotation, "__name__", str(annotation))


def _dag_field(path: str, comparison: bool) -> bool:
    fixed = DAG_FIELDS + (("method",) if comparison else ())
    return any(path == f or path.startswith(f + ".") for f in fixed)


def parameters(comparison: bool = False) -> list[Parameter]:
    """The run-time fields of the config, in the schema's order."""
    out = []

    def walk(model: type[pydantic.BaseModel], prefix: str) -> None:
        for name, field in model.model_fields.items():
            path = prefix + name
            if field.exclude or _dag_field(path, comparison):
                continue  # secrets, and what shapes the DAG
            annotation = field.annotation
            if isinstance(annotation, type) and issubclass(annotation, pydantic.BaseModel):
                walk(annotation, path + ".")
                continue
            kind, optional, encoded, note = _kind(annotation)
            out.append(Parameter(path, kind, optional, encoded, (field.description or "") + note))

    walk(RunConfig, "")
    return out


def defaults(config: RunConfig, params: list[Parameter]) -> dict:
    """Each parameter's value in ``config`` as KFP takes it (JSON text for unions, a bare word as itself)."""
    data = config.model_dump(mode="json")
    out = {}
    for p in params:
        value = data
        for key in p.path.split("."):
            value = value[key]
        if value is None and p.optional:
            value = ""
        elif p.json and not isinstance(value, str):
            value = json.dumps(value)
        elif isinstance(value, list):  # KFP's list default holds no null: an entry's unset field is left out
            value = [
                {k: v for k, v in item.items() if v is not None} if isinstance(item, dict) else item for item in value
            ]
        out[p.name] = value
    return out


def apply(config_json: str, values: dict) -> str:
    """The compiled config with the run's parameter ``values`` (by parameter
    name) merged in, validated: what every later task reads. A bad value raises
    :class:`~tracefp4.schemas.ConfigError` naming the field path."""
    data = json.loads(config_json)
    by_name = {p.name: p for p in parameters()}
    for name, value in values.items():
        p = by_name[name]
        if p.optional and value == "":
            value = None
        elif p.json:
            try:
                value = json.loads(value)
            except (TypeError, json.JSONDecodeError):
                pass  # a bare word, such as all
        node = data
        *parents, leaf = p.path.split(".")
        for key in parents:
            node = node[key]
        node[leaf] = value
    try:
        config = RunConfig.model_validate(data)
    except pydantic.ValidationError as e:
        raise ConfigError.from_validation(e, "the run's parameters") from None
    check_servable(config)
    return config.model_dump_json()


def apply_to_methods(config_json: str, values: dict, methods: list[str]) -> str:
    """:func:`apply` for each method of a comparison, so that a value some
    branch would refuse stops the run before any branch trains, naming that
    branch; the first method's config, which the comparison's report reads."""
    configs = []
    for method in methods:
        try:
            configs.append(apply(config_json, {**values, "method": method}))
        except ConfigError as e:
            raise ConfigError(e.problems, f"the comparison's branch of method {method}", e.unchecked) from None
    return configs[0]


def reached(config_json: str) -> str:
    """``config_json`` once what the run's steps will reach has answered, its
    problem files pinned (:func:`pin_problems`): its
    tasks (every task's split drawn, :func:`check_drawable`), the store (its
    endpoint, credentials and bucket, and a write, read, listing and deletion
    under its prefix: :meth:`~tracefp4.components.store.ArtifactStore.check_access`)
    and, where the ranks train in a
    TrainJob, the Kubernetes API taking one of these settings
    (:func:`~tracefp4.pipelines.trainjob.dry_run`). The pipeline's first task
    asks, on a cluster with the steps' own secrets and service account: else
    a typo in the store shows in the first GPU step, and a TrainJob's in
    round 0's train step, after the rollout."""
    from tracefp4.components.store import open_store

    config = RunConfig.model_validate_json(config_json)
    pinned = pin_problems(config)
    check_drawable(pinned)
    open_store(config.store.uri, create_bucket=config.store.create_bucket).check_access()
    if config.train.in_trainjob:
        from tracefp4.pipelines.trainjob import dry_run

        dry_run(config)
    return config_json if pinned == config else pinned.model_dump_json()


def pin_problems(config: RunConfig) -> RunConfig:
    """``config`` with each problem file's sha256 pinned
    (:func:`~tracefp4.components.steps.pin_problem_files`), so that every step
    reads the problems the run started with; a file that is not there or holds
    no problems is a :class:`ConfigError` naming its entry."""
    from tracefp4.components.steps import pin_problem_files

    try:
        return pin_problem_files(config)
    except ValueError as e:  # "tasks.i.data: ..."
        field, _, reason = str(e).partition(": ")
        raise ConfigError([(field, reason)]) from None


def check_drawable(config: RunConfig) -> None:
    """Every task holds its ``train_size + test_size`` distinct problems, and
    an enabled bootstrap's ``extra_problems`` their ``size`` besides: a
    task's generator alone knows (countdown at difficulty 1 has about 2,750),
    so validation cannot, and prepare, the first step to draw them, would
    find out on a GPU node after fetching the checkpoint. Drawing them here
    costs what each step pays (``benchmarks/tasks.py``: half a minute on a
    paper preset), in the memory of the prompts alone; and it finds, for a
    library preset, a prompt without room for ``rollout.max_new_tokens``
    within ``model.max_seq_len`` and an answer longer than
    ``rollout.max_new_tokens``, which would never score, both of which
    prepare would (for a checkpoint it alone can, in its tokenizer; a
    pydantic validator would draw them at every validation, in every step)."""
    from tracefp4.components.steps import check_tasks_drawable

    try:
        check_tasks_drawable(config)
    except ValueError as e:
        # "tasks.i: ...", "bootstrap.extra_problems.i: ...", "model.max_seq_len: ...", "rollout.max_new_tokens: ..."
        field, _, reason = str(e).partition(": ")
        raise ConfigError([(field, reason)]) from None


def check_servable(config: RunConfig) -> None:
    """The pipeline ends by exporting the policy as its rollout served it: a
    rollout that no serving format expresses is refused before any work, when
    the pipeline is built and when the run's parameters are applied."""
    from tracefp4.components.export import check_exportable
    from tracefp4.components.steps import rollout_quant

    try:
        check_exportable(rollout_quant(config))
    except ValueError as e:  # "field: reason"
        field, _, reason = str(e).partition(": ")
        raise ConfigError([(field, f"{reason}; the pipeline ends with that export")]) from None


def configure_function(params: list[Parameter], methods: list[str] | None = None, reach: bool = True):
    """The ``configure`` component's function: the compiled config and one
    typed input per parameter, returning the validated config JSON (with
    ``methods``, a comparison's: validated for each, :func:`apply_to_methods`),
    with ``reach`` once the store and the Kubernetes API answer (:func:`reached`).

    KFP builds a lightweight component from a function's source, and the
    inputs differ per schema, so the source is generated here and registered
    with :mod:`linecache`, which is where :func:`inspect.getsource` reads it."""
    names = [p.name for p in params]
    signature = ", ".join(f"{p.name}: {p.annotation.__name__}" for p in params)
    values = f"{{{', '.join(f'{n!r}: {n}' for n in names)}}}"
    call = (
        f"apply(config_json, {values})" if methods is None else f"apply_to_methods(config_json, {values}, {methods!r})"
    )
    functions = [call.partition("(")[0]] + (["reached"] if reach else [])
    source = (
        f"def configure(config_json: str, {signature}) -> str:\n"
        '    """The run config: the compiled one with the run\'s parameters, validated."""\n'
        f"    from tracefp4.pipelines.parameters import {', '.join(functions)}\n\n"
        f"    return {f'reached({call})' if reach else call}\n"
    )
    filename = f"<tracefp4 configure {abs(hash(source)):x}>"
    linecache.cache[filename] = (len(source), None, source.splitlines(keepends=True), filename)
    namespace: dict = {}
    exec(compile(source, filename, "exec"), namespace)  # noqa: S102 - our own generated source, no input in it
    return namespace["configure"]


def pipeline_signature(params: list[Parameter], config: RunConfig, extra: list[inspect.Parameter]) -> inspect.Signature:
    """The pipeline function's signature: ``extra`` (e.g. run_id), then every parameter with its default."""
    values = defaults(config, params)
    typed = [
        inspect.Parameter(
            p.name, inspect.Parameter.POSITIONAL_OR_KEYWORD, default=values[p.name], annotation=p.annotation
        )
        for p in params
    ]
    return inspect.Signature(extra + typed)


def docstring(summary: str, params: list[Parameter], extra: dict[str, str]) -> str:
    """A Google-style docstring: KFP reads each input's description from its Args section."""
    lines = [summary, "", "Args:"]
    lines += [f"    {name}: {text}" for name, text in extra.items()]
    lines += [f"    {p.name}: {' '.join(p.description.split())}" for p in params]
    return "\n".join(lines) + "\n"
