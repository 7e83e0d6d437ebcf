"""Run the DAG on this machine with kfp.local: every component a subprocess
of this Python, artifacts under the output folder, the store a local folder
unless the config names S3.

Nothing silent, nothing lost:

- every component's log is appended to ``<output>/pipeline.log`` without
  kfp's colour codes (``verbose`` also echoes it);
- a failed component ends the run at once (no retries: locally a failure is
  deterministic) with :class:`PipelineFailed`, which names the component and
  holds the last lines of its own log;
- SIGINT or SIGTERM stops the running component and its children before the
  runner raises :class:`Interrupted` (kfp.local starts them in this process's
  group, so a signal sent to this process alone would leave them writing);
  SIGKILL stops nothing, and the running component, which holds the
  folder's lock too (:func:`.resume.hold_folder_lock`), keeps a rerun out
  of the folder until it has ended;
- a rerun of the same folder resumes after the last completed task
  (:mod:`.resume`).
"""

import builtins
import contextlib
import ctypes
import functools
import itertools
import json
import logging
import os
import re
import signal
import sys
import textwrap
import threading
import time
import warnings
from pathlib import Path
from typing import NamedTuple

import kfp.local
from tqdm import tqdm

from tracefp4.components.checkpoint import (
    MANIFEST,
    CheckpointError,
    check_weights,
    fetch,
    local_folder,
    provenance,
    read_policy_folder,
)
from tracefp4.components.device import resolve
from tracefp4.components.metrics import PUBLISH_FAILED
from tracefp4.components.steps import check_policy_fits, steps_environment, warn_of_checkpoint_dtype
from tracefp4.components.store import file_path, open_store, write_atomic
from tracefp4.components.tasks import reward_parts
from tracefp4.components.tokenizer import TokenizerError
from tracefp4.schemas import ConfigError, RunConfig, continuation

from . import resume
from .parameters import check_drawable, pin_problems
from .pipeline import build_comparison_pipeline, build_pipeline

ANSI = re.compile(r"\x1b\[[0-?]*[ -/]*[@-~]")
# kfp.local's own log lines (colour codes stripped) and the bootstrap's (components/bootstrap.py)
EXECUTING = re.compile(r"Executing task '([^']+)'")
FINISHED = re.compile(r"Task '([^']+)' finished with status (\w+)")
CACHE_HIT = re.compile(r"Task \S+ cache hit")
BOOTSTRAP = re.compile(r"bootstrap step (\d+)/(\d+)")
LOG = "pipeline.log"  # a run's log in its folder, every component's output
# in the error kfp.local raises for a loop's task, and in the folder of each iteration's tasks
LOOP_ITERATION = re.compile(r"for-loop-\d+-iteration-(\d+)")
TAIL_LINES = 15
SIGNALS = (signal.SIGINT, signal.SIGTERM)
# a signal this soon after the first is the same one delivered twice: GNU timeout signals the command, then its
# process group, which holds the command too
SAME_SIGNAL_S = 1.0
# prctl options (linux/prctl.h): a subreaper becomes the parent of the orphans below it, where init would
_PR_SET_CHILD_SUBREAPER, _PR_GET_CHILD_SUBREAPER = 36, 37
# a report task's artifacts (KFP names them, without an extension) -> their copies in the run folder, named so that
# a browser opens the page as HTML from file:// (it shows a file without an extension as text)
REPORT_COPIES = {"page": "report.html", "markdown": "report.md"}
# beside a report task's artifacts: the run they are of (record_report)
REPORT_RUN = "run.json"


class PipelineFailed(Exception):
    """A component exited non-zero: which one (and in a comparison, of which
    method), the last lines of its log, and the whole log's path."""

    def __init__(self, task: str, tail: list[str], log: Path, method: str | None = None):
        self.task, self.tail, self.log, self.method = task, tail, log, method
        lines = "\n".join("  " + line for line in tail)
        which = f"component {task}" + (f" of method {method}" if method else "")
        super().__init__(f"{which} failed; the end of its log:\n{lines}\nfull log: {log}")


class Interrupted(BaseException):
    """SIGINT/SIGTERM stopped the run (a BaseException, like KeyboardInterrupt,
    so that no ``except Exception`` in kfp.local swallows it)."""

    def __init__(self, signum: int):
        self.signum = signum
        super().__init__(f"interrupted by {signal.Signals(signum).name}")


def localize(config: RunConfig, output: Path) -> RunConfig:
    """A relative ``file://`` store becomes a folder of the run's output, a
    relative metrics file a file in it; every round runs in this one run
    (``rl.rounds_per_run`` splits a schedule into a chain of cluster runs, whose
    size KFP bounds; a local run has no such bound); and the settings that only
    shape a cluster run's pods (:data:`~tracefp4.schemas.config.CLUSTER_ONLY`)
    are left at their defaults (:meth:`~tracefp4.schemas.RunConfig.without_cluster_only`):
    a rerun that changes one (the image, a pod's memory) resumes, every finished
    task reused, and ``store.ca_bundle_secret`` unset points no step at a file
    that is not here (they trust what this process's SSL_CERT_FILE says). A
    relative path of a checkpoint, trainer state, problem or reward file
    becomes absolute, as the steps read it from here: the report's settings
    then read back to the same run from any folder."""
    config = config.without_cluster_only()
    uri = config.store.uri
    if uri.startswith("file://") and not (path := file_path(uri)).is_absolute():
        uri = (output / path).resolve().as_uri()
    metrics_file = str((output / config.metrics.metrics_file).resolve())
    model = {field: _absolute(getattr(config.model, field)) for field in ("checkpoint", "trainer_state")}
    tasks = [
        t.model_copy(update={"data": _absolute(t.data), "reward": _absolute_reward(t.reward)}) for t in config.tasks
    ]
    return config.model_copy(
        update={
            "store": config.store.model_copy(update={"uri": uri}),
            "metrics": config.metrics.model_copy(update={"metrics_file": metrics_file}),
            "rl": config.rl.model_copy(update={"rounds_per_run": 0}),
            "model": config.model.model_copy(update=model),
            "tasks": tasks,
        }
    )


def unlike_the_run_it_continues(run_dir: Path, config: RunConfig, output: Path) -> list[str]:
    """What ``config``, a continuation of the newest run of the local run
    folder ``run_dir`` (:func:`continuation_of`), asks otherwise than that run
    was asked (its request in the folder's run.json), leaving out what a
    continuation changes itself and where each run keeps its own store and
    metrics: a setting the run was given and this one is not (``model.dtype``,
    say) would change as the run goes on. Empty for a folder whose run.json
    holds no requests (an earlier tracefp4's)."""
    run = provenance(Path(config.model.trainer_state))["run_id"]
    record = json.loads((Path(run_dir) / resume.RUN_FILE).read_text())
    asked = record.get("requests", {}).get(next((d for d, r in record["runs"].items() if r == run), None))
    if asked is None:
        return []
    own = {**continuation("", "", 0), "store.uri": None, "metrics.metrics_file": None}
    settings = []
    for data in (json.loads(asked["settings"]), localize(config, output).model_dump(mode="json")):
        for path in own:
            *parents, key = path.split(".")
            functools.reduce(dict.get, parents, data).pop(key, None)
        for task, key in itertools.product(data["tasks"], ("sha256", "reward_sha256")):  # pinned as a run starts
            task.pop(key, None)
        settings.append({"settings": json.dumps(data)})
    return resume.changes(*settings)


def _absolute(location: str | None) -> str | None:
    """A path made absolute (from this process's folder, which the steps read it from) and normal: a trailing
    ``/`` was another request of the same folder, a new run. A URI or None as it is."""
    return location if location is None or "://" in location else os.path.abspath(location)


def _absolute_reward(reward: str | None) -> str | None:
    """A task's ``reward``, FILE.py:FUNCTION, with its file's path :func:`_absolute`."""
    if reward is None:
        return None
    source, function = reward_parts(reward)
    return f"{_absolute(source)}:{function}"


def continuation_of(run_dir: Path, steps_per_round: int, method: str | None = None) -> dict:
    """The settings (dotted paths) of a run that goes on from the newest run
    in the local run folder ``run_dir``, at ``steps_per_round`` steps a round:
    that run's last train task's ``new_policy`` and ``new_trainer_state``, and
    the rounds they end (its policy version, which runs that continue one
    another count on). A comparison's run ended with a last state per method,
    and a continuation goes on with one: ``method``'s (its train task's history
    names it), refused where none or another is named. Only a train
    task that finished counts: one stopped after its state was committed
    (before its metrics were written, say) ran again when the run resumed,
    into a folder of its own, and left a state no later round went on from."""
    # a comparison's train tasks lie a folder deeper, in their loop iteration's
    finished = resume.finished_outputs(run_dir)
    root = Path(run_dir, resume.PIPELINE_ROOT).resolve()
    states = [
        s for s in root.glob("**/train*/new_trainer_state") if resume.PIPELINE_ROOT / s.relative_to(root) in finished
    ]
    saved = {state: found for state in states if (found := provenance(state))}  # committed: its manifest written
    if not saved:
        raise ValueError(
            f"{run_dir}: no train task of a run finished there (pipeline_root/**/train*/new_trainer_state): name "
            "the --output of a `tracefp4 run` that trained"
        )
    run = saved[max(saved, key=lambda state: (state / MANIFEST).stat().st_mtime)]["run_id"]
    version = max(found["policy_version"] for found in saved.values() if found["run_id"] == run)
    last = [state for state, found in saved.items() if found == {"run_id": run, "policy_version": version}]
    if len(last) > 1:
        by_method = {_trained_method(state): state for state in last}
        if method not in by_method:
            named = f" ({method} is none of them)" if method else ""
            raise ValueError(
                f"{run_dir}: run {run} ended with {len(last)} trainer states, one per method of a comparison "
                f"({', '.join(sorted(map(str, by_method)))}): continue one, naming it (--set method=...){named}"
            )
        last = [by_method[method]]
    if version % steps_per_round:
        raise ValueError(
            f"{last[0]}: policy version {version} is no whole number of rounds of rl.steps_per_round {steps_per_round}"
            " (this config's, not the run's?): go on with the --preset, --config and --set the run was started with"
        )
    return continuation(str(last[0].with_name("new_policy")), str(last[0]), version // steps_per_round)


def _trained_method(state: Path) -> str | None:
    """The method whose train task wrote the trainer state ``state``: its history's (beside it) first step's."""
    with contextlib.suppress(OSError, ValueError, AttributeError):
        with open(state.with_name("history")) as history:
            return json.loads(history.readline()).get("method")
    return None


def ran_to_its_end(run_dir: Path, trainer_state: str) -> bool:
    """Whether the run whose last train task wrote ``trainer_state`` in the
    local run folder ``run_dir`` ran to its end: a report finished after that
    state was committed (an interrupted run's last state is where it stopped)."""
    committed = (Path(trainer_state) / MANIFEST).stat().st_mtime
    return any(report.stat().st_mtime >= committed for report in resume.finished_reports(run_dir))


def task_count(config: RunConfig, methods: list[str] | None = None) -> int:
    """Tasks of the DAG: configure; prepare, 3 per round (with N rollout
    workers N + 4: the workers' list, N rollouts, gather), export, evaluate,
    report; per method (its own configure) and one collecting report for a comparison."""
    workers = config.rollout.workers
    per_round = 3 if workers == 1 else workers + 4
    if methods:
        return 1 + len(methods) * (per_round * config.rl.rounds + 5) + 1
    return 1 + per_round * config.rl.rounds + 4


def where_it_stopped(text: str) -> str | None:
    """Where the last run that wrote the log ``text`` stopped short of its end, if it did: the task that
    failed, or the one running when it was stopped."""
    started, finished = list(EXECUTING.finditer(text)), list(FINISHED.finditer(text))
    if started and (not finished or finished[-1].start() < started[-1].start()):
        return f"task {started[-1].group(1)!r} was running when it was stopped"
    if finished and finished[-1].group(2) != "SUCCESS":
        return f"task {finished[-1].group(1)!r} ended with status {finished[-1].group(2)}"
    return None


def progress_state(text: str) -> tuple[int, str | None, tuple[int, int] | None]:
    """From a run's log: tasks done (run or reused), the running task, and its bootstrap step (step, steps) if any."""
    done = sum(m.group(2) == "SUCCESS" for m in FINISHED.finditer(text)) + len(CACHE_HIT.findall(text))
    started = list(EXECUTING.finditer(text))
    ended = [m.start() for m in FINISHED.finditer(text)]
    if not started or (ended and ended[-1] > started[-1].start()):
        return done, None, None
    steps = BOOTSTRAP.findall(text, started[-1].end())
    return done, started[-1].group(1), tuple(map(int, steps[-1])) if steps else None


def failed_task(text: str) -> tuple[str, list[str]] | None:
    """The first failed task of a run's log (the tasks running beside it are
    stopped then, and fail too) and the last lines of its own streamed log
    (kfp.local's lines left out), from its last traceback where it has one
    (a short traceback's tail opened with the end of kfp's executor input)."""
    failures = [m for m in FINISHED.finditer(text) if m.group(2) != "SUCCESS"]
    if not failures:
        return None
    task, end = failures[0].group(1), failures[0].start()
    section = text[text.rfind(f"Executing task '{task}'", 0, end) : end]
    # kfp indents a component's lines by 4, and by 4 more inside a loop's iteration
    streamed = textwrap.dedent("\n".join(line for line in section.splitlines() if line.startswith("    ")))
    streamed = streamed.splitlines()
    while streamed and not streamed[-1].strip():
        streamed.pop()
    streamed = _without_kfp_frames(streamed)
    tracebacks = [i for i, line in enumerate(streamed) if line.startswith("Traceback (most recent call last)")]
    return task, streamed[tracebacks[-1] if tracebacks else 0 :][-TAIL_LINES:]


def failed_method(error: str, methods: list[str] | None) -> str | None:
    """The comparison's method whose task failed, from kfp.local's error, which
    names the loop iterations it failed inside, innermost first: the last is
    the methods' loop (a rollout worker's is inside it)."""
    iterations = LOOP_ITERATION.findall(error)
    return methods[int(iterations[-1])] if methods and iterations else None


def _without_kfp_frames(lines: list[str]) -> list[str]:
    """A traceback's frames in kfp's executor say nothing about the component's error: dropped."""
    kept, skipping = [], False
    for line in lines:
        if line.startswith('  File "'):
            skipping = "/kfp/" in line
        elif not line.startswith("    "):
            skipping = False
        if not skipping:
            kept.append(line)
    return kept


class _Log:
    """The components' stream (standard output during the run): appended to
    the log file without colour codes, echoed to ``echo`` when given."""

    def __init__(self, path: Path, echo=None):
        self.path, self.echo = path, echo
        self.file = open(path, "a", buffering=1, encoding="utf-8", errors="replace")
        self.start = self.file.tell()
        self.lost: OSError | None = None  # why the log stopped being written (a full disk), if it did

    def write(self, text: str) -> int:
        self._to_file(lambda: self.file.write(ANSI.sub("", text)))
        if self.echo:
            self.echo.write(text)
        return len(text)

    def flush(self):
        self._to_file(self.file.flush)
        if self.echo:
            self.echo.flush()

    def _to_file(self, act) -> None:
        """``act`` on the log file until it fails once (a full disk): from then
        on the stream goes to ``echo`` alone, said once on standard error,
        rather than failing each component's every line (it is kfp's stdout)."""
        if self.lost is not None:
            return
        try:
            act()
        except OSError as e:
            self.lost = OSError(e.errno, f"{e.strerror}; the components' log stopped there", str(self.path))
            print(f"tracefp4: {self.path}: {self.lost.strerror}", file=sys.stderr, flush=True)

    def text(self) -> str:
        """This run's part of the log (earlier attempts' parts come before it)."""
        with open(self.path, encoding="utf-8", errors="replace") as f:
            f.seek(self.start)
            return f.read()


class _Progress(threading.Thread):
    """Tasks done, the running one and the bootstrap's steps, read from the
    log: a tqdm bar on a terminal, else a plain line whenever that changes
    (the bootstrap in tenths), never carriage-return redraws into a file."""

    def __init__(self, log: _Log, total: int, out):
        super().__init__(daemon=True)
        self.log, self.total, self.out, self.done = log, total, out, threading.Event()
        self.bar = tqdm(total=total, unit="task", desc="pipeline", file=out) if out.isatty() else None
        self.last = None

    def run(self):
        while not self.done.wait(0.5):
            self._update()
        self._update()
        if self.bar is not None:
            self.bar.close()

    def _update(self):
        done, running, boot = progress_state(self.log.text())
        detail = (running or "") + (f" (bootstrap step {boot[0]}/{boot[1]})" if boot else "")
        if self.bar is not None:
            self.bar.n = done
            self.bar.set_postfix_str(detail)
            return
        key = (done, running, boot and boot[0] * 10 // boot[1])
        if key != self.last:
            self.last = key
            line = f"pipeline: {done}/{self.total} tasks" + (f", running {detail}" if running else "")
            self.out.write(line + "\n")  # not print: kfp.local indents print's lines while a component runs
            self.out.flush()


@contextlib.contextmanager
def _kfp_local_swaps_undone():
    """``builtins.print`` and the root logger's handlers and level as they were
    before the run, after it. While a component runs kfp.local swaps each (a
    print wrapper that indents; its own handler at INFO, bound to the stdout of
    the moment, the run's log) and then restores what it found: two loop
    iterations at once restore each other's, and one of them stays. A process
    that runs on (a notebook, the tests) would indent every later print, and
    hand every later log line to a handler whose stream, the run's log, is
    closed: a 'Logging error' each time."""
    root = logging.getLogger()
    printer, handlers, level = builtins.print, list(root.handlers), root.level
    try:
        yield
    finally:
        builtins.print = printer
        for handler in [h for h in root.handlers if h not in handlers]:
            root.removeHandler(handler)
        for handler in handlers:
            root.addHandler(handler)  # none twice: addHandler adds only what is not there
        root.setLevel(level)


@contextlib.contextmanager
def _logging_to(stream):
    """The root logger at INFO into ``stream`` for the run, as kfp.local's log contexts set it."""
    root, handler = logging.getLogger(), logging.StreamHandler(stream)
    handler.setFormatter(logging.Formatter("%(asctime)s - %(levelname)s - %(message)s"))
    level = root.level
    root.addHandler(handler)
    root.setLevel(logging.INFO)
    try:
        yield
    finally:
        root.removeHandler(handler)
        root.setLevel(level)


def _descendants(pid: int) -> list[int]:
    """Every process below ``pid`` (Linux /proc), children before grandchildren."""
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            ppid = int(stat.read_text().rsplit(")", 1)[1].split()[1])  # after "pid (comm)": state, ppid
        except (OSError, IndexError, ValueError):
            continue  # exited meanwhile
        children.setdefault(ppid, []).append(int(stat.parent.name))
    found, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(0), []):
            found.append(child)
            todo.append(child)
    return found


def _alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] not in "ZX"
    except (OSError, IndexError):
        return False


def _stop(pids: list[int], grace: float = 10.0) -> None:
    """SIGTERM, then SIGKILL for whatever still runs after ``grace`` seconds."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, sig)
        deadline = time.monotonic() + grace
        while any(map(_alive, pids)) and time.monotonic() < deadline:
            time.sleep(0.05)
        pids = [p for p in pids if _alive(p)]
        if not pids:
            return


@contextlib.contextmanager
def warnings_to(out):
    """What tracefp4 warns of while the block runs, said on ``out`` as
    ``warning: ...`` (where Python's handler of last resort would print the
    bare message on standard error, in a command whose other lines are on ``out``)."""
    handler = logging.StreamHandler(out)
    handler.setLevel(logging.WARNING)
    handler.format = lambda record: f"{record.levelname.lower()}: {record.getMessage()}"
    logger = logging.getLogger("tracefp4")
    logger.addHandler(handler)
    try:
        yield
    finally:
        logger.removeHandler(handler)


@contextlib.contextmanager
def _adopting_orphans():
    """Make this process the parent of the processes orphaned below it while
    the block runs (Linux; elsewhere nothing changes), so that
    :func:`_descendants` still finds them. A component runs under ``sh``: sh
    stopped as it forks leaves the component running, on the run folder's
    lock, and under init it would be out of reach. An adopted one that exits
    stays a zombie until this process ends (it holds no file, nor the lock)."""
    libc = ctypes.CDLL(None) if sys.platform == "linux" else None
    if libc is None:
        yield
        return
    was = ctypes.c_int()
    libc.prctl(_PR_GET_CHILD_SUBREAPER, ctypes.byref(was), 0, 0, 0)
    libc.prctl(_PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)
    try:
        yield
    finally:
        libc.prctl(_PR_SET_CHILD_SUBREAPER, was.value, 0, 0, 0)


@contextlib.contextmanager
def _stop_components(log: _Log):
    """SIGINT/SIGTERM: stop the processes started inside (the running
    components), then raise :class:`Interrupted`; a second signal (not one
    within :data:`SAME_SIGNAL_S` of the first) acts as it did before, for a
    user who will not wait for the components to stop. After the signal, or
    once a component failed (``log`` says so), stop whatever starts until the
    block ends: kfp.local runs a loop's iterations (a comparison's methods,
    rollout workers) two at a time and starts the queued ones before it
    raises. Where the block ends early, whatever is left below this process is
    stopped, orphans included (:func:`_adopting_orphans`)."""
    before = set(_descendants(os.getpid()))
    stopping, ended = threading.Event(), threading.Event()

    def started() -> list[int]:
        return [p for p in _descendants(os.getpid()) if p not in before]

    def stop_what_starts():
        while not ended.wait(0.5):
            if not stopping.is_set() and any(m.group(2) != "SUCCESS" for m in FINISHED.finditer(log.text())):
                stopping.set()
            if stopping.is_set():
                _stop(started())

    def handler(signum, frame):
        first = time.monotonic()

        def again(signum, frame):
            if time.monotonic() - first > SAME_SIGNAL_S:
                for s, h in previous.items():
                    signal.signal(s, h)
                signal.raise_signal(signum)

        for s in previous:
            signal.signal(s, again)
        stopping.set()
        _stop(started())
        raise Interrupted(signum)

    previous = {s: signal.signal(s, handler) for s in SIGNALS}
    watcher = threading.Thread(target=stop_what_starts, daemon=True)
    watcher.start()
    try:
        with _adopting_orphans():
            try:
                yield
            except BaseException:
                stopping.set()  # the run ends early: nothing it started goes on
                raise
            finally:
                ended.set()
                watcher.join()
                if stopping.is_set():  # what started, or was orphaned, since the watcher's last look
                    _stop(started())
    finally:
        for s, h in previous.items():
            signal.signal(s, h)


def publish_report(report: Path, run_dir: Path) -> tuple[Path, Path]:
    """The report whose markdown artifact is ``report`` (its page beside it)
    copied into the run folder ``run_dir`` as :data:`REPORT_COPIES`, each
    replaced whole (never a page half of one report and half of another):
    the paths of the page and the markdown, files to open."""
    copies = tuple(Path(run_dir) / name for name in REPORT_COPIES.values())
    for artifact, copy in zip(REPORT_COPIES, copies):
        data = report.with_name(artifact).read_bytes()
        write_atomic(copy, lambda f, data=data: f.write(data))
    return copies


def serving_exports(run_dir: Path, run_id: str, methods: list[str] | None = None) -> dict[str | None, Path]:
    """The checkpoints for serving that the ``export`` tasks of the run
    ``run_id`` wrote in the local run folder ``run_dir`` and finished: a run's
    one (key None), a comparison's one per method of ``methods`` (each in its
    loop iteration's folder). A resumed run's export may lie in an earlier
    attempt's folder, and a folder may hold other runs' exports: each is known
    by its run id (its policy's provenance)."""
    finished = resume.finished_outputs(run_dir)
    root = Path(run_dir, resume.PIPELINE_ROOT)
    found = {}
    for path in sorted(root.glob("**/export/exported")):
        relative = path.relative_to(root)
        if resume.PIPELINE_ROOT / relative in finished and provenance(path).get("run_id") == run_id:
            iteration = LOOP_ITERATION.search(str(relative))
            found[methods[int(iteration[1])] if methods and iteration else None] = path
    return found


def record_report(report: Path, run_id: str, methods: list[str] | None) -> None:
    """Write beside the report whose markdown artifact is ``report`` the run it
    is of, ``run_id`` (a comparison's with its ``methods``), for
    :func:`report_exports`: no artifact says it otherwise. A report task resumed
    alone (its run stopped while it ran) runs in an attempt's folder of its own,
    holding none of that run's other outputs, and a report's cache entry holds
    its outputs, not its inputs. A report is one run's: kfp.local's key of its
    task holds the run id."""
    record = json.dumps({"run_id": run_id, "methods": methods}) + "\n"
    write_atomic(report.with_name(REPORT_RUN), lambda f: f.write(record.encode()))


def report_run(report: Path) -> tuple[str, list[str] | None] | None:
    """The run (its id, and a comparison's methods) whose report (markdown
    artifact) is ``report``, as :func:`record_report` wrote it beside it: None
    where it wrote none (a run of an earlier tracefp4, or one stopped after its
    report task finished and before it returned: its rerun writes it). A
    ValueError, naming the file, where what is there cannot be read."""
    path = report.with_name(REPORT_RUN)
    if not path.exists():
        return None
    try:
        run = json.loads(path.read_text())
        return run["run_id"], run["methods"]
    except (ValueError, KeyError, TypeError) as e:
        raise ValueError(f"{path}: unreadable ({type(e).__name__}: {e})") from None


def report_exports(run_dir: Path, report: Path) -> dict[str | None, Path]:
    """The :func:`serving_exports` of the run whose report is ``report``, in
    the local run folder ``run_dir`` (:func:`report_run`; none where it is not known)."""
    run = report_run(report)
    return serving_exports(run_dir, *run) if run else {}


class Finished(NamedTuple):
    """What a local run that ran to its end leaves to read and to serve."""

    report: Path  # the report task's markdown artifact (its HTML page beside it, ``page``)
    page: Path  # the report's copies in the run folder (publish_report): report.html
    markdown: Path  # report.md
    exports: dict[str | None, Path]  # serving_exports: the export tasks' checkpoints, by method in a comparison


def check_device(config: RunConfig) -> None:
    """A :class:`~tracefp4.schemas.ConfigError` where ``resources.device`` names
    a GPU this machine lacks: found by a run's (or bootstrap's) first step
    otherwise, as a traceback in its log."""
    try:
        resolve(config.resources.device)
    except RuntimeError as e:
        raise ConfigError([("resources.device", str(e))]) from None


def check_checkpoint(config: RunConfig, env: dict[str, str]) -> None:
    """A :class:`~tracefp4.schemas.ConfigError` where ``model.checkpoint`` is
    no policy folder (a run folder, a serving export, one without
    config.json) or its config.json and tokenizer fail prepare's checks
    (:func:`~tracefp4.components.checkpoint.read_policy_folder`), saying what
    is wrong, and a local folder's weights where their headers disagree with
    its config.json (:func:`~tracefp4.components.checkpoint.check_weights`);
    then the run against its architecture and tokenizer, as prepare checks
    it (:func:`~tracefp4.components.steps.check_policy_fits`: the guided
    layers, and the prompts and answers within the lengths): each found by
    prepare otherwise, after the run has started. A store's is read with
    ``env`` (the steps' environment) as prepare reads it, but for its
    weights (``fetch(weights=False)``), which prepare alone reads."""
    if not config.model.checkpoint:
        return
    folder = local_folder(config.model.checkpoint)
    if folder is not None and (problem := resume.run_folder_problem(folder)):
        raise ConfigError([("model.checkpoint", f"{problem}; to go on from its run: --continue-from {folder}")])
    try:
        if folder is None:
            cfg, tokenizer = read_policy_folder(
                fetch(config.model.checkpoint, env, weights=False), config.model.checkpoint
            )
        else:
            cfg, tokenizer = read_policy_folder(folder)
            warn_of_checkpoint_dtype(check_weights(folder, cfg), config)  # a store's are read by prepare alone
    except (CheckpointError, TokenizerError, OSError) as e:
        raise ConfigError([("model.checkpoint", str(e))]) from None
    try:
        check_policy_fits(config, cfg, tokenizer)
    except ValueError as e:  # a "field: reason" line a problem
        raise ConfigError([tuple(line.partition(": ")[::2]) for line in str(e).splitlines()]) from None


def run_local(
    config: RunConfig, output: Path, log: Path | None = None, methods: list[str] | None = None, **options
) -> Path:
    """:func:`run_to_end`'s report: the report task's markdown artifact (its HTML page beside it, ``page``)."""
    return run_to_end(config, output, log, methods, **options).report


def run_to_end(
    config: RunConfig,
    output: Path,
    log: Path | None = None,
    methods: list[str] | None = None,
    *,
    verbose: bool = False,
    restart: bool = False,
    out=None,
) -> Finished:
    """Run the whole pipeline (with ``methods``, the comparison pipeline),
    copy its report into ``output`` (:func:`publish_report`) and return what
    it leaves (:class:`Finished`); a rerun in the same ``output`` resumes unless
    ``restart``. Components log to ``log`` (default ``<output>/pipeline.log``),
    echoed to ``out`` (default standard output) when ``verbose``, else ``out``
    shows the progress. Raises :class:`PipelineFailed` or :class:`Interrupted`, and
    :class:`~tracefp4.schemas.ConfigError` for a run no local machine can do."""
    out = out or sys.stdout
    if config.train.in_trainjob:  # found by the train step otherwise, after the rollout
        reason = "trainjob creates a Kubeflow Trainer TrainJob on a cluster; a local run trains on this machine"
        raise ConfigError([("train.launcher", f"{reason}: set launcher torchrun (and nodes 1)")])
    check_device(config)
    output = Path(output).resolve()
    resume.check_run_folder(output)
    with warnings_to(out):  # the log is not open yet: a checkpoint without a chat template, say
        # the problem files pinned before the pipeline takes the config: a file rewritten during the run stops it
        config = pin_problems(localize(config, output))
        # built before the folder is made: it refuses a comparison branch that could not run, a rollout no export
        # expresses
        if methods:
            pipeline = build_comparison_pipeline(config, methods, retries=False)
        else:
            pipeline = build_pipeline(config, retries=False)
        # the tasks' problems drawn as the configure task draws them (the same for every method): else a value that
        # leaves them short or unscorable fails that task, a traceback at the end of its log
        check_drawable(config)
        # reached now, as every step will (its endpoint, credentials and bucket), in the steps' environment (which
        # store.endpoint sets): else a typo shows in the rollout, after the bootstrap
        env = steps_environment(config)
        store = open_store(config.store.uri, env=env, create_bucket=config.store.create_bucket)
        request = resume.request(config, methods, store, env)  # it refuses a checkpoint that is not there
        check_checkpoint(config, env)
    output.mkdir(parents=True, exist_ok=True)
    # held until the run ends (and by its tasks until they do): two runs in one folder would share a run id
    with contextlib.closing(resume.lock_folder(output)):
        run_id, resumed, others, replaced, changed = resume.run_id(output, request, restart)
        note = ", resumed: finished tasks are reused, not rerun" if resumed else ""
        if replaced:
            note = f", a new run (--restart): {replaced}, the folder's earlier run of these settings, no longer resumes"
        elif others and not resumed:
            what = f" (its last one: {'; '.join(changed)})" if changed else ""
            note = (
                f", a new run: the folder's {others} other run(s) were asked for something else{what}; each "
                "resumes when asked for again"
            )
        header = f"running {config.name}: {config.rl.rounds} round(s) of {config.rl.steps_per_round} step(s), method "
        header += f"{', '.join(methods or [config.method])}; component logs in {log or output / LOG}"
        print(f"{header}\nrun id {run_id}{note}", file=out, flush=True)  # once the run is sure to start
        resume.cache_every_task(pipeline, run_id)
        resume.hold_folder_lock(pipeline, output)
        kfp.local.init(
            runner=kfp.local.SubprocessRunner(use_venv=False),
            pipeline_root=str(output / resume.PIPELINE_ROOT),
            enable_caching=True,
            cache_root=str(output / resume.COMPLETED),
        )
        stream = _Log(Path(log) if log else output / LOG, echo=out if verbose else None)
        stream.write(f"==== {time.strftime('%Y-%m-%d %H:%M:%S')} run id {run_id}{' (resumed)' if resumed else ''}\n")
        with contextlib.ExitStack() as stack:
            stack.enter_context(_kfp_local_swaps_undone())
            stack.callback(stream.file.close)
            # kfp.local's lines outside its own log contexts: cache hits, retries
            stack.enter_context(_logging_to(stream))
            stack.enter_context(_stop_components(stream))
            if not verbose:
                progress = _Progress(stream, task_count(config, methods), out)
                progress.start()
                stack.callback(progress.join)
                stack.callback(progress.done.set)
            stack.enter_context(contextlib.redirect_stdout(stream))
            stack.enter_context(warnings.catch_warnings())  # resources and image are for the cluster: no-ops here
            warnings.simplefilter("ignore", UserWarning)
            warnings.simplefilter("ignore", RuntimeWarning)
            try:
                task = pipeline(run_id=run_id)
            except Interrupted as e:
                stream.write(f"==== {e}\n")
                raise
            except RuntimeError as e:
                failure = failed_task(stream.text())
                if failure is None and stream.lost is not None:  # the log that names the failed task stopped
                    raise stream.lost from e
                if failure is None:
                    raise
                raise PipelineFailed(*failure, stream.path, failed_method(str(e), methods)) from None
        failures = stream.text().count(PUBLISH_FAILED)
        if failures:
            print(
                f"warning: {failures} metrics write(s)/push(es) failed (grep '{PUBLISH_FAILED}' {stream.path})",
                file=out,
            )
        report = Path(task.output.path)
        record_report(report, run_id, methods)
        # under the folder's lock: a run that finishes after this one replaces the copies after these
        return Finished(report, *publish_report(report, output), report_exports(output, report))
