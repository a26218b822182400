"""Serving on real Ray Serve from the real MLflow registry, asserted over real HTTP.

The module trains the digits job once on the session's cluster with ``register_as`` (what
``raydeck demo --register-as`` and the jobs' ``--register-as`` call), then deploys it with the
``raydeck serve`` command in a subprocess, as a user would, on 2 replicas (preset cpu-2) that
check their alias every second. Serve is shut down at the end of the module.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
import uuid
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from raydeck.cluster.serve_ingress import HAPROXY_RETRY_ON
from raydeck.stack.processes import listening
from tests.fixtures.processes import free_port, wait_until
from tests.fixtures.prometheus import DASHBOARDS_DIR, PrometheusServer
from tests.fixtures.summer_model import SUMMER_CODE, register_summer

CLI_TIMEOUT_S = 240
REQUESTS = 1000
FORMATS = ("dataframe_split", "dataframe_records", "instances", "inputs")


@dataclass(frozen=True)
class Served:
    name: str
    run_id: str
    val_accuracy: float
    url: str
    env: dict[str, str]

    @property
    def invocations(self) -> str:
        return f"{self.url}/invocations"


def _cli(*args: str, env: dict[str, str], timeout: float = CLI_TIMEOUT_S
         ) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "raydeck.cli", *args], env=env,
                          capture_output=True, text=True, timeout=timeout)


def _body(form: str, rows: np.ndarray) -> bytes:
    values = rows.tolist()
    columns = [f"pixel_{i}" for i in range(rows.shape[1])]
    payload: Any = {
        "dataframe_split": {"columns": columns, "data": values},
        "dataframe_records": [dict(zip(columns, row, strict=True)) for row in values],
        "instances": values,
        "inputs": values,
    }[form]
    return json.dumps({form: payload}).encode()


def _post(url: str, body: bytes, timeout: float = 30) -> tuple[int, dict[str, str], Any]:
    request = urllib.request.Request(url, data=body, method="POST",
                                     headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=timeout) as answer:
            return answer.status, dict(answer.headers), json.loads(answer.read())
    except urllib.error.HTTPError as error:
        text = error.read()
        try:
            return error.code, dict(error.headers), json.loads(text or b"null")
        except ValueError:  # not raydeck's JSON (Serve's proxy answered), kept as text
            return error.code, dict(error.headers), text.decode(errors="replace")


def _label(form: str, prediction: Any) -> int:
    """The class of one prediction: MLflow writes a tensor-signature model's predictions as
    nested lists for every ``form``."""
    assert isinstance(prediction, list), (form, prediction)
    return int(np.argmax(prediction))


@pytest.fixture(scope="module")
def served(ray_cluster: None, raydeck_env: dict[str, str], mlflow_client: Any
           ) -> Iterator[Served]:
    import ray
    from ray import serve

    from raydeck.examples.digits import run_digits
    from raydeck.models import promote

    name = f"digits-{uuid.uuid4().hex[:6]}"
    run = run_digits(preset="cpu-2", config={"epochs": 8}, run_name="served",
                     register_as=name)
    assert run.registered_model_uri == f"models:/{name}/1"
    promote(mlflow_client.tracking_uri, name, "1", "champion")
    port = free_port()
    env = {**os.environ, "RAYDECK_RAY_ADDRESS": ray.get_runtime_context().gcs_address,
           "COLUMNS": "200"}
    try:
        deployed = _cli("serve", f"models:/{name}@champion", "--preset", "cpu-2", "--port",
                        str(port), "--poll-interval", "1", env=env)
        assert deployed.returncode == 0, deployed.stdout[-3000:] + deployed.stderr[-3000:]
        url = f"http://127.0.0.1:{port}"
        assert f"{url}/invocations" in deployed.stdout and "version 1" in deployed.stdout
        yield Served(name, run.run_id, run.val_accuracy, url, env)
    finally:
        serve.shutdown()


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_the_registered_model_is_self_contained_and_points_to_its_run(
        served: Served, mlflow_client: Any) -> None:
    import mlflow

    from raydeck.examples.digits import raw_split

    version = mlflow_client.get_model_version(served.name, "1")
    run = mlflow_client.get_run(served.run_id)
    assert version.tags["raydeck.run_id"] == served.run_id
    assert version.tags["raydeck.git_commit"] == run.data.tags["mlflow.source.git.commit"]
    assert float(version.tags["raydeck.metric.val_accuracy"]) == pytest.approx(
        served.val_accuracy)
    # Only MLflow's API and raw pixels: the job's scaling is inside the model.
    mlflow.set_tracking_uri(mlflow_client.tracking_uri)
    model = mlflow.pyfunc.load_model(f"models:/{served.name}@champion")
    assert str(model.metadata.get_input_schema()) == "[Tensor('float64', (-1, 64))]"
    _, _, x_val, y_val = raw_split(0)
    accuracy = (np.asarray(model.predict(x_val)).argmax(axis=1) == y_val).mean()
    assert accuracy == pytest.approx(served.val_accuracy, abs=1e-6)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_models_cli_lists_shows_and_promotes(served: Served) -> None:
    listed = _cli("models", "list", env=served.env)
    assert listed.returncode == 0, listed.stderr
    row = next(line for line in listed.stdout.splitlines() if served.name in line)
    assert "@champion -> 1" in row
    shown = _cli("models", "show", served.name, env=served.env)
    assert shown.returncode == 0, shown.stderr
    assert served.run_id in shown.stdout and "val_accuracy" in shown.stdout
    missing = _cli("models", "promote", served.name, "99", env=served.env)
    assert missing.returncode == 2 and len(missing.stderr.strip().splitlines()) == 1
    assert "does not exist" in missing.stderr


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_thousand_requests_in_every_format_score_like_the_run(served: Served) -> None:
    from sklearn.datasets import load_digits

    digits = load_digits()
    x, y = digits.data[:REQUESTS], digits.target[:REQUESTS]

    def one(index: int) -> tuple[str, int, int]:
        form = FORMATS[index % len(FORMATS)]
        status, headers, answer = _post(served.invocations, _body(form, x[index:index + 1]))
        assert status == 200, answer
        assert headers["x-raydeck-model-version"] == "1"
        return form, _label(form, answer["predictions"][0]), int(y[index])

    with ThreadPoolExecutor(8) as pool:
        results = list(pool.map(one, range(REQUESTS)))
    assert len(results) == REQUESTS
    for form in FORMATS:
        hits = [predicted == truth for f, predicted, truth in results if f == form]
        assert len(hits) == REQUESTS // len(FORMATS)
        assert np.mean(hits) >= 0.95, form
    # A batch of rows in one request answers row by row, in order.
    status, _, answer = _post(served.invocations, _body("inputs", x[:50]))
    assert status == 200 and len(answer["predictions"]) == 50
    assert [int(np.argmax(p)) for p in answer["predictions"]] == [r[1] for r in results[:50]]


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_the_serving_pages_curl_example_is_answered_with_its_digit(served: Served) -> None:
    import re

    page = (Path(__file__).resolve().parents[2] / "docs" / "serving.md").read_text()
    body = re.search(r"curl -s http://127.0.0.1:8000/invocations .*?-d '(.*?)'", page, re.S)
    assert body, "docs/serving.md lost its curl example"
    status, _, answer = _post(served.invocations, body.group(1).encode())
    assert status == 200 and int(np.argmax(answer["predictions"][0])) == 0  # load_digits()[0]


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_haproxy_is_the_ingress_of_a_local_ray_raydeck_starts(served: Served) -> None:
    """The session's Ray is started as raydeck's own ``ray.init()`` starts a local one
    (``raydeck.cluster.connection.local_node_variables``), so Serve's ingress is HAProxy: it listens
    on the application's port and sends each request straight to a replica's own HTTP server, on the
    application's host only. Every other test of the module runs through it."""
    import psutil

    port = int(served.url.rsplit(":", 1)[1])
    listeners = [c for c in psutil.net_connections("tcp") if c.status == psutil.CONN_LISTEN]
    ingress = {c.pid: psutil.Process(c.pid) for c in listeners if c.laddr.port == port and c.pid}
    assert {process.name() for process in ingress.values()} == {"haproxy"}, ingress
    # The config HAProxy reads resends a dead replica's requests, POSTs included: it reads a
    # request's body before sending it (raydeck.cluster.serve_ingress.HAPROXY_RETRY_ON).
    command = next(iter(ingress.values())).cmdline()
    config = Path(command[command.index("-f") + 1]).read_text()
    defaults = config.split("\ndefaults\n", 1)[1].split("\nfrontend ", 1)[0].splitlines()
    rendered = f"    retry-on {HAPROXY_RETRY_ON}".splitlines()
    assert defaults[defaults.index(rendered[0]):][:len(rendered)] == rendered, config
    assert "    option http-buffer-request" in rendered
    answered = set()
    for _ in range(8):
        with urllib.request.urlopen(f"{served.url}/health", timeout=10) as answer:
            assert answer.status == 200
            answered.add(json.loads(answer.read())["replica"])
    assert len(answered) == 2  # HAProxy balances over both replicas

    def is_replica(pid: int | None) -> bool:
        try:
            return bool(pid) and " ".join(psutil.Process(pid).cmdline()).startswith(
                f"ray::ServeReplica:{served.name}:")
        except psutil.NoSuchProcess:
            return False

    # Serve's direct-ingress ports (RAY_SERVE_DIRECT_INGRESS_MIN/MAX_HTTP_PORT).
    direct = [c.laddr for c in listeners if 30000 <= c.laddr.port <= 31000 and is_replica(c.pid)]
    assert len(direct) == 2 and {address.ip for address in direct} == {"127.0.0.1"}, direct


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_bad_inputs_get_a_400_naming_the_problem_and_the_server_keeps_serving(
        served: Served) -> None:
    row = [0.0] * 64
    cases = {
        "not JSON": (b"{not json", "not valid JSON"),
        "empty body": (b"", "empty request body"),
        "wrong width": (json.dumps({"inputs": [[1.0, 2.0, 3.0]]}).encode(),
                        "row 0 has 3 values; expected rows of 64 numbers"),
        "strings": (json.dumps({"instances": [["a"] * 64]}).encode(),
                    "row 0, column 0 is 'a' (str)"),
        "no known key": (json.dumps({"rows": [row]}).encode(), "needs exactly one of"),
        "10 MB body": (json.dumps({"inputs": [row] * 40_000}).encode(),
                       "the limit is 8,388,608 bytes (max_request_bytes)"),
        "ragged records": (json.dumps({"dataframe_records": [{"a": 1}, {"b": 2}]}).encode(),
                           "same columns"),
    }
    for what, (body, message) in cases.items():
        status, _, answer = _post(served.invocations, body)
        assert status == 400, (what, status, answer)
        assert answer["error_code"] == "BAD_REQUEST" and message in answer["message"], (
            what, answer)
        assert "Tensor('float64', (-1, 64))" in answer["message"] or what in (
            "not JSON", "empty body", "no known key", "10 MB body", "ragged records"), (
            what, answer)
        ok, _, good = _post(served.invocations, json.dumps({"inputs": [row]}).encode())
        assert ok == 200 and len(good["predictions"]) == 1, what
    with urllib.request.urlopen(f"{served.url}/ping", timeout=10) as ping:
        assert ping.status == 200


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_moving_the_alias_switches_every_replica_without_a_failed_request_and_a_broken_version_is_rolled_back(  # noqa: E501
        served: Served, mlflow_client: Any) -> None:
    from raydeck.models import promote, register_run_model

    uri = mlflow_client.tracking_uri
    answers: list[tuple[int, str]] = []
    stop = threading.Event()
    body = json.dumps({"inputs": [[0.0] * 64]}).encode()

    def client() -> None:
        while not stop.is_set():
            status, headers, _ = _post(served.invocations, body)
            answers.append((status, headers.get("x-raydeck-model-version", "")))

    def last_versions(count: int) -> set[str]:
        return {version for _, version in answers[-count:]}

    sender = threading.Thread(target=client, daemon=True)
    sender.start()
    try:
        wait_until(lambda: len(answers) >= 20, 60, "the client's first answers")
        two = register_run_model(uri, served.run_id, served.name, "val_accuracy")
        promote(uri, served.name, str(two.version), "champion")
        # Both replicas answer (Serve balances between them): 40 answers in a row from "2".
        wait_until(lambda: len(answers) > 40 and last_versions(40) == {"2"}, 90,
                   "every replica to answer with version 2")

        broken = _register_corrupt_version(mlflow_client, served)
        promote(uri, served.name, broken, "champion")
        wait_until(lambda: _rejected_everywhere(served, broken), 90,
                   "both replicas to reject the broken version")
        settled = len(answers)
        wait_until(lambda: len(answers) > settled + 40, 60, "answers after the rejection")
        assert last_versions(len(answers) - settled) == {"2"}
    finally:
        stop.set()
        sender.join(timeout=60)
    failed = [status for status, _ in answers if status != 200]
    assert not failed, f"{len(failed)} of {len(answers)} requests failed"
    print(f"\nalias switch: {len(answers)} requests during two alias moves, 0 failed")

    status = _cli("serve", "status", env=served.env)
    assert status.returncode == 0, status.stderr
    row = next(line for line in status.stdout.splitlines() if served.name in line)
    assert "RUNNING" in row and f"v{broken}" in status.stdout
    # Its own table only: none of Serve's INFO lines (`Started <...LongPollClient object ...>`).
    assert "Started" not in status.stdout + status.stderr, status.stdout + status.stderr


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_replica_sigkilled_under_load_is_replaced_by_one_that_follows_the_alias(
        served: Served, mlflow_client: Any) -> None:
    """After the alias moves above (deployed at version 1, now 2): one of the two replicas is
    SIGKILLed while four clients send requests; the other serves on, Serve starts a
    replacement, and it loads the alias's current version, not the one the application was
    deployed with."""
    import signal

    import ray
    from ray import serve
    from ray.util.state import list_actors

    from raydeck.models import promote

    promote(mlflow_client.tracking_uri, served.name, "2", "champion")
    handle = serve.get_app_handle(served.name)
    gcs_address = ray.get_runtime_context().gcs_address

    def replicas() -> dict[str, dict[str, Any]]:
        """Alive replicas by id, with their pid (a Serve replica's actor name ends in it).
        The session's address: with none, Ray looks for GCS processes and refuses when another
        Ray runs on the machine."""
        return {actor.name.rsplit("#", 1)[-1]: {"pid": actor.pid} for actor in list_actors(
            address=gcs_address, filters=[("state", "=", "ALIVE")], limit=10_000)
            if actor.class_name.startswith(f"ServeReplica:{served.name}:")}

    def describes() -> dict[str, str]:
        states = [handle.describe.remote().result(timeout_s=10) for _ in range(8)]
        return {state["replica"]: state["version"] for state in states}

    answers: list[tuple[float, int, Any]] = []
    stop = threading.Event()
    body = json.dumps({"inputs": [[0.0] * 64]}).encode()

    def client() -> None:
        while not stop.is_set():
            try:
                status, _, answer = _post(served.invocations, body)
            except OSError as error:  # the connection itself failed
                status, answer = 0, repr(error)
            answers.append((time.monotonic(), status, answer))

    before = replicas()
    assert len(before) == 2, before
    victim = next(iter(before))
    senders = [threading.Thread(target=client, daemon=True) for _ in range(4)]
    for sender in senders:
        sender.start()
    try:
        wait_until(lambda: len(answers) >= 40, 60, "the clients' first answers")
        os.kill(before[victim]["pid"], signal.SIGKILL)
        killed_at = time.monotonic()
        new: dict[str, str] = {}

        def replaced_and_serving() -> bool:
            new.update({replica: version for replica, version in describes().items()
                        if replica not in before})
            return bool(new) and len(replicas()) == 2

        wait_until(replaced_and_serving, 180, "a replacement replica to serve")
        serving_s = time.monotonic() - killed_at
        settled = len(answers)
        wait_until(lambda: len(answers) > settled + 40, 60, "answers after the replacement")
    finally:
        stop.set()
        for sender in senders:
            sender.join(timeout=60)
    assert victim not in replicas()
    assert set(new.values()) == {"2"}, new  # the alias's version, not the deployed one (1)
    failed = [(round(at - killed_at, 1), status, str(answer)[:200])
              for at, status, answer in answers if status != 200]
    print(f"\nreplica SIGKILL: {len(answers)} requests from 4 clients, {len(failed)} failed "
          f"({failed[:5]}); the replacement served {serving_s:.1f} s after the kill")
    # The session's Ray serves through HAProxy (tests/conftest.py starts it as raydeck does),
    # which reads each request's body before sending it and resends what the killed replica
    # held to the other one (raydeck.cluster.serve_ingress.HAPROXY_RETRY_ON). Without the body read
    # first HAProxy resent no POST: 6 of 12 kills failed 1-2 requests each (2026-12-05).
    assert not failed, failed


def _register_corrupt_version(mlflow_client: Any, served: Served) -> str:
    """A new version whose weights file is garbage, as a half-uploaded artifact would be."""
    from raydeck.models import register_run_model

    with tempfile.TemporaryDirectory() as tmp:
        local = Path(mlflow_client.download_artifacts(served.run_id, "model", tmp))
        for weights in local.rglob("*.pth"):
            weights.write_bytes(b"not a torch file")
        experiment = mlflow_client.get_run(served.run_id).info.experiment_id
        run_id = mlflow_client.create_run(experiment, run_name="corrupt").info.run_id
        mlflow_client.log_artifacts(run_id, str(local), "model")
        mlflow_client.set_terminated(run_id)
    ref = register_run_model(mlflow_client.tracking_uri, run_id, served.name)
    assert ref.version is not None
    return ref.version


def _rejected_everywhere(served: Served, version: str) -> bool:
    from ray import serve

    handle = serve.get_app_handle(served.name)
    seen = [handle.describe.remote().result(timeout_s=10) for _ in range(8)]
    return all(version in state["rejected"] and state["version"] == "2" for state in seen)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_missing_model_exits_2_with_one_line_and_deploys_nothing(served: Served) -> None:
    from ray import serve

    for uri in (f"models:/{served.name}@nobody", f"models:/{served.name}/99",
                "models:/never-registered/1", f"runs:/{uuid.uuid4().hex}/model",
                "s3://bucket/model"):
        answer = _cli("serve", uri, "--name", "must-not-exist", env=served.env)
        assert answer.returncode == 2, (uri, answer.stdout, answer.stderr)
        lines = answer.stderr.strip().splitlines()
        assert len(lines) == 1 and uri in lines[0], (uri, answer.stderr)
    assert "must-not-exist" not in serve.status().applications


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_config_out_writes_a_serve_config_that_ray_accepts_without_secrets(
        served: Served, tmp_path: Path) -> None:
    import yaml
    from ray.serve.schema import ServeDeploySchema

    from raydeck.serving.app import app_builder

    target = tmp_path / "serve.yaml"
    answer = _cli("serve", f"models:/{served.name}@champion", "--config-out", str(target),
                  "--preset", "cpu-2", "--autoscale", "1:3", "--host", "0.0.0.0", env=served.env)
    assert answer.returncode == 0, answer.stderr
    config = yaml.safe_load(target.read_text())
    ServeDeploySchema.model_validate(config)
    application = config["applications"][0]
    assert application["import_path"] == "raydeck.serving.app:app_builder"
    deployment = application["deployments"][0]
    assert deployment["autoscaling_config"]["max_replicas"] == 3
    assert deployment["ray_actor_options"] == {
        "num_cpus": 1.0, "runtime_env": {"env_vars": {"RAY_ACCEL_ENV_VAR_OVERRIDE_ON_ZERO": "1"}}}
    assert "tracking" not in target.read_text().lower()
    app_builder(application["args"])  # what `serve deploy` imports and calls


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_the_serving_dashboard_has_data_for_every_panel(
        served: Served, prometheus_for_one_test: PrometheusServer) -> None:
    from raydeck.observability.dashboard_check import check
    from raydeck.observability.dashboards import load_dashboards
    from raydeck.observability.metrics import METRICS

    prometheus = prometheus_for_one_test
    dashboard = [d for d in load_dashboards(DASHBOARDS_DIR) if d.uid == "raydeck-serving"]
    started = time.time()
    body = json.dumps({"inputs": [[0.0] * 64]}).encode()

    def every_panel_has_data() -> bool:
        _post(served.invocations, body)
        _post(served.invocations, b"not json")
        results = check(dashboard, prometheus.client, range_s=time.time() - started + 60,
                        rate_interval_s=30)
        assert not [r.error for r in results if r.error]
        return not [r for r in results if not r.series]

    wait_until(every_panel_has_data, 120, "every Serving panel to have data", interval_s=2)
    serving = [m for m in METRICS if m.name.startswith("raydeck_serving_")]
    assert not prometheus.unexported(serving, time.time() - started + 60)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_requests_that_queue_behind_a_prediction_are_predicted_together_next(
        served: Served, mlflow_client: Any, tmp_path: Path) -> None:
    """Adaptive batching, the default (no batch wait): a request that finds its replica idle
    is predicted alone at once; the requests that arrive while it is predicted wait for it and
    are then predicted together, in one call. A second application on the module's Serve, one
    replica of a model whose predict calls are logged and held at a gate."""
    from ray import serve

    code, calls, gate = tmp_path / "summer_model.py", tmp_path / "calls", tmp_path / "gate"
    code.write_text(SUMMER_CODE)
    name = f"gated-{uuid.uuid4().hex[:6]}"
    assert register_summer(mlflow_client.tracking_uri, name, code, tmp_path / "store-down",
                           gated=(calls, gate)) == "1"
    port = served.url.rsplit(":", 1)[1]
    deployed = _cli("serve", f"models:/{name}/1", "--name", name, "--preset", "cpu-1",
                    "--port", port, "--route-prefix", f"/{name}", env=served.env)
    assert deployed.returncode == 0, deployed.stdout[-3000:] + deployed.stderr[-3000:]
    url = f"{served.url}/{name}"

    def predict_calls() -> list[str]:
        return calls.read_text().split() if calls.exists() else []

    def in_batches() -> int:
        with urllib.request.urlopen(f"{url}/health", timeout=10) as answer:
            return int(json.loads(answer.read())["in_batches"])

    seen = len(predict_calls())  # registration and the replica's health check
    gate.touch()
    try:
        with ThreadPoolExecutor(4) as pool:
            first = pool.submit(_post, f"{url}/invocations", b'{"inputs": [[0, 1]]}')
            wait_until(lambda: len(predict_calls()) > seen, 60,
                       "the first request to be predicted")
            behind = [pool.submit(_post, f"{url}/invocations",
                                  json.dumps({"inputs": [[n, 1]]}).encode())
                      for n in (1, 2, 3)]
            wait_until(lambda: in_batches() == 4, 60, "three requests to queue behind it")
            gate.unlink()
            answers = [future.result(timeout=60) for future in (first, *behind)]
    finally:
        gate.unlink(missing_ok=True)
        serve.delete(name)
    assert [(status, body) for status, _, body in answers] == [
        (200, {"predictions": [float(n + 1)]}) for n in range(4)]
    assert predict_calls()[seen:] == ["1", "3"]


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_stop_deletes_the_application(served: Served, raydeck_env: dict[str, str]) -> None:
    """`raydeck serve` deployed it from a config (what lets the queue bound its replicas) that
    names where its settings are, not what they are; `--stop` deletes both."""
    from ray import serve
    from ray.experimental.internal_kv import _internal_kv_exists
    from ray.serve.context import _get_global_client

    from raydeck._internal.contract import KV_NAMESPACE

    client = _get_global_client()
    assert client is not None
    app = client.get_serve_details()["applications"][served.name]
    assert app["source"] == "declarative"
    key = app["deployed_app_config"]["args"]["settings_key"]
    assert key.startswith(f"serve-settings:{served.name}:"), key
    assert _internal_kv_exists(key, namespace=KV_NAMESPACE)
    assert raydeck_env["RAYDECK_TRACKING_URI"] not in json.dumps(app)
    others = set(serve.status().applications) - {served.name}
    stopped = _cli("serve", "--stop", "--name", served.name, env=served.env)
    assert stopped.returncode == 0, stopped.stderr
    assert f"deleted {served.name}" in stopped.stdout
    assert not _internal_kv_exists(key, namespace=KV_NAMESPACE)
    port = int(served.url.rsplit(":", 1)[1])
    if not others:
        # The last application: Serve shut down with it, and so did its HAProxy listener
        # (it answered 404 on the port until the cluster stopped).
        wait_until(lambda: not listening(port), 30, "the application's port to close")
    again = _cli("serve", "--stop", "--name", served.name, env=served.env)
    assert again.returncode == 2 and "no Serve application" in again.stderr


@pytest.mark.slow
@pytest.mark.timeout(500)
def test_serve_deploy_runs_the_written_config_on_a_cluster_of_its_own(
        served: Served, tmp_path: Path, raydeck_env: dict[str, str]) -> None:
    """What README says for clusters: --config-out, then Ray's own `serve deploy`; replicas
    read the tracking URI from their node's environment (the config holds none)."""
    from tests.fixtures.ray_head import RayHead, head_env

    venv_bin = Path(sys.executable).parent
    env = head_env(raydeck_env["RAYDECK_TRACKING_URI"], tmp_path / "data")
    head = RayHead(tmp_path / "head", env).start()
    try:
        port = free_port()
        config = tmp_path / "serve.yaml"
        written = _cli("serve", f"models:/{served.name}/1", "--name", "from-config",
                       "--port", str(port), "--config-out", str(config), env=served.env)
        assert written.returncode == 0, written.stderr
        deployed = subprocess.run(
            [str(venv_bin / "serve"), "deploy", str(config), "--address", head.address],
            env={**env, **head.client_env}, capture_output=True, text=True, timeout=120)
        assert deployed.returncode == 0, deployed.stdout + deployed.stderr
        row = [[0.0] * 64]
        url = f"http://127.0.0.1:{port}/invocations"

        def answers() -> bool:
            try:
                status, headers, _ = _post(url, json.dumps({"inputs": row}).encode(), 5)
            except (OSError, ValueError):  # not up yet: no proxy, or its plain-text 404/503
                return False
            return status == 200 and headers.get("x-raydeck-model-version") == "1"

        wait_until(answers, 240, "the config-deployed application to answer", interval_s=1)
    finally:
        head.stop()
