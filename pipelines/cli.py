"""The tracefp4 command: run the pipeline here, bootstrap a base policy,
export a policy for serving (compressed-tensors NVFP4 / MXFP4), size what a
run writes and needs, compile the pipeline for a cluster and submit it,
follow its runs and delete what a finished one left in object storage, write
the config's JSON Schema, the Grafana dashboards and the Prometheus alerting
rules, list presets, show a run's report, delete a run's metrics from a
Pushgateway."""

import contextlib
import json
import logging
import os
import sys
import tempfile
from collections.abc import Callable, Mapping
from pathlib import Path

import click
import yaml

from tracefp4.components.quant_config import FP4_FORMATS, ROLLOUT_CONFIGS, rollout_config
from tracefp4.schemas import PRESETS, ConfigError, export_json_schema, load_config, save_config
from tracefp4.schemas.io import config_source, config_text, load_yaml


def _config(
    preset: str | None,
    config_file: str | None,
    store: str | None = None,
    pushgateway: str | None = None,
    settings: dict | None = None,
    sets: dict | None = None,
    settings_by: str = "",
):
    """The run config, validated with ``sets`` (--set), then the options' values, then the command's own
    ``settings`` (dotted keys, set by ``settings_by``: the command or its option) in it. An option and a --set
    of its field that disagree are refused: neither has the last word by its place on the command line; nor
    is a --set the command's settings would silently replace."""
    options = {"store.uri": ("--store", store), "metrics.pushgateway_url": ("--pushgateway", pushgateway)}
    given = {key: value for key, (_, value) in options.items() if value is not None}
    for key, value in given.items():
        if key in (sets or {}) and sets[key] != value:
            raise click.UsageError(f"{options[key][0]} {value} and --set {key}={sets[key]} disagree: give one")
    for key, value in (settings or {}).items():
        if key in (sets or {}) and sets[key] != value:
            asked, set_by = (v if isinstance(v, str) else json.dumps(v) for v in (sets[key], value))
            raise click.UsageError(f"--set {key}={asked}: {settings_by} sets {key} to {set_by}; leave it out")
    overrides = (sets or {}) | given | (settings or {})
    try:
        return load_config(config_file, preset=preset or (None if config_file else "tiny"), overrides=overrides or None)
    except ConfigError as e:
        raise click.ClickException(str(e)) from None


def _refused(e: ConfigError, config_file: str | None, sets: dict) -> click.ClickException:
    """A check of the validated config (a run's start, its first task's, a comparison's branch) refusing it,
    as the command's error: naming the --config file, where the problem may lie, as validation's errors do."""
    return click.ClickException(str(e.found_in(config_source(config_file, sets))))


preset_option = click.option(
    "--preset",
    type=click.Choice(sorted(PRESETS)),
    help="Named configuration, under --config and --set (default: tiny; with --config, the schema's defaults).",
)


def _one_config(ctx, param, values: tuple[str, ...]) -> str | None:
    """--config's file: one (click would keep the last of two, the first dropped without a word)."""
    if len(values) > 1:
        raise click.BadParameter(
            f"given {len(values)} times ({', '.join(values)}): give one file, holding the others' settings too",
            ctx=ctx,
            param=param,
        )
    return values[0] if values else None


config_option = click.option(
    "--config",
    "config_file",
    type=click.Path(exists=True, dir_okay=False),
    multiple=True,
    callback=_one_config,
    help="YAML or JSON run config.",
)


def _sets(ctx, param, values: tuple[str, ...]) -> dict:
    """--set's KEY=VALUE pairs: a config value by its dotted path, the value read as YAML, in the
    order they apply (a key given again moves to its last place: load_config applies them in order)."""
    sets = {}
    for item in values:
        key, equals, text = item.partition("=")
        if not equals or not key.strip():
            raise click.BadParameter(f"{item!r}: expected KEY=VALUE, e.g. rl.rounds=2", ctx=ctx, param=param)
        try:
            value = load_yaml(text)
        except yaml.YAMLError as e:
            problem = getattr(e, "problem", None) or e  # a parse error's one line, without its echo of the input
            raise click.BadParameter(f"{item!r}: its value is not YAML ({problem})", ctx=ctx, param=param) from None
        sets.pop(key.strip(), None)
        sets[key.strip()] = value
    return sets


set_option = click.option(
    "--set",
    "sets",
    multiple=True,
    metavar="KEY=VALUE",
    callback=_sets,
    help="A config value by its dotted path, over --preset and --config; the value is YAML (rl.rounds=2, "
    "guidance.layers=[2,3], model.preset=null, tasks.0.train_size=64). Repeatable, in order: a later one "
    "goes over an earlier one.",
)


def _device(ctx, param, value: str):
    """The torch device ``value`` names, one this machine has (else a usage error saying what torch sees)."""
    from tracefp4.components.device import resolve

    try:
        return resolve(value)
    except (ValueError, RuntimeError) as e:
        raise click.BadParameter(str(e)) from None


def _methods(ctx, param, value: str | None) -> list[str] | None:
    """--compare's comma-separated methods, each known and named once (an empty one, between two commas or
    after the last, is none: it was said as an unknown method of no name)."""
    from tracefp4.pipelines.pipeline import check_methods

    if value is None:
        return None
    try:
        return check_methods([m for m in (part.strip() for part in value.split(",")) if m])
    except ValueError as e:
        raise click.BadParameter(str(e), ctx=ctx, param=param) from None


compare_option = click.option(
    "--compare", "methods", callback=_methods, help="Comma-separated methods side by side (e.g. trace,qat,bf16)."
)
pushgateway_option = click.option(
    "--pushgateway", help="Also push the metrics to this Pushgateway (http://host:9091; metrics.pushgateway_url)."
)
cluster_store_option = click.option(
    "--store", help="Artifact store URI for guidance and checkpoints (s3://bucket/prefix; the pods share it)."
)


def _output_error(output: str, e: OSError) -> click.ClickException:
    """A command's --output it could not write (a file in the way, no permission, no room), in one line."""
    return click.ClickException(f"--output {output}: {e.filename or output}: {e.strerror or e}")


class _Group(click.Group):
    """The ``tracefp4`` group: a Ctrl-C ends any of its commands with one line and exit status 130 (128 +
    SIGINT), as one while the command loads does (:func:`tracefp4.pipelines.main`) and as ``run`` does,
    where click would print "Aborted!" and exit 1, the status of a failed command."""

    def invoke(self, ctx):
        try:
            return super().invoke(ctx)
        except KeyboardInterrupt:
            click.echo("\ntracefp4: interrupted", err=True)
            sys.exit(130)


@click.group(cls=_Group, help=__doc__)  # shown as written, so plain text: no ``markup``
@click.version_option(package_name="tracefp4", prog_name="tracefp4")  # the installed distribution's version
def main():
    pass


@main.command()
@preset_option
@config_option
@set_option
@click.option(
    "--output", type=click.Path(file_okay=False), default="runs/latest", show_default=True, help="Run folder."
)
@click.option("--store", help="Artifact store URI for guidance and checkpoints (file://..., s3://bucket/prefix).")
@click.option("--verbose", is_flag=True, help="Stream every component's log (it also goes to <output>/pipeline.log).")
@compare_option
@pushgateway_option
@click.option("--restart", is_flag=True, help="Start a new run in the folder instead of resuming its last one.")
@click.option(
    "--continue-from",
    "previous",
    type=click.Path(exists=True, file_okay=False),
    help="Go on from the newest run of this run folder: its final policy and trainer state, its round count "
    "(model.checkpoint, model.trainer_state, rl.first_round; no bootstrap).",
)
def run(preset, config_file, sets, output, store, verbose, methods, pushgateway, restart, previous):
    """Run the whole DAG on this machine (kfp.local), then print the results, the report's files
    (<output>/report.html and report.md) and the serving export's folder.

    A rerun with the same config and output resumes: finished tasks are reused, not rerun."""
    from tracefp4.components.store import StoreError
    from tracefp4.pipelines.local import (
        Interrupted,
        PipelineFailed,
        continuation_of,
        ran_to_its_end,
        run_to_end,
        unlike_the_run_it_continues,
    )
    from tracefp4.pipelines.resume import FolderInUse, UnreadableRunRecord

    config = _config(preset, config_file, store, pushgateway, sets=sets)
    output = Path(output)
    if previous:
        if output.resolve() == Path(previous).resolve():  # a rerun would find this run's own states to go on from
            raise click.BadParameter("continue into another --output, so that a rerun resumes", param_hint="--output")
        if methods:
            raise click.UsageError("--continue-from goes on with one method's optimizer: leave out --compare")
        try:
            # a comparison's folder: the method --set names, none chosen for the user
            settings = continuation_of(Path(previous), config.rl.steps_per_round, (sets or {}).get("method"))
        except ValueError as e:
            raise click.ClickException(str(e)) from None
        config = _config(preset, config_file, store, pushgateway, settings, sets, "--continue-from")
        click.echo(f"continuing from round {config.rl.first_round}: {config.model.trainer_state}")
        try:
            unlike = unlike_the_run_it_continues(Path(previous), config, output)
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:  # its run.json, damaged by a hand
            click.echo(f"note: what the run it continues was asked is unreadable ({type(e).__name__}: {e})")
        else:
            if unlike:
                click.echo(
                    f"note: asked otherwise than the run it continues: {'; '.join(unlike)} (give that run's "
                    "--preset, --config and --set to go on as it ran)"
                )
        if not ran_to_its_end(Path(previous), config.model.trainer_state):
            click.echo(
                f"note: the run in {previous} did not run to its end (no report after its last train task): this "
                "goes on from where it stopped"
            )
    try:
        finished = run_to_end(config, output, methods=methods, verbose=verbose, restart=restart)
    # StoreError: the run's store, opened first, or model.checkpoint's, fingerprinted first
    except (PipelineFailed, FolderInUse, UnreadableRunRecord, StoreError) as e:
        raise click.ClickException(str(e)) from None
    except ConfigError as e:  # a run no machine here can do, a problem file or checkpoint the run cannot use
        raise _refused(e, config_file, sets) from None
    except OSError as e:  # the run folder: a file in the way, no permission, no room
        raise click.ClickException(f"{e.filename or output}: {e.strerror or e}") from None
    except Interrupted as e:
        click.echo(f"{e}: the running component was stopped; rerun the same command to resume", err=True)
        sys.exit(128 + e.signum)
    click.echo(finished.report.read_text())
    _echo_report_files(finished.page, finished.markdown)
    _echo_exports(finished.exports)


def _echo_report_files(page: Path, markdown: Path) -> None:
    """Where to open a report: its copies in the run folder (:func:`tracefp4.pipelines.local.publish_report`)."""
    click.echo(f"report: {page} (open it in a browser), {markdown} (markdown)")


def _for(export: dict) -> str:
    """Whom an export is for (:func:`tracefp4.components.export.served_by`, in its record or its stats)."""
    served = export.get("served_by")
    if served is None:  # an export of an earlier tracefp4 records none
        return "for serving"
    return f"for {served}" if served else "which no serving engine loads"


def _echo_exports(exports: dict[str | None, Path]) -> None:
    """Where a run's policy for serving is: its export tasks' checkpoints
    (:func:`tracefp4.pipelines.local.serving_exports`), a comparison's by method."""
    from tracefp4.components.checkpoint import provenance

    for method, exported in exports.items():
        which = f" of {method}" if method else ""
        record = provenance(exported)
        click.echo(f"serving export{which}: {exported} ({record['format']}, {_for(record)}: docs/export.md)")


@main.command()
@preset_option
@config_option
@set_option
@click.option(
    "--output",
    type=click.Path(file_okay=False),
    required=True,
    help="Folder of the bootstrapped checkpoint, or a store's (s3://bucket/prefix: uploaded once written); an "
    "earlier bootstrap's there is replaced, another tracefp4 save (a run's policy, an export) refused.",
)
def bootstrap(preset, config_file, sets, output):
    """SFT of the config's initial policy on its tasks (its bootstrap settings, enabled): a Hugging Face checkpoint."""
    from tracefp4.components.steps import prepare, steps_environment
    from tracefp4.components.store import StoreError
    from tracefp4.pipelines.local import check_device

    # validated with it on
    config = _config(preset, config_file, settings={"bootstrap.enabled": True}, sets=sets, settings_by="bootstrap")
    try:
        check_device(config)
    except ConfigError as e:
        raise _refused(e, config_file, sets) from None
    progress = _BootstrapSteps()
    try:
        with _written_to(
            output, steps_environment(config), replaces=(_bootstrapped, "bootstrapped checkpoint")
        ) as folder:
            with _said_here(progress, "tracefp4.components.bootstrap"):
                stats = prepare(config, folder)
    except (ValueError, OSError, StoreError) as e:  # a folder not to write into, a checkpoint that is none
        raise click.ClickException(str(e)) from None
    finally:
        progress.close()
    click.echo(
        f"{output}: {stats['bootstrap_steps']} SFT steps in {stats['bootstrap_seconds']:.0f} s, "
        f"greedy test accuracy {stats['bootstrap_accuracy']:.1%}"
    )


@main.command()
@click.option(
    "--format",
    "fmt",
    type=click.Choice(FP4_FORMATS),
    default="nvfp4",
    show_default=True,
    help="The run's rollout.fmt: nvfp4 (nvfp4-pack-quantized) or mxfp4 (mxfp4-pack-quantized).",
)
@click.option(
    "--rollout-config",
    "config_name",
    type=click.Choice(ROLLOUT_CONFIGS),
    default="fp4_wa_kv",
    show_default=True,
    help="The run's rollout.config: what its rollout quantized is what is exported (fp4_kv and bf16 left the "
    "weights BF16: an unquantized BF16 checkpoint).",
)
@click.option(
    "--rollout-dtype",
    type=click.Choice(["bfloat16", "float32"]),
    default="bfloat16",
    show_default=True,
    help="The dtype the run's rollout computed in (its model.dtype): the weights are quantized from it.",
)
@click.option(
    "--calibration-seed",
    type=int,
    default=0,
    show_default=True,
    help="The run's seed: the rollout calibrates its static activation scales on a batch drawn with it.",
)
@click.option(
    "--device",
    default="cpu",
    show_default=True,
    callback=_device,
    help="Device of the calibration (the rollout's): auto, cpu, cuda or cuda:N.",
)
@click.option(
    "--preset",
    type=click.Choice(sorted(PRESETS)),
    help="The run's named configuration: its rollout settings (all of the above) instead of the options.",
)
@click.option(
    "--config",
    "config_file",
    type=click.Path(exists=True, dir_okay=False),
    help="The run's config: its rollout settings (all of the above) instead of the options.",
)
@set_option
@click.argument("src", type=click.Path(exists=True, file_okay=False))
@click.argument("dst", type=click.Path(file_okay=False))
@click.pass_context
def export(ctx, fmt, config_name, rollout_dtype, calibration_seed, device, preset, config_file, sets, src, dst):
    """Write the policy folder SRC at DST for vLLM / SGLang as the run's rollout served it: a
    compressed-tensors checkpoint with the routed experts FP4 as the rollout quantized them and
    everything else BF16, or all BF16 where the rollout left the weights BF16. With --preset or
    --config (and the run's --set), as the pipeline's export task does for that run. DST may be a
    store's folder (s3://bucket/prefix), uploaded once written."""
    import torch

    from tracefp4.components import steps
    from tracefp4.components.export import export as export_policy
    from tracefp4.components.store import StoreError
    from tracefp4.pipelines.resume import run_folder_problem

    # each option's setting in the run config
    settings = {
        "fmt": "rollout.fmt",
        "config_name": "rollout.config",
        "rollout_dtype": "model.dtype",
        "calibration_seed": "seed",
        "device": "resources.device",
    }
    given = [name for name in settings if ctx.get_parameter_source(name) is click.core.ParameterSource.COMMANDLINE]
    if (preset or config_file) and given:
        names = ", ".join(f"{p.opts[0]} ({settings[p.name]})" for p in ctx.command.params if p.name in given)
        raise click.UsageError(
            f"{names}: the run's config (--preset, --config) sets it; give the config or the options"
        )
    if sets and not (preset or config_file):
        raise click.UsageError("--set changes the run's config: give it with the run's --preset or --config")
    if problem := run_folder_problem(Path(src)):
        raise click.ClickException(
            f"{problem}; `tracefp4 run` exported its last policy already (the folder it printed)"
        )
    config = _config(preset, config_file, sets=sets) if preset or config_file else None
    try:
        env = steps.steps_environment(config) if config else os.environ
        with _written_to(dst, env, replaces=(_exported, "export")) as folder:
            with _said_here(_Logged(logging.WARNING)):
                if config:
                    stats = steps.export_policy(config, Path(src), folder)
                else:
                    quant = rollout_config(config_name, fmt)
                    dtype = getattr(torch, rollout_dtype)
                    stats = export_policy(
                        src, folder, quant, rollout_dtype=dtype, device=device, calibration_seed=calibration_seed
                    )
    except (ValueError, OSError, StoreError) as e:  # not a policy folder, a store that refuses, say
        raise click.ClickException(str(e)) from None
    click.echo(
        f"{dst}: {stats['format']} ({_for(stats)}), {stats['expert_matrices']} expert matrices in "
        f"{stats['expert_bytes']} bytes ({stats['expert_bytes_bf16']} in BF16)"
    )


def _bootstrapped(found: dict) -> bool:
    """Whether a save's provenance is a bootstrap's (prepare's, of no run): what ``bootstrap --output`` replaces."""
    return found == {"run_id": "", "policy_version": 0}


def _exported(found: dict) -> bool:
    """Whether a save's provenance is an export's (it names its ``format``): what ``export``'s DST replaces."""
    return "format" in found


@contextlib.contextmanager
def _written_to(output: str, env: Mapping[str, str], replaces: tuple[Callable[[dict], bool], str]):
    """The local folder a command writes its output folder in: ``output``
    itself, or where that is a store URI (``s3://``, ``minio://``) a
    temporary one, uploaded there once written whole (``upload_folder``: a
    reader never takes it half uploaded), with ``env``'s S3 settings (the
    steps', :func:`~tracefp4.components.steps.steps_environment`, where a
    config sets ``store.endpoint``).
    The store is opened first: a bucket that is not there, or credentials it
    refuses, fail before the work. A folder uploaded there before is
    replaced, as a local save replaces one; a folder or prefix holding other
    files is refused before the work (the save would delete them, or mix
    with those in folders below), and so is a tracefp4 save of
    another kind than the command's (``replaces``: whether a save's provenance
    is of that kind, and its name): a swapped or mistyped path would otherwise
    replace a trained policy."""
    from tracefp4.components.checkpoint import (
        MANIFEST,
        CheckpointError,
        check_replaceable,
        local_folder,
        manifest_provenance,
        upload_folder,
    )
    from tracefp4.components.store import open_store

    def refuse_another_kind(manifest: bytes) -> None:
        found = manifest_provenance(manifest, f"{output}/{MANIFEST}")
        if not replaces[0](found):
            saved = ", ".join(
                f"{k} {found[k]}" for k in ("run_id", "policy_version", "format") if found.get(k) not in (None, "")
            )
            raise click.ClickException(
                f"{output} holds a tracefp4 save that is no {replaces[1]} ({saved or 'no provenance'}), which "
                "writing there would replace: give another folder"
            )

    folder = local_folder(output)
    if folder is not None:
        try:
            check_replaceable(folder)
        except CheckpointError as e:
            raise click.ClickException(str(e)) from None
        if (folder / MANIFEST).is_file():
            refuse_another_kind((folder / MANIFEST).read_bytes())
        yield folder
        return
    store = open_store(output, env=env)
    held = store.list()
    foreign = [key for key in held if "/" in key] or ([] if MANIFEST in held else held)  # a tracefp4 folder is flat
    if foreign:
        raise click.ClickException(
            f"{output} holds {len(foreign)} object(s) of no tracefp4 folder ({', '.join(foreign[:3])}"
            f"{', ...' if len(foreign) > 3 else ''}), which writing a folder there would delete or mix with: give "
            "an empty prefix"
        )
    if held:
        refuse_another_kind(store.get_bytes(MANIFEST))
    with tempfile.TemporaryDirectory(prefix="tracefp4-output-") as tmp:
        yield Path(tmp) / "folder"
        upload_folder(Path(tmp) / "folder", store)


def _warn(message: str) -> None:
    click.echo(f"warning: {message}", err=True)


@contextlib.contextmanager
def _said_here(handler: logging.Handler, name: str = "tracefp4"):
    """What the logger ``name`` logs at ``handler``'s level and above while the
    block runs, said by ``handler`` as the command's own lines, and not passed
    on to whatever the process's root logger holds too (a host's handlers, or
    one bound to a stream since closed): each said once, here."""
    logger = logging.getLogger(name)
    level, propagates = logger.level, logger.propagate
    logger.addHandler(handler)
    logger.setLevel(min(handler.level, logger.getEffectiveLevel()))
    logger.propagate = False
    try:
        yield
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)
        logger.propagate = propagates


class _Logged(logging.Handler):
    """What tracefp4 logs while a command runs in this process (the export's warnings: matrices served one ulp
    off, MXFP4 activations exported as dynamic), said as the command's own, ``warning: ...`` on standard error,
    where Python's handler of last resort would print the bare message."""

    def emit(self, record: logging.LogRecord) -> None:
        click.echo(f"{record.levelname.lower()}: {record.getMessage()}", err=True)


class _BootstrapSteps(_Logged):
    """The bootstrap's steps, which its log names one by one ("bootstrap step
    i/n"), as the command's progress: a tqdm bar on a terminal, else a line at
    each tenth of them; its warnings as :class:`_Logged` says them."""

    def __init__(self):
        super().__init__(logging.INFO)
        self.bar, self.tenth = None, 0

    def emit(self, record: logging.LogRecord) -> None:
        from tqdm import tqdm

        from tracefp4.pipelines.local import BOOTSTRAP

        found = BOOTSTRAP.search(record.getMessage())
        if not found:
            if record.levelno >= logging.WARNING:
                super().emit(record)
            return
        step, steps = map(int, found.groups())
        out = sys.stdout  # the stream click.echo writes to (a test runner's too)
        if out.isatty():
            self.bar = self.bar or tqdm(total=steps, unit="step", desc="bootstrap", file=out)
            self.bar.update(step - self.bar.n)
        elif step * 10 // steps > self.tenth:
            self.tenth = step * 10 // steps
            click.echo(f"bootstrap step {step}/{steps}")

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
        super().close()


def _warn_for_cluster(config) -> None:
    """What in the config would keep a compiled or submitted run from working on a cluster, from being
    watched, or its export from being served."""
    from tracefp4.components.export import unservable
    from tracefp4.components.steps import rollout_quant

    if problem := unservable(rollout_quant(config)):
        _warn(problem)
    if config.store.uri.startswith("file://"):
        _warn(f"store {config.store.uri} is local to each pod; use --store s3://... on a cluster")
    elif config.store.endpoint is None:
        _warn(
            f"store {config.store.uri} without store.endpoint: every step takes TRACEFP4_S3_ENDPOINT from the "
            "image's environment, and fails at its start where the image sets none (--set store.endpoint=http://...)"
        )
    if config.metrics.pushgateway_url is None:
        _warn(
            "no metrics.pushgateway_url: the run pushes no metrics, and the Grafana dashboards stay empty "
            "(--pushgateway http://...)"
        )
    read = {"model.checkpoint": config.model.checkpoint, "model.trainer_state": config.model.trainer_state}
    read |= {f"tasks.{i}.data": t.data for i, t in enumerate(config.tasks)}
    read |= {f"tasks.{i}.reward": t.reward for i, t in enumerate(config.tasks)}
    for field, where in read.items():
        if where is not None and not where.startswith(("s3://", "minio://")):
            _warn(f"{field} {where} is a path each pod reads in its own image; put it in the store (s3://...)")


def _yaml_path(ctx, param, value: str) -> str:
    """--output of compile: a .yaml or .yml file, the only kind the compiled pipeline (with its Kubernetes
    platform spec) can be written as, and that the KFP UI uploads."""
    if not value.endswith((".yaml", ".yml")):
        raise click.BadParameter(f"{value!r}: the compiled pipeline is YAML; name a .yaml or .yml file")
    return value


@main.command()
@preset_option
@config_option
@set_option
@click.option(
    "--output",
    type=click.Path(dir_okay=False),
    required=True,
    callback=_yaml_path,
    help="Where to write the KFP IR YAML (.yaml or .yml; replaced whole, never left half written).",
)
@cluster_store_option
@pushgateway_option
@compare_option
def compile(preset, config_file, sets, output, store, pushgateway, methods):
    """Compile the pipeline (or with --compare the comparison pipeline) to KFP IR YAML (upload it in the KFP UI)."""
    import tempfile

    from tracefp4.components.store import write_atomic
    from tracefp4.pipelines.pipeline import (
        compile_pipeline,
        compiled_documents,
        run_size_problem,
        run_tasks,
        version_name,
    )

    config = _config(preset, config_file, store, pushgateway, sets=sets)
    try:
        # compiled aside, then renamed into place: kfp's compiler writes the file as it goes, so that a failure
        # or a Ctrl-C partway would leave a truncated pipeline where an earlier one was
        with tempfile.TemporaryDirectory(prefix="tracefp4-compile-") as tmp:
            package = Path(compile_pipeline(config, Path(tmp) / "pipeline.yaml", methods)).read_bytes()
        write_atomic(Path(output), lambda f: f.write(package))
    except ConfigError as e:  # a comparison's branch that could not run
        raise _refused(e, config_file, sets) from None
    except OSError as e:  # a folder in the way, no permission
        raise _output_error(output, e) from None
    _warn_for_cluster(config)
    documents = compiled_documents(package)
    tasks = run_tasks(documents[0], config)
    if problem := run_size_problem(tasks):
        _warn(f"{output}: {problem}")
    name = f"tracefp4-{config.name}" + ("-compare" if methods else "")
    rl = config.rl
    chain = (
        f", a chain of {-(-rl.rounds // rl.rounds_per_run)} runs of at most {rl.rounds_per_run} rounds"
        if rl.chained
        else ""
    )
    version = version_name(documents)
    click.echo(f"{output}: pipeline {name}, version {version} (submit's), {tasks} tasks a run{chain}")


def connection_options(command):
    """--host, --namespace and how to authenticate to the KFP API (shared by submit and runs)."""
    options = [
        click.option(
            "--host",
            required=True,
            envvar="KF_PIPELINES_ENDPOINT",
            help="KFP UI/API URL: http://localhost:8080, the Kubeflow gateway (env KF_PIPELINES_ENDPOINT).",
        ),
        click.option("--namespace", help="Profile namespace of a multi-user Kubeflow."),
        click.option(
            "--token",
            help="Bearer token (default: env KF_PIPELINES_TOKEN, else the pod's token, at KF_PIPELINES_SA_TOKEN_PATH "
            "where set).",
        ),
        click.option(
            "--cookies",
            help="Cookie header of a logged-in session, e.g. oauth2_proxy_kubeflow=... "
            "(default: env KF_PIPELINES_COOKIES).",
        ),
        click.option(
            "--ca-bundle",
            type=click.Path(exists=True, dir_okay=False),
            help="CA certificate(s) that signed the server's certificate (PEM).",
        ),
        click.option("--insecure-skip-verify", is_flag=True, help="Accept any TLS certificate (self-signed gateways)."),
        click.option(
            "--timeout",
            "timeout_s",
            type=click.FloatRange(min=0, min_open=True),
            default=30,
            show_default=True,
            help="Seconds per request.",
        ),
    ]
    for option in reversed(options):
        command = option(command)
    return command


def _connection(host, namespace, token, cookies, ca_bundle, insecure_skip_verify, timeout_s):
    from tracefp4.pipelines.submit import Connection

    if ca_bundle and insecure_skip_verify:  # kfp.Client would check no certificate, the bundle unread
        raise click.UsageError("--ca-bundle and --insecure-skip-verify: give one (a CA to check with, or no check)")
    return Connection(host, namespace, token, cookies, ca_bundle, not insecure_skip_verify, timeout_s)


@main.command()
@preset_option
@config_option
@set_option
@connection_options
@click.option("--experiment", default="tracefp4", show_default=True, help="KFP experiment to file the run under.")
@cluster_store_option
@pushgateway_option
@click.option("--service-account", help="Service account of the run's pods (e.g. tracefp4-pipeline-runner).")
@click.option(
    "--pipeline-root",
    "root",
    help="Where KFP keeps this run's artifacts (default: the cluster's, e.g. "
    "minio://mlpipeline/v2/artifacts); the minio overlay's is minio://tracefp4/pipeline-root.",
)
@compare_option
def submit(preset, config_file, sets, experiment, store, pushgateway, service_account, root, methods, **connection):
    """Upload the pipeline (--compare: the comparison), or a new version of it, to a KFP server and start a run."""
    from tracefp4.pipelines.submit import SubmitError
    from tracefp4.pipelines.submit import submit as submit_run

    connection = _connection(**connection)
    config = _config(preset, config_file, store, pushgateway, sets=sets)
    _warn_for_cluster(config)
    try:
        result = submit_run(
            config,
            connection,
            experiment,
            service_account=service_account,
            pipeline_root=root,
            methods=methods,
            warn=_warn,
        )
    except SubmitError as e:
        raise click.ClickException(str(e)) from None
    except ConfigError as e:
        raise _refused(e, config_file, sets) from None
    click.echo(
        f"pipeline {result['pipeline_id']}, version {result['pipeline_version_id']}, "
        f"experiment {result['experiment_id']}, run {result['run_id']}"
    )
    click.echo(result["run_url"])


@main.group()
def runs():
    """Runs on a KFP server: list them, a run's status, its tasks' errors and log commands, and delete what a
    finished one left in object storage."""


def _kfp_call(function, *args, **kwargs):
    from tracefp4.pipelines.submit import SubmitError

    try:
        return function(*args, **kwargs)
    except SubmitError as e:
        raise click.ClickException(str(e)) from None


@runs.command("list")
@connection_options
@click.option("--experiment", help="Only this experiment's runs.")
@click.option("--limit", type=click.IntRange(1, 200), default=20, show_default=True, help="Runs to list.")
def runs_list(experiment, limit, **connection):
    """The newest runs, newest first."""
    from tracefp4.pipelines.submit import list_runs

    found = _kfp_call(list_runs, _connection(**connection), experiment, limit)
    for r in found:
        click.echo(f"{r['run_id']}  {r['state']:10}  {r['created_at']}  {r['name']}")
    if not found:
        click.echo("no runs")


def _print_status(status: dict) -> None:
    when = f"created {status['created_at']}, finished {status['finished_at']}"
    click.echo(f"run {status['run_id']} {status['name']}: {status['state']} ({when})")
    if status["error"]:
        click.echo(f"error: {status['error']}")
    for task in status["tasks"]:
        click.echo(f"  {task['name']:32} {task['state']:10}" + (f"  error: {task['error']}" if task["error"] else ""))


@runs.command("status")
@connection_options
@click.argument("run_id")
def runs_status(run_id, **connection):
    """A run's state and error, and its tasks' states and errors."""
    from tracefp4.pipelines.submit import run_status

    _print_status(_kfp_call(run_status, _connection(**connection), run_id))


@runs.command("logs")
@connection_options
@click.argument("run_id")
def runs_logs(run_id, **connection):
    """A run's task states and errors, and the kubectl command for each task pod's log."""
    from tracefp4.pipelines.submit import log_commands, run_namespace, run_status

    connection = _connection(**connection)
    status = _kfp_call(run_status, connection, run_id)
    _print_status(status)
    commands = log_commands(status, _kfp_call(run_namespace, connection, status))
    if commands:
        click.echo("\nThe KFP API gives states, not logs; each task pod's log (Kubernetes API):")
    else:
        click.echo("\nno task pods recorded yet")
    for command in commands:
        click.echo(f"  {command}")


def folder_option(default: str, help: str):
    """A command's ``--output``: the folder it writes its files into. Its
    default is the repository's (a path from its root): a command run
    elsewhere, where that path's first folder is not, is refused rather than
    make a stray copy of the repository's folders there."""

    def outside_the_repository(ctx, param, value: str) -> str:
        if value == default and not Path(Path(default).parts[0]).is_dir():
            raise click.BadParameter(
                f"the default, {default}, is the repository's, and {Path(default).parts[0]}/ is not here: run it "
                "from the repository's root, or give --output",
                ctx=ctx,
                param=param,
            )
        return value

    return click.option(
        "--output",
        type=click.Path(file_okay=False),
        default=default,
        show_default=True,
        callback=outside_the_repository,
        help=help,
    )


@main.command()
@folder_option("schemas", "Folder to write the JSON Schema files into.")
def schema(output):
    """Write the run config's JSON Schema."""
    try:
        written = export_json_schema(output)
    except OSError as e:  # a file in the way, no permission
        raise _output_error(output, e) from None
    for path in written:
        click.echo(path)


@main.command()
@folder_option("manifests/base/grafana/dashboards", "Folder to write the dashboard, tracefp4.json, into.")
def dashboards(output):
    """Write the Grafana dashboard JSON (built from the run metrics)."""
    try:
        from tracefp4.pipelines.dashboards import write
    except ImportError as e:
        raise click.ClickException(f"{e}: the dashboards need the dev extras (pip install -e '.[dev]')") from None

    try:
        click.echo(write(output))
    except OSError as e:  # a file in the way, no permission
        raise _output_error(output, e) from None


@main.command()
@folder_option(
    "manifests",
    "The kustomize manifests' folder, to write base/prometheus/alerts.yml and the "
    "kube-prometheus-stack overlay's prometheusrule.yaml under.",
)
def alerts(output):
    """Write the Prometheus alerting rules on a run's train-rollout mismatch (docs/metrics.md, "Alerts")."""
    from tracefp4.pipelines.alerts import write

    try:
        for path in write(output):
            click.echo(path)
    except OSError as e:  # a file in the way, no permission
        raise _output_error(output, e) from None


@main.command("config")
@preset_option
@config_option
@set_option
@click.option(
    "--output",
    type=click.Path(dir_okay=False),
    help="Write it to this .yaml, .yml or .json file instead of printing it as YAML.",
)
@click.option(
    "--check",
    is_flag=True,
    help="Also read the tasks' problem files (S3 with the config's store settings) and draw every task, as a "
    "run's first task does, and model.checkpoint's config.json and tokenizer (a local folder's weights' headers "
    "too), as a local run does before it starts; give the config with the files' sha256 pinned.",
)
def show_config(preset, config_file, sets, output, check):
    """Print the whole run config that --preset, --config and --set give, validated: what a run of them takes,
    every value (of a task, those that apply to it), and a start for a --config file of your own (e.g.
    tracefp4 config --set model.checkpoint=my-moe > my-run.yaml). --check finds before a submit what the
    run's first task would refuse in its tasks, and prepare in its checkpoint."""
    config = _config(preset, config_file, sets=sets)
    if check:
        from tracefp4.components.steps import steps_environment
        from tracefp4.pipelines.local import check_checkpoint, warnings_to
        from tracefp4.pipelines.parameters import check_drawable, pin_problems

        # on standard error: a reward's print() and the warnings, where the config printed is a file's
        try:
            with contextlib.redirect_stdout(sys.stderr), warnings_to(sys.stderr):
                config = pin_problems(config)
                check_drawable(config)
                check_checkpoint(config, steps_environment(config))
        except ConfigError as e:
            raise _refused(e, config_file, sets) from None
    if output is None:
        click.echo(config_text(config), nl=False)
        return
    try:
        click.echo(save_config(config, output))
    except ConfigError as e:  # another extension
        raise click.ClickException(f"--output {output}: {e.problems[0][1]}") from None
    except OSError as e:  # a folder in the way, no permission
        raise _output_error(output, e) from None


@main.command()
def presets():
    """List the named configurations (tracefp4 config --preset NAME prints one whole)."""
    for name, config in sorted(PRESETS.items()):
        model = config.model.preset or config.model.checkpoint
        click.echo(
            f"{name:22} model {model}, {config.rollout.config} ({config.rollout.fmt}), method {config.method}, "
            f"{config.rl.rounds}x{config.rl.steps_per_round} steps"
            + (f", {config.rl.rounds_per_run} rounds a run" if config.rl.chained else "")
        )


def _size(n: float) -> str:
    """Bytes for a reader: in decimal units (GB, TB), as the docs give them."""
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if abs(n) < 1000 or unit == "TB":
            return f"{n:,.0f} {unit}" if unit == "B" else f"{n:,.1f} {unit}"
        n /= 1000


@main.command()
@preset_option
@config_option
@set_option
@click.option(
    "--model-config",
    type=click.Path(exists=True, dir_okay=False),
    help="The model's config.json on disk, where model.checkpoint is in a store this machine does not reach.",
)
@click.option(
    "--tokens-per-trajectory",
    type=click.IntRange(1),
    help="Mean tokens of a trajectory, prompt and response (default: the bound model.max_seq_len).",
)
def plan(preset, config_file, sets, model_config, tokens_per_trajectory):
    """What a run writes and needs: its policy, trainer state, guidance and trajectories, per round, run and
    chain, by where they land (docs/deploy.md, step 6, "Sizes"); the figures again as one JSON line at the end."""
    from tracefp4.components import plan as planning

    config = _config(preset, config_file, sets=sets)
    try:
        figures = planning.plan(config, planning.model_config(config, model_config), tokens_per_trajectory)
    except planning.PlanError as e:
        raise click.ClickException(str(e)) from None
    except ValueError as e:  # "tasks.i.data: ...": a task's file that cannot be read, as the run's first task says
        field, _, reason = str(e).partition(": ")
        raise _refused(ConfigError([(field, reason)]), config_file, sets) from None
    f = figures
    bound = "at most" if f["tokens_per_trajectory_is_bound"] else "a mean of"
    rows = [
        ("model", f"{f['model_type']}, {f['parameters']:,} parameters"),
        ("policy", f"{_size(f['policy_bytes'])} ({f['policy_dtype']}: a save's Hub tensors)"),
        (
            "trainer state",
            f"{_size(f['trainer_state_bytes'])} (AdamW's float32 moments and step"
            + (", float32 master weights)" if f["trainer_state_masters"] else ")"),
        ),
        ("guided layers", ", ".join(map(str, f["guided_layers"])) or "none"),
        (
            "guidance a token",
            f"{_size(f['guidance_bytes_per_token'])} (full 4-bit capture: {_size(f['full_capture_bytes_per_token'])})",
        ),
        ("capture a token", f"{_size(f['capture_bytes_per_token'])} (shipped for compaction besides guidance)"),
        (
            "round",
            f"{f['trajectories_per_round']:,} trajectories of {bound} {f['tokens_per_trajectory']:,} tokens: "
            f"{f['tokens_per_round']:,} tokens",
        ),
        ("guidance a round", _size(f["guidance_bytes_per_round"] + f["capture_bytes_per_round"])),
        (
            "trajectories",
            f"{_size(f['trajectories_bytes_per_round'])} a round ({_size(f['trajectory_bytes_per_token'])} a token: "
            f"JSON lines of ids and log-probabilities; {_size(f['problem_bytes_per_trajectory'])} a trajectory: its "
            "problem)",
        ),
        (
            "store",
            f"guidance and capture {_size(f['store_bytes_per_run'])} at once in a run of {f['rounds_per_run']} "
            f"round{'s' * (f['rounds_per_run'] != 1)}, {_size(f['store_bytes_after_run'])} left after it until "
            f"runs clean, {_size(f['store_bytes_per_chain'])} a chain of {f['runs']} run{'s' * (f['runs'] != 1)}, "
            "none cleaned; trainer states "
            f"{_size(f['store_trainer_state_bytes'])} at once"
            + f", and a TrainJob's trajectories {_size(f['store_trajectories_bytes'])}"
            * bool(f["store_trajectories_bytes"]),
        ),
        (
            "pipeline root",
            f"{_size(f['pipeline_root_bytes_per_run'])} a run (policies and trajectories), "
            f"{_size(f['pipeline_root_bytes_per_chain'])} a chain",
        ),
    ]
    for name, text in rows:
        click.echo(f"{name:17} {text}")
    click.echo("runs clean deletes all but the run's record (report, metrics, the exported policy)")
    click.echo(json.dumps(figures))


@main.command()
@click.argument("run_dir", type=click.Path(exists=True, file_okay=False, resolve_path=True, path_type=Path))
@click.option(
    "--run-id",
    help="The report of this run of the folder (its id, which `tracefp4 run` prints as it starts); default: the "
    "newest report, whichever run of the folder wrote it.",
)
def report(run_dir, run_id):
    """Print the newest report of a run folder (of a comparison, its side-by-side report), copy it to
    report.html and report.md there, to open, and say whose it is and where its run's serving export is, as run
    does."""
    from tracefp4.pipelines.local import (
        LOG,
        REPORT_COPIES,
        publish_report,
        report_exports,
        report_run,
        where_it_stopped,
    )
    from tracefp4.pipelines.resume import PIPELINE_ROOT, finished_reports, written_reports

    if not (run_dir / PIPELINE_ROOT).is_dir():  # a folder above the run folder, say, or a task's own
        raise click.ClickException(
            f"{run_dir}: not a run folder (no {PIPELINE_ROOT}/ in it): name the --output of a `tracefp4 run`, "
            "such as runs/tiny"
        )
    found = finished_reports(run_dir)
    if not found:
        log = run_dir / LOG
        stopped = where_it_stopped(log.read_text(errors="replace")) if log.is_file() else None
        raise click.ClickException(
            f"{run_dir}: no run there has finished its report"
            + (f"; the last one stopped: {stopped} (its log: {log})" if stopped else "")
            + "; rerun its `tracefp4 run` command to resume it" * bool(stopped or written_reports(run_dir))
        )

    def run_of(report: Path) -> str | None:
        try:
            return (report_run(report) or (None,))[0]
        except ValueError:  # damaged from outside: said with its exports below
            return None

    runs = list(dict.fromkeys(filter(None, map(run_of, found))))  # oldest report's first
    if run_id is not None:
        found = [r for r in found if run_of(r) == run_id]
        if not found:
            raise click.ClickException(
                f"{run_dir}: no finished report of run {run_id}; its runs' reports: {', '.join(runs) or 'none known'}"
            )
    # copied before anything is said: a reader that stops early (`| head`) leaves the copies made
    try:
        copies = publish_report(found[-1], run_dir)
    except OSError as e:  # a run folder this user may not write into, a folder in the way: the report is shown
        copies = None
        click.echo(
            f"warning: {run_dir}: could not copy the report there as {' and '.join(REPORT_COPIES.values())} "
            f"({e.strerror or e}); it is {found[-1].with_name('page')} (HTML) and {found[-1]} (markdown)",
            err=True,
        )
    click.echo(found[-1].read_text())
    if (shown := run_of(found[-1])) and len(runs) > 1:
        others = ", ".join(r for r in runs if r != shown)
        click.echo(f"the report of run {shown}; the folder's other runs' (--run-id): {others}")
    if copies:
        _echo_report_files(*copies)  # absolute, as run says them
    try:
        _echo_exports(report_exports(run_dir, found[-1]))
    except ValueError as e:  # damaged from outside: the report is shown
        click.echo(f"warning: {e}: its run's serving export is not known", err=True)


@runs.command("clean")
@connection_options
@click.argument("run_id")
@click.option(
    "--pipeline-root",
    "root",
    help="Where KFP kept the run's artifacts, for a run submitted without one (the cluster's default, e.g. "
    "minio://mlpipeline/v2/artifacts).",
)
@click.option(
    "--only",
    type=click.Choice(["artifacts", "store"]),
    help="Only the run's KFP artifacts or only its folder in tracefp4's store (when they are on two S3 servers).",
)
@click.option(
    "--all",
    "everything",
    is_flag=True,
    help="Also the run's record in its KFP artifacts: report, history, metrics, evaluation results and the exported "
    "policy (kept by default).",
)
@click.option(
    "--chain",
    is_flag=True,
    help="Also every run it went on from, back to its chain's first (each found by the policy it started from).",
)
@click.option("--yes", is_flag=True, help="Delete them; without it, only say what would go.")
@click.option(
    "--deleted",
    is_flag=True,
    help="The run was deleted in KFP: its folders from its config (--preset, --config, --set, as submitted) and "
    "--pipeline-root.",
)
@preset_option
@config_option
@set_option
def runs_clean(run_id, root, only, everything, chain, yes, deleted, preset, config_file, sets, **connection):
    """Delete what a finished run left in object storage: its policies, trainer states, trajectories and
    guidance among its KFP artifacts, and its folder in tracefp4's store (S3 settings: TRACEFP4_S3_*);
    refused while a run that goes on from it has yet to prepare."""
    from tracefp4.components.store import StoreError
    from tracefp4.pipelines.clean import (
        KINDS,
        chain_folders,
        delete,
        deleted_run_folders,
        run_folders,
        survey,
        waiting_continuations,
    )
    from tracefp4.pipelines.submit import connect

    if everything and only == "store":  # --all widens what goes of the KFP artifacts, which --only store keeps
        raise click.UsageError("--all and --only store: --all is about the KFP artifacts, which --only store leaves")
    config_given = preset or config_file or sets
    if deleted and (chain or not (preset or config_file) or not root):
        raise click.UsageError(
            "--deleted: KFP forgot the run's pipeline and parameters, so give its config (--preset or --config, with "
            "its --set) and --pipeline-root; one run at a time (no --chain)"
        )
    if config_given and not deleted:
        raise click.UsageError("--preset, --config and --set: only with --deleted; KFP holds a run's config")
    connection = _connection(**connection)
    client = _kfp_call(connect, connection)
    config = _config(preset, config_file, sets=sets) if deleted else None
    try:  # every folder surveyed before any is deleted: one the S3 settings do not reach stops nothing half done
        if deleted:  # its artifacts are read: which pipeline's folder holds them, the run id its policies record
            runs = {run_id: _kfp_call(deleted_run_folders, client, run_id, config, root)}
        elif chain:
            runs = _kfp_call(chain_folders, client, run_id, root)
        else:
            runs = {run_id: _kfp_call(run_folders, client, run_id, root)}
        folders = [folder for found in runs.values() for folder in found]
        if waiting := _kfp_call(waiting_continuations, client, connection.namespace, folders):
            which = (
                f"run {run_id} and the {len(runs) - 1} run(s) before it are" if len(runs) > 1 else f"run {run_id} is"
            )
            raise click.ClickException(
                f"{which} kept: runs that go on from them have not finished their prepare task: "
                f"{', '.join(waiting)}; clean once they have, or delete them in KFP first"
            )
        surveys = {run: [survey(f, everything) for f in found if only in (None, f.kind)] for run, found in runs.items()}
        for run, found_in_run in surveys.items():
            if len(runs) > 1:
                click.echo(f"run {run}:")
            for found in found_in_run:
                size = f"{len(found.keys)} objects, {found.size / 1e9:.2f} GB"
                click.echo(f"{KINDS[found.folder.kind]}: {found.folder.uri}: {size}")
                if yes and found.keys:
                    delete(found)
                    click.echo("  deleted")
    except (StoreError, ValueError) as e:
        raise click.ClickException(str(e)) from None
    if not yes:
        click.echo("nothing deleted: add --yes to delete them (the run can then be neither retried nor continued)")


@main.command("delete-metrics")
@click.option("--pushgateway", required=True, help="Pushgateway URL (http://host:9091).")
@click.option("--pipeline", required=True, help="The run config's name (the metrics' pipeline label).")
@click.option("--run-id", required=True, help="The KFP run ID (the metrics' run_id label).")
@click.option("--job", default="tracefp4", show_default=True, help="The metrics' job label (metrics.job).")
def delete_metrics(pushgateway, pipeline, run_id, job):
    """Delete every metrics group one run pushed to a Pushgateway."""
    from tracefp4.components.metrics import delete_run

    try:
        deleted = delete_run(pushgateway, job, pipeline, run_id)
    except (OSError, ValueError) as e:  # unreachable, or not a URL
        raise click.ClickException(f"pushgateway {pushgateway}: {getattr(e, 'reason', e)}") from None
    click.echo(f"deleted {deleted} group(s)")
    if not deleted:
        _warn(
            f"no metrics group of job {job}, pipeline {pipeline}, run {run_id} on {pushgateway}: check --pipeline "
            "(the run config's name), --run-id (the KFP run ID) and --job"
        )


if __name__ == "__main__":
    sys.exit(main())
