"""The train step's Kubeflow Trainer TrainJob: the object it creates validates
against the Trainer v2.3.0 CRD's OpenAPI schema (tests/data/README.md names
its source), and the create / watch / fail / delete flow runs against a
loopback HTTP server that answers those Kubernetes API calls. That server is
not a cluster: no controller runs the TrainJob; the test plays its status
(and, for a success, the ranks' outputs in the store)."""

import copy
import hashlib
import json
import os
import re
import shutil
import signal
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import parse_qs, urlparse

import jsonschema
import pytest
import yaml
from kubernetes import client

from tracefp4.components.checkpoint import LOCATION, MANIFEST, CheckpointError, fetch, folder_digest, location
from tracefp4.components.distributed import UPLOADING, DistributedError, checkpoints_prefix
from tracefp4.components.model import build_model
from tracefp4.components.quant_config import BF16
from tracefp4.components.store import StoreError, open_store
from tracefp4.components.trainer import TrainConfig, Trainer
from tracefp4.pipelines import trainjob as module
from tracefp4.pipelines.trainjob import (
    GROUP,
    PATCH_MANAGER,
    PLURAL,
    TRAINER_JOB,
    VERSION,
    TrainJobRun,
    round_prefix,
    trainjob,
    trainjob_name,
)
from tracefp4.schemas import RunConfig, get_preset

CRD = Path(__file__).parent / "data" / "trainer.kubeflow.org_trainjobs.yaml"
NAMESPACE = "team-a"
RUN = "run-tj"


def strict(schema: dict) -> dict:
    """The CRD's structural schema with unknown fields refused (the API server
    would silently prune them: a misspelled field must fail here instead).
    CEL rules (x-kubernetes-validations) are not evaluated."""
    schema = copy.deepcopy(schema)

    def walk(node):
        if isinstance(node, dict):
            if "properties" in node and not node.get("x-kubernetes-preserve-unknown-fields"):
                node.setdefault("additionalProperties", False)
            for value in node.values():
                walk(value)
        elif isinstance(node, list):
            for value in node:
                walk(value)

    walk(schema)
    return schema


@pytest.fixture(scope="module")
def schema() -> dict:
    crd = yaml.safe_load(CRD.read_text())
    assert crd["spec"]["group"] == GROUP and crd["spec"]["names"]["plural"] == PLURAL
    (version,) = [v for v in crd["spec"]["versions"] if v["name"] == VERSION]
    return version["schema"]["openAPIV3Schema"]


@pytest.fixture(scope="module")
def validator(schema):
    return jsonschema.Draft7Validator(strict(schema))


def name_errors(schema: dict, name: str) -> list[str]:
    """The messages of the CRD's CEL rules on ``metadata.name`` that ``name`` breaks (the API
    server evaluates them, jsonschema does not). A rule of another form fails the test, so that a
    new release's rules are not skipped unseen."""
    errors = []
    for check in schema["x-kubernetes-validations"]:
        if m := re.fullmatch(r"self\.metadata\.name\.matches\('(.+)'\)", check["rule"]):
            ok = re.search(m[1], name) is not None  # CEL matches(): RE2, unanchored unless the pattern is
        elif m := re.fullmatch(r"size\(self\.metadata\.name\) <= (\d+)", check["rule"]):
            ok = len(name) <= int(m[1])
        else:
            raise AssertionError(f"a CRD rule this test cannot evaluate: {check['rule']}")
        if not ok:
            errors.append(check["message"])
    return errors


def domain_prefixed_path(value: str) -> bool:
    """k8s.io/apimachinery's validation.IsDomainPrefixedPath, which the Trainer's webhook applies to
    a runtime patch's manager: a DNS-1123 subdomain, '/', an HTTP path."""
    host, sep, path = value.partition("/")
    subdomain = r"[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*"
    return bool(
        sep
        and len(host) <= 253
        and re.fullmatch(subdomain, host)
        and re.fullmatch(r"[A-Za-z0-9/\-._~%!$&'()*+,;=:]+", path)
    )


def config(tmp_path, **train) -> RunConfig:
    data = get_preset("smoke").model_dump()
    data["store"]["uri"] = (tmp_path / "store").as_uri()
    data["rl"]["microbatch_size"] = 1
    data["train"] = {
        "launcher": "trainjob",
        "nodes": 2,
        "processes_per_node": 2,
        "timeout_seconds": 10,
        "precision": "fp32_master",
        **train,
    }
    data["resources"].update(gpus=2, accelerator_type="nvidia.com/gpu")  # one per process
    return RunConfig.model_validate(data)


def test_the_trainjob_validates_against_the_trainer_crd(tmp_path, validator):
    c = config(tmp_path)
    job = trainjob(c, trainjob_name(c, RUN, 3), NAMESPACE, ["--run-id", RUN], b"{}")
    validator.validate(job)
    assert job["metadata"]["annotations"] == {module.INPUTS_ANNOTATION: hashlib.sha256(b"{}").hexdigest()}
    trainer = job["spec"]["trainer"]
    assert (trainer["numNodes"], trainer["numProcPerNode"]) == (2, 2)
    assert trainer["resourcesPerNode"]["limits"]["nvidia.com/gpu"] == "2"
    assert job["spec"]["runtimeRef"] == {
        "apiGroup": GROUP,
        "kind": "ClusterTrainingRuntime",
        "name": "torch-distributed",
    }
    # the validator is strict: a misspelled field or a wrong type fails
    bad = copy.deepcopy(job)
    bad["spec"]["trainer"]["numProcsPerNode"] = 2
    with pytest.raises(jsonschema.ValidationError, match="numProcsPerNode"):
        validator.validate(bad)
    bad = copy.deepcopy(job)
    bad["spec"]["trainer"]["numNodes"] = "2"
    with pytest.raises(jsonschema.ValidationError):
        validator.validate(bad)


def test_trainjob_names_are_dns_labels_stable_per_round(tmp_path, schema):
    c = config(tmp_path)
    name = trainjob_name(c, RUN, 12)
    assert name == trainjob_name(c, RUN, 12) != trainjob_name(c, "other", 12)
    assert len(name) <= 63 and name.replace("-", "").isalnum() and name.islower()
    assert name.startswith(f"{c.name}-") and not name_errors(schema, name)  # a name that is valid stays as it was


@pytest.mark.parametrize("run_name", ["7b-run", "0", "9" * 63, "a" * 63, "x-" * 31 + "y"])
def test_trainjob_names_meet_the_crd_rules_whatever_the_run_name(tmp_path, schema, validator, run_name):
    c = config(tmp_path)
    c.name = run_name  # validated: any DNS label, so it may start with a digit
    stem = run_name[:30].rstrip("-")
    # the CRD refuses a TrainJob named after the run as it is when the run name starts with a digit
    assert bool(name_errors(schema, f"{stem}-0123456789-r0")) == run_name[0].isdigit()
    for round_index in (0, 199, 10**9):
        name = trainjob_name(c, RUN, round_index)
        assert name_errors(schema, name) == [] and name == trainjob_name(c, RUN, round_index)
        validator.validate(trainjob(c, name, NAMESPACE, [], b"{}"))
        # the prefix only where it is needed
        assert name.startswith(f"tj-{stem}-" if run_name[0].isdigit() else f"{stem}-")


def test_the_rank_pods_get_the_runs_placement_shared_memory_and_no_istio_sidecar(tmp_path, validator):
    c = config(tmp_path)
    # the GPU run config of docs/deploy.md
    c.resources.node_selector = {"nvidia.com/gpu.present": "true"}
    c.resources.tolerations = [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}]
    job = trainjob(c, trainjob_name(c, RUN, 0), NAMESPACE, [], b"{}")
    validator.validate(job)
    # one patch, keyed by a manager the Trainer's webhook accepts
    (patch,) = job["spec"]["runtimePatches"]
    assert patch["manager"] == PATCH_MANAGER and domain_prefixed_path(PATCH_MANAGER)
    assert not domain_prefixed_path("tracefp4") and not domain_prefixed_path("Tracefp4/x")
    # on the replicated job the TrainJob's trainer runs as: "node" in every runtime of Trainer v2.3.0
    # (manifests/base/runtimes/torch_distributed.yaml, pkg/constants Node); the Trainer refuses another name
    (replicated,) = patch["trainingRuntimeSpec"]["template"]["spec"]["replicatedJobs"]
    assert replicated["name"] == TRAINER_JOB == "node"
    pod = replicated["template"]["spec"]["template"]  # the Job's pod template
    shm = {  # NCCL's shared-memory transport: more than the container's default 64 MiB
        "volumes": [{"name": "dshm", "emptyDir": {"medium": "Memory"}}],
        "containers": [{"name": "node", "volumeMounts": [{"name": "dshm", "mountPath": "/dev/shm"}]}],
    }
    assert pod["spec"] == {
        "nodeSelector": {"nvidia.com/gpu.present": "true"},
        "tolerations": [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}],
        **shm,
    }
    assert pod["metadata"] == {"annotations": {"sidecar.istio.io/inject": "false"}}
    # the strict validator knows the path: a pod field the patch does not allow is refused
    bad = copy.deepcopy(job)
    bad["spec"]["runtimePatches"][0]["trainingRuntimeSpec"]["template"]["spec"]["replicatedJobs"][0]["template"][
        "spec"
    ]["template"]["spec"]["priorityClassName"] = "high"
    with pytest.raises(jsonschema.ValidationError, match="priorityClassName"):
        validator.validate(bad)
    # without a selector or tolerations the patch still turns the sidecar off and mounts /dev/shm, and sets nothing else
    c.resources.node_selector, c.resources.tolerations = {}, []
    job = trainjob(c, trainjob_name(c, RUN, 0), NAMESPACE, [], b"{}")
    validator.validate(job)
    (patch,) = job["spec"]["runtimePatches"]
    (replicated,) = patch["trainingRuntimeSpec"]["template"]["spec"]["replicatedJobs"]
    assert replicated["template"]["spec"]["template"] == {
        "metadata": {"annotations": {"sidecar.istio.io/inject": "false"}},
        "spec": shm,
    }


def test_the_rank_pods_get_the_stores_region_and_ca_bundle(tmp_path, validator):
    """As every step of the pipeline does: the secret store.ca_bundle_secret mounted read-only where
    SSL_CERT_FILE finds its ca.crt, and store.region; unset, neither (the test above: the pod spec
    holds /dev/shm alone)."""
    c = config(tmp_path)
    credentials = ["TRACEFP4_S3_ACCESS_KEY", "TRACEFP4_S3_SECRET_KEY"]
    job = trainjob(c, trainjob_name(c, RUN, 0), NAMESPACE, [], b"{}")
    assert [e["name"] for e in job["spec"]["trainer"]["env"]] == credentials
    c.store.endpoint, c.store.region, c.store.ca_bundle_secret = "https://minio.tracefp4:9000", "eu-central-1", "ca"
    job = trainjob(c, trainjob_name(c, RUN, 0), NAMESPACE, [], b"{}")
    validator.validate(job)
    env = job["spec"]["trainer"]["env"]
    assert [e["name"] for e in env[:2]] == credentials and env[2:] == [
        {"name": "TRACEFP4_S3_ENDPOINT", "value": "https://minio.tracefp4:9000"},
        {"name": "TRACEFP4_S3_REGION", "value": "eu-central-1"},
        {"name": "SSL_CERT_FILE", "value": "/etc/tracefp4/store-ca/ca.crt"},
    ]
    (patch,) = job["spec"]["runtimePatches"]
    (replicated,) = patch["trainingRuntimeSpec"]["template"]["spec"]["replicatedJobs"]
    pod = replicated["template"]["spec"]["template"]["spec"]
    assert pod["volumes"] == [
        {"name": "dshm", "emptyDir": {"medium": "Memory"}},
        {"name": "store-ca", "secret": {"secretName": "ca"}},
    ]
    assert pod["containers"] == [
        {
            "name": "node",  # the trainer's container, which the env above goes to
            "volumeMounts": [
                {"name": "dshm", "mountPath": "/dev/shm"},
                {"name": "store-ca", "mountPath": "/etc/tracefp4/store-ca", "readOnly": True},
            ],
        }
    ]
    # the strict validator knows the secret volume's fields: a misspelled one is refused
    pod["volumes"][1]["secret"] = {"name": "ca"}
    with pytest.raises(jsonschema.ValidationError, match="'name' was unexpected"):
        validator.validate(job)


class FakeKubernetes:
    """Answers the TrainJob calls of the Kubernetes API on 127.0.0.1 (not a
    cluster): create, get, delete; each get moves the job along ``script``,
    a list of statuses, the last one repeated, and calls ``on_get``. With
    ``deletes_hang`` a deleted job stays (a pod Terminating on a lost node).
    ``pods`` are the job's rank pods, listed and their logs read. Kueue's
    LocalQueues ``local_queues`` are there, in each of ``kueue_versions``
    (what its API serves); as Kueue's webhook does, a job created with a
    queue label is made suspended (unless not ``kueue_trainjobs``), and with
    ``default_queue`` one created without is put in the LocalQueue
    ``default``; ``workloads`` are Kueue's, listed by label selector (a
    403 with ``workloads_forbidden``)."""

    def __init__(
        self,
        script: list[dict],
        on_complete=None,
        on_get=None,
        deletes_hang=False,
        pods=None,
        unavailable_gets=0,
        failing_deletes=(),
        create_refusal=None,
        local_queues=(),
        kueue_versions=("v1beta1", "v1beta2"),
        default_queue=False,
        kueue_trainjobs=True,
        workloads=(),
        workloads_forbidden=False,
        kueue_starts_before_a_move=False,
    ):
        self.script, self.on_complete, self.on_get, self.deletes_hang = script, on_complete, on_get, deletes_hang
        self.unavailable_gets = unavailable_gets  # the first gets of the job answer 503 (the API server restarting)
        self.failing_deletes = list(failing_deletes)  # the first deletes' answers (503, 403), the last one repeated
        self.create_refusal = create_refusal  # (code, message) every create answers: a webhook's or RBAC's refusal
        self.pods: dict[str, tuple[dict, str]] = pods or {}  # the job's rank pods: name -> (status, log)
        self.local_queues, self.kueue_versions, self.default_queue = set(local_queues), kueue_versions, default_queue
        self.kueue_trainjobs, self.workloads, self.workloads_forbidden = (
            kueue_trainjobs,
            list(workloads),
            workloads_forbidden,
        )
        self.workload_selectors: list[str] = []
        self.kueue_starts_before_a_move = kueue_starts_before_a_move  # a queue move answers 422, the job started
        self.calls: list[tuple[str, str]] = []
        self.jobs: dict[str, dict] = {}
        self.gets = 0
        fake = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def _answer(self, code: int, body: dict):
                data = json.dumps(body).encode()
                self.send_response(code)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def _route(self):
                base = f"/apis/{GROUP}/{VERSION}/namespaces/{NAMESPACE}/{PLURAL}"
                path = self.path.split("?")[0]
                fake.calls.append((self.command, path))
                if not path.startswith(base):
                    return None
                return path[len(base) :].strip("/")

            def do_POST(self):
                if self._route() != "":
                    return self._answer(404, {"message": "not found"})
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                name = body["metadata"]["name"]
                if fake.create_refusal:
                    code, message = fake.create_refusal
                    return self._answer(code, {"kind": "Status", "message": message})
                if name in fake.jobs:
                    return self._answer(409, {"kind": "Status", "message": f'trainjobs "{name}" already exists'})
                labels = body["metadata"].setdefault("labels", {})
                if fake.default_queue:
                    labels.setdefault(module.KUEUE_QUEUE, "default")
                if module.KUEUE_QUEUE in labels and fake.kueue_trainjobs:
                    body["spec"]["suspend"] = True
                body["metadata"]["uid"] = f"uid-of-{name}"
                if "dryRun=All" not in self.path:  # a dry run is checked, answered, and not kept
                    fake.jobs[name] = body
                self._answer(201, body)

            def do_GET(self):
                pods = f"/api/v1/namespaces/{NAMESPACE}/pods"
                path = self.path.split("?")[0]
                if path.startswith("/apis/kueue.x-k8s.io/"):
                    fake.calls.append((self.command, path))
                    version, queue = path.split("/")[3], path.split("/")[-1]
                    if version not in fake.kueue_versions:
                        return self._answer(404, {"kind": "Status", "reason": "NotFound", "details": {}})
                    if queue == "workloads" and fake.workloads_forbidden:
                        message = 'workloads.kueue.x-k8s.io is forbidden: User "system:serviceaccount" cannot list'
                        return self._answer(403, {"kind": "Status", "reason": "Forbidden", "message": message})
                    if queue == "workloads":
                        fake.workload_selectors += parse_qs(urlparse(self.path).query).get("labelSelector", [])
                        return self._answer(200, {"kind": "WorkloadList", "items": fake.workloads})
                    if queue not in fake.local_queues:
                        return self._answer(404, {"kind": "Status", "reason": "NotFound", "details": {"name": queue}})
                    return self._answer(200, {"kind": "LocalQueue", "metadata": {"name": queue}})
                if path == pods:
                    items = [{"metadata": {"name": n}, "status": status} for n, (status, _) in fake.pods.items()]
                    return self._answer(200, {"kind": "PodList", "apiVersion": "v1", "items": items})
                if path.startswith(pods + "/") and path.endswith("/log"):
                    data = fake.pods[path.split("/")[-2]][1].encode()
                    self.send_response(200)
                    self.send_header("Content-Type", "text/plain")
                    self.send_header("Content-Length", str(len(data)))
                    self.end_headers()
                    return self.wfile.write(data)
                name = self._route()
                if fake.unavailable_gets:
                    fake.unavailable_gets -= 1
                    return self._answer(503, {"kind": "Status", "message": "the server is currently unable"})
                if name not in fake.jobs:
                    return self._answer(404, {"kind": "Status", "message": f'trainjobs "{name}" not found'})
                status = fake.script[min(fake.gets, len(fake.script) - 1)]
                fake.gets += 1
                if fake.on_get:
                    fake.on_get()
                if any(c["type"] == "Complete" for c in status.get("conditions", [])) and fake.on_complete:
                    fake.on_complete(fake.jobs[name])
                    fake.on_complete = None
                self._answer(200, {**fake.jobs[name], "status": status})

            def do_PATCH(self):  # a merge patch of the job (TrainJobRun.start's spec.suspend or queue label)
                name = self._route()
                patch = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                if name not in fake.jobs:
                    return self._answer(404, {"kind": "Status", "message": f'trainjobs "{name}" not found'})
                if fake.kueue_starts_before_a_move and module.KUEUE_QUEUE in patch.get("metadata", {}).get(
                    "labels", {}
                ):
                    fake.jobs[name]["spec"]["suspend"] = False
                    message = "metadata.labels[kueue.x-k8s.io/queue-name]: Invalid value: field is immutable"
                    return self._answer(422, {"kind": "Status", "reason": "Invalid", "message": message})
                for key, fields in patch.items():
                    for field, value in fields.items():
                        part = fake.jobs[name].setdefault(key, {})
                        part[field] = {**part.get(field, {}), **value} if isinstance(value, dict) else value
                self._answer(200, fake.jobs[name])

            def do_DELETE(self):
                name = self._route()
                if fake.failing_deletes:
                    code = fake.failing_deletes.pop(0) if len(fake.failing_deletes) > 1 else fake.failing_deletes[0]
                    return self._answer(code, {"kind": "Status", "message": f"answered {code}"})
                if (fake.jobs.get(name) if fake.deletes_hang else fake.jobs.pop(name, None)) is None:
                    return self._answer(404, {"kind": "Status", "message": f'trainjobs "{name}" not found'})
                self._answer(200, {"kind": "Status", "status": "Success"})

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def api(self) -> client.ApiClient:
        cfg = client.Configuration()
        cfg.host = f"http://127.0.0.1:{self.server.server_address[1]}"
        return client.ApiClient(cfg)

    def close(self):
        self.server.shutdown()


RUNNING = {"jobsStatus": [{"name": "node", "active": 2, "ready": 2}]}
# what the Trainer reports while a rank pod is Pending (unschedulable): the child Job is active, not ready
PENDING = {"jobsStatus": [{"name": "node", "ready": 0, "succeeded": 0, "failed": 0, "active": 1, "suspended": 0}]}
FAILED = {
    "conditions": [{"type": "Failed", "status": "True", "reason": "JobsFailed", "message": "rank 3 exited with 1"}],
    "jobsStatus": [{"name": "node", "failed": 1}],
}
COMPLETE = {"conditions": [{"type": "Complete", "status": "True", "reason": "JobsCompleted", "message": ""}]}


def inputs(tmp_path) -> tuple[Path, Path, Path, Path]:
    trainer = Trainer(build_model("smoke"), TrainConfig(), BF16, {})
    policy, state = trainer.save(tmp_path / "policy", tmp_path / "state", run_id=RUN)
    (tmp_path / "trajectories.jsonl").write_text('{"header": {}}\n')
    (tmp_path / "guidance.json").write_text(json.dumps({"rl_step": 0}))
    return policy, state, tmp_path / "trajectories.jsonl", tmp_path / "guidance.json"


def test_a_failed_trainjob_fails_the_step_with_its_reason_and_is_deleted(tmp_path, validator):
    pods = {
        "run-tj-node-0-0": ({"phase": "Running"}, "step 1\n"),
        "run-tj-node-0-1": ({"phase": "Failed"}, "step 1\nTraceback ...\ntorch.OutOfMemoryError: CUDA out of memory\n"),
    }
    fake = FakeKubernetes([{}, RUNNING, RUNNING, FAILED], pods=pods)
    c = config(tmp_path)
    message, log, _ = failed_round(c, fake, tmp_path, "failed: JobsFailed: rank 3 exited with 1")
    # the failed rank's log first, read before the deletion took the pods
    assert message.split("\n")[1:4] == [
        "--- run-tj-node-0-1 (Failed), last 30 lines ---", "step 1", "Traceback ...",
    ]  # fmt: skip
    assert "CUDA out of memory" in message and "--- run-tj-node-0-0 (Running)" in message
    methods = [m for m, p in fake.calls if "/pods" not in p]
    # adopt's look for a TrainJob left by an earlier attempt (none: 404), then the watch's 4
    assert methods[:2] == ["GET", "POST"] and methods[-1] == "DELETE" and methods.count("GET") == 5
    assert not fake.jobs and not (tmp_path / "out").exists()
    assert any("ready 2, active 2" in line for line in log) and any("Failed(JobsFailed)" in line for line in log)
    # what was created is a valid TrainJob handing the ranks the round's inputs as store URIs, all uploaded
    (created,) = [m for m, p in fake.calls if m == "POST"]
    store = open_store(c.store.uri)
    prefix = round_prefix(c, RUN, 0)
    assert {"config.json", "trajectories.jsonl", "guidance.json", "policy/checksums.json", "state/checksums.json"} <= {
        k.removeprefix(prefix + "/") for k in store.list(prefix + "/")
    }


def test_a_completed_trainjob_gives_the_ranks_outputs_and_is_deleted(tmp_path, validator):
    c = config(tmp_path)
    c.resources.labels = {"kueue.x-k8s.io/queue-name": "team-a"}  # the steps' pods' and the TrainJob's
    store = open_store(c.store.uri)
    prefix = round_prefix(c, RUN, 0)
    seen, labels = [], []

    def finish(job, prefix):  # what rank 0 uploads at the end (components/distributed.py)
        validator.validate(job)
        seen.append(job["spec"]["trainer"]["args"])
        labels.append(job["metadata"]["labels"])
        for name in ("policy", "state"):
            for f in sorted((tmp_path / name).iterdir()):
                store.put_bytes(f"{prefix}/new-{name}/{f.name}", f.read_bytes())
        store.put_bytes(f"{prefix}/history.json", json.dumps([{"step": 1, "loss": 0.5}]).encode())

    fake = FakeKubernetes([RUNNING, COMPLETE], on_complete=lambda job: finish(job, prefix))
    try:
        job = TrainJobRun(c, RUN, 0, fake.api(), namespace=NAMESPACE, poll_s=0.01)
        rows = job.run(
            *inputs(tmp_path),
            tmp_path / "out",
            tmp_path / "out-state",
            {"rollout_seconds": 1.0},
            echo=lambda line: None,
        )
    finally:
        fake.close()
    assert rows == [{"step": 1, "loss": 0.5}]
    assert labels == [
        {
            "app.kubernetes.io/part-of": "tracefp4",
            "kueue.x-k8s.io/queue-name": "team-a",  # Kueue admits the TrainJob into the steps' queue
            "tracefp4/run-id": RUN,  # kubectl get trainjobs -l tracefp4/run-id=<run id>
            "tracefp4/round": "0",
        }
    ]
    assert module.run_labels("not a label value!", 2) == {"tracefp4/round": "2"}  # carried by the name alone
    assert (tmp_path / "out" / "config.json").exists()
    # the new trainer state stays in the store: out-state stands for it, with its manifest (the same pin)
    assert sorted(p.name for p in (tmp_path / "out-state").iterdir()) == [MANIFEST, LOCATION]
    assert location(tmp_path / "out-state") == f"{c.store.uri}/{prefix}/new-state"
    assert folder_digest(tmp_path / "out-state") == folder_digest(fetch(tmp_path / "out-state"))
    assert not fake.jobs
    args = dict(zip(seen[0][::2], seen[0][1::2]))
    assert args["--policy"] == f"{c.store.uri}/{prefix}/policy" and args["--run-id"] == RUN
    assert (
        args["--state"] == f"{c.store.uri}/{prefix}/state"
        and args["--out-state"] == f"{c.store.uri}/{prefix}/new-state"
    )
    assert json.loads(store.get_bytes(f"{prefix}/round_stats.json")) == {"rollout_seconds": 1.0}

    # the next round's policy and state are this round's outputs: the ranks get the folders already in the
    # store (the state where out-state stands for it) and nothing of them is uploaded again
    nxt, log = round_prefix(c, RUN, 1), []
    fake = FakeKubernetes([RUNNING, COMPLETE], on_complete=lambda job: finish(job, nxt))
    try:
        job = TrainJobRun(c, RUN, 1, fake.api(), namespace=NAMESPACE, poll_s=0.01)
        given = (tmp_path / "out", tmp_path / "out-state", tmp_path / "trajectories.jsonl", tmp_path / "guidance.json")
        job.run(*given, tmp_path / "out-2", tmp_path / "out-state-2", {}, echo=log.append)
    finally:
        fake.close()
    args = dict(zip(seen[1][::2], seen[1][1::2]))
    assert args["--policy"] == f"{c.store.uri}/{prefix}/new-policy"
    assert args["--state"] == f"{c.store.uri}/{prefix}/new-state"
    assert sum("already in the store" in x for x in log) == 2

    # once round 2 is out, its inputs are gone from the store: round 1's new policy it took with the record of
    # it, and round 1's new state its input stood for; round 2's outputs stay
    def folders(prefix):
        return {k.removeprefix(prefix + "/").split("/")[0] for k in store.list(prefix + "/")}

    assert not {"new-policy", "new-state", "trajectories.jsonl"} & folders(prefix)
    assert not {"policy", "state", "trajectories.jsonl"} & folders(nxt) and {"new-policy", "new-state"} <= folders(nxt)
    with pytest.raises(CheckpointError, match="which is gone .* go on from a run's last round"):
        fetch(tmp_path / "out-state")  # a continuation from round 1 can no longer follow its state
    # the record is per config: another config under the same run id neither takes nor deletes those folders
    other = c.model_copy(update={"rl": c.rl.model_copy(update={"learning_rate": c.rl.learning_rate * 2})})
    api = fake.api()
    assert (
        TrainJobRun(c, RUN, 2, api, namespace=NAMESPACE).stored(tmp_path / "out-2") == f"{c.store.uri}/{nxt}/new-policy"
    )
    assert TrainJobRun(other, RUN, 2, api, namespace=NAMESPACE).stored(tmp_path / "out-2") is None


def test_a_trainjob_left_failed_by_an_earlier_attempt_is_replaced(tmp_path):
    c = config(tmp_path)
    fake = FakeKubernetes([FAILED])
    fake.jobs[trainjob_name(c, RUN, 0)] = {"metadata": {"name": "old"}}
    _, log, _ = failed_round(c, fake, tmp_path, "JobsFailed")
    assert [m for m, _ in fake.calls][:4] == ["GET", "DELETE", "GET", "POST"]
    assert any("left failed, deleting it" in line for line in log)


def ranks_upload_outputs(c: RunConfig, tmp_path):
    """What rank 0 uploads at the end of a round (components/distributed.py), as a fake's ``on_complete``."""
    store = open_store(c.store.uri)
    prefix = round_prefix(c, RUN, 0)

    def upload(job=None):
        store.put_bytes(f"{prefix}/history.json", json.dumps([{"step": 1, "loss": 0.5}]).encode())
        for name in ("policy", "state"):
            for f in sorted((tmp_path / name).iterdir(), key=lambda f: f.name == "checksums.json"):
                store.put_bytes(f"{prefix}/new-{name}/{f.name}", f.read_bytes())

    return upload


def failed_round(c: RunConfig, fake: FakeKubernetes, tmp_path, match: str | None = None, poll_s: float = 0.01):
    """Round 0's TrainJob step against ``fake``, which must fail with a DistributedError matching ``match``:
    its message, its log and the step's TrainJobRun."""
    log = []
    try:
        job = TrainJobRun(c, RUN, 0, fake.api(), namespace=NAMESPACE, poll_s=poll_s)
        with pytest.raises(DistributedError, match=match) as failed:
            job.run(*inputs(tmp_path), tmp_path / "out", tmp_path / "out-state", {}, echo=log.append)
    finally:
        fake.close()
    return str(failed.value), log, job


def inputs_of(tmp_path) -> bytes:
    return module.inputs_record(*inputs(tmp_path))


def ready_record(c: RunConfig, given) -> bytes:
    """What inputs-ready.json says once ``given`` are all in the store, for round 0 of ``c`` (module.ready_record)."""
    folders = TrainJobRun(c, RUN, 0, client.ApiClient(), namespace=NAMESPACE).input_folders(*given[:2])
    return module.ready_record(module.inputs_record(*given), folders)


def awaiting(c: RunConfig, given) -> list[str]:
    """The arguments with which a TrainJob's ranks wait for ``given`` all in the store (round 0 of ``c``)."""
    key = f"{round_prefix(c, RUN, 0)}/{module.READY}"
    return ["--inputs", f"{c.store.uri}/{key}", hashlib.sha256(ready_record(c, given)).hexdigest(), "10"]


def completed_round(
    c: RunConfig, fake: FakeKubernetes, given, tmp_path, poll_s: float = 0.01
) -> tuple[list[dict], list[str]]:
    """Round 0's TrainJob step on ``given`` inputs against ``fake``: its history rows and its log."""
    log = []
    try:
        job = TrainJobRun(c, RUN, 0, fake.api(), namespace=NAMESPACE, poll_s=poll_s)
        return job.run(*given, tmp_path / "out", tmp_path / "out-state", {}, echo=log.append), log
    finally:
        fake.close()


@pytest.mark.parametrize("made_by", ["this tracefp4", "an older tracefp4"])
def test_a_trainjob_an_earlier_attempt_left_running_is_waited_for(tmp_path, made_by):
    """A retry of the step (its pod lost, say) finds the round's TrainJob still
    running on the same inputs: it waits for that job, uploading nothing under
    its ranks; the attempt recorded the inputs ready, or made the job with an
    older tracefp4, which started it once they were."""
    c = config(tmp_path)
    c.resources.labels[module.KUEUE_QUEUE] = "team-a-gpus"  # Kueue started it in the default queue: it stays
    given = inputs(tmp_path)
    fake = FakeKubernetes([RUNNING, COMPLETE], on_complete=ranks_upload_outputs(c, tmp_path))
    name, record = trainjob_name(c, RUN, 0), module.inputs_record(*given)
    ranks = awaiting(c, given) if made_by == "this tracefp4" else []
    fake.jobs[name] = trainjob(c, name, NAMESPACE, ranks, record)
    fake.jobs[name]["spec"]["suspend"] = False  # started
    fake.jobs[name]["metadata"]["labels"][module.KUEUE_QUEUE] = "default"
    open_store(c.store.uri).put_bytes(f"{round_prefix(c, RUN, 0)}/{module.INPUTS}", record)
    if ranks:
        open_store(c.store.uri).put_bytes(f"{round_prefix(c, RUN, 0)}/{module.READY}", ready_record(c, given))
    rows, log = completed_round(c, fake, given, tmp_path)
    assert rows == [{"step": 1, "loss": 0.5}] and (tmp_path / "out" / "config.json").exists()
    calls = [m for m, _ in fake.calls]
    assert calls[:2] == ["GET", "GET"] and {"POST", "PATCH"}.isdisjoint(calls) and calls[-1] == "DELETE"
    assert any("on the same inputs: waiting for it" in line for line in log)
    assert not any(
        key.endswith(("/trajectories.jsonl", "/policy/checksums.json")) for key in open_store(c.store.uri).list()
    )


def test_the_trainjob_claims_the_round_suspended_and_starts_once_the_inputs_are_in_the_store(tmp_path, monkeypatch):
    """The TrainJob is created suspended before the step uploads anything
    (the round's claim: another submission meets it instead of uploading
    over these inputs) and unsuspended after the uploads and the record that
    they are all there, which its ranks are told to wait for. A suspended one
    an attempt left as it died uploading the same inputs is deleted, and the
    round claimed anew (the inputs recorded as the round's, as an older
    tracefp4 did before it uploaded them, are uploaded all the same);
    another submission's fails the step as preparing."""
    c = config(tmp_path)
    given = inputs(tmp_path)
    name, ready = trainjob_name(c, RUN, 0), ready_record(c, given)
    key = f"{round_prefix(c, RUN, 0)}/{module.READY}"
    store = open_store(c.store.uri)
    store.put_bytes(key, b'{"inputs": "another submission\'s"}')  # gone before anything is overwritten
    fake = FakeKubernetes([RUNNING, COMPLETE], on_complete=ranks_upload_outputs(c, tmp_path))
    at_upload, suspended = [], []
    real = module.TrainJobRun.upload

    def upload(self, *a):
        at_upload.append([m for m, _ in fake.calls])
        real(self, *a)
        there = self.store.list(self.prefix + "/")
        assert f"{self.prefix}/{module.READY}" not in there  # it comes after them
        assert f"{self.prefix}/{module.READY}{UPLOADING}" in there  # the step's heartbeat meanwhile

    monkeypatch.setattr(module.TrainJobRun, "upload", upload)
    started, real_start = [], module.TrainJobRun.start
    monkeypatch.setattr(
        module.TrainJobRun, "start", lambda self, echo: started.append(self.ready(ready)) or real_start(self, echo)
    )
    fake.on_get = lambda: suspended.append(fake.jobs[name]["spec"]["suspend"])
    created = []
    fake.on_complete = lambda job: created.append(job) or ranks_upload_outputs(c, tmp_path)()
    rows, _ = completed_round(c, fake, given, tmp_path)
    assert at_upload == [["GET", "POST"]] and [m for m, _ in fake.calls][2] == "PATCH"
    assert suspended and not any(suspended) and rows == [{"step": 1, "loss": 0.5}]
    args = created[0]["spec"]["trainer"]["args"]
    assert args[-4:] == ["--inputs", f"{c.store.uri}/{key}", hashlib.sha256(ready).hexdigest(), "10"]
    assert started == [True] and not store.list(key)  # ready as it started; not once the round's inputs are gone
    assert not store.list(key + UPLOADING)  # no heartbeat left

    again = tmp_path / "again"  # a store without the round's outputs
    again.mkdir()
    c = config(again)
    name = trainjob_name(c, RUN, 0)
    fake = FakeKubernetes([FAILED])
    fake.jobs[name] = trainjob(c, name, NAMESPACE, [], module.inputs_record(*inputs(again)))  # suspended
    at_upload.clear()
    store = open_store(c.store.uri)
    store.put_bytes(f"{round_prefix(c, RUN, 0)}/{module.INPUTS}", module.inputs_record(*inputs(again)))
    elsewhere = {"policy": "s3://elsewhere/policy", "state": "s3://elsewhere/state"}  # not where these ranks read
    store.put_bytes(f"{round_prefix(c, RUN, 0)}/{module.READY}", module.ready_record(inputs_of(again), elsewhere))
    failed_round(c, fake, again, "JobsFailed")  # the new claim's TrainJob fails: the step is done with it
    assert [m for m, _ in fake.calls][:5] == ["GET", "DELETE", "GET", "POST", "PATCH"] and len(at_upload) == 1
    fake = FakeKubernetes([{}])
    fake.jobs[name] = trainjob(c, name, NAMESPACE, [], b'{"policy": "another"}')
    failed_round(c, fake, again, "is preparing this round from other inputs")
    assert [m for m, _ in fake.calls] == ["GET"] and name in fake.jobs


def test_a_trainjob_goes_to_the_runs_kueue_queue_once_its_inputs_are_in_the_store(tmp_path, clock):
    """With Kueue's queue label in resources.labels the TrainJob is created
    suspended without it, and handed to that queue (the label) once its
    inputs are in the store: Kueue, here the fake, keeps it suspended until
    it admits it. However long that takes, and again after an eviction (a
    preemption; then its quota reserved while an admission check provisions
    nodes), the step waits, saying what Kueue says of it (its Workload),
    counting it against neither train.timeout_seconds nor, once the job ran,
    the time it waited before against train.queue_timeout_seconds."""
    c = config(tmp_path, timeout_seconds=10, queue_timeout_seconds=60)
    c.resources.labels[module.KUEUE_QUEUE] = "team-a-gpus"
    name = trainjob_name(c, RUN, 0)
    # queued 40 s, running, evicted for 40 s, running to the end
    suspended = {"conditions": [{"type": "Suspended", "status": "True", "reason": "Suspended"}]}
    script = [suspended] * 40 + [RUNNING] + [suspended] * 40 + [RUNNING, COMPLETE]
    quota = "couldn't assign flavors to pod set node: insufficient unused quota for nvidia.com/gpu in flavor h200"
    workload = {"metadata": {"name": f"trainjob-{name}-1a2b3"}, "spec": {"active": True}, "status": {}}
    workload["status"]["conditions"] = [quota_reserved("False", "WaitingForQuota", quota)]
    fake = FakeKubernetes(script, on_complete=ranks_upload_outputs(c, tmp_path), workloads=[workload])
    created = []
    provisioning = {
        "conditions": [quota_reserved("True", "QuotaReserved", ""), quota_reserved("False", "", "")],
        "admissionChecks": [{"name": "dws", "state": "Pending", "message": "waiting for 8 nodes"}],
    }
    provisioning["conditions"][1].update(type="Admitted", message="The workload has not all checks ready")

    def kueue():  # the answer of get number fake.gets is script[fake.gets - 1]
        job = fake.jobs[name]
        created.append(copy.deepcopy(job)) if not created else None
        job["spec"]["suspend"] = script[min(fake.gets, len(script)) - 1] is suspended
        if fake.gets > 60:  # evicted: quota reserved again at once, and a check provisions the nodes
            workload["status"] = provisioning

    fake.on_get = kueue
    rows, log = completed_round(c, fake, inputs(tmp_path), tmp_path, poll_s=1)
    assert rows == [{"step": 1, "loss": 0.5}] and clock.now > 80
    assert sum(f"suspended in Kueue's queue 'team-a-gpus': waiting: {quota}" in line for line in log) == 2
    assert any("waiting: The workload has not all checks ready" in line for line in log)
    assert set(fake.workload_selectors) == {f"kueue.x-k8s.io/job-uid=uid-of-{name}"}
    assert any("handed to Kueue's queue 'team-a-gpus'" in line for line in log)
    assert [m for m, _ in fake.calls if m != "GET"] == ["POST", "PATCH", "DELETE"]
    assert created[0]["metadata"]["labels"][module.KUEUE_QUEUE] == "team-a-gpus"  # the patch's
    body = trainjob(c, name, NAMESPACE, [], b"{}")
    assert module.KUEUE_QUEUE not in body["metadata"]["labels"] and body["spec"]["suspend"]


def test_ranks_kueue_evicts_for_never_getting_ready_fail_the_step_after_the_timeout(tmp_path, clock):
    """Kueue's waitForPodsReady evicts a job whose pods do not get ready
    (unschedulable ranks) and queues it again, over and over: the time
    queued stops the clock, but does not restart it."""
    c = config(tmp_path, timeout_seconds=10)
    c.resources.labels[module.KUEUE_QUEUE] = "team-a-gpus"
    name = trainjob_name(c, RUN, 0)
    suspended = {"conditions": [{"type": "Suspended", "status": "True", "reason": "Suspended"}]}
    script = ([PENDING] * 6 + [suspended] * 30) * 5
    evicted = {"type": "Evicted", "status": "True", "reason": "PodsReadyTimeout", "message": "exceeded the PodsReady"}
    workload = {"metadata": {"name": "trainjob-x"}, "status": {"conditions": [evicted]}}
    fake = FakeKubernetes(script, workloads=[workload])
    fake.on_get = lambda: fake.jobs[name]["spec"].update(suspend=script[min(fake.gets, len(script)) - 1] is suspended)
    failed_round(c, fake, tmp_path, "waited 10 s .train.timeout_seconds. for the pods of its node job", poll_s=1)
    assert 40 < clock.now < 50  # 6 s not ready, 30 s queued, 5 s not ready


def test_where_kueue_queues_a_trainjob_as_it_is_created_its_ranks_wait_for_the_inputs(tmp_path, monkeypatch):
    """In a namespace with a LocalQueue named default, Kueue's webhook puts
    every TrainJob created there in it, and Kueue starts it whenever it
    admits it: the step starts nothing itself, and the job's ranks wait for
    the record of the inputs (tests/test_distributed.py). A retry whose
    earlier attempt died uploading them finds that job queued, and uploads
    the inputs its ranks wait for instead of creating another; one an older
    tracefp4 made is replaced."""
    c = config(tmp_path)
    given = inputs(tmp_path)
    name = trainjob_name(c, RUN, 0)
    fake = FakeKubernetes([RUNNING, COMPLETE], on_complete=ranks_upload_outputs(c, tmp_path), default_queue=True)
    rows, log = completed_round(c, fake, given, tmp_path)
    assert rows == [{"step": 1, "loss": 0.5}] and [m for m, _ in fake.calls if m != "GET"] == ["POST", "DELETE"]
    assert any("created in Kueue's queue 'default', which starts it" in line for line in log)

    again = tmp_path / "again"
    again.mkdir()
    c = config(again)
    given = inputs(again)
    name = trainjob_name(c, RUN, 0)
    fake = FakeKubernetes([RUNNING, COMPLETE], on_complete=ranks_upload_outputs(c, again), default_queue=True)
    record = module.inputs_record(*given)
    fake.jobs[name] = trainjob(c, name, NAMESPACE, awaiting(c, given), record)
    fake.jobs[name]["metadata"]["labels"][module.KUEUE_QUEUE] = "default"
    uploads = []
    real = module.TrainJobRun.upload
    monkeypatch.setattr(module.TrainJobRun, "upload", lambda self, *a: uploads.append(1) or real(self, *a))
    waited, real_wait = [], module.TrainJobRun.wait
    monkeypatch.setattr(
        module.TrainJobRun,
        "wait",
        lambda self, echo: waited.append(self.ready(ready_record(c, given))) or real_wait(self, echo),
    )
    rows, log = completed_round(c, fake, given, again)
    assert rows == [{"step": 1, "loss": 0.5}] and uploads == [1]
    assert [m for m, _ in fake.calls if m != "GET"] == ["DELETE"] and any("waiting for it" in line for line in log)
    assert waited == [True]

    # the run names a queue of its own: the job goes there at once, before Kueue may start it in the default one
    fourth = tmp_path / "fourth"
    fourth.mkdir()
    c = config(fourth)
    c.resources.labels[module.KUEUE_QUEUE] = "team-a-gpus"
    fake = FakeKubernetes([RUNNING, COMPLETE], on_complete=ranks_upload_outputs(c, fourth), default_queue=True)
    uploads.clear()
    monkeypatch.setattr(
        module.TrainJobRun, "upload", lambda self, *a: uploads.append([m for m, _ in fake.calls]) or real(self, *a)
    )
    rows, _ = completed_round(c, fake, inputs(fourth), fourth)
    assert rows == [{"step": 1, "loss": 0.5}] and uploads == [["GET", "POST", "PATCH"]]
    assert [m for m, _ in fake.calls].count("PATCH") == 1

    # Kueue starts it in the default queue before the step can move it: it stays there
    fake = FakeKubernetes(
        [RUNNING, COMPLETE],
        on_complete=ranks_upload_outputs(c, fourth),
        default_queue=True,
        kueue_starts_before_a_move=True,
    )
    shutil.rmtree(fourth / "out"), shutil.rmtree(fourth / "out-state")
    open_store(c.store.uri).delete(f"{round_prefix(c, RUN, 0)}/history.json")  # the round not finished
    rows, log = completed_round(c, fake, inputs(fourth), fourth)
    assert rows == [{"step": 1, "loss": 0.5}] and any("started in Kueue's queue 'default' before it" in x for x in log)

    # a retry finds the job its attempt left in the default queue, dead before it moved it: it moves it
    fake = FakeKubernetes([RUNNING, COMPLETE], on_complete=ranks_upload_outputs(c, fourth), default_queue=True)
    shutil.rmtree(fourth / "out"), shutil.rmtree(fourth / "out-state")
    open_store(c.store.uri).delete(f"{round_prefix(c, RUN, 0)}/history.json")  # the round not finished
    name = trainjob_name(c, RUN, 0)
    fake.jobs[name] = trainjob(c, name, NAMESPACE, awaiting(c, inputs(fourth)), inputs_of(fourth))
    fake.jobs[name]["metadata"]["labels"][module.KUEUE_QUEUE] = "default"
    completed_round(c, fake, inputs(fourth), fourth)
    assert [m for m, _ in fake.calls if m != "GET"] == ["PATCH", "DELETE"]

    # an older tracefp4's job there, whose ranks read their inputs as soon as Kueue starts them: not taken
    third = tmp_path / "third"
    third.mkdir()
    c = config(third)
    name = trainjob_name(c, RUN, 0)
    fake = FakeKubernetes([{}, FAILED], default_queue=True)  # adopt's look, then the new job's
    fake.jobs[name] = trainjob(c, name, NAMESPACE, [], module.inputs_record(*inputs(third)))
    fake.jobs[name]["metadata"]["labels"][module.KUEUE_QUEUE] = "default"
    failed_round(c, fake, third, "JobsFailed")
    assert [m for m, _ in fake.calls][:4] == ["GET", "DELETE", "GET", "POST"]


def quota_reserved(status: str, reason: str, message: str) -> dict:
    return {"type": "QuotaReserved", "status": status, "reason": reason, "message": message}


NEVER_ADMITTED = {  # what Kueue's Workload says -> what the step fails with, and after how long (s)
    "deactivated": (
        {
            "spec": {"active": False},
            "conditions": [
                dict(quota_reserved("True", "", ""), type="Evicted", message="exceeded the PodsReady timeout 5 times")
            ],
        },
        "Kueue deactivated its Workload trainjob-x .Evicted: exceeded the PodsReady timeout 5 times",
        0,
    ),
    "finished": (
        {"conditions": [{"type": "Finished", "status": "True", "message": "the job failed to start"}]},
        "Kueue finished its Workload trainjob-x .the job failed to start",
        0,
    ),
    "none": (None, "Kueue has made no Workload of it in 10 s .*integrations.frameworks", 10),
    "misconfigured": (  # Kueue 0.19's reason for a missing queue
        {"conditions": [quota_reserved("False", "Misconfigured", "LocalQueue team-a-gpus doesn't exist")]},
        "has not started it in 10 s .*nor waits for quota to: waiting: LocalQueue team-a-gpus doesn't exist",
        10,
    ),
    "inadmissible": (
        {"conditions": [quota_reserved("False", "Inadmissible", "LocalQueue team-a-gpus is stopped")]},
        "has not started it in 10 s .*nor waits for quota to: waiting: LocalQueue team-a-gpus is stopped",
        10,
    ),
    "beyond its capacity": (
        {"conditions": [quota_reserved("False", "Pending", "nvidia.com/gpu 64 > maximum capacity 32")]},
        "waited 120 s .train.queue_timeout_seconds. in Kueue's queue 'team-a-gpus', which says: waiting: nvidia",
        120,
    ),
}


@pytest.mark.parametrize("kueue", NEVER_ADMITTED)
def test_a_trainjob_kueue_will_never_admit_fails_the_step_saying_why(tmp_path, clock, kueue):
    """Kueue deactivated or finished the Workload, made none (it does not
    manage TrainJobs), cannot use its queue, or waits for more quota than
    the queue ever has: the step does not wait forever, and says why."""
    c = config(tmp_path, timeout_seconds=10, queue_timeout_seconds=120)
    c.resources.labels[module.KUEUE_QUEUE] = "team-a-gpus"
    said, error, after_s = NEVER_ADMITTED[kueue]
    workloads = []
    if said is not None:
        workloads = [
            {
                "metadata": {"name": "trainjob-x"},
                "spec": said.get("spec", {}),
                "status": {"conditions": said["conditions"]},
            }
        ]
    fake = FakeKubernetes([{}], workloads=workloads)
    fake.on_get = lambda: fake.jobs and fake.jobs[trainjob_name(c, RUN, 0)]["spec"].update(suspend=True)
    failed_round(c, fake, tmp_path, error, poll_s=0.5)
    assert after_s <= clock.now <= after_s + 1


@pytest.mark.parametrize(
    ("queues", "versions", "error"),
    [
        (["team-a-gpus"], ("v1beta1", "v1beta2"), None),
        (["team-a-gpus"], ("v1beta1",), None),  # a Kueue before v1beta2
        (["team-b-gpus"], ("v1beta1", "v1beta2"), "namespace team-a has none of that name"),
        ([], (), "the cluster serves no Kueue LocalQueues"),
        (["team-a-gpus"], ("v1beta2",), "Kueue does not queue TrainJobs in this cluster"),  # no TrainJob integration
        (["team-a-gpus"], ("v1beta2",), "could not read their Workloads in team-a .*forbidden"),
    ],
)
def test_the_runs_first_task_checks_the_kueue_queue_its_trainjobs_go_to(tmp_path, queues, versions, error):
    c = config(tmp_path)
    c.resources.labels[module.KUEUE_QUEUE] = "team-a-gpus"
    fake = FakeKubernetes(
        [RUNNING],
        local_queues=queues,
        kueue_versions=versions,
        kueue_trainjobs="TrainJobs" not in (error or ""),
        workloads_forbidden="Workloads" in (error or ""),
    )
    try:
        if error is None:
            module.dry_run(c, fake.api(), NAMESPACE)
            assert (
                "POST" in [m for m, _ in fake.calls]
                and fake.calls[-1][1] == f"/apis/kueue.x-k8s.io/{max(versions)}/namespaces/{NAMESPACE}/workloads"
            )
            assert not fake.jobs
        else:
            with pytest.raises(DistributedError, match=error):
                module.dry_run(c, fake.api(), NAMESPACE)
    finally:
        fake.close()


def test_where_kueue_queues_every_trainjob_the_runs_first_task_checks_the_workloads_are_readable(tmp_path):
    """A namespace with a LocalQueue named default, and no queue in the run's labels: Kueue queues its TrainJobs
    all the same, and the train step reads their Workloads."""
    c = config(tmp_path)
    fake = FakeKubernetes([RUNNING], default_queue=True, workloads_forbidden=True)
    try:
        with pytest.raises(DistributedError, match="Kueue queues the run's TrainJobs, but .* forbidden"):
            module.dry_run(c, fake.api(), NAMESPACE)
    finally:
        fake.close()


def test_a_trainjob_being_deleted_or_made_before_the_annotation_is_told_by_what_it_is(tmp_path):
    """One the earlier attempt was deleting as it died (SIGTERM) is waited out
    and the round trained anew; one created without the inputs annotation (by
    an older tracefp4) is this step's if the round's inputs.json says so."""
    c = config(tmp_path)
    given = inputs(tmp_path)
    name = trainjob_name(c, RUN, 0)
    fake = FakeKubernetes([RUNNING, COMPLETE], on_complete=ranks_upload_outputs(c, tmp_path))
    fake.jobs[name] = trainjob(c, name, NAMESPACE, [], module.inputs_record(*given))
    fake.jobs[name]["metadata"]["deletionTimestamp"] = "2026-12-03T10:00:00Z"
    rows, log = completed_round(c, fake, given, tmp_path)
    assert [m for m, _ in fake.calls][:4] == ["GET", "DELETE", "GET", "POST"] and rows == [{"step": 1, "loss": 0.5}]
    assert any("being deleted by an earlier attempt" in line for line in log)

    for out in ("out", "out-state"):
        shutil.rmtree(tmp_path / out)
    open_store(c.store.uri).delete(f"{round_prefix(c, RUN, 0)}/history.json")  # the round not finished
    fake = FakeKubernetes([RUNNING, COMPLETE], on_complete=ranks_upload_outputs(c, tmp_path))
    fake.jobs[name] = trainjob(c, name, NAMESPACE, [], b"{}")
    del fake.jobs[name]["metadata"]["annotations"], fake.jobs[name]["spec"]["suspend"]
    rows, log = completed_round(c, fake, given, tmp_path)
    assert "POST" not in [m for m, _ in fake.calls] and any("on the same inputs: waiting" in line for line in log)


def test_a_trainjob_left_from_other_inputs_is_not_taken_for_this_steps(tmp_path):
    """The round's TrainJob running from other inputs (a second submission of
    the same settings under the same run id) fails the step and is left alone,
    with its inputs in the store. One that finished from other inputs is
    deleted, and so are its outputs and its ranks' checkpoints, before the
    round is trained from this step's own: neither this step, nor a retry of
    it after its own TrainJob failed, takes them for its own."""
    c = config(tmp_path)
    name = trainjob_name(c, RUN, 0)
    fake = FakeKubernetes([RUNNING])
    fake.jobs[name] = trainjob(c, name, NAMESPACE, [], b'{"policy": "another"}')
    message, _, _ = failed_round(c, fake, tmp_path, "another submission of these settings under run id")
    assert [m for m, _ in fake.calls] == ["GET"] and name in fake.jobs
    store = open_store(c.store.uri)
    assert store.list() == []  # nothing of this step's overwrote the running round's inputs

    def the_other_submissions_round():
        store.put_bytes(f"{round_prefix(c, RUN, 0)}/{module.INPUTS}", b'{"policy": "another"}')
        ranks_upload_outputs(c, tmp_path)()
        store.put_bytes(f"{round_prefix(c, RUN, 0)}/history.json", json.dumps([{"step": 1, "loss": 9.9}]).encode())
        store.put_bytes(f"{checkpoints_prefix(c, RUN, 0)}/step-000001/.metadata", b"its ranks' checkpoint")

    the_other_submissions_round()
    fake = FakeKubernetes([COMPLETE, FAILED])
    fake.jobs[name] = trainjob(c, name, NAMESPACE, [], b'{"policy": "another"}')
    _, log, job = failed_round(c, fake, tmp_path, "JobsFailed")
    assert [m for m, _ in fake.calls if "/pods" not in _][:4] == ["GET", "DELETE", "GET", "POST"]
    assert any("left finished from other inputs, deleting it" in line for line in log)
    assert not job.finished(module.inputs_record(*inputs(tmp_path)))  # a retry trains the round
    left = {key.removeprefix(round_prefix(c, RUN, 0) + "/") for key in store.list()}
    assert not {"history.json", "new-policy/checksums.json", "new-state/checksums.json"} & left
    assert store.list(checkpoints_prefix(c, RUN, 0) + "/") == []

    the_other_submissions_round()  # and a step whose TrainJob completes gives its ranks' rows, not the other's
    fake = FakeKubernetes([{}, RUNNING, COMPLETE])
    fake.on_get = lambda: "POST" in [m for m, _ in fake.calls] and ranks_upload_outputs(c, tmp_path)()
    rows, _ = completed_round(c, fake, inputs(tmp_path), tmp_path)
    assert rows == [{"step": 1, "loss": 0.5}]


def test_a_retry_after_the_ranks_finished_takes_their_outputs_without_training_again(tmp_path):
    c = config(tmp_path)
    given = inputs(tmp_path)
    record = module.inputs_record(*given)
    open_store(c.store.uri).put_bytes(f"{round_prefix(c, RUN, 0)}/{module.INPUTS}", record)  # the attempt's own
    ranks_upload_outputs(c, tmp_path)()
    fake = FakeKubernetes([{}])
    rows, log = completed_round(c, fake, given, tmp_path)
    assert rows == [{"step": 1, "loss": 0.5}] and (fetch(tmp_path / "out-state") / "state.json").exists()
    assert [m for m, _ in fake.calls] == ["DELETE"] and "an earlier attempt of this step trained the round" in log[0]
    # the next round, retried after its first attempt deleted the state its input stood for (its outputs were
    # out): its inputs' record pins that state by the manifest it keeps, so the retry takes those outputs
    store, nxt = open_store(c.store.uri), round_prefix(c, RUN, 1)
    given_next = (tmp_path / "out", tmp_path / "out-state", *given[2:])
    store.put_bytes(f"{nxt}/{module.INPUTS}", module.inputs_record(*given_next))
    for key in store.list(round_prefix(c, RUN, 0) + "/"):
        if "/new-" in key:
            store.put_bytes(key.replace(round_prefix(c, RUN, 0), nxt), store.get_bytes(key))
    store.put_bytes(f"{nxt}/history.json", json.dumps([{"step": 2}]).encode())
    store.delete_folder(f"{round_prefix(c, RUN, 0)}/new-state", MANIFEST)
    fake, retried = FakeKubernetes([{}]), []
    try:
        job = TrainJobRun(c, RUN, 1, fake.api(), namespace=NAMESPACE, poll_s=0.01)
        rows = job.run(*given_next, tmp_path / "out-2", tmp_path / "out-state-2", {}, echo=retried.append)
    finally:
        fake.close()
    assert rows == [{"step": 2}] and [m for m, _ in fake.calls] == ["DELETE"] and "an earlier attempt" in retried[0]
    assert location(tmp_path / "out-state-2") == f"{c.store.uri}/{nxt}/new-state"
    # another run given the same run id, with another learning rate: not a retry, so none of the above is its
    other = c.model_copy(update={"rl": c.rl.model_copy(update={"learning_rate": c.rl.learning_rate * 2})})
    assert trainjob_name(other, RUN, 0) != trainjob_name(c, RUN, 0)
    assert not TrainJobRun(other, RUN, 0, fake.api(), namespace=NAMESPACE).finished(record)  # no call made
    # a second submission of the same settings under the same run id, with trajectories of its own: not its outputs
    ranks_upload_outputs(c, tmp_path)()
    (tmp_path / "trajectories.jsonl").write_text('{"header": {"another": "rollout"}}\n')
    ours = TrainJobRun(c, RUN, 0, fake.api(), namespace=NAMESPACE)
    assert ours.finished(record) and not ours.finished(module.inputs_record(*given))


def test_an_api_server_that_does_not_answer_for_a_while_is_waited_out(tmp_path):
    c = config(tmp_path)
    fake = FakeKubernetes([RUNNING, COMPLETE], on_complete=ranks_upload_outputs(c, tmp_path), unavailable_gets=3)
    rows, log = completed_round(c, fake, inputs(tmp_path), tmp_path)
    assert rows == [{"step": 1, "loss": 0.5}]
    assert any("status unreadable" in line for line in log)


def test_a_deletion_waited_for_outlasts_an_api_server_that_does_not_answer(tmp_path, clock):
    """The job's gets answer 503 (the API server restarting) after its deletion: no news, polled again until gone."""
    c = config(tmp_path, timeout_seconds=30)
    fake = FakeKubernetes([FAILED], unavailable_gets=2)
    log = []
    try:
        job = TrainJobRun(c, RUN, 0, fake.api(), namespace=NAMESPACE, poll_s=1)
        fake.jobs[job.name] = {"metadata": {"name": job.name}}
        job.delete(log.append, wait=True)
    finally:
        fake.close()
    gets = [method for method, path in fake.calls if path.endswith(job.name)]
    assert gets == ["DELETE", "GET", "GET", "GET"] and not fake.jobs  # two unanswered, then 404: gone
    assert log[0].endswith("deleted") and "status unreadable" in log[1] and clock.now == 2


def test_a_terminated_step_deletes_its_trainjob(tmp_path):
    """SIGTERM (the run terminated) while the ranks train: the step exits, its TrainJob deleted on the way out."""
    fake = FakeKubernetes([RUNNING], on_get=lambda: os.kill(os.getpid(), signal.SIGTERM))
    before = signal.getsignal(signal.SIGTERM)
    try:
        job = TrainJobRun(config(tmp_path), RUN, 0, fake.api(), namespace=NAMESPACE, poll_s=0.01)
        with pytest.raises(SystemExit) as exited:
            job.run(*inputs(tmp_path), tmp_path / "out", tmp_path / "out-state", {}, echo=lambda line: None)
    finally:
        fake.close()
    assert exited.value.code == 128 + signal.SIGTERM and not fake.jobs
    assert [m for m, _ in fake.calls][-1] == "DELETE" and signal.getsignal(signal.SIGTERM) is before


class Clock:
    """The watch's clock (``time`` of the module): ``sleep`` moves it on at once. Waiting
    forever ends in an AssertionError instead of a hung test."""

    def __init__(self, limit_s: float = 3600):
        self.now, self.limit_s = 0.0, limit_s

    def monotonic(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.now += seconds
        assert self.now < self.limit_s, f"still waiting after {self.limit_s} s"


@pytest.fixture
def clock(monkeypatch) -> Clock:
    clock = Clock()
    monkeypatch.setattr(module, "time", clock)
    return clock


def test_a_deletion_the_api_server_refuses_leaves_the_steps_error_as_it_was(tmp_path):
    """The job failed and its deletion is forbidden: the step fails with the
    job's reason and its ranks' words, and says the job is left, with the
    command that deletes it; a refused deletion used to replace that error."""
    pods = {"run-tj-node-0-1": ({"phase": "Failed"}, "torch.OutOfMemoryError: CUDA out of memory\n")}
    fake = FakeKubernetes([{}, RUNNING, FAILED], pods=pods, failing_deletes=[403])
    message, log, job = failed_round(fake=fake, c=config(tmp_path), tmp_path=tmp_path, match="JobsFailed")
    assert "CUDA out of memory" in message and fake.jobs
    assert "answered 403; not deleted: `kubectl -n team-a delete trainjobs.trainer.kubeflow.org" in log[-1]


def test_a_deletion_the_api_server_does_not_answer_is_asked_again_and_fails_no_trained_round(tmp_path, clock):
    """The job completed, the ranks' outputs are in the store: deletions that
    answer 503 are asked again; where none is answered within
    train.timeout_seconds, the step still gives the round and says the job is left."""
    c = config(tmp_path, timeout_seconds=10)
    fake = FakeKubernetes([RUNNING, COMPLETE], on_complete=ranks_upload_outputs(c, tmp_path), failing_deletes=[503])
    log = []
    try:
        job = TrainJobRun(c, RUN, 0, fake.api(), namespace=NAMESPACE, poll_s=1)
        rows = job.run(*inputs(tmp_path), tmp_path / "out", tmp_path / "out-state", {}, echo=log.append)
        start = clock.now
        assert rows == [{"step": 1, "loss": 0.5}] and fake.jobs
        assert "deletion unanswered" in log[-2] and "not deleted" in log[-1]
        assert [m for m, _ in fake.calls].count("DELETE") == 12  # asked each second until 10 s had passed
        fake.failing_deletes = [503, 503, 200]
        job.let_go(log.append)
        assert [m for m, _ in fake.calls].count("DELETE") == 15 and log[-1].endswith("deleted")
        assert clock.now == start + 2
    finally:
        fake.close()


def test_a_trainjob_no_controller_picks_up_fails_after_the_timeout(tmp_path, clock):
    c = config(tmp_path, timeout_seconds=10)
    fake = FakeKubernetes([{}])
    failed_round(c, fake, tmp_path, "no status after 10 s: is Kubeflow Trainer installed", poll_s=0.5)
    assert not fake.jobs  # deleted all the same
    assert 10 < clock.now <= 11


def test_a_trainjob_kept_suspended_outside_kueues_queues_fails_after_the_timeout_saying_why(tmp_path, clock):
    """Where Kueue manages every job, with or without a queue label, it
    suspends again the TrainJob the step started (here the fake keeps it so)."""
    c = config(tmp_path, timeout_seconds=10)
    fake = FakeKubernetes([{}])
    fake.on_get = lambda: fake.jobs and fake.jobs[trainjob_name(c, RUN, 0)]["spec"].update(suspend=True)
    failed_round(c, fake, tmp_path, "still suspended 10 s .*manageJobsWithoutQueueName", poll_s=0.5)
    assert 10 < clock.now <= 11


def test_a_trainjob_whose_pods_never_get_ready_fails_after_the_timeout(tmp_path, clock):
    c = config(tmp_path, timeout_seconds=30)
    # the Trainer reports the job at once; its pods stay Pending (a runtime's initializer finishing is no progress)
    unschedulable = {
        "phase": "Pending",
        "conditions": [
            {"type": "PodScheduled", "status": "False", "reason": "Unschedulable",
             "message": "0/3 nodes are available: 3 Insufficient nvidia.com/gpu."},
        ],
    }  # fmt: skip
    fake = FakeKubernetes(
        [{}, {"jobsStatus": [{"name": "model-initializer", "succeeded": 1}, *PENDING["jobsStatus"]]}],
        pods={"run-tj-node-0-0": (unschedulable, "")},
    )
    message, log, job = failed_round(c, fake, tmp_path, poll_s=1)
    assert f"TrainJob {NAMESPACE}/{job.name}: waited 30 s (train.timeout_seconds)" in message
    assert "pods of its node job to be ready" in message and "node: active 1" in message
    assert message.endswith(
        "--- run-tj-node-0-0 (Pending) ---\nPodScheduled: Unschedulable: 0/3 nodes are available: 3 Insufficient "
        "nvidia.com/gpu."
    )
    assert 30 < clock.now <= 32 and not fake.jobs
    assert "node: active 1" in log[-2] and log[-1].endswith("deleted")


def test_a_trainjob_whose_pods_are_ready_is_not_timed_out_however_long_it_runs(tmp_path, clock):
    c = config(tmp_path, timeout_seconds=30)
    # 25 s Pending, 10 min running (all pods ready, then rank pods done), 25 s of pods not ready, complete
    running = [RUNNING] * 550 + [{"jobsStatus": [{"name": "node", "active": 1, "succeeded": 1}]}] * 50
    fake = FakeKubernetes([{}] * 5 + [PENDING] * 20 + running + [PENDING] * 25 + [COMPLETE])
    try:
        job = TrainJobRun(c, RUN, 0, fake.api(), namespace=NAMESPACE, poll_s=1)
        fake.jobs[job.name] = trainjob(c, job.name, NAMESPACE, [], b"{}")
        job.wait(echo=lambda line: None)
    finally:
        fake.close()
    assert clock.now == 650


def test_the_heartbeat_leaves_the_uploads_outcome_as_it_was(tmp_path):
    """A store that fails the heartbeat's last delete fails neither an upload that ended well nor replaces the
    error of one that did not: the heartbeat, left behind, stops beating, and goes with the round's inputs."""

    class Failing:
        def put_bytes(self, key, data):
            pass

        def delete(self, key):
            raise StoreError(f"delete {key!r} failed")

    with module.heartbeat(Failing(), "inputs-ready.json.uploading", timeout_s=10):
        pass
    with pytest.raises(ValueError, match="the upload's own"), module.heartbeat(Failing(), "k", timeout_s=10):
        raise ValueError("the upload's own")


def test_the_runs_first_task_asks_for_a_trainjob_without_creating_one(tmp_path, validator):
    """configure's dry run (dryRun=All) creates nothing; a refusal, here a
    misspelt runtime as the Trainer's webhook words it, fails it with the
    server's reason, before any step holds a GPU."""
    c = config(tmp_path)
    fake = FakeKubernetes([RUNNING])
    try:
        module.dry_run(c, fake.api(), NAMESPACE)
        assert fake.calls == [("POST", f"/apis/{GROUP}/{VERSION}/namespaces/{NAMESPACE}/{PLURAL}")] and not fake.jobs
        webhook = (
            'admission webhook "validate.trainjob.trainer.kubeflow.org" denied the request: '
            'ClusterTrainingRuntime.trainer.kubeflow.org "torch-distributd" not found'
        )
        fake.create_refusal = (422, webhook)
        with pytest.raises(
            DistributedError, match=f"refused a TrainJob of this run's settings in {NAMESPACE}.*{webhook}"
        ):
            module.dry_run(c, fake.api(), NAMESPACE)
    finally:
        fake.close()


def test_outside_a_cluster_the_trainjob_launcher_says_so(tmp_path, monkeypatch):
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
    with pytest.raises(DistributedError, match="no in-cluster service account.*train.launcher torchrun"):
        module.in_cluster_api()


def test_a_trainjob_that_never_goes_away_fails_the_step_after_the_timeout(tmp_path, clock):
    c = config(tmp_path, timeout_seconds=30)
    fake = FakeKubernetes([FAILED], deletes_hang=True)
    fake.jobs[trainjob_name(c, RUN, 0)] = {"metadata": {"name": "old"}}  # an earlier attempt's, failed: replaced
    failed_round(c, fake, tmp_path, "still there 30 s .* after its deletion", poll_s=1)
    assert 30 < clock.now <= 32
