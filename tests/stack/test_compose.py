"""The compose stack a deployer brings up, as docker-compose resolves docker/docker-compose.yml.

No container runs here (the test machines have no Docker engine): ``docker-compose config``
validates the file, fills in the variables and prints what ``up`` would create, and these tests
assert on that: the services, the one raydeck image, which ports reach the host, where data
persists, start order and health checks, Ray's token auth, raydeck's settings (real registry
names that load), that secrets only come from the environment, that the Prometheus config it
mounts passes ``promtool`` and that the Grafana provisioning it mounts points at what exists.
"""

from __future__ import annotations

import http.client
import importlib.util
import re
import secrets
import shutil
import subprocess
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

import pytest
import yaml

from raydeck.cluster.serve_ingress import HAPROXY_RETRY_ON
from tests.fixtures.processes import ManagedProcess, free_port, http_ok, venv_executable, wait_until

ROOT = Path(__file__).resolve().parents[2]
DOCKER_DIR = ROOT / "docker"
COMPOSE_FILE = DOCKER_DIR / "docker-compose.yml"
GPU_FILE = DOCKER_DIR / "docker-compose.gpu.yml"
ENV_EXAMPLE = DOCKER_DIR / ".env.example"
DOCKERFILE = DOCKER_DIR / "Dockerfile"
COMMAND_TIMEOUT_S = 60
MLFLOW_STARTUP_TIMEOUT_S = 120

pytestmark = pytest.mark.timeout(120)

SERVICES = {"minio", "storage-init", "postgres", "mlflow", "ray-head", "ray-worker", "prometheus",
            "grafana", "jupyter"}
# Services built from docker/Dockerfile, and those of them that run raydeck's own code.
IMAGE_SERVICES = {"storage-init", "mlflow", "ray-head", "ray-worker", "jupyter"}
RAYDECK_SERVICES = {"storage-init", "ray-head", "ray-worker", "jupyter"}
RAY_SERVICES = {"ray-head", "ray-worker", "jupyter"}
# The only ports that reach the host: service -> container port.
PUBLISHED = {"mlflow": 5000, "ray-head": 8265, "grafana": 3000, "jupyter": 8888, "minio": 9001}
SECRETS = {"RAY_AUTH_TOKEN", "RAYDECK_S3_SECRET_ACCESS_KEY", "POSTGRES_PASSWORD",
           "GRAFANA_ADMIN_PASSWORD", "JUPYTER_TOKEN"}
SECRET_KEY = re.compile(r"PASSWORD|SECRET|TOKEN")
VARIABLE = re.compile(r"\$\{(\w+)")


# --- running docker-compose --------------------------------------------------------------------
def _example_values() -> dict[str, str]:
    """``KEY=VALUE`` lines of .env.example (commented-out optional ones are not included)."""
    values = {}
    for line in ENV_EXAMPLE.read_text().splitlines():
        if line.strip() and not line.lstrip().startswith("#"):
            key, _, value = line.partition("=")
            values[key.strip()] = value.strip()
    return values


def _compose(env: dict[str, str], empty_env_file: Path, *files: Path
             ) -> subprocess.CompletedProcess[str]:
    """``docker-compose config`` with exactly ``env``: no docker/.env of a developer leaks in."""
    binary = shutil.which("docker-compose")
    assert binary, "docker-compose is not installed (apt-get install docker-compose)"
    args = [binary, "--env-file", str(empty_env_file)]
    for path in files or (COMPOSE_FILE,):
        args += ["-f", str(path)]
    return subprocess.run([*args, "config"], capture_output=True, text=True,
                          timeout=COMMAND_TIMEOUT_S, env={"PATH": "/usr/bin:/bin", **env})


@pytest.fixture(scope="module")
def empty_env_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("compose") / "empty.env"
    path.write_text("")
    return path


@pytest.fixture(scope="module")
def deploy_env() -> dict[str, str]:
    """What a deployer's docker/.env holds: .env.example with a fresh value for each secret."""
    values = _example_values()
    return {key: value or f"{key.lower()}-{secrets.token_hex(16)}" for key, value in values.items()}


@pytest.fixture(scope="module")
def stack(deploy_env: dict[str, str], empty_env_file: Path) -> dict[str, Any]:
    answer = _compose(deploy_env, empty_env_file)
    assert answer.returncode == 0, answer.stderr
    config: dict[str, Any] = yaml.safe_load(answer.stdout)
    return config


@pytest.fixture(scope="module")
def raw() -> dict[str, Any]:
    """The file as written (YAML anchors merged, nothing interpolated)."""
    document: dict[str, Any] = yaml.safe_load(COMPOSE_FILE.read_text())
    return document


def _service(stack: dict[str, Any], name: str) -> dict[str, Any]:
    service: dict[str, Any] = stack["services"][name]
    return service


def _mounts(service: dict[str, Any]) -> list[tuple[str, str, bool]]:
    """(source, target, read_only) of each volume, in docker-compose 1.x or v2 output form."""
    mounts = []
    for volume in service.get("volumes", []):
        if isinstance(volume, str):
            source, target, *mode = volume.split(":")
            mounts.append((source, target, bool(mode) and "ro" in mode[0].split(",")))
        else:
            mounts.append((volume["source"], volume["target"], bool(volume.get("read_only"))))
    return mounts


def _ports(service: dict[str, Any]) -> list[tuple[str, int, int]]:
    """(host ip, host port, container port) of each published port."""
    ports = []
    for port in service.get("ports", []):
        if isinstance(port, str):
            host_ip, published, target = port.split("/")[0].rsplit(":", 2)
            ports.append((host_ip, int(published), int(target)))
        else:
            ports.append((port.get("host_ip", ""), int(port["published"]), int(port["target"])))
    return ports


def _command(service: dict[str, Any]) -> list[str]:
    command = service["command"]
    return command.split() if isinstance(command, str) else list(command)


# --- the stack ---------------------------------------------------------------------------------
def test_every_service_of_the_stack_is_defined(stack: dict[str, Any]) -> None:
    assert set(stack["services"]) == SERVICES


def test_raydeck_services_run_one_image_built_from_this_repository(stack: dict[str, Any]) -> None:
    images = set()
    for name in IMAGE_SERVICES:
        service = _service(stack, name)
        build = service["build"]
        assert Path(build["context"]) == ROOT, name
        assert build["dockerfile"] == "docker/Dockerfile", name
        images.add((service["image"], tuple(sorted(build["args"].items()))))
    assert len(images) == 1, f"one image for every raydeck service, got {images}"
    ((image, args),) = images
    base_tag = dict(args)["RAY_IMAGE_TAG"]
    assert base_tag == "2.60.0-py311-cpu" and image == f"raydeck:{base_tag}"

    dockerfile = DOCKERFILE.read_text()
    assert f"ARG RAY_IMAGE_TAG={base_tag}\nFROM rayproject/ray:${{RAY_IMAGE_TAG}}" in dockerfile
    assert re.search(r'pip install \. "psycopg\[binary\][^"]*" "boto3[^"]*"', dockerfile)
    ignored = (ROOT / ".dockerignore").read_text().splitlines()
    for source in re.findall(r"^COPY --chown=\S+ (.+) \S+$", dockerfile, re.M):
        for path in source.split():
            assert (ROOT / path).exists(), f"Dockerfile copies {path}, which does not exist"
            assert f"!{path}" in ignored, f".dockerignore leaves {path} out"
    for name in SERVICES - IMAGE_SERVICES:
        image = _service(stack, name)["image"]
        assert re.search(r":[\w.\-]+$", image) and not image.endswith(":latest"), (
            f"{name}: pin the image version ({image})")


def test_only_the_user_interfaces_are_published_and_on_loopback(stack: dict[str, Any]) -> None:
    published = {}
    for name in SERVICES:
        ports = _ports(_service(stack, name))
        if ports:
            published[name] = ports
    assert set(published) == set(PUBLISHED)
    for name, ports in published.items():
        assert ports == [("127.0.0.1", PUBLISHED[name], PUBLISHED[name])], name
    worker = _service(stack, "ray-worker")
    assert "container_name" not in worker, "a container name prevents --scale ray-worker=N"


def test_persistent_data_lives_in_named_volumes(stack: dict[str, Any]) -> None:
    expected = {
        "postgres": "/var/lib/postgresql/data",
        "minio": "/data",
        "grafana": "/var/lib/grafana",
        "prometheus": "/prometheus",
        # The tracking proxy's spool: runs survive a restart of the head.
        "ray-head": _service(stack, "ray-head")["environment"]["RAYDECK_DATA_DIR"],
    }
    for name, target in expected.items():
        sources = [source for source, mount, read_only in _mounts(_service(stack, name))
                   if mount == target and not read_only]
        assert len(sources) == 1, f"{name}: no writable volume at {target}"
        assert sources[0] in stack["volumes"], f"{name}: {target} is not on a named volume"


def test_services_start_in_dependency_order(stack: dict[str, Any]) -> None:
    expected = {
        "storage-init": {"minio": "service_healthy"},
        "mlflow": {"postgres": "service_healthy",
                   "storage-init": "service_completed_successfully"},
        "ray-head": {"mlflow": "service_healthy"},
        "ray-worker": {"ray-head": "service_healthy"},
        "jupyter": {"ray-head": "service_healthy"},
        "prometheus": {"ray-head": "service_started"},
        "grafana": {"prometheus": "service_started"},
    }
    for name in SERVICES:
        depends = _service(stack, name).get("depends_on", {})
        conditions = {dep: spec["condition"] for dep, spec in depends.items()}
        assert conditions == expected.get(name, {}), name
    assert _service(stack, "storage-init")["restart"] == "no"
    assert _command(_service(stack, "storage-init")) == ["raydeck", "storage", "init"]


def test_healthchecks_guard_what_other_services_wait_for(stack: dict[str, Any]) -> None:
    waited_on = {dep for service in stack["services"].values()
                 for dep, spec in service.get("depends_on", {}).items()
                 if spec["condition"] == "service_healthy"}
    assert {"postgres", "minio", "mlflow", "ray-head"} <= waited_on
    for name in waited_on | {"postgres", "minio", "mlflow"}:
        assert _service(stack, name).get("healthcheck", {}).get("test"), name
    probes = {name: " ".join(_service(stack, name)["healthcheck"]["test"])
              for name in ("postgres", "minio", "mlflow", "ray-head")}
    assert "pg_isready" in probes["postgres"]
    assert "mc ready local" in probes["minio"]
    assert "127.0.0.1:5000/health" in probes["mlflow"]
    # Public under token auth, so the probe needs no token.
    assert "127.0.0.1:8265/api/gcs_healthz" in probes["ray-head"]


def test_ray_nodes_and_clients_share_token_auth_and_addresses(
    stack: dict[str, Any], deploy_env: dict[str, str]
) -> None:
    for name in RAY_SERVICES:
        env = _service(stack, name)["environment"]
        assert env["RAY_AUTH_MODE"] == "token", name
        assert env["RAY_AUTH_TOKEN"] == deploy_env["RAY_AUTH_TOKEN"], name
    head = _command(_service(stack, "ray-head"))
    worker = _command(_service(stack, "ray-worker"))
    assert head[:3] == ["ray", "start", "--head"] and "--block" in head
    assert "--dashboard-host=0.0.0.0" in head and "--dashboard-port=8265" in head
    assert "--port=6379" in head and "--address=ray-head:6379" in worker and "--block" in worker
    # A fixed metrics port on every node (Prometheus finds them through the head's discovery).
    assert "--metrics-export-port=8080" in head and "--metrics-export-port=8080" in worker
    jupyter = _service(stack, "jupyter")["environment"]
    assert "--ray-client-server-port=10001" in head
    assert jupyter["RAY_ADDRESS"] == jupyter["RAYDECK_RAY_ADDRESS"] == "ray://ray-head:10001"
    assert jupyter["RAY_API_SERVER_ADDRESS"] == "http://ray-head:8265"


def test_every_ray_node_serves_through_haproxy_unless_docker_env_says_not(
    stack: dict[str, Any], deploy_env: dict[str, str], empty_env_file: Path
) -> None:
    """Serve reads RAY_SERVE_ENABLE_HA_PROXY when its controller and proxies start, on any
    node: every Ray node has it (HAProxy, which the image's ray[serve] brings), Jupyter (a Ray
    Client, no node) does not; RAY_SERVE_ENABLE_HA_PROXY=0 in docker/.env keeps Serve's proxy."""
    for name in ("ray-head", "ray-worker"):
        environment = _service(stack, name)["environment"]
        assert environment["RAY_SERVE_ENABLE_HA_PROXY"] == "1", name
        # A dead replica's requests go to another, POSTs included (the value Ray starts HAProxy
        # with where raydeck starts Ray: raydeck.cluster.serve_ingress.HAPROXY_RETRY_ON).
        assert environment["RAY_SERVE_HAPROXY_RETRY_ON"] == HAPROXY_RETRY_ON, name
    assert "RAY_SERVE_ENABLE_HA_PROXY" not in _service(stack, "jupyter")["environment"]
    answer = _compose({**deploy_env, "RAY_SERVE_ENABLE_HA_PROXY": "0"}, empty_env_file)
    assert answer.returncode == 0, answer.stderr
    opted_out = yaml.safe_load(answer.stdout)
    for name in ("ray-head", "ray-worker"):
        assert _service(opted_out, name)["environment"]["RAY_SERVE_ENABLE_HA_PROXY"] == "0"


def test_raydeck_settings_are_registry_names_and_load_in_every_raydeck_service(
    stack: dict[str, Any], monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    from raydeck.config.settings import load_settings, settings_reference

    known = {row[0] for row in settings_reference()}
    for path in (COMPOSE_FILE, ENV_EXAMPLE, GPU_FILE):
        # Every name, in values, keys and comments alike (a glob such as RAYDECK_S3_* aside).
        used = set(re.findall(r"\bRAYDECK_\w+\b(?!\*)", path.read_text()))
        assert used <= known, f"{path.name}: not raydeck settings: {sorted(used - known)}"

    monkeypatch.chdir(tmp_path)  # no raydeck.toml of this checkout
    data_dirs = set()
    for name in RAYDECK_SERVICES:
        env = {k: str(v) for k, v in _service(stack, name)["environment"].items()}
        settings = load_settings(env=env)
        assert settings.tracking.uri == "http://mlflow:5000", name
        assert settings.storage.endpoint == "http://minio:9000", name
        assert settings.storage.secret_access_key, f"{name}: the S3 secret key is missing"
        data_dirs.add(settings.data_dir)
    # The tracking proxy on the head writes its spool under the driver's data dir.
    assert len(data_dirs) == 1


def test_ray_nodes_provide_every_variable_the_cluster_runtime_envs_read(
    stack: dict[str, Any]
) -> None:
    for runtime_env in ("cpu.yaml", "gpu.yaml"):
        env_vars = yaml.safe_load((ROOT / "runtime_envs" / runtime_env).read_text())["env_vars"]
        wanted = {m for value in env_vars.values() for m in VARIABLE.findall(str(value))}
        for name in ("ray-head", "ray-worker"):
            missing = wanted - set(_service(stack, name)["environment"])
            assert not missing, f"{name} lacks {sorted(missing)} that {runtime_env} reads"


def test_mlflow_accepts_the_host_name_the_other_services_call_it_by(
    stack: dict[str, Any], tmp_path: Path
) -> None:
    """MLflow answers 403 to Host headers outside its allow-list (by default: localhost and
    private IPs, not a compose service name). A real ``mlflow server`` with the compose file's
    MLFLOW_* settings must accept ``mlflow:5000``, the host of every RAYDECK_TRACKING_URI."""
    hosts = {urlparse(_service(stack, name)["environment"]["RAYDECK_TRACKING_URI"]).netloc
             for name in RAYDECK_SERVICES}
    assert hosts == {"mlflow:5000"}
    env = {key: str(value) for key, value in _service(stack, "mlflow")["environment"].items()
           if key.startswith("MLFLOW_SERVER_")}
    port = free_port()
    server = ManagedProcess(
        [venv_executable("mlflow"), "server", f"--backend-store-uri=sqlite:///{tmp_path}/m.db",
         "--host=127.0.0.1", f"--port={port}", "--workers=1"],
        log_path=tmp_path / "mlflow.log", env=env).start()

    def status(host: str) -> int:
        connection = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
        try:
            connection.request("GET", "/api/2.0/mlflow/experiments/search?max_results=1",
                               headers={"Host": host})
            return connection.getresponse().status
        finally:
            connection.close()

    try:
        wait_until(lambda: http_ok(f"http://127.0.0.1:{port}/health"), MLFLOW_STARTUP_TIMEOUT_S,
                   "mlflow server")
        assert status("mlflow:5000") == 200
        assert status(f"localhost:{port}") == 200  # a browser on the published port
        assert status("elsewhere.example:5000") == 403  # the protection stays on
    finally:
        server.stop()


# --- secrets -----------------------------------------------------------------------------------
def test_secrets_come_only_from_the_environment(
    raw: dict[str, Any], stack: dict[str, Any], deploy_env: dict[str, str]
) -> None:
    for name, service in raw["services"].items():
        for key, value in (service.get("environment") or {}).items():
            if SECRET_KEY.search(key) and key != "RAY_AUTH_MODE":
                assert re.fullmatch(r"\$\{(\w+):\?[^}]+\}", str(value)), (
                    f"{name}: {key} must be a required variable (${{VAR:?message}}), not {value!r}")
    empty = {key for key, value in _example_values().items() if not value}
    assert empty == SECRETS, ".env.example must leave exactly the secrets empty"

    def where(node: Any, path: tuple[str, ...]) -> list[tuple[str, ...]]:
        if isinstance(node, dict):
            return [p for key, value in node.items() for p in where(value, (*path, str(key)))]
        if isinstance(node, list):
            return [p for item in node for p in where(item, path)]
        return [path] if any(value in str(node) for value in secret_values) else []

    secret_values = {deploy_env[name] for name in SECRETS}
    for path in where(stack["services"], ()):
        assert path[1] == "environment", f"a secret reaches {'.'.join(path)}"


@pytest.mark.parametrize("secret", sorted(SECRETS))
def test_missing_secret_stops_compose_naming_it(
    secret: str, deploy_env: dict[str, str], empty_env_file: Path
) -> None:
    for env in ({k: v for k, v in deploy_env.items() if k != secret}, {**deploy_env, secret: ""}):
        answer = _compose(env, empty_env_file)
        assert answer.returncode != 0
        assert f"set {secret} in docker/.env" in answer.stderr, answer.stderr


def test_env_example_lists_every_variable_the_compose_files_read() -> None:
    listed = set(re.findall(r"^#?(\w+)=", ENV_EXAMPLE.read_text(), re.M))
    for path in (COMPOSE_FILE, GPU_FILE):
        # $${NAME} is the container's own variable (escaped), not one compose fills in.
        read = set(re.findall(r"(?<!\$)\$\{(\w+)", path.read_text()))
        assert read <= listed, f".env.example does not mention {sorted(read - listed)}"


# --- Prometheus and Grafana --------------------------------------------------------------------
def _render_module() -> Any:
    spec = importlib.util.spec_from_file_location("render_prometheus",
                                                  DOCKER_DIR / "render_prometheus.py")
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_prometheus_config_is_the_current_render() -> None:
    module = _render_module()
    assert module.main(["--check"]) == 0, "run: python docker/render_prometheus.py"


def test_prometheus_config_as_mounted_passes_promtool(
    stack: dict[str, Any], tmp_path: Path
) -> None:
    """Every path the config names is a mount of the prometheus service; with the mounts
    replaced by their sources (named volumes by empty folders), promtool accepts the config,
    rule files included."""
    mounts = _mounts(_service(stack, "prometheus"))
    targets = {target: source for source, target, _ in mounts}
    config_source = Path(targets["/etc/prometheus/prometheus.yml"])
    assert config_source == DOCKER_DIR / "prometheus.yml"
    config = yaml.safe_load(config_source.read_text())
    volumes_in_head = {source: target for source, target, _ in _mounts(_service(stack, "ray-head"))}
    assert targets["/tmp/ray"] in volumes_in_head and volumes_in_head[targets["/tmp/ray"]] == (
        "/tmp/ray"), "Prometheus must see the head's Ray temp dir at the same path"
    [discovery] = config["scrape_configs"][0]["file_sd_configs"][0]["files"]
    assert discovery.startswith("/tmp/ray/")

    def on_host(container_path: str) -> str:
        for target, source in targets.items():
            if container_path == target or container_path.startswith(target + "/"):
                base = Path(source) if source.startswith("/") else tmp_path / "volumes" / source
                return str(base / Path(container_path).relative_to(target))
        raise AssertionError(f"{container_path} is not mounted into the prometheus service")

    rules = [on_host(path) for path in config["rule_files"]]
    assert rules == [str(ROOT / "dashboards" / "alerts" / "raydeck.rules.yml")]
    config["rule_files"] = rules
    config["scrape_configs"][0]["file_sd_configs"][0]["files"] = [on_host(discovery)]
    Path(on_host(discovery)).parent.mkdir(parents=True)
    Path(on_host(discovery)).write_text('[{"labels": {"job": "ray"}, "targets": '
                                        '["172.18.0.5:8080", "172.18.0.5:44217"]}]')
    mapped = tmp_path / "prometheus.yml"
    mapped.write_text(yaml.safe_dump(config))
    promtool = shutil.which("promtool")
    assert promtool, "promtool is not installed (apt-get install prometheus)"
    answer = subprocess.run([promtool, "check", "config", str(mapped)], capture_output=True,
                            text=True, timeout=COMMAND_TIMEOUT_S)
    assert answer.returncode == 0, answer.stdout + answer.stderr
    assert "SUCCESS" in answer.stdout + answer.stderr


def test_grafana_mounts_the_provisioning_and_the_dashboards_it_names(
    stack: dict[str, Any]
) -> None:
    from raydeck.observability.grafana import (
        GRAFANA_DASHBOARDS_PATH,
        GRAFANA_PROMETHEUS_URL,
        GRAFANA_RAY_DASHBOARDS_PATH,
    )

    grafana = _service(stack, "grafana")
    mounts = {target: source for source, target, _ in _mounts(grafana)}
    for target, source in mounts.items():
        if source.startswith("/"):
            assert Path(source).is_dir() and Path(source).is_relative_to(ROOT), (target, source)
    for kind in ("datasources", "dashboards"):
        provisioning = Path(mounts[f"/etc/grafana/provisioning/{kind}"])
        assert provisioning == ROOT / "dashboards" / "provisioning" / kind
        assert list(provisioning.glob("*.yml")), f"no provisioning files in {provisioning}"

    providers = yaml.safe_load(
        (ROOT / "dashboards/provisioning/dashboards/raydeck.yml").read_text())["providers"]
    paths = {provider["options"]["path"] for provider in providers}
    assert paths == {GRAFANA_DASHBOARDS_PATH, GRAFANA_RAY_DASHBOARDS_PATH}
    raydeck_json = Path(mounts[GRAFANA_DASHBOARDS_PATH])
    assert raydeck_json == ROOT / "dashboards" / "grafana" and list(raydeck_json.glob("*.json"))
    # Ray writes its dashboards into its session dir on the head: the same volume, same path.
    ray_volume = mounts["/tmp/ray"]
    assert GRAFANA_RAY_DASHBOARDS_PATH.startswith("/tmp/ray/")
    assert (ray_volume, "/tmp/ray", False) in _mounts(_service(stack, "ray-head"))

    datasource = yaml.safe_load(
        (ROOT / "dashboards/provisioning/datasources/raydeck.yml").read_text())["datasources"][0]
    assert datasource["url"] == GRAFANA_PROMETHEUS_URL == "http://prometheus:9090"
    head_env = _service(stack, "ray-head")["environment"]
    assert head_env["RAY_PROMETHEUS_HOST"] == GRAFANA_PROMETHEUS_URL
    assert head_env["RAY_PROMETHEUS_NAME"] == datasource["name"]


def test_gpu_override_gives_workers_the_gpus(
    deploy_env: dict[str, str], empty_env_file: Path
) -> None:
    answer = _compose(deploy_env, empty_env_file, COMPOSE_FILE, GPU_FILE)
    assert answer.returncode == 0, answer.stderr
    worker = yaml.safe_load(answer.stdout)["services"]["ray-worker"]
    [device] = worker["deploy"]["resources"]["reservations"]["devices"]
    assert device["capabilities"] == ["gpu"] and device["driver"] == "nvidia"
