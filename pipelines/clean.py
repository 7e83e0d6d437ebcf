"""What a finished run left in object storage, and deleting it (``tracefp4 runs clean``).

Why: KFP keeps every task's output artifacts in the pipeline root, and deleting a run in KFP leaves
them there (kubeflow/pipelines#10816); tracefp4's store keeps the run's last round's captures and
guidance (every round's with ``guidance.keep_steps``), and its last trainer state. At the paper
presets a run of 14 rounds leaves 1.1 TB of policies and trajectories in the pipeline root and, at
10,000 tokens a trajectory, 4.0 TB of guidance in the store (docs/deploy.md, "Sizes"), and nothing else
deletes it.

Where a run's files are:

- KFP's: ``{pipeline root}/{pipelineInfo.name}/{run id}/``, where KFP's driver puts every task's
  outputs (``metadata.GenerateOutputURI`` in backend/src/v2, KFP 2.14-2.17). The pipeline root is the
  run's own, else its compiled spec's default; a run submitted with neither used the cluster's
  default, which the API does not tell: then it must be given.
- tracefp4's: ``{store.uri}/{name}/{run id}/`` (:func:`~tracefp4.components.steps.store_prefix`), the
  name and store read from the config compiled into the run's pipeline, the run id its ``run_id``
  parameter or, empty, KFP's.

Of KFP's artifacts a clean deletes the bulk (:data:`BULK`), and keeps the run's record (its report,
history, metrics, evaluation results and exported policy) unless told everything; of the store, the run's
folder. A run is cleaned only once finished, and not while a run that goes on from it (the chain's next run,
or any run given a URI under one of its folders as a parameter: ``model.checkpoint``,
``model.trainer_state``) has yet to finish its ``prepare`` task, which copies what it needs.
"""

import json
from dataclasses import dataclass
from urllib.parse import urlsplit

from tracefp4.components.checkpoint import MANIFEST, UNFINISHED, CheckpointError, manifest_provenance, mark_unfinished
from tracefp4.components.distributed import METADATA
from tracefp4.components.guidance import STEP_MANIFEST
from tracefp4.components.store import open_store
from tracefp4.pipelines.pipeline import comparison_name, pipeline_name
from tracefp4.pipelines.submit import SubmitError, quiet
from tracefp4.schemas import RunConfig

FINISHED = ("SUCCEEDED", "FAILED", "CANCELED", "SKIPPED")
# The pipeline's outputs that make a run's bulk (at the paper presets a policy is 70 GB, a trainer state 420 GB):
# of its KFP artifacts, what a clean deletes unless told everything. The run's record stays (report, history,
# metrics, evaluation results, the exported policy), and so does an output this list does not name.
BULK = ("policy", "trainer_state", "new_policy", "new_trainer_state", "trajectories", "guidance")
PREPARE = "prepare"  # the task that copies a continuation's starting policy and trainer state into its own run
PAGE = 100
KINDS = {"artifacts": "KFP artifacts", "store": "tracefp4 store"}


@dataclass(frozen=True)
class RunFolder:
    """A folder of one run: ``prefix`` in the store at ``root``; ``kind`` a key of :data:`KINDS`."""

    kind: str
    root: str
    prefix: str

    @property
    def uri(self) -> str:
        return f"{self.root.rstrip('/')}/{self.prefix}/"


@dataclass(frozen=True)
class Survey:
    """What a run folder holds now."""

    folder: RunFolder
    keys: list[str]
    size: int


def run_folders(client, run_id: str, pipeline_root: str | None = None) -> list[RunFolder]:
    """The folders finished run ``run_id`` left: its KFP artifacts and its folder in tracefp4's store
    (``client``: :func:`~.submit.connect`'s; ``pipeline_root``: the cluster's default, for a run that
    records none). Raises SubmitError."""
    return _folders(client, _run(client, run_id), pipeline_root)


def _run(client, run_id: str):
    with quiet():
        return client.get_run(run_id)


def _folders(client, run, pipeline_root: str | None) -> list[RunFolder]:
    """:func:`run_folders` of the run ``run`` as the API gave it."""
    if run.state not in FINISHED:
        raise SubmitError(f"run {run.run_id} is {run.state or 'in no state'}: clean it once it has finished")
    spec = _pipeline_spec(client, run)
    root = _pipeline_root(run, spec, pipeline_root)
    folders = [RunFolder("artifacts", root, f"{spec['pipelineInfo']['name']}/{run.run_id}")]
    tracefp4_run_id = _parameters(run).get("run_id") or run.run_id
    for name, store in sorted(_compiled_runs(spec)):
        folders.append(RunFolder("store", store, f"{name}/{tracefp4_run_id}"))
    return folders


def deleted_run_folders(client, run_id: str, config: RunConfig, pipeline_root: str) -> list[RunFolder]:
    """The folders run ``run_id`` left once deleted in KFP, which forgets its pipeline spec and parameters
    with it and keeps its artifacts: ``config``, the run's as submitted, names its pipeline (the run's or the
    comparison's: the one that holds its artifacts) and its store folder, ``pipeline_root`` where KFP kept the
    artifacts. The store folder is under the run id its policies record (:func:`_recorded_run_id`: a run given
    a ``run_id`` parameter used that one), else KFP's. Refused while KFP still knows the run:
    :func:`run_folders` finds its folders, and checks it has finished."""
    try:
        run = _run(client, run_id)
    except SubmitError as e:
        if e.status != 404:
            raise
    else:
        raise SubmitError(f"run {run_id} is in KFP ({run.state or 'in no state'}): clean it without --deleted")
    root = _artifacts_root(pipeline_root)
    candidates = [
        RunFolder("artifacts", root, f"{name}/{run_id}") for name in (pipeline_name(config), comparison_name(config))
    ]
    store = open_store(root)
    held = {folder: store.list(folder.prefix + "/") for folder in candidates}
    artifacts = [folder for folder in candidates if held[folder]] or candidates[:1]
    recorded = _recorded_run_id([key for folder in artifacts for key in held[folder]], store)
    return [*artifacts, RunFolder("store", config.store.uri, f"{config.name}/{recorded or run_id}")]


def _recorded_run_id(keys: list[str], store) -> str | None:
    """The run id in the provenance of the first policy among a run's artifact ``keys`` (each policy's
    :data:`~tracefp4.components.checkpoint.MANIFEST` records the id the run's store folder is under), None
    where none is left (a clean deleted them)."""
    for key in keys:
        *_, output, name = key.split("/")
        if name == MANIFEST and output in ("policy", "new_policy"):
            where = f"{store.uri}/{key}"
            found = manifest_provenance(store.get_bytes(key), where)
            if "run_id" not in found:
                raise CheckpointError(f"{where}: its provenance records no run id")
            return found["run_id"] or None
    return None


def went_on_from(run, artifacts: RunFolder) -> str | None:
    """The id of the run that ``run`` went on from: the one whose KFP artifacts, beside its own ``artifacts``
    (under the same pipeline root), hold a URI among its parameters (the policy or trainer state that a chain's
    next run, or a continuation submitted by hand, starts from); None for a run that started from none."""
    under = artifacts.root.rstrip("/") + "/"
    for value in _parameters(run).values():
        if isinstance(value, str) and value.startswith(under):
            parts = value[len(under) :].split("/")  # {pipeline name}/{run id}/{task}/...
            if len(parts) > 2 and parts[1] != run.run_id:
                return parts[1]
    return None


def chain_folders(client, run_id: str, pipeline_root: str | None = None) -> dict[str, list[RunFolder]]:
    """:func:`run_folders` of run ``run_id`` and, newest first, of each run it went on from in turn
    (:func:`went_on_from`): the runs of its chain back to the first. Each run is read from the API once."""
    run = _run(client, run_id)
    folders = {run_id: _folders(client, run, pipeline_root)}
    while (before := went_on_from(run, folders[run_id][0])) and before not in folders:
        try:
            run = _run(client, before)
            folders[before] = _folders(client, run, folders[run_id][0].root)
        except SubmitError as e:  # not finished, or deleted in KFP (its artifacts stay: its spec does not)
            raise SubmitError(f"run {run_id} went on from run {before}: {e}") from None
        run_id = before
    return folders


def _parameters(run) -> dict:
    """The run's parameters as it was started with them (none recorded: empty)."""
    return (run.runtime_config.parameters if run.runtime_config else None) or {}


def _pipeline_spec(client, run) -> dict:
    """The run's compiled pipeline spec: its own, or its pipeline version's (``{"pipeline_spec",
    "platform_spec"}`` where the upload held a platform spec, as ours do)."""
    spec = run.pipeline_spec
    if not spec:
        ref = run.pipeline_version_reference
        if ref is None or not ref.pipeline_version_id:
            raise SubmitError(f"run {run.run_id} names neither a pipeline spec nor a pipeline version")
        with quiet():
            spec = client.get_pipeline_version(ref.pipeline_id, ref.pipeline_version_id).pipeline_spec
    return spec.get("pipeline_spec", spec)


def _pipeline_root(run, spec: dict, given: str | None) -> str:
    """Where KFP kept the run's artifacts: the root the run or its spec records, else ``given``."""
    recorded = (run.runtime_config.pipeline_root if run.runtime_config else None) or spec.get("defaultPipelineRoot")
    if recorded and given and recorded.rstrip("/") != given.rstrip("/"):
        raise SubmitError(f"run {run.run_id} kept its artifacts in {recorded}, not {given}")
    if not (recorded or given):
        raise SubmitError(
            f"run {run.run_id} was submitted without a pipeline root, so KFP kept its artifacts in the cluster's "
            "default, which its API does not tell: pass it (--pipeline-root; the kfp-launcher ConfigMap's "
            "defaultPipelineRoot, KFP's own minio://mlpipeline/v2/artifacts)"
        )
    return _artifacts_root(recorded or given)


def _artifacts_root(pipeline_root: str) -> str:
    """Where KFP's artifacts under ``pipeline_root`` lie: KFP keeps a root's query (its S3 settings) off their paths."""
    return urlsplit(pipeline_root)._replace(query="").geturl()


def _compiled_runs(spec: dict) -> set[tuple[str, str]]:
    """(name, store URI) of each config compiled into the pipeline: the ``config_json`` constant of its
    ``configure`` tasks (a comparison has one per method, all in one store under one name)."""
    found = set()

    def walk(dag: dict) -> None:
        for task in dag["tasks"].values():
            constant = task.get("inputs", {}).get("parameters", {}).get("config_json", {})
            if text := constant.get("runtimeValue", {}).get("constant"):
                config = json.loads(text)
                found.add((config["name"], config["store"]["uri"]))
            component = spec["components"][task["componentRef"]["name"]]
            if "dag" in component:
                walk(component["dag"])

    walk(spec["root"]["dag"])
    if not found:
        raise SubmitError("the run's pipeline holds no tracefp4 config (its configure task's config_json)")
    return found


def waiting_continuations(client, namespace: str | None, folders: list[RunFolder]) -> list[str]:
    """The runs (in ``namespace``) given a URI under one of ``folders`` as a parameter whose ``prepare``
    task has not succeeded: they still have to copy from there (a failed one, if retried, too)."""
    waiting, token = [], ""
    while True:
        with quiet():
            page = client.list_runs(page_token=token, page_size=PAGE, namespace=namespace)
        for run in page.runs or []:
            if not any(isinstance(v, str) and v.startswith(f.uri) for v in _parameters(run).values() for f in folders):
                continue
            details = _run(client, run.run_id).run_details
            tasks = (details.task_details if details else None) or []
            if not any(t.display_name == PREPARE and t.state == "SUCCEEDED" for t in tasks):
                waiting.append(f"{run.display_name} ({run.run_id}, {run.state})")
        token = page.next_page_token
        if not token:
            return waiting


def survey(folder: RunFolder, everything: bool = False) -> Survey:
    """The objects under ``folder`` a clean deletes, and their bytes (StoreError where its server is not
    reached): in the store, all; of the KFP artifacts, those of :data:`BULK` outputs, or all (``everything``).
    An artifact's keys are ``{task}/{salt}/{output}/...`` under the folder (KFP's driver)."""
    sizes = open_store(folder.root).sizes(folder.prefix + "/")
    keys = sorted(sizes)
    if folder.kind == "artifacts" and not everything:
        depth = folder.prefix.count("/") + 3  # the output's name: the third part under the folder
        keys = [k for k in keys if k.count("/") >= depth and k.split("/")[depth] in BULK]
    return Survey(folder, keys, sum(sizes[k] for k in keys))


# What says a folder of a run is whole, written last: a checkpoint's checksums, a guidance or capture step's
# manifest, a sharded training checkpoint's .metadata
FOLDER_MARKERS = (MANIFEST, STEP_MANIFEST, METADATA)


def delete(found: Survey) -> None:
    """Delete what ``found`` lists, each folder's marker first: one half deleted is never read as whole. A
    checkpoint folder first gets :data:`~tracefp4.components.checkpoint.UNFINISHED`, which goes last: without
    its manifest, the config.json and weights a cut deletion left would load as a checkpoint from elsewhere."""
    store = open_store(found.folder.root)
    checkpoints = {key.rpartition("/")[0] for key in found.keys if key.rpartition("/")[2] == MANIFEST}
    unfinished = {mark_unfinished(store, folder) for folder in sorted(checkpoints)}
    unfinished |= {key for key in found.keys if key.rpartition("/")[2] == UNFINISHED}  # a cut upload's, kept too
    store.delete_keys([key for key in found.keys if key not in unfinished], FOLDER_MARKERS)
    store.delete_keys(sorted(unfinished), ())
