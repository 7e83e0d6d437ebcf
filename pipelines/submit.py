"""Submit a run to a Kubeflow Pipelines server over its v2beta1 REST API.

    compile -> find or upload the pipeline -> find or upload the version
            -> find or create the experiment -> create the run

Plain HTTP (urllib), no ``kfp.Client``: every call is explicit, so a test
server can record it. Field names follow KFP's v2beta1 API (the generated
``kfp_server_api`` models: V2beta1Pipeline, V2beta1PipelineVersion,
V2beta1Experiment, V2beta1Run, V2beta1Filter) and the upload endpoints of the
API server (multipart field ``uploadfile``; ``name``, ``display_name``,
``description``, ``namespace``, ``pipelineid`` in the query string).

An optional bearer token (argument, else ``KF_PIPELINES_TOKEN``) goes in the
``Authorization`` header and nowhere else; errors never repeat it.
"""

import json
import hashlib
import os
import socket
import tempfile
import time
import urllib.error
import urllib.parse
import urllib.request
import uuid
from pathlib import Path

from tracefp4.pipelines.pipeline import compile_pipeline, pipeline_name, pipeline_version
from tracefp4.schemas import RunConfig

API = "/apis/v2beta1"
TOKEN_ENV = "KF_PIPELINES_TOKEN"
_EQUALS = 1  # V2beta1PredicateOperation EQUALS, as kfp.Client sends it


class SubmitError(RuntimeError):
    """A failed call to the Kubeflow Pipelines server (HTTP error, no connection, bad answer)."""


def _name_filter(display_name: str) -> str:
    """KFP's filter: a JSON-encoded V2beta1Filter (urlencode encodes it once more for the query string)."""
    predicate = {"operation": _EQUALS, "key": "display_name", "stringValue": display_name}
    return json.dumps({"predicates": [predicate]}, separators=(",", ":"))


class _Api:
    def __init__(self, host: str, token: str | None, timeout_s: float):
        if not host.startswith(("http://", "https://")):
            raise SubmitError(f"host must be an http:// or https:// URL, got {host!r}")
        self.host = host.rstrip("/")
        self.token = token
        self.timeout_s = timeout_s

    def _scrub(self, text: str) -> str:
        return text.replace(self.token, "***") if self.token else text

    def call(self, method: str, path: str, query: dict | None = None, body: dict | None = None, files=None) -> dict:
        """One request; the parsed JSON answer ({} when empty). ``files``: (field, filename, bytes) as multipart."""
        url = self.host + path + ("?" + urllib.parse.urlencode(query) if query else "")
        headers = {"Accept": "application/json"}
        data = None
        if files is not None:
            field, filename, content = files
            boundary = uuid.uuid4().hex
            data = (f'--{boundary}\r\nContent-Disposition: form-data; name="{field}"; filename="{filename}"\r\n'
                    f"Content-Type: application/x-yaml\r\n\r\n").encode() + content + f"\r\n--{boundary}--\r\n".encode()  # fmt: skip
            headers["Content-Type"] = f"multipart/form-data; boundary={boundary}"
        elif body is not None:
            data = json.dumps(body).encode()
            headers["Content-Type"] = "application/json"
        if self.token:
            headers["Authorization"] = f"Bearer {self.token}"
        request = urllib.request.Request(url, data=data, headers=headers, method=method)
        where = f"{method} {path}"
        try:
            with urllib.request.urlopen(request, timeout=self.timeout_s) as response:
                raw = response.read()
        except urllib.error.HTTPError as e:
            raw = e.read() if e.fp is not None else b""
            raise SubmitError(self._scrub(f"{where} -> HTTP {e.code} {e.reason}: {_message(raw)}")) from None
        except urllib.error.URLError as e:
            raise SubmitError(self._scrub(f"{where}: cannot reach {self.host}: {e.reason}")) from None
        except (TimeoutError, socket.timeout):
            raise SubmitError(self._scrub(f"{where}: no answer from {self.host} within {self.timeout_s:g} s")) from None
        except OSError as e:
            raise SubmitError(self._scrub(f"{where}: connection to {self.host} failed: {e}")) from None
        if not raw.strip():
            return {}
        try:
            answer = json.loads(raw)
        except ValueError:
            hint = " (a login page? pass a token)" if raw.lstrip()[:1] == b"<" else ""
            raise SubmitError(self._scrub(f"{where}: the answer is not JSON{hint}: {raw[:200]!r}")) from None
        if not isinstance(answer, dict):
            raise SubmitError(self._scrub(f"{where}: expected a JSON object, got {type(answer).__name__}"))
        return answer

    def field(self, answer: dict, key: str, what: str) -> str:
        value = answer.get(key)
        if not value:
            raise SubmitError(f"the server's answer for {what} has no {key}: {self._scrub(json.dumps(answer)[:300])}")
        return value


def _message(raw: bytes) -> str:
    """The server's message: grpc-gateway's {"message"}, the upload server's {"error_message"}, or the text."""
    text = raw.decode("utf-8", "replace").strip()
    try:
        answer = json.loads(text)
    except ValueError:
        answer = None
    if isinstance(answer, dict):
        for key in ("message", "error_message", "error"):
            if answer.get(key):
                return str(answer[key])[:500]
    return text[:500] or "(empty answer)"


def _first(api: _Api, path: str, key: str, display_name: str, namespace: str | None) -> dict | None:
    query = {"filter": _name_filter(display_name), "page_size": 1}
    if namespace:
        query["namespace"] = namespace
    found = api.call("GET", path, query).get(key) or []
    return found[0] if found else None


def submit(
    config: RunConfig,
    host: str,
    experiment: str = "tracefp4",
    *,
    token: str | None = None,
    timeout_s: float = 30,
    namespace: str | None = None,
    service_account: str | None = None,
) -> dict:
    """Upload ``config``'s pipeline (or a new version of it) to the KFP server at ``host`` and start a run.

    The pipeline is ``tracefp4-<config.name>``; the version is
    ``pipeline_version()`` plus a hash of the compiled YAML (reused when one of
    that name exists); the run gets
    ``config_json`` = the config's JSON. ``namespace``: the user namespace of a
    multi-user deployment (pipeline, experiment); ``service_account``: the
    Kubernetes service account the run's pods use. Returns pipeline_id,
    pipeline_version_id, experiment_id, run_id and run_url. Raises SubmitError."""
    api = _Api(host, token if token is not None else os.environ.get(TOKEN_ENV) or None, timeout_s)
    name = pipeline_name(config)
    with tempfile.TemporaryDirectory(prefix="tracefp4-submit-") as tmp:
        package = Path(compile_pipeline(config, Path(tmp) / f"{name}.yaml")).read_bytes()
    # the compiled DAG depends on the config too (rounds, image, resources): a
    # version name reused for another DAG would run the old one
    version = f"{pipeline_version()}-{hashlib.sha256(package).hexdigest()[:8]}"
    upload = ("uploadfile", f"{name}.yaml", package)

    pipeline = _first(api, f"{API}/pipelines", "pipelines", name, namespace)
    if pipeline is None:
        query = {"name": name, "display_name": name,
                 "description": f"TRACE FP4 RL ({config.method}, {config.rollout.config})"}  # fmt: skip
        if namespace:
            query["namespace"] = namespace
        pipeline = api.call("POST", f"{API}/pipelines/upload", query, files=upload)
    pipeline_id = api.field(pipeline, "pipeline_id", "the pipeline")

    # the upload creates a first version named after the pipeline; runs use one named after the package
    versions = f"{API}/pipelines/{urllib.parse.quote(pipeline_id, safe='')}/versions"
    found = _first(api, versions, "pipeline_versions", version, None)
    if found is None:
        query = {"name": version, "display_name": version, "pipelineid": pipeline_id,
                 "description": f"tracefp4 {version}"}  # fmt: skip
        found = api.call("POST", f"{API}/pipelines/upload_version", query, files=upload)
    version_id = api.field(found, "pipeline_version_id", "the pipeline version")

    exp = _first(api, f"{API}/experiments", "experiments", experiment, namespace)
    if exp is None:
        body = {"display_name": experiment, "description": "tracefp4 runs"}
        if namespace:
            body["namespace"] = namespace
        exp = api.call("POST", f"{API}/experiments", body=body)
    experiment_id = api.field(exp, "experiment_id", "the experiment")

    body = {
        "display_name": f"{config.name}-{time.strftime('%Y%m%d-%H%M%S', time.gmtime())}",
        "experiment_id": experiment_id,
        "pipeline_version_reference": {"pipeline_id": pipeline_id, "pipeline_version_id": version_id},
        "runtime_config": {"parameters": {"config_json": config.model_dump_json()}},
    }
    if service_account:
        body["service_account"] = service_account
    run = api.call("POST", f"{API}/runs", body=body)
    run_id = api.field(run, "run_id", "the run")
    return {
        "pipeline_id": pipeline_id,
        "pipeline_version_id": version_id,
        "experiment_id": experiment_id,
        "run_id": run_id,
        "run_url": f"{api.host}/#/runs/details/{run_id}",
    }
