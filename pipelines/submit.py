"""Kubeflow Pipelines from the command line, through ``kfp.Client``: start a
run of the pipeline, and look at runs; and, from a run's last task, start the
run that continues it (:func:`submit_next`: a chain of runs).

    compile -> pipeline by name (uploaded if new) -> version by name (uploaded if new)
            -> experiment by name (created if new) -> run

The version's name is the package version, the config schema's hash and a
hash of the compiled YAML's documents: submitting the same config twice reuses it,
another DAG gets a new one. Runs: list, status (the run's and its tasks'
states and errors from the run details) and the ``kubectl logs`` commands
for the tasks' pods (the KFP API gives states, not logs).

Connection (:class:`Connection`): the host, a namespace (multi-user
Kubeflow), a bearer token (argument, else ``KF_PIPELINES_TOKEN``, else in a
pod KFP's projected token or the service account's token), a cookie header
(``KF_PIPELINES_COOKIES``: a gateway's session cookie), a CA bundle or no
verification (gateways often use self-signed certificates), and a timeout.
Every call through ``kfp.Client`` gets the timeout, and a failure is a
:class:`SubmitError` naming the call (method and path) and the server's
message; the token and cookies are never part of one.
"""

import contextlib
import io
import json
import os
import tempfile
import time
import urllib.parse
import warnings
from dataclasses import dataclass, replace
from pathlib import Path

import kfp
import urllib3
from kfp_server_api.exceptions import ApiException

from tracefp4.components.store import hide_secrets
from tracefp4.pipelines.pipeline import (
    compile_pipeline,
    compiled_documents,
    pipeline_name,
    run_size_problem,
    run_tasks,
    version_name,
)
from tracefp4.schemas import RunConfig, next_in_chain

TOKEN_ENV = "KF_PIPELINES_TOKEN"
COOKIES_ENV = "KF_PIPELINES_COOKIES"
# in a pod: KFP's projected token (audience pipelines.kubeflow.org) when mounted, else the service account's
KFP_TOKEN_FILE = Path("/var/run/secrets/kubeflow/pipelines/token")
SERVICE_ACCOUNT_TOKEN_FILE = Path("/var/run/secrets/kubernetes.io/serviceaccount/token")
_EQUALS = 1  # V2beta1PredicateOperation EQUALS


class SubmitError(RuntimeError):
    """A failed call to the Kubeflow Pipelines server (HTTP error, no connection, bad answer); ``status``, the
    HTTP status where the server answered with one."""

    def __init__(self, message: str, status: int | None = None):
        super().__init__(message)
        self.status = status


@dataclass
class Connection:
    """How to reach the KFP API."""

    host: str  # http(s)://host[:port][/path], e.g. the UI's port-forward or the Kubeflow gateway's /pipeline
    namespace: str | None = None  # a multi-user Kubeflow's profile namespace
    token: str | None = None  # None: KF_PIPELINES_TOKEN, else a token file mounted in this pod
    cookies: str | None = None  # a Cookie header ("oauth2_proxy_kubeflow=..."); None: KF_PIPELINES_COOKIES
    ca_bundle: str | None = None  # PEM file of the CA that signed the server's certificate
    verify_ssl: bool = True  # False: accept any certificate (self-signed gateways; not for production)
    timeout_s: float = 30  # per request

    def resolved_token(self) -> str | None:
        if self.token is not None:
            return self.token or None
        if os.environ.get(TOKEN_ENV):
            return os.environ[TOKEN_ENV]
        for path in (Path(os.environ.get("KF_PIPELINES_SA_TOKEN_PATH", KFP_TOKEN_FILE)), SERVICE_ACCOUNT_TOKEN_FILE):
            if path.is_file():
                return path.read_text().strip() or None
        return None


def _message(raw) -> str:
    """The server's message: grpc-gateway's {"message"}, the upload server's {"error_message"}, or the text."""
    text = (raw.decode("utf-8", "replace") if isinstance(raw, bytes) else str(raw or "")).strip()
    try:
        answer = json.loads(text)
    except ValueError:
        answer = None
    if isinstance(answer, dict):
        for key in ("message", "error_message", "error"):
            if answer.get(key):
                return str(answer[key])[:500]
    return text[:500] or "(empty answer)"


class _Client(kfp.Client):
    """kfp.Client whose every request has a timeout and fails as a SubmitError.

    kfp.Client sends requests without a timeout and, while constructed, probes
    the server's healthz up to 5 times 5 s apart; here each request is
    checked by :meth:`_checked`, installed on the one REST client all of
    kfp.Client's APIs share (before that probe, which is tried once)."""

    def __init__(self, timeout_s: float, secrets: list[str], host: str, **kwargs):
        self._timeout_s, self._secrets, self._host = timeout_s, secrets, host
        super().__init__(host=host, **kwargs)
        self._install(self._run_api.api_client.rest_client)

    def get_kfp_healthz(self, sleep_duration: int = 5):
        self._install(self._healthz_api.api_client.rest_client)
        return self._healthz_api.healthz_service_get_healthz()

    def _install(self, rest) -> None:
        if getattr(rest, "_tracefp4_checked", False):
            return
        request = rest.request

        def checked(method, url, *args, _request_timeout=None, **kwargs):
            # a (connect, read) pair: the REST client ignores a float
            timeout = _request_timeout or (self._timeout_s, self._timeout_s)
            return self._checked(request, method, url, *args, _request_timeout=timeout, **kwargs)

        rest.request, rest._tracefp4_checked = checked, True

    def scrub(self, text: str) -> str:
        return hide_secrets(text, self._secrets)

    def _checked(self, request, method, url, *args, **kwargs):
        where = f"{method} {urllib.parse.urlsplit(url).path}"
        try:
            response = request(method, url, *args, **kwargs)
        except ApiException as e:
            if not e.status:  # the REST client's wrapping of a TLS failure
                untrusted = "CERTIFICATE" in str(e.reason).upper()
                hint = " (a self-signed certificate? pass its CA bundle, or skip verification)" if untrusted else ""
                raise SubmitError(self.scrub(f"{where}: {self._host}: {e.reason}{hint}")) from None
            message = self.scrub(f"{where} -> HTTP {e.status} {e.reason}: {_message(e.body)}")
            raise SubmitError(message, e.status) from None
        except urllib3.exceptions.HTTPError as e:
            reason = e.reason if isinstance(e, urllib3.exceptions.MaxRetryError) else e
            if isinstance(reason, urllib3.exceptions.NewConnectionError):  # a ConnectTimeoutError too, in urllib3 2
                text = f"{where}: cannot reach {self._host}: {reason}"
            elif isinstance(reason, urllib3.exceptions.TimeoutError):
                text = f"{where}: no answer from {self._host} within {self._timeout_s:g} s"
            elif isinstance(reason, urllib3.exceptions.SSLError):
                text = f"{where}: {self._host}: TLS failed: {reason} (a self-signed certificate? pass its CA bundle)"
            else:
                text = f"{where}: cannot reach {self._host}: {reason}"
            raise SubmitError(self.scrub(text)) from None
        data = getattr(response, "data", b"") or b""
        if data.strip():
            try:
                json.loads(data)
            except ValueError:
                hint = " (a login page? pass a token or the session cookie)" if data.lstrip()[:1] == b"<" else ""
                raise SubmitError(self.scrub(f"{where}: the answer is not JSON{hint}: {data[:200]!r}")) from None
        return response


def connect(connection: Connection) -> _Client:
    """A ``kfp.Client`` for ``connection`` (no request is made unless the
    namespace is unset: then kfp.Client asks the server whether it is multi-user)."""
    host = connection.host
    if not host.startswith(("http://", "https://")):
        raise SubmitError(f"host must be an http:// or https:// URL, got {host!r}")
    token = connection.resolved_token()
    cookies = connection.cookies if connection.cookies is not None else os.environ.get(COOKIES_ENV) or None
    secrets = [s for s in (token, cookies) if s]
    with quiet():
        return _Client(
            connection.timeout_s,
            secrets,
            host.rstrip("/"),
            namespace=connection.namespace or "kubeflow",  # kfp.Client's "not set"
            existing_token=token,
            cookies=cookies,
            ssl_ca_cert=connection.ca_bundle,
            verify_ssl=connection.verify_ssl,
        )


@contextlib.contextmanager
def quiet():
    """kfp.Client prints links and warns of its version support; the CLI prints its own lines."""
    with warnings.catch_warnings(), contextlib.redirect_stdout(io.StringIO()):
        warnings.simplefilter("ignore", FutureWarning)
        yield


def _name_filter(display_name: str) -> str:
    predicate = {"operation": _EQUALS, "key": "display_name", "stringValue": display_name}
    return json.dumps({"predicates": [predicate]}, separators=(",", ":"))


def _run_parameters(spec: dict) -> dict:
    """The compiled pipeline's inputs and defaults (the config's values): passed, so that the run records them."""
    inputs = spec.get("root", {}).get("inputDefinitions", {}).get("parameters", {})
    return {name: p["defaultValue"] for name, p in inputs.items() if "defaultValue" in p}


def submit(
    config: RunConfig,
    host: str | Connection,
    experiment: str = "tracefp4",
    *,
    token: str | None = None,
    timeout_s: float = 30,
    namespace: str | None = None,
    service_account: str | None = None,
    pipeline_root: str | None = None,
    methods: list[str] | None = None,
    run_name: str | None = None,
    warn=lambda message: None,
) -> dict:
    """Upload ``config``'s pipeline (with ``methods``, the comparison pipeline),
    or a new version of it, and start a run in ``experiment``.

    The pipeline is ``tracefp4-<config.name>`` (``-compare`` with ``methods``; in ``namespace`` when given);
    the version :func:`~tracefp4.pipelines.pipeline.version_name`, reused
    when one of that name exists; the run's parameters are the compiled
    defaults. ``service_account``: the Kubernetes service account of the run's
    pods; ``pipeline_root``: where KFP keeps the run's artifacts (default: the
    cluster's); ``run_name``: the run's (default: the config's name and the
    time); ``warn`` is told, before anything is uploaded, what may stop
    the run partway (:func:`~.pipeline.run_size_problem`). Returns
    pipeline_id, pipeline_version_id, experiment_id, run_id and run_url.
    Raises SubmitError."""
    connection = host if isinstance(host, Connection) else Connection(host, namespace, token, timeout_s=timeout_s)
    namespace = connection.namespace
    client = connect(connection)
    name = pipeline_name(config) + ("-compare" if methods else "")
    with tempfile.TemporaryDirectory(prefix="tracefp4-submit-") as tmp, quiet():
        path = compile_pipeline(config, Path(tmp) / f"{name}.yaml", methods)
        documents = compiled_documents(Path(path).read_bytes())  # parsed once: at the paper's scale 0.3 s
        spec = documents[0]
        if problem := run_size_problem(run_tasks(spec, config)):
            warn(f"pipeline {name}: {problem}")
        version = version_name(documents)

        found = client.list_pipelines(filter=_name_filter(name), page_size=1, namespace=namespace).pipelines
        if found:
            pipeline_id = found[0].pipeline_id
        else:
            description = f"TRACE FP4 RL ({', '.join(methods or [config.method])}, {config.rollout.config})"
            pipeline_id = client.upload_pipeline(path, name, description, namespace=namespace).pipeline_id
        found = client.list_pipeline_versions(pipeline_id, page_size=1, filter=_name_filter(version)).pipeline_versions
        if found:
            version_id = found[0].pipeline_version_id
        else:
            uploaded = client.upload_pipeline_version(path, version, pipeline_id, description=f"tracefp4 {version}")
            version_id = uploaded.pipeline_version_id

        try:
            experiment_id = client.create_experiment(experiment, "tracefp4 runs", namespace=namespace).experiment_id
        except ValueError as e:  # several experiments of that name
            raise SubmitError(f"experiment {experiment!r}: {e}") from None
        run = client.run_pipeline(
            experiment_id,
            run_name or f"{config.name}-{time.strftime('%Y%m%d-%H%M%S', time.gmtime())}",
            params=_run_parameters(spec),
            pipeline_id=pipeline_id,
            version_id=version_id,
            pipeline_root=pipeline_root,
            service_account=service_account,
        )
    for what, value in (("pipeline", pipeline_id), ("pipeline version", version_id), ("run", run.run_id)):
        if not value:
            raise SubmitError(f"the server's answer for the {what} has no id")
    return {
        "pipeline_id": pipeline_id,
        "pipeline_version_id": version_id,
        "experiment_id": experiment_id,
        "run_id": run.run_id,
        "run_url": f"{connection.host.rstrip('/')}/#/runs/details/{run.run_id}",
    }


def submit_next(
    config: RunConfig,
    continue_with: dict,
    job_id: str,
    connection: Connection | None = None,
    warn=lambda message: None,
) -> dict:
    """Submit the run that continues run ``job_id`` of ``config`` for the
    rounds it leaves (``rl.rounds_per_run``): :func:`~tracefp4.schemas.next_in_chain`
    of ``continue_with``, its last train task's continuation settings; into
    the same experiment, with the same service account and pipeline root,
    through ``config.kfp_host``. The run's last task, ``chain``, calls it.

    The run is named after its rounds and this run, so that a retry of the
    task finds it instead of submitting a second. Returns :func:`submit`'s
    ids (only run_id for one found), its ``name``, and ``submitted`` (False: found)."""
    following = next_in_chain(config, continue_with)
    connection = connection or Connection(config.kfp_host)
    client = connect(connection)
    with quiet():
        this = client.get_run(job_id)
        experiment = client.get_experiment(experiment_id=this.experiment_id)
    namespace = connection.namespace or experiment.namespace or None
    rounds = following.rl.run_rounds()
    name = f"{following.name}-rounds-{rounds.start}-{rounds.stop - 1}-after-{job_id[:8]}"
    with quiet():
        found = client.list_runs(
            experiment_id=this.experiment_id, namespace=namespace, filter=_name_filter(name), page_size=1
        ).runs
    if found:
        return {"run_id": found[0].run_id, "name": name, "submitted": False}
    submitted = submit(
        following,
        replace(connection, namespace=namespace),
        experiment.display_name,
        service_account=this.service_account or None,
        pipeline_root=(this.runtime_config.pipeline_root or None) if this.runtime_config else None,
        run_name=name,
        warn=warn,
    )
    return {**submitted, "name": name, "submitted": True}


def _when(value) -> str:
    """A time of the API's, or "-" where it has none: KFP's API server answers the Unix epoch for a time it has
    not recorded (a run's ``finished_at`` while it runs, KFP 2.17's ``toApiRun``), which is no time to show."""
    return value.strftime("%Y-%m-%d %H:%M:%S") if value and value.timestamp() > 0 else "-"


def _error(status) -> str:
    return (status.message or f"code {status.code}") if status and (status.message or status.code) else ""


def list_runs(connection: Connection, experiment: str | None = None, limit: int = 20) -> list[dict]:
    """The newest runs (of ``experiment`` when given): run_id, name, state, created_at."""
    client = connect(connection)
    experiment_id = None
    with quiet():
        if experiment:
            try:
                found = client.get_experiment(experiment_name=experiment, namespace=connection.namespace)
            except ValueError as e:
                raise SubmitError(str(e)) from None
            experiment_id = found.experiment_id
        runs = client.list_runs(
            page_size=limit, sort_by="created_at desc", experiment_id=experiment_id, namespace=connection.namespace
        )
    return [
        {"run_id": r.run_id, "name": r.display_name, "state": r.state or "-", "created_at": _when(r.created_at)}
        for r in runs.runs or []
    ]


def run_status(connection: Connection, run_id: str) -> dict:
    """One run: its state and error, and each task's name, state, error and pods (from the run details)."""
    with quiet():
        run = connect(connection).get_run(run_id)
    tasks = []
    for t in (run.run_details.task_details if run.run_details else None) or []:
        pods = [p for p in [t.pod_name, *(c.pod_name for c in t.child_tasks or [])] if p]
        name, pods = t.display_name or t.task_id, list(dict.fromkeys(pods))
        state, started = t.state or "-", _when(t.start_time)
        tasks.append({"name": name, "state": state, "error": _error(t.error), "pods": pods, "started": started})
    tasks.sort(key=lambda t: (t["started"] == "-", t["started"]))  # in the order they started, the rest after
    return {
        "run_id": run.run_id,
        "experiment_id": run.experiment_id,
        "name": run.display_name,
        "state": run.state or "-",
        "error": _error(run.error),
        "created_at": _when(run.created_at),
        "finished_at": _when(run.finished_at),
        "tasks": tasks,
    }


def run_namespace(connection: Connection, status: dict) -> str | None:
    """The namespace :func:`run_status`'s run ran in: the connection's, else its experiment's (a multi-user
    Kubeflow's profile namespace, where the run was submitted into one), else None (standalone KFP)."""
    if connection.namespace or not status["experiment_id"]:
        return connection.namespace
    with quiet():
        return connect(connection).get_experiment(experiment_id=status["experiment_id"]).namespace or None


def log_commands(status: dict, namespace: str | None) -> list[str]:
    """``kubectl logs`` for every pod of the run's tasks (pods run in the run's namespace:
    ``kubeflow`` for standalone KFP, the profile namespace in multi-user Kubeflow)."""
    ns = namespace or "kubeflow"
    return [f"kubectl -n {ns} logs {pod} -c main" for task in status["tasks"] for pod in task["pods"]]
