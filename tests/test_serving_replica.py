"""One serving replica's defects, each pinned: bodies that used to answer 500, the size limit
while reading, a version that fails to load for a moment versus one that fails its health check,
and no credential in what a replica says about either.

The replica class (:class:`raydeck.serving.server.ModelServer`) runs in the test process against
the session's real MLflow server and registry, with real models and real Starlette requests;
Serve's HTTP path around it is ``tests/test_serving.py``'s.
"""

from __future__ import annotations

import asyncio
import json
import os
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from raydeck.serving.protocol import InputError, TensorInput, parse_json_object, parse_request
from tests.fixtures.processes import wait_until

EXPECTED = TensorInput(width=2, dtype="float64")


@pytest.mark.parametrize(("body", "says"), [
    (b"[" * 100_000 + b"]" * 100_000, "nested too deeply"),
    (b'{"inputs": [[' + b"9" * 5000 + b', 1]]}', "not valid JSON"),
    (b"[[1, 2]]", "must be an object"),
    (b'"rows"', "must be an object"),
    (b"\xff\xfe", "not valid JSON"),
])
def test_malformed_bodies_are_input_errors_not_crashes(body: bytes, says: str) -> None:
    with pytest.raises(InputError, match=says):
        parse_json_object(body)
    with pytest.raises(InputError, match=says):
        parse_request(body, EXPECTED, 1 << 30)


def test_what_may_pass_is_told_from_what_will_not() -> None:
    from mlflow.exceptions import MlflowException
    from mlflow.protos.databricks_pb2 import RESOURCE_DOES_NOT_EXIST

    from raydeck.serving.server import HealthCheckFailed, is_transient

    assert is_transient(ConnectionRefusedError(111, "refused"))
    assert is_transient(TimeoutError("read timed out"))
    assert is_transient(MlflowException("API request to http://h/x failed: Max retries"))
    assert not is_transient(MlflowException("no such version",
                                            error_code=RESOURCE_DOES_NOT_EXIST))
    assert not is_transient(HealthCheckFailed("predicting its input example gave nan"))
    assert not is_transient(ModuleNotFoundError("No module named 'sklearn'"))


# A pyfunc model whose loading fails while a flag file exists (a store that is down) and whose
# predictions are the rows' sums, or NaN when built to fail its health check.
MODEL_CODE = '''
import os
import numpy as np
import mlflow.pyfunc


class Summer(mlflow.pyfunc.PythonModel):
    def __init__(self, down_flag, broken):
        self.down_flag, self.broken = down_flag, broken

    def load_context(self, context):
        if os.path.exists(self.down_flag):
            raise ConnectionError("artifact store at http://bob:hunter2secret@store:9000 is down")

    def predict(self, context, model_input, params=None):
        rows = np.asarray(model_input, dtype=float)
        return np.full(len(rows), np.nan) if self.broken else rows.sum(axis=1)
'''


def _register(tracking_uri: str, name: str, code: Path, down_flag: Path,
              broken: bool = False) -> str:
    """Register one version of the model in ``code``; its version number."""
    import importlib.util

    import mlflow
    from mlflow.models import infer_signature

    spec = importlib.util.spec_from_file_location("summer_model", code)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    example = np.array([[1.0, 2.0], [3.0, 4.0]])
    mlflow.set_tracking_uri(tracking_uri)
    with mlflow.start_run():
        info = mlflow.pyfunc.log_model(
            name="model", python_model=module.Summer(str(down_flag), broken),
            code_paths=[str(code)], input_example=example,
            signature=infer_signature(example, np.array([3.0, 7.0])),
            registered_model_name=name)
    return str(info.registered_model_version)


def _request(body: bytes | list[bytes], path: str = "/invocations", method: str = "POST") -> Any:
    from starlette.requests import Request

    chunks = [body] if isinstance(body, bytes) else body
    messages = [{"type": "http.request", "body": chunk, "more_body": i < len(chunks) - 1}
                for i, chunk in enumerate(chunks)]

    async def receive() -> dict[str, Any]:
        return messages.pop(0)

    scope = {"type": "http", "method": method, "path": path, "headers": [],
             "query_string": b"", "root_path": ""}
    return Request(scope, receive)


def _call(server: Any, body: bytes | list[bytes], path: str = "/invocations",
          method: str = "POST") -> tuple[int, Any]:
    response = asyncio.run(server(_request(body, path, method)))
    return response.status_code, json.loads(response.body)


@pytest.fixture
def replica(ray_cluster: None, raydeck_env: dict[str, str], mlflow_client: Any,
            tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[dict[str, Any]]:
    """A replica following ``models:/<name>@champion``, version 1 a good model; the registry URI
    it is given carries a password (as a credentialed deployment's does)."""
    from raydeck.config import load_settings
    from raydeck.models import promote
    from raydeck.serving.options import ServeOptions
    from raydeck.serving.server import ModelServer

    code = tmp_path / "summer_model.py"
    code.write_text(MODEL_CODE)
    down_flag = tmp_path / "store-down"
    name = f"summer-{uuid.uuid4().hex[:6]}"
    uri = mlflow_client.tracking_uri
    assert _register(uri, name, code, down_flag) == "1"
    promote(uri, name, "1", "champion")
    monkeypatch.setenv("MLFLOW_TRACKING_PASSWORD", "hunter2secret")
    server = ModelServer(ServeOptions(f"models:/{name}@champion", poll_interval_s=0.2,
                                      max_batch_size=1, max_request_bytes=4096),
                         load_settings())
    try:
        yield {"server": server, "name": name, "uri": uri, "code": code, "down": down_flag}
    finally:
        server.__del__()  # stops its alias-following thread


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_every_malformed_body_is_a_400_and_the_limit_holds_while_reading(
        replica: dict[str, Any]) -> None:
    server = replica["server"]
    assert _call(server, b'{"inputs": [[1, 2]]}') == (200, {"predictions": [3.0]})
    for body in (b"[" * 50_000, b'{"inputs": [[' + b"7" * 5000 + b', 1]]}', b"[[1, 2]]",
                 b"\xff"):
        status, answer = _call(server, body)
        assert status == 400 and answer["error_code"] == "BAD_REQUEST", (body[:20], answer)
    # 10 chunks of 1 KB against a 4 KB limit: refused, and only the first 4 KB kept.
    status, answer = _call(server, [b" " * 1024] * 10)
    assert status == 400, answer
    assert answer["message"].startswith("request body is 10,240 bytes; the limit is 4,096 bytes "
                                        "(max_request_bytes)"), answer


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_every_form_is_answered_byte_for_byte_as_mlflows_scoring_server_answers(
        replica: dict[str, Any]) -> None:
    """MLflow's own scoring code (what ``mlflow models serve`` runs per request: parse, predict
    with schema enforcement, write) on the same registered version, against the replica."""
    import io

    import mlflow.pyfunc
    from mlflow.pyfunc.scoring_server import infer_and_parse_data, predictions_to_json

    model = mlflow.pyfunc.load_model(f"models:/{replica['name']}/1")
    rows = [[1.0, 2.0], [3.5, -4.25]]
    columns = ["a", "b"]
    for payload in ({"dataframe_split": {"columns": columns, "data": rows}},
                    {"dataframe_records": [dict(zip(columns, row, strict=True))
                                           for row in rows]},
                    {"instances": rows}, {"inputs": rows}):
        body = json.dumps(payload).encode()
        expected = io.StringIO()
        predictions_to_json(model.predict(infer_and_parse_data(
            payload, model.metadata.get_input_schema())), expected)
        response = asyncio.run(replica["server"](_request(body)))
        assert response.status_code == 200
        assert bytes(response.body) == expected.getvalue().encode(), (payload, response.body)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_version_that_cannot_load_for_a_while_is_retried_one_that_fails_its_check_is_not(
        replica: dict[str, Any], mlflow_client: Any) -> None:
    from raydeck.models import promote

    server, name, uri = replica["server"], replica["name"], replica["uri"]
    # Version 2 cannot be loaded while its store is "down": the replica keeps version 1, says
    # it is retrying, and switches once the store is back, without the alias moving again.
    replica["down"].write_text("down")
    assert _register(uri, name, replica["code"], replica["down"]) == "2"
    promote(uri, name, "2", "champion")
    wait_until(lambda: "2" in server.describe()["retrying"], 60, "version 2 to be retried")
    health = json.dumps(_call(server, b"", "/health", "GET"))
    assert '"version": "1"' in health and "ConnectionError" in health, health
    assert "hunter2secret" not in health and "bob" not in health, health
    assert not server.describe()["rejected"]
    os.remove(replica["down"])
    wait_until(lambda: server.describe()["version"] == "2", 60, "version 2 to be served")
    assert not server.describe()["retrying"]
    # Version 3 loads but predicts NaN for its own input example: refused, not retried.
    assert _register(uri, name, replica["code"], replica["down"], broken=True) == "3"
    promote(uri, name, "3", "champion")
    wait_until(lambda: "3" in server.describe()["rejected"], 60, "version 3 to be refused")
    assert server.describe()["version"] == "2" and not server.describe()["retrying"]
    assert "HealthCheckFailed" in server.describe()["rejected"]["3"]
    assert _call(server, b'{"inputs": [[2, 2]]}') == (200, {"predictions": [4.0]})
