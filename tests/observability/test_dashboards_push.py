"""`raydeck dashboards push`, checked against the Grafana HTTP API *contract* only.

No Grafana server can be installed here. ``GrafanaContractDouble`` below is NOT Grafana: it is a
recorder that answers the documented endpoints push uses (datasources by uid, folders,
``POST /api/dashboards/db``) with the documented status codes, so these tests verify what
raydeck *sends* (paths, methods, auth header, payload shape, idempotence, error handling).
They do not verify that a real Grafana accepts and renders the dashboards; the compose stack's
Grafana is that end-to-end check.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest

from raydeck.config.secrets import Secret
from raydeck.errors import MonitoringError
from raydeck.observability.dashboards import load_dashboards
from raydeck.observability.grafana import (
    DATASOURCE_UID,
    FOLDER_UID,
    RAY_FOLDER_UID,
    push,
    ray_dashboards,
)
from tests.cli.test_cli import _one_error_line, _raydeck
from tests.fixtures.processes import free_port
from tests.fixtures.prometheus import DASHBOARDS_DIR

pytestmark = pytest.mark.timeout(120)

TOKEN = "glsa_contract-test-token-0123456789"


class GrafanaContractDouble:
    """Records requests and answers Grafana's documented API shapes. Not a Grafana."""

    def __init__(self, token: str) -> None:
        self.token = token
        self.requests: list[dict[str, Any]] = []
        self.datasources: dict[str, dict[str, Any]] = {}
        self.folders: dict[str, dict[str, Any]] = {}
        self.dashboards: dict[str, dict[str, Any]] = {}
        double = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args: Any) -> None:
                return None

            def do_GET(self) -> None:
                double.answer(self, "GET")

            def do_POST(self) -> None:
                double.answer(self, "POST")

            def do_PUT(self) -> None:
                double.answer(self, "PUT")

        self.server = ThreadingHTTPServer(("127.0.0.1", free_port()), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    def answer(self, handler: BaseHTTPRequestHandler, method: str) -> None:
        length = int(handler.headers.get("Content-Length") or 0)
        raw = handler.rfile.read(length) if length else b""
        body = json.loads(raw) if raw else None
        self.requests.append({"method": method, "path": handler.path, "body": body, "raw": raw,
                              "auth": handler.headers.get("Authorization", "")})
        if handler.headers.get("Authorization") != f"Bearer {self.token}":
            return self._send(handler, 401, {"message": "invalid API key"})
        status, answer = self.route(method, handler.path, body)
        self._send(handler, status, answer)

    def route(self, method: str, path: str, body: Any) -> tuple[int, dict[str, Any]]:
        if path.startswith("/api/datasources/uid/"):
            uid = path.rsplit("/", 1)[1]
            if uid not in self.datasources:
                return 404, {"message": "Data source not found"}
            if method == "PUT":
                self.datasources[uid] = body
                return 200, {"message": "Datasource updated", "datasource": body}
            return 200, self.datasources[uid]
        if path == "/api/datasources" and method == "POST":
            if body["uid"] in self.datasources:
                return 409, {"message": "data source with the same uid already exists"}
            self.datasources[body["uid"]] = body
            return 200, {"message": "Datasource added", "datasource": body}
        if path.startswith("/api/folders/") and method == "GET":
            uid = path.rsplit("/", 1)[1]
            if uid not in self.folders:
                return 404, {"message": "folder not found"}
            return 200, self.folders[uid]
        if path == "/api/folders" and method == "POST":
            if body["uid"] in self.folders:
                return 409, {"message": "a folder with the same uid already exists"}
            self.folders[body["uid"]] = body
            return 200, body
        if path == "/api/dashboards/db" and method == "POST":
            dashboard = body["dashboard"]
            if body.get("folderUid") not in self.folders:
                return 400, {"message": "folder not found"}
            if dashboard["uid"] in self.dashboards and not body.get("overwrite"):
                return 412, {"status": "version-mismatch"}
            previous = self.dashboards.get(dashboard["uid"], {}).get("version", 0)
            self.dashboards[dashboard["uid"]] = {**body, "version": previous + 1}
            return 200, {"status": "success", "uid": dashboard["uid"], "version": previous + 1,
                         "url": f"/d/{dashboard['uid']}/slug"}
        return 404, {"message": f"no route {method} {path}"}

    @staticmethod
    def _send(handler: BaseHTTPRequestHandler, status: int, answer: dict[str, Any]) -> None:
        data = json.dumps(answer).encode()
        handler.send_response(status)
        handler.send_header("Content-Type", "application/json")
        handler.send_header("Content-Length", str(len(data)))
        handler.end_headers()
        handler.wfile.write(data)


@pytest.fixture
def grafana() -> Iterator[GrafanaContractDouble]:
    double = GrafanaContractDouble(TOKEN)
    double.thread.start()
    yield double
    double.server.shutdown()
    double.server.server_close()


def _rendered() -> list[dict[str, Any]]:
    return [d.render() for d in load_dashboards(DASHBOARDS_DIR)]


def test_push_creates_datasource_folders_and_dashboards_with_stable_uids(
        grafana: GrafanaContractDouble) -> None:
    ray = ray_dashboards()
    result = push(grafana.url, Secret(TOKEN), _rendered(), prometheus_url="http://prom:9090",
                  ray=ray)
    assert result.datasource == "created"
    datasource = grafana.datasources[DATASOURCE_UID]
    assert datasource["type"] == "prometheus" and datasource["url"] == "http://prom:9090"
    assert datasource["access"] == "proxy"
    assert set(grafana.folders) == {FOLDER_UID, RAY_FOLDER_UID}
    ours = {d.uid for d in load_dashboards(DASHBOARDS_DIR)}
    assert ours | {d["uid"] for d in ray} == set(grafana.dashboards)
    for uid, body in grafana.dashboards.items():
        assert body["overwrite"] is True
        assert body["folderUid"] == (FOLDER_UID if uid in ours else RAY_FOLDER_UID)
        assert body["dashboard"]["id"] is None and body["dashboard"]["uid"] == uid
    assert len(result.dashboards) == len(grafana.dashboards)


def test_push_twice_updates_in_place(grafana: GrafanaContractDouble) -> None:
    push(grafana.url, Secret(TOKEN), _rendered(), prometheus_url="http://prom:9090")
    first = len(grafana.requests)
    result = push(grafana.url, Secret(TOKEN), _rendered(), prometheus_url="http://prom:9091")
    second = grafana.requests[first:]
    assert result.datasource == "updated"
    assert grafana.datasources[DATASOURCE_UID]["url"] == "http://prom:9091"
    assert not [r for r in second if r["method"] == "POST" and r["path"] != "/api/dashboards/db"]
    assert [r["method"] for r in second if "datasources" in r["path"]] == ["GET", "PUT"]
    assert {d["version"] for d in grafana.dashboards.values()} == {2}


def test_every_request_carries_the_token_only_in_the_authorization_header(
        grafana: GrafanaContractDouble) -> None:
    push(grafana.url, Secret(TOKEN), _rendered(), prometheus_url="http://prom:9090")
    assert grafana.requests
    for request in grafana.requests:
        assert request["path"].startswith("/api/")
        assert request["auth"] == f"Bearer {TOKEN}"
        assert TOKEN.encode() not in request["raw"]
        assert TOKEN not in request["path"]


def test_a_wrong_token_is_one_error_naming_the_fix(grafana: GrafanaContractDouble) -> None:
    with pytest.raises(MonitoringError, match="refused the token") as caught:
        push(grafana.url, Secret("wrong-token-value"), _rendered(),
             prometheus_url="http://prom:9090")
    assert "wrong-token-value" not in str(caught.value)


def test_cli_wrong_token_is_one_line_exit_2_and_never_prints_the_token(
        grafana: GrafanaContractDouble, tmp_path: Path) -> None:
    secret = "glsa_wrong-secret-token-987654321"
    result = _raydeck("dashboards", "push", "--no-ray", "--dir", str(DASHBOARDS_DIR), cwd=tmp_path,
                      env={"GRAFANA_URL": grafana.url, "GRAFANA_TOKEN": secret})
    line = _one_error_line(result)
    assert "GRAFANA_TOKEN" in line
    assert secret not in result.stdout + result.stderr


@pytest.mark.parametrize(("env", "expected"), [
    ({"GRAFANA_TOKEN": TOKEN}, "no Grafana URL"),
    ({"GRAFANA_URL": "grafana:3000", "GRAFANA_TOKEN": TOKEN}, "must look like http://host:port"),
    ({"GRAFANA_URL": "http://127.0.0.1:{port}", "GRAFANA_TOKEN": TOKEN}, "cannot reach Grafana"),
    ({"GRAFANA_URL": "http://127.0.0.1:{port}"}, "no Grafana token"),
])
def test_cli_missing_or_wrong_url_or_token_is_one_line_exit_2(
        tmp_path: Path, env: dict[str, str], expected: str) -> None:
    env = {k: v.format(port=free_port()) for k, v in env.items()}
    result = _raydeck("dashboards", "push", "--no-ray", "--dir", str(DASHBOARDS_DIR), cwd=tmp_path,
                      env=env)
    assert expected in _one_error_line(result)
    assert TOKEN not in result.stdout + result.stderr


def test_check_cli_with_unreachable_prometheus_is_one_line_exit_2(tmp_path: Path) -> None:
    line = _one_error_line(_raydeck(
        "dashboards", "check", "--dir", str(DASHBOARDS_DIR), cwd=tmp_path,
        env={"PROMETHEUS_URL": f"http://127.0.0.1:{free_port()}"}))
    assert "cannot reach Prometheus" in line
