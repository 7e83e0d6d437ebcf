"""Run the DAG on this machine with kfp.local: every component a subprocess
of this Python, artifacts under the output folder, the store a local folder
unless the config names S3."""

import contextlib
import re
import threading
import warnings
from pathlib import Path

import kfp.local
from tqdm import tqdm

from tracefp4.schemas import RunConfig

from .pipeline import build_comparison_pipeline, build_pipeline


def localize(config: RunConfig, output: Path) -> RunConfig:
    """A relative ``file://`` store becomes a folder of the run's output, a relative metrics file a file in it."""
    uri = config.store.uri
    if uri.startswith("file://") and not uri.startswith("file:///"):
        uri = (output / uri.removeprefix("file://")).resolve().as_uri()
    metrics_file = str((output / config.metrics.metrics_file).resolve())
    return config.model_copy(update={"store": config.store.model_copy(update={"uri": uri}),
                                     "metrics": config.metrics.model_copy(update={"metrics_file": metrics_file})})  # fmt: skip


def task_count(config: RunConfig, methods: list[str] | None = None) -> int:
    """Tasks of the DAG: prepare, 3 per round, evaluate, report; per method (plus
    the method switch) and one collecting report for a comparison."""
    if methods:
        return len(methods) * (3 * config.rl.rounds + 4) + 1
    return 3 * config.rl.rounds + 3


class _Progress(threading.Thread):
    """A progress bar over the DAG's tasks, driven by the log file kfp.local writes."""

    def __init__(self, log: Path, total: int):
        super().__init__(daemon=True)
        self.log, self.bar, self.done = log, tqdm(total=total, unit="task", desc="pipeline"), threading.Event()

    def run(self):
        while not self.done.wait(0.5):
            self._update()
        self._update()
        self.bar.close()

    def _update(self):
        text = self.log.read_text(errors="replace") if self.log.exists() else ""
        finished = len(re.findall(r"Task .* finished with status", text))
        running = re.findall(r"Executing task \S*?'([^']+)'", text)
        self.bar.n = finished
        self.bar.set_postfix_str(running[-1] if running and finished < self.bar.total else "")
        self.bar.refresh()


def run_local(config: RunConfig, output: Path, log: Path | None = None, methods: list[str] | None = None) -> Path:
    """Run the whole pipeline (with ``methods``, the comparison pipeline);
    returns the report's path. With ``log``, the components' streamed logs go
    to that file instead of standard output."""
    output = Path(output).resolve()
    output.mkdir(parents=True, exist_ok=True)
    config = localize(config, output)
    kfp.local.init(runner=kfp.local.SubprocessRunner(use_venv=False), pipeline_root=str(output / "pipeline_root"))
    with contextlib.ExitStack() as stack:
        if log is not None:
            stack.enter_context(contextlib.redirect_stdout(stack.enter_context(open(log, "w", buffering=1))))
            progress = _Progress(Path(log), task_count(config, methods))
            progress.start()
            stack.callback(progress.join)
            stack.callback(progress.done.set)
        stack.enter_context(warnings.catch_warnings())  # resources and image are for the cluster: no-ops here
        warnings.simplefilter("ignore", UserWarning)
        warnings.simplefilter("ignore", RuntimeWarning)
        task = (build_comparison_pipeline(config, methods) if methods else build_pipeline(config))()
    return Path(task.output.path)
