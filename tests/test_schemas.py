"""Run configs: presets, loading and merging, one error listing every bad field,
secrets kept out of every output, and the committed JSON Schema in sync."""

import json
import re
import subprocess
import sys
from pathlib import Path
from typing import get_args

import pytest
import yaml

from tracefp4.components.architecture import QWEN35_35B_A3B
from tracefp4.schemas import (
    PRESETS,
    ConfigError,
    GuidanceConfig,
    ModelPreset,
    RolloutConfigName,
    RunConfig,
    export_json_schema,
    get_preset,
    load_config,
    save_config,
    schema_hash,
)

ROOT = Path(__file__).resolve().parents[1]
REGENERATE = "python -c \"from tracefp4.schemas import export_json_schema; export_json_schema('schemas')\""
SECRETS = {"TRACEFP4_S3_ACCESS_KEY": "AKIA-test-access-4711", "TRACEFP4_S3_SECRET_KEY": "s3cr3t-test-value-0815"}


@pytest.fixture(autouse=True)
def _no_secrets_in_env(monkeypatch):
    for name in SECRETS:
        monkeypatch.delenv(name, raising=False)


@pytest.mark.parametrize("name", sorted(PRESETS))
@pytest.mark.parametrize("suffix", [".json", ".yaml", ".yml"])
def test_preset_validates_and_round_trips(name, suffix, tmp_path):
    preset = get_preset(name)
    assert RunConfig.model_validate(preset.model_dump()) == preset
    path = save_config(preset, tmp_path / f"run{suffix}")
    assert load_config(path) == preset
    assert load_config(path, preset="smoke") == preset  # a full file overrides everything of a base preset


def test_presets_set_what_they_promise():
    smoke, tiny = PRESETS["smoke"], PRESETS["tiny"]
    assert smoke.model.preset == "smoke" and smoke.rl.rounds == smoke.rl.steps_per_round == 1
    assert smoke.rollout.max_new_tokens <= 8 and smoke.rollout.prompts_per_step * smoke.rollout.group_size <= 4
    assert tiny.model.preset == "tiny" and tiny.rl.rounds > 1
    # R-1bit-L20: the layers with FP4 sites among the 20 deepest of 40 (W4A8: KV only, the full-attention ones)
    for name, config, layers in [("paper-nvfp4-wa-kv", "fp4_wa_kv", 20), ("paper-w4a8-mxfp4-kv", "w4a8_mxfp4_kv", 5)]:
        p = PRESETS[name]
        assert p.model.checkpoint == "s3://models/qwen3.5-35b-a3b" and p.model.preset is None
        assert (p.method, p.guidance.bits, p.guidance.layers, p.rollout.config) == ("trace", 1, layers, config)
        assert p.guided_layer_problems(QWEN35_35B_A3B, "its checkpoint") == []  # prepare checks it so
        assert p.resources.gpus == 4 and p.resources.accelerator_type  # a GB200 tray's GPUs
        # 35B parameters' training state sharded over TrainJob nodes, one process per GPU
        assert p.train.launcher == "trainjob" and p.train.processes_per_node == p.resources.gpus
        assert p.train.world_size == 8 and p.train.precision == "fp32_master"
    assert PRESETS["paper-nvfp4-wa-kv"].rollout.fmt == "nvfp4"


def test_get_preset_returns_a_copy_and_names_the_choices():
    get_preset("smoke").rl.rounds = 99
    assert PRESETS["smoke"].rl.rounds == 1
    with pytest.raises(ValueError, match="paper-nvfp4-wa-kv.*smoke.*tiny"):
        get_preset("huge")


def test_literals_match_the_library():
    """The schema's names of rollout configs and model presets are the library's,
    and the FP4 formats its torch-free half names are the kernels' own."""
    from tracefp4.components import architecture, quant_config
    from tracefp4.kernels import FORMATS

    assert quant_config.FP4_FORMATS == tuple(FORMATS)
    assert set(get_args(RolloutConfigName)) == set(quant_config.ROLLOUT_CONFIGS)
    assert set(get_args(ModelPreset)) == set(architecture.PRESETS)
    for preset in PRESETS.values():  # deepest-N selections fit the preset models
        if preset.model.preset is not None and isinstance(preset.guidance.layers, int):
            assert preset.guidance.layers <= architecture.PRESETS[preset.model.preset].num_layers


def test_the_config_and_the_command_load_without_torch(tmp_path):
    """The run config takes its choices from torch-free modules (components.architecture,
    quant_config, choices, syndrome_rate), so the tracefp4 command starts, checks a
    config and writes its schema without the seconds torch takes to import."""
    script = (
        "import sys\n"
        "import tracefp4.pipelines.cli\n"
        "from tracefp4.schemas import RunConfig, export_json_schema, get_preset\n"
        "for name in ('paper-nvfp4-wa-kv', 'smoke'):\n"
        "    RunConfig.model_validate(get_preset(name).model_dump())\n"
        f"export_json_schema({str(tmp_path)!r})\n"
        "print(sorted(m for m in sys.modules if m.split('.')[0] == 'torch')[:5])\n"
    )
    done = subprocess.run([sys.executable, "-P", "-c", script], cwd=ROOT, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]", f"torch modules loaded: {done.stdout}"


def test_exported_schema_files_are_in_sync(tmp_path):
    fresh = export_json_schema(tmp_path)
    assert [p.name for p in fresh] == ["run-config.schema.json"]
    committed = sorted(p.name for p in (ROOT / "schemas").glob("*.schema.json"))
    assert committed == sorted(p.name for p in fresh), f"stale or missing schema files; regenerate with: {REGENERATE}"
    for path in fresh:
        assert (ROOT / "schemas" / path.name).read_bytes() == path.read_bytes(), (
            f"schemas/{path.name} is out of date; regenerate with: {REGENERATE}"
        )
    assert export_json_schema(tmp_path / "again")[0].read_bytes() == fresh[0].read_bytes()
    schema = json.loads(fresh[0].read_text())
    assert "0.1.0" in schema["$id"] and schema["additionalProperties"] is False
    assert len(schema_hash()) == 12 and int(schema_hash(), 16) >= 0


def test_invalid_file_lists_every_bad_field_with_its_path(tmp_path):
    path = tmp_path / "bad-run.yaml"
    path.write_text(
        yaml.safe_dump(
            {
                "name": "Bad_Name",
                "rl": {"learning_rate": -1.0, "adam_betas": [0.9, 1.5]},
                "rollout": {"top_p": 0.0, "fmt": "fp3"},
                "tasks": [{"name": "arithmetic"}, {"name": "countdown", "difficulty": 9}],
                "resources": {"tolerations": [{"operator": "Sometimes"}]},
            }
        )
    )
    with pytest.raises(ConfigError) as info:
        load_config(path)
    err = info.value
    expected = {
        "name": "DNS label",
        "rl.learning_rate": "greater than 0",
        "rl.adam_betas.1": "less than 1",
        "rollout.top_p": "greater than 0",
        "rollout.fmt": "'nvfp4' or 'mxfp4'",
        "tasks.1.difficulty": "less than or equal to 5",
        "resources.tolerations.0.operator": "'Equal' or 'Exists'",
    }
    assert dict(err.problems).keys() == expected.keys()
    message = str(err)
    assert isinstance(err, ValueError) and "bad-run.yaml" in message.splitlines()[0]
    for dotted, reason in expected.items():
        assert any(line.strip().startswith(f"{dotted}:") and reason in line for line in message.splitlines()), dotted


def test_cross_field_problems_are_reported_with_their_paths():
    with pytest.raises(ConfigError) as info:
        load_config(None, overrides={"model.max_seq_len": 64, "rollout": {"max_new_tokens": 64, "config": "bf16"}})
    assert {path for path, _ in info.value.problems} == {"rollout.max_new_tokens", "method"}


def test_field_errors_say_that_the_checks_across_fields_are_still_to_run():
    """pydantic runs RunConfig's checks across fields once every field is valid: a list of field errors
    is not the whole list, and a user who fixes it and resubmits meets the others; the message says so."""
    both = {"rollout.top_p": 0.0, "model.max_seq_len": 64, "rollout.max_new_tokens": 64}
    with pytest.raises(ConfigError) as info:
        load_config(None, overrides=both)
    assert [path for path, _ in info.value.problems] == ["rollout.top_p"] and info.value.unchecked
    assert str(info.value).splitlines()[-1] == (  # one problem: "this is" (it said "these are" for one too)
        "once this is fixed, the checks across fields run (such as max_new_tokens vs max_seq_len)"
    )
    with pytest.raises(ConfigError) as info:
        load_config(None, overrides={**both, "rl.rounds": "two"})
    assert len(info.value.problems) == 2 and str(info.value).splitlines()[-1].startswith("once these are fixed, ")
    with pytest.raises(ConfigError) as info:
        load_config(None, overrides={**both, "rollout.top_p": 1.0})
    assert [path for path, _ in info.value.problems] == ["rollout.max_new_tokens"] and not info.value.unchecked
    assert "once these are fixed" not in str(info.value)


def test_a_kl_penalty_that_would_be_zero_is_refused():
    """The KL reference is the policy a round started from: an on_policy round trains exactly it."""
    with pytest.raises(ConfigError, match="rl.kl_coef") as info:
        load_config(None, overrides={"rl.kl_coef": 0.1})
    assert [path for path, _ in info.value.problems] == ["rl.kl_coef"]
    off_policy = {"rl": {"kl_coef": 0.1, "schedule": "off_policy", "steps_per_round": 2}}
    assert load_config(None, overrides=off_policy).rl.kl_coef == 0.1
    with pytest.raises(ConfigError, match="rl.kl_coef"):  # off_policy, but still one optimizer step a round
        load_config(None, overrides={"rl": {"kl_coef": 0.1, "schedule": "off_policy", "steps_per_round": 1}})
    one_group = {"kl_coef": 0.1, "schedule": "off_policy", "microbatch_size": 1}  # 32 microbatches an RL step
    with pytest.raises(ConfigError, match="rl.kl_coef"):  # accumulated over all of them: one optimizer step
        load_config(None, overrides={"rl": {**one_group, "grad_accumulation": 64}})
    assert load_config(None, overrides={"rl": {**one_group, "grad_accumulation": 16}}).rl.kl_coef == 0.1


@pytest.mark.parametrize(
    "overrides, path",
    [
        ({"rollout.group_size": 1}, "rollout.group_size"),  # a group of one: every advantage 0
        ({"rollout.temperature": 0.0}, "rollout.temperature"),  # a group of alike responses: the same
        ({"guidance.prefetch_microbatches": 0}, "guidance.prefetch_microbatches"),  # a queue of 0 is unbounded
        ({"bootstrap": {"target_accuracy": 0.5, "eval_every": 0}}, "bootstrap"),  # a target never checked
        ({"bootstrap": {"target_accuracy": 0.5, "eval_every": 300, "steps": 300}}, "bootstrap"),
        ({"bootstrap": {"enabled": True, "steps": 10}}, "bootstrap"),  # warmup 30: never at the peak
        ({"method": "qat", "rollout": {"config": "bf16"}}, "method"),  # nothing to fake-quantize against
        ({"method": "quads", "rollout": {"config": "fp4_kv"}}, "method"),  # BF16 weights
        (
            {
                "method": "bf16",
                "rollout": {"config": "bf16"},
                "rl": {"measure_mismatch": True},
                "guidance": {"compaction": "offline"},
            },
            "rl.measure_mismatch",
        ),
        ({"rollout.max_tokens_per_forward": 4}, "rollout.max_tokens_per_forward"),  # no prompt fits a forward
        ({"method": "bf16", "rollout": {"fmt": "mxfp4"}}, "evaluation.ptq_baselines"),  # NVFP4 PTQ, scored nowhere
        ({"tasks": [{"name": "arithmetic"}, {"name": "arithmetic", "difficulty": 2}]}, "tasks.1.name"),
    ],
)
def test_values_that_would_run_without_effect_are_refused(overrides, path):
    with pytest.raises(ConfigError) as info:
        load_config(None, overrides=overrides)
    assert [p for p, _ in info.value.problems] == [path]


@pytest.mark.parametrize(
    "overrides, path, reason",
    [
        # logits / temperature overflows float32: the policy trained to NaN without a word
        ({"rollout.temperature": 1e-300}, "rollout.temperature", "greater than or equal to 0.01"),
        ({"rl.kl_coef": 1e39}, "rl.kl_coef", "less than or equal to 1000"),  # inf in float32: a NaN loss
        ({"rl.tis_cap": 1e39}, "rl.tis_cap", "less than or equal to 1000000"),  # no float32: clamp raised
        # Kubernetes quantities KFP's SDK refuses, at pipeline build (a traceback, also for a local run)
        ({"resources.memory": "1.5Gi"}, "resources.memory", "whole number"),
        ({"resources.host_memory": "512k"}, "resources.host_memory", "whole number"),
        # pods Kubernetes refuses, only once a step of the run starts
        ({"resources.node_selector": {"bad key!": "x"}}, "resources.node_selector.bad key!.[key]", "label key"),
        ({"resources.node_selector": {"pool": "a b"}}, "resources.node_selector.pool", "label value"),
        ({"resources.tolerations": [{"value": "v"}]}, "resources.tolerations.0", "needs operator Exists"),
        ({"image": "ghcr.io//tracefp4"}, "image", "image reference"),
        # a secret no pod could mount (every step would stay ContainerCreating), a region no S3 server names
        ({"store.ca_bundle_secret": "Store_CA"}, "store.ca_bundle_secret", "DNS label"),
        ({"store.ca_bundle_secret": ""}, "store.ca_bundle_secret", "DNS label"),
        # a Kubernetes object name that no volume can take: KFP names the step pods' volume after the secret
        ({"store.ca_bundle_secret": "store.ca"}, "store.ca_bundle_secret", "DNS label"),
        ({"store.ca_bundle_secret": "ca" * 32}, "store.ca_bundle_secret", "DNS label"),
        ({"store.region": "eu central"}, "store.region", "S3 region name such as 'us-east-1'"),
        ({"store.region": ""}, "store.region", "S3 region name"),
        ({"store.region": "us-east-1/x"}, "store.region", "S3 region name"),
        # rates the syndrome codec would raise or cut without a word
        ({"guidance.syndrome_rate": 0.0625}, "guidance.syndrome_rate", "greater than or equal to 0.09375"),
        (
            {"rollout.fmt": "mxfp4", "guidance": {"codec": "syndrome", "bits": 1, "syndrome_rate": 0.3125}},
            "guidance.syndrome_rate",
            "MXFP4 block of 256 elements (8 scales) takes at most 0.28125",
        ),
        # no code of the captured sites to compare in training: code_mismatch None every step
        (
            {"method": "quads", "rl": {"measure_mismatch": True}, "guidance": {"compaction": "offline"}},
            "rl.measure_mismatch",
            "method quads quantizes none",
        ),
    ],
)
def test_values_that_would_fail_or_do_nothing_at_run_time_are_refused(overrides, path, reason):
    with pytest.raises(ConfigError) as info:
        load_config(None, overrides=overrides)
    ((found, message),) = info.value.problems
    assert found == path and reason in message


def test_kubernetes_settings_that_run_are_taken():
    resources = {
        "memory": "64Gi",
        "host_memory": "1000000",
        "node_selector": {"nvidia.com/gpu.present": "true", "pool": ""},
        "tolerations": [
            {"operator": "Exists"},
            {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"},
        ],
    }
    config = load_config(None, overrides={"resources": resources, "image": "registry.local:5000/team/img:1.0-RC1"})
    assert config.resources.node_selector["pool"] == "" and config.image.endswith(":1.0-RC1")


def test_the_stores_region_and_ca_bundle_reach_the_pods_environment():
    """What every pod of a cluster run gets besides the credentials: the variables the S3 client reads, those set."""
    store = load_config(None, overrides={"store.uri": "s3://runs/x"}).store
    assert store.pod_environment() == {}  # the pods' own environment
    store.endpoint, store.region, store.ca_bundle_secret = "https://minio.tracefp4:9000", "us-east-1", "store-ca-v2"
    assert store.pod_environment() == {
        "TRACEFP4_S3_ENDPOINT": "https://minio.tracefp4:9000",
        "TRACEFP4_S3_REGION": "us-east-1",
        "SSL_CERT_FILE": "/etc/tracefp4/store-ca/ca.crt",  # the secret's key ca.crt, where the pods mount it
    }


def test_a_seed_a_pipeline_parameter_would_round_is_refused(tmp_path):
    """KFP carries integer parameters as JSON doubles: seed 2**53 + 1 compiled
    to a default of 2**53 and ran (and was reported) as that."""
    from tracefp4.pipelines.parameters import defaults, parameters

    config = load_config(None, overrides={"seed": 2**53})
    assert float(defaults(config, parameters())["seed"]) == 2**53  # the largest the parameter holds exactly
    with pytest.raises(ConfigError) as info:
        load_config(None, overrides={"seed": 2**53 + 1})
    assert [path for path, _ in info.value.problems] == ["seed"]


def test_evaluation_never_asks_for_more_test_prompts_than_a_task_holds():
    tasks = [{"name": "arithmetic", "test_size": 300}, {"name": "countdown", "test_size": 200}]
    load_config(None, overrides={"tasks": tasks, "evaluation": {"test_prompts": 400}})  # 200 of each
    with pytest.raises(ConfigError) as info:
        load_config(None, overrides={"tasks": tasks, "evaluation": {"test_prompts": 401}})  # 201 of each
    assert [path for path, _ in info.value.problems] == ["tasks.1.test_size"]
    assert "asks 201 of each of the 2 tasks" in str(info.value)


@pytest.mark.parametrize(
    "overrides, told",
    [
        ({"colour": "red"}, "colour: unknown field (the config has name, seed, model, "),
        ({"rl": {"lr": 1e-3}}, "rl.lr: unknown field (rl has schedule, steps_per_round, rounds, "),
        ({"rl.round": 2}, "rl.round: unknown field: did you mean rl.rounds?"),  # a typo
        (
            {"tasks": [{"name": "arithmetic", "dificulty": 2}]},
            "tasks.0.dificulty: unknown field: did you mean tasks.0.difficulty?",
        ),
        (
            {"resources": {"tolerations": [{"key": "a", "seconds": 3}]}},
            "resources.tolerations.0.seconds: unknown field (resources.tolerations.0 has key, operator, value, effect)",
        ),
    ],
)
def test_unknown_fields_are_rejected_naming_the_sections_fields(overrides, told):
    with pytest.raises(ConfigError, match=re.escape(told)):
        load_config(None, overrides=overrides)


@pytest.mark.parametrize(
    "uri, why",
    [
        ("http://bucket/x", "must start with"),
        ("bucket/prefix", "must start with"),
        ("s3://", "must start with"),
        ("gs://b", "must start with"),
        ("s3://key:pw@bucket/x", "must not carry credentials"),
        ("file://key:pw@host/x", "must not carry credentials"),
        # as an S3 store reads them, which would fail the run's first step that opens the store
        ("s3://bucket/p?x=1", "use s3://bucket/optional/prefix"),
        ("s3://bucket#f", "use s3://bucket/optional/prefix"),
        ("s3://bucket/runs/a//b", "no empty, '.' or '..' path segments"),
        ("s3://bucket/../x", "no empty, '.' or '..' path segments"),
        ("s3:///nobucket", "use s3://bucket/optional/prefix"),
        ("minio://b/p", "bucket name"),
        # a host names no folder: a local run read it as the relative folder host/x
        ("file://host/x", "use file:///absolute/path or file://./relative/path"),
    ],
)
def test_bad_store_uri_is_rejected(uri, why):
    with pytest.raises(ConfigError, match=f"store.uri: .*{re.escape(why)}") as info:
        load_config(None, overrides={"store": {"uri": uri}})
    assert "pw@" not in str(info.value)  # a URI with credentials is never echoed


@pytest.mark.parametrize("uri", ["file://./store", "file:///tmp/store", "s3://bucket/prefix", "minio://bucket"])
def test_good_store_uri_is_accepted(uri):
    assert load_config(None, overrides={"store.uri": uri}).store.uri == uri


@pytest.mark.parametrize(
    "model, state", [({"preset": "tiny", "checkpoint": "/ckpt"}, "both"), ({"preset": None}, "neither")]
)
def test_model_needs_exactly_one_of_preset_and_checkpoint(model, state):
    with pytest.raises(ConfigError, match=rf"model: set exactly one .*\({state}"):
        load_config(None, overrides={"model": model})


def test_a_layer_naming_preset_or_checkpoint_replaces_the_other():
    assert (
        load_config(
            None, "paper-nvfp4-wa-kv", {"model": {"preset": "smoke"}, "guidance": {"layers": 1}}
        ).model.checkpoint
        is None
    )
    deepest = (
        r"guidance.layers: the deepest 20 layers with FP4 sites; model preset smoke has FP4 sites in layers \[0, 1\]"
    )
    with pytest.raises(ConfigError, match=deepest):
        load_config(None, "paper-nvfp4-wa-kv", {"model": {"preset": "smoke"}})  # known before any work
    with pytest.raises(ConfigError, match="guidance.layers: layer 5 does not exist; model preset smoke has 2"):
        load_config(None, "smoke", {"guidance.layers": [0, 5]})
    assert load_config(None, "smoke", {"model.checkpoint": "/ckpt/qwen3"}).model.preset is None


def test_guided_layers_need_fp4_sites_under_every_rollout_config_that_guides_them():
    """tiny-qwen35: 3 Gated DeltaNet layers (no KV cache), then 1 full-attention one; all four are MoE."""
    kv_only = {"rollout.config": "fp4_kv", "evaluation.rollout_configs": ["fp4_kv"]}
    with pytest.raises(
        ConfigError, match=r"layers \[0\] have no FP4 site; .* layers \[3\] under rollout config fp4_kv"
    ):
        load_config(None, "tiny-qwen35", {**kv_only, "guidance.layers": [0]})
    with pytest.raises(
        ConfigError, match=r"the deepest 2 layers with FP4 sites; .* layers \[3\] under rollout config fp4_kv"
    ):
        load_config(None, "tiny-qwen35", {**kv_only, "guidance.layers": 2})
    # the run's own config guides layers 2 and 3; trace's discrepancy analysis under fp4_kv would guide them too
    evaluated = {"evaluation.rollout_configs": ["bf16", "fp4_wa_kv", "fp4_kv"]}
    with pytest.raises(ConfigError, match="rollout config fp4_kv"):
        load_config(None, "tiny-qwen35", evaluated)
    assert load_config(None, "tiny-qwen35", {**evaluated, "evaluation.discrepancy_prompts": 0})
    assert load_config(None, "tiny-qwen35", {**evaluated, "method": "qat"})  # its evaluation guides nothing


def test_secrets_come_from_the_environment_only(monkeypatch, tmp_path):
    for name, value in SECRETS.items():
        monkeypatch.setenv(name, value)
    config = load_config(None, preset="smoke")
    assert config.store.access_key.get_secret_value() == SECRETS["TRACEFP4_S3_ACCESS_KEY"]
    assert config.store.secret_key.get_secret_value() == SECRETS["TRACEFP4_S3_SECRET_KEY"]
    outputs = [
        repr(config),
        str(config),
        repr(config.store),
        str(config.store),
        json.dumps(config.model_dump(mode="json")),
        str(config.model_dump()),
        config.model_dump_json(),
        save_config(config, tmp_path / "run.yaml").read_text(),
        export_json_schema(tmp_path)[0].read_text(),
    ]
    for text in outputs:
        for value in SECRETS.values():
            assert value not in text
    assert "access_key" not in config.model_dump()["store"]
    with pytest.raises(ConfigError, match="store.secret_key: set only from the environment variable TRACEFP4_S3_SEC"):
        load_config(None, overrides={"store": {"secret_key": "from-a-file"}})


def test_overrides_deep_merge_over_a_preset(tmp_path):
    path = tmp_path / "run.yml"
    path.write_text("rl:\n  learning_rate: 5.0e-5\nrollout: {temperature: 0.7}\n")
    config = load_config(path, preset="tiny", overrides={"rl.rounds": 7, "guidance": {"bits": 2}, "seed": 3})
    tiny = PRESETS["tiny"]
    assert (config.rl.learning_rate, config.rl.rounds, config.rollout.temperature) == (5e-5, 7, 0.7)
    assert (config.guidance.bits, config.seed) == (2, 3)
    assert config.rl.steps_per_round == tiny.rl.steps_per_round and config.guidance.layers == tiny.guidance.layers
    assert config.rollout.max_new_tokens == tiny.rollout.max_new_tokens and config.tasks == tiny.tasks
    assert config.model == tiny.model and config.name == "tiny"
    # a list's items by their number (--set tasks.0.difficulty=2 replaced the list with a mapping before)
    config = load_config(None, preset="tiny", overrides={"tasks.1.difficulty": 2, "tasks": {"0": {"weight": 3.0}}})
    assert [(t.difficulty, t.weight) for t in config.tasks] == [(tiny.tasks[0].difficulty, 3.0), (2, 1.0)]
    with pytest.raises(ConfigError, match="tasks.2: no such item: the list has 2"):
        load_config(None, preset="tiny", overrides={"tasks.2.difficulty": 2})
    # a problem of the file or of the overrides: the message says both were read
    with pytest.raises(ConfigError, match="in .*run.yml with the overrides"):
        load_config(path, preset="tiny", overrides={"rl.rounds": "many"})


def test_overrides_go_over_one_another_in_their_order():
    """As --set options: an item of a list set by an earlier override is that
    list's (its override was lost, the run trained on the preset's tasks), and
    a later whole list replaces the items set before it."""
    mine = {"name": "mine", "data": "problems.jsonl", "train_size": 16, "test_size": 4}
    config = load_config(None, preset="smoke", overrides={"tasks": [mine], "tasks.0.train_size": 20})
    assert [(t.name, t.train_size) for t in config.tasks] == [("mine", 20)]
    configs = load_config(
        None,
        preset="smoke",
        overrides={"evaluation.rollout_configs": ["fp4_kv", "bf16"], "evaluation.rollout_configs.0": "fp4_wa_kv"},
    ).evaluation.rollout_configs
    assert configs == ["fp4_wa_kv", "bf16"]
    config = load_config(None, preset="smoke", overrides={"tasks.0.train_size": 20, "tasks": [mine]})
    assert [(t.name, t.train_size) for t in config.tasks] == [("mine", 16)]


def test_file_errors_name_the_file(tmp_path):
    with pytest.raises(ConfigError, match=r"unknown config file extension '\.toml'"):
        load_config(tmp_path / "run.toml")
    (tmp_path / "run.json").write_text("{not json")
    with pytest.raises(ConfigError, match=r"run\.json.*\n.*not valid JSON"):
        load_config(tmp_path / "run.json")
    (tmp_path / "list.yaml").write_text("- 1\n")
    with pytest.raises(ConfigError, match="must be a mapping"):
        load_config(tmp_path / "list.yaml")
    with pytest.raises(ConfigError, match="missing.yaml"):
        load_config(tmp_path / "missing.yaml")


def test_an_unquoted_value_opening_with_a_brace_is_said_to_need_quotes(tmp_path):
    """A prompt template's '{prompt} ...' unquoted: YAML's own message points at the text after the brace."""
    path = tmp_path / "run.yaml"
    path.write_text("tasks:\n  - name: x\n    data: f.jsonl\n    prompt_template: {prompt} Put it in \\boxed{}.\n")
    with pytest.raises(
        ConfigError, match=r"line 4's value opens with '\{' unquoted, .*: quote it \('\{prompt\} ...'\)"
    ):
        load_config(path)
    path.write_text("rl:\n  rounds: [3\n")  # another fault: no hint
    with pytest.raises(ConfigError, match=r"not valid YAML") as refused:
        load_config(path)
    assert "opens with" not in str(refused.value)


def test_a_key_given_twice_is_refused_naming_it(tmp_path):
    """yaml.safe_load and json.loads keep a repeated key's last value: a file with two rl sections
    silently lost the first one's rounds. A merge (<<) may still be overridden."""
    path = tmp_path / "run.yaml"
    path.write_text("rl:\n  rounds: 3\nevaluation:\n  initial: false\nrl:\n  learning_rate: 1.0e-5\n")
    with pytest.raises(
        ConfigError, match=r"run\.yaml.*\n.*not valid YAML: key 'rl' given twice \(first at line 1\)\n.*line 5"
    ):
        load_config(path)
    path.write_text("rl:\n  rounds: 3\n  rounds: 4\n")
    with pytest.raises(ConfigError, match=r"key 'rounds' given twice \(first at line 2\)"):
        load_config(path)
    path.write_text("rl:\n  <<: {rounds: 3, learning_rate: 1.0e-5}\n  rounds: 4\n")
    assert (load_config(path).rl.rounds, load_config(path).rl.learning_rate) == (4, 1e-5)
    path = tmp_path / "run.json"
    path.write_text('{"rl": {"rounds": 3}, "rl": {"learning_rate": 1e-5}}')
    with pytest.raises(ConfigError, match=r"run\.json.*\n.*not valid JSON: key 'rl' appears twice in an object"):
        load_config(path)


@pytest.mark.parametrize(
    "field", ["rl.rounds", "rollout.temperature", "bootstrap.target_accuracy", "tasks.0.difficulty", "seed"]
)
@pytest.mark.parametrize("value", [True, False])
def test_a_boolean_is_no_number(field, value):
    """pydantic takes true as 1 and false as 0: rl.rounds: true ran one round and
    rollout.temperature: true sampled at 1.0, without a word."""
    with pytest.raises(ConfigError, match=rf"{re.escape(field)}: must be a number, not {str(value).lower()}") as info:
        load_config(None, preset="tiny", overrides={field: value})
    assert len(info.value.problems) == 1
    assert load_config(None, preset="tiny", overrides={"bootstrap.enabled": False}).bootstrap.enabled is False


@pytest.mark.parametrize("layers, expected", [("all", "all"), (20, 20), ([2, 1], [1, 2])])
def test_layer_selection_accepts(layers, expected):
    assert GuidanceConfig(layers=layers).layers == expected


@pytest.mark.parametrize("layers", ["adaptive:x", -1, 0, "deepest", "adaptive:0", [], [1, 1], [-2], True, 2.5])
def test_layer_selection_rejects(layers):
    with pytest.raises(ConfigError, match="guidance.layers: ") as info:
        load_config(None, overrides={"guidance": {"layers": layers}})
    assert len(info.value.problems) == 1
