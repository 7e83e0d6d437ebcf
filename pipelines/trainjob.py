"""A distributed train step on a cluster: a Kubeflow Trainer v2 TrainJob.

KFP v2 has no resource op, so the train component itself creates the
TrainJob (``trainer.kubeflow.org/v1alpha1``, runtime ``train.trainjob_runtime``,
``torch-distributed`` by default) through the Kubernetes API with the
pipeline runner's service account (its Role in
manifests/base/kfp/pipeline-runner.yaml grants it) suspended, starts it once
the round's inputs are uploaded (or hands it to the run's Kueue queue, where
Kueue starts it once it admits it into the team's quota), watches it and
deletes it when done. The ranks cannot see the step's local files, so the
round's inputs go to the store first and travel as store URIs; the ranks
(:mod:`tracefp4.components.distributed`, under the runtime's torchrun) write
the new policy and the history rows back there.

Which launcher runs is the config's ``train.launcher``, never guessed: a
TrainJob needs the in-cluster service account and fails at once without one.
The object is built from the ``kubeflow-trainer-api`` models; tests check it
against the Trainer release's CRD schema and run the create / watch / fail /
delete flow against a loopback HTTP server.

What the runtime's pod template cannot know about a run (its node selector
and tolerations, the store's CA bundle, no Istio sidecar) reaches the rank
pods through the TrainJob's ``spec.runtimePatches``, which the Trainer merges
into the runtime's JobSet template.
"""

import contextlib
import hashlib
import json
import re
import signal
import tempfile
import threading
import time
from pathlib import Path

import urllib3
from kubeflow_trainer_api import models
from kubernetes import client
from kubernetes import config as kube_config
from kubernetes.client.exceptions import ApiException

from tracefp4.components.checkpoint import (
    MANIFEST,
    delete_folder,
    fetch,
    folder_digest,
    location,
    size_and_sha256,
    upload_folder,
    write_location,
)
from tracefp4.components.distributed import UPLOADING, DistributedError, checkpoints_prefix, clear_checkpoints
from tracefp4.components.launch import MODULE, rank_arguments, torchrun
from tracefp4.components.steps import config_digest, store_prefix
from tracefp4.components.store import ArtifactNotFound, open_store
from tracefp4.schemas import RunConfig
from tracefp4.schemas.config import CA_BUNDLE_MOUNT, LABEL_VALUE, SECRET_KEYS

GROUP, VERSION, PLURAL = "trainer.kubeflow.org", "v1alpha1", "trainjobs"
SERVICE_ACCOUNT_NAMESPACE = "/var/run/secrets/kubernetes.io/serviceaccount/namespace"
# The replicated job of the Trainer's runtimes that runs the trainer, and its container (the Trainer's
# constants.Node; the only job of torch-distributed): a runtime patch names them, and the Trainer refuses a name
# the runtime lacks.
TRAINER_JOB = "node"
# NCCL's shared-memory transport needs more /dev/shm than a container's default 64 MiB (pipeline.py gives the
# train step's own pod the same volume when torchrun starts its processes there)
SHARED_MEMORY = models.IoK8sApiCoreV1Volume(
    name="dshm", emptyDir=models.IoK8sApiCoreV1EmptyDirVolumeSource(medium="Memory")
)
CA_BUNDLE_VOLUME = "store-ca"  # the rank pods' volume of the secret store.ca_bundle_secret
# Who owns this step's runtime patch; the Trainer's webhook wants a domain-prefixed path.
PATCH_MANAGER = "tracefp4/train-step"
# A TrainJob's name must start with a letter (its CRD's rule); a run name may start with a digit.
NAME_PREFIX = "tj-"
# What the ranks leave in the store for the step, beside its inputs: all there once the round is trained.
OUTPUTS = ("history.json", f"new-policy/{MANIFEST}", f"new-state/{MANIFEST}")
# Under the run's trainjob prefix: each output folder's store key, by the sha256 of its manifest (TrainJobRun.stored)
BY_MANIFEST = "by-manifest"
# In a round's folder: what its ranks were given to train from (inputs_record), checked before a retry takes outputs
INPUTS = "inputs.json"
# ... and the same record once those inputs are all in the store, which the ranks wait for (wait_for_inputs)
READY = "inputs-ready.json"
# The TrainJob's annotation of the sha256 of that record: checked before a retry waits for a TrainJob it finds
INPUTS_ANNOTATION = "tracefp4/inputs-sha256"
# Kueue's label of the LocalQueue that admits a job (resources.labels; Kueue's webhook gives a job created without
# it the namespace's LocalQueue named "default", if there is one): Kueue holds such a TrainJob suspended until it
# admits it, and may suspend it again (an eviction)
KUEUE_QUEUE = "kueue.x-k8s.io/queue-name"


def distributed_train(
    config: RunConfig,
    policy: str,
    state: str,
    trajectories: str,
    guidance: str,
    out: str,
    out_state: str,
    run_id: str,
    round_stats: dict,
) -> list[dict]:
    """The train step over ``train.nodes`` x ``train.processes_per_node``
    processes, started as ``train.launcher`` says; the new policy goes to ``out``, its
    trainer state to ``out_state``."""
    round_index = json.loads(Path(guidance).read_text())["rl_step"]
    if config.train.launcher == "torchrun":
        with tempfile.TemporaryDirectory(prefix="tracefp4-torchrun-") as work:
            return torchrun(
                config, policy, state, trajectories, guidance, out, out_state, Path(work), run_id, round_stats
            )
    return TrainJobRun(config, run_id, round_index, in_cluster_api()).run(
        Path(policy), Path(state), Path(trajectories), Path(guidance), Path(out), Path(out_state), round_stats
    )


def inputs_record(policy: Path, state: Path, trajectories: Path, guidance: Path) -> bytes:
    """What a round trains from, as the sha256 of each input: the policy's and
    the trainer state's manifests, the trajectories and the guidance reference."""
    digests = {"policy": folder_digest(policy), "state": folder_digest(state)}
    digests.update(trajectories=size_and_sha256(Path(trajectories))[1], guidance=size_and_sha256(Path(guidance))[1])
    return json.dumps(digests, sort_keys=True).encode()


def ready_record(inputs: bytes, folders: dict[str, str]) -> bytes:
    """What :data:`READY` says once the round's ``inputs`` (:func:`inputs_record`) are all in the store, in
    ``folders`` (:meth:`TrainJobRun.input_folders`): a retry that would point its ranks elsewhere uploads again."""
    return json.dumps({"inputs": json.loads(inputs), "folders": folders}, sort_keys=True).encode()


def in_cluster_api() -> client.ApiClient:
    """The Kubernetes API as the step's service account sees it; outside a cluster, a clear error."""
    try:
        kube_config.load_incluster_config()
    except kube_config.ConfigException as e:
        raise DistributedError(
            f"train.launcher trainjob creates a Kubeflow Trainer TrainJob from inside the cluster, but this step "
            f"has no in-cluster service account ({e}); for a local run set train.launcher torchrun"
        ) from None
    return client.ApiClient()


def trainjob_name(config: RunConfig, run_id: str, round_index: int) -> str:
    """An RFC 1035 label naming the round's TrainJob: the same for a retry of the step, another
    for another config under the same run id (a run id is a UI parameter, which two runs may
    share: the second must neither wait for the first's TrainJob nor take its outputs). A run name
    starting with a digit ("7b-run") gets ``NAME_PREFIX``, which the TrainJob CRD needs; others keep
    their name as it is."""
    digest = hashlib.sha256(f"{run_id}/{config.method}/{config_digest(config)}".encode()).hexdigest()[:10]
    stem = config.name[:30].rstrip("-")
    return f"{NAME_PREFIX if stem[0].isdigit() else ''}{stem}-{digest}-r{round_index}"


def round_prefix(config: RunConfig, run_id: str, round_index: int) -> str:
    """Where the round's TrainJob finds its inputs and leaves its outputs in the store: a folder
    named as the TrainJob, so that a retry finds what its earlier attempt left, and nothing else does."""
    return f"{store_prefix(config, run_id, 'trainjob')}/{trainjob_name(config, run_id, round_index)}"


def rank_pod_patch(config: RunConfig) -> models.TrainerV1alpha1RuntimePatch:
    """What the runtime's pod template lacks for this run's rank pods, as a runtime patch of its
    ``TRAINER_JOB``: the run's ``resources.node_selector`` and ``tolerations`` (GPU nodes are tainted,
    docs/deploy.md: without them the ranks stay Pending or land elsewhere), a memory-backed /dev/shm
    (:data:`SHARED_MEMORY`), the secret ``store.ca_bundle_secret`` where set (read-only at ``CA_BUNDLE_MOUNT``,
    where the trainer's ``SSL_CERT_FILE`` points, as in the pipeline's steps), and no Istio sidecar (a profile
    namespace injects one, which keeps the Job from completing and can break torchrun's rendezvous; KFP opts its
    own pods out the same way)."""
    r = config.resources
    volumes = [SHARED_MEMORY]
    mounts = [models.IoK8sApiCoreV1VolumeMount(name=SHARED_MEMORY.name, mountPath="/dev/shm")]
    if secret := config.store.ca_bundle_secret:
        volumes.append(
            models.IoK8sApiCoreV1Volume(
                name=CA_BUNDLE_VOLUME, secret=models.IoK8sApiCoreV1SecretVolumeSource(secretName=secret)
            )
        )
        mounts.append(models.IoK8sApiCoreV1VolumeMount(name=CA_BUNDLE_VOLUME, mountPath=CA_BUNDLE_MOUNT, readOnly=True))
    pod = models.TrainerV1alpha1PodTemplatePatch(
        metadata=models.IoK8sApimachineryPkgApisMetaV1ObjectMeta(annotations={"sidecar.istio.io/inject": "false"}),
        spec=models.TrainerV1alpha1PodSpecPatch(
            nodeSelector=r.node_selector or None,
            tolerations=[models.IoK8sApiCoreV1Toleration(**t.model_dump(exclude_none=True)) for t in r.tolerations]
            or None,
            volumes=volumes,
            containers=[models.TrainerV1alpha1ContainerPatch(name=TRAINER_JOB, volumeMounts=mounts)],
        ),
    )
    job = models.TrainerV1alpha1ReplicatedJobPatch(
        name=TRAINER_JOB,
        template=models.TrainerV1alpha1JobTemplatePatch(spec=models.TrainerV1alpha1JobSpecPatch(template=pod)),
    )
    return models.TrainerV1alpha1RuntimePatch(
        manager=PATCH_MANAGER,
        trainingRuntimeSpec=models.TrainerV1alpha1TrainingRuntimeSpecPatch(
            template=models.TrainerV1alpha1JobSetTemplatePatch(
                spec=models.TrainerV1alpha1JobSetSpecPatch(replicatedJobs=[job])
            )
        ),
    )


def trainjob(
    config: RunConfig, name: str, namespace: str, args: list[str], inputs: bytes, labels: dict | None = None
) -> dict:
    """The TrainJob running the distributed train step with ``args`` on every
    node, annotated with the sha256 of its ``inputs`` (:func:`inputs_record`)
    and labelled with the run's ``resources.labels`` and ``labels`` (its run
    and round: :func:`run_labels`), suspended until the step has uploaded the
    round's inputs. But for Kueue's queue label (:data:`KUEUE_QUEUE`), which
    the step adds then (:meth:`TrainJobRun.start`): Kueue would start a job
    in its queue whenever it admits it, inputs or not."""
    r = config.resources
    limits = {"cpu": r.cpu, "memory": r.memory}
    if r.gpus:
        limits[r.accelerator_type] = str(r.gpus)
    limits = {k: models.IoK8sApimachineryPkgApiResourceQuantity(actual_instance=v) for k, v in limits.items()}
    env = [
        models.IoK8sApiCoreV1EnvVar(
            name=var,
            valueFrom=models.IoK8sApiCoreV1EnvVarSource(
                secretKeyRef=models.IoK8sApiCoreV1SecretKeySelector(
                    name=config.store.secret_name, key=key, optional=config.store.uri.startswith("file://")
                )
            ),
        )
        for key, var in SECRET_KEYS.items()
    ]
    env += [models.IoK8sApiCoreV1EnvVar(name=k, value=v) for k, v in config.store.pod_environment().items()]
    job = models.TrainerV1alpha1TrainJob(
        apiVersion=f"{GROUP}/{VERSION}",
        kind="TrainJob",
        metadata=models.IoK8sApimachineryPkgApisMetaV1ObjectMeta(
            name=name,
            namespace=namespace,
            labels={
                "app.kubernetes.io/part-of": "tracefp4",
                **{k: v for k, v in r.labels.items() if k != KUEUE_QUEUE},
                **(labels or {}),
            },
            annotations={INPUTS_ANNOTATION: hashlib.sha256(inputs).hexdigest()},
        ),
        spec=models.TrainerV1alpha1TrainJobSpec(
            runtimeRef=models.TrainerV1alpha1RuntimeRef(
                name=config.train.trainjob_runtime, kind="ClusterTrainingRuntime", apiGroup=GROUP
            ),
            trainer=models.TrainerV1alpha1Trainer(
                image=config.image,
                command=["torchrun", "--max-restarts", "0", "-m", MODULE],  # the runtime sets torchrun's PET_* env
                args=args,
                env=env,
                numNodes=config.train.nodes,
                numProcPerNode=config.train.processes_per_node,
                resourcesPerNode=models.IoK8sApiCoreV1ResourceRequirements(limits=limits, requests=limits),
            ),
            runtimePatches=[rank_pod_patch(config)],
            suspend=True,  # until the step has uploaded the round's inputs (TrainJobRun.start)
        ),
    )
    return job.to_dict()


RUN_ID_LABEL, ROUND_LABEL = "tracefp4/run-id", "tracefp4/round"


def run_labels(run_id: str, round_index: int) -> dict[str, str]:
    """A round's TrainJob's labels: its round and, where it makes a label value
    (a KFP job id, a local run's id), its run id, so that ``kubectl get
    trainjobs -l tracefp4/run-id=<run id>`` finds a run's jobs."""
    labels = {ROUND_LABEL: str(round_index)}
    if run_id and re.match(LABEL_VALUE, run_id):
        labels[RUN_ID_LABEL] = run_id
    return labels


def dry_run(config: RunConfig, api: client.ApiClient | None = None, namespace: str | None = None) -> None:
    """Ask the API server to create a TrainJob of this run's settings without
    creating it (``dryRun=All``): the server checks this pod's right to create
    one, the Trainer's webhook its runtime and fields. The pipeline's first
    task runs it, so that a misspelt runtime or a missing RBAC rule fails the
    run before any step holds a GPU, not round 0's train step after its
    rollout. The same for a Kueue queue ``resources.labels`` names: the
    namespace must have that LocalQueue, and Kueue must queue TrainJobs (its
    webhook suspends one created in a queue unsuspended), else the train step
    would hand its TrainJob to a queue that never starts it. Raises
    :class:`DistributedError` with the server's reason."""
    api, namespace = api or in_cluster_api(), namespace or _namespace()
    queue = config.resources.labels.get(KUEUE_QUEUE)
    if queue:
        check_local_queue(api, namespace, queue)
    name = trainjob_name(config, "dry-run", config.rl.run_rounds().start)
    body = trainjob(config, name, namespace, [], b"")
    if queue:  # as the step hands it over
        body["metadata"]["labels"][KUEUE_QUEUE], body["spec"]["suspend"] = queue, False
    created = _answered(
        lambda: client.CustomObjectsApi(api).create_namespaced_custom_object(
            GROUP, VERSION, namespace, PLURAL, body, dry_run="All"
        ),
        f"the Kubernetes API refused a TrainJob of this run's settings in {namespace} (asked before any step runs, "
        "without creating it)",
        "a TrainJob's dry run",
    )
    if queue and not _suspended(created):
        raise DistributedError(
            f"resources.labels puts the run's TrainJobs in Kueue's queue {queue!r}, but Kueue does not queue "
            "TrainJobs in this cluster: enable its TrainJob integration (trainer.kubeflow.org/trainjob in its "
            "integrations.frameworks), or leave the label out to run them outside the queue"
        )
    if _queue(created):  # Kueue queues the run's TrainJobs: the train step reads their Workloads
        check_workloads_readable(api, namespace)


# Kueue's API group, and its versions, newest first (v1beta1 is deprecated but served up to Kueue 0.19 at least)
KUEUE, KUEUE_VERSIONS = "kueue.x-k8s.io", ("v1beta2", "v1beta1")


def in_kueue(call):
    """``call(version)``'s answer in the newest of Kueue's API versions the
    cluster serves (a 404 that names no object: that version is not);
    None where it serves none."""
    for version in KUEUE_VERSIONS:
        try:
            return call(version)
        except ApiException as e:
            if e.status != 404 or _not_found_name(e) is not None:
                raise
    return None


def check_local_queue(api: client.ApiClient, namespace: str, queue: str) -> None:
    """That ``namespace`` has Kueue's LocalQueue ``queue``; else a :class:`DistributedError` saying so."""
    said = f"resources.labels puts the run's TrainJobs in Kueue's queue {queue!r}, but"
    custom = client.CustomObjectsApi(api)
    try:
        found = in_kueue(lambda v: custom.get_namespaced_custom_object(KUEUE, v, namespace, "localqueues", queue))
    except ApiException as e:
        if e.status == 404:
            raise DistributedError(
                f"{said} namespace {namespace} has none of that name (`kubectl -n {namespace} get localqueues`)"
            ) from None
        raise DistributedError(f"{said} reading it: {_reason(e)}") from None
    except urllib3.exceptions.HTTPError as e:
        raise DistributedError(f"{said} the Kubernetes API did not answer: {e}") from None
    if found is None:
        raise DistributedError(f"{said} the cluster serves no Kueue LocalQueues (is Kueue installed?)")


def check_workloads_readable(api: client.ApiClient, namespace: str) -> None:
    """That this pod may list Kueue's Workloads in ``namespace``, as the train
    step does while its TrainJob waits in a queue (:meth:`TrainJobRun.workload`)."""
    custom = client.CustomObjectsApi(api)
    _answered(
        lambda: in_kueue(lambda v: custom.list_namespaced_custom_object(KUEUE, v, namespace, "workloads", limit=1)),
        f"Kueue queues the run's TrainJobs, but the train step could not read their Workloads in {namespace} (the "
        "Role in manifests/base/kfp/pipeline-runner.yaml lets it)",
        "a list of Kueue's Workloads",
    )


def _answered(call, refused: str, asked: str):
    """``call()``'s answer from the API server; a refusal is a :class:`DistributedError`
    of ``refused`` and the server's reason, no answer one that names what was ``asked``."""
    try:
        return call()
    except ApiException as e:
        raise DistributedError(f"{refused}: {_reason(e)}") from None
    except urllib3.exceptions.HTTPError as e:
        raise DistributedError(f"the Kubernetes API did not answer {asked}: {e}") from None


class TrainJobRun:
    """One round's TrainJob: upload the inputs, create, watch, fetch the outputs, delete."""

    def __init__(
        self,
        config: RunConfig,
        run_id: str,
        round_index: int,
        api: client.ApiClient,
        namespace: str | None = None,
        poll_s: float = 5.0,
    ):
        self.config, self.run_id, self.round_index = config, run_id, round_index
        self.api, self.pods = client.CustomObjectsApi(api), client.CoreV1Api(api)
        self.poll_s = poll_s
        self.name = trainjob_name(config, run_id, round_index)
        self.namespace = namespace or _namespace()
        self.prefix = round_prefix(config, run_id, round_index)
        self.store = open_store(config.store.uri, create_bucket=config.store.create_bucket)

    def uri(self, name: str) -> str:
        """The store URI of ``name`` in the round's folder."""
        return self.key_uri(f"{self.prefix}/{name}")

    def key_uri(self, key: str) -> str:
        return f"{self.config.store.uri.rstrip('/')}/{key}"

    def run(
        self,
        policy: Path,
        state: Path,
        trajectories: Path,
        guidance: Path,
        out: Path,
        out_state: Path,
        round_stats: dict,
        echo=print,
    ):
        """The history rows; the new policy in ``out``, and ``out_state``
        standing for its trainer state in the store
        (:func:`.checkpoint.write_location`). Raises :class:`DistributedError`
        with the TrainJob's reason. A retry of the step whose earlier attempt's
        ranks finished the round from the same inputs takes their outputs
        instead of training it again."""
        inputs = inputs_record(policy, state, trajectories, guidance)
        if self.finished(inputs):
            echo(f"trainjob {self.namespace}/{self.name}: an earlier attempt of this step trained the round")
            self.let_go(echo)  # where that attempt ended before deleting it
        else:
            self.train(inputs, policy, state, trajectories, guidance, round_stats, echo)
        fetch(self.uri("new-policy"), into=out)  # not through the cache: that would be a second copy
        # the trainer state stays where the ranks left it, and out_state stands for it: only the next round's
        # ranks read it, and at the paper's scale it is 420 GB, which the step's pod would download and KFP keep
        manifest = self.store.get_bytes(f"{self.prefix}/new-state/{MANIFEST}")
        write_location(out_state, self.uri("new-state"), manifest)
        self.forget_inputs(policy, state)
        self.remember("new-policy")
        return json.loads(self.store.get_bytes(f"{self.prefix}/history.json"))

    def finished(self, inputs: bytes) -> bool:
        """Whether the round's outputs are all in the store (rank 0 uploads the
        history, then each folder with its manifest last), trained from
        ``inputs`` (:func:`inputs_record`): a run id is a UI parameter, and a
        second submission under it must train its rounds from its own
        inputs, not take what the first trained from others."""
        keys = set(self.store.list(self.prefix + "/"))
        return {f"{self.prefix}/{name}" for name in OUTPUTS} <= keys and self.recorded(inputs)

    def ready(self, record: bytes) -> bool:
        """Whether the inputs are all in the store where the ranks read them (:func:`ready_record`, :data:`READY`)."""
        try:
            return self.store.get_bytes(f"{self.prefix}/{READY}") == record
        except ArtifactNotFound:
            return False

    def recorded(self, inputs: bytes) -> bool:
        """Whether the round's folder records ``inputs`` as what it was last trained from (:data:`INPUTS`)."""
        try:
            return self.store.get_bytes(f"{self.prefix}/{INPUTS}") == inputs
        except ArtifactNotFound:
            return False

    def train(
        self, inputs: bytes, policy: Path, state: Path, trajectories: Path, guidance: Path, round_stats: dict, echo
    ) -> None:
        """Run the round's TrainJob on ``inputs`` (their record) to its end and
        delete it; or wait for the one an earlier attempt of the step left on
        the same inputs (:meth:`adopt`). The TrainJob is created suspended
        before anything is uploaded, and started once the inputs are in the
        store (:meth:`start`): the name is the round's claim, so a second
        submission of these settings under the same run id meets it
        (:meth:`adopt`, or a 409) instead of uploading over this one's inputs.
        Its ranks wait for the record that the inputs are all in the store
        (:data:`READY`, :func:`~tracefp4.components.distributed.wait_for_inputs`),
        should they start before, as in a namespace where Kueue queues every
        TrainJob (a LocalQueue named ``default``) and starts it when it admits
        it; the step stamps a heartbeat beside it while it uploads, by which
        they tell a long upload from a step that died."""
        with exit_on_sigterm():  # a terminated run's step deletes its TrainJob too: its ranks hold the GPUs
            job = self.adopt(inputs, echo)
            ours = True  # from here a failure or SIGTERM deletes the job, also one the create call made as it died
            try:
                folders = self.input_folders(policy, state)
                record = ready_record(inputs, folders)
                if job is not None and _awaited(job) not in (None, hashlib.sha256(record).hexdigest()):
                    echo(f"trainjob {self.namespace}/{self.name}: its ranks wait for another record of the inputs")
                    self.delete(echo, wait=True)  # they would wait in vain (made by another version's step)
                    job = None
                # an earlier attempt uploaded them; or made the job with an older tracefp4, which started it then
                ready = self.ready(record) or (job is not None and "--inputs" not in _args(job))
                if job is None:
                    args = rank_arguments(
                        self.uri("config.json"),
                        folders["policy"],
                        folders["state"],
                        self.uri("trajectories.jsonl"),
                        self.uri("guidance.json"),
                        self.uri("round_stats.json"),
                        self.run_id,
                        self.uri("new-policy"),
                        self.uri("new-state"),
                        self.uri("history.json"),
                        (self.uri(READY), hashlib.sha256(record).hexdigest(), self.config.train.timeout_seconds),
                    )
                    labels = run_labels(self.run_id, self.round_index)
                    job = self.create(trainjob(self.config, self.name, self.namespace, args, inputs, labels), echo)
                    if job is None:
                        ours = False
                        raise DistributedError(
                            f"creating TrainJob {self.namespace}/{self.name}: another attempt or submission created "
                            "it meanwhile"
                        )
                suspended, queue = _suspended(job), _queue(job)
                if suspended and queue not in (None, self.config.resources.labels.get(KUEUE_QUEUE, queue)):
                    self.move(queue, echo)  # Kueue put it in the namespace's default queue: to the run's, at once
                if not ready:
                    with heartbeat(self.store, f"{self.prefix}/{READY}{UPLOADING}", self.config.train.timeout_seconds):
                        self.store.delete(f"{self.prefix}/{READY}")  # first: the ranks wait
                        self.clear_other_inputs_round(inputs)
                        self.store.put_bytes(f"{self.prefix}/{INPUTS}", inputs)  # before the ranks write any output
                        self.upload(policy, state, trajectories, guidance, round_stats, folders, echo)
                    self.store.put_bytes(f"{self.prefix}/{READY}", record)
                if suspended and queue is None:
                    self.start(echo)
                try:
                    self.wait(echo)
                except DistributedError as e:  # the ranks' own words, read before the deletion takes their pods
                    raise DistributedError(f"{e}{self.rank_report()}") from None
            finally:
                if ours:
                    self.let_go(echo)

    def let_go(self, echo) -> None:
        """Delete the TrainJob; where the API server refuses, or does not
        answer within ``train.timeout_seconds``, say so with the command that
        deletes it. The step ends as its training did: with the ranks' error,
        which a failed deletion must not replace, or with their outputs, in
        the store already (a retry takes them: :meth:`finished`)."""
        try:
            self.delete(echo)
        except DistributedError as e:
            echo(f"{e}; not deleted: `kubectl -n {self.namespace} delete {PLURAL}.{GROUP} {self.name}`")

    def clear_other_inputs_round(self, inputs: bytes) -> None:
        """Before the round is trained from ``inputs``: delete what the round's
        folder holds from other inputs (another submission of these settings
        under the same run id, or none recorded), its outputs (each folder's
        manifest first) and its ranks' sharded checkpoints, so that neither a
        retry (:meth:`finished`) nor the ranks (which resume from the newest
        complete checkpoint) take them for this one's. A retry of an attempt
        on the same inputs keeps them: its ranks resume where it stopped."""
        if self.recorded(inputs):
            return
        self.store.delete(f"{self.prefix}/history.json")  # first: the round no longer looks finished
        for name in ("new-policy", "new-state"):
            delete_folder(self.store, f"{self.prefix}/{name}")
        clear_checkpoints(self.store, checkpoints_prefix(self.config, self.run_id, self.round_index))

    def input_folders(self, policy: Path, state: Path) -> dict[str, str]:
        """The store URIs the ranks read the policy and trainer state from: the
        folder a round's trainer state stands for (:func:`.checkpoint.write_location`),
        an earlier round's outputs of the same content where the store has them
        (:meth:`stored`), else this round's own folders, which :meth:`upload` fills."""
        return {
            name: location(Path(folder)) or self.stored(Path(folder)) or self.uri(name)
            for name, folder in (("policy", policy), ("state", state))
        }

    def upload(
        self,
        policy: Path,
        state: Path,
        trajectories: Path,
        guidance: Path,
        round_stats: dict,
        folders: dict[str, str],
        echo,
    ) -> None:
        """The round's inputs into the store: the policy and trainer state where
        ``folders`` (:meth:`input_folders`) names this round's own folders."""
        self.store.put_bytes(f"{self.prefix}/config.json", self.config.model_dump_json().encode())
        self.store.put_bytes(f"{self.prefix}/round_stats.json", json.dumps(round_stats).encode())
        self.store.upload(f"{self.prefix}/trajectories.jsonl", trajectories)
        self.store.upload(f"{self.prefix}/guidance.json", guidance)
        for name, folder in (("policy", policy), ("state", state)):
            if folders[name] == self.uri(name):
                upload_folder(Path(folder), open_store(self.uri(name)))
            else:
                echo(f"trainjob {self.namespace}/{self.name}: {name} already in the store at {folders[name]}")

    def _pointer(self, manifest: bytes) -> str:
        """Where the store key of this config's output folder with this ``manifest`` is recorded (by its sha256):
        per config, as the rounds' folders are (:func:`trainjob_name`), so that no other config takes or
        deletes them."""
        return (
            f"{store_prefix(self.config, self.run_id, 'trainjob')}/{BY_MANIFEST}/{config_digest(self.config)}/"
            f"{hashlib.sha256(manifest).hexdigest()}"
        )

    def stored(self, folder: Path) -> str | None:
        """The store URI of a folder of ``folder``'s content an earlier round's
        ranks wrote, if any: a round's policy is the previous round's new one,
        which that round's step fetched from the store (at Qwen3.5-35B-A3B
        70 GB, not uploaded again). Found by
        the sha256 of the folder's manifest (:meth:`remember`), and taken only
        if the manifest there is the same, byte for byte."""
        key = self._stored_key(folder)
        return None if key is None else self.key_uri(key)

    def _stored_key(self, folder: Path) -> str | None:
        """:meth:`stored`'s folder as a store key."""
        manifest = (folder / MANIFEST).read_bytes()
        try:
            key = self.store.get_bytes(self._pointer(manifest)).decode()
            same = self.store.get_bytes(f"{key}/{MANIFEST}") == manifest
        except ArtifactNotFound:
            return None
        return key if same else None

    def forget_inputs(self, policy: Path, state: Path) -> None:
        """Delete the round's policy, trainer state and trajectories from the
        store once its outputs are out: this round's upload of them, the
        earlier round's policy it took (:meth:`stored`) and its record, and the
        earlier round's trainer state its input stood for. At the paper's scale
        they are 490 GB a round. KFP keeps its own copy of every round's policy
        and trajectories, but of a trainer state only the folder that stood for
        it: a run goes on from its last round's. Each folder loses its manifest
        first, so that a half-deleted one is never taken for whole."""
        self.store.delete(f"{self.prefix}/{READY}")  # first: no rank of a retry takes what is left for whole
        self.store.delete(f"{self.prefix}/{READY}{UPLOADING}")
        self.store.delete(f"{self.prefix}/trajectories.jsonl")  # a retry takes the outputs (finished), or uploads
        folders = {f"{self.prefix}/policy", f"{self.prefix}/state"}
        for folder in (policy, state):
            key = self._stored_key(folder)  # only a folder of the same manifest: this input's copy
            if key is not None:
                folders.add(key)
                self.store.delete(self._pointer((folder / MANIFEST).read_bytes()))
        before = f"{round_prefix(self.config, self.run_id, self.round_index - 1)}/new-state"
        if location(state, check=False) == self.key_uri(before):  # the trainer state its input stood for
            folders.add(before)
        for folder in sorted(folders - {f"{self.prefix}/new-policy", f"{self.prefix}/new-state"}):  # never outputs
            delete_folder(self.store, folder)

    def remember(self, name: str) -> None:
        """Record where the ranks' output folder ``name`` is, by the sha256 of its
        manifest, for the next round to find it (:meth:`stored`)."""
        manifest = self.store.get_bytes(f"{self.prefix}/{name}/{MANIFEST}")
        self.store.put_bytes(self._pointer(manifest), f"{self.prefix}/{name}".encode())

    def adopt(self, inputs: bytes, echo) -> dict | None:
        """The round's TrainJob where it is already there, left running,
        queued in Kueue or completed by an earlier attempt of the step on the
        same ``inputs`` (its annotation): it is waited for, and nothing is
        uploaded under its ranks (but the inputs a job Kueue queued at its
        creation waits for, where that attempt died uploading them). One left
        failed, finished from other inputs, being deleted, or suspended by an
        attempt that died before it started it (outside Kueue; or made by an
        older tracefp4, whose ranks do not wait for their inputs), is deleted
        (None). One running, queued or suspended from other inputs is another
        submission of these settings under the same run id, and fails the
        step: its inputs in the store are not overwritten, nor its outputs
        taken for this one's."""
        left = self.read(echo)
        if left is None:
            return None
        where, metadata = f"trainjob {self.namespace}/{self.name}", left.get("metadata") or {}
        if metadata.get("deletionTimestamp"):  # an attempt's deletion (its SIGTERM) still under way
            echo(f"{where}: being deleted by an earlier attempt, waiting for it to go")
            self.delete(echo, wait=True)
            return None
        said = (metadata.get("annotations") or {}).get(INPUTS_ANNOTATION)
        # without the annotation (created by an older tracefp4), the round's record tells its inputs
        same = self.recorded(inputs) if said is None else said == hashlib.sha256(inputs).hexdigest()
        conditions = _conditions(left.get("status") or {})
        suspended = _suspended(left)
        # the attempt died before it started the job; or an older tracefp4 made it, whose ranks read their inputs
        # as soon as they start (Kueue may start one it queued at once)
        if same and suspended and (not _queue(left) or "--inputs" not in _args(left)):
            echo(f"{where}: left suspended by an earlier attempt, deleting it")
            self.delete(echo, wait=True)
            return None
        if same and "Failed" not in conditions:
            echo(f"{where}: left by an earlier attempt on the same inputs: waiting for it")
            return left
        if "Failed" in conditions or "Complete" in conditions:
            echo(f"{where}: left {'failed' if 'Failed' in conditions else 'finished from other inputs'}, deleting it")
            self.delete(echo, wait=True)
            return None
        raise DistributedError(
            f"TrainJob {self.namespace}/{self.name} is {_stage(left)} this round from "
            "other inputs (the policy, trainer state, trajectories or guidance differ): another submission of these "
            f"settings under run id {self.run_id!r}; wait for it to end (or `kubectl -n {self.namespace} delete "
            f"trainjob {self.name}` if that run is gone), or submit under another run id"
        )

    def create(self, body: dict, echo) -> dict | None:
        """Create the TrainJob (:meth:`adopt` found none, or deleted it): the
        job as created (Kueue's webhook may have put it in a queue); None
        where one is there already (409: another attempt created it since
        adopt looked)."""
        try:
            job = self.api.create_namespaced_custom_object(GROUP, VERSION, self.namespace, PLURAL, body)
        except ApiException as e:
            if e.status == 409:
                return None
            raise DistributedError(f"creating TrainJob {self.namespace}/{self.name}: {_reason(e)}") from None
        if queue := _queue(job):
            echo(f"trainjob {self.namespace}/{self.name}: created in Kueue's queue {queue!r}, which starts it")
        else:
            echo(f"trainjob {self.namespace}/{self.name}: created, suspended while its inputs upload")
        return job

    def start(self, echo) -> None:
        """Start the TrainJob, its inputs in the store: hand it to the run's
        Kueue queue (``resources.labels``; a suspended job may change queues),
        which starts it once it admits it, or else unsuspend it."""
        queue = self.config.resources.labels.get(KUEUE_QUEUE)
        patch = {"metadata": {"labels": {KUEUE_QUEUE: queue}}} if queue else {"spec": {"suspend": False}}
        try:
            self.api.patch_namespaced_custom_object(GROUP, VERSION, self.namespace, PLURAL, self.name, patch)
        except ApiException as e:
            raise DistributedError(f"starting TrainJob {self.namespace}/{self.name}: {_reason(e)}") from None
        said = f"handed to Kueue's queue {queue!r}" if queue else "started"
        echo(f"trainjob {self.namespace}/{self.name}: {said} ({self.config.train.world_size} processes)")

    def move(self, queue: str, echo) -> None:
        """Move the TrainJob from Kueue's ``queue``, where Kueue's webhook put
        it, to the run's (:meth:`start`); where Kueue started it there first
        (a running job's queue is fixed), it stays: its ranks wait for the
        inputs all the same."""
        try:
            self.start(echo)
        except DistributedError:
            job = self.read(echo)
            if job is None or _suspended(job):
                raise
            echo(f"trainjob {self.namespace}/{self.name}: started in Kueue's queue {queue!r} before it could move")

    def wait(self, echo) -> None:
        """Until the TrainJob completes; its status changes go to the step's log.
        Failed, deleted, or ``train.timeout_seconds`` without progress: an error.
        Progress is the ranks' job (:data:`TRAINER_JOB`) with all its pods ready
        or done (``ready`` or ``succeeded`` in the Trainer's ``status.jobsStatus``); ``active``
        counts Pending pods too, so unschedulable ranks, or a Trainer that
        never picks the job up, would otherwise keep the step waiting forever.
        Every poll that shows progress restarts the clock: a long run is not cut
        short. Time the job waits in Kueue's queue for quota (not admitted
        yet, or evicted: preempted, say, after which its ranks resume from
        their last checkpoint) stops the clock instead, and counts against
        ``train.queue_timeout_seconds``; the log says what Kueue says of it.
        A poll the API server does not answer (5xx, 429, no connection) is
        no news, and the clock runs on."""
        # stalled: seconds without progress, the time queued for quota left out (a requeue after Kueue evicted
        # ranks that never got ready, its waitForPodsReady, must not restart it); queued: for quota, since
        stalled, polled, last, queued_since = 0.0, time.monotonic(), None, None
        while True:
            now = time.monotonic()
            job = self.read(echo, now - stalled)
            if job is None:
                raise DistributedError(f"TrainJob {self.namespace}/{self.name}: deleted while the step waited for it")
            status = job.get("status") or {}
            queue = _suspended(job) and _queue(job)
            queued, workload = False, None
            if queue:  # Kueue's news of it: its Workload
                workload = self.workload(job, echo, now - stalled)
                summary = f"suspended in Kueue's queue {queue!r}: {_workload_news(workload)}"
                queued = _waits_for_quota(workload)
                queued_since = (queued_since or now) if queued else None
                if queued and now - queued_since > self.config.train.queue_timeout_seconds:
                    raise DistributedError(
                        f"TrainJob {self.namespace}/{self.name} waited {self.config.train.queue_timeout_seconds} s "
                        f"(train.queue_timeout_seconds) in Kueue's queue {queue!r}, which says: "
                        f"{_workload_news(workload)}"
                    )
            else:
                summary, queued_since = _summary(status), None
            if summary != last:
                echo(f"trainjob {self.namespace}/{self.name}: {summary}")
                last = summary
            conditions = _conditions(status)
            if "Complete" in conditions:
                return
            if "Failed" in conditions:
                c = conditions["Failed"]
                raise DistributedError(
                    f"TrainJob {self.namespace}/{self.name} failed: {c.get('reason', '?')}: {c.get('message', '')}"
                )
            if _progressing(status):
                stalled = 0.0
            elif not queued:
                stalled += now - polled
                if stalled > self.config.train.timeout_seconds:
                    raise DistributedError(self.stalled(job, workload))
            polled = now
            time.sleep(self.poll_s)

    def workload(self, job: dict, echo, since: float) -> dict | None:
        """Kueue's Workload of ``job`` (its ``kueue.x-k8s.io/job-uid`` label),
        None where Kueue has made none; a Workload Kueue deactivated (its
        requeuing limit reached, or by hand) or finished (the job failed to
        start), which it never admits again, is a :class:`DistributedError`."""
        selector = f"kueue.x-k8s.io/job-uid={(job.get('metadata') or {}).get('uid')}"
        found = self._asked(
            "Kueue's Workloads unreadable",
            lambda: in_kueue(
                lambda v: self.api.list_namespaced_custom_object(
                    KUEUE, v, self.namespace, "workloads", label_selector=selector
                )
            ),
            echo,
            since,
        )
        workload = next(iter((found or {}).get("items") or []), None)
        if workload is None:
            return None
        finished = _conditions(workload.get("status") or {}).get("Finished")
        if (workload.get("spec") or {}).get("active") is False or finished:
            verb, why = (
                ("finished", finished.get("message", "")) if finished else ("deactivated", _workload_news(workload))
            )
            raise DistributedError(
                f"TrainJob {self.namespace}/{self.name}: Kueue {verb} its Workload "
                f"{(workload.get('metadata') or {}).get('name')} ({why}), and will not admit it"
            )
        return workload

    def read(self, echo, since: float | None = None) -> dict | None:
        """The TrainJob as the API server has it; None where there is none. A
        poll it does not answer (5xx, 429, no connection: restarting, busy or
        out of reach) is no news, said once and polled again until
        ``train.timeout_seconds`` from ``since`` (default now) have passed;
        other errors (forbidden) fail the step at once."""
        return self._asked(
            "status unreadable",
            lambda: self.api.get_namespaced_custom_object(GROUP, VERSION, self.namespace, PLURAL, self.name),
            echo,
            since,
        )

    def _asked(self, unanswered: str, call, echo, since: float | None = None):
        """``call()``'s answer from the API server, None where it says 404 (no
        such job). One it does not give (5xx, 429, no connection) is said once
        as ``unanswered`` and asked again until ``train.timeout_seconds`` from
        ``since`` (default now) have passed; other errors (forbidden) fail at once."""
        since, last = time.monotonic() if since is None else since, None
        while True:
            try:
                return call()
            except (ApiException, urllib3.exceptions.HTTPError) as e:
                code = getattr(e, "status", None)  # None: no answer at all
                if code == 404:
                    return None
                if code is not None and code < 500 and code != 429:
                    raise DistributedError(f"TrainJob {self.namespace}/{self.name}: {_reason(e)}") from None
                said = f"{unanswered} ({_reason(e) if isinstance(e, ApiException) else e})"
                if said != last:
                    echo(f"trainjob {self.namespace}/{self.name}: {said}")
                    last = said
                if time.monotonic() - since > self.config.train.timeout_seconds:
                    raise DistributedError(f"TrainJob {self.namespace}/{self.name}: {said}") from None
                time.sleep(self.poll_s)

    def stalled(self, job: dict, workload: dict | None) -> str:
        """Why the TrainJob made no progress for ``train.timeout_seconds``, and
        where to look (``workload``: Kueue's, where it is in Kueue's queue)."""
        timeout, where = self.config.train.timeout_seconds, f"TrainJob {self.namespace}/{self.name}"
        status = job.get("status") or {}
        if workload is not None:
            return (
                f"{where} is in Kueue's queue {_queue(job)!r}, and Kueue has not started it in {timeout} s "
                f"(train.timeout_seconds), nor waits for quota to: {_workload_news(workload)}"
            )
        if _suspended(job) and _queue(job):
            return (
                f"{where} is in Kueue's queue {_queue(job)!r}, and Kueue has made no Workload of it in {timeout} s "
                "(train.timeout_seconds): does Kueue manage TrainJobs here (trainer.kubeflow.org/trainjob in its "
                "integrations.frameworks)?"
            )
        if _suspended(job):  # the step started it (outside Kueue's queues: wait)
            return (
                f"{where} is still suspended {timeout} s (train.timeout_seconds) after the step started it: does "
                "Kueue manage jobs without a queue here (manageJobsWithoutQueueName)? Then put the run in a "
                f"LocalQueue: resources.labels {KUEUE_QUEUE}: <its name>"
            )
        if not status:
            return (
                f"{where} has no status after {timeout} s: is Kubeflow Trainer installed with runtime "
                f"{self.config.train.trainjob_runtime}? (docs/deploy.md)"
            )
        return (
            f"{where}: waited {timeout} s (train.timeout_seconds) for the pods of its {TRAINER_JOB} job to be ready, "
            f"last status: {_summary(status)}; below, what its pods say (unschedulable: resources, "
            "resources.node_selector, resources.tolerations; image pull)"
        )

    def rank_report(self, pods: int = 4, lines: int = 30) -> str:
        """What up to ``pods`` of the job's rank pods say, failed ones first, as
        text to append to an error before the deletion takes them: a pod's last
        ``lines`` of the trainer container's log (where a failing rank's
        traceback is), or why it is not running (unschedulable, image pull)."""
        try:
            found = self.pods.list_namespaced_pod(
                self.namespace, label_selector=f"jobset.sigs.k8s.io/jobset-name={self.name}"
            ).items
            found.sort(key=lambda pod: (pod.status.phase != "Failed", pod.metadata.name))
            report = []
            for pod in found[:pods]:
                name, phase = pod.metadata.name, pod.status.phase
                if phase == "Pending":
                    report.append(f"--- {name} (Pending) ---\n{_waiting(pod)}")
                else:
                    log = self.pods.read_namespaced_pod_log(
                        name, self.namespace, container=TRAINER_JOB, tail_lines=lines
                    )
                    report.append(f"--- {name} ({phase}), last {lines} lines ---\n{log.rstrip()}")
        except ApiException as e:
            return f"\n(the rank pods are unreadable: {_reason(e)})"
        return "".join(f"\n{part}" for part in report) or "\n(no rank pod found)"

    def delete(self, echo, wait: bool = False) -> None:
        """Delete the TrainJob with its pods (foreground); ``wait``: until it is
        gone, at most ``train.timeout_seconds`` (a rank pod on a lost node can
        stay Terminating, and with it the job)."""
        deleted = self._asked(
            "deletion unanswered",
            lambda: self.api.delete_namespaced_custom_object(
                GROUP, VERSION, self.namespace, PLURAL, self.name, propagation_policy="Foreground"
            ),
            echo,
        )
        if deleted is None:
            return  # there was none
        echo(f"trainjob {self.namespace}/{self.name}: deleted")
        since = time.monotonic()
        while wait and self.read(echo, since) is not None:  # an API server that does not answer is no news here too
            if time.monotonic() - since > self.config.train.timeout_seconds:
                raise DistributedError(
                    f"TrainJob {self.namespace}/{self.name} is still there {self.config.train.timeout_seconds} s "
                    f"(train.timeout_seconds) after its deletion; `kubectl -n {self.namespace} get pods -l "
                    f"jobset.sigs.k8s.io/jobset-name={self.name}` shows what holds it (a pod Terminating on a lost "
                    "node?)"
                )
            time.sleep(self.poll_s)


@contextlib.contextmanager
def heartbeat(store, key: str, timeout_s: float):
    """Rewrite ``key`` in ``store`` every tenth of ``timeout_s`` (at most a
    minute) while the block runs: the ranks waiting for the round's inputs
    take a changed heartbeat for progress (:func:`~tracefp4.components.distributed.wait_for_inputs`),
    so that an upload longer than ``train.timeout_seconds`` (a first round's
    trainer state at the paper's scale, 420 GB) does not fail them. The first
    beat is written before the block starts, the rest by a thread. Removed after."""
    stop = threading.Event()

    def put(count: int) -> None:
        with contextlib.suppress(Exception):  # a beat the store missed only delays the next; the ranks time out
            store.put_bytes(key, str(count).encode())

    def beat():
        count = 1
        while not stop.wait(min(timeout_s / 10, 60)):
            put(count)
            count += 1

    put(0)  # there from the block's start, not from whenever the thread first runs
    beating = threading.Thread(target=beat, name="inputs-heartbeat", daemon=True)
    beating.start()
    try:
        yield
    finally:  # quickly, and without replacing the block's exception: a SIGTERM gives the step 30 s to clean up
        stop.set()
        beating.join(timeout=5)
        with contextlib.suppress(Exception):  # one left behind stops beating, and is deleted with the inputs
            store.delete(key)


@contextlib.contextmanager
def exit_on_sigterm():
    """SIGTERM (the run terminated, the node drained) raised as SystemExit
    inside the block, so that its ``finally`` clauses run: by default Python
    dies at once, and a TrainJob it created would keep its ranks and their
    GPUs until the round ends. The handler before is restored after."""

    def terminate(signum, frame):
        raise SystemExit(128 + signum)

    previous = signal.signal(signal.SIGTERM, terminate)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def _namespace() -> str:
    """The step's own namespace (where the pipeline runner may create TrainJobs)."""
    path = Path(SERVICE_ACCOUNT_NAMESPACE)
    if not path.exists():
        raise DistributedError(f"{path} is missing: a TrainJob is created from a pod inside the cluster")
    return path.read_text().strip()


def _workload_news(workload: dict | None) -> str:
    """What a Kueue Workload says of its admission: why it was evicted, or why it waits."""
    if workload is None:
        return "no Workload yet"
    for kind, state in (("Evicted", "True"), ("QuotaReserved", "False"), ("Admitted", "False")):
        c = _conditions(workload.get("status") or {}, state).get(kind)
        if c and c.get("message"):
            return f"{kind if state == 'True' else 'waiting'}: {c['message']}"
    return "pending"


# QuotaReserved=False reasons of a Workload that no quota freed up will admit: its LocalQueue or ClusterQueue is
# missing or stopped (Inadmissible; from Kueue 0.19 Misconfigured, Suspended), it asks for more than the queue
# can ever give or no flavor fits it (ExceedsMaxQuota, NoMatchingFlavor), or it is held (OnHold)
NEVER_ADMITTED = ("Inadmissible", "Misconfigured", "Suspended", "ExceedsMaxQuota", "NoMatchingFlavor", "OnHold")


def _waits_for_quota(workload: dict | None) -> bool:
    """Whether a Kueue Workload waits in its queue for capacity, which may
    take long (``train.queue_timeout_seconds``): for quota, or with quota
    reserved for an admission check (a ProvisioningRequest for nodes);
    rather than for a fault (no Workload, a queue Kueue cannot use: ``train.timeout_seconds``)."""
    if workload is None:
        return False
    status = workload.get("status") or {}
    if "QuotaReserved" in _conditions(status):
        checks = status.get("admissionChecks") or []
        return "Admitted" not in _conditions(status) and any(c.get("state") == "Pending" for c in checks)
    reason = _conditions(status, "False").get("QuotaReserved", {}).get("reason")
    return reason not in NEVER_ADMITTED


def _args(job: dict) -> list[str]:
    """The arguments a TrainJob gives its ranks."""
    return ((job.get("spec") or {}).get("trainer") or {}).get("args") or []


def _awaited(job: dict) -> str | None:
    """The sha256 of the record of the inputs a TrainJob's ranks wait for (``--inputs``), if any."""
    args = _args(job)
    return args[args.index("--inputs") + 2] if "--inputs" in args else None


def _stage(job: dict) -> str:
    """What a TrainJob left by another submission is doing with the round, as a verb for an error."""
    if not _suspended(job):
        return "training"
    return "queued for" if _queue(job) else "preparing"


def _suspended(job: dict) -> bool:
    """Whether a TrainJob is suspended (``spec.suspend``): by the step until it starts it, or by Kueue."""
    return bool((job.get("spec") or {}).get("suspend"))


def _queue(job: dict) -> str | None:
    """The Kueue LocalQueue a TrainJob is in (:data:`KUEUE_QUEUE`), if any."""
    return ((job.get("metadata") or {}).get("labels") or {}).get(KUEUE_QUEUE)


def _conditions(status: dict, state: str = "True") -> dict[str, dict]:
    """A TrainJob's or a Kueue Workload's ``status`` conditions of ``state`` (true ones by default), by type."""
    return {c["type"]: c for c in status.get("conditions", []) if c.get("status") == state}


def _progressing(status: dict) -> bool:
    """Whether the trainer's replicated job (:data:`TRAINER_JOB`) has all its pods
    ready, or has finished (the Trainer's JobStatus counts child Jobs); a
    runtime's initializer jobs finishing says nothing of the ranks."""
    return any(
        j.get("name") == TRAINER_JOB and (j.get("ready") or j.get("succeeded")) for j in status.get("jobsStatus", [])
    )


def _summary(status: dict) -> str:
    """One line of a TrainJob's status: its true conditions and its jobs' counts."""
    if not status:
        return "pending (no status yet)"
    conditions = [
        f"{c['type']}({c.get('reason', '')})" for c in status.get("conditions", []) if c.get("status") == "True"
    ]
    jobs = [
        f"{j.get('name')}: " + ", ".join(f"{k} {j[k]}" for k in ("ready", "active", "succeeded", "failed") if j.get(k))
        for j in status.get("jobsStatus", [])
    ]
    return "; ".join(conditions + jobs) or "running"


def _waiting(pod) -> str:
    """Why a pod is not running yet: its false conditions (PodScheduled:
    Unschedulable, "0/3 nodes are available: ...") and its containers' waiting reasons."""
    status = pod.status
    words = [f"{c.type}: {c.reason}: {c.message}" for c in status.conditions or [] if c.status == "False" and c.message]
    words += [
        f"container {c.name}: {c.state.waiting.reason}: {c.state.waiting.message or ''}".rstrip(": ")
        for c in status.container_statuses or []
        if c.state and c.state.waiting
    ]
    return "\n".join(words) or "no reason given yet"


def _not_found_name(e: ApiException) -> str | None:
    """The name of the object a 404 says is missing; None where the resource itself is not served."""
    try:
        return json.loads(e.body)["details"]["name"]
    except (TypeError, ValueError, KeyError):
        return None


def _reason(e: ApiException) -> str:
    try:
        return json.loads(e.body)["message"]
    except (TypeError, ValueError, KeyError):
        return f"HTTP {e.status} {e.reason}"
