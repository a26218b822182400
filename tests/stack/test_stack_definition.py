"""`raydeck up` and docker/docker-compose.yml describe one platform: this fails when they drift.

The compose file is parsed as written (YAML anchors merged, nothing interpolated) and compared
with :mod:`raydeck.stack.services` and the environments :mod:`raydeck.stack.launchers` builds:
services, ports, start order, environment variable names, credential names and defaults. Also
the connection file's place in the settings' precedence. No process starts here.
"""

from __future__ import annotations

import re
import stat
from pathlib import Path
from typing import Any

import pytest
import yaml

from raydeck.cluster.node_env import GRPC_FORK_SUPPORT_ENV, NODE_ENV
from raydeck.config import stack_connection as connection
from raydeck.config.secrets import Secret
from raydeck.config.settings import load_settings
from raydeck.config.stack_credentials import SECRET_NAMES, Credentials, load_or_create
from raydeck.stack.launchers import LAUNCHERS, StackContext
from raydeck.stack.processes import free_port
from raydeck.stack.services import (
    MARKER_ENV,
    NOT_LOCAL,
    POSTGRES_DB,
    POSTGRES_USER,
    SERVICES,
)
from raydeck.stack.state import StackPaths, StackState

ROOT = Path(__file__).resolve().parents[2]
COMPOSE = yaml.safe_load((ROOT / "docker" / "docker-compose.yml").read_text())["services"]
COMPOSE_TEXT = (ROOT / "docker" / "docker-compose.yml").read_text()
TWIN = {spec.compose_service: spec.name for spec in SERVICES}


def _context(tmp_path: Path) -> StackContext:
    state = StackState(ports={port.name: port.default for spec in SERVICES
                              for port in spec.ports})
    credentials = Credentials(ray_auth_token=Secret("t"), s3_access_key_id="raydeck",
                              s3_secret_access_key=Secret("s"), postgres_password=Secret("p"),
                              jupyter_token=Secret("j"))
    return StackContext(paths=StackPaths(tmp_path / "stack"), state=state,
                        credentials=credentials, settings=load_settings(env={}),
                        stack_file=tmp_path / "stack.toml")


def _compose_env(name: str) -> set[str]:
    return set((COMPOSE[name].get("environment") or {}).keys())


def test_every_compose_service_runs_locally_or_says_why_not() -> None:
    assert set(TWIN) | set(NOT_LOCAL) == set(COMPOSE)
    assert not set(TWIN) & set(NOT_LOCAL)
    assert [launcher.spec for launcher in LAUNCHERS] == list(SERVICES)


def test_local_ports_are_the_compose_containers_ports() -> None:
    """Each port is where compose's containers listen: in the service's own command, its
    published port, or the address other services use (``postgres:5432``)."""
    for spec in SERVICES:
        service = COMPOSE[spec.compose_service]
        command = " ".join(service.get("command") or [])
        published = {str(port).rsplit(":", 1)[-1] for port in service.get("ports", [])}
        for port in spec.ports:
            number = str(port.default)
            assert (f"{spec.compose_service}:{number}" in COMPOSE_TEXT
                    or re.search(rf"=\s*{number}\b", command) or number in published), (
                f"{spec.name}: port {port.name}={number} is not where compose's "
                f"{spec.compose_service} listens")


def test_free_ports_never_give_one_port_twice() -> None:
    """`ray start` refuses two components on one port; the kernel hands a just-closed port out
    again often enough that 200 plain picks repeat one most of the time (CI saw it)."""
    state = StackState()
    for launcher in LAUNCHERS:
        launcher.choose_internal_ports(state)
    chosen = sorted(state.ports_in_use())
    for _ in range(200):
        chosen.append(free_port(set(chosen)))
    assert len(chosen) == len(set(chosen)) == 200 + sum(
        len(ports) for ports in state.internal_ports.values())


def test_start_order_is_compose_depends_on() -> None:
    for spec in SERVICES:
        depends = set(COMPOSE[spec.compose_service].get("depends_on") or {})
        # storage-init is the s3 service's bucket step locally.
        expected = {TWIN.get(name, "s3" if name == "storage-init" else name) for name in depends}
        assert set(spec.after) == expected, spec.name
    names = [spec.name for spec in SERVICES]
    for spec in SERVICES:
        assert all(names.index(before) < names.index(spec.name) for before in spec.after)


def test_each_service_gets_the_compose_containers_variables(tmp_path: Path) -> None:
    """Same names as compose, except the declared, commented differences in services.py."""
    ctx = _context(tmp_path)
    for launcher in LAUNCHERS:
        spec = launcher.spec
        local = set(launcher.environment(ctx))
        compose = _compose_env(spec.compose_service)
        assert local == (compose - set(spec.compose_env)) | set(spec.local_env), (
            f"{spec.name}: only local {sorted(local - compose - set(spec.local_env))}, only in "
            f"compose {sorted(compose - local - set(spec.compose_env))}")
        assert set(spec.compose_env) <= compose, spec.name
        assert MARKER_ENV not in local


def test_raydeck_processes_get_settings_that_load_and_point_at_the_stack(
    tmp_path: Path
) -> None:
    ctx = _context(tmp_path)
    for launcher in LAUNCHERS:
        env = launcher.environment(ctx)
        if "RAYDECK_TRACKING_URI" not in env:
            continue
        settings = load_settings(env={k: v for k, v in env.items()
                                      if k.startswith("RAYDECK_") and k != "RAYDECK_STACK_FILE"})
        assert settings.tracking.uri == ctx.url("mlflow")
        assert settings.storage.endpoint == ctx.url("s3")
        assert settings.storage.secret_access_key.reveal() == "s"
        assert env["RAY_AUTH_MODE"] == "token"


def test_the_head_serves_through_haproxy_unless_the_shell_says_not(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Compose's ``${RAY_SERVE_ENABLE_HA_PROXY:-1}``: HAProxy (this venv has its binary), the
    shell's value kept though `up` drops the shell's other RAY_* variables, and HAProxy's ports
    the stack's own, chosen once with its other ports."""
    from raydeck.cluster.serve_ingress import HAPROXY_ENV, HAPROXY_PORT_ENVS

    (head,) = [launcher for launcher in LAUNCHERS if launcher.spec.name == "ray-head"]
    ctx = _context(tmp_path)
    monkeypatch.delenv(HAPROXY_ENV, raising=False)
    head.choose_internal_ports(ctx.state)
    env = head.environment(ctx)
    assert env[HAPROXY_ENV] == "1"
    internal = ctx.state.internal_ports["ray-head"]
    assert [int(env[name]) for name in HAPROXY_PORT_ENVS] == [
        internal[name] for name in head.haproxy_port_names]
    assert not any(name in arg for name in head.haproxy_port_names for arg in head.argv(ctx))
    monkeypatch.setenv(HAPROXY_ENV, "0")
    assert head.environment(ctx)[HAPROXY_ENV] == "0"
    assert COMPOSE["ray-head"]["environment"][HAPROXY_ENV] == "${RAY_SERVE_ENABLE_HA_PROXY:-1}"


def test_credentials_are_compose_secrets_and_postgres_defaults_match() -> None:
    required = set(re.findall(r"\$\{(\w+):\?", COMPOSE_TEXT))
    secrets = {name for name in required if re.search(r"PASSWORD|SECRET|TOKEN", name)}
    assert secrets - set(SECRET_NAMES) == {"GRAFANA_ADMIN_PASSWORD"}  # no local Grafana
    assert set(SECRET_NAMES) <= secrets
    assert f"${{POSTGRES_USER:-{POSTGRES_USER}}}" in COMPOSE_TEXT
    assert f"${{POSTGRES_DB:-{POSTGRES_DB}}}" in COMPOSE_TEXT


def test_credentials_file_is_private_and_stable(tmp_path: Path) -> None:
    path = tmp_path / "credentials.env"
    first = load_or_create(path)
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert set(re.findall(r"^(\w+)=", path.read_text(), re.M)) == {
        *SECRET_NAMES, "RAYDECK_S3_ACCESS_KEY_ID"}
    path.chmod(0o644)
    assert load_or_create(path) == first  # read again, not regenerated
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    secret = first.s3_secret_access_key.reveal()
    assert secret not in repr(first) and first.mask(f"key={secret}!") == "key=********!"


@pytest.fixture
def stack_file(tmp_path: Path) -> dict[str, Any]:
    credentials = load_or_create(tmp_path / "credentials.env")
    path = tmp_path / "stack.toml"
    connection.StackConnection(
        state_dir=tmp_path, credentials_file=tmp_path / "credentials.env",
        ray_auth_token_file=tmp_path / "ray_auth_token", ray_address="127.0.0.1:16379",
        job_server="http://127.0.0.1:18265", urls={"mlflow": "http://127.0.0.1:15000"},
        settings={"data_dir": str(tmp_path / "data"), "ray_address": "127.0.0.1:16379",
                  "tracking": {"uri": "http://127.0.0.1:15000"},
                  "storage": {"endpoint": "http://127.0.0.1:19000",
                              "access_key_id": "raydeck", "prefix": "stack"}},
    ).write(path)
    (tmp_path / "ray_auth_token").write_text(credentials.ray_auth_token.reveal())
    return {"RAYDECK_STACK_FILE": str(path), "secret": credentials.s3_secret_access_key,
            "token": credentials.ray_auth_token, "path": path}


def test_connection_file_is_the_lowest_precedence(
    stack_file: dict[str, Any], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    env = {"RAYDECK_STACK_FILE": stack_file["RAYDECK_STACK_FILE"]}
    assert stat.S_IMODE(stack_file["path"].stat().st_mode) == 0o600
    assert stack_file["secret"].reveal() not in stack_file["path"].read_text()

    settings = load_settings(env=env)
    assert settings.tracking.uri == "http://127.0.0.1:15000"
    assert settings.ray_address == "127.0.0.1:16379"
    assert settings.data_dir == (tmp_path / "data").resolve()
    assert settings.storage.endpoint == "http://127.0.0.1:19000"
    assert settings.storage.secret_access_key == stack_file["secret"]  # from credentials.env
    assert settings.storage.artifacts_bucket == "mlflow" and settings.storage.prefix == "stack"

    (tmp_path / "raydeck.toml").write_text('[storage]\nprefix = "mine"\n')
    assert load_settings(env=env).storage.prefix == "mine"  # raydeck.toml wins
    over = load_settings(env={**env, "RAYDECK_TRACKING_URI": "http://elsewhere:5000",
                              "RAY_ADDRESS": "10.0.0.1:6379"})
    assert over.tracking.uri == "http://elsewhere:5000"  # the environment wins
    assert over.ray_address == ""  # RAY_ADDRESS is Ray's own: the stack's address steps back
    # MLFLOW_TRACKING_URI is MLflow's own: the stack's tracking URI steps back the same way.
    mlflow = load_settings(env={**env, "MLFLOW_TRACKING_URI": "http://company-mlflow:5000"})
    assert mlflow.tracking.uri == "http://company-mlflow:5000"
    assert mlflow.storage.endpoint == "http://127.0.0.1:19000"  # the rest of the stack stays
    # raydeck:// names raydeck's configured backend, this stack's: not the embedded SQLite.
    for uri in ("raydeck://", "raydeck:///", " raydeck:// "):
        assert load_settings(env={**env, "MLFLOW_TRACKING_URI": uri}).tracking.uri \
            == "http://127.0.0.1:15000", uri
    # raydeck+<backend> names that backend, over the stack's, as any MLflow URI does.
    wrapped = load_settings(env={**env, "MLFLOW_TRACKING_URI": "raydeck+http://other:5000"})
    assert wrapped.tracking.uri == "http://other:5000"
    assert load_settings(env={"RAYDECK_STACK_FILE": ""}).tracking.uri.startswith("sqlite:")


def test_stack_token_goes_only_to_the_stack(stack_file: dict[str, Any]) -> None:
    from raydeck.jobs.submission import JobServer

    env = {"RAYDECK_STACK_FILE": stack_file["RAYDECK_STACK_FILE"], "HOME": "/nonexistent"}
    server = JobServer.from_env(env=env)
    assert server.address == "http://127.0.0.1:18265" and server.token == stack_file["token"]
    assert JobServer.from_env("http://other:8265", env=env).token is None
    assert connection.ray_auth_env("127.0.0.1:16379", env)["RAY_AUTH_MODE"] == "token"
    assert connection.ray_auth_env("10.0.0.1:6379", env) == {}
    assert connection.ray_auth_env("127.0.0.1:16379", {**env, "RAY_AUTH_MODE": "disabled"}) == {}


def test_config_command_masks_the_stacks_secret(stack_file: dict[str, Any], tmp_path: Path
                                                ) -> None:
    import subprocess
    import sys

    answer = subprocess.run([sys.executable, "-m", "raydeck.cli", "config"], capture_output=True,
                            text=True, timeout=120, cwd=tmp_path,
                            env={"PATH": "/usr/bin:/bin", "HOME": str(tmp_path),
                                 "RAYDECK_STACK_FILE": stack_file["RAYDECK_STACK_FILE"],
                                 "COLUMNS": "200"})
    assert answer.returncode == 0, answer.stderr
    assert "http://127.0.0.1:15000" in answer.stdout and "(set)" in answer.stdout
    assert stack_file["secret"].reveal() not in answer.stdout + answer.stderr
    # `raydeck config` with MLFLOW_TRACKING_URI=raydeck:// shows the same backend, the stack's.
    plugin = subprocess.run([sys.executable, "-m", "raydeck.cli", "config"],
                            capture_output=True, text=True, timeout=120, cwd=tmp_path,
                            env={"PATH": "/usr/bin:/bin", "HOME": str(tmp_path),
                                 "RAYDECK_STACK_FILE": stack_file["RAYDECK_STACK_FILE"],
                                 "MLFLOW_TRACKING_URI": "raydeck://", "COLUMNS": "200"})
    assert plugin.returncode == 0, plugin.stderr
    assert "http://127.0.0.1:15000" in plugin.stdout and "sqlite" not in plugin.stdout


def test_the_head_carries_the_variables_of_every_ray_node(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """gRPC's fork handlers off on `up`'s head and compose's nodes, as on every node raydeck
    starts (:mod:`raydeck.cluster.node_env`)."""
    (head,) = [launcher for launcher in LAUNCHERS if launcher.spec.name == "ray-head"]
    monkeypatch.delenv(GRPC_FORK_SUPPORT_ENV, raising=False)
    env = head.environment(_context(tmp_path))
    assert {name: env[name] for name in NODE_ENV} == dict(NODE_ENV)
    for node in ("ray-head", "ray-worker"):
        assert str(COMPOSE[node]["environment"][GRPC_FORK_SUPPORT_ENV]) == "0"
