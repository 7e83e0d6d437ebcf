"""`submit` against a fake Kubeflow Pipelines server on 127.0.0.1 that speaks
the v2beta1 endpoints it uses and records every request."""

import email
import json
import socket
import threading
import time
import urllib.parse
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
import yaml

from tracefp4.pipelines.pipeline import pipeline_version
from tracefp4.pipelines.submit import SubmitError, submit
from tracefp4.schemas import get_preset, load_config

API = "/apis/v2beta1"
TOKEN = "s3cr3t-t0ken-value"


class FakeKfp(ThreadingHTTPServer):
    """Pipelines, versions and experiments in dicts; ``fail[(method, path)] = (status, body)`` answers an error;
    ``delay_s`` holds every answer back."""

    daemon_threads = True

    def __init__(self):
        super().__init__(("127.0.0.1", 0), Handler)
        self.requests, self.pipelines, self.versions, self.experiments, self.runs = [], {}, {}, {}, {}
        self.fail, self.delay_s, self.counter = {}, 0.0, 0

    @property
    def url(self):
        return f"http://127.0.0.1:{self.server_address[1]}"

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
        s.requests.append({"method": method, "path": url.path, "query": query, "headers": dict(self.headers), "body": body})
        if s.delay_s:
            time.sleep(s.delay_s)
        if (method, url.path) in s.fail:
            status, answer = s.fail[(method, url.path)]
            if callable(answer):
                answer = answer(self)
            return self._answer(status, answer)
        wanted = None
        if "filter" in query:
            (pred,) = json.loads(query["filter"])["predicates"]
            assert pred["key"] == "display_name" and pred["operation"] == 1
            wanted = pred["stringValue"]

        def listing(items):
            return [i for i in items if wanted is None or i["display_name"] == wanted]

        parts = url.path.removeprefix(API).strip("/").split("/")
        if method == "GET" and parts == ["pipelines"]:
            return self._answer(200, {"pipelines": listing(s.pipelines.values())} if listing(s.pipelines.values()) else {})
        if method == "POST" and parts == ["pipelines", "upload"]:
            p = {"pipeline_id": s.new_id("pipeline"), "name": query["name"], "display_name": query.get("display_name", query["name"])}
            s.pipelines[p["pipeline_id"]] = p
            s.versions[p["pipeline_id"]] = [{"pipeline_id": p["pipeline_id"], "pipeline_version_id": s.new_id("version"),
                                             "display_name": p["display_name"]}]  # fmt: skip
            return self._answer(200, p)
        if method == "GET" and len(parts) == 3 and parts[0] == "pipelines" and parts[2] == "versions":
            if parts[1] not in s.pipelines:
                return self._answer(404, {"code": 5, "message": f"pipeline {parts[1]} not found"})
            found = listing(s.versions[parts[1]])
            return self._answer(200, {"pipeline_versions": found, "total_size": len(found)} if found else {})
        if method == "POST" and parts == ["pipelines", "upload_version"]:
            v = {"pipeline_id": query["pipelineid"], "pipeline_version_id": s.new_id("version"),
                 "display_name": query.get("display_name", query["name"])}  # fmt: skip
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
            r = dict(json.loads(body), run_id=s.new_id("run"), state="PENDING")
            s.runs[r["run_id"]] = r
            return self._answer(200, r)
        return self._answer(404, {"code": 5, "message": f"no route {method} {url.path}"})

    def do_GET(self):
        self._handle("GET")

    def do_POST(self):
        self._handle("POST")


@pytest.fixture
def kfp(monkeypatch):
    for var in ("http_proxy", "https_proxy", "HTTP_PROXY", "HTTPS_PROXY", "all_proxy", "ALL_PROXY", "KF_PIPELINES_TOKEN"):
        monkeypatch.delenv(var, raising=False)
    server = FakeKfp()
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
    thread.start()
    yield server
    server.shutdown()
    server.server_close()


@pytest.fixture(scope="module")
def config():
    return get_preset("smoke")


def uploaded_yaml(request) -> dict:
    content_type = request["headers"]["Content-Type"]
    assert content_type.startswith("multipart/form-data; boundary=")
    message = email.message_from_bytes(f"Content-Type: {content_type}\r\n\r\n".encode() + request["body"])
    (part,) = message.get_payload()
    assert part.get_param("name", header="content-disposition") == "uploadfile"
    assert part.get_filename() == "tracefp4-smoke.yaml"
    return next(yaml.safe_load_all(part.get_payload(decode=True)))


def test_first_submission_uploads_the_pipeline_and_creates_experiment_and_run(kfp, config):
    result = submit(config, kfp.url, experiment="fp4-study")
    assert kfp.calls() == [
        ("GET", f"{API}/pipelines"),
        ("POST", f"{API}/pipelines/upload"),
        ("GET", f"{API}/pipelines/pipeline-1/versions"),
        ("POST", f"{API}/pipelines/upload_version"),
        ("GET", f"{API}/experiments"),
        ("POST", f"{API}/experiments"),
        ("POST", f"{API}/runs"),
    ]
    lookup, upload, _, version_upload, _, new_experiment, run = kfp.requests
    assert json.loads(lookup["query"]["filter"]) == {"predicates": [{"operation": 1, "key": "display_name", "stringValue": "tracefp4-smoke"}]}
    assert upload["query"]["name"] == upload["query"]["display_name"] == "tracefp4-smoke"
    spec = uploaded_yaml(upload)
    assert spec["pipelineInfo"]["name"] == "tracefp4-smoke"
    assert json.loads(spec["root"]["inputDefinitions"]["parameters"]["config_json"]["defaultValue"]) == json.loads(config.model_dump_json())
    version = version_upload["query"]["name"]  # package version, schema hash, then a hash of this DAG
    assert version.startswith(pipeline_version() + "-") and len(version) == len(pipeline_version()) + 9
    assert version_upload["query"] == {"name": version, "display_name": version, "pipelineid": "pipeline-1",
                                       "description": f"tracefp4 {version}"}  # fmt: skip
    assert uploaded_yaml(version_upload) == spec
    assert json.loads(new_experiment["body"])["display_name"] == "fp4-study"
    assert new_experiment["headers"]["Content-Type"] == "application/json"
    body = json.loads(run["body"])
    assert body["display_name"].startswith("smoke-")
    assert body["experiment_id"] == "experiment-4"
    assert body["pipeline_version_reference"] == {"pipeline_id": "pipeline-1", "pipeline_version_id": "version-3"}
    assert set(body["runtime_config"]) == {"parameters"} and set(body["runtime_config"]["parameters"]) == {"config_json"}
    assert body["runtime_config"]["parameters"]["config_json"] == config.model_dump_json()
    assert result == {"pipeline_id": "pipeline-1", "pipeline_version_id": "version-3", "experiment_id": "experiment-4",
                      "run_id": "run-5", "run_url": f"{kfp.url}/#/runs/details/run-5"}  # fmt: skip
    assert all("Authorization" not in r["headers"] for r in kfp.requests)
    assert "service_account" not in body  # KFP's default unless asked


def test_a_run_can_name_its_service_account(kfp, config):
    submit(config, kfp.url, service_account="tracefp4-pipeline-runner")
    assert json.loads(kfp.requests[-1]["body"])["service_account"] == "tracefp4-pipeline-runner"


def test_second_submission_uploads_a_version_and_a_third_reuses_it(kfp, config):
    kfp.pipelines["p-old"] = {"pipeline_id": "p-old", "display_name": "tracefp4-smoke"}
    kfp.versions["p-old"] = [{"pipeline_id": "p-old", "pipeline_version_id": "v-old", "display_name": "0.0.9-oldhash"}]
    kfp.experiments["e-old"] = {"experiment_id": "e-old", "display_name": "tracefp4"}
    first = submit(config, kfp.url)
    assert kfp.calls() == [
        ("GET", f"{API}/pipelines"),
        ("GET", f"{API}/pipelines/p-old/versions"),
        ("POST", f"{API}/pipelines/upload_version"),
        ("GET", f"{API}/experiments"),
        ("POST", f"{API}/runs"),
    ]
    assert kfp.requests[2]["query"]["pipelineid"] == "p-old" and kfp.requests[2]["query"]["name"].startswith(pipeline_version() + "-")
    assert uploaded_yaml(kfp.requests[2])["pipelineInfo"]["name"] == "tracefp4-smoke"
    assert first["pipeline_id"] == "p-old" and first["experiment_id"] == "e-old" and first["pipeline_version_id"] != "v-old"

    kfp.requests.clear()
    second = submit(config, kfp.url)
    assert kfp.calls() == [
        ("GET", f"{API}/pipelines"),
        ("GET", f"{API}/pipelines/p-old/versions"),
        ("GET", f"{API}/experiments"),
        ("POST", f"{API}/runs"),
    ]
    assert json.loads(kfp.requests[1]["query"]["filter"])["predicates"][0]["stringValue"].startswith(pipeline_version() + "-")
    assert second["pipeline_version_id"] == first["pipeline_version_id"] and second["run_id"] != first["run_id"]
    assert len(kfp.runs) == 2 and len(kfp.pipelines) == 1
    kfp.requests.clear()
    submit(config.model_copy(update={"image": "registry.example/tracefp4:other"}), kfp.url)  # another DAG: a new version
    assert ("POST", f"{API}/pipelines/upload_version") in kfp.calls()


@pytest.mark.parametrize(
    "status, route, answer, message",
    [
        (500, ("POST", f"{API}/runs"), {"error": "internal", "code": 13, "message": "database is down"}, "database is down"),
        (403, ("GET", f"{API}/pipelines"), b"RBAC: access denied", "RBAC: access denied"),
        (400, ("POST", f"{API}/pipelines/upload"), {"error_message": "Failed to read pipeline from file"}, "Failed to read pipeline"),
    ],
)
def test_http_errors_name_method_path_status_and_message(kfp, config, status, route, answer, message):
    kfp.fail[route] = (status, answer)
    with pytest.raises(SubmitError) as e:
        submit(config, kfp.url)
    text = str(e.value)
    assert f"{route[0]} {route[1]}" in text and f"HTTP {status}" in text and message in text
    assert e.value.__cause__ is None and e.value.__suppress_context__  # no chained urllib traceback
    assert kfp.calls()[-1] == route  # stops at the failing call


def test_refused_connection_fails_quickly(config):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # closed again: nothing listens there
    start = time.monotonic()
    with pytest.raises(SubmitError, match=rf"GET /apis/v2beta1/pipelines: cannot reach http://127.0.0.1:{port}"):
        submit(config, f"http://127.0.0.1:{port}/", timeout_s=2)
    assert time.monotonic() - start < 3


def test_a_silent_server_times_out(kfp, config):
    kfp.delay_s = 1.0
    start = time.monotonic()
    with pytest.raises(SubmitError, match="no answer .* within 0.2 s|timed out"):
        submit(config, kfp.url, timeout_s=0.2)
    assert time.monotonic() - start < 1.5


def test_token_is_sent_and_never_shown(kfp, config, monkeypatch):
    submit(config, kfp.url, token=TOKEN)
    assert kfp.requests and all(r["headers"]["Authorization"] == f"Bearer {TOKEN}" for r in kfp.requests)

    kfp.requests.clear()
    monkeypatch.setenv("KF_PIPELINES_TOKEN", TOKEN)  # from the environment too; a server that echoes it back
    kfp.fail[("POST", f"{API}/runs")] = (403, lambda h: {"message": f"token {h.headers['Authorization']} lacks access"})
    with pytest.raises(SubmitError) as e:
        submit(config, kfp.url)
    assert kfp.requests[-1]["headers"]["Authorization"] == f"Bearer {TOKEN}"
    assert "HTTP 403" in str(e.value) and "lacks access" in str(e.value) and TOKEN not in str(e.value)
    assert TOKEN not in repr(e.value)


def test_a_login_page_is_an_error_and_no_secret_leaves(kfp, monkeypatch):
    monkeypatch.setenv("TRACEFP4_S3_ACCESS_KEY", "AKIA-never-sent")
    monkeypatch.setenv("TRACEFP4_S3_SECRET_KEY", "never-sent-either")
    config = load_config(None, preset="smoke", overrides={"store.uri": "s3://runs/smoke"})
    submit(config, kfp.url)
    assert not any(b"never-sent" in r["body"] or "never-sent" in json.dumps(r["query"]) for r in kfp.requests)

    kfp.fail[("GET", f"{API}/experiments")] = (200, b"<html><body>Log in</body></html>")
    with pytest.raises(SubmitError, match="not JSON .a login page"):
        submit(config, kfp.url)


def test_host_must_be_a_url(config):
    with pytest.raises(SubmitError, match="http:// or https://"):
        submit(config, "kfp.example.com")


def test_cli_submit(kfp):
    from click.testing import CliRunner

    from tracefp4.pipelines.cli import main

    result = CliRunner().invoke(main, ["submit", "--preset", "smoke", "--host", kfp.url, "--store", "s3://runs/smoke"])
    assert result.exit_code == 0, result.output
    assert f"{kfp.url}/#/runs/details/" in result.output and len(kfp.runs) == 1
    refused = CliRunner().invoke(main, ["submit", "--preset", "smoke", "--host", "http://127.0.0.1:9"])
    assert refused.exit_code != 0 and "cannot reach" in refused.output
