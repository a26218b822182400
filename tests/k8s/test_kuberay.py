"""`raydeck k8s render`'s manifests: valid for KubeRay and Kubernetes, and the same platform as
docker/docker-compose.yml and `raydeck up`.

Validation uses real schemas with real validators, and nothing else (no Kubernetes API server
exists here, so nothing is applied): the custom resources against the ``openAPIV3Schema`` of the
CRDs vendored under tests/schemas/ (KubeRay v1.7.0, Prometheus Operator v0.93.0) with
jsonschema, made strict as ``kubectl apply``'s default field validation is (an unknown field is
an error, not silently pruned); the PersistentVolumeClaim and every pod template inside the
custom resources against Kubernetes' own schemas (kubernetes-validate, strict). No process
starts: rendering and validation take well under a second.
"""

from __future__ import annotations

import functools
import re
from pathlib import Path
from typing import Any

import jsonschema
import kubernetes_validate
import pytest
import yaml
from typer.testing import CliRunner

from raydeck.cli.main import app
from raydeck.cluster.serve_ingress import HAPROXY_RETRY_ON
from raydeck.config.secrets import Secret
from raydeck.config.settings import Settings, load_settings
from raydeck.config.stack_credentials import SECRET_NAMES, Credentials
from raydeck.errors import ConfigError
from raydeck.jobs.submission import submitted_runtime_env
from raydeck.k8s import kuberay, manifests
from raydeck.k8s.options import DEFAULT_IMAGE, KubeRayOptions, WorkerBounds
from raydeck.serving import ServeOptions, serve_config
from raydeck.stack.launchers import LAUNCHERS, StackContext
from raydeck.stack.services import SECRET_SETTINGS_ENV, SERVICES, service
from raydeck.stack.state import StackPaths, StackState

ROOT = Path(__file__).resolve().parents[2]
SCHEMAS = Path(__file__).resolve().parents[1] / "schemas"
KUBERAY = SCHEMAS / "kuberay-v1.7.0"
PROMETHEUS_OPERATOR = SCHEMAS / "prometheus-operator-v0.93.0"
KUEUE = SCHEMAS / "kueue-v0.19.2"
CRDS = {
    "RayCluster": KUBERAY / "ray.io_rayclusters.yaml",
    "RayJob": KUBERAY / "ray.io_rayjobs.yaml",
    "RayService": KUBERAY / "ray.io_rayservices.yaml",
    "PodMonitor": PROMETHEUS_OPERATOR / "monitoring.coreos.com_podmonitors.yaml",
    **{kind: KUEUE / f"kueue.x-k8s.io_{plural}.yaml" for kind, plural in (
        ("ResourceFlavor", "resourceflavors"), ("ClusterQueue", "clusterqueues"),
        ("LocalQueue", "localqueues"), ("WorkloadPriorityClass", "workloadpriorityclasses"))},
}
KUBERNETES_VERSION = "1.37"  # kubernetes-validate 1.37.0's newest schemas
COMPOSE_TEXT = (ROOT / "docker" / "docker-compose.yml").read_text()
COMPOSE = yaml.safe_load(COMPOSE_TEXT)["services"]
SECRET_VALUE = "s3-secret-never-in-a-manifest"


def _strict(schema: Any) -> Any:
    """The schema with unknown fields rejected wherever it lists the known ones, as the API
    server's strict field validation does (KubeRay's CRDs rely on pruning otherwise)."""
    if isinstance(schema, list):
        return [_strict(item) for item in schema]
    if not isinstance(schema, dict):
        return schema
    strict = {key: _strict(value) for key, value in schema.items()}
    if ("properties" in schema and "additionalProperties" not in schema
            and not schema.get("x-kubernetes-preserve-unknown-fields")):
        strict["additionalProperties"] = False
    return strict


@functools.cache
def _crd_validator(kind: str) -> jsonschema.protocols.Validator:
    # libyaml's loader: the pure-Python one takes ~10 s for KubeRay's 1-3 MB CRDs.
    crd = yaml.load(CRDS[kind].read_text(), Loader=yaml.CSafeLoader)
    assert crd["spec"]["names"]["kind"] == kind
    served = manifest_version(kind)
    (version,) = [v for v in crd["spec"]["versions"] if v["name"] == served]
    schema = _strict(version["schema"]["openAPIV3Schema"])
    jsonschema.Draft7Validator.check_schema(schema)
    return jsonschema.Draft7Validator(schema)


def manifest_version(kind: str) -> str:
    """The API version raydeck renders ``kind`` at: Kueue's v1beta2, the others' v1."""
    return "v1beta2" if CRDS[kind].parent == KUEUE else "v1"


def _validate_custom(manifest: dict[str, Any]) -> None:
    assert manifest["apiVersion"].rsplit("/", 1)[1] == manifest_version(manifest["kind"])
    errors = sorted(_crd_validator(manifest["kind"]).iter_errors(manifest), key=str)
    assert not errors, "\n".join(f"{'.'.join(map(str, e.absolute_path))}: {e.message}"
                                 for e in errors)


def _validate_core(manifest: dict[str, Any]) -> None:
    kubernetes_validate.validate(manifest, KUBERNETES_VERSION, strict=True)


def _settings(**env: str) -> Settings:
    return load_settings(env={"RAYDECK_STACK_FILE": "", "RAYDECK_S3_ENDPOINT": "http://s3:9000",
                              "RAYDECK_S3_ACCESS_KEY_ID": "raydeck",
                              "RAYDECK_S3_SECRET_ACCESS_KEY": SECRET_VALUE, **env})


def _render(settings: Settings | None = None,
            options: KubeRayOptions | None = None) -> dict[str, dict[str, Any]]:
    return manifests.render(options or KubeRayOptions(), settings or _settings(),
                          kuberay.job_request("jobs/digits_torch.py", "cpu-2"),
                          ServeOptions(model_uri="models:/digits@champion"))


def _pod_templates(manifests: dict[str, dict[str, Any]]) -> list[dict[str, Any]]:
    cluster = manifests[f"{kuberay.CLUSTER_DIR}/raycluster.yaml"]["spec"]
    service_cluster = manifests["rayservice.yaml"]["spec"]["rayClusterConfig"]
    return [group["template"] for spec in (cluster, service_cluster)
            for group in (spec["headGroupSpec"], *spec["workerGroupSpecs"])] + [
        manifests["rayjob.yaml"]["spec"]["submitterPodTemplate"]]


def _env(container: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {item["name"]: item for item in container["env"]}


def _head_and_worker_env(manifests: dict[str, dict[str, Any]]
                         ) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    spec = manifests[f"{kuberay.CLUSTER_DIR}/raycluster.yaml"]["spec"]
    head = _env(spec["headGroupSpec"]["template"]["spec"]["containers"][0])
    workers = [_env(group["template"]["spec"]["containers"][0])
               for group in spec["workerGroupSpecs"]]
    return head, workers


def _compose_value(text: Any, env: dict[str, str] | None = None) -> str:
    """A compose value as docker compose resolves it with ``env`` and no .env file:
    ``${NAME:-default}`` and ``${NAME:?message}`` (then required: empty here)."""
    def fill(match: re.Match[str]) -> str:
        name, kind, default = match.groups()
        return (env or {}).get(name) or (default if kind == "-" else "")
    return re.sub(r"\$\{(\w+):([-?])([^}]*)\}", fill, str(text))


# --- the schemas ------------------------------------------------------------------------------
def test_custom_resources_validate_against_the_kuberay_and_prometheus_operator_crds() -> None:
    manifests = _render()
    kinds = {manifest["kind"] for manifest in manifests.values()}
    assert kinds == {"RayCluster", "RayJob", "RayService", "PodMonitor",
                     "PersistentVolumeClaim"}
    for manifest in manifests.values():
        if manifest["kind"] in CRDS:
            _validate_custom(manifest)


def test_core_objects_and_every_pod_template_validate_against_kubernetes_schemas() -> None:
    manifests = _render(options=KubeRayOptions(storage_class="fast-ssd"))
    _validate_core(manifests[f"{kuberay.CLUSTER_DIR}/spool-pvc.yaml"])
    for template in _pod_templates(manifests):
        _validate_core({"apiVersion": "v1", "kind": "PodTemplate",
                        "metadata": {"name": "check"}, "template": template})


def test_the_validators_reject_what_the_cluster_would() -> None:
    """The checks are not vacuous: a misspelt field, wrong types and a bad enum value fail."""
    manifests = _render()
    cluster = yaml.safe_load(yaml.safe_dump(manifests[f"{kuberay.CLUSTER_DIR}/raycluster.yaml"]))
    cluster["spec"]["workerGroupSpecs"][0]["maxReplica"] = 3
    with pytest.raises(AssertionError, match="maxReplica"):
        _validate_custom(cluster)
    job = yaml.safe_load(yaml.safe_dump(manifests["rayjob.yaml"]))
    job["spec"]["clusterSelector"] = ["raydeck"]
    with pytest.raises(AssertionError, match="clusterSelector"):
        _validate_custom(job)
    service_spec = yaml.safe_load(yaml.safe_dump(manifests["rayservice.yaml"]))
    service_spec["spec"]["rayClusterConfig"]["authOptions"] = {"mode": "sometimes"}
    with pytest.raises(AssertionError, match="authOptions"):
        _validate_custom(service_spec)
    template = _pod_templates(manifests)[0]
    template["spec"]["containers"][0]["ports"][0]["containerPort"] = "6379"
    with pytest.raises(kubernetes_validate.ValidationError):
        _validate_core({"apiVersion": "v1", "kind": "PodTemplate",
                        "metadata": {"name": "check"}, "template": template})


# --- one platform -----------------------------------------------------------------------------
def test_pods_get_the_compose_containers_variables() -> None:
    """Compose's ray-head and ray-worker variables by name, except the declared differences."""
    head, workers = _head_and_worker_env(_render())
    for compose_name, env in (("ray-head", head), *(("ray-worker", w) for w in workers)):
        compose = set(COMPOSE[compose_name]["environment"])
        expected = (compose - set(kuberay.COMPOSE_ONLY_ENV)) | set(kuberay.KUBERAY_ONLY_ENV)
        assert set(env) == expected, compose_name


def test_settings_values_are_composes_defaults() -> None:
    """With default settings every non-secret value equals compose's (its default, or its
    literal: the in-cluster addresses of MLflow and S3, the data directory)."""
    head, _ = _head_and_worker_env(_render(load_settings(env={"RAYDECK_STACK_FILE": ""})))
    compose = COMPOSE["ray-head"]["environment"]
    for name, item in head.items():
        if "value" in item and name in compose:
            assert item["value"] == _compose_value(compose[name]), name
    assert f"raydeck-data:{kuberay.CONTAINER_DATA_DIR}" in COMPOSE["ray-head"]["volumes"]


def test_a_changed_setting_shows_in_compose_raydeck_up_and_the_manifests(tmp_path: Path) -> None:
    changed = {"RAYDECK_TRACKING_EXPERIMENT": "vision", "RAYDECK_S3_PREFIX": "team-a",
               "RAYDECK_S3_REGION": "eu-west-1", "RAYDECK_LOG_LEVEL": "DEBUG",
               "RAYDECK_S3_CHECKPOINTS_BUCKET": "ckpt", "RAYDECK_S3_ARTIFACTS_BUCKET": "art"}
    settings = _settings(**changed)
    head, workers = _head_and_worker_env(_render(settings))
    credentials = Credentials(ray_auth_token=Secret("t"), s3_access_key_id="raydeck",
                              s3_secret_access_key=Secret("s"), postgres_password=Secret("p"),
                              jupyter_token=Secret("j"))
    ctx = StackContext(paths=StackPaths(tmp_path), credentials=credentials, settings=settings,
                       state=StackState(ports={p.name: p.default for s in SERVICES
                                               for p in s.ports}), stack_file=None)
    (ray_head,) = [launcher for launcher in LAUNCHERS if launcher.spec.name == "ray-head"]
    local = ray_head.environment(ctx)
    compose = COMPOSE["ray-head"]["environment"]
    for name, value in changed.items():
        assert _compose_value(compose[name], changed) == value, f"compose: {name}"
        assert local[name] == value, f"raydeck up: {name}"
        for env in (head, *workers):
            assert env[name]["value"] == value, f"manifests: {name}"


def test_every_ray_pod_serves_through_haproxy_unless_told_not() -> None:
    """Compose's default (``${RAY_SERVE_ENABLE_HA_PROXY:-1}``); the images carry HAProxy."""
    manifests = _render()
    for template in _pod_templates(manifests)[:6]:  # the clusters' heads and workers
        assert _env(template["spec"]["containers"][0])["RAY_SERVE_ENABLE_HA_PROXY"] == {
            "name": "RAY_SERVE_ENABLE_HA_PROXY", "value": "1"}
        assert _env(template["spec"]["containers"][0])["RAY_SERVE_HAPROXY_RETRY_ON"][
            "value"] == HAPROXY_RETRY_ON
    head, workers = _head_and_worker_env(_render(options=KubeRayOptions(
        haproxy_ingress=False)))
    assert {env["RAY_SERVE_ENABLE_HA_PROXY"]["value"] for env in (head, *workers)} == {"0"}


def test_ports_image_and_paths_are_the_compose_files() -> None:
    manifests = _render()
    spec = manifests[f"{kuberay.CLUSTER_DIR}/raycluster.yaml"]["spec"]
    head = spec["headGroupSpec"]
    ports = {p["name"]: p["containerPort"] for p in head["template"]["spec"]["containers"][0]
             ["ports"]}
    for port in service("ray-head").ports:
        assert ports[kuberay.KUBERAY_PORT_NAMES[port.name]] == port.default
        assert head["rayStartParams"][kuberay.RAY_START_FLAGS[port.name]] == str(port.default)
        assert f"{kuberay.RAY_START_FLAGS[port.name]}={port.default}" in " ".join(
            COMPOSE["ray-head"]["command"])
    for compose_name in ("ray-head", "ray-worker"):
        assert f"--metrics-export-port={kuberay.METRICS_EXPORT_PORT}" in COMPOSE[compose_name][
            "command"]
        assert _compose_value(COMPOSE[compose_name]["shm_size"]) == "2gb"
    assert kuberay.SHM_SIZE == "2Gi"
    assert _compose_value(COMPOSE["ray-head"]["image"]) == DEFAULT_IMAGE
    dockerfile = (ROOT / "docker" / "Dockerfile").read_text()
    assert f"WORKDIR {kuberay.IMAGE_CODE_DIR}\nCOPY" in dockerfile
    assert "COPY --chown=ray:users jobs/ jobs/" in dockerfile
    bounds = [(g["groupName"], g["minReplicas"], g["maxReplicas"])
              for g in spec["workerGroupSpecs"]]
    assert bounds == [("cpu", 0, 4), ("gpu", 0, 2)] and spec["enableInTreeAutoscaling"]
    gpu = spec["workerGroupSpecs"][1]["template"]["spec"]["containers"][0]
    assert gpu["resources"]["limits"]["nvidia.com/gpu"] == 1
    monitor = manifests[f"{kuberay.CLUSTER_DIR}/podmonitor.yaml"]["spec"]
    (endpoint,) = monitor["podMetricsEndpoints"]
    assert endpoint["port"] == "metrics"
    assert endpoint["relabelings"][0]["targetLabel"] == "ray_io_cluster"  # dashboards' $cluster
    assert all(any(p["name"] == "metrics" for p in t["spec"]["containers"][0]["ports"])
               for t in _pod_templates(manifests)[:3])


def test_the_spool_is_on_the_claim_and_the_token_a_mounted_secret() -> None:
    manifests = _render()
    claim = manifests[f"{kuberay.CLUSTER_DIR}/spool-pvc.yaml"]
    head = manifests[f"{kuberay.CLUSTER_DIR}/raycluster.yaml"]["spec"]["headGroupSpec"]
    pod = head["template"]["spec"]
    (spool,) = [v for v in pod["volumes"] if "persistentVolumeClaim" in v]
    assert spool["persistentVolumeClaim"]["claimName"] == claim["metadata"]["name"]
    assert {"name": spool["name"], "mountPath": kuberay.CONTAINER_DATA_DIR} in pod[
        "containers"][0]["volumeMounts"]
    for template in _pod_templates(manifests):
        spec = template["spec"]
        env = _env(spec["containers"][0])
        assert env["RAY_AUTH_MODE"]["value"] == "token"
        mount = env["RAY_AUTH_TOKEN_PATH"]["value"].rsplit("/", 1)[0]
        (volume,) = [v for v in spec["volumes"] if "secret" in v]
        assert volume["secret"]["secretName"] == "raydeck-credentials"
        # Readable by Ray's user (group users) and nobody else.
        assert volume["secret"]["defaultMode"] == 0o440
        assert spec["securityContext"]["fsGroup"] == kuberay.RAY_IMAGE_GID
        assert {"name": volume["name"], "mountPath": mount, "readOnly": True} in spec[
            "containers"][0]["volumeMounts"]


def test_no_secret_is_a_value_anywhere() -> None:
    manifests = _render()
    text = yaml.safe_dump(manifests)
    assert SECRET_VALUE not in text
    for template in _pod_templates(manifests):
        env = _env(template["spec"]["containers"][0])
        assert "RAY_AUTH_TOKEN" not in env  # the token is a mounted file, never a variable
        for name in (set(SECRET_NAMES) | set(SECRET_SETTINGS_ENV)) & env.keys():
            assert env[name] == {"name": name, "valueFrom": {"secretKeyRef": {
                "name": "raydeck-credentials", "key": name}}}
    assert set(SECRET_SETTINGS_ENV) <= set(
        _env(_pod_templates(manifests)[0]["spec"]["containers"][0]))


def test_the_job_is_submits_and_the_service_is_serves() -> None:
    manifests = _render()
    request = kuberay.job_request("jobs/digits_torch.py", "cpu-2")
    job = manifests["rayjob.yaml"]["spec"]
    assert job["entrypoint"] == request.entrypoint == "python jobs/digits_torch.py"
    runtime_env = yaml.safe_load(job["runtimeEnvYAML"])
    assert runtime_env["working_dir"] == kuberay.IMAGE_CODE_DIR
    contract = submitted_runtime_env(request)["env_vars"]
    assert set(runtime_env["env_vars"]) == set(contract)
    assert runtime_env["env_vars"]["RAYDECK_PRESET"] == "cpu-2"
    assert job["clusterSelector"] == {"ray.io/cluster": "raydeck"}
    served = yaml.safe_load(manifests["rayservice.yaml"]["spec"]["serveConfigV2"])
    options = ServeOptions(model_uri="models:/digits@champion", host="0.0.0.0")
    assert served == serve_config(options, _settings())


def test_options_are_checked() -> None:
    with pytest.raises(ConfigError, match="MIN:MAX"):
        WorkerBounds.parse("4", "--gpu-workers")
    with pytest.raises(ConfigError, match="0 <= MIN <= MAX"):
        WorkerBounds.parse("5:2", "--cpu-workers")
    with pytest.raises(ConfigError, match="--name"):
        KubeRayOptions(name="Ray_Deck")
    with pytest.raises(ConfigError, match="--tracking-uri"):
        KubeRayOptions(tracking_uri="sqlite:///mlflow.db")  # a pod's own disk
    with pytest.raises(ConfigError, match="--spool-size"):
        KubeRayOptions(spool_size="lots")
    with pytest.raises(ConfigError, match="--job"):
        kuberay.job_request("../outside.py", "cpu-2")


def test_render_command_writes_the_manifests_and_no_secret(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("RAYDECK_STACK_FILE", "")
    monkeypatch.setenv("RAYDECK_S3_SECRET_ACCESS_KEY", SECRET_VALUE)
    answer = CliRunner().invoke(app, ["k8s", "render", "--out", "out", "--gpu-workers", "1:8",
                                      "--name", "team-a"])
    assert answer.exit_code == 0, answer.output
    written = sorted(str(p.relative_to(tmp_path / "out")) for p in (tmp_path / "out").rglob("*")
                     if p.is_file())
    assert written == sorted(_render())
    assert SECRET_VALUE not in answer.output
    for path in (tmp_path / "out").rglob("*.yaml"):
        text = path.read_text()
        assert SECRET_VALUE not in text
        assert "&id" not in text, f"{path}: a YAML alias (pods sharing an object)"
    cluster = yaml.safe_load((tmp_path / "out" / "cluster" / "raycluster.yaml").read_text())
    assert cluster["metadata"]["name"] == "team-a"
    assert cluster["spec"]["workerGroupSpecs"][1]["maxReplicas"] == 8
    _validate_custom(cluster)
    # The user's RAY_SERVE_ENABLE_HA_PROXY wins over HAProxy, the default.
    monkeypatch.setenv("RAY_SERVE_ENABLE_HA_PROXY", "0")
    answer = CliRunner().invoke(app, ["k8s", "render", "--out", "proxy"])
    assert answer.exit_code == 0, answer.output
    head = yaml.safe_load((tmp_path / "proxy" / "cluster" / "raycluster.yaml").read_text())[
        "spec"]["headGroupSpec"]["template"]["spec"]["containers"][0]
    assert _env(head)["RAY_SERVE_ENABLE_HA_PROXY"]["value"] == "0"
