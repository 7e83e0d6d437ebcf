"""Resuming a local run: a rerun of the same run folder picks up after the
last completed task instead of starting over.

How it works: kfp.local has a task cache (``kfp.local.init(enable_caching=True)``)
that records a task's outputs only once the task succeeded, atomically (a
temporary file renamed), keyed by the component, its code and its resolved
arguments (the config JSON, the round, the run id, the upstream artifacts'
URIs and metadata), and drops an entry whose artifact files are gone. A task
that was interrupted or failed has no entry, so its partial outputs are never
read: the rerun runs it again into a fresh folder. Every task's key also
holds the run id (:func:`cache_every_task`): ``configure`` takes no run id,
and its entry would otherwise outlive a new run (changed code, ``--restart``).
The run folder holds:

- ``run.json``: per request, what was asked for (config and methods, the
  digest of the code asked to do it, :func:`code_digest`, the server of an
  S3 store, from the environment), its hash and its run id (created once,
  reused on every resume), and which request ran last. The same config on the same code
  resumes (one that differs only in settings no local step reads, such as the
  image or a pod's resources, is the same: :func:`.local.localize` leaves them
  at their defaults, in every task's key too); another config, changed code or
  another S3 endpoint starts a new run id, whose keys match nothing recorded
  (kfp.local's key holds a component's own few lines, not the library code they
  call), and coming back to an earlier request (a setting tried and undone, an
  edit reverted) resumes its run.
- ``completed/``: kfp.local's cache entries, one JSON file per finished task.
- ``.lock``: held (``flock``) by the run in the folder, with its pid, and by
  every task it runs (:func:`hold_folder_lock`): a second run in the same
  folder stops at once instead of sharing the first one's run id, also
  while a task of a run killed with SIGKILL (which could not stop its
  tasks) still writes there.

With ``model.checkpoint`` (and ``model.trainer_state``) the request also
holds its fingerprint (its manifest's hash): the same URI with other weights
behind it is another run.

kfp.local takes an output artifact without a file for a lost one (a miss),
and a ``Metrics`` artifact lives in its metadata only: a component with a
``Metrics`` output ends with :func:`write_metrics`, else it never resumes.

The pipeline compiles with caching off (on a cluster, KFP's cache would hand a
new run the previous run's outputs); :func:`cache_every_task` turns it on in
the local copy of the spec only.
"""

import contextlib
import fcntl
import hashlib
import importlib
import json
import os
import uuid
from collections.abc import Mapping
from pathlib import Path
from typing import NamedTuple

from tracefp4.components.checkpoint import CheckpointError, fingerprint
from tracefp4.components.store import ArtifactStore, S3Store, write_atomic
from tracefp4.schemas import ConfigError, RunConfig

RUN_FILE = "run.json"
LOCK_FILE = ".lock"  # flock-ed by the run in the folder (lock_folder)
COMPLETED = "completed"
PIPELINE_ROOT = "pipeline_root"  # kfp.local's, in the run folder: the tasks' outputs
PACKAGES = ("tracefp4.kernels", "tracefp4.components", "tracefp4.pipelines", "tracefp4.schemas")
RUN_ENV = "TRACEFP4_LOCAL_RUN_ID"  # in every task's environment: kfp.local's key of each task holds it
LOCK_ENV = "TRACEFP4_FOLDER_LOCK"  # the run folder's lock, which every task holds (hold_folder_lock)
# what each task runs before its own command, under "python3" (kfp.local writes its Python over that word in every
# argument, so the lock's path comes in the environment): the folder's lock, shared with the run, on a descriptor
# that the command (sh, then the component's Python) inherits
HOLD_LOCK = (
    "import fcntl, os, sys\n"
    f"lock = os.open(os.environ[{LOCK_ENV!r}], os.O_RDONLY)\n"
    "fcntl.flock(lock, fcntl.LOCK_SH | fcntl.LOCK_NB)\n"
    "os.set_inheritable(lock, True)\n"
    "os.execvp(sys.argv[1], sys.argv[1:])\n"
)


def code_digest() -> str:
    """sha256 of the tracefp4 code the tasks run: every Python file of its packages, by name and content."""
    digest = hashlib.sha256()
    for name in PACKAGES:
        root = Path(importlib.import_module(name).__path__[0])
        for path in sorted(root.rglob("*.py")):
            digest.update(f"{name}/{path.relative_to(root).as_posix()}\0".encode())
            digest.update(path.read_bytes())
    return digest.hexdigest()


class FolderInUse(RuntimeError):
    """Another run, or files that are not a run's, hold the run folder."""


def check_run_folder(output: Path) -> None:
    """Refuse ``output`` where a run would write among files that are not a
    run's: a folder that holds some, but neither :data:`RUN_FILE` nor
    :data:`LOCK_FILE` (a run folder that a run was killed in before it
    recorded its run id holds the lock's file), such as a project's root."""
    held = {path.name for path in Path(output).iterdir()} if Path(output).is_dir() else set()
    if held and not held & {RUN_FILE, LOCK_FILE}:
        raise FolderInUse(
            f"{output} holds files and is not a tracefp4 run folder (it has no {RUN_FILE}): a run would write among "
            "them; choose a new or empty folder (--output)"
        )


def request(
    config: RunConfig, methods: list[str] | None, store: ArtifactStore, env: Mapping[str, str] | None = None
) -> dict[str, str]:
    """What a run is asked to do, part by part, as :func:`run_id` compares
    it: the config (a local run's: its cluster-only settings at their
    defaults, so that changing one resumes, :func:`.local.localize`), the
    methods, the code (:func:`code_digest`), the server of an S3 ``store`` (the
    run's, opened: its endpoint comes from the environment, and the same bucket
    on another server holds none of the finished tasks' outputs) and, from a
    checkpoint (and a continuation's trainer state), its fingerprint (read with
    ``env``, the steps' environment, as they read it): the same URI with other
    weights behind it is another run. One that is not there is refused, naming
    its field."""
    asked = {"settings": config.model_dump_json(), "methods": json.dumps(methods), "code": code_digest()}
    if isinstance(store, S3Store):
        asked["store endpoint"] = store.endpoint
    for field, uri in (
        ("model.checkpoint", config.model.checkpoint),
        ("model.trainer_state", config.model.trainer_state),
    ):
        try:
            if uri:
                asked[f"the files at {field}"] = fingerprint(uri, env)
        except CheckpointError as e:
            raise ConfigError([(field, str(e))]) from None
    return asked


def run_folder_problem(folder: Path) -> str | None:
    """What is wrong where a policy folder is asked for and ``folder`` is a
    local run's folder (it holds :data:`RUN_FILE`), else None."""
    if not (Path(folder) / RUN_FILE).exists():
        return None
    return f"{folder} is a tracefp4 run folder, not a policy (a train task's new_policy under {PIPELINE_ROOT}/ is one)"


def lock_folder(output: Path):
    """The run folder's lock, taken at once or not at all: two runs in one folder
    would resume the same run id and overwrite each other's guidance and log.
    Held while the returned file is open, shared with the run's tasks
    (:func:`hold_folder_lock`), each of which holds it until it ends: a run
    killed with SIGKILL leaves its running task writing in the folder. The
    run's pid is in it."""
    path = Path(output) / LOCK_FILE
    lock = open(path, "a+")
    try:
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)  # no run, no task of one, holds it
        lock.truncate(0)
        lock.write(f"{os.getpid()}\n")
        lock.flush()
        # shared from now on, with the tasks; a run that took it in the meantime holds it, and this one stops
        fcntl.flock(lock, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except BlockingIOError:
        lock.seek(0)
        run = lock.read().strip() or "?"
        lock.close()
        tasks = [str(pid) for pid in _holders(path)]
        if not tasks or run in tasks:
            raise FolderInUse(
                f"{output} is in use by another run (pid {run}); wait for it to end, or choose another --output"
            ) from None
        raise FolderInUse(
            f"{output} is in use by pid(s) {', '.join(tasks)}, task(s) of an earlier run (pid {run}) that ended "
            f"without stopping them (killed with SIGKILL?): wait for them to end, or stop them (kill {' '.join(tasks)})"
        ) from None
    return lock


def _holders(path: Path) -> list[int]:
    """The processes that have the file at ``path`` open (Linux /proc; none found elsewhere)."""
    target = path.stat()
    found = set()
    for fd in Path("/proc").glob("[0-9]*/fd/*"):
        with contextlib.suppress(OSError):  # closed, or its process exited, meanwhile
            if os.path.samestat(fd.stat(), target):
                found.add(int(fd.parent.parent.name))
    return sorted(found)


class UnreadableRunRecord(RuntimeError):
    """A run folder whose record of run ids cannot be read: what it held is
    what every earlier run there resumes by, so nothing is recorded over it."""


class RunId(NamedTuple):
    """A local run's id, whether it resumes an earlier attempt, how many
    other runs (other requests) the folder holds, the run of the same
    request that a restart replaced (which no longer resumes), and what this
    request asks otherwise than the folder's last run did (:func:`changes`;
    empty where it is that run, or the folder has none)."""

    run_id: str
    resumed: bool
    others: int
    replaced: str | None = None
    changed: tuple[str, ...] = ()


def run_id(output: Path, request: Mapping[str, str], restart: bool = False) -> RunId:
    """The run id of ``request`` (what the run was asked to do, by
    :func:`request`) in the folder. Each request keeps its own: a new one is
    written for a request the folder has not seen, or on ``restart``; one seen
    before resumes, even after other requests ran there (one edit of the code
    and back used to lose the first run's tasks). The record keeps each
    request too, and which ran last, to say what a new one changed. It is
    written whole or not at all, so one that cannot be read was damaged from
    outside: refused, naming it, rather than replaced by a new record in which
    no earlier run of the folder resumes."""
    path = Path(output) / RUN_FILE
    digest = hashlib.sha256(json.dumps(request, sort_keys=True).encode()).hexdigest()
    runs, requests, last = {}, {}, None
    if path.exists():
        try:
            recorded = json.loads(path.read_text())
            runs, requests, last = dict(recorded["runs"]), dict(recorded.get("requests", {})), recorded.get("last")
        except (ValueError, KeyError, TypeError, AttributeError) as e:
            raise UnreadableRunRecord(
                f"{path}: unreadable ({type(e).__name__}: {e}); it holds the run id each run in {output} resumes "
                "by: restore it, or delete it to start every run there anew"
            ) from None
    others, earlier = len(runs) - (digest in runs), runs.get(digest)
    resumed = bool(earlier) and not restart
    if not resumed:
        runs[digest] = f"local-{uuid.uuid4().hex[:12]}"
    before = requests.get(last) if last != digest else None
    requests[digest] = dict(request)
    record = json.dumps({"runs": runs, "requests": requests, "last": digest}, indent=2) + "\n"
    write_atomic(path, lambda f: f.write(record.encode()))
    changed = tuple(changes(before, request)) if isinstance(before, dict) else ()
    return RunId(runs[digest], resumed, others, None if resumed else earlier, changed)


def changes(before: Mapping[str, str], now: Mapping[str, str], shown: int = 6) -> list[str]:
    """What ``now`` asks otherwise than the request ``before``, in words: each
    setting that differs (``rl.rounds 2 -> 3``; a problem file rewritten is
    its ``tasks.i.sha256``), the methods, the code, the store's server, the
    files behind a checkpoint; at most ``shown`` settings, then how many more."""
    settings = [
        f"{key} {_shown(was, value)}"
        for key, (was, value) in _differences(
            json.loads(before.get("settings", "{}")), json.loads(now.get("settings", "{}"))
        ).items()
    ]
    if len(settings) > shown:
        settings[shown - 1 :] = [f"{len(settings) - shown + 1} more settings"]
    parts = {"methods": "the methods", "code": "tracefp4's code", "store endpoint": "the store's server"}
    others = sorted({*before, *now} - {"settings"})
    return settings + [parts.get(part, part) for part in others if before.get(part) != now.get(part)]


def _differences(before, now, prefix: str = "") -> dict[str, tuple]:
    """The leaves of two settings' JSON that differ, by dotted path (a list's items by number)."""
    if isinstance(before, dict) and isinstance(now, dict):
        items = [(key, before.get(key), now.get(key)) for key in dict.fromkeys([*before, *now])]
    elif isinstance(before, list) and isinstance(now, list) and len(before) == len(now):
        items = [(str(i), a, b) for i, (a, b) in enumerate(zip(before, now))]
    else:
        return {} if before == now else {prefix.removesuffix("."): (before, now)}
    found = {}
    for key, a, b in items:
        found |= _differences(a, b, f"{prefix}{key}.")
    return found


def _shown(was, value, width: int = 24) -> str:
    """A setting's two values as :func:`changes` says them, ``was -> value``,
    each cut to ``width`` characters from a little before where they first
    differ: a path that differs in its last character shows it."""
    texts = [json.dumps(v) for v in (was, value)]
    first = next((i for i, (a, b) in enumerate(zip(*texts)) if a != b), min(map(len, texts)))
    start = max(0, min(first - width // 2, max(map(len, texts)) - width))
    return " -> ".join(
        "..." * bool(start) + text[start : start + width] + "..." * (len(text) > start + width) for text in texts
    )


def finished_outputs(run_dir: Path) -> set[Path]:
    """The files of the output artifacts of the tasks that finished in the
    local run folder ``run_dir`` (its kfp.local cache entries), relative to
    it (``pipeline_root/...``: the folder may have moved since): a task killed
    or failing while it wrote its outputs left files that no entry names."""
    found = set()
    for entry in Path(run_dir, COMPLETED).glob("*.json"):
        try:
            outputs = json.loads(entry.read_text())
        except (OSError, ValueError):  # not kfp.local's: nothing of it is read
            continue
        for value in outputs.values() if isinstance(outputs, dict) else ():
            for artifact in value if isinstance(value, list) else [value]:
                if isinstance(artifact, dict) and artifact.get("__kfp_artifact__") and "uri" in artifact:
                    parts = Path(artifact["uri"]).parts
                    if PIPELINE_ROOT in parts:
                        found.add(Path(*parts[len(parts) - parts[::-1].index(PIPELINE_ROOT) - 1 :]))
    return found


def written_reports(run_dir: Path) -> list[Path]:
    """The markdown reports in the local run folder ``run_dir``, whole or not:
    a run's ``report`` task's, a comparison's ``compare`` task's."""
    root = Path(run_dir, PIPELINE_ROOT)
    return [*root.glob("*/report/markdown"), *root.glob("*/compare/markdown")]


def finished_reports(run_dir: Path) -> list[Path]:
    """The :func:`written_reports` that their task finished writing, oldest first."""
    finished = finished_outputs(run_dir)
    written = [p for p in written_reports(run_dir) if p.relative_to(run_dir) in finished]
    return sorted(written, key=lambda p: p.stat().st_mtime)


def write_metrics(*artifacts) -> None:
    """Each ``Output[Metrics]``'s logged values as JSON in its file, so that
    kfp.local's cache finds the artifact (on a cluster: uploaded alongside)."""
    for artifact in artifacts:
        Path(artifact.path).write_text(json.dumps(artifact.metadata, sort_keys=True) + "\n")


def cache_every_task(pipeline, run_id: str) -> None:
    """Turn kfp.local's task cache on for every task of a built pipeline
    (the root DAG and the sub-DAGs of loops), in its spec object, with
    ``run_id`` in every task's environment, which kfp.local's key holds: a
    task that takes no run id (``configure``) would otherwise be reused by
    another run of the folder (changed code, ``--restart``), its result and
    the checks it makes left as the first run found them."""
    spec = pipeline.pipeline_spec
    dags = [spec.root.dag] + [c.dag for c in spec.components.values() if c.WhichOneof("implementation") == "dag"]
    for dag in dags:
        for task in dag.tasks.values():
            task.caching_options.enable_cache = True
    for container in _containers(pipeline):
        container.get_or_create_list("env").add_struct().update({"name": RUN_ENV, "value": run_id})


def hold_folder_lock(pipeline, output: Path) -> None:
    """Every task of a built pipeline holds the run folder's lock
    (:func:`lock_folder`) while it runs, in its spec object: its command
    starts with :data:`HOLD_LOCK`. A run killed with SIGKILL cannot stop its
    running task; without this, a rerun would take the folder while that task
    still writes there. The task's shell and its component's Python inherit
    the lock (the processes the component starts through :mod:`subprocess`
    do not: it closes their inherited descriptors, and the component waits
    for them)."""
    for container in _containers(pipeline):
        container["command"] = ["python3", "-c", HOLD_LOCK, *container["command"]]
        container.get_or_create_list("env").add_struct().update({"name": LOCK_ENV, "value": str(output / LOCK_FILE)})


def _containers(pipeline) -> list:
    """The container of each executor of a built pipeline, in its spec object."""
    executors = pipeline.pipeline_spec.deployment_spec["executors"]
    return [executors[name]["container"] for name in executors.keys() if "container" in executors[name]]
