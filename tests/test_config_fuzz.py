"""Hostile config input: random bytes and random structures, as files and as
overrides, raise nothing but ConfigError (never a traceback of pydantic,
YAML, JSON or the library), and never hang: every size has an upper bound."""

import json
import string

from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from tracefp4.schemas import ConfigError, RunConfig, get_preset, load_config

FIELDS = {
    section: list(model.model_fields)
    for section, model in ((name, f.annotation) for name, f in RunConfig.model_fields.items())
    if hasattr(model, "model_fields")
}
SCALARS = (
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**70), max_value=2**70)
    | st.floats(allow_nan=True, allow_infinity=True)
    | st.text(max_size=12)
    | st.sampled_from(["all", "nvfp4", "trace", "on_policy", "1e9", "s3://b/p", "../x", "\x00"])
)
VALUES = st.recursive(
    SCALARS,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=12,
)
SETTINGS = settings(max_examples=350, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])


def _paths():
    """A dotted path of the schema (a real field most of the time), or junk."""
    real = st.sampled_from(
        [f"{section}.{field}" for section, fields in FIELDS.items() for field in fields]
        + [name for name in RunConfig.model_fields]
    )
    return real | st.text(string.ascii_lowercase + "._", min_size=1, max_size=15)


def _load_only_config_errors(path=None, preset=None, overrides=None) -> None:
    try:
        config = load_config(path, preset=preset, overrides=overrides)
    except ConfigError:
        return
    assert isinstance(config, RunConfig)


@SETTINGS
@given(data=st.binary(max_size=400), suffix=st.sampled_from([".yaml", ".json", ".yml"]))
def test_random_bytes_as_a_config_file(tmp_path, data, suffix):
    path = tmp_path / f"run{suffix}"
    path.write_bytes(data)
    _load_only_config_errors(path)


@SETTINGS
@given(
    overrides=st.dictionaries(_paths(), VALUES, min_size=1, max_size=5), preset=st.sampled_from(["smoke", "tiny", None])
)
def test_random_structures_as_overrides(overrides, preset):
    _load_only_config_errors(preset=preset, overrides=overrides)


@SETTINGS
@given(tree=st.dictionaries(st.sampled_from(sorted(RunConfig.model_fields)), VALUES, max_size=6))
@example(tree={"tasks": {"0": None}})  # a list item replaced by null: _merge took it for a mapping
@example(tree={"tasks": {"\u00b9": None}})  # "¹" isdigit(), and int() refuses it
def test_random_trees_as_json_and_yaml_files(tmp_path, tree):
    for suffix, text in ((".json", json.dumps(tree, default=str)), (".yaml", json.dumps(tree, default=str))):
        path = tmp_path / f"run{suffix}"
        path.write_text(text)
        _load_only_config_errors(path, preset="smoke")


def test_huge_values_are_rejected_before_anything_runs():
    for override in (
        {"rl.rounds": 10_000},
        {"rl.rounds": 10**9},
        {"bootstrap.batch_size": 10**8},
        {"rollout.prompts_per_step": 10**7},
        {"tasks": [{"name": "arithmetic", "train_size": 10**9}]},
    ):
        try:
            load_config(None, preset="smoke", overrides=override)
        except ConfigError as e:
            assert str(e).count("less than or equal") == 1, e
        else:
            raise AssertionError(f"{override} was accepted")
    assert get_preset("smoke").rl.rounds == 1
