"""Run the DAG on this machine with kfp.local: every component a subprocess
of this Python, artifacts under the output folder, the store a local folder
unless the config names S3."""

import contextlib
import warnings
from pathlib import Path

import kfp.local

from tracefp4.schemas import RunConfig

from .pipeline import build_pipeline


def localize(config: RunConfig, output: Path) -> RunConfig:
    """A relative ``file://`` store becomes a folder of the run's output."""
    uri = config.store.uri
    if uri.startswith("file://") and not uri.startswith("file:///"):
        uri = (output / uri.removeprefix("file://")).resolve().as_uri()
    return config.model_copy(update={"store": config.store.model_copy(update={"uri": uri})})


def run_local(config: RunConfig, output: Path, log: Path | None = None) -> Path:
    """Run the whole pipeline; returns the report's path. With ``log``, the
    components' streamed logs go to that file instead of standard output."""
    output = Path(output).resolve()
    output.mkdir(parents=True, exist_ok=True)
    config = localize(config, output)
    kfp.local.init(runner=kfp.local.SubprocessRunner(use_venv=False), pipeline_root=str(output / "pipeline_root"))
    with contextlib.ExitStack() as stack:
        if log is not None:
            stack.enter_context(contextlib.redirect_stdout(stack.enter_context(open(log, "w"))))
        stack.enter_context(warnings.catch_warnings())  # resources and image are for the cluster: no-ops here
        warnings.simplefilter("ignore", UserWarning)
        warnings.simplefilter("ignore", RuntimeWarning)
        task = build_pipeline(config)()
    return Path(task.output.path)
