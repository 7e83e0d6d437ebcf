"""The Kubeflow pipeline: the smoke preset runs the whole DAG through
kfp.local; the compiled YAML names every component and parameter; the CLI."""

import json

import pytest
import yaml
from click.testing import CliRunner
from kfp import components

from tracefp4.components.checkpoint import load_model
from tracefp4.components.guidance import read_manifest
from tracefp4.components.steps import store_prefix
from tracefp4.components.store import open_store
from tracefp4.pipelines.cli import main
from tracefp4.pipelines.local import localize, run_local
from tracefp4.pipelines.pipeline import build_comparison_pipeline, compile_pipeline, pipeline_version
from tracefp4.schemas import get_preset, load_config

STEPS = ("prepare", "rollout", "compaction", "train", "evaluate", "report")


@pytest.fixture(scope="module")
def smoke_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("run")
    return out, run_local(get_preset("smoke"), out)


def test_smoke_preset_runs_the_whole_dag(smoke_run):
    out, report = smoke_run
    text = report.read_text()
    assert "# tracefp4 run `smoke`" in text and "| bf16 | arithmetic |" in text and "| fp4_wa_kv | arithmetic |" in text
    root = next((out / "pipeline_root").iterdir())
    assert {p.name for p in root.iterdir()} >= set(STEPS)
    policy = load_model(root / "train" / "new_policy")
    assert policy.cfg.num_layers == 2 and (root / "train" / "new_policy" / "tokenizer.json").exists()
    store = open_store(localize(get_preset("smoke"), out).store.uri)
    manifest = read_manifest(store, 0, store_prefix(get_preset("smoke"), "guidance"))
    assert manifest["bits"] == [1] and manifest["layers"] == [1]  # R-1bit on the deepest layer, as the preset says
    history = [json.loads(line) for line in (root / "train" / "history").read_text().splitlines()]
    assert len(history) == 1 and history[0]["guidance_coverage"] > 0.9


def test_compiled_yaml_names_every_component_and_parameter(tmp_path):
    config = load_config(None, preset="smoke", overrides={"rl.rounds": 2, "store.uri": "s3://runs/smoke"})
    path = compile_pipeline(config, tmp_path / "pipeline.yaml")
    spec = next(yaml.safe_load_all(open(path)))
    tasks = spec["root"]["dag"]["tasks"]
    assert set(tasks) == {"prepare", "rollout", "compaction", "train", "rollout-2", "compaction-2", "train-2", "evaluate", "report"}
    assert set(spec["root"]["inputDefinitions"]["parameters"]) == {"config_json"}
    assert json.loads(spec["root"]["inputDefinitions"]["parameters"]["config_json"]["defaultValue"])["rl"]["rounds"] == 2
    executors = spec["deploymentSpec"]["executors"]
    assert all(e["container"]["image"] == config.image for e in executors.values())
    assert all(e["container"]["resources"]["cpuLimit"] == 1 for e in executors.values())
    text = open(path).read()
    assert "mlpipeline-minio-artifact" in text and "TRACEFP4_S3_SECRET_KEY" in text  # credentials from the secret
    assert components.load_component_from_file(path).name == "tracefp4-smoke"
    assert pipeline_version().startswith("0.1.0-")


def test_cli(tmp_path):
    runner = CliRunner()
    result = runner.invoke(main, ["presets"])
    assert result.exit_code == 0 and "smoke" in result.output and "paper-nvfp4-wa-kv" in result.output
    result = runner.invoke(main, ["compile", "--preset", "smoke", "--output", str(tmp_path / "p.yaml")])
    assert result.exit_code == 0 and (tmp_path / "p.yaml").exists()
    bad = tmp_path / "bad.yaml"
    bad.write_text("rl:\n  learning_rate: -1\ntasks:\n  - name: chess\n")
    result = runner.invoke(main, ["compile", "--config", str(bad), "--output", str(tmp_path / "q.yaml")])
    assert result.exit_code != 0 and "rl.learning_rate" in result.output and "tasks.0.name" in result.output
    result = runner.invoke(main, ["schema", "--output", str(tmp_path / "schemas")])
    assert result.exit_code == 0 and (tmp_path / "schemas" / "run-config.schema.json").exists()
    for command in ("run", "compile", "schema", "presets", "report"):
        assert runner.invoke(main, [command, "--help"]).exit_code == 0


def test_html_report_holds_the_tables_and_plots(smoke_run):
    from html.parser import HTMLParser

    out, report = smoke_run
    page = report.with_name("page").read_text()

    class Collect(HTMLParser):
        tags, images, cells = [], [], []

        def handle_starttag(self, tag, attrs):
            self.tags.append(tag)
            if tag == "img":
                self.images.append(dict(attrs))

        def handle_data(self, data):
            self.cells.append(data.strip())

    parsed = Collect()
    parsed.feed(page)
    assert parsed.tags.count("table") == 2
    assert len(parsed.images) >= 2 and all(i["src"].startswith("data:image/png;base64,") for i in parsed.images)
    assert {"Train-rollout log-prob |diff|", "Reward and accuracy"} <= {i["alt"] for i in parsed.images}
    assert "fp4_wa_kv" in parsed.cells and "arithmetic" in parsed.cells
    assert any("run smoke: method trace" in c for c in parsed.cells)  # the page names its run and config


def test_cli_report_of_a_run(smoke_run):
    out, report = smoke_run
    result = CliRunner().invoke(main, ["report", str(out)])
    assert result.exit_code == 0 and str(report) in result.output


def test_comparison_pipeline_fans_out_over_methods(tmp_path):
    report = run_local(get_preset("smoke"), tmp_path, tmp_path / "log", methods=["trace", "qat"])
    text = report.read_text()
    assert "# tracefp4 comparison `smoke`" in text
    assert "| qat | bf16 | arithmetic |" in text and "| trace | fp4_wa_kv | arithmetic |" in text
    store = open_store(localize(get_preset("smoke"), tmp_path).store.uri)
    assert store.list("smoke/trace/guidance") and not store.list("smoke/qat/guidance")  # only trace ships guidance
    compiled = tmp_path / "compare.yaml"
    from kfp import compiler

    compiler.Compiler().compile(build_comparison_pipeline(get_preset("smoke"), ["trace", "qat"]), str(compiled))
    assert "parameterIterator" in compiled.read_text() or "iteratorPolicy" in compiled.read_text() or "for-loop" in compiled.read_text()


def test_inline_compaction_writes_guidance_from_the_rollout(tmp_path):
    from tracefp4.components import steps

    config = localize(load_config(None, preset="smoke", overrides={"guidance.compaction": "inline"}), tmp_path)
    policy = steps.prepare(config, tmp_path / "policy")
    steps.rollout(config, policy, 0, tmp_path / "trajectories.jsonl")
    store = open_store(config.store.uri)
    assert not store.list(store_prefix(config, "capture"))  # nothing full was shipped
    manifest = read_manifest(store, 0, store_prefix(config, "guidance"))
    assert manifest["bits"] == [1] and manifest["layers"] == [1]
    assert steps.compaction(config, 0)["bytes"] == sum(e["bytes"] for e in manifest["shards"])
    assert steps.train(config, policy, tmp_path / "trajectories.jsonl", 0, tmp_path / "next")[0]["guidance_coverage"] > 0.9
