"""A schema value either runs or is rejected at validation: for every value of
every Literal in the run config (found by walking the models, so a new Literal
without a runner here fails), the smoke preset with that value either fails
validation or runs the part of the library that reads it."""

import types
import typing

import pydantic
import pytest
import torch

from tracefp4.components import steps
from tracefp4.components.model import build_model
from tracefp4.components.ptq import apply_ptq
from tracefp4.components.rollout import SamplingParams, TorchEngine
from tracefp4.components.tasks import TASKS, get_task, split
from tracefp4.pipelines.pipeline import compile_pipeline
from tracefp4.schemas import RunConfig, get_preset


def literal_fields(model: type[pydantic.BaseModel], prefix: str = "") -> dict[str, tuple]:
    """Dotted path -> allowed values, for every Literal-typed field (inside lists and Optionals too)."""
    out = {}
    for name, field in model.model_fields.items():
        stack = [field.annotation]
        while stack:
            t = stack.pop()
            if typing.get_origin(t) is typing.Literal:
                out[prefix + name] = typing.get_args(t)
            elif isinstance(t, type) and issubclass(t, pydantic.BaseModel):
                out.update(literal_fields(t, f"{prefix}{name}."))
            elif typing.get_origin(t) in (list, typing.Union, types.UnionType, typing.Annotated):
                stack += [a for a in typing.get_args(t) if not isinstance(a, (pydantic.fields.FieldInfo, str))]
    return out


def _round(config: RunConfig, tmp_path):
    steps.prepare(config, tmp_path / "p0", "run", tmp_path / "s0")
    steps.run_round(config, tmp_path / "p0", tmp_path / "s0", 0, tmp_path / "p1", tmp_path / "s1", tmp_path, "run")


def _generate(config: RunConfig, tmp_path):
    for name in config.evaluation.rollout_configs:
        engine = TorchEngine(
            build_model("smoke", seed=0), steps.rollout_quant(config, name), dtype=steps.compute_dtype(config)
        )
        assert len(engine.generate([[1, 2, 3]], SamplingParams(max_new_tokens=2))[0].response) == 2


def _prepare(config: RunConfig, tmp_path):
    steps.prepare(config, tmp_path / "p0", "run")


def _task(config: RunConfig, tmp_path):
    for t in config.tasks:
        train, _ = split(t.name, 4, 1, config.seed, t.difficulty)
        assert get_task(t.name).reward(train[0], train[0].answer) == 1.0


def _extra(config: RunConfig, tmp_path):
    train, _, test = steps.sft_problems(config)
    (extra,) = config.bootstrap.extra_problems
    for p in train[-extra.size :]:
        assert p.task == extra.name and get_task(p.task).reward(p, p.answer) == 1.0
        assert p.prompt not in {q.prompt for q in train[: -extra.size] + test}


def _ptq(config: RunConfig, tmp_path):
    for method in config.evaluation.ptq_baselines:
        apply_ptq(build_model("smoke", seed=0), method, torch.randint(0, 100, (2, 16)))


def _compile(config: RunConfig, tmp_path):
    assert compile_pipeline(config, tmp_path / "p.yaml")


def _launch(config: RunConfig, tmp_path):
    """Two training processes as ``train.launcher`` says: torchrun trains the
    round; a TrainJob is built, and outside a cluster refused naming the fix."""
    from tracefp4.components.distributed import DistributedError
    from tracefp4.pipelines import trainjob

    steps.prepare(config, tmp_path / "p0", "run", tmp_path / "s0")
    steps.rollout(config, tmp_path / "p0", 0, tmp_path / "t.jsonl", "run")
    ref, stats = steps.compaction(config, tmp_path / "p0", tmp_path / "t.jsonl", 0, "run")
    (tmp_path / "g.json").write_text(ref.to_json())
    inputs = (
        tmp_path / "p0",
        tmp_path / "s0",
        tmp_path / "t.jsonl",
        tmp_path / "g.json",
        tmp_path / "p1",
        tmp_path / "s1",
    )
    inputs = tuple(str(path) for path in inputs)
    if config.train.launcher == "torchrun":
        assert trainjob.distributed_train(config, *inputs, "run", stats)[0]["step"] == 1
    else:
        assert trainjob.trainjob(config, "x", "ns", [], b"{}")["spec"]["trainer"]["numProcPerNode"] == 2
        with pytest.raises(DistributedError, match="in-cluster"):
            trainjob.distributed_train(config, *inputs, "run", stats)


RUNNERS = {
    "model.preset": _prepare,
    "model.dtype": _generate,
    "rollout.fmt": _generate,
    "rollout.config": _round,
    "rollout.activation_global_scale": _round,
    "method": _round,
    "guidance.compaction": _round,
    "guidance.codec": _round,
    "guidance.layers": _round,
    "rl.schedule": _round,
    "train.precision": _round,
    "tasks.name": _task,
    "bootstrap.extra_problems.name": _extra,
    "evaluation.rollout_configs": _generate,
    "evaluation.ptq_baselines": _ptq,
    "resources.tolerations.operator": _compile,
    "resources.tolerations.effect": _compile,
    "train.launcher": _launch,
}
# Named values of a field that is no Literal: a task's name is a generated family's, or, with data, free
# (tests/test_problem_files.py runs a file task)
NAMED = {"tasks.name": tuple(TASKS)}
CASES = [(path, value) for path, values in sorted({**literal_fields(RunConfig), **NAMED}.items()) for value in values]


def test_every_literal_has_a_runner():
    assert set(literal_fields(RunConfig)) | set(NAMED) == set(RUNNERS)


def _with(path: str, value) -> dict:
    data = get_preset("smoke").model_dump()
    data["bootstrap"]["enabled"] = False
    data["evaluation"]["rollout_configs"] = [data["rollout"]["config"]]
    if path == "rl.schedule" and value == "off_policy":
        data["rl"]["steps_per_round"] = 2
    section, _, leaf = path.rpartition(".")
    if path == "tasks.name":
        data["tasks"] = [{"name": value}]
    elif path == "bootstrap.extra_problems.name":
        data["bootstrap"]["extra_problems"] = [{"name": value, "size": 4}]
    elif section == "resources.tolerations":
        data["resources"]["tolerations"] = [
            {"key": "k", "operator": value, "value": None if value == "Exists" else "v"}
        ]
        if leaf == "effect":
            data["resources"]["tolerations"][0].update(effect=value, operator="Exists", value=None)
    elif path.startswith("evaluation."):
        data["evaluation"][leaf] = [value]
    else:
        target = data
        for key in section.split(".") if section else []:
            target = target[key]
        target[leaf] = value
    if path == "model.preset":
        data["model"]["max_seq_len"] = 64
    if path == "train.launcher":  # two processes (float32 parameters, sharded), one microbatch each
        data["train"].update(processes_per_node=2, precision="fp32_master")
        data["rl"]["microbatch_size"] = 2
    return data


@pytest.mark.parametrize("path, value", CASES, ids=[f"{p}={v}" for p, v in CASES])
def test_a_value_runs_or_is_rejected_at_validation(path, value, tmp_path):
    try:
        config = RunConfig.model_validate(_with(path, value))
    except pydantic.ValidationError:
        return  # rejected where the user sees it, before any work
    config = config.model_copy(update={"store": config.store.model_copy(update={"uri": (tmp_path / "s").as_uri()})})
    RUNNERS[path](config, tmp_path)


def test_the_rejections_are_the_ones_we_mean():
    rejected = set()
    for path, value in CASES:
        try:
            RunConfig.model_validate(_with(path, value))
        except pydantic.ValidationError:
            rejected.add((path, value))
    assert rejected == {
        ("rollout.config", "bf16")
    }  # trace (the smoke preset's method) guides nothing under a BF16 rollout
