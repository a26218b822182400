"""Production on Kubernetes: credentials only in Secrets, one spool claim per head, Kueue from
the teams file, Kubernetes token auth with RBAC, and every object of every option combination
valid against its CRD (Kueue v0.19.2, KubeRay v1.7.0, Prometheus Operator v0.93.0) or
Kubernetes' own schema (1.37), strictly.

No Kubernetes API server runs here: nothing is applied; the schemas are what the API server
would check first (CEL rules in Kueue's CRDs are not evaluated by jsonschema).
"""

from __future__ import annotations

import http.server
import itertools
import json
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import kubernetes_validate
import mlflow.environment_variables as mlflow_env
import pytest
import yaml
from typer.testing import CliRunner

from raydeck.cli.main import app
from raydeck.config.settings import Settings
from raydeck.errors import ConfigError
from raydeck.jobs import submission
from raydeck.k8s import auth, kuberay, kueue, manifests, secrets
from raydeck.k8s.kueue import Capacity, TeamSpec
from raydeck.k8s.options import KubeRayOptions
from raydeck.scheduling.queue.actor import DATABASE_URL_ENV
from raydeck.serving import ServeOptions
from tests.k8s.test_kuberay import (
    CRDS,
    KUBERNETES_VERSION,
    SECRET_VALUE,
    _settings,
    _validate_core,
    _validate_custom,
)

MLFLOW_USER = "alice-mlflow-user"
MLFLOW_PASSWORD = "mlflow-password-never-in-a-manifest"
PG_PASSWORD = "pg-password-never-in-a-manifest"
CREDENTIALED_TRACKING = f"https://{MLFLOW_USER}:{MLFLOW_PASSWORD}@mlflow.example.com:8443/"
CREDENTIALED_DATABASE = f"postgresql://raydeck:{PG_PASSWORD}@pg.example.com:5432/queue"
TEAMS = (TeamSpec("vision", weight=2, gpus=4, members=("ana", "bo"), max_priority=5),
         TeamSpec("nlp", weight=1, cpus=32, members=()))
CAPACITY = Capacity(cpus=64, gpus=8)
TEAMS_FILE = """\
admins: [root-admin]
vision: {weight: 2, gpus: 4, members: [ana, bo], max_priority: 5}
nlp: {cpus: 32}
"""


def _options(**changes: Any) -> KubeRayOptions:
    return KubeRayOptions(**changes)


def _render(options: KubeRayOptions, settings: Settings | None = None, job_preset: str = "cpu-2",
            serve_preset: str = "cpu-1") -> dict[str, dict[str, Any]]:
    return manifests.render(options, settings or _settings(),
                            kuberay.job_request("jobs/digits_torch.py", job_preset),
                            ServeOptions(model_uri="models:/digits@champion",
                                         preset=serve_preset))


def _combinations() -> Iterator[tuple[str, KubeRayOptions, str]]:
    """Every option combination the issue names: plain, credentialed URIs, --auth k8s,
    --teams, --kueue (with an elastic and a fixed preset), and all together."""
    credentialed = {"tracking_uri": CREDENTIALED_TRACKING,
                    "queue_database_url": CREDENTIALED_DATABASE}
    for creds, k8s, teams, use_kueue in itertools.product((False, True), repeat=4):
        if use_kueue and not teams:
            continue
        changes: dict[str, Any] = dict(credentialed) if creds else {}
        if k8s:
            changes["auth"] = "k8s"
        if teams:
            changes.update(teams=TEAMS, admins=("root-admin",))
        if use_kueue:
            changes.update(kueue=True, capacity=CAPACITY, team="vision", priority=3)
        label = f"creds={creds} k8s={k8s} teams={teams} kueue={use_kueue}"
        for preset in ("cpu-2", "gpu-1-4") if use_kueue else ("cpu-2",):
            yield f"{label} preset={preset}", _options(**changes), preset


def _pod_templates(manifest: dict[str, Any]) -> list[dict[str, Any]]:
    """Every pod template inside a KubeRay object."""
    spec = manifest["spec"]
    clusters = [spec] if manifest["kind"] == "RayCluster" else [
        spec[key] for key in ("rayClusterSpec", "rayClusterConfig") if key in spec]
    templates = [group["template"] for cluster in clusters
                 for group in (cluster["headGroupSpec"], *cluster["workerGroupSpecs"])]
    if "submitterPodTemplate" in spec:
        templates.append(spec["submitterPodTemplate"])
    return templates


def _validate(manifest: dict[str, Any]) -> None:
    if manifest["kind"] in CRDS:
        _validate_custom(manifest)
        for template in (_pod_templates(manifest) if manifest["apiVersion"] == "ray.io/v1"
                         else []):
            _validate_core({"apiVersion": "v1", "kind": "PodTemplate",
                            "metadata": {"name": "check"}, "template": template})
    else:
        _validate_core(manifest)


# --- schemas ----------------------------------------------------------------------------------
@pytest.mark.timeout(120)
def test_every_object_of_every_combination_validates_against_its_schema() -> None:
    kinds: set[str] = set()
    for label, options, preset in _combinations():
        for path, manifest in _render(options, job_preset=preset).items():
            try:
                _validate(manifest)
            except (AssertionError, kubernetes_validate.ValidationError) as exc:
                raise AssertionError(f"{label}: {path}: {exc}") from None
            kinds.add(manifest["kind"])
    assert kinds == {"RayCluster", "RayJob", "RayService", "PodMonitor",
                     "PersistentVolumeClaim", "Secret", "Namespace", "ServiceAccount", "Role",
                     "RoleBinding", "ClusterRole", "ClusterRoleBinding", "ResourceFlavor",
                     "ClusterQueue", "LocalQueue", "WorkloadPriorityClass"}


def test_an_unknown_or_missing_field_fails_validation() -> None:
    """Kueue's v1beta1 name ``cohort`` (v1beta2: ``cohortName``), a quota without its required
    ``nominalQuota``, a priority class without ``value``, an RBAC rule without verbs."""
    rendered = _render(_options(teams=TEAMS, kueue=True, capacity=CAPACITY, auth="k8s"))
    queue = yaml.safe_load(yaml.safe_dump(rendered["kueue/clusterqueue-raydeck-vision.yaml"]))
    queue["spec"]["cohort"] = queue["spec"].pop("cohortName")
    with pytest.raises(AssertionError, match="cohort"):
        _validate_custom(queue)
    queue = yaml.safe_load(yaml.safe_dump(rendered["kueue/clusterqueue-raydeck-vision.yaml"]))
    del queue["spec"]["resourceGroups"][0]["flavors"][0]["resources"][0]["nominalQuota"]
    with pytest.raises(AssertionError, match="nominalQuota"):
        _validate_custom(queue)
    priority = dict(rendered["kueue/workloadpriorityclass-raydeck-priority-0.yaml"])
    del priority["value"]
    with pytest.raises(AssertionError, match="value"):
        _validate_custom(priority)
    role = yaml.safe_load(yaml.safe_dump(rendered["teams/vision/role.yaml"]))
    del role["rules"][0]["verbs"]
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(role, KUBERNETES_VERSION, strict=True)
    binding = yaml.safe_load(yaml.safe_dump(rendered["teams/vision/rolebinding.yaml"]))
    binding["subject"] = binding.pop("subjects")
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(binding, KUBERNETES_VERSION, strict=True)


# --- credentials ------------------------------------------------------------------------------
def test_every_credential_form_is_only_in_a_secret(tmp_path: Path) -> None:
    """The MLflow URI's user and password, PostgreSQL's password, the S3 secret (a setting):
    in no object but a Secret, in every combination; pods reach each by secretKeyRef."""
    settings = _settings()
    for label, options, preset in _combinations():
        rendered = _render(options, settings, job_preset=preset)
        for path, manifest in rendered.items():
            text = yaml.safe_dump(manifest)
            assert SECRET_VALUE not in text, f"{label}: {path}"
            if manifest["kind"] != "Secret":
                for value in (MLFLOW_USER, MLFLOW_PASSWORD, PG_PASSWORD):
                    assert value not in text, f"{label}: {path} holds {value}"
        written = manifests.write(rendered, tmp_path / label.replace(" ", "_"))
        for file in written:
            if "secrets/" in str(file):
                assert file.stat().st_mode & 0o777 == manifests.SECRET_FILE_MODE


def test_a_credentialed_uri_is_split_into_a_secret_and_a_uri_without_it() -> None:
    options = _options(tracking_uri=CREDENTIALED_TRACKING,
                       queue_database_url=CREDENTIALED_DATABASE)
    assert CREDENTIALED_TRACKING not in repr(options)
    rendered = _render(options)
    secret = rendered["secrets/uri-credentials.yaml"]
    assert secret["metadata"]["name"] == "raydeck-uri-credentials"
    assert secret["stringData"] == {"MLFLOW_TRACKING_USERNAME": MLFLOW_USER,
                                    "MLFLOW_TRACKING_PASSWORD": MLFLOW_PASSWORD,
                                    "PGPASSWORD": PG_PASSWORD}
    cluster = rendered["cluster/raycluster.yaml"]["spec"]
    head = {e["name"]: e for e in cluster["headGroupSpec"]["template"]["spec"]["containers"][0][
        "env"]}
    worker = {e["name"]: e for e in cluster["workerGroupSpecs"][0]["template"]["spec"][
        "containers"][0]["env"]}
    assert head["RAYDECK_TRACKING_URI"]["value"] == "https://mlflow.example.com:8443/"
    assert head[DATABASE_URL_ENV]["value"] == "postgresql://raydeck@pg.example.com:5432/queue"
    assert DATABASE_URL_ENV not in worker  # the queue runs on the head
    for name in ("MLFLOW_TRACKING_USERNAME", "MLFLOW_TRACKING_PASSWORD"):
        assert head[name]["valueFrom"]["secretKeyRef"] == {
            "name": "raydeck-uri-credentials", "key": name}
    assert head["PGPASSWORD"]["valueFrom"]["secretKeyRef"] == {
        "name": "raydeck-uri-credentials", "key": "PGPASSWORD"}
    # A token MLflow reads from the credentials Secret when it holds one.
    assert worker["MLFLOW_TRACKING_TOKEN"]["valueFrom"]["secretKeyRef"] == {
        "name": "raydeck-credentials", "key": "MLFLOW_TRACKING_TOKEN", "optional": True}
    # Without a credentialed URI: every MLflow credential an optional key of that Secret, and
    # no Secret is rendered.
    plain = _render(_options(queue_database_url="postgresql://raydeck@pg:5432/queue"))
    assert not any(m["kind"] == "Secret" for m in plain.values())
    head = {e["name"]: e for e in plain["cluster/raycluster.yaml"]["spec"]["headGroupSpec"][
        "template"]["spec"]["containers"][0]["env"]}
    assert head["PGPASSWORD"]["valueFrom"]["secretKeyRef"] == {
        "name": "raydeck-credentials", "key": "POSTGRES_PASSWORD", "optional": True}
    assert head["MLFLOW_TRACKING_USERNAME"]["valueFrom"]["secretKeyRef"]["optional"] is True


def test_the_names_are_the_ones_mlflow_libpq_the_queue_and_the_client_read() -> None:
    assert (mlflow_env.MLFLOW_TRACKING_USERNAME.name,
                                  mlflow_env.MLFLOW_TRACKING_PASSWORD.name,
                                  mlflow_env.MLFLOW_TRACKING_TOKEN.name) == secrets.MLFLOW_ENV
    assert secrets.QUEUE_DATABASE_ENV == DATABASE_URL_ENV
    assert auth.K8S_TOKEN_FILE_ENV == submission.K8S_TOKEN_FILE_ENV


def test_mlflow_sends_the_split_credentials() -> None:
    """MLflow's own client, given the pod's variables, authenticates with them."""
    from mlflow.tracking._tracking_service.utils import get_default_host_creds

    split = secrets.split_credentials(CREDENTIALED_TRACKING, "--tracking-uri",
                                      keep_username=False)
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("MLFLOW_TRACKING_USERNAME", split.username)
        patch.setenv("MLFLOW_TRACKING_PASSWORD", split.password.reveal())
        creds = get_default_host_creds(split.uri)
    assert (creds.host, creds.username, creds.password) == (
        "https://mlflow.example.com:8443/", MLFLOW_USER, MLFLOW_PASSWORD)


def test_credential_forms_that_cannot_be_split_are_refused() -> None:
    with pytest.raises(ConfigError, match="--tracking-uri: a user name without a password"):
        _options(tracking_uri="https://alice@mlflow.example.com")
    with pytest.raises(ConfigError, match="query parameter 'token'"):
        _options(tracking_uri="https://mlflow.example.com/?token=abc")
    with pytest.raises(ConfigError, match="query parameter 'password'"):
        _options(queue_database_url="postgresql://pg/queue?password=abc")
    with pytest.raises(ConfigError, match="postgresql://"):
        _options(queue_database_url="sqlite:///queue.db")
    split = secrets.split_credentials("http://u%40x:p%3Aw@[::1]:5000/a", "--x",
                                      keep_username=False)
    assert (split.uri, split.username, split.password.reveal()) == (
        "http://[::1]:5000/a", "u@x", "p:w")


# --- storage ----------------------------------------------------------------------------------
def test_each_claim_is_mounted_by_one_head_and_the_service_needs_none() -> None:
    """Applied together, the RayCluster, the RayJob and the RayService share no volume: the
    RayCluster's head alone mounts its ReadWriteOnce claim; the RayService's head and a Kueue
    RayJob's keep their data directory on an emptyDir."""
    for label, options, preset in _combinations():
        rendered = _render(options, job_preset=preset)
        claims = {(m["metadata"].get("namespace", ""), m["metadata"]["name"])
                  for m in rendered.values() if m["kind"] == "PersistentVolumeClaim"}
        mounted: list[tuple[str, str, str]] = []
        for manifest in rendered.values():
            if manifest["apiVersion"] != "ray.io/v1":
                continue
            for template in _pod_templates(manifest):
                for volume in template["spec"].get("volumes", []):
                    if "persistentVolumeClaim" in volume:
                        mounted.append((manifest["kind"],
                                        manifest["metadata"].get("namespace", ""),
                                        volume["persistentVolumeClaim"]["claimName"]))
            if manifest["kind"] == "RayService" or "rayClusterSpec" in manifest["spec"]:
                head = _pod_templates(manifest)[0]["spec"]["volumes"]
                (spool,) = [v for v in head if v["name"] == "spool"]
                assert "emptyDir" in spool, f"{label}: {manifest['kind']}"
        assert sorted((ns, claim) for _, ns, claim in mounted) == sorted(claims), label
        assert {kind for kind, _, _ in mounted} == {"RayCluster"}, label


# --- Kueue ------------------------------------------------------------------------------------
def test_fair_shares_split_by_weight_within_quotas() -> None:
    assert kueue.fair_shares(8, [2, 1], [4, float("inf")]) == [4, 4]
    assert kueue.fair_shares(9, [2, 1], [float("inf")] * 2) == [6, 3]
    assert kueue.fair_shares(10, [1, 1, 1], [float("inf")] * 3) == [4, 3, 3]
    assert kueue.fair_shares(10, [1, 1], [2, 3]) == [2, 3]  # the rest is nobody's


def test_kueue_objects_from_the_teams_file() -> None:
    rendered = _render(_options(teams=TEAMS, kueue=True, capacity=CAPACITY, team="vision",
                                priority=3))
    flavors = {m["metadata"]["name"]: m["spec"] for m in rendered.values()
               if m["kind"] == "ResourceFlavor"}
    assert flavors[kueue.GPU_FLAVOR]["nodeLabels"] == kueue.GPU_NODE_LABELS
    assert set(flavors) == {kueue.CPU_FLAVOR, kueue.GPU_FLAVOR}
    vision = rendered["kueue/clusterqueue-raydeck-vision.yaml"]["spec"]
    nlp = rendered["kueue/clusterqueue-raydeck-nlp.yaml"]["spec"]
    assert vision["cohortName"] == nlp["cohortName"] == kueue.COHORT
    assert vision["fairSharing"] == {"weight": "2"}
    (cpu_group, gpu_group) = vision["resourceGroups"]
    assert gpu_group["coveredResources"] == ["nvidia.com/gpu"]
    # 8 GPUs: vision's share (2/3) is capped by its quota 4, nlp gets the other 4 and may
    # borrow without bound (no GPU quota); vision may borrow nothing above its quota.
    assert gpu_group["flavors"][0]["resources"] == [
        {"name": "nvidia.com/gpu", "nominalQuota": 4, "borrowingLimit": 0}]
    assert nlp["resourceGroups"][1]["flavors"][0]["resources"] == [
        {"name": "nvidia.com/gpu", "nominalQuota": 4}]
    # 64 CPUs: nlp's share 21.333 is under its 32; it may borrow up to its quota.
    (cpu, memory) = nlp["resourceGroups"][0]["flavors"][0]["resources"]
    assert cpu == {"name": "cpu", "nominalQuota": "21333m", "borrowingLimit": "10667m"}
    assert memory["nominalQuota"] == f"{21333 * 4096 // 1000}Mi"
    assert cpu_group["flavors"][0]["resources"][0] == {"name": "cpu", "nominalQuota": "42667m"}
    assert vision["namespaceSelector"] == {"matchLabels": {
        "kubernetes.io/metadata.name": "vision"}}
    local = rendered["teams/nlp/localqueue.yaml"]
    assert (local["metadata"]["namespace"], local["spec"]["clusterQueue"]) == (
        "nlp", "raydeck-nlp")
    values = sorted(m["value"] for m in rendered.values()
                    if m["kind"] == "WorkloadPriorityClass")
    assert values == list(range(kueue.DEFAULT_TOP_PRIORITY + 1))  # nlp has no max_priority
    for path in ("rayjob.yaml", "rayservice.yaml"):
        metadata = rendered[path]["metadata"]
        assert metadata["namespace"] == "vision"
        assert metadata["labels"][kueue.QUEUE_LABEL] == kueue.LOCAL_QUEUE
        assert metadata["labels"][kueue.PRIORITY_CLASS_LABEL] == "raydeck-priority-3"
    job = rendered["rayjob.yaml"]["spec"]
    assert "clusterSelector" not in job and job["shutdownAfterJobFinishes"] is True
    # cpu-2 (2 workers of 1 CPU) is one 4-CPU pod; a fixed size: no autoscaling.
    assert job["rayClusterSpec"]["enableInTreeAutoscaling"] is False
    (group,) = job["rayClusterSpec"]["workerGroupSpecs"]
    assert (group["groupName"], group["minReplicas"], group["maxReplicas"]) == ("cpu", 1, 1)
    assert kueue.ELASTIC_ANNOTATION not in rendered["rayjob.yaml"]["metadata"].get(
        "annotations", {})
    service = rendered["rayservice.yaml"]["spec"]["rayClusterConfig"]
    assert service["enableInTreeAutoscaling"] is False
    cluster = rendered["teams/vision/raycluster.yaml"]
    assert cluster["metadata"]["labels"][kueue.QUEUE_LABEL] == kueue.LOCAL_QUEUE
    assert cluster["metadata"]["annotations"] == {kueue.ELASTIC_ANNOTATION: "true"}


def test_an_elastic_preset_renders_an_elastic_rayjob() -> None:
    rendered = _render(_options(teams=TEAMS, kueue=True, capacity=CAPACITY),
                       job_preset="gpu-1-4")
    job = rendered["rayjob.yaml"]
    assert job["metadata"]["annotations"] == {"kueue.x-k8s.io/elastic-job": "true"}
    assert kueue.ELASTIC_FEATURE_GATE == "ElasticJobsViaWorkloadSlices"
    spec = job["spec"]["rayClusterSpec"]
    assert spec["enableInTreeAutoscaling"] is True
    (group,) = spec["workerGroupSpecs"]
    assert (group["groupName"], group["replicas"], group["minReplicas"],
            group["maxReplicas"]) == ("gpu", 1, 1, 4)


def test_kueue_options_are_checked() -> None:
    with pytest.raises(ConfigError, match="--kueue needs --teams"):
        _options(kueue=True)
    with pytest.raises(ConfigError, match="team vision may use 0-5"):
        _options(teams=TEAMS, kueue=True, capacity=CAPACITY, team="vision", priority=6)
    with pytest.raises(ConfigError, match="--team 'ops'"):
        _options(teams=TEAMS, team="ops")
    with pytest.raises(ConfigError, match="share the namespace"):
        _options(teams=(TeamSpec("a_b"), TeamSpec("a-b")))
    with pytest.raises(ConfigError, match="CPUS:GPUS"):
        Capacity.parse("64")


# --- Kubernetes auth --------------------------------------------------------------------------
def test_k8s_auth_renders_token_auth_and_who_may_write_each_raycluster() -> None:
    rendered = _render(_options(teams=TEAMS, admins=("root-admin",), auth="k8s"))
    cluster = rendered["teams/vision/raycluster.yaml"]["spec"]
    assert cluster["authOptions"] == {"mode": "token", "enableK8sTokenAuth": True}
    assert "autoscalerOptions" not in cluster  # KubeRay configures the autoscaler's auth
    for template in _pod_templates(rendered["teams/vision/raycluster.yaml"]):
        spec = template["spec"]
        assert spec["serviceAccountName"] == "raydeck-ray"
        assert not [v for v in spec["volumes"] if "secret" in v]  # no shared token
        env = {e["name"]: e.get("value") for e in spec["containers"][0]["env"]}
        assert "RAY_AUTH_TOKEN_PATH" not in env
        assert env[auth.K8S_TOKEN_FILE_ENV] == "/var/run/secrets/ray.io/serviceaccount/token"
    role = rendered["teams/vision/role.yaml"]
    assert role["metadata"]["namespace"] == "vision"
    assert role["rules"] == [{"apiGroups": ["ray.io"], "resources": ["rayclusters"],
                              "resourceNames": ["raydeck"], "verbs": ["ray:write"]}]
    subjects = rendered["teams/vision/rolebinding.yaml"]["subjects"]
    assert {(s["kind"], s["name"]) for s in subjects} == {
        ("ServiceAccount", "raydeck-ray"), ("User", "ana"), ("User", "bo"),
        ("User", "root-admin")}
    # A team without members is open to every authenticated user, as raydeck's queue is.
    assert ("Group", "system:authenticated") in {
        (s["kind"], s["name"]) for s in rendered["teams/nlp/rolebinding.yaml"]["subjects"]}
    authenticator = rendered["auth/clusterrolebinding.yaml"]["subjects"]
    assert {(s["namespace"], s["name"]) for s in authenticator} == {
        ("vision", "raydeck-ray"), ("nlp", "raydeck-ray")}
    # The RayJob on the RayCluster submits as its ServiceAccount; KubeRay refuses Kubernetes
    # auth in a RayService's own cluster, which keeps the shared token.
    submitter = rendered["rayjob.yaml"]["spec"]["submitterPodTemplate"]["spec"]
    assert submitter["serviceAccountName"] == "raydeck-ray" and "volumes" not in submitter
    service = rendered["rayservice.yaml"]["spec"]["rayClusterConfig"]
    assert "authOptions" not in service
    assert [v for v in service["headGroupSpec"]["template"]["spec"]["volumes"] if "secret" in v]
    # Under Kueue the RayJob's own cluster likewise.
    queued = _render(_options(teams=TEAMS, kueue=True, capacity=CAPACITY, auth="k8s"))
    assert "authOptions" not in queued["rayjob.yaml"]["spec"]["rayClusterSpec"]


class _RecordingJobServer(http.server.BaseHTTPRequestHandler):
    """A real HTTP server answering as Ray's job server does to a client's first requests."""

    seen: list[str | None] = []

    def do_GET(self) -> None:
        self.seen.append(self.headers.get("Authorization"))
        import ray

        body = (json.dumps({"version": "4", "ray_version": ray.__version__,
                            "ray_commit": "x"}) if self.path.startswith("/api/version")
                else "[]")
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.end_headers()
        self.wfile.write(body.encode())

    def log_message(self, *args: Any) -> None:
        pass


@pytest.mark.timeout(60)
def test_raydecks_client_sends_the_kubernetes_token_read_for_each_request(tmp_path: Path
                                                                          ) -> None:
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _RecordingJobServer)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        token = tmp_path / "token"
        token.write_text("k8s-token-1\n")
        address = f"http://127.0.0.1:{server.server_address[1]}"
        env = {submission.K8S_TOKEN_FILE_ENV: str(token), "RAY_AUTH_MODE": "token",
               "RAY_AUTH_TOKEN": "the-shared-token", "HOME": str(tmp_path)}
        job_server = submission.JobServer.from_env(address, env)
        job_server.client()
        assert set(_RecordingJobServer.seen) == {"Bearer k8s-token-1"}
        token.write_text("k8s-token-2\n")  # the kubelet rotated it
        assert job_server.headers() == {"Authorization": "Bearer k8s-token-2"}
        token.unlink()
        with pytest.raises(ConfigError, match="RAYDECK_K8S_TOKEN_FILE"):
            submission.JobServer.from_env(address, env)
        assert submission.JobServer.from_env(
            address, {**env, "RAY_AUTH_MODE": "disabled"}).headers() == {}
    finally:
        server.shutdown()
        server.server_close()


# --- the command ------------------------------------------------------------------------------
def test_render_command_with_teams_kueue_and_k8s_auth(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("RAYDECK_STACK_FILE", "")
    (tmp_path / "teams.yaml").write_text(TEAMS_FILE)
    answer = CliRunner().invoke(app, [
        "k8s", "render", "--out", "out", "--teams", "teams.yaml", "--kueue", "--capacity",
        "64:8", "--auth", "k8s", "--team", "vision", "--priority", "2", "--preset", "gpu-1-4",
        "--tracking-uri", CREDENTIALED_TRACKING])
    assert answer.exit_code == 0, answer.output
    assert MLFLOW_PASSWORD not in answer.output
    out = tmp_path / "out"
    written = {str(p.relative_to(out)) for p in out.rglob("*.yaml")}
    assert {"namespaces/vision.yaml", "teams/nlp/localqueue.yaml",
            "kueue/clusterqueue-raydeck-vision.yaml", "auth/clusterrole.yaml",
            "teams/vision/secrets/uri-credentials.yaml", "rayjob.yaml"} <= written
    assert (out / "teams/vision/secrets/uri-credentials.yaml").stat().st_mode & 0o777 == 0o600
    binding = yaml.safe_load((out / "teams/vision/rolebinding.yaml").read_text())
    assert "root-admin" in {s["name"] for s in binding["subjects"]}
    job = yaml.safe_load((out / "rayjob.yaml").read_text())
    assert job["metadata"]["annotations"] == {kueue.ELASTIC_ANNOTATION: "true"}
    for path in out.rglob("*.yaml"):
        _validate(yaml.safe_load(path.read_text()))
    answer = CliRunner().invoke(app, ["k8s", "render", "--out", "x", "--kueue"])
    assert isinstance(answer.exception, ConfigError)
    assert "--kueue needs --teams" in str(answer.exception)
