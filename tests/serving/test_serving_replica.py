"""One serving replica's promises: what ``mlflow models serve`` answers, byte for byte, to every
form, content type and error its clients send (MLflow's own scoring app on the same version is
the reference); numbers cast to the signature's dtype only when nothing changes; and its defects,
each pinned: bodies that used to answer 500, the size limit while reading, a version that fails
to load for a moment versus one that fails its health check, and no credential in what a replica
says about either.

The replica class (:class:`raydeck.serving.server.ModelServer`) runs in the test process against
the session's real MLflow server and registry, with real models and real Starlette requests;
Serve's HTTP path around it is ``tests/serving/test_serving.py``'s.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from raydeck.serving.protocol import (
    InputError,
    TensorInput,
    UnsupportedMediaType,
    media_type,
    parse_json_object,
    parse_request,
)
from tests.fixtures.processes import wait_until
from tests.fixtures.summer_model import SUMMER_CODE, register_summer

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


@pytest.mark.parametrize(("body", "dtype", "rows"), [
    (b'{"inputs": [[1, 2]]}', "float64", [[1.0, 2.0]]),
    (b'{"inputs": [[9007199254740992, 2]]}', "float64", [[2.0**53, 2.0]]),
    (b'{"inputs": [[16777216, 0.1]]}', "float32", [[2.0**24, np.float32(0.1)]]),
    (b'{"inputs": [[3.0, -4]]}', "int64", [[3, -4]]),
    (b'{"inputs": [[1, 2]], "params": {"temperature": 0}}', "float64", [[1.0, 2.0]]),
])
def test_numbers_are_cast_to_the_signatures_dtype_when_nothing_changes(
        body: bytes, dtype: str, rows: list[list[float]]) -> None:
    parsed = parse_request(body, TensorInput(width=2, dtype=dtype), 1 << 20)
    assert parsed.rows.dtype == np.dtype(dtype) and parsed.rows.tolist() == rows


@pytest.mark.parametrize(("body", "dtype", "says"), [
    (b'{"inputs": [[9007199254740993, 2]]}', "float64", "9007199254740993 at index [0, 0]"),
    (b'{"inputs": [[18446744073709551615, 2]]}', "float64", "cannot hold exactly"),
    (b'{"inputs": [[' + b"1" + b"0" * 40 + b', 2]]}', "float64", "cannot hold exactly"),
    (b'{"inputs": [[16777217, 2]]}', "float32", "16777217 at index [0, 0] would change"),
    (b'{"inputs": [[1e300, 2]]}', "float32", "would change as float32"),
    (b'{"inputs": [[2.5, 2]]}', "int64", "2.5 at index [0, 0] would change as int64"),
    (b'{"inputs": [["7", 2]]}', "float64", "'7' (str)"),
    (b'{"inputs": [[true, 2]]}', "float64", "True (bool)"),
    (b'{"dataframe_split": {"columns": ["a", "b"], "data": [[1, false]]}}', "float64",
     "False (bool)"),
])
def test_numbers_a_cast_would_change_are_refused(body: bytes, dtype: str, says: str) -> None:
    with pytest.raises(InputError, match=re.escape(says)):
        parse_request(body, TensorInput(width=2, dtype=dtype), 1 << 20)


@pytest.mark.parametrize(("content_type", "status"), [
    (None, "json"), ("application/json", "json"), ("application/json; charset=UTF-8", "json"),
    ("text/csv", "csv"), ("text/csv; charset=utf-8", "csv"),
    ("application/vnd.apache.parquet", "parquet"),
    ("application/json; format=pandas-split", "Unrecognized content type parameters: format"),
    ("application/json; charset=latin-1", "only supports UTF-8"),
    ("text/plain", "only supports the following content types"),
])
def test_content_types_are_read_as_mlflows_scoring_server_reads_them(
        content_type: str | None, status: str) -> None:
    csv, parquet = b"a,b\n1,2\n", _parquet([[1.0, 2.0]], ["a", "b"])
    body = {"json": b'{"inputs": [[1, 2]]}', "csv": csv, "parquet": parquet}.get(status, csv)
    if status in ("json", "csv", "parquet"):
        parsed = parse_request(body, EXPECTED, 1 << 20, content_type)
        assert parsed.rows.tolist() == [[1.0, 2.0]]
        assert parsed.form == ("inputs" if status == "json" else status)
    else:
        with pytest.raises(UnsupportedMediaType, match=re.escape(status)):
            media_type(content_type)


@pytest.mark.parametrize(("body", "says"), [
    (b"", "No columns to parse"), (b"a,b\n", "has no rows"), (b"a,b\n1,\n", "is nan"),
    (b"a,b\nx,2\n", "'x' (str)"), (b"a,b,c\n1,2,3\n", "row 0 has 3 values"),
    (b"\xff,b\n1,2\n", "not UTF-8"),
])
def test_a_bad_csv_body_is_an_input_error(body: bytes, says: str) -> None:
    with pytest.raises(InputError, match=re.escape(says)):
        parse_request(body, EXPECTED, 1 << 20, "text/csv")


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


def _request(body: bytes | list[bytes], path: str = "/invocations", method: str = "POST",
             content_type: str | None = None) -> Any:
    from starlette.requests import Request

    chunks = [body] if isinstance(body, bytes) else body
    messages = [{"type": "http.request", "body": chunk, "more_body": i < len(chunks) - 1}
                for i, chunk in enumerate(chunks)]

    async def receive() -> dict[str, Any]:
        return messages.pop(0)

    headers = [(b"content-type", content_type.encode())] if content_type else []
    scope = {"type": "http", "method": method, "path": path, "headers": headers,
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
    from raydeck.config.settings import load_settings
    from raydeck.models import promote
    from raydeck.serving.options import ServeOptions
    from raydeck.serving.server import ModelServer

    code = tmp_path / "summer_model.py"
    code.write_text(SUMMER_CODE)
    down_flag = tmp_path / "store-down"
    name = f"summer-{uuid.uuid4().hex[:6]}"
    uri = mlflow_client.tracking_uri
    assert register_summer(uri, name, code, down_flag) == "1"
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


def _mlflow_and(server: Any, model_uri: str, monkeypatch: pytest.MonkeyPatch) -> Any:
    """``both(body, content_type, path, method)``: the request sent to MLflow's own scoring app
    serving ``model_uri`` and to ``server``; each answer as (status, content type, body)."""
    import mlflow.pyfunc
    from mlflow.environment_variables import _MLFLOW_IS_IN_SERVING_ENVIRONMENT
    from mlflow.pyfunc import scoring_server
    from starlette.testclient import TestClient

    monkeypatch.delenv(_MLFLOW_IS_IN_SERVING_ENVIRONMENT.name, raising=False)  # init() sets it
    mlflow_app = TestClient(scoring_server.init(mlflow.pyfunc.load_model(model_uri)))

    def both(body: bytes, content_type: str | None = "application/json",
             path: str = "/invocations", method: str = "POST") -> tuple[Any, Any]:
        theirs = mlflow_app.request(method, path, content=body,
                                    headers={"content-type": content_type} if content_type
                                    else {})
        ours = asyncio.run(server(_request(body, path, method, content_type)))
        return ((theirs.status_code, theirs.headers["content-type"], theirs.content),
                (ours.status_code, ours.headers["content-type"], bytes(ours.body)))

    return both


def _parquet(rows: list[list[float]], columns: list[str]) -> bytes:
    import io

    import pandas as pd

    buffer = io.BytesIO()
    pd.DataFrame(rows, columns=columns).to_parquet(buffer)
    return buffer.getvalue()


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_mlflows_clients_get_what_mlflow_models_serve_answers_byte_for_byte(
        replica: dict[str, Any], monkeypatch: pytest.MonkeyPatch) -> None:
    """The same requests to MLflow's own scoring app (what ``mlflow models serve`` runs, here
    in process on the same registered version) and to the replica: every form, content type,
    ``params``, refusal and error, compared byte for byte where MLflow answers, key for key
    where its message quotes the request differently."""
    both = _mlflow_and(replica["server"], f"models:/{replica['name']}/1", monkeypatch)
    rows, ints, columns = [[1.0, 2.0], [3.5, -4.25]], [[1, 2], [3, 4]], ["a", "b"]
    same = {
        "dataframe_split": {"dataframe_split": {"columns": columns, "data": rows}},
        "dataframe_records": {"dataframe_records": [dict(zip(columns, row, strict=True))
                                                    for row in rows]},
        "instances": {"instances": rows},
        "inputs": {"inputs": rows},
        "integer rows": {"inputs": ints},
        "params (no params schema: ignored, as MLflow does)": {"inputs": rows,
                                                                "params": {"k": 3}},
    }
    for what, payload in same.items():
        for content_type in ("application/json", "application/json; charset=utf-8"):
            theirs, ours = both(json.dumps(payload).encode(), content_type)
            assert theirs[0] == 200 and ours == theirs, (what, content_type, theirs, ours)
    # MLflow 2 and 3 refuse MLflow 1's content types and any charset but UTF-8 with a 415 in
    # plain text: word for word the same.
    for content_type in ("application/json; format=pandas-split",
                         "application/json; format=pandas-records",
                         "application/json; charset=latin-1", "text/plain",
                         "application/x-www-form-urlencoded"):
        theirs, ours = both(json.dumps(same["inputs"]).encode(), content_type)
        assert theirs[0] == 415 and ours == theirs, (content_type, theirs, ours)
    # CSV and Parquet tables: MLflow 3.17's CSV parser fails on any tensor signature (a 400),
    # so the replica's answer is compared with MLflow's to the same rows as JSON.
    split = both(json.dumps(same["dataframe_split"]).encode())[0]
    csv = "a,b\n" + "".join(f"{x},{y}\n" for x, y in rows)
    for body, content_type in ((csv.encode(), "text/csv"),
                               (_parquet(rows, columns), "application/vnd.apache.parquet")):
        theirs, ours = both(body, content_type)
        assert ours == (theirs if theirs[0] == 200 else split), (content_type, theirs, ours)
    # Errors: MLflow's status and body keys (error_code, message, sqlstate, error_class); the
    # messages differ where MLflow quotes the request (raydeck's name the row and column).
    for body in (b"{not json", b"[1, 2]", b'{"rows": [[1, 2]]}', b'{"inputs": [[1, 2, 3]]}',
                 b'{"inputs": [["a", 2]]}'):
        theirs, ours = both(body)
        assert theirs[0] == ours[0] == 400 and theirs[1] == ours[1], (body, theirs, ours)
        assert json.loads(theirs[2]).keys() == json.loads(ours[2]).keys(), (body, theirs, ours)
    # Paths and methods MLflow has no route for: FastAPI's 404 and 405, byte for byte.
    for path, method in (("/predict", "POST"), ("/invocations", "GET")):
        theirs, ours = both(b"", None, path, method)
        assert theirs[0] in (404, 405) and ours == theirs, (path, theirs, ours)
    # Where raydeck is stricter: an integer float64 cannot hold exactly (MLflow rounds it) and a
    # boolean among numbers (MLflow reads it as 0 or 1).
    for body, says in ((b'{"inputs": [[9007199254740993, 1]]}', b"9007199254740993"),
                       (b'{"inputs": [[true, 1]]}', b"True (bool)")):
        theirs, ours = both(body)
        assert theirs[:2] == (200, "application/json"), theirs
        assert ours[0] == 400 and says in ours[2], ours


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_model_with_a_params_schema_gets_its_params_as_mlflow_models_serve_passes_them(
        replica: dict[str, Any], monkeypatch: pytest.MonkeyPatch) -> None:
    from raydeck.config.settings import load_settings
    from raydeck.serving.options import ServeOptions
    from raydeck.serving.server import ModelServer

    name = f"scaled-{uuid.uuid4().hex[:6]}"
    assert register_summer(replica["uri"], name, replica["code"], replica["down"],
                     params={"scale": 1.0}) == "1"
    server = ModelServer(ServeOptions(f"models:/{name}/1", max_batch_size=1), load_settings())
    both = _mlflow_and(server, f"models:/{name}/1", monkeypatch)
    for payload in ({"inputs": [[1, 2]]}, {"inputs": [[1, 2]], "params": {"scale": 2.0}},
                    {"dataframe_split": {"columns": ["a", "b"], "data": [[1, 2]]},
                     "params": {"scale": 0.5}}):
        theirs, ours = both(json.dumps(payload).encode())
        assert theirs[0] == 200 and ours == theirs, (payload, theirs, ours)
    assert json.loads(both(b'{"inputs": [[1, 2]], "params": {"scale": 2.0}}')[1][2]) == {
        "predictions": [6.0]}
    theirs, ours = both(b'{"inputs": [[1, 2]], "params": {"scale": "big"}}')
    assert theirs[0] == ours[0] == 400 and theirs[1:] == ours[1:], (theirs, ours)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_version_that_cannot_load_for_a_while_is_retried_one_that_fails_its_check_is_not(
        replica: dict[str, Any], mlflow_client: Any) -> None:
    from raydeck.models import promote

    server, name, uri = replica["server"], replica["name"], replica["uri"]
    # Version 2 cannot be loaded while its store is "down": the replica keeps version 1, says
    # it is retrying, and switches once the store is back, without the alias moving again.
    replica["down"].write_text("down")
    assert register_summer(uri, name, replica["code"], replica["down"]) == "2"
    promote(uri, name, "2", "champion")
    wait_until(lambda: "2" in server.describe()["retrying"], 60, "version 2 to be retried")
    health = json.dumps(_call(server, b"", "/health", "GET"))
    assert '"version": "1"' in health and "ConnectionError" in health, health
    assert '"device": null' in health  # not a torch module
    assert "hunter2secret" not in health and "bob" not in health, health
    assert not server.describe()["rejected"]
    os.remove(replica["down"])
    wait_until(lambda: server.describe()["version"] == "2", 60, "version 2 to be served")
    assert not server.describe()["retrying"]
    # Version 3 loads but predicts NaN for its own input example: refused, not retried.
    assert register_summer(uri, name, replica["code"], replica["down"], broken=True) == "3"
    promote(uri, name, "3", "champion")
    wait_until(lambda: "3" in server.describe()["rejected"], 60, "version 3 to be refused")
    assert server.describe()["version"] == "2" and not server.describe()["retrying"]
    assert "HealthCheckFailed" in server.describe()["rejected"]["3"]
    assert _call(server, b'{"inputs": [[2, 2]]}') == (200, {"predictions": [4.0]})



@pytest.mark.timeout(120)
def test_a_replica_says_which_device_its_model_predicts_on(tmp_path: Path) -> None:
    """``/health`` shows where the model predicts: a torch model's device as MLflow's pytorch
    flavor placed it (``cuda:0`` on a replica given a GPU); a model that is not a torch module
    says nothing (the summer model's ``/health`` in the retry test above)."""
    import mlflow.pyfunc
    import torch

    from raydeck.models import Standardized, save_torch_model
    from raydeck.serving.server import model_device

    network = Standardized(torch.nn.Linear(2, 1), [0.0, 0.0], [1.0, 1.0])
    saved = save_torch_model(network, tmp_path / "torch", np.zeros((1, 2), dtype=np.float32))
    expected = "cuda:0" if torch.cuda.is_available() else "cpu"
    assert model_device(mlflow.pyfunc.load_model(str(saved))) == expected


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_a_replica_given_no_gpu_sees_none_on_a_node_that_has_one(ray_cluster: None) -> None:
    """Ray leaves a GPU node's ``CUDA_VISIBLE_DEVICES`` as it is for an actor given no GPU, and
    MLflow's pytorch flavor would then load onto a GPU that Ray counts as free; the replica's
    actor options make Ray hide it. The node's variable is set in the probe's environment,
    as a GPU node's raylet passes it on."""
    import ray

    from raydeck.config.settings import load_settings
    from raydeck.serving.options import ServeOptions

    actor_options = ServeOptions("models:/digits/1").deployment_options(
        load_settings())["ray_actor_options"]
    assert "num_gpus" not in actor_options
    env_vars = {**actor_options["runtime_env"]["env_vars"], "CUDA_VISIBLE_DEVICES": "0"}

    @ray.remote(num_cpus=0)
    class Probe:
        def visible_gpus(self) -> str | None:
            return os.environ.get("CUDA_VISIBLE_DEVICES")

    probe = Probe.options(runtime_env={"env_vars": env_vars}).remote()  # type: ignore[attr-defined]
    try:
        assert ray.get(probe.visible_gpus.remote(), timeout=60) == ""
    finally:
        ray.kill(probe)
