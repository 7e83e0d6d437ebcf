"""The run config as typed pipeline parameters: the compiled inputs are pinned
by a golden file; a run-time override reaches the steps through kfp.local; a
field that shapes the DAG is no parameter; a bad value fails the run's first
task naming the field."""

import json
import os
from pathlib import Path

import pytest
import yaml

from tracefp4.components.checkpoint import fetch
from tracefp4.components.store import StoreError, open_store
from tracefp4.components.trainer_state import read_meta
from tracefp4.pipelines.parameters import apply, configure_function, defaults, parameters, reached
from tracefp4.pipelines.pipeline import build_pipeline, compile_pipeline
from tracefp4.schemas import ConfigError, RunConfig, get_preset, load_config

GOLDEN = Path(__file__).parent / "golden" / "smoke-inputs.json"
REGENERATE = "TRACEFP4_REGENERATE_GOLDEN=1 python -m pytest tests/test_parameters.py -k golden"


def compiled_inputs(tmp_path, methods=None) -> dict:
    spec = next(yaml.safe_load_all(open(compile_pipeline(get_preset("smoke"), tmp_path / "p.yaml", methods))))
    return spec["root"]["inputDefinitions"]["parameters"]


def test_compiled_inputs_match_the_golden_file(tmp_path):
    inputs = compiled_inputs(tmp_path)
    if os.environ.get("TRACEFP4_REGENERATE_GOLDEN"):
        GOLDEN.parent.mkdir(exist_ok=True)
        GOLDEN.write_text(json.dumps(inputs, indent=1, sort_keys=True) + "\n")
    assert inputs == json.loads(GOLDEN.read_text()), f"compiled inputs changed; if on purpose: {REGENERATE}"


def test_inputs_are_typed_with_the_presets_defaults_and_the_fields_descriptions(tmp_path):
    inputs = compiled_inputs(tmp_path)
    types = {name: spec["parameterType"] for name, spec in inputs.items()}
    assert types["rl_learning_rate"] == "NUMBER_DOUBLE" and types["rollout_group_size"] == "NUMBER_INTEGER"
    assert (
        types["guidance_allow_rtn_fallback"] == "BOOLEAN" and types["tasks"] == "LIST" and types["method"] == "STRING"
    )
    assert inputs["rollout_group_size"]["defaultValue"] == get_preset("smoke").rollout.group_size
    assert "One of: bf16, qat, quads, trace, tis_sc." in inputs["method"]["description"]
    for fixed in ("rl_rounds", "image", "resources_cpu", "store_uri", "name", "config_json", "train_launcher"):
        assert fixed not in inputs  # shapes the DAG or the pods: compiled in
    assert "method" not in compiled_inputs(tmp_path, ["trace", "qat"])  # a comparison's branches set it


def test_a_comparisons_first_task_checks_the_run_values_for_every_method(tmp_path):
    """A value some branch refuses stops the comparison in its first task, naming
    that branch, before any branch trains; every branch waits for that task."""
    config, params = get_preset("smoke"), parameters(comparison=True)
    config.store.uri = (tmp_path / "store").as_uri()  # which the task opens, as every step will
    configure = configure_function(params, ["bf16", "qat"])
    values = defaults(config, params)
    json.loads(configure(config.model_dump_json(), **values))
    with pytest.raises(ConfigError, match="the comparison's branch of method qat(.|\n)*method: qat trains against"):
        configure(config.model_dump_json(), **{**values, "rollout_config": "bf16"})
    spec = next(yaml.safe_load_all(open(compile_pipeline(config, tmp_path / "p.yaml", ["bf16", "qat"]))))
    loop = next(name for name in spec["root"]["dag"]["tasks"] if name.startswith("for-loop"))
    assert spec["root"]["dag"]["tasks"][loop]["dependentTasks"] == ["configure"]


def test_the_first_task_finds_a_store_the_steps_cannot_reach(s3_env):
    """configure opens the store as every step will (a local run does before it
    starts): a missing bucket fails the run's first task, not its first GPU step."""
    data = get_preset("smoke").model_dump()
    data["store"]["uri"] = "s3://no-such-bucket/runs"
    config_json = RunConfig.model_validate(data).model_dump_json()
    with pytest.raises(StoreError, match="no-such-bucket"):
        reached(config_json)
    data["store"]["create_bucket"] = True
    config_json = RunConfig.model_validate(data).model_dump_json()
    assert reached(config_json) == config_json


def test_the_first_task_finds_a_store_prefix_the_steps_cannot_write(s3_env, monkeypatch):
    """Credentials to which the bucket answers, but that may not write under
    the run's prefix (a profile's in multi-user Kubeflow): configure writes,
    reads back, lists and deletes an object there, and fails naming the write."""
    for name, value in s3_env.profile_env.items():
        monkeypatch.setenv(name, value)
    data = get_preset("smoke").model_dump()
    data["store"]["uri"] = f"s3://{s3_env.bucket}/tracefp4"
    with pytest.raises(
        StoreError, match=rf"s3://{s3_env.bucket}/tracefp4: put '.access-check/\w+' failed: AccessDenied"
    ):
        reached(RunConfig.model_validate(data).model_dump_json())
    data["store"]["uri"] = f"s3://{s3_env.bucket}/private/profile/tracefp4"
    config_json = RunConfig.model_validate(data).model_dump_json()
    assert reached(config_json) == config_json
    assert open_store(data["store"]["uri"]).list() == []  # its object deleted


def test_the_first_task_draws_the_tasks_the_steps_will_draw(tmp_path):
    """A task's generator alone knows how many distinct problems it holds
    (countdown at difficulty 1: about 2,750), so validation passes a split
    larger than that; configure draws them, so the run fails there, naming
    the task, not in prepare on a GPU node after fetching the checkpoint."""
    data = get_preset("smoke").model_dump()
    data["store"]["uri"] = (tmp_path / "store").as_uri()
    data["tasks"] = [{"name": "countdown", "difficulty": 1, "train_size": 2900, "test_size": 100}]
    data["rollout"]["max_new_tokens"] = 16  # room for countdown's answers
    config_json = RunConfig.model_validate(data).model_dump_json()
    with pytest.raises(ConfigError, match=r"tasks.0: train_size 2900 \+ test_size 100: countdown at difficulty 1: 27"):
        reached(config_json)
    assert not (tmp_path / "store").exists()  # refused before anything else is asked
    data["tasks"][0]["train_size"] = 2600
    config_json = RunConfig.model_validate(data).model_dump_json()
    assert reached(config_json) == config_json
    # the bootstrap draws its extra problems outside the splits, from what is left
    data["bootstrap"]["enabled"] = True
    data["bootstrap"]["extra_problems"] = [{"name": "countdown", "difficulty": 1, "size": 200}]
    config_json = RunConfig.model_validate(data).model_dump_json()
    with pytest.raises(ConfigError, match=r"bootstrap.extra_problems.0: size 200: countdown at difficulty 1: "):
        reached(config_json)


def test_the_first_task_finds_a_prompt_without_room_for_its_response(tmp_path):
    """A preset's character tokenizer is known without a checkpoint: configure
    encodes every task's longest prompt as prepare would, so a program prompt
    of 100+ characters under the smoke preset's 64-token sequences fails the
    run's first task naming the fields that make room, not prepare."""
    data = get_preset("smoke").model_dump()
    data["store"]["uri"] = (tmp_path / "store").as_uri()
    data["tasks"] = [
        {"name": "arithmetic", "train_size": 8, "test_size": 4},
        {"name": "program", "difficulty": 3, "train_size": 8, "test_size": 4},
    ]
    config_json = RunConfig.model_validate(data).model_dump_json()
    with pytest.raises(ConfigError) as info:
        reached(config_json)
    ((path, reason),) = info.value.problems
    assert path == "model.max_seq_len" and "tasks.1: program at difficulty 3" in reason
    assert reason.endswith(
        "exceed model.max_seq_len 64: raise it or lower rollout.max_new_tokens or lower tasks.1.difficulty"
    )
    assert not (tmp_path / "store").exists()  # refused before anything else is asked
    data["model"]["max_seq_len"] = 256
    config_json = RunConfig.model_validate(data).model_dump_json()
    # nor is there room for the program's answers in 8 new tokens: cut before their end, they would score nothing
    with pytest.raises(ConfigError) as info:
        reached(config_json)
    ((path, reason),) = info.value.problems
    assert path == "rollout.max_new_tokens" and "(tasks.1: program at difficulty 3) before their end" in reason
    assert reason.endswith("which then score nothing: raise it or lower tasks.1.difficulty")
    data["rollout"]["max_new_tokens"] = 64
    config_json = RunConfig.model_validate(data).model_dump_json()
    assert reached(config_json) == config_json


def test_the_first_task_finds_an_extra_problem_longer_than_the_bootstraps_examples(tmp_path):
    """The bootstrap refuses an example (prompt and answer) beyond model.max_seq_len before it trains; a
    preset's extra problems, never a prompt of the rollout, are checked so in configure, naming the entry."""
    data = get_preset("smoke").model_dump()
    data["store"]["uri"] = (tmp_path / "store").as_uri()
    data["bootstrap"]["extra_problems"] = [{"name": "countdown", "size": 4}, {"name": "program", "size": 2}]
    config_json = RunConfig.model_validate(data).model_dump_json()
    with pytest.raises(ConfigError) as info:
        reached(config_json)
    ((path, reason),) = info.value.problems
    assert path == "bootstrap.extra_problems.1" and "(model.max_seq_len): raise it or lower the difficulty" in reason
    assert reason.startswith("a program example of ") and "exceeds max_len 64" in reason
    data["model"]["max_seq_len"] = 128
    config_json = RunConfig.model_validate(data).model_dump_json()
    assert reached(config_json) == config_json


def test_a_dag_shaping_field_cannot_be_set_at_run_time():
    pipeline = build_pipeline(get_preset("smoke"))
    with pytest.raises(TypeError):
        pipeline(rl_rounds=3)


def test_apply_merges_and_validates_naming_the_field():
    config = get_preset("smoke")
    values = defaults(config, parameters())
    assert json.loads(apply(config.model_dump_json(), values)) == json.loads(config.model_dump_json())
    changed = json.loads(apply(config.model_dump_json(), {**values, "rl_learning_rate": 0.5, "guidance_layers": "all"}))
    assert changed["rl"]["learning_rate"] == 0.5 and changed["guidance"]["layers"] == "all"
    assert json.loads(apply(config.model_dump_json(), {**values, "guidance_layers": "[0, 1]"}))["guidance"][
        "layers"
    ] == [0, 1]
    with pytest.raises(ConfigError, match=r"rl.learning_rate: .*greater than 0"):
        apply(config.model_dump_json(), {**values, "rl_learning_rate": -1.0})
    with pytest.raises(ConfigError, match="method: Input should be"):
        apply(config.model_dump_json(), {**values, "method": "qarl"})


def test_a_rollout_no_serving_format_expresses_is_refused_before_any_work():
    """The pipeline ends by exporting the policy as its rollout served it; compressed-tensors has
    no per-token NVFP4 activation global scale, so such a run is refused when built or configured."""
    per_token = load_config(None, "smoke", {"rollout.activation_global_scale": "per_token"})
    with pytest.raises(ConfigError, match="per_token cannot be exported.*the pipeline ends with that export") as info:
        build_pipeline(per_token)
    assert [path for path, _ in info.value.problems] == ["rollout.activation_global_scale"]
    config = get_preset("smoke")
    values = defaults(config, parameters())
    with pytest.raises(ConfigError, match="per_token cannot be exported"):
        apply(config.model_dump_json(), {**values, "rollout_activation_global_scale": "per_token"})


def test_an_override_reaches_the_steps(tmp_path):
    """kfp.local, the smoke preset without bootstrap, the learning rate and seed set at run time."""
    import kfp.local

    config = get_preset("smoke")
    config.bootstrap.enabled = False
    config.evaluation.rollout_configs = ["bf16"]  # what is checked here is the training step
    config.store.uri = (tmp_path / "store").as_uri()
    config.metrics.metrics_file = str(tmp_path / "metrics.prom")
    kfp.local.init(runner=kfp.local.SubprocessRunner(use_venv=False), pipeline_root=str(tmp_path / "root"))
    build_pipeline(config, retries=False)(run_id="run-x", seed=7, rl_learning_rate=0.25, bootstrap_steps=3)
    root = next((tmp_path / "root").iterdir())
    state = read_meta(fetch(root / "train" / "new_trainer_state"))
    assert state["run_id"] == "run-x" and state["param_groups"][0]["lr"] == 0.25
    history = [json.loads(line) for line in (root / "train" / "history").read_text().splitlines()]
    assert history and all(row["method"] == "trace" for row in history)
    with pytest.raises(RuntimeError, match="configure"):  # a bad value fails the first task, before any work
        build_pipeline(config, retries=False)(run_id="run-y", rl_learning_rate=-1.0)
    assert not list((tmp_path / "root").glob("*/prepare"))[1:]  # the failed run prepared nothing


def test_compile_command_compiles_the_comparison(tmp_path):
    from click.testing import CliRunner

    from tracefp4.pipelines.cli import main

    result = CliRunner().invoke(
        main, ["compile", "--preset", "smoke", "--compare", "trace,qat", "--output", str(tmp_path / "c.yaml")]
    )
    assert result.exit_code == 0, result.output
    spec = next(yaml.safe_load_all(open(tmp_path / "c.yaml")))
    assert (
        spec["pipelineInfo"]["name"] == "tracefp4-smoke-compare"
        and "methods trace, qat" in spec["pipelineInfo"]["description"]
    )
    result = CliRunner().invoke(
        main, ["compile", "--preset", "smoke", "--compare", "trace,trace", "--output", str(tmp_path / "d.yaml")]
    )
    assert result.exit_code == 2 and "named more than once" in result.output
