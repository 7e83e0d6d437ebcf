"""`submit` and `runs` through kfp.Client against a fake Kubeflow Pipelines API
server on 127.0.0.1 (not a cluster): it answers the v2beta1 calls kfp.Client
makes (healthz, pipelines, uploads, versions, experiments, runs) the way the
API server does, keeps what was created in dicts and records every request."""

import datetime
import email
import ipaddress
import json
import signal
import socket
import ssl
import subprocess
import sys
import threading
import time
import urllib.parse
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
import yaml
from click.testing import CliRunner

from tracefp4.components.checkpoint import MANIFEST
from tracefp4.pipelines import submit as submit_module
from tracefp4.pipelines.cli import main
from tracefp4.pipelines.pipeline import pipeline_version
from tracefp4.pipelines.submit import (
    Connection,
    SubmitError,
    list_runs,
    log_commands,
    run_status,
    submit,
    submit_next,
)
from tracefp4.schemas import continuation, get_preset, load_config, next_in_chain

API = "/apis/v2beta1"
TOKEN = "s3cr3t-t0ken-value"
COOKIE = "authservice_session=c00kie-value"
EPOCH = "1970-01-01T00:00:00Z"


class FakeKfp(ThreadingHTTPServer):
    """Pipelines, versions, experiments and runs in dicts; ``fail[(method, path)] = (status, body)`` answers an
    error; ``delay_s`` holds every answer back; ``multi_user`` is what healthz says."""

    daemon_threads = True

    def __init__(self, tls: ssl.SSLContext | None = None):
        super().__init__(("127.0.0.1", 0), Handler)
        if tls is not None:
            self.socket = tls.wrap_socket(self.socket, server_side=True)
        self.scheme = "https" if tls else "http"
        self.requests, self.pipelines, self.versions, self.experiments, self.runs = [], {}, {}, {}, {}
        self.fail, self.delay_s, self.counter, self.multi_user = {}, 0.0, 0, False
        self.any_run: dict | None = None  # what GET /runs/{id} answers for an id it does not know (see this_run)

    def handle_error(self, request, client_address):
        """A client that gave up waiting (a timeout's test) is no error: socketserver printed its broken pipe to
        whatever stood for standard error then, another test's captured command output (a CliRunner's)."""
        if not isinstance(sys.exc_info()[1], (BrokenPipeError, ConnectionResetError)):
            super().handle_error(request, client_address)

    @property
    def url(self):
        return f"{self.scheme}://127.0.0.1:{self.server_address[1]}"

    def new_id(self, kind):
        self.counter += 1
        return f"{kind}-{self.counter}"

    def calls(self):
        return [(r["method"], r["path"]) for r in self.requests]


class Handler(BaseHTTPRequestHandler):
    server: FakeKfp

    def log_message(self, *args):
        pass

    def _answer(self, status, body):
        data = body if isinstance(body, bytes) else json.dumps(body).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def _handle(self, method):
        s = self.server
        url = urllib.parse.urlsplit(self.path)
        query = dict(urllib.parse.parse_qsl(url.query))
        length = int(self.headers.get("Content-Length") or 0)
        body = self.rfile.read(length) if length else b""
        headers = {k.lower(): v for k, v in self.headers.items()}
        record = {"method": method, "path": url.path, "query": query, "headers": headers, "body": body}
        s.requests.append(record)
        if s.delay_s:
            time.sleep(s.delay_s)
        if (method, url.path) in s.fail:
            status, answer = s.fail[(method, url.path)]
            return self._answer(status, answer(self) if callable(answer) else answer)
        wanted = None
        if query.get("filter"):
            (pred,) = json.loads(query["filter"])["predicates"]
            assert pred["key"] == "display_name" and pred["operation"] in (1, "EQUALS")
            wanted = pred["stringValue"]

        def listing(items, namespace_key=None):
            found = [i for i in items if wanted is None or i["display_name"] == wanted]
            if query.get("namespace"):
                found = [i for i in found if i.get("namespace") == query["namespace"]]
            return found

        parts = url.path.removeprefix(API).strip("/").split("/")
        if method == "GET" and parts == ["healthz"]:
            return self._answer(200, {"multi_user": s.multi_user})
        if method == "GET" and parts == ["pipelines"]:
            found = listing(s.pipelines.values())
            return self._answer(200, {"pipelines": found, "total_size": len(found)} if found else {})
        if method == "POST" and parts == ["pipelines", "upload"]:
            name = query["name"]
            if any(
                p["display_name"] == name and p.get("namespace") == query.get("namespace") for p in s.pipelines.values()
            ):
                return self._answer(409, {"error_message": f"pipeline {name} already exists", "code": 6})
            p = {"pipeline_id": s.new_id("pipeline"), "name": name, "display_name": query.get("display_name", name)}
            if query.get("namespace"):
                p["namespace"] = query["namespace"]
            s.pipelines[p["pipeline_id"]] = p
            first = {"pipeline_id": p["pipeline_id"], "pipeline_version_id": s.new_id("version"), "display_name": name}
            first["pipeline_spec"] = version_spec(record)
            s.versions[p["pipeline_id"]] = [first]  # the API server's first version, named after the pipeline
            return self._answer(200, p)
        if method == "GET" and len(parts) == 3 and parts[0] == "pipelines" and parts[2] == "versions":
            if parts[1] not in s.pipelines:
                return self._answer(404, {"code": 5, "message": f"pipeline {parts[1]} not found"})
            found = listing(s.versions[parts[1]])
            return self._answer(200, {"pipeline_versions": found, "total_size": len(found)} if found else {})
        if method == "GET" and len(parts) == 4 and parts[0] == "pipelines" and parts[2] == "versions":
            found = [v for v in s.versions.get(parts[1], []) if v["pipeline_version_id"] == parts[3]]
            if not found:
                return self._answer(404, {"code": 5, "message": f"pipeline version {parts[3]} not found"})
            return self._answer(200, found[0])
        if method == "POST" and parts == ["pipelines", "upload_version"]:
            name = query["name"]
            v = {"pipeline_id": query["pipelineid"], "pipeline_version_id": s.new_id("version"), "display_name": name}
            v["pipeline_spec"] = version_spec(record)
            s.versions[query["pipelineid"]].append(v)
            return self._answer(200, v)
        if method == "GET" and parts == ["experiments"]:
            found = listing(s.experiments.values())
            return self._answer(200, {"experiments": found} if found else {})
        if method == "POST" and parts == ["experiments"]:
            e = dict(json.loads(body), experiment_id=s.new_id("experiment"))
            s.experiments[e["experiment_id"]] = e
            return self._answer(200, e)
        if method == "POST" and parts == ["runs"]:
            now = datetime.datetime.now(datetime.UTC).isoformat().replace("+00:00", "Z")
            # the times the API server has not recorded yet it answers as the Unix epoch (KFP 2.17's toApiRun)
            r = dict(json.loads(body), run_id=s.new_id("run"), state="PENDING", created_at=now, finished_at=EPOCH)
            s.runs[r["run_id"]] = r
            return self._answer(200, r)
        if method == "GET" and len(parts) == 2 and parts[0] == "experiments":
            if parts[1] not in s.experiments:
                return self._answer(404, {"code": 5, "message": f"experiment {parts[1]} not found"})
            return self._answer(200, s.experiments[parts[1]])
        if method == "GET" and parts == ["runs"]:
            found = [r for r in s.runs.values() if query.get("experiment_id") in (None, r.get("experiment_id"))]
            found = [r for r in found if wanted is None or r["display_name"] == wanted]
            found.sort(key=lambda r: r["created_at"], reverse=query.get("sort_by") == "created_at desc")
            found = found[: int(query.get("page_size") or 10)]
            return self._answer(200, {"runs": found, "total_size": len(found)} if found else {})
        if method == "GET" and len(parts) == 2 and parts[0] == "runs":
            if parts[1] in s.runs:
                return self._answer(200, s.runs[parts[1]])
            if s.any_run is not None:
                return self._answer(200, {**s.any_run, "run_id": parts[1]})
            return self._answer(404, {"code": 5, "message": f"run {parts[1]} not found"})
        return self._answer(404, {"code": 5, "message": f"no route {method} {url.path}"})

    def do_GET(self):
        self._handle("GET")

    def do_POST(self):
        self._handle("POST")


def _serve(server):
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
    thread.start()
    return server


@pytest.fixture(autouse=True)
def isolated(monkeypatch, tmp_path):
    """No proxies, no token or cookie from this machine, no kfp context file of the user's, no mounted token."""
    proxies = ("http_proxy", "https_proxy", "HTTP_PROXY", "HTTPS_PROXY", "all_proxy", "ALL_PROXY")
    kfp_env = ("TOKEN", "COOKIES", "ENDPOINT", "SA_TOKEN_PATH", "UI_ENDPOINT")
    for var in proxies + tuple(f"KF_PIPELINES_{name}" for name in kfp_env):
        monkeypatch.delenv(var, raising=False)
    import kfp

    monkeypatch.setattr(kfp.Client, "_LOCAL_KFP_CONTEXT", str(tmp_path / "kfp-context.json"))
    monkeypatch.setattr(submit_module, "KFP_TOKEN_FILE", tmp_path / "no-kfp-token")
    monkeypatch.setattr(submit_module, "SERVICE_ACCOUNT_TOKEN_FILE", tmp_path / "no-sa-token")


@pytest.fixture
def kfp_server():
    server = _serve(FakeKfp())
    yield server
    server.shutdown()
    server.server_close()


@pytest.fixture(scope="module")
def config():
    return get_preset("smoke")


def _uploaded_file(request):
    content_type = request["headers"]["content-type"]
    assert content_type.startswith("multipart/form-data; boundary=")
    message = email.message_from_bytes(f"Content-Type: {content_type}\r\n\r\n".encode() + request["body"])
    (part,) = message.get_payload()
    assert part.get_param("name", header="content-disposition") == "uploadfile"
    return part


def uploaded_documents(request) -> list[dict]:
    return [doc for doc in yaml.safe_load_all(_uploaded_file(request).get_payload(decode=True)) if doc]


def uploaded_yaml(request) -> dict:
    assert _uploaded_file(request).get_filename() in ("tracefp4-smoke.yaml", "tracefp4-smoke-compare.yaml")
    return uploaded_documents(request)[0]


def version_spec(request) -> dict:
    """An uploaded file as the API server keeps its version's spec: the pipeline spec, wrapped with the
    platform spec where the file holds one (KFP 2.17's YamlStringToPipelineSpecStruct)."""
    pipeline, *platform = uploaded_documents(request)
    return {"pipeline_spec": pipeline, "platform_spec": platform[0]} if platform else pipeline


def test_first_submission_uploads_the_pipeline_and_creates_experiment_and_run(kfp_server, config):
    result = submit(config, kfp_server.url, experiment="fp4-study")
    assert kfp_server.calls() == [
        ("GET", f"{API}/healthz"),  # kfp.Client: multi-user or not, as no namespace was given
        ("GET", f"{API}/pipelines"),
        ("POST", f"{API}/pipelines/upload"),
        ("GET", f"{API}/pipelines/pipeline-1/versions"),
        ("POST", f"{API}/pipelines/upload_version"),
        ("GET", f"{API}/experiments"),
        ("POST", f"{API}/experiments"),
        ("POST", f"{API}/runs"),
    ]
    _, lookup, upload, _, version_upload, _, new_experiment, run = kfp_server.requests
    assert json.loads(lookup["query"]["filter"])["predicates"] == [
        {"operation": 1, "key": "display_name", "stringValue": "tracefp4-smoke"}
    ]
    assert upload["query"]["name"] == "tracefp4-smoke" and "namespace" not in upload["query"]
    spec = uploaded_yaml(upload)
    assert spec["pipelineInfo"]["name"] == "tracefp4-smoke"
    version = version_upload["query"]["name"]  # package version, schema hash, then a hash of this DAG
    assert version.startswith(pipeline_version() + "-") and len(version) == len(pipeline_version()) + 9
    assert version_upload["query"]["pipelineid"] == "pipeline-1"
    assert version_upload["query"]["description"] == f"tracefp4 {version}"
    assert uploaded_yaml(version_upload) == spec
    assert json.loads(new_experiment["body"])["display_name"] == "fp4-study"
    body = json.loads(run["body"])
    assert body["display_name"].startswith("smoke-")
    assert body["experiment_id"] == "experiment-4"
    assert body["pipeline_version_reference"] == {"pipeline_id": "pipeline-1", "pipeline_version_id": "version-3"}
    # the run's parameters: the compiled pipeline's inputs with their defaults (the config)
    inputs = spec["root"]["inputDefinitions"]["parameters"]
    assert body["runtime_config"]["parameters"] == {
        k: p["defaultValue"] for k, p in inputs.items() if "defaultValue" in p
    }
    assert body["runtime_config"]["parameters"]
    assert "pipeline_root" not in body["runtime_config"]  # the cluster's default unless asked
    assert result == {
        "pipeline_id": "pipeline-1",
        "pipeline_version_id": "version-3",
        "experiment_id": "experiment-4",
        "run_id": "run-5",
        "run_url": f"{kfp_server.url}/#/runs/details/run-5",
    }
    assert all("authorization" not in r["headers"] and "cookie" not in r["headers"] for r in kfp_server.requests)
    assert "service_account" not in body  # KFP's default unless asked


def test_a_run_can_name_its_service_account_and_pipeline_root(kfp_server, config):
    submit(
        config,
        kfp_server.url,
        service_account="tracefp4-pipeline-runner",
        pipeline_root="minio://tracefp4/pipeline-root",
    )
    body = json.loads(kfp_server.requests[-1]["body"])
    assert body["service_account"] == "tracefp4-pipeline-runner"
    assert body["runtime_config"]["pipeline_root"] == "minio://tracefp4/pipeline-root"


THIS_RUN = "0c9e7f2a-5b4d-4e1f-9a8b-123456789abc"  # KFP's run id of the run whose last task submits the next
POLICY, STATE = (f"minio://tracefp4/pipeline-root/smoke/{THIS_RUN}/train/{name}" for name in ("new_policy", "state"))


def this_run(server: FakeKfp, namespace: str | None = None, any_id: bool = False) -> None:
    """The run a chain task finds itself in: its experiment, service account and pipeline root (``any_id``: what
    the server says of any run id, a run kfp.local executes standing for one on the cluster)."""
    experiment = {"experiment_id": "experiment-0", "display_name": "long-schedules"}
    if namespace:
        experiment["namespace"] = namespace
    server.experiments[experiment["experiment_id"]] = experiment
    server.runs[THIS_RUN] = {
        "run_id": THIS_RUN,
        "display_name": "smoke-20261205-050000",
        "experiment_id": "experiment-0",
        "service_account": "tracefp4-pipeline-runner",
        "runtime_config": {"pipeline_root": "minio://tracefp4/pipeline-root", "parameters": {}},
        "state": "RUNNING",
        "created_at": "2026-12-05T05:00:00Z",
    }
    if any_id:
        server.any_run = server.runs.pop(THIS_RUN)


def chained(rounds: int, **settings):
    """The smoke config, ``rounds`` rounds two a run; and what its first run's last train task records."""
    config = load_config(preset="smoke", overrides={"rl.rounds": rounds, "rl.rounds_per_run": 2, **settings})
    return config, {"method": "trace", **continuation(POLICY, STATE, 2)}


def test_a_chained_runs_last_task_submits_the_next_run_once(kfp_server):
    """Rounds 0-1 of 5 done: the next run continues at round 2 from the last train task's policy and state, in
    this run's experiment with its service account and pipeline root, and ends by submitting the one after; a
    retry of the task finds the run it submitted."""
    this_run(kfp_server)
    config, continue_with = chained(5)
    run = submit_next(config, continue_with, THIS_RUN, Connection(kfp_server.url), warn=pytest.fail)
    assert run["submitted"] and run["name"] == "smoke-rounds-2-3-after-0c9e7f2a"
    created = json.loads(kfp_server.requests[-1]["body"])
    assert created["display_name"] == run["name"] and created["experiment_id"] == "experiment-0"
    assert created["service_account"] == "tracefp4-pipeline-runner"
    params = created["runtime_config"]["parameters"]
    assert created["runtime_config"]["pipeline_root"] == "minio://tracefp4/pipeline-root"
    assert (params["model_checkpoint"], params["model_trainer_state"]) == (POLICY, STATE)
    assert params["bootstrap_enabled"] is False and params["method"] == "trace"
    upload = next(r for r in kfp_server.requests if r["path"].endswith("/pipelines/upload"))
    spec = uploaded_yaml(upload)
    assert "rounds 2 from round 2, the 1 left to the next run" in spec["pipelineInfo"]["description"]
    tasks = spec["root"]["dag"]["tasks"]  # its initial policy is this run's trained one, evaluated here
    assert "chain" in tasks and set(tasks["evaluate"]["inputs"]["artifacts"]) == {"policy"}

    again = submit_next(config, continue_with, THIS_RUN, Connection(kfp_server.url))
    assert again == {"run_id": run["run_id"], "name": run["name"], "submitted": False}
    assert len(kfp_server.runs) == 2  # this run and the one it submitted


def test_the_last_link_of_a_chain_submits_none_after_it(kfp_server):
    this_run(kfp_server, namespace="team-a")
    config, continue_with = chained(3)
    run = submit_next(config, continue_with, THIS_RUN, Connection(kfp_server.url))
    assert run["name"] == "smoke-rounds-2-2-after-0c9e7f2a"
    upload = next(r for r in kfp_server.requests if r["path"].endswith("/pipelines/upload"))
    assert upload["query"]["namespace"] == "team-a"  # the experiment's profile namespace
    spec = uploaded_yaml(upload)
    assert "rounds 1 from round 2;" in spec["pipelineInfo"]["description"]
    assert "chain" not in spec["root"]["dag"]["tasks"]


def test_the_chain_component_submits_through_the_configs_kfp_host(kfp_server, capsys):
    """The component's body as its pod runs it: the history artifact's metadata (the last train task's) names
    where to go on from; an API it cannot reach fails the task, saying so."""
    from kfp.dsl import Dataset

    from tracefp4.pipelines import components

    this_run(kfp_server)
    config, continue_with = chained(5, kfp_host=kfp_server.url)
    history = Dataset(
        uri="minio://tracefp4/pipeline-root/history", metadata={"continue_with": json.dumps(continue_with)}
    )
    run_id = components.chain(config.model_dump_json(), history, THIS_RUN)
    assert kfp_server.runs[run_id]["display_name"] == "smoke-rounds-2-3-after-0c9e7f2a"
    assert f"submitted: run smoke-rounds-2-3-after-0c9e7f2a ({run_id})" in capsys.readouterr().out
    unreachable = config.model_copy(update={"kfp_host": "http://127.0.0.1:9"})
    with pytest.raises(RuntimeError, match="submitting the next run failed"):
        components.chain(unreachable.model_dump_json(), history, THIS_RUN)
    assert "chain: GET /apis/v2beta1/healthz: cannot reach http://127.0.0.1:9" in capsys.readouterr().out


def test_a_chained_smoke_run_ends_by_submitting_its_next_run(kfp_server, tmp_path):
    """The compiled chain task as it runs: kfp.local executes round 0 of a smoke schedule of 2, one round a run
    (not through run_local, which runs every round), and its last task reaches the API at kfp_host: the run it
    submits goes on at round 1 from the artifacts of this run's train task."""
    import kfp.local

    from tracefp4.pipelines.local import localize
    from tracefp4.pipelines.pipeline import build_pipeline

    this_run(kfp_server, any_id=True)
    # evaluation.initial off as in a chain's later runs: evaluate runs without its optional input
    config = localize(load_config(preset="smoke", overrides={"rl.rounds": 2, "evaluation.initial": False}), tmp_path)
    # what a local run leaves out, the chained run's: one round a run, its next submitted through kfp_host
    rl = config.rl.model_copy(update={"rounds_per_run": 1})
    config = config.model_copy(update={"rl": rl, "kfp_host": kfp_server.url})
    kfp.local.init(runner=kfp.local.SubprocessRunner(use_venv=False), pipeline_root=str(tmp_path / "root"))
    build_pipeline(config, retries=False)(run_id="chained")
    ((run_id, created),) = [(i, r) for i, r in kfp_server.runs.items()]
    assert created["display_name"].startswith("smoke-rounds-1-1-after-")
    train = next((tmp_path / "root").iterdir()) / "train"
    params = created["runtime_config"]["parameters"]
    assert params["model_checkpoint"] == str(train / "new_policy")
    assert params["model_trainer_state"] == str(train / "new_trainer_state")
    root = next((tmp_path / "root").iterdir())
    assert (root / "chain").is_dir()
    accuracy = json.loads((root / "evaluate" / "results").read_text())["accuracy"]
    assert {row["policy"] for row in accuracy} == {"trained"}
    spec = uploaded_yaml(next(r for r in kfp_server.requests if r["path"].endswith("/pipelines/upload")))
    assert "rounds 1 from round 1;" in spec["pipelineInfo"]["description"]


def test_a_chain_goes_on_only_from_its_own_last_round():
    config, continue_with = chained(5)
    with pytest.raises(ValueError, match="end before round 2, but its last train task continues at round 3"):
        next_in_chain(config, {**continue_with, "rl.first_round": 3})
    unchained, _ = chained(2)
    with pytest.raises(ValueError, match="rl.rounds 2 are done in one run"):
        next_in_chain(unchained, continue_with)


def test_a_run_too_large_to_finish_is_warned_of_before_it_is_uploaded(kfp_server, config):
    """The paper preset's 100 rounds unrolled in one run: more tasks than a KFP run holds (docs/deploy.md, "Known
    limit"); as the preset chains them, 14 a run, none."""
    from tracefp4.schemas import get_preset

    warned = []
    submit(config, kfp_server.url, warn=warned.append)
    assert warned == []
    uploads = lambda: sum(r["path"].endswith("upload") for r in kfp_server.requests)  # noqa: E731
    before = uploads()
    unchained = load_config(preset="paper-nvfp4-wa-kv", overrides={"rl.rounds_per_run": 0})
    submit(unchained, kfp_server.url, warn=lambda m: warned.append((m, uploads())))
    ((message, uploads_then),) = warned
    assert "305 tasks in a run" in message and "rl.rounds_per_run" in message and uploads_then == before < uploads()
    submit(get_preset("paper-nvfp4-wa-kv"), kfp_server.url, warn=warned.append)  # 14 rounds a run, chained
    assert len(warned) == 1


def test_a_comparison_is_its_own_pipeline(kfp_server, config):
    submit(config, kfp_server.url, methods=["trace", "qat"])
    upload = next(r for r in kfp_server.requests if r["path"].endswith("/pipelines/upload"))
    assert upload["query"]["name"] == "tracefp4-smoke-compare"
    assert "methods trace, qat" in uploaded_yaml(upload)["pipelineInfo"]["description"]


def test_second_submission_uploads_a_version_and_a_third_reuses_it(kfp_server, config):
    kfp_server.pipelines["p-old"] = {"pipeline_id": "p-old", "display_name": "tracefp4-smoke"}
    kfp_server.versions["p-old"] = [
        {"pipeline_id": "p-old", "pipeline_version_id": "v-old", "display_name": "0.0.9-old"}
    ]
    kfp_server.experiments["e-old"] = {"experiment_id": "e-old", "display_name": "tracefp4"}
    first = submit(config, kfp_server.url)
    assert kfp_server.calls()[1:] == [
        ("GET", f"{API}/pipelines"),
        ("GET", f"{API}/pipelines/p-old/versions"),
        ("POST", f"{API}/pipelines/upload_version"),
        ("GET", f"{API}/experiments"),
        ("POST", f"{API}/runs"),
    ]
    assert kfp_server.requests[3]["query"]["pipelineid"] == "p-old"
    assert uploaded_yaml(kfp_server.requests[3])["pipelineInfo"]["name"] == "tracefp4-smoke"
    assert (
        first["pipeline_id"] == "p-old"
        and first["experiment_id"] == "e-old"
        and first["pipeline_version_id"] != "v-old"
    )

    kfp_server.requests.clear()
    second = submit(config, kfp_server.url)
    assert kfp_server.calls()[1:] == [
        ("GET", f"{API}/pipelines"),
        ("GET", f"{API}/pipelines/p-old/versions"),
        ("GET", f"{API}/experiments"),
        ("POST", f"{API}/runs"),
    ]
    lookup = json.loads(kfp_server.requests[2]["query"]["filter"])["predicates"][0]["stringValue"]
    assert lookup.startswith(pipeline_version() + "-")
    assert second["pipeline_version_id"] == first["pipeline_version_id"] and second["run_id"] != first["run_id"]
    assert len(kfp_server.runs) == 2 and len(kfp_server.pipelines) == 1
    kfp_server.requests.clear()
    submit(config.model_copy(update={"image": "registry.example/tracefp4:other"}), kfp_server.url)  # another DAG
    assert ("POST", f"{API}/pipelines/upload_version") in kfp_server.calls()


def test_a_namespace_goes_to_pipeline_experiment_and_lookups_and_skips_the_healthz_probe(kfp_server, config):
    submit(config, Connection(kfp_server.url, namespace="kubeflow-user-example-com"))
    assert ("GET", f"{API}/healthz") not in kfp_server.calls()
    lookup, upload = kfp_server.requests[:2]
    assert lookup["query"]["namespace"] == upload["query"]["namespace"] == "kubeflow-user-example-com"
    experiments = next(r for r in kfp_server.requests if r["path"] == f"{API}/experiments" and r["method"] == "GET")
    assert experiments["query"]["namespace"] == "kubeflow-user-example-com"
    (experiment,) = kfp_server.experiments.values()
    assert experiment["namespace"] == "kubeflow-user-example-com"
    kfp_server.requests.clear()
    submit(config, Connection(kfp_server.url, namespace="kubeflow-user-example-com"))  # found in its namespace
    assert ("POST", f"{API}/pipelines/upload") not in kfp_server.calls() and len(kfp_server.pipelines) == 1


@pytest.mark.parametrize(
    "status, route, answer, message",
    [
        (
            500,
            ("POST", f"{API}/runs"),
            {"error": "internal", "code": 13, "message": "database is down"},
            "database is down",
        ),
        (403, ("GET", f"{API}/pipelines"), b"RBAC: access denied", "RBAC: access denied"),
        (
            400,
            ("POST", f"{API}/pipelines/upload"),
            {"error_message": "Failed to read pipeline"},
            "Failed to read pipeline",
        ),
        (503, ("GET", f"{API}/healthz"), {"message": "upstream connect error"}, "upstream connect error"),
    ],
)
def test_http_errors_name_method_path_status_and_message(kfp_server, config, status, route, answer, message):
    kfp_server.fail[route] = (status, answer)
    start = time.monotonic()
    with pytest.raises(SubmitError) as e:
        submit(config, kfp_server.url)
    text = str(e.value)
    assert f"{route[0]} {route[1]}" in text and f"HTTP {status}" in text and message in text
    assert e.value.__cause__ is None and e.value.__suppress_context__  # no chained kfp/urllib3 traceback
    assert kfp_server.calls()[-1] == route  # stops at the failing call, tried once
    assert time.monotonic() - start < 5  # kfp.Client's healthz probe would retry for 25 s


def test_refused_connection_fails_quickly(config):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # closed again: nothing listens there
    start = time.monotonic()
    with pytest.raises(SubmitError, match=rf"GET /apis/v2beta1/healthz: cannot reach http://127.0.0.1:{port}"):
        submit(config, f"http://127.0.0.1:{port}/", timeout_s=2)
    assert time.monotonic() - start < 3


def test_a_silent_server_times_out(kfp_server, config):
    # The server holds its answer far longer than the bound below, so the bound
    # fails only if the timeout is not applied; urllib3's retries of an
    # idempotent GET (4 tries of 0.2 s) and a loaded machine fit well inside it
    # (a bound of 6 s beside an 8 s delay failed once, at 6.1 s, on a machine
    # running twice as many processes as it has cores).
    kfp_server.delay_s = 60.0
    start = time.monotonic()
    with pytest.raises(SubmitError, match=r"no answer from .* within 0.2 s"):
        submit(config, Connection(kfp_server.url, namespace="ns", timeout_s=0.2))
    assert time.monotonic() - start < 30


def test_token_is_sent_and_never_shown(kfp_server, config, monkeypatch):
    submit(config, kfp_server.url, token=TOKEN)
    assert kfp_server.requests and all(r["headers"]["authorization"] == f"Bearer {TOKEN}" for r in kfp_server.requests)

    kfp_server.requests.clear()
    monkeypatch.setenv("KF_PIPELINES_TOKEN", TOKEN)  # from the environment too; a server that echoes it back
    kfp_server.fail[("POST", f"{API}/runs")] = (
        403,
        lambda h: {"message": f"token {h.headers['Authorization']} lacks access"},
    )
    with pytest.raises(SubmitError) as e:
        submit(config, kfp_server.url)
    assert kfp_server.requests[-1]["headers"]["authorization"] == f"Bearer {TOKEN}"
    assert "HTTP 403" in str(e.value) and "lacks access" in str(e.value) and TOKEN not in str(e.value)
    assert TOKEN not in repr(e.value)


def test_in_a_pod_the_mounted_token_is_used(kfp_server, config, monkeypatch, tmp_path):
    sa_token = tmp_path / "sa-token"
    sa_token.write_text("service-account-token\n")
    monkeypatch.setattr(submit_module, "SERVICE_ACCOUNT_TOKEN_FILE", sa_token)
    submit(config, kfp_server.url)
    assert all(r["headers"]["authorization"] == "Bearer service-account-token" for r in kfp_server.requests)

    kfp_token = tmp_path / "kfp-token"  # KFP's projected token wins over the service account's
    kfp_token.write_text("kfp-audience-token")
    monkeypatch.setenv("KF_PIPELINES_SA_TOKEN_PATH", str(kfp_token))
    kfp_server.requests.clear()
    submit(config, kfp_server.url)
    assert all(r["headers"]["authorization"] == "Bearer kfp-audience-token" for r in kfp_server.requests)
    kfp_server.requests.clear()
    submit(config, Connection(kfp_server.url, token=TOKEN))  # an explicit token wins over both
    assert all(r["headers"]["authorization"] == f"Bearer {TOKEN}" for r in kfp_server.requests)


def test_a_session_cookie_is_sent_and_never_shown(kfp_server, config, monkeypatch):
    submit(config, Connection(kfp_server.url, cookies=COOKIE))
    assert all(r["headers"]["cookie"] == COOKIE for r in kfp_server.requests)
    monkeypatch.setenv("KF_PIPELINES_COOKIES", COOKIE)
    kfp_server.fail[("GET", f"{API}/experiments")] = (401, lambda h: {"message": f"bad session {h.headers['Cookie']}"})
    with pytest.raises(SubmitError) as e:
        submit(config, kfp_server.url)
    assert "HTTP 401" in str(e.value) and "c00kie-value" not in str(e.value)


def test_a_login_page_is_an_error_and_no_secret_leaves(kfp_server, monkeypatch):
    monkeypatch.setenv("TRACEFP4_S3_ACCESS_KEY", "AKIA-never-sent")
    monkeypatch.setenv("TRACEFP4_S3_SECRET_KEY", "never-sent-either")
    config = load_config(None, preset="smoke", overrides={"store.uri": "s3://runs/smoke"})
    submit(config, kfp_server.url)
    assert not any(b"never-sent" in r["body"] or "never-sent" in json.dumps(r["query"]) for r in kfp_server.requests)

    kfp_server.fail[("GET", f"{API}/experiments")] = (200, b"<html><body>Log in</body></html>")
    with pytest.raises(SubmitError, match="GET /apis/v2beta1/experiments: the answer is not JSON .a login page"):
        submit(config, kfp_server.url)


def test_host_must_be_a_url(config):
    with pytest.raises(SubmitError, match="http:// or https://"):
        submit(config, "kfp.example.com")


def _self_signed(folder):
    """A certificate for 127.0.0.1 signed by itself, and its key, as PEM files."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "127.0.0.1")])
    now = datetime.datetime.now(datetime.UTC)
    builder = x509.CertificateBuilder().subject_name(name).issuer_name(name).public_key(key.public_key())
    builder = builder.serial_number(x509.random_serial_number()).not_valid_before(now)
    builder = builder.not_valid_after(now + datetime.timedelta(1))
    san = x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address("127.0.0.1"))])
    cert = builder.add_extension(san, False).add_extension(x509.BasicConstraints(ca=True, path_length=None), True)
    cert = cert.sign(key, hashes.SHA256())
    (folder / "cert.pem").write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    pem = key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption())
    (folder / "key.pem").write_bytes(pem)
    return folder / "cert.pem", folder / "key.pem"


def test_a_self_signed_gateway_needs_its_ca_bundle_or_no_verification(config, tmp_path):
    cert, key = _self_signed(tmp_path)
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.load_cert_chain(cert, key)
    server = _serve(FakeKfp(tls=context))
    try:
        with pytest.raises(SubmitError, match="certificate|CERTIFICATE") as e:
            submit(config, Connection(server.url, timeout_s=5))
        assert "/apis/v2beta1/healthz" in str(e.value)
        assert submit(config, Connection(server.url, ca_bundle=str(cert)))["run_id"]
        assert submit(config, Connection(server.url, verify_ssl=False))["run_id"]
    finally:
        server.shutdown()
        server.server_close()


def _finished_run(server, run_id):
    server.runs[run_id].update(
        state="FAILED",
        finished_at="2026-11-20T10:05:00Z",
        error={"code": 9, "message": "task rollout-r0 failed"},
        run_details={
            "task_details": [
                {
                    "task_id": "t1",
                    "display_name": "prepare",
                    "state": "SUCCEEDED",
                    "start_time": "2026-11-20T10:00:00Z",
                    "child_tasks": [
                        {"pod_name": "smoke-abc-system-container-driver-1"},
                        {"pod_name": "smoke-abc-system-container-impl-2"},
                    ],
                },
                {
                    "task_id": "t2",
                    "display_name": "rollout-r0",
                    "state": "FAILED",
                    "start_time": "2026-11-20T10:01:00Z",
                    "error": {"code": 2, "message": "CUDA out of memory"},
                    "pod_name": "smoke-abc-system-container-impl-3",
                },
            ]
        },
    )


def test_runs_list_status_and_log_commands(kfp_server, config):
    connection = Connection(kfp_server.url)
    first = submit(config, connection)
    second = submit(config, connection, experiment="other")
    _finished_run(kfp_server, first["run_id"])
    listed = list_runs(connection)
    assert [r["run_id"] for r in listed] == [second["run_id"], first["run_id"]]
    assert listed[1]["state"] == "FAILED" and listed[1]["name"].startswith("smoke-")
    assert [r["run_id"] for r in list_runs(connection, experiment="other")] == [second["run_id"]]
    with pytest.raises(SubmitError, match="No experiment is found with name nope"):
        list_runs(connection, experiment="nope")

    status = run_status(connection, first["run_id"])
    assert status["state"] == "FAILED" and status["error"] == "task rollout-r0 failed"
    assert [(t["name"], t["state"], t["error"]) for t in status["tasks"]] == [
        ("prepare", "SUCCEEDED", ""),
        ("rollout-r0", "FAILED", "CUDA out of memory"),
    ]
    assert log_commands(status, None) == [
        "kubectl -n kubeflow logs smoke-abc-system-container-driver-1 -c main",
        "kubectl -n kubeflow logs smoke-abc-system-container-impl-2 -c main",
        "kubectl -n kubeflow logs smoke-abc-system-container-impl-3 -c main",
    ]
    assert log_commands(status, "team-a")[0].startswith("kubectl -n team-a logs ")
    with pytest.raises(SubmitError, match=r"GET /apis/v2beta1/runs/missing -> HTTP 404 .*run missing not found"):
        run_status(connection, "missing")


def test_a_run_not_finished_shows_no_finishing_time(kfp_server, config):
    """The API server answers an unfinished run's finished_at as the Unix epoch, which was shown as
    "finished 1970-01-01 00:00:00"; and its tasks are listed in the order they started, those yet to start
    ("-", which sorted first) after them."""
    run_id = submit(config, Connection(kfp_server.url))["run_id"]
    waiting = {"task_id": "t2", "display_name": "rollout-r0", "state": "PENDING"}
    started = {"task_id": "t1", "display_name": "prepare", "state": "RUNNING", "start_time": "2026-11-20T10:00:00Z"}
    kfp_server.runs[run_id].update(state="RUNNING", run_details={"task_details": [waiting, started]})
    result = CliRunner().invoke(main, ["runs", "status", run_id, "--host", kfp_server.url])
    assert result.exit_code == 0, result.output
    assert "RUNNING (created " in result.output and ", finished -)" in result.output and "1970" not in result.output
    assert [line.split()[0] for line in result.output.splitlines()[1:]] == ["prepare", "rollout-r0"], result.output


def test_cli_submit_and_runs(kfp_server, tmp_path):
    result = CliRunner().invoke(
        main,
        [
            "submit",
            "--preset",
            "smoke",
            "--host",
            kfp_server.url,
            "--store",
            "s3://runs/smoke",
            "--token",
            TOKEN,
            "--pipeline-root",
            "minio://tracefp4/pipeline-root",
        ],
    )
    assert result.exit_code == 0, result.output
    assert f"{kfp_server.url}/#/runs/details/" in result.output and len(kfp_server.runs) == 1
    assert "Experiment details" not in result.output  # kfp.Client's own prints stay out
    assert kfp_server.requests[-1]["headers"]["authorization"] == f"Bearer {TOKEN}"
    (run_id,) = kfp_server.runs
    _finished_run(kfp_server, run_id)

    listed = CliRunner().invoke(main, ["runs", "list", "--host", kfp_server.url])
    assert listed.exit_code == 0, listed.output
    assert run_id in listed.output and "FAILED" in listed.output
    status = CliRunner().invoke(main, ["runs", "status", run_id, "--host", kfp_server.url])
    assert status.exit_code == 0, status.output
    assert "FAILED" in status.output and "CUDA out of memory" in status.output and "kubectl" not in status.output
    logs = CliRunner().invoke(main, ["runs", "logs", run_id, "--host", kfp_server.url, "--namespace", "team-a"])
    assert logs.exit_code == 0, logs.output
    assert "kubectl -n team-a logs smoke-abc-system-container-impl-3 -c main" in logs.output

    refused = CliRunner().invoke(main, ["submit", "--preset", "smoke", "--host", "http://127.0.0.1:9"])
    assert refused.exit_code != 0 and "cannot reach" in refused.output
    missing = CliRunner().invoke(main, ["runs", "status", "nope", "--host", kfp_server.url])
    assert missing.exit_code != 0 and "HTTP 404" in missing.output


def _leave(store, keys: list[str]) -> None:
    for key in keys:
        store.put_bytes(key, b"x" * 10)


def test_runs_clean_deletes_what_a_finished_run_left_once_no_run_still_needs_it(kfp_server, s3_env, tmp_path):
    """A run's KFP artifacts (``{root}/{pipelineInfo.name}/{run id}/{task}/{salt}/{output}``, where KFP's driver
    puts them: its policies and the like, its record too with --all) and its folder in tracefp4's store, on a
    real S3 server: listed without --yes, deleted with it, another run's left; refused while the run runs, and
    while a run that goes on from its policy has not prepared."""
    base = f"clean-{tmp_path.name}"  # the session's bucket holds other tests' objects too
    root, store_uri = s3_env.uri(f"{base}/pipeline-root"), s3_env.uri(f"{base}/runs")
    config = load_config(preset="smoke", overrides={"store.uri": store_uri})
    connection = Connection(kfp_server.url)
    run_id = submit(config, connection, pipeline_root=root)["run_id"]
    other = submit(config, connection, pipeline_root=root)["run_id"]
    bucket = s3_env.store(base)
    ours = [f"pipeline-root/tracefp4-smoke/{run_id}/train/a1/new_policy/{n}" for n in ("model.safetensors", MANIFEST)]
    ours += [f"runs/smoke/{run_id}/trace/guidance/step-000000.bin"]
    record = [f"pipeline-root/tracefp4-smoke/{run_id}/report/c3/page"]  # the run's record: kept without --all
    theirs = [f"pipeline-root/tracefp4-smoke/{other}/train/b2/new_policy/{MANIFEST}", f"runs/smoke/{other}/x"]
    _leave(bucket, ours + record + theirs)

    def clean(*options):
        return CliRunner().invoke(main, ["runs", "clean", run_id, "--host", kfp_server.url, *options])

    result = clean("--yes")
    assert result.exit_code == 1 and f"run {run_id} is PENDING: clean it once it has finished" in result.output
    kfp_server.runs[run_id]["state"] = "SUCCEEDED"
    listed = clean()
    assert listed.exit_code == 0, listed.output
    assert f"KFP artifacts: {root}/tracefp4-smoke/{run_id}/: 2 objects" in listed.output
    assert f"tracefp4 store: {store_uri}/smoke/{run_id}/: 1 objects" in listed.output
    assert "nothing deleted: add --yes" in listed.output and bucket.list() == sorted(ours + record + theirs)

    policy = f"{root}/tracefp4-smoke/{run_id}/train/a1/new_policy"
    follower = submit(config, connection, pipeline_root=root, run_name="goes-on")["run_id"]
    kfp_server.runs[follower]["runtime_config"]["parameters"]["model_checkpoint"] = policy
    refused = clean("--yes")
    assert (
        refused.exit_code == 1
        and f"have not finished their prepare task: goes-on ({follower}, PENDING);" in refused.output
    )
    assert bucket.list() == sorted(ours + record + theirs)
    prepared = {"task_id": "t1", "display_name": "prepare", "state": "SUCCEEDED"}
    kfp_server.runs[follower].update(state="RUNNING", run_details={"task_details": [prepared]})
    store_only = clean("--yes", "--only", "store")
    assert store_only.exit_code == 0 and "KFP artifacts" not in store_only.output, store_only.output
    assert bucket.list() == sorted(ours[:2] + record + theirs)
    deleted = clean("--yes")
    assert deleted.exit_code == 0, deleted.output
    assert f"{store_uri}/smoke/{run_id}/: 0 objects" in deleted.output and deleted.output.count("  deleted") == 1
    assert bucket.list() == sorted(record + theirs)
    everything = clean("--yes", "--all")
    assert everything.exit_code == 0 and f"{root}/tracefp4-smoke/{run_id}/: 1 objects" in everything.output
    assert bucket.list() == sorted(theirs)


def test_runs_clean_chain_deletes_a_chain_back_to_its_first_run(kfp_server, s3_env, tmp_path):
    """--chain: each run found by the policy it started from, a URI under the KFP artifacts of the run
    before it; the first run started from a checkpoint elsewhere. Every run of the chain listed, then deleted;
    another run's objects stay; refused while a run going on from the last has not prepared."""
    base = f"clean-{tmp_path.name}"
    root, store_uri = s3_env.uri(f"{base}/pipeline-root"), s3_env.uri(f"{base}/runs")
    config = load_config(preset="smoke", overrides={"store.uri": store_uri})
    connection = Connection(kfp_server.url)
    prepared = {"run_details": {"task_details": [{"task_id": "t", "display_name": "prepare", "state": "SUCCEEDED"}]}}

    def run(started_from: str) -> str:
        run_id = submit(config, connection, pipeline_root=root)["run_id"]
        kfp_server.runs[run_id]["runtime_config"]["parameters"]["model_checkpoint"] = started_from
        kfp_server.runs[run_id].update(state="SUCCEEDED", **prepared)
        return run_id

    first = run(s3_env.uri(f"{base}/base-checkpoint"))
    second = run(f"{root}/tracefp4-smoke/{first}/train-2/a1/new_policy")
    last = run(f"{root}/tracefp4-smoke/{second}/train-5/b2/new_policy")
    other = run(s3_env.uri(f"{base}/base-checkpoint"))
    bucket = s3_env.store(base)
    chain = [f"pipeline-root/tracefp4-smoke/{r}/train/c/new_policy/{MANIFEST}" for r in (first, second, last)]
    chain += [f"runs/smoke/{r}/trace/guidance/step-000000.bin" for r in (first, second, last)]
    theirs = [f"pipeline-root/tracefp4-smoke/{other}/train/c/new_policy/{MANIFEST}", f"runs/smoke/{other}/x"]
    _leave(bucket, chain + theirs)

    def clean(*options):
        return CliRunner().invoke(main, ["runs", "clean", last, "--chain", "--host", kfp_server.url, *options])

    listed = clean()
    assert listed.exit_code == 0, listed.output
    headers = [line for line in listed.output.splitlines() if line.startswith("run ")]
    assert headers == [f"run {last}:", f"run {second}:", f"run {first}:"]
    assert listed.output.count(": 1 objects") == 6 and bucket.list() == sorted(chain + theirs)

    follower = submit(config, connection, pipeline_root=root, run_name="goes-on")["run_id"]
    kfp_server.runs[follower]["runtime_config"]["parameters"]["model_checkpoint"] = f"{root}/tracefp4-smoke/{last}/x"
    refused = clean("--yes")
    assert refused.exit_code == 1 and f"run {last} and the 2 run(s) before it are kept" in refused.output
    assert f"goes-on ({follower}, PENDING)" in refused.output and bucket.list() == sorted(chain + theirs)
    kfp_server.runs[follower].update(state="RUNNING", **prepared)
    deleted = clean("--yes")
    assert deleted.exit_code == 0 and deleted.output.count("  deleted") == 6, deleted.output
    assert bucket.list() == sorted(theirs)
    del kfp_server.runs[first]  # deleted in KFP
    gone = clean()
    assert gone.exit_code == 1 and f"run {second} went on from run {first}: GET " in gone.output, gone.output


def test_runs_clean_deleted_finds_a_run_kfp_forgot_by_its_config(kfp_server, s3_env, tmp_path):
    """A run deleted in KFP (which keeps its artifacts, kubeflow/pipelines#10816): --deleted finds its folders
    from the config it was submitted with and --pipeline-root (the run's or the comparison's pipeline folder,
    whichever holds its artifacts; its store folder under the run id its policies record, which a ``run_id``
    parameter set), deletes its bulk and store folder, keeps its record and another run's objects; refused
    while KFP still knows the run, and while a run that goes on from it has not prepared."""
    base = f"clean-{tmp_path.name}"
    root, store_uri = s3_env.uri(f"{base}/pipeline-root"), s3_env.uri(f"{base}/runs")
    config = load_config(preset="smoke", overrides={"store.uri": store_uri})
    connection = Connection(kfp_server.url)
    run_id, other, named = (submit(config, connection, pipeline_root=root)["run_id"] for _ in range(3))
    bucket = s3_env.store(base)

    def policy(pipeline: str, run: str, recorded: str) -> str:
        key = f"pipeline-root/{pipeline}/{run}/prepare/a0/policy/{MANIFEST}"
        bucket.put_bytes(key, json.dumps({"files": {}, "provenance": {"run_id": recorded}}).encode())
        return key

    ours = [policy("tracefp4-smoke", run_id, run_id), f"runs/smoke/{run_id}/x"]
    ours += [f"pipeline-root/tracefp4-smoke/{run_id}/train/a1/new_policy/model.safetensors"]
    record = [f"pipeline-root/tracefp4-smoke/{run_id}/report/c3/page"]
    theirs = [f"pipeline-root/tracefp4-smoke/{other}/train/b2/new_policy/model.safetensors", f"runs/smoke/{other}/x"]
    _leave(bucket, [key for key in ours + record + theirs if not key.endswith(MANIFEST)])

    def clean(run, *options):
        given = ["--deleted", "--preset", "smoke", "--set", f"store.uri={store_uri}", "--pipeline-root", root]
        return CliRunner().invoke(main, ["runs", "clean", run, "--host", kfp_server.url, *given, *options])

    known = clean(run_id, "--yes")
    assert known.exit_code == 1 and f"run {run_id} is in KFP (PENDING): clean it without --deleted" in known.output
    del kfp_server.runs[run_id]
    follower = submit(config, connection, pipeline_root=root, run_name="goes-on")["run_id"]
    kfp_server.runs[follower]["runtime_config"]["parameters"]["model_checkpoint"] = f"{root}/tracefp4-smoke/{run_id}/t"
    refused = clean(run_id, "--yes")
    assert refused.exit_code == 1 and f"goes-on ({follower}, PENDING)" in refused.output
    del kfp_server.runs[follower]
    deleted = clean(run_id, "--yes")
    assert deleted.exit_code == 0, deleted.output
    assert f"KFP artifacts: {root}/tracefp4-smoke/{run_id}/: 2 objects" in deleted.output
    assert "compare" not in deleted.output  # not a comparison: its pipeline's folder holds nothing of the run
    assert f"tracefp4 store: {store_uri}/smoke/{run_id}/: 1 objects" in deleted.output
    assert bucket.list() == sorted(record + theirs)

    # a comparison given run_id "my-run": its store folder is under that id, which its prepared policy records
    mine = [policy("tracefp4-smoke-compare", named, "my-run"), "runs/smoke/my-run/trace/x"]
    _leave(bucket, mine[1:])
    del kfp_server.runs[named]
    found = clean(named)
    assert found.exit_code == 0, found.output
    assert f"KFP artifacts: {root}/tracefp4-smoke-compare/{named}/: 1 objects" in found.output
    assert f"tracefp4 store: {store_uri}/smoke/my-run/: 1 objects" in found.output
    bucket.put_bytes(mine[0], b"{not json")
    unreadable = clean(named)
    assert unreadable.exit_code == 1 and f"{mine[0].partition('/')[2]}: not a checksum manifest" in unreadable.output

    usage = CliRunner().invoke(main, ["runs", "clean", run_id, "--host", kfp_server.url, "--deleted"])
    assert usage.exit_code == 2 and "give its config (--preset or --config" in usage.output
    misplaced = CliRunner().invoke(main, ["runs", "clean", other, "--host", kfp_server.url, "--preset", "smoke"])
    assert misplaced.exit_code == 2 and "only with --deleted" in misplaced.output


def test_runs_clean_needs_the_pipeline_root_of_a_run_that_records_none(kfp_server, s3_env, tmp_path):
    """A run submitted without a pipeline root kept its artifacts in the cluster's default, which the API does
    not tell; one that records its root refuses another."""
    base = f"clean-{tmp_path.name}"
    config = load_config(preset="smoke", overrides={"store.uri": s3_env.uri(f"{base}/runs")})
    run_id = submit(config, Connection(kfp_server.url))["run_id"]
    kfp_server.runs[run_id]["state"] = "FAILED"
    result = CliRunner().invoke(main, ["runs", "clean", run_id, "--host", kfp_server.url])
    assert result.exit_code == 1 and "submitted without a pipeline root" in result.output
    root = s3_env.uri(f"{base}/kfp-default")
    given = CliRunner().invoke(main, ["runs", "clean", run_id, "--host", kfp_server.url, "--pipeline-root", root])
    assert given.exit_code == 0, given.output
    assert f"KFP artifacts: {root}/tracefp4-smoke/{run_id}/: 0 objects" in given.output
    kfp_server.runs[run_id]["runtime_config"]["pipeline_root"] = recorded = s3_env.uri(f"{base}/pipeline-root")
    other = CliRunner().invoke(main, ["runs", "clean", run_id, "--host", kfp_server.url, "--pipeline-root", root])
    assert other.exit_code == 1 and f"kept its artifacts in {recorded}, not {root}" in other.output


def test_a_ctrl_c_while_a_command_waits_on_the_server_ends_it_with_status_130(kfp_server):
    """click ended it with "Aborted!" and exit status 1, a failed command's, where a Ctrl-C while the command
    loads, and one during `tracefp4 run`, end it with 130 (128 + SIGINT)."""
    kfp_server.delay_s = 30  # the answer never comes before the Ctrl-C
    command = [sys.executable, "-m", "tracefp4.pipelines", "runs", "list", "--host", kfp_server.url]
    # SIGINT as a terminal's: a shell without job control starts background commands (a CI's, say) ignoring it,
    # and a child inherits that
    default_sigint = lambda: signal.signal(signal.SIGINT, signal.SIG_DFL)  # noqa: E731
    child = subprocess.Popen(
        command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, preexec_fn=default_sigint
    )
    try:
        deadline = time.monotonic() + 60
        while not kfp_server.requests and time.monotonic() < deadline:
            time.sleep(0.05)
        assert kfp_server.requests, "the command made no request"
        child.send_signal(signal.SIGINT)
        out, err = child.communicate(timeout=30)
    finally:
        child.kill()
    assert child.returncode == 130 and err == "\ntracefp4: interrupted\n" and out == "", (child.returncode, err)


def test_compile_and_submit_take_the_store_and_pushgateway_as_run_does(kfp_server, tmp_path):
    """compile had neither --store nor --pushgateway and submit no --pushgateway, while both warned of a run
    without them: the same config by the same options compiles to the version submit uploads."""
    options = ["--preset", "smoke", "--store", "s3://runs/smoke", "--pushgateway", "http://pushgateway:9091"]
    compiled = CliRunner().invoke(main, ["compile", *options, "--output", str(tmp_path / "p.yaml")])
    assert compiled.exit_code == 0, compiled.output
    assert "local to each pod" not in compiled.output and "no metrics.pushgateway_url" not in compiled.output
    version = compiled.output.split(", version ")[1].split(" ")[0]
    submitted = CliRunner().invoke(main, ["submit", *options, "--host", kfp_server.url])
    assert submitted.exit_code == 0, submitted.output
    assert "no metrics.pushgateway_url" not in submitted.output
    (upload,) = [r for r in kfp_server.requests if r["path"] == f"{API}/pipelines/upload"]
    assert upload["query"]["name"] == "tracefp4-smoke"
    (pipeline_id,) = kfp_server.pipelines
    uploaded = [v["display_name"] for v in kfp_server.versions[pipeline_id]]
    assert uploaded == ["tracefp4-smoke", version]  # the API server's first version, then submit's
    assert '"pushgateway_url":"http://pushgateway:9091"' in (tmp_path / "p.yaml").read_text()


def test_runs_logs_names_the_namespace_the_run_ran_in(kfp_server, config):
    """Without --namespace the kubectl commands named kubeflow, where a multi-user Kubeflow ran the run's pods
    in its experiment's profile namespace; standalone KFP's experiments have none: kubeflow."""
    profile = submit(config, Connection(kfp_server.url, namespace="team-a"))["run_id"]
    standalone = submit(config, Connection(kfp_server.url), experiment="other")["run_id"]
    for run_id, namespace in ((profile, "team-a"), (standalone, "kubeflow")):
        _finished_run(kfp_server, run_id)
        logs = CliRunner().invoke(main, ["runs", "logs", run_id, "--host", kfp_server.url])
        assert logs.exit_code == 0, logs.output
        assert f"kubectl -n {namespace} logs smoke-abc-system-container-impl-3 -c main" in logs.output
