"""Reading and writing run configs, one error for every bad field, and the JSON Schema.

`load_config` layers a preset, a YAML/JSON file and overrides (later wins,
mappings merge key by key, lists and scalars replace but for an override's
numbered items), validates once, then takes the S3 credentials from the
environment. A failure is one `ConfigError` listing every bad field by dotted
path; the checks across fields (pydantic's model validators) run once every
field is valid, so those come in a second pass, which the error says.
"""

import difflib
import functools
import hashlib
import json
import os
import re
from collections.abc import Mapping
from importlib.metadata import version
from pathlib import Path
from typing import get_args

from pydantic import BaseModel, SecretStr, ValidationError

from tracefp4.components.store import write_atomic

from .config import PATTERN_HINTS, SECRET_ENV, RunConfig
from .presets import get_preset

SCHEMA_FILES = {"run-config.schema.json": RunConfig}
JSON_SCHEMA_DIALECT = "https://json-schema.org/draft/2020-12/schema"
_DOTTED = re.compile(r"^[a-z_][a-z0-9_]*(\.[a-z0-9_]+)*$")
_FIELD = re.compile(r"^[a-z_][a-z0-9_]*$")


class ConfigError(ValueError):
    """An invalid run config: `problems` holds (dotted path, reason) pairs, `source` the file if any.
    ``unchecked``: the checks across fields have not run (they need every field valid), so that fixing
    these problems may show others; the message says so rather than read as the whole list."""

    def __init__(self, problems: list[tuple[str, str]], source: str | Path | None = None, unchecked: bool = False):
        self.problems = problems
        self.source = None if source is None else str(source)
        self.unchecked = unchecked
        where = f" in {self.source}" if self.source else ""
        lines = [f"invalid tracefp4 config{where} ({len(problems)} problem{'s' * (len(problems) != 1)}):"]
        lines += [f"  {path}: {reason}" if path else f"  {reason}" for path, reason in problems]
        if unchecked:
            these = "these are" if len(problems) != 1 else "this is"
            lines.append(f"once {these} fixed, the checks across fields run (such as max_new_tokens vs max_seq_len)")
        super().__init__("\n".join(lines))

    def found_in(self, source: str | Path | None) -> "ConfigError":
        """This error naming ``source`` where it names none: a check after validation (a run's start, the
        run's first task) finds what lies in a file the user gave, and the message should say which."""
        return self if self.source or source is None else ConfigError(self.problems, source, self.unchecked)

    @classmethod
    def from_validation(cls, err: ValidationError, source: str | Path | None = None) -> "ConfigError":
        """One line per pydantic error; a root error (a cross-field check) already names its paths. Without
        one, RunConfig's checks across fields did not run: pydantic runs them once every field is valid."""
        problems, unchecked = [], True
        for e in err.errors(include_input=False, include_url=False):
            path = ".".join(str(part) for part in e["loc"])
            reason = e["msg"].removeprefix("Value error, ")
            if e["type"] == "string_pattern_mismatch":
                reason = PATTERN_HINTS.get(e["ctx"]["pattern"], reason)
            elif e["type"] == "extra_forbidden":
                reason = _unknown_field(e["loc"]) or reason
            head, sep, tail = reason.partition(": ")
            if path and sep and _FIELD.match(head):  # a section's check across its fields names the one at fault
                problems.append((f"{path}.{head}", tail))
            elif path:
                problems.append((path, reason))
            else:
                unchecked = False
                for line in reason.splitlines():
                    head, sep, tail = line.partition(": ")
                    problems.append((head, tail) if sep and _DOTTED.match(head) else ("", line))
        return cls(problems, source, unchecked)


def _unknown_field(loc: tuple) -> str | None:
    """What a field no section has is told (``loc``: its place): the field of its section nearest its name (a
    typo: ``rl.round``), or the section's fields; None where ``loc`` names no section of :class:`RunConfig`."""
    section: type[BaseModel] | None = RunConfig
    for part in loc[:-1]:
        if not isinstance(part, int):  # a list's item: the list's section
            field = section.model_fields.get(part) if section else None
            section = _section_of(field.annotation) if field else None
    if section is None:
        return None
    parent = "".join(f"{part}." for part in loc[:-1])
    near = difflib.get_close_matches(str(loc[-1]), section.model_fields, n=1, cutoff=0.75)
    if near:
        return f"unknown field: did you mean {parent}{near[0]}?"
    return f"unknown field ({parent.removesuffix('.') or 'the config'} has {', '.join(section.model_fields)})"


def _section_of(annotation) -> type[BaseModel] | None:
    """The model a field's annotation holds (``RLConfig``, ``list[TaskConfig]``, ``X | None``), if any."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    return next((found for arg in get_args(annotation) if (found := _section_of(arg))), None)


def _yaml():
    import yaml  # only YAML files need it; JSON configs work without PyYAML

    return yaml


@functools.cache
def _unique_key_loader():
    """PyYAML's SafeLoader, but a mapping that names a key twice is an error
    naming the key and both places: ``safe_load`` keeps the last, so a config
    with two ``rl:`` sections lost the first one's settings without a word.
    Keys that a merge (``<<: *base``) brings in may still be overridden."""
    yaml = _yaml()

    class UniqueKeyLoader(yaml.SafeLoader):
        def construct_mapping(self, node, deep=False):
            if isinstance(node, yaml.MappingNode):
                first: dict = {}
                for key_node, _ in node.value:
                    if key_node.tag == "tag:yaml.org,2002:merge":
                        continue
                    key = self.construct_object(key_node, deep=True)
                    try:
                        seen = first.setdefault(key, key_node)
                    except TypeError:  # an unhashable key: SafeLoader names it
                        continue
                    if seen is not key_node:
                        first_line = seen.start_mark.line + 1
                        raise yaml.constructor.ConstructorError(
                            None, None, f"key {key!r} given twice (first at line {first_line})", key_node.start_mark
                        )
            return super().construct_mapping(node, deep)

    return UniqueKeyLoader


def load_yaml(text: str):
    """``text`` read as YAML like ``yaml.safe_load``, a key given twice in a mapping refused (``yaml.YAMLError``)."""
    return _yaml().load(text, Loader=_unique_key_loader())


def _unique_keys(pairs: list[tuple[str, object]]) -> dict:
    """A JSON object's members, a key given twice refused: ``json.loads`` keeps the last one's value."""
    seen = set()
    for key, _ in pairs:
        if key in seen:
            raise ValueError(f"key {key!r} appears twice in an object")
        seen.add(key)
    return dict(pairs)


def _brace_hint(text: str, error) -> str:
    """Where YAML failed on a line whose value opens with ``{`` unquoted (a prompt template's ``{prompt} ...``),
    which YAML reads as the start of a mapping: say to quote it."""
    mark = getattr(error, "problem_mark", None)
    lines = text.splitlines()
    if mark is None or mark.line >= len(lines) or not re.match(r"^\s*(-\s+)?[^\s#:]+:\s+\{", lines[mark.line]):
        return ""
    return (
        f"\n  line {mark.line + 1}'s value opens with '{{' unquoted, which YAML reads as a mapping: quote it "
        "('{prompt} ...')"
    )


def _read(path: Path) -> dict:
    suffix = path.suffix.lower()
    if suffix not in (".yaml", ".yml", ".json"):
        raise ConfigError([("", f"unknown config file extension {path.suffix!r}; use .yaml, .yml or .json")], path)
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as e:
        raise ConfigError([("", f"cannot read the file: {e.strerror}")], path) from None
    except UnicodeDecodeError as e:
        raise ConfigError([("", f"not UTF-8 text: byte {e.object[e.start]:#04x} at offset {e.start}")], path) from None
    if suffix == ".json":
        try:
            data = json.loads(text, object_pairs_hook=_unique_keys)
        except ValueError as e:  # JSONDecodeError, or a key given twice
            raise ConfigError([("", f"not valid JSON: {e}")], path) from None
    else:
        yaml = _yaml()
        try:
            data = load_yaml(text)
        except yaml.YAMLError as e:
            raise ConfigError([("", f"not valid YAML: {e}{_brace_hint(text, e)}")], path) from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError([("", f"the top level must be a mapping, not {type(data).__name__}")], path)
    return data


def _expand_dotted(overrides: Mapping) -> dict:
    """{"rl.learning_rate": 1e-5} -> {"rl": {"learning_rate": 1e-5}} (field names never contain dots). Only
    the keys of ``overrides`` are paths: a mapping value is taken as it is, since the keys of a mapping field
    may hold dots (a node selector's "nvidia.com/gpu.present")."""
    out: dict = {}
    for key, value in overrides.items():
        *parents, leaf = str(key).split(".")
        node = out
        for part in parents:
            if not isinstance(node.get(part), dict):
                node[part] = {}
            node = node[part]
        if isinstance(value, Mapping):
            value = _merge(node.get(leaf) if isinstance(node.get(leaf), dict) else {}, value)
        node[leaf] = value
    return out


def _merge(base: dict, over: Mapping, at: str = "") -> dict:
    """Deep merge: mappings merge key by key, a mapping of item numbers into
    a list item by item ("tasks.0.difficulty"), anything else replaces.

    model.preset and model.checkpoint are alternatives: a layer that names one
    drops the other, so a file can switch a preset's checkpoint to a preset."""
    out = dict(base)
    for key, value in over.items():
        if isinstance(value, Mapping) and isinstance(out.get(key), dict):
            out[key] = _merge(out[key], value, f"{at}{key}.")
        elif isinstance(value, Mapping) and isinstance(out.get(key), list) and all(_item_number(k) for k in value):
            items = list(out[key])
            for index, item in value.items():
                if int(index) >= len(items):
                    raise ConfigError([(f"{at}{key}.{index}", f"no such item: the list has {len(items)}")])
                old = items[int(index)]
                mergeable = isinstance(old, dict) and isinstance(item, Mapping)
                items[int(index)] = _merge(old, item, f"{at}{key}.{index}.") if mergeable else item
            out[key] = items
        else:
            out[key] = value
    model = over.get("model")
    if isinstance(model, Mapping) and isinstance(out.get("model"), dict):
        for chosen, other in (("preset", "checkpoint"), ("checkpoint", "preset")):
            if model.get(chosen) is not None and other not in model:
                out["model"].pop(other, None)
    return out


def _item_number(key) -> bool:
    """Whether a key names a list item: ASCII digits ("0", "12"; not "¹", which isdigit takes and int refuses)."""
    return re.fullmatch(r"[0-9]+", str(key)) is not None


def config_source(path: str | Path | None, overrides: Mapping | None) -> str | None:
    """Where a config's error lies, as the error names it: its file, "with the overrides" where some were
    given, since a problem may lie in either; None without a file."""
    if path is None:
        return None
    return f"{path} with the overrides" if overrides else str(path)


def load_config(
    path: str | Path | None = None, preset: str | None = None, overrides: Mapping | None = None
) -> RunConfig:
    """Build a RunConfig from a preset (or the defaults), a .yaml/.yml/.json file and overrides.

    Overrides may be nested or use dotted keys ("rl.learning_rate"), and go
    over the file one by one in their order, as ``--set`` options do: an item
    of a list set by an earlier one ("tasks" then "tasks.0.train_size") is
    that list's. S3 credentials come only from TRACEFP4_S3_ACCESS_KEY /
    TRACEFP4_S3_SECRET_KEY; a file or an override that sets them is an error."""
    try:
        data = (get_preset(preset) if preset is not None else RunConfig()).model_dump(mode="json")
    except ValueError as e:  # an unknown preset name
        raise ConfigError([("preset", str(e))]) from None
    if path is not None:
        data = _merge(data, _read(Path(path)))
    for key, value in (overrides or {}).items():
        data = _merge(data, _expand_dotted({key: value}))
    try:
        config = RunConfig.model_validate(data, context={"from_file": True})
    except ValidationError as e:  # a problem may lie in the overrides (--set), not the file
        raise ConfigError.from_validation(e, config_source(path, overrides)) from None
    for field, env_name in SECRET_ENV.items():
        if os.environ.get(env_name):
            setattr(config.store, field, SecretStr(os.environ[env_name]))
    return config


def continuation(checkpoint: str, trainer_state: str, first_round: int) -> dict:
    """The settings (dotted paths) of a run that continues another from the
    policy ``checkpoint`` and ``trainer_state`` it saved after ``first_round``
    rounds (docs/deploy.md, "Known limit")."""
    return {
        "model.preset": None,
        "model.checkpoint": checkpoint,
        "model.trainer_state": trainer_state,
        "rl.first_round": first_round,
        "bootstrap.enabled": False,
    }


def next_in_chain(config: RunConfig, continue_with: Mapping) -> RunConfig:
    """The run that goes on where a run of ``config`` stops
    (``rl.rounds_per_run``): its last train task's :func:`continuation`
    settings (``continue_with``) over ``config``, for the rounds left; it
    leaves out evaluating its initial policy, the trained one this run scored."""
    done = config.rl.run_rounds()
    if not config.rl.chained:
        raise ValueError(f"rl.rounds {config.rl.rounds} are done in one run: no run follows")
    if continue_with.get("rl.first_round") != done.stop:
        raise ValueError(
            f"the run's rounds end before round {done.stop}, but its last train task continues at round "
            f"{continue_with.get('rl.first_round')}"
        )
    following = {**continue_with, "rl.rounds": config.rl.rounds_left, "evaluation.initial": False}
    data = _merge(config.model_dump(mode="json"), _expand_dotted(following))
    try:
        return RunConfig.model_validate(data)
    except ValidationError as e:
        raise ConfigError.from_validation(e, None) from None


def changed_settings(config: RunConfig) -> dict:
    """``config``'s settings that differ from the schema's defaults, dotted
    (a list, such as ``tasks``, whole): what a config file holds to ask for
    ``config`` over those defaults (:func:`settings_yaml` writes one)."""

    def flat(data: Mapping, prefix: str = "") -> dict:
        found = {}
        for key, value in data.items():
            if isinstance(value, Mapping) and value:
                found.update(flat(value, f"{prefix}{key}."))
            else:
                found[f"{prefix}{key}"] = value
        return found

    ours, defaults = flat(_as_file_holds(config)), flat(_as_file_holds(RunConfig()))
    return {key: value for key, value in ours.items() if key not in defaults or defaults[key] != value}


def settings_yaml(settings: Mapping) -> str:
    """Dotted ``settings`` as the text of a YAML config file (``--config``), nested, keys sorted."""
    return _yaml().safe_dump(_expand_dotted(settings), sort_keys=True)


def config_text(config: RunConfig, suffix: str = ".yaml") -> str:
    """The whole config as the text of a .yaml/.yml or .json file (secrets are never written), in the schema's
    order, each task without the fields that do not apply to it (:meth:`TaskConfig.unused_fields`):
    load_config reads it back."""
    data = _as_file_holds(config)
    if suffix.lower() == ".json":
        return json.dumps(data, indent=2) + "\n"
    if suffix.lower() in (".yaml", ".yml"):
        return _yaml().safe_dump(data, sort_keys=False)
    raise ConfigError([("", f"unknown config file extension {suffix!r}; use .yaml, .yml or .json")])


def _as_file_holds(config: RunConfig) -> dict:
    """The config's data (secrets never), each task without the fields that do not apply to it."""
    data = config.model_dump(mode="json")
    for task, entry in zip(config.tasks, data["tasks"]):
        for field in task.unused_fields():
            del entry[field]
    return data


def save_config(config: RunConfig, path: str | Path) -> Path:
    """Write :func:`config_text` to ``path`` (its extension picks the format), atomically."""
    path = Path(path)
    try:
        text = config_text(config, path.suffix)
    except ConfigError as e:
        raise ConfigError(e.problems, path) from None
    write_atomic(path, lambda f: f.write(text.encode("utf-8")))
    return path


def _canonical(schema: dict) -> str:
    return json.dumps(schema, sort_keys=True, indent=2, ensure_ascii=False) + "\n"


def schema_hash() -> str:
    """First 12 hex digits of the SHA-256 of RunConfig's canonical JSON Schema.

    It changes when the config's shape, bounds, defaults or descriptions do, not
    with the package version, so a pipeline can be versioned by what it accepts."""
    return hashlib.sha256(_canonical(RunConfig.model_json_schema()).encode()).hexdigest()[:12]


def export_json_schema(out_dir: str | Path) -> list[Path]:
    """Write one JSON Schema file per top-level model into out_dir; byte-identical on every run."""
    out_dir = Path(out_dir)
    written = []
    for file_name, model in SCHEMA_FILES.items():
        schema = {
            "$schema": JSON_SCHEMA_DIALECT,
            "$id": f"urn:tracefp4:{version('tracefp4')}:{file_name}",
            **model.model_json_schema(),
        }
        target = out_dir / file_name
        text = _canonical(schema).encode()
        write_atomic(target, lambda f, text=text: f.write(text))  # a file kept whole: the old or the new one
        written.append(target)
    return written
