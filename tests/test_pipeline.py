"""The Kubeflow pipeline: the smoke preset runs the whole DAG through
kfp.local; the compiled YAML names every component and parameter; the CLI."""

import builtins
import gc
import inspect
import io
import json
import logging
import shutil
import time
import weakref
from types import SimpleNamespace

import pytest
import torch
import yaml
from click.testing import CliRunner
from kfp import components

from tracefp4.components.checkpoint import LOCATION, MANIFEST, fetch, folder_digest, load_model, location, provenance
from tracefp4.components.guidance import read_manifest
from tracefp4.components.steps import store_prefix
from tracefp4.components.store import open_store
from tracefp4.components.trainer_state import read_meta
from tracefp4.pipelines import resume
from tracefp4.pipelines.cli import main
from tracefp4.pipelines.local import continuation_of, localize, ran_to_its_end, run_local, task_count
from tracefp4.pipelines.pipeline import (
    RUN_TASKS_WARN,
    build_comparison_pipeline,
    build_pipeline,
    compile_pipeline,
    compiled_documents,
    pipeline_version,
    run_size_problem,
    run_tasks,
    version_name,
)
from tracefp4.schemas import ConfigError, RunConfig, get_preset, load_config
from tracefp4.schemas.config import CLUSTER_ONLY

STEPS = ("prepare", "rollout", "compaction", "train", "export", "evaluate", "report")
RUN = "run-a"


@pytest.fixture(scope="module")
def smoke_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("run")
    return out, run_local(get_preset("smoke"), out)


def test_smoke_preset_runs_the_whole_dag(smoke_run):
    out, report = smoke_run
    text = report.read_text()
    assert (
        "# tracefp4 run `smoke`" in text
        and "| trace | trained | bf16 |" in text
        and "| trace | trained | fp4_wa_kv |" in text
    )
    assert text.index("| trace | initial | bf16 |") < text.index(
        "| trace | trained | bf16 |"
    )  # where RL started, first
    root = next((out / "pipeline_root").iterdir())
    assert {p.name for p in root.iterdir()} >= set(STEPS)
    policy = load_model(root / "train" / "new_policy")
    assert policy.cfg.num_layers == 2 and (root / "train" / "new_policy" / "tokenizer.json").exists()
    store = open_store(localize(get_preset("smoke"), out).store.uri)
    run_id = provenance(root / "train" / "new_policy")["run_id"]
    assert run_id and provenance(root / "prepare" / "policy") == {"run_id": run_id, "policy_version": 0}
    standing = root / "train" / "new_trainer_state"  # beside the policy, not in it; in the store, not in KFP's root
    assert sorted(p.name for p in standing.iterdir()) == sorted([MANIFEST, LOCATION])
    assert location(standing).startswith(f"{store.uri}/smoke/{run_id}/trace/trainer-state/round-000000-")
    state = read_meta(fetch(standing))
    assert (state["run_id"], state["policy_version"]) == (run_id, 1)
    assert read_meta(root / "prepare" / "trainer_state")["policy_version"] == 0
    manifest = read_manifest(store, 0, store_prefix(get_preset("smoke"), run_id, "guidance"))
    assert manifest["bits"] == [1] and manifest["layers"] == [1]  # R-1bit on the deepest layer, as the preset says
    guidance = json.loads(
        (root / "compaction" / "guidance").read_text()
    )  # the artifact on the compaction -> train edge
    assert (guidance["run_id"], guidance["layers"], guidance["policy_version"]) == (run_id, [1], 0)
    history = [json.loads(line) for line in (root / "train" / "history").read_text().splitlines()]
    assert len(history) == 1 and history[0]["guidance_coverage"] > 0.9
    exported = json.loads((root / "export" / "exported" / "config.json").read_text())  # the final policy, for serving
    assert exported["quantization_config"]["format"] == "nvfp4-pack-quantized"
    assert provenance(root / "export" / "exported")["exported_from"] == folder_digest(root / "train" / "new_policy")


def test_a_continuation_goes_on_from_the_smoke_runs_final_policy_and_state(smoke_run, tmp_path):
    """The next run of a schedule split into runs, as a user starts it: the
    last train task's new_policy and new_trainer_state, the rounds done."""
    out, first = smoke_run
    root = next((out / "pipeline_root").iterdir())
    settings = continuation_of(out, steps_per_round=1)  # what `tracefp4 run --continue-from` sets
    # a --set of one of them is refused: it was replaced, the run going on from another policy than the one asked
    asked = ["run", "--preset", "smoke", "--continue-from", str(out), "--output", str(tmp_path / "then")]
    refused = CliRunner().invoke(main, [*asked, "--set", f"model.checkpoint={tmp_path / 'other'}"])
    assert refused.exit_code == 2 and "--continue-from sets model.checkpoint to " in refused.output, refused.output
    assert settings == {
        "model.preset": None,
        "model.checkpoint": str(root / "train" / "new_policy"),
        "model.trainer_state": str(root / "train" / "new_trainer_state"),
        "rl.first_round": 1,
        "bootstrap.enabled": False,
    }
    with pytest.raises(
        ValueError,
        match="policy version 1 is no whole number of rounds of rl.steps_per_round 2 .* the --preset, --config and "
        "--set the run was started with",
    ):
        continuation_of(out, steps_per_round=2)
    # a train task stopped after committing its state (its run resumed, and the task ran again) left a state of
    # the same run and version, newer, that no cache entry names: not one of a comparison's, and not gone on from
    moved = tmp_path / "moved"
    shutil.copytree(out, moved)
    killed = moved / "pipeline_root" / "tracefp4-smoke-killed" / "train" / "new_trainer_state"
    shutil.copytree(root / "train" / "new_trainer_state", killed)
    assert continuation_of(moved, steps_per_round=1)["model.trainer_state"] == str(
        moved.resolve() / root.relative_to(out) / "train" / "new_trainer_state"
    )
    # the report ends with the same settings, as a config file to continue with (on a cluster: the artifacts' URIs)
    section = first.read_text().split("## Continue this run")[1]
    (tmp_path / "continue.yaml").write_text(section.split("```yaml\n")[1].split("```")[0])
    page = (first.parent / "page").read_text()
    assert "<pre>bootstrap:\n  enabled: false\nmethod: trace\nmodel:\n" in page and "first_round: 1\n</pre>" in page
    config = load_config(tmp_path / "continue.yaml", preset="smoke")
    assert config == load_config(preset="smoke", overrides=settings)
    report = run_local(config, tmp_path / "then")
    assert "# tracefp4 run `smoke`" in report.read_text()
    then = next((tmp_path / "then" / "pipeline_root").iterdir())
    run_id = provenance(then / "prepare" / "policy")["run_id"]
    assert run_id != provenance(root / "train" / "new_policy")["run_id"]  # a run of its own
    assert provenance(then / "prepare" / "policy") == {"run_id": run_id, "policy_version": 1}
    assert provenance(then / "train" / "new_policy") == {"run_id": run_id, "policy_version": 2}
    assert read_meta(fetch(then / "train" / "new_trainer_state"))["policy_version"] == 2
    history = [json.loads(line) for line in (then / "train" / "history").read_text().splitlines()]
    assert [(row["round"], row["step"]) for row in history] == [(1, 2)]


# every cluster-only setting (schemas/config.py's CLUSTER_ONLY) at another value than the smoke preset's
CLUSTER_CHANGES = {
    "image": "registry.example.com/team/tracefp4:next",
    "kfp_host": "http://ml-pipeline.other:8888",
    "resources.cpu": "16",
    "resources.memory": "64Gi",
    "resources.host_cpu": "4",
    "resources.host_memory": "16Gi",
    "resources.gpus": 1,
    "resources.accelerator_type": "nvidia.com/gpu",
    "resources.node_selector": {"pool": "gpu"},
    "resources.tolerations": [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}],
    "resources.labels": {"kueue.x-k8s.io/queue-name": "team-a"},
    "store.secret_name": "other-store",
    "store.ca_bundle_secret": "store-ca",
    "train.trainjob_runtime": "other-runtime",
    "train.queue_timeout_seconds": 600,
}
# settings beside them that the steps read (the device every step computes on, how long ranks wait at a
# collective, the metrics' job label, whether the store makes its bucket): each another local run
READ_CHANGES = {
    "resources.device": "cpu",
    "train.timeout_seconds": 900,
    "metrics.job": "other",
    "store.create_bucket": True,
}


def test_cluster_only_settings_shape_the_compiled_pods_and_nothing_a_local_task_gets(tmp_path):
    """The cluster compile puts each cluster-only setting into the pods; a local
    run leaves them at their defaults, in the pipeline it runs (every task's
    image, command, inputs and environment: kfp.local's key) and in the
    request its run id is kept by, while a setting a step reads stays in both."""
    assert set(CLUSTER_CHANGES) == set(CLUSTER_ONLY)
    base, changed = get_preset("smoke"), load_config(None, preset="smoke", overrides=CLUSTER_CHANGES)
    spec, platform = compiled_documents(open(compile_pipeline(changed, tmp_path / "cluster.yaml"), "rb").read())
    executors = spec["deploymentSpec"]["executors"]
    pods = platform["platforms"]["kubernetes"]["deploymentSpec"]["executors"]
    assert all(e["container"]["image"] == CLUSTER_CHANGES["image"] for e in executors.values())
    prepare, pod = executors["exec-prepare"]["container"]["resources"], pods["exec-prepare"]
    assert (prepare["resourceCpuLimit"], prepare["resourceMemoryLimit"], prepare["accelerator"]["count"]) == (
        "16",
        "64Gi",
        "1",
    )
    assert pod["nodeSelector"] == {"labels": {"pool": "gpu"}}
    assert [t["key"] for t in pod["tolerations"]] == ["nvidia.com/gpu"]
    assert pod["podMetadata"]["labels"] == CLUSTER_CHANGES["resources.labels"]
    assert [s["secretName"] for s in pod["secretAsEnv"]] == ["other-store"]
    assert [s["secretName"] for s in pod["secretAsVolume"]] == ["store-ca"]
    local = {name: localize(config, tmp_path / "run") for name, config in (("base", base), ("changed", changed))}
    assert local["changed"] == local["base"]
    built = {name: build_pipeline(config, retries=False).pipeline_spec for name, config in local.items()}
    assert built["changed"] == built["base"]
    store = open_store(local["base"].store.uri)
    assert resume.request(local["changed"], None, store) == resume.request(local["base"], None, store)
    for path, value in READ_CHANGES.items():
        read = localize(load_config(None, preset="smoke", overrides={path: value}), tmp_path / "run")
        assert resume.request(read, None, store) != resume.request(local["base"], None, store), path


def test_a_local_run_reads_relative_paths_as_absolute_ones_so_its_settings_read_back_anywhere(tmp_path, monkeypatch):
    """The report's settings are the run's: a relative problem, reward or checkpoint path in them would name
    another file, or none, read from another folder."""
    monkeypatch.chdir(tmp_path)
    tasks = [
        {"name": "mine", "data": "p.jsonl", "reward": "r/rewards.py:score"},
        {"name": "theirs", "data": "s3://bucket/p.jsonl", "reward": "/abs/./rewards.py:score"},
    ]
    model = {"checkpoint": "ckpt/", "trainer_state": "file:///s"}  # normal: a trailing / was another run
    config = RunConfig.model_validate({"model": model, "rl": {"first_round": 1}, "tasks": tasks})
    local = localize(config, tmp_path / "run")
    assert [(t.data, t.reward) for t in local.tasks] == [
        (f"{tmp_path}/p.jsonl", f"{tmp_path}/r/rewards.py:score"),
        ("s3://bucket/p.jsonl", "/abs/rewards.py:score"),
    ]
    assert (local.model.checkpoint, local.model.trainer_state) == (f"{tmp_path}/ckpt", "file:///s")


def test_a_local_rerun_that_changes_only_cluster_settings_reuses_every_task(tmp_path):
    """The image, a pod's resources or placement change no step's output in a
    local run: a rerun with only those changed resumes, every task reused
    (hours of a paper run's rollouts and training were run again, as a new
    run); one that changes a setting the steps read runs every task again."""
    smoke = get_preset("smoke")
    report = run_local(smoke, tmp_path, out=io.StringIO())
    said = io.StringIO()
    assert run_local(load_config(None, preset="smoke", overrides=CLUSTER_CHANGES), tmp_path, out=said) == report
    assert "resumed" in said.getvalue()
    rerun = (tmp_path / "pipeline.log").read_text().split("==== ")[-1]
    assert "Executing task" not in rerun and rerun.count("cache hit") == task_count(smoke)
    said = io.StringIO()
    read = load_config(None, preset="smoke", overrides={**CLUSTER_CHANGES, "resources.device": "cpu"})
    assert "# tracefp4 run `smoke`" in run_local(read, tmp_path, out=said).read_text()
    assert "a new run" in said.getvalue()
    rerun = (tmp_path / "pipeline.log").read_text().split("==== ")[-1]
    assert "cache hit" not in rerun and rerun.count("Executing task") == task_count(smoke)


def test_tiny_qwen35_preset_runs_the_smoke_pipeline(tmp_path):
    """The smoke DAG on the hybrid Qwen3.5-MoE model: FP4 rollout with its
    recurrent states, guided training on a linear- and a full-attention layer,
    evaluation, the report."""
    config = get_preset("tiny-qwen35")
    text = run_local(config, tmp_path).read_text()
    assert "# tracefp4 run `tiny-qwen35`" in text and "| trace | trained | fp4_wa_kv |" in text
    root = next((tmp_path / "pipeline_root").iterdir())
    policy = load_model(root / "train" / "new_policy")
    assert policy.cfg.model_type == "qwen3_5_moe" and policy.cfg.linear_layers == [0, 1, 2]
    guidance = json.loads((root / "compaction" / "guidance").read_text())
    assert guidance["layers"] == [2, 3]
    history = [json.loads(line) for line in (root / "train" / "history").read_text().splitlines()]
    assert len(history) == 1 and history[0]["guidance_coverage"] > 0.9


def test_compiled_yaml_names_every_component_and_parameter(tmp_path):
    config = load_config(None, preset="smoke", overrides={"rl.rounds": 2, "store.uri": "s3://runs/smoke"})
    path = compile_pipeline(config, tmp_path / "pipeline.yaml")
    spec = next(yaml.safe_load_all(open(path)))
    tasks = spec["root"]["dag"]["tasks"]
    assert set(tasks) == {
        "configure",
        "prepare",
        "rollout",
        "compaction",
        "train",
        "rollout-2",
        "compaction-2",
        "train-2",
        "export",
        "evaluate",
        "report",
    }
    inputs = spec["root"]["inputDefinitions"]["parameters"]
    assert inputs["rl_learning_rate"]["parameterType"] == "NUMBER_DOUBLE" and "rl_rounds" not in inputs
    train = spec["components"][tasks["train"]["componentRef"]["name"]]["inputDefinitions"]["artifacts"]
    assert tasks["train"]["inputs"]["artifacts"]["guidance"]["taskOutputArtifact"]["producerTask"] == "compaction"
    assert train["guidance"]["artifactType"]["schemaTitle"] == "system.Artifact"
    retried = {t for t in tasks if "retryPolicy" in tasks[t]}  # a cluster retries (with backoff); run_local does not
    assert retried == set(tasks) - {"configure", "report"}  # whose failures are deterministic
    assert "rounds 2" in spec["pipelineInfo"]["description"]  # fixed at compile time, and said so
    executors = spec["deploymentSpec"]["executors"]
    assert all(e["container"]["image"] == config.image for e in executors.values())
    assert all(e["container"]["resources"]["cpuLimit"] == 1 for e in executors.values())
    text = open(path).read()
    assert "tracefp4-store" in text and "TRACEFP4_S3_SECRET_KEY" in text  # credentials from the secret
    assert "TRACEFP4_S3_ENDPOINT" not in text  # the pods' own environment unless the config names one
    config.store.endpoint = "http://minio.tracefp4.svc.cluster.local:9000"
    text = open(compile_pipeline(config, tmp_path / "with-endpoint.yaml")).read()
    assert text.count("TRACEFP4_S3_ENDPOINT") == text.count("TRACEFP4_S3_SECRET_KEY") > 0  # every task gets it
    assert components.load_component_from_file(path).name == "tracefp4-smoke"
    assert pipeline_version().startswith("0.1.0-")


def _leaf_executors(spec: dict) -> dict:
    """Every container task of a compiled pipeline, loops' bodies included: name -> (task, its executor's label)."""
    components_, out = spec["components"], {}

    def walk(dag):
        for name, task in dag["tasks"].items():
            component = components_[task["componentRef"]["name"]]
            if "dag" in component:
                walk(component["dag"])
            else:
                out[name] = (task, component["executorLabel"])

    walk(spec["root"]["dag"])
    return out


def _leaf_tasks(spec: dict) -> dict:
    """Every container task of a compiled pipeline, loops' bodies included: name -> (resources, retried)."""
    executors = spec["deploymentSpec"]["executors"]
    return {
        name: (executors[label]["container"]["resources"], "retryPolicy" in task)
        for name, (task, label) in _leaf_executors(spec).items()
    }


def test_kfps_task_setters_run_off_the_callers_stack_and_their_errors_reach_it(monkeypatch):
    """KFP's setters read the source of every frame of the stack they run on (``inspect.stack()``): a pipeline
    built from deep in a caller's stack (a test runner's, a notebook's) sets its tasks up from a shallow one."""
    from kfp.dsl import pipeline_task

    depths, checked = [], pipeline_task.PipelineTask._ensure_container_spec_exists

    def counted(task):
        depths.append(len(inspect.stack(0)))
        return checked(task)

    monkeypatch.setattr(pipeline_task.PipelineTask, "_ensure_container_spec_exists", counted)

    def built(depth):  # the pipeline built `depth` frames below here
        return built(depth - 1) if depth else build_pipeline(get_preset("smoke"))

    built(100)
    assert depths and max(depths) < 20  # a thread's few frames, not pytest's and the 100 below them
    monkeypatch.setattr(pipeline_task.PipelineTask, "set_cpu_limit", lambda task, cpu: 1 / 0)
    with pytest.raises(ZeroDivisionError):
        built(0)


def test_every_step_gets_the_stores_region_and_ca_bundle(tmp_path):
    """A store on https whose certificate a private CA signed: every step's pod, a loop's, a chained run's last
    and a comparison's included, mounts the secret store.ca_bundle_secret and finds its ca.crt through
    SSL_CERT_FILE, and signs for store.region; unset, the pods get neither."""
    store = {"store.uri": "s3://runs/smoke", "store.endpoint": "https://minio.tracefp4:9000", "rollout.workers": 2}
    tls = {"store.region": "eu-central-1", "store.ca_bundle_secret": "store-ca"}
    endpoint = {"TRACEFP4_S3_ENDPOINT": "https://minio.tracefp4:9000"}
    chained = {"rl.rounds": 2, "rl.rounds_per_run": 1}
    for name, overrides, methods, env in [
        ("run", {**store, **chained, **tls}, None, {"TRACEFP4_S3_REGION": "eu-central-1"}),
        ("compare", {**store, **tls}, ["qat", "trace"], {"TRACEFP4_S3_REGION": "eu-central-1"}),
        ("plain", {**store, **chained}, None, {}),
    ]:
        config = load_config(None, preset="smoke", overrides=overrides)
        path = compile_pipeline(config, tmp_path / f"{name}.yaml", methods)
        spec, platform = compiled_documents(open(path, "rb").read())
        tasks = _leaf_executors(spec)
        assert {"gather", "chain" if name != "compare" else "compare"} <= set(tasks), name
        volumes = platform["platforms"]["kubernetes"]["deploymentSpec"]["executors"]
        for task, (_, label) in tasks.items():
            found = {e["name"]: e["value"] for e in spec["deploymentSpec"]["executors"][label]["container"]["env"]}
            mounted = volumes[label].get("secretAsVolume", [])
            if name == "plain":  # nothing of either
                assert found == endpoint and mounted == [], task
                continue
            assert found == {**endpoint, **env, "SSL_CERT_FILE": "/etc/tracefp4/store-ca/ca.crt"}, task
            assert [(v["secretName"], v["mountPath"], v["optional"]) for v in mounted] == [
                ("store-ca", "/etc/tracefp4/store-ca", False)  # a secret missing is the pod's error, not a skip
            ], task
    # a local run mounts no secret: its steps trust what its own SSL_CERT_FILE says, not a file that is not there
    local = localize(load_config(None, preset="smoke", overrides={**store, **tls}), tmp_path / "local")
    assert local.store.ca_bundle_secret is None and local.store.pod_environment() == {
        **endpoint,
        "TRACEFP4_S3_REGION": "eu-central-1",
    }


def test_only_steps_that_run_the_model_hold_gpus(tmp_path):
    """On a GPU cluster the control tasks run small and are not retried (the
    chain's submission runs small and is retried), and
    the tasks that only move data (gather; train when its ranks are a TrainJob)
    hold no GPU: the TrainJob's ranks would otherwise wait for the GPUs its own
    launching pod holds; they take `host_cpu` and `host_memory`, so that on a
    node the ranks share they leave room for a rank."""
    overrides = {
        "store.uri": "s3://runs/smoke",
        "rollout.workers": 2,
        "resources.gpus": 2,
        "resources.accelerator_type": "nvidia.com/gpu",
        "resources.cpu": "8",
        "resources.memory": "64Gi",
        "resources.host_cpu": "2",
        "resources.host_memory": "16Gi",
        "rl.microbatch_size": 1,
        "train.precision": "fp32_master",
        "train.nodes": 2,
        "train.launcher": "trainjob",
    }
    config = load_config(None, preset="smoke", overrides=overrides)
    tasks = _leaf_tasks(next(yaml.safe_load_all(open(compile_pipeline(config, tmp_path / "gpu.yaml")))))
    compute = {"prepare", "rollout", "compaction", "evaluate", "export"}
    host, control = {"gather", "train"}, {"configure", "rollout-workers", "report"}
    assert set(tasks) == compute | host | control
    for name, (resources, retried) in tasks.items():
        assert ("accelerator" in resources) == (name in compute), name
        if name in compute:  # each computes on one device: resources.gpus is a training node's
            assert resources["accelerator"]["count"] == "1", name
        cpu, memory = ("1", "2Gi") if name in control else ("2", "16Gi") if name in host else ("8", "64Gi")
        assert (resources["resourceCpuLimit"], resources["resourceMemoryLimit"]) == (cpu, memory), name
        assert retried == (name not in control), name
    # a chained run's last task, which submits the next run through the KFP API: small, and retried (a retry
    # finds the run it submitted before)
    chained = config.model_copy(update={"rl": config.rl.model_copy(update={"rounds": 2, "rounds_per_run": 1})})
    resources, retried = _leaf_tasks(next(yaml.safe_load_all(open(compile_pipeline(chained, tmp_path / "c.yaml")))))[
        "chain"
    ]
    assert (resources["resourceCpuLimit"], resources["resourceMemoryLimit"]) == ("1", "2Gi") and retried
    assert "accelerator" not in resources
    spec = next(yaml.safe_load_all(open(compile_pipeline(config, tmp_path / "compare.yaml", ["qat", "trace"]))))
    compared = _leaf_tasks(spec)
    assert "accelerator" not in compared["compare"][0] and not compared["compare"][1]
    config.train.nodes = 1  # one process trains in the train step itself, on its GPU, whatever the launcher
    train, _ = _leaf_tasks(next(yaml.safe_load_all(open(compile_pipeline(config, tmp_path / "one.yaml")))))["train"]
    assert train["accelerator"]["count"] == "1" and train["resourceMemoryLimit"] == "64Gi"
    config.train.launcher, config.train.nodes, config.train.processes_per_node = "torchrun", 1, 2  # in its own pod
    spec, platform = yaml.safe_load_all(open(compile_pipeline(config, tmp_path / "torchrun.yaml")))
    train, _ = _leaf_tasks(spec)["train"]
    assert train["accelerator"]["count"] == "2" and train["resourceMemoryLimit"] == "64Gi"  # a training node
    # and a memory-backed /dev/shm for NCCL between them, larger than a container's 64 MiB
    executors = platform["platforms"]["kubernetes"]["deploymentSpec"]["executors"]
    # resources.labels on every step's pod (a Kueue queue: the steps' GPUs come out of the team's quota)
    config.resources.labels = {"kueue.x-k8s.io/queue-name": "team-a"}
    _, labelled = yaml.safe_load_all(open(compile_pipeline(config, tmp_path / "labelled.yaml")))
    labelled = labelled["platforms"]["kubernetes"]["deploymentSpec"]["executors"]
    assert all(e["podMetadata"]["labels"] == {"kueue.x-k8s.io/queue-name": "team-a"} for e in labelled.values())
    assert len(labelled) == len(executors)
    mounts = {label: e.get("emptyDirMounts", []) for label, e in executors.items()}
    assert [label for label, m in mounts.items() if m] == ["exec-train"]
    assert mounts["exec-train"] == [{"volumeName": "dshm", "mountPath": "/dev/shm", "medium": "Memory"}]


def test_a_run_counts_each_loop_body_once_per_item(tmp_path):
    """The tasks a run executes, what grows KFP's Workflow object of it
    (docs/deploy.md, "Known limit"): 2 + 3 per round + 3 with one rollout
    worker; with two, a round runs rollout-workers and gather, the loop and its
    two rollouts, compaction and train; a comparison runs the chain once per method."""

    def tasks(name, methods=None, **overrides):
        config = load_config(None, preset="tiny", overrides=overrides)  # 3 rounds
        path = compile_pipeline(config, tmp_path / f"{name}.yaml", methods)
        count = run_tasks(compiled_documents(open(path, "rb").read())[0], config)
        return count, run_size_problem(count)

    assert tasks("one") == (2 + 3 * 3 + 3, None)
    assert tasks("two", **{"rollout.workers": 2}) == (2 + 3 * (2 + 1 + 2 + 2) + 3, None)
    count, _ = tasks("compare", ["trace", "qat"])
    assert count == 3 + 2 * (2 + 3 * 3 + 3)  # configure, the loop, compare; per method its configure, the chain, report
    rounds = (RUN_TASKS_WARN - 5) // 3
    assert tasks("most", **{"rl.rounds": rounds}) == (RUN_TASKS_WARN, None)
    count, problem = tasks("more", **{"rl.rounds": rounds + 1})
    assert count == RUN_TASKS_WARN + 3 and problem.startswith(f"{count} tasks in a run, more than {RUN_TASKS_WARN}")


def test_cli(tmp_path):
    runner = CliRunner()
    result = runner.invoke(main, ["presets"])
    assert result.exit_code == 0 and "smoke" in result.output and "paper-nvfp4-wa-kv" in result.output
    result = runner.invoke(main, ["compile", "--preset", "smoke", "--output", str(tmp_path / "new" / "p.yaml")])
    assert result.exit_code == 0 and (tmp_path / "new" / "p.yaml").exists() and "tasks a run" in result.output
    # the version submit uploads the YAML under: another DAG, another version
    package = (tmp_path / "new" / "p.yaml").read_bytes()
    assert f"version {version_name(compiled_documents(package))} (submit's)" in result.output
    # the same documents under another head comment (KFP's prints a list default's dicts in an order that
    # changes between processes) and with their keys in another order: the same version, not a new one a submit
    documents = compiled_documents(package)
    shuffled = yaml.safe_dump_all([dict(reversed(doc.items())) for doc in documents], sort_keys=False)
    assert version_name(compiled_documents(b"# another head\n" + shuffled.encode())) == version_name(documents)
    assert "no metrics.pushgateway_url" in result.output  # smoke's: nothing to watch on a cluster
    assert "warning: store file://./store is local to each pod" in result.output  # smoke's store
    assert "use --store s3://... on a cluster" in result.output  # compile takes --store, as run does
    assert "tasks in a run" not in result.output
    args = ["compile", "--preset", "smoke", "--set", "store.uri=s3://bucket/runs", "--output", str(tmp_path / "s.yaml")]
    task = '{"name": "mine", "data": "mine.jsonl", "reward": "s3://bucket/r.py:score"}, '
    task += '{"name": "yours", "data": "s3://bucket/yours.jsonl", "reward": "r.py:score"}'
    result = runner.invoke(main, [*args, "--set", f"tasks=[{task}]"])
    assert "store s3://bucket/runs without store.endpoint: every step takes TRACEFP4_S3_ENDPOINT" in result.output
    assert "tasks.0.data mine.jsonl is a path each pod reads in its own image; put it in the store" in result.output
    assert "tasks.1.reward r.py:score is a path each pod reads" in result.output
    assert "tasks.1.data" not in result.output and "tasks.0.reward" not in result.output
    assert "vLLM refuses" not in result.output
    # a rollout whose export no serving engine loads: said as it compiles, not after the run's last task
    args = [
        "compile",
        "--preset",
        "smoke",
        "--set",
        "rollout.config=w4a8_mxfp4_kv",
        "--output",
        str(tmp_path / "w.yaml"),
    ]
    result = runner.invoke(main, args)
    assert result.exit_code == 0 and "warning: NVFP4 expert weights with FP8 activations" in result.output
    result = runner.invoke(
        main, ["compile", "--preset", "smoke", "--output", str(tmp_path / "new" / "p.yaml" / "x.yaml")]
    )
    assert result.exit_code == 1 and "p.yaml: File exists" in result.output  # a file in the way: no traceback
    # the paper preset's 100 rounds: 14 a run, in a chain of runs; unrolled in one, more tasks than a KFP run holds
    # (docs/deploy.md, "Known limit"), said at compile time
    result = runner.invoke(main, ["compile", "--preset", "paper-nvfp4-wa-kv", "--output", str(tmp_path / "big.yaml")])
    assert result.exit_code == 0 and "48 tasks a run, a chain of 8 runs of at most 14 rounds" in result.output
    assert "tasks in a run" not in result.output
    (tmp_path / "one-run.yaml").write_text("rl: {rounds_per_run: 0}\n")
    args = ["compile", "--preset", "paper-nvfp4-wa-kv", "--config", str(tmp_path / "one-run.yaml")]
    result = runner.invoke(main, [*args, "--output", str(tmp_path / "big.yaml")])
    assert result.exit_code == 0 and "305 tasks in a run, more than 50" in result.output
    bad = tmp_path / "bad.yaml"
    bad.write_text("rl:\n  learning_rate: -1\ntasks:\n  - name: chess\n")
    result = runner.invoke(main, ["compile", "--config", str(bad), "--output", str(tmp_path / "q.yaml")])
    assert result.exit_code != 0 and "rl.learning_rate" in result.output and "tasks.0.name" in result.output
    result = runner.invoke(main, ["schema", "--output", str(tmp_path / "schemas")])
    assert result.exit_code == 0 and (tmp_path / "schemas" / "run-config.schema.json").exists()
    for command in (
        "run",
        "bootstrap",
        "compile",
        "submit",
        "schema",
        "dashboards",
        "presets",
        "config",
        "report",
        "delete-metrics",
    ):
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
    assert parsed.tags.count("table") >= 6  # accuracy, ablation, sensitivity, discrepancy, per step, time breakdown
    assert len(parsed.images) >= 4 and all(i["src"].startswith("data:image/png;base64,") for i in parsed.images)
    alts = {i["alt"] for i in parsed.images}
    assert {
        "Train-rollout log-prob |diff|",
        "Reward and accuracy",
        "Time breakdown per round",
        "Relative excess MSE per layer",
    } <= alts
    assert "fp4_wa_kv" in parsed.cells and "arithmetic pass@1" in parsed.cells and "R-1bit" in parsed.cells
    assert any("run smoke: method trace" in c for c in parsed.cells)  # the page names its run and config


def test_cli_report_of_a_run(smoke_run, tmp_path):
    """The newest report whose task finished: one a killed or failing task left
    (emptied, say, by a full disk) is not taken for it, and a folder with no
    other says so; a moved run folder still has its report."""
    out, report = smoke_run
    result = CliRunner().invoke(main, ["report", str(out)])
    assert result.exit_code == 0 and report.read_text() in result.output
    assert f"report: {out / 'report.html'} (open it in a browser), {out / 'report.md'} (markdown)" in result.output
    assert (out / "report.html").read_bytes() == report.with_name("page").read_bytes()
    moved = tmp_path / "moved"
    shutil.copytree(out, moved)
    unfinished = moved / "pipeline_root" / "tracefp4-smoke-later" / "report" / "markdown"
    unfinished.parent.mkdir(parents=True)
    unfinished.write_text("")  # newer than the finished one; no cache entry names it
    result = CliRunner().invoke(main, ["report", str(moved)])
    assert result.exit_code == 0 and "# tracefp4 run `smoke`" in result.output, result.output
    # a continuation says where it goes on from: the run's end, or where it stopped (a state after its report)
    state = next(moved.glob("pipeline_root/*/train/new_trainer_state"))
    assert ran_to_its_end(moved, str(state))
    time.sleep(0.01)
    (state / MANIFEST).touch()
    assert not ran_to_its_end(moved, str(state))
    shutil.rmtree(moved / "completed")
    result = CliRunner().invoke(main, ["report", str(moved)])
    assert result.exit_code == 1 and "no run there has finished its report; rerun its `tracefp4 run`" in result.output
    # where the last run stopped, from its log: a failed task, or one stopped as it ran
    with (moved / "pipeline.log").open("a") as log:
        log.write("00:25:52.249 - ERROR - Task 'report' finished with status FAILURE\n")
    result = CliRunner().invoke(main, ["report", str(moved)])
    assert "the last one stopped: task 'report' ended with status FAILURE (its log: " in result.output
    with (moved / "pipeline.log").open("a") as log:
        log.write("00:26:01.000 - INFO - Executing task 'report'\n")
    result = CliRunner().invoke(main, ["report", str(moved)])
    assert "the last one stopped: task 'report' was running when it was stopped" in result.output


def test_cli_report_says_where_its_runs_serving_export_is(smoke_run, tmp_path):
    """As `tracefp4 run` ends: it did not, having no run id to know the run's export by. A report task resumed
    alone runs in an attempt's folder of its own, holding no export; a run folder of an earlier tracefp4 records
    no run beside its report (nothing said), and a record damaged from outside is said, the report shown."""
    out, report = smoke_run
    exported = next(out.glob("pipeline_root/*/export/exported"))
    ending = f"serving export: {exported} (nvfp4-pack-quantized, for vLLM and SGLang: docs/export.md)"
    result = CliRunner().invoke(main, ["report", str(out)])
    assert result.exit_code == 0 and result.output.splitlines()[-2:] == [
        f"report: {out / 'report.html'} (open it in a browser), {out / 'report.md'} (markdown)",
        ending,
    ], result.output
    moved = tmp_path / "moved"
    shutil.copytree(out, moved)
    alone = moved / "pipeline_root" / "tracefp4-smoke-resumed" / "report"
    alone.parent.mkdir()
    shutil.move(moved / report.relative_to(out).parent, alone)
    for entry in (moved / "completed").glob("*.json"):  # its task's cache entry names where it is now
        entry.write_text(entry.read_text().replace(str(report.parent), str(alone)))
    result = CliRunner().invoke(main, ["report", str(moved)])
    assert result.exit_code == 0 and "# tracefp4 run `smoke`" in result.output, result.output
    assert result.output.splitlines()[-1] == ending.replace(str(out), str(moved))
    (alone / "run.json").write_text("{")
    result = CliRunner().invoke(main, ["report", str(moved)])
    assert result.exit_code == 0 and result.output.splitlines()[-1] == (
        f"warning: {alone / 'run.json'}: unreadable (JSONDecodeError: Expecting property name enclosed in double "
        "quotes: line 1 column 2 (char 1)): its run's serving export is not known"
    )
    (alone / "run.json").unlink()
    result = CliRunner().invoke(main, ["report", str(moved)])
    assert result.exit_code == 0 and result.output.splitlines()[-1].startswith("report: "), result.output


def test_comparison_pipeline_fans_out_over_methods(tmp_path):
    unpatched, handlers = builtins.print, list(logging.getLogger().handlers)
    report = run_local(get_preset("smoke"), tmp_path, tmp_path / "log", methods=["trace", "bf16"])
    # what kfp.local swaps while a component runs, left by two branches at once, is gone: its indenting print
    # wrapper, and its root handler bound to the run's log (closed since)
    assert builtins.print is unpatched and logging.getLogger().handlers == handlers
    text = report.read_text()
    assert "# tracefp4 comparison `smoke`" in text
    assert "| bf16 | trained | bf16 |" in text and "| trace | trained | fp4_wa_kv |" in text
    assert "| bf16 | ptq:four_over_six | fp4_wa_kv |" in text  # PTQ baselines of the BF16-trained policy
    page = report.with_name("page").read_text()
    assert 'alt="Train-rollout log-prob |diff| per method"' in page
    reports = sorted(tmp_path.glob("pipeline_root/*/for-loop-*/report/markdown"))
    assert len(reports) == 2 and {"`bf16`" in r.read_text() for r in reports} == {True, False}  # each method's own
    result = CliRunner().invoke(main, ["report", str(tmp_path)])  # a comparison folder's: the side-by-side one
    assert result.exit_code == 0 and f"report: {tmp_path / 'report.html'}" in result.output, result.output
    assert (tmp_path / "report.html").read_bytes() == report.with_name("page").read_bytes()
    exports = sorted(tmp_path.glob("pipeline_root/*/for-loop-*/export/exported"))  # iteration 0's first: trace's
    assert result.output.splitlines()[-2:] == [
        f"serving export of {method}: {path} ({provenance(path)['format']}, for vLLM and SGLang: docs/export.md)"
        for method, path in zip(["trace", "bf16"], exports)
    ]
    # a continuation goes on with one method's state: the one named (its train task's), none chosen for the user
    for method in (None, "qat"):
        with pytest.raises(ValueError, match=r"2 trainer states, one per method of a comparison \(bf16, trace\): "):
            continuation_of(tmp_path, steps_per_round=1, method=method)
    trace = continuation_of(tmp_path, steps_per_round=1, method="trace")["model.trainer_state"]
    assert trace == str(exports[0].parent.parent / "train" / "new_trainer_state")  # iteration 0's
    assert all("## Continue this run" in r.read_text() for r in reports)  # each method's, as a run of its own
    store = open_store(localize(get_preset("smoke"), tmp_path).store.uri)
    keys = store.list("smoke/")
    assert any("/trace/guidance/" in k for k in keys) and not any(
        "/bf16/guidance/" in k for k in keys
    )  # only trace ships guidance
    assert len({k.split("/")[1] for k in keys}) == 1  # the two branches of one run share its run id
    compiled = tmp_path / "compare.yaml"
    from kfp import compiler

    compiler.Compiler().compile(build_comparison_pipeline(get_preset("smoke"), ["trace", "qat"]), str(compiled))
    assert (
        "parameterIterator" in compiled.read_text()
        or "iteratorPolicy" in compiled.read_text()
        or "for-loop" in compiled.read_text()
    )
    for methods, message in ((["trace", "trace"], "trace named more than once"), (["trace", "foo"], "unknown method")):
        with pytest.raises(ValueError, match=message):
            build_comparison_pipeline(get_preset("smoke"), methods)
    # a branch its configure task would refuse at run time, after the others started: refused when built
    fp4_kv = load_config(None, preset="smoke", overrides={"rollout.config": "fp4_kv"})
    with pytest.raises(ConfigError, match="branch of method quads .*\n  method: quads fake-quantizes"):
        build_comparison_pipeline(fp4_kv, ["trace", "quads"])


def test_inline_compaction_writes_guidance_from_the_rollout(tmp_path):
    from tracefp4.components import steps

    config = localize(load_config(None, preset="smoke", overrides={"guidance.compaction": "inline"}), tmp_path)
    policy, state, trajectories = tmp_path / "policy", tmp_path / "state", tmp_path / "trajectories.jsonl"
    assert steps.prepare(config, policy, RUN, state)["bootstrap_steps"] == 2
    rollout = steps.rollout(config, policy, 0, trajectories, RUN)
    assert rollout["rollout_tokens"] > 0 and 0 < rollout["capture_overhead_ratio"] < 1
    store = open_store(config.store.uri)
    assert not store.list(store_prefix(config, RUN, "capture"))  # nothing full was shipped
    manifest = read_manifest(store, 0, store_prefix(config, RUN, "guidance"))
    assert manifest["bits"] == [1] and manifest["layers"] == [1]
    ref, size = steps.compaction(config, policy, trajectories, 0, RUN)
    assert size["layers"] == [1] and size["guidance_bytes"] > 0 and size["capture_bytes"] is None
    assert size["guidance_bits_per_element"] > 1  # one bit per element, plus the block scales
    rows = steps.train(
        config, policy, state, trajectories, ref, tmp_path / "next", tmp_path / "s1", RUN, {**rollout, **size}
    )
    assert rows[0]["guidance_coverage"] > 0.9 and rows[0]["rollout_tokens"] == rollout["rollout_tokens"]


@pytest.mark.parametrize("method", ["bf16", "qat", "quads", "tis_sc"])
def test_every_method_trains_through_the_steps(tmp_path, method):
    from tracefp4.components import steps

    config = localize(load_config(None, preset="smoke", overrides={"method": method}), tmp_path)
    policy, state, trajectories = tmp_path / "policy", tmp_path / "state", tmp_path / "trajectories.jsonl"
    steps.prepare(config, policy, RUN, state)
    stats = steps.rollout(config, policy, 0, trajectories, RUN)
    ref, size = steps.compaction(config, policy, trajectories, 0, RUN)
    assert stats["capture_overhead_ratio"] is None and size["guidance_bytes"] is None and ref.prefix is None
    (row,) = steps.train(config, policy, state, trajectories, ref, tmp_path / "next", tmp_path / "s1", RUN, stats)
    assert row["method"] == method and row["optimizer_steps"] == 1


def test_compaction_measures_size_and_fidelity_against_a_full_capture_whatever_the_codec(tmp_path):
    """Offline compaction measures the full capture it compacts, and its fidelity; inline guidance and the
    syndrome codec have no full capture, and their ratio is to the same one: every FP4 layer's records."""
    from tracefp4.components import steps
    from tracefp4.components.device import measured_on

    sizes = {}
    codecs = {"offline": {"guidance.compaction": "offline"}, "inline": {}, "syndrome": {"guidance.codec": "syndrome"}}
    for name, overrides in codecs.items():
        overrides = {"model.dtype": "bfloat16", **overrides}
        config = localize(load_config(None, preset="smoke", overrides=overrides), tmp_path / name)
        policy, trajectories = tmp_path / name / "policy", tmp_path / name / "trajectories.jsonl"
        steps.prepare(config, policy, RUN)
        steps.rollout(config, policy, 0, trajectories, RUN)
        sizes[name] = steps.compaction(config, policy, trajectories, 0, RUN)[1]
    offline = sizes["offline"]
    assert offline["capture_bytes"] > offline["guidance_bytes"] > 0
    assert offline["compaction_ratio"] == offline["guidance_bytes"] / offline["capture_bytes"] < 0.5  # 1 layer of 2
    assert 0.5 < offline["compaction_fidelity"] <= 1
    where = {f"compaction_{key}": value for key, value in measured_on(torch.device("cpu")).items()}
    assert {key: offline[key] for key in where} == where  # the machine its seconds were measured on
    assert sizes["inline"]["guidance_bytes"] == offline["guidance_bytes"]  # the same rollout, compacted alike
    for size in sizes.values():
        assert size["compaction_ratio"] == size["guidance_bytes"] / offline["capture_bytes"]
    assert sizes["syndrome"]["compaction_ratio"] < offline["compaction_ratio"]


def test_evaluation_of_a_bf16_run_holds_ptq_baselines_discrepancy_and_sensitivity(tmp_path, monkeypatch):
    from tracefp4.components import evaluation, steps
    from tracefp4.components.tasks import format_example
    from tracefp4.components.tokenizer import load_tokenizer

    overrides = {"method": "bf16", "model.dtype": "bfloat16", "seed": 3}
    config = localize(load_config(None, preset="smoke", overrides=overrides), tmp_path)
    config.evaluation.rollout_configs = ["bf16", "fp4_wa_kv", "fp4_kv"]  # fp4_kv's weights stay BF16: no PTQ rows
    steps.prepare(config, tmp_path / "policy")
    calibrated, ptq_model, held = [], evaluation._ptq_model, []

    def one_at_a_time(model, method, prompts):  # each dropped before the next is made
        gc.collect()  # cold_engine below ties each engine to itself (its generate, a bound method in its __dict__)
        assert not any(ref() is not None for ref in held), "two PTQ copies of the policy held at once"
        calibrated.extend(prompts)
        out = ptq_model(model, method, prompts)
        held.append(weakref.ref(out))
        return out

    monkeypatch.setattr(evaluation, "_ptq_model", one_at_a_time)
    seeds, engine, cold_start, paid = [], evaluation.TorchEngine, 1000.0, [0.0]
    # evaluation's clock, moved on by each one-time cost: a timed pass that paid one reads >= 1000 s, however
    # loaded the machine (a real 2 s sleep was outlasted by a warm pass on a busy one)
    monkeypatch.setattr(evaluation, "time", SimpleNamespace(perf_counter=lambda: time.perf_counter() + paid[0]))

    def cold_engine(*a, **kw):  # whose first call pays a one-time cost, as Triton compilation does on a GPU
        seeds.append(kw.get("calibration_seed"))
        e = engine(*a, **kw)
        warm = e.generate

        def first_call(*args, **kwargs):
            paid[0] += cold_start
            e.generate = warm
            return warm(*args, **kwargs)

        e.generate = first_call
        return e

    monkeypatch.setattr(evaluation, "TorchEngine", cold_engine)
    result = evaluation.evaluate(config, tmp_path / "policy")
    assert len(seeds) > 2 and set(seeds) == {3}  # every engine quantizes with the run's static scales
    tokenizer, (train, test) = load_tokenizer(tmp_path / "policy"), steps.problems(config)
    encoded = lambda problems: {tuple(tokenizer.encode_prompt(format_example(p))) for p in problems}  # noqa: E731
    assert calibrated and {tuple(p) for p in calibrated} <= encoded(train) - encoded(
        test
    )  # H-Scale never sees the test
    policies = {(r["policy"], r["rollout"]) for r in result["accuracy"]}
    assert policies == {("trained", "bf16"), ("trained", "fp4_wa_kv"), ("trained", "fp4_kv")} | {
        (f"ptq:{m}", "fp4_wa_kv") for m in ("nvfp4", "four_over_six", "h_scale")
    }
    assert [t["rollout"] for t in result["throughput"]] == ["bf16", "fp4_wa_kv", "fp4_kv"] and all(
        0 < t["seconds"] < cold_start and t["tokens_per_second"] > 0 for t in result["throughput"]
    ), result["throughput"]  # timed on a warm engine
    assert result["hardware"]["device"] == "cpu" and result["hardware"]["cpu_bf16"] in ("native", "emulated")
    d = result["discrepancy"][0]
    assert d["rollout"] == "fp4_wa_kv" and d["logprob_abs_diff_mean"] > 0  # BF16 training against an FP4 rollout
    assert d["code_mismatch"] is None and not d["codeword_diff_hist"]  # a bf16 training path rounds nothing
    by_bits = {(r["bits"], r["layers"]): r for r in result["guidance_sensitivity"]}
    assert set(by_bits) == {(b, n) for b in (1, 2, 3, 4) for n in (1, 2)}
    assert by_bits[(4, 2)]["fidelity"] == 1.0 and by_bits[(4, 2)]["ratio_to_full"] == 1.0
    assert (
        by_bits[(1, 1)]["bits_per_element"] < by_bits[(2, 1)]["bits_per_element"] < by_bits[(2, 2)]["bits_per_element"]
    )


def test_the_discrepancy_analysis_takes_each_task_in_turn():
    from tracefp4.components.evaluation import across_tasks
    from tracefp4.components.tasks import Problem

    test = [Problem(task, f"{task}{i}", "", {}) for task, n in (("arithmetic", 3), ("countdown", 2)) for i in range(n)]
    assert [test[i].prompt for i in across_tasks(test, 3)] == ["arithmetic0", "countdown0", "arithmetic1"]
    assert sorted(across_tasks(test, 99)) == list(range(5))


def test_evaluation_of_a_trace_run_measures_its_guided_training_path(tmp_path, native_bf16):
    from tracefp4.components import evaluation, steps

    overrides = {
        "model.dtype": "bfloat16",
        "guidance.bits": 4,
        "guidance.layers": "all",
        "evaluation.ptq_baselines": [],
    }
    config = localize(load_config(None, preset="smoke", overrides=overrides), tmp_path)
    steps.prepare(config, tmp_path / "policy")
    (d,) = evaluation.evaluate(config, tmp_path / "policy")["discrepancy"]
    qat = evaluation.evaluate(config.model_copy(update={"method": "qat"}), tmp_path / "policy")["discrepancy"][0]
    assert (
        qat["code_mismatch"] > 0
        and set(qat["code_mismatch_by_layer"]) == {0, 1}
        and qat["relative_excess_mse_by_layer"]
    )
    assert (
        d["code_mismatch"] < qat["code_mismatch"] / 5
    )  # full guidance on every layer: the rollout's codes, nearly all


def test_measuring_the_training_path_leaves_the_evaluated_policy_alone(tmp_path):
    """The discrepancy's trainer converted the evaluated policy in place (float32
    weights rounded to bf16 under train.precision bf16, train mode on), so every
    rollout config scored after an FP4 one scored other weights."""
    from tracefp4.components import evaluation, steps
    from tracefp4.components.tokenizer import load_tokenizer

    config = localize(load_config(None, preset="smoke", overrides={"train.precision": "bf16"}), tmp_path)
    steps.prepare(config, tmp_path / "policy")
    model, tokenizer = load_model(tmp_path / "policy"), load_tokenizer(tmp_path / "policy")
    before = {k: v.clone() for k, v in model.state_dict().items()}
    prompts = steps.encode_prompts(config, tokenizer, steps.problems(config)[1][:2])
    evaluation._discrepancy(
        config,
        model.eval(),
        "fp4_wa_kv",
        steps.rollout_quant(config, "fp4_wa_kv"),
        tokenizer,
        prompts,
        sensitivity=False,
    )
    assert not model.training and all(torch.equal(v, before[k]) for k, v in model.state_dict().items())


def test_evaluation_holds_one_copy_of_a_policy_beside_the_policy_at_a_time(tmp_path, monkeypatch):
    """Each engine and the discrepancy's trainer start with two Transformers
    alive (at Qwen3.5-35B-A3B 69 GB each): the evaluated policy and the copy
    they run on, or the initial policy, loaded for its scoring and handed over."""
    import gc

    from tracefp4.components import evaluation, steps
    from tracefp4.components.model import Transformer

    config = localize(load_config(None, preset="smoke", overrides={"evaluation.ptq_baselines": []}), tmp_path)
    steps.prepare(config, tmp_path / "policy")
    alive, engine, trainer = [], evaluation.TorchEngine, evaluation.Trainer

    def transformers() -> int:
        gc.collect()
        return sum(type(o) is Transformer for o in gc.get_objects())

    before = transformers()  # what earlier tests in this process left (a module's fixture, say)

    def counted(cls):
        def make(*a, **kw):
            made = cls(*a, **kw)
            alive.append((cls.__name__, transformers() - before))
            return made

        return make

    monkeypatch.setattr(evaluation, "TorchEngine", counted(engine))
    monkeypatch.setattr(evaluation, "Trainer", counted(trainer))
    evaluation.evaluate(config, tmp_path / "policy", initial=tmp_path / "policy")
    # bf16: trained, initial; fp4_wa_kv: trained, initial, the discrepancy's engine and trainer
    assert [name for name, _ in alive] == ["TorchEngine"] * 5 + ["Trainer"]
    assert {n for _, n in alive} == {2}, alive


def test_bootstrap_command_writes_a_bootstrapped_checkpoint(tmp_path):
    result = CliRunner().invoke(main, ["bootstrap", "--preset", "smoke", "--output", str(tmp_path / "base")])
    assert result.exit_code == 0, result.output
    assert "2 SFT steps" in result.output and "greedy test accuracy" in result.output
    assert "bootstrap step 1/2\nbootstrap step 2/2\n" in result.output  # its progress, which was silent
    assert load_model(tmp_path / "base").cfg.num_layers == 2 and (tmp_path / "base" / "tokenizer.json").exists()
    # a config that holds valid with the bootstrap off is checked again with it on, as the command runs it
    data = load_config(None, preset="smoke").model_dump(mode="json")
    data["bootstrap"].update(enabled=False, eval_every=1, eval_prompts=8)  # smoke's 8 training problems
    (tmp_path / "off.json").write_text(json.dumps(data))
    result = CliRunner().invoke(main, ["bootstrap", "--config", str(tmp_path / "off.json"), "--output", "unused"])
    assert result.exit_code != 0 and "none left to train on" in result.output, result.output


def test_rollout_workers_and_training_processes_through_kfp_local_match_one_of_each(tmp_path):
    """smoke with rollout.workers 2 and train.processes_per_node 2 (torchrun,
    gloo) against the same run with one of each: the same trajectories, the
    same step loss and coverage, the same policy up to float32 summation order."""
    import torch

    def run(name, workers, processes):
        config = load_config(
            None,
            preset="smoke",
            overrides={
                "rl.microbatch_size": 2,
                "rollout.workers": workers,
                "train.processes_per_node": processes,
                "train.precision": "fp32_master",
                "evaluation.rollout_configs": ["bf16"],  # compared here: rollout and training, not evaluation
            },
        )
        out = tmp_path / name
        run_local(config, out)
        root = next((out / "pipeline_root").iterdir())
        return root

    one, two = run("one", 1, 1), run("two", 2, 2)
    assert {p.name for p in two.iterdir()} >= {"rollout-workers", "for-loop-1-iteration-1", "gather"}
    single = [json.loads(line) for line in (one / "rollout" / "trajectories").read_text().splitlines()[1:]]
    gathered = [json.loads(line) for line in (two / "gather" / "trajectories").read_text().splitlines()[1:]]
    assert len(gathered) == len(single) == 4
    for a, b in zip(single, gathered):  # the same requests, tokens and problems; log-probs to float32 rounding
        # (the smoke policy computes in float32 on the CPU, where a matmul's rounding depends on the batch's size)
        assert b["problem"] == a["problem"]
        assert {k: v for k, v in b["trajectory"].items() if k != "logprobs"} == {
            k: v for k, v in a["trajectory"].items() if k != "logprobs"
        }
        assert b["trajectory"]["logprobs"] == pytest.approx(a["trajectory"]["logprobs"], abs=1e-6)
    h1, h2 = (json.loads((root / "train" / "history").read_text().splitlines()[0]) for root in (one, two))
    assert h2["loss"] == pytest.approx(h1["loss"], rel=1e-4, abs=1e-6)
    assert h2["guidance_coverage"] == h1["guidance_coverage"] > 0.9
    p1, p2 = (load_model(root / "train" / "new_policy").state_dict() for root in (one, two))
    for name in p1:
        torch.testing.assert_close(p2[name], p1[name], rtol=1e-4, atol=1e-5)  # float32 summation order
