"""The ``tracefp4`` command: run the pipeline here, bootstrap a base policy,
compile the pipeline for a cluster and submit it, export the config's JSON
Schema and the Grafana dashboards, list presets, show a run's report, delete a
run's metrics from a Pushgateway."""

import sys
from pathlib import Path

import click

from tracefp4.schemas import PRESETS, ConfigError, export_json_schema, load_config


def _config(preset: str | None, config_file: str | None, store: str | None = None, pushgateway: str | None = None):
    overrides = {key: value for key, value in {"store.uri": store, "metrics.pushgateway_url": pushgateway}.items() if value}
    try:
        return load_config(config_file, preset=preset or (None if config_file else "tiny"), overrides=overrides or None)
    except ConfigError as e:
        raise click.ClickException(str(e)) from None


preset_option = click.option("--preset", type=click.Choice(sorted(PRESETS)), help="Named configuration (default: tiny).")
config_option = click.option("--config", "config_file", type=click.Path(exists=True, dir_okay=False), help="YAML or JSON run config.")


def _methods(ctx, param, value: str | None) -> list[str] | None:
    """--compare's comma-separated methods, each known and named once."""
    from tracefp4.pipelines.pipeline import check_methods

    if value is None:
        return None
    try:
        return check_methods([m.strip() for m in value.split(",")])
    except ValueError as e:
        raise click.BadParameter(str(e), ctx=ctx, param=param) from None


compare_option = click.option(
    "--compare", "methods", callback=_methods, help="Comma-separated methods side by side (e.g. trace,qat,bf16)."
)


@click.group(help=__doc__)
def main():
    pass


@main.command()
@preset_option
@config_option
@click.option("--output", type=click.Path(file_okay=False), default="runs/latest", show_default=True, help="Run folder.")
@click.option("--store", help="Artifact store URI for guidance and checkpoints (file://..., s3://bucket/prefix).")
@click.option("--verbose", is_flag=True, help="Stream every component's log (it also goes to <output>/pipeline.log).")
@compare_option
@click.option("--pushgateway", help="Also push the metrics to this Pushgateway (http://host:9091).")
@click.option("--restart", is_flag=True, help="Start a new run in the folder instead of resuming its last one.")
def run(preset, config_file, output, store, verbose, methods, pushgateway, restart):
    """Run the whole DAG on this machine (kfp.local), then print the results and the report's path.

    A rerun with the same config and output resumes: finished tasks are reused, not rerun."""
    from tracefp4.pipelines.local import Interrupted, PipelineFailed, run_local

    config = _config(preset, config_file, store, pushgateway)
    output = Path(output)
    click.echo(f"running {config.name}: {config.rl.rounds} round(s) of {config.rl.steps_per_round} step(s), "
               f"method {', '.join(methods or [config.method])}; component logs in {output / 'pipeline.log'}")
    try:
        report = run_local(config, output, methods=methods, verbose=verbose, restart=restart)
    except PipelineFailed as e:
        raise click.ClickException(str(e)) from None
    except Interrupted as e:
        click.echo(f"{e}: the running component was stopped; rerun the same command to resume", err=True)
        sys.exit(128 + e.signum)
    click.echo(report.read_text())
    click.echo(f"report: {report.with_name('page')} (HTML), {report} (markdown)")


@main.command()
@preset_option
@config_option
@click.option("--output", type=click.Path(file_okay=False), required=True, help="Folder of the bootstrapped checkpoint.")
def bootstrap(preset, config_file, output):
    """SFT of the config's initial policy on its tasks (the config's bootstrap settings, enabled); a Hugging Face checkpoint."""
    from tracefp4.components.steps import prepare

    config = _config(preset, config_file)
    config.bootstrap.enabled = True
    stats = prepare(config, Path(output))
    click.echo(f"{output}: {stats['bootstrap_steps']} SFT steps in {stats['bootstrap_seconds']:.0f} s, "
               f"greedy test accuracy {stats['bootstrap_accuracy']:.1%}")  # fmt: skip


@main.command()
@preset_option
@config_option
@click.option("--output", type=click.Path(dir_okay=False), required=True, help="Where to write the KFP IR YAML.")
@compare_option
def compile(preset, config_file, output, methods):
    """Compile the pipeline (or with --compare the comparison pipeline) to KFP IR YAML (upload it in the KFP UI)."""
    from tracefp4.pipelines.pipeline import compile_pipeline, pipeline_version

    config = _config(preset, config_file)
    compile_pipeline(config, output, methods)
    name = f"tracefp4-{config.name}" + ("-compare" if methods else "")
    click.echo(f"{output}: pipeline {name}, version {pipeline_version()}")


@main.command()
@preset_option
@config_option
@click.option("--host", required=True, envvar="KF_PIPELINES_ENDPOINT", help="KFP UI/API URL, e.g. http://localhost:8080 (env KF_PIPELINES_ENDPOINT).")
@click.option("--experiment", default="tracefp4", show_default=True, help="KFP experiment to file the run under.")
@click.option("--namespace", help="User namespace of a multi-user Kubeflow deployment.")
@click.option("--store", help="Artifact store URI for guidance and checkpoints (s3://bucket/prefix; the pods share it).")
@click.option("--service-account", help="Service account of the run's pods (e.g. tracefp4-pipeline-runner).")
def submit(preset, config_file, host, experiment, namespace, store, service_account):
    """Upload the pipeline (or a new version) to a KFP server and start a run (token: env KF_PIPELINES_TOKEN)."""
    from tracefp4.pipelines.submit import SubmitError
    from tracefp4.pipelines.submit import submit as submit_run

    config = _config(preset, config_file, store)
    if config.store.uri.startswith("file://"):
        click.echo(f"warning: store {config.store.uri} is local to each pod; use --store s3://... on a cluster", err=True)
    try:
        result = submit_run(config, host, experiment, namespace=namespace, service_account=service_account)
    except SubmitError as e:
        raise click.ClickException(str(e)) from None
    click.echo(f"pipeline {result['pipeline_id']}, version {result['pipeline_version_id']}, "
               f"experiment {result['experiment_id']}, run {result['run_id']}")  # fmt: skip
    click.echo(result["run_url"])


@main.command()
@click.option("--output", type=click.Path(file_okay=False), default="schemas", show_default=True)
def schema(output):
    """Write the run config's JSON Schema."""
    for path in export_json_schema(output):
        click.echo(path)


@main.command()
@click.option("--output", type=click.Path(file_okay=False), default="manifests/base/grafana/dashboards", show_default=True)
def dashboards(output):
    """Write the Grafana dashboard JSON (built from the run metrics)."""
    try:
        from tracefp4.pipelines.dashboards import write
    except ImportError as e:
        raise click.ClickException(f"{e}: the dashboards need the dev extras (pip install -e '.[dev]')") from None

    click.echo(write(output))


@main.command()
def presets():
    """List the named configurations."""
    for name, config in sorted(PRESETS.items()):
        model = config.model.preset or config.model.checkpoint
        click.echo(f"{name:22} model {model}, {config.rollout.config} ({config.rollout.fmt}), method {config.method}, "
                   f"{config.rl.rounds}x{config.rl.steps_per_round} steps")  # fmt: skip


@main.command()
@click.argument("run_dir", type=click.Path(exists=True, file_okay=False))
def report(run_dir):
    """Print the newest report of a run folder."""
    found = sorted(Path(run_dir).glob("pipeline_root/*/report/markdown"), key=lambda p: p.stat().st_mtime)
    if not found:
        raise click.ClickException(f"no report under {run_dir}/pipeline_root")
    click.echo(found[-1].read_text())
    click.echo(f"report: {found[-1].with_name('page')} (HTML), {found[-1]} (markdown)")


@main.command("delete-metrics")
@click.option("--pushgateway", required=True, help="Pushgateway URL (http://host:9091).")
@click.option("--pipeline", required=True, help="The run config's name (the metrics' pipeline label).")
@click.option("--run-id", required=True, help="The KFP run ID (the metrics' run_id label).")
@click.option("--job", default="tracefp4", show_default=True, help="The metrics' job label (metrics.job).")
def delete_metrics(pushgateway, pipeline, run_id, job):
    """Delete every metrics group one run pushed to a Pushgateway."""
    from tracefp4.components.metrics import delete_run

    click.echo(f"deleted {delete_run(pushgateway, job, pipeline, run_id)} group(s)")


if __name__ == "__main__":
    sys.exit(main())
