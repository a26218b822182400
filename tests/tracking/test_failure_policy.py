"""Every failure a write can meet is classified: retry (transient) or set aside (permanent).

The exceptions are the real ones, produced by real calls to a real MLflow server, a real S3
server, a dead port and the local file system.
"""

from __future__ import annotations

import socket
import uuid
from pathlib import Path
from typing import Any

import pytest

from raydeck.tracking.proxy.writer import FailurePolicy, Verdict
from tests.fixtures.mlflow_server import MlflowServer
from tests.fixtures.processes import free_port

POLICY = FailurePolicy()


def _raised(call: Any) -> BaseException:
    try:
        call()
    except Exception as exc:
        return exc
    raise AssertionError("the call did not fail")


def _verdict(call: Any) -> Verdict:
    return POLICY.classify(_raised(call))


def test_mlflow_answers_are_classified_by_status(mlflow_server: MlflowServer,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    from mlflow.entities import Param
    from mlflow.tracking import MlflowClient

    from raydeck.tracking.proxy.writer import DEFAULT_REQUEST_TIMEOUT_S, mlflow_request_env

    # as the shard calls MLflow: no retries
    for name, value in mlflow_request_env(DEFAULT_REQUEST_TIMEOUT_S).items():
        monkeypatch.setenv(name, value)

    client = MlflowClient(mlflow_server.uri)
    run_id = client.create_run(client.create_experiment(f"policy-{uuid.uuid4().hex[:6]}")
                               ).info.run_id
    client.log_param(run_id, "lr", "0.1")
    changed = _verdict(lambda: client.log_batch(run_id, params=[Param("lr", "0.2")]))
    assert not changed.transient and "INVALID_PARAMETER_VALUE" in changed.reason
    unknown_run = _verdict(lambda: client.log_param("0" * 32, "x", "1"))
    assert not unknown_run.transient

    dead = MlflowClient(f"http://127.0.0.1:{free_port()}")
    refused = _verdict(lambda: dead.get_experiment_by_name("x"))
    assert refused.transient and not refused.answered


def test_s3_answers_are_classified_by_code(s3_server: Any, tmp_path: Path) -> None:
    import boto3
    from botocore.config import Config

    client = boto3.client("s3", endpoint_url=s3_server.endpoint,
                          aws_access_key_id=s3_server.access_key_id,
                          aws_secret_access_key=s3_server.secret_access_key,
                          region_name="us-east-1",
                          config=Config(retries={"max_attempts": 1}))
    missing = _verdict(lambda: client.put_object(Bucket="no-such-bucket-raydeck",
                                                 Key="a", Body=b"x"))
    assert not missing.transient and "NoSuchBucket" in missing.reason
    wrong_key = boto3.client("s3", endpoint_url=s3_server.endpoint,
                             aws_access_key_id="nobody", aws_secret_access_key="wrong",
                             region_name="us-east-1", config=Config(retries={"max_attempts": 1}))
    assert not _verdict(lambda: wrong_key.list_buckets()).transient
    closed = boto3.client("s3", endpoint_url=f"http://127.0.0.1:{free_port()}",
                          aws_access_key_id="a", aws_secret_access_key="b",
                          region_name="us-east-1", config=Config(retries={"max_attempts": 1}))
    assert _verdict(lambda: closed.list_buckets()).transient


def test_os_errors_no_retry_can_fix_are_permanent(tmp_path: Path) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("x")
    not_a_dir = _verdict(lambda: (blocker / "child").write_text("y"))
    assert not not_a_dir.transient
    with socket.socket() as sock:
        refused = _verdict(lambda: sock.connect(("127.0.0.1", free_port())))
    assert refused.transient


def test_an_unknown_error_is_retried_but_marked_unclassified() -> None:
    verdict = _verdict(lambda: (_ for _ in ()).throw(RuntimeError("something odd")))
    assert verdict.transient and verdict.reason.startswith("unclassified")


@pytest.mark.parametrize(("message", "transient"), [
    ("API request to .../artifacts/model/w.bin failed: [Errno 20] Not a directory", False),
    ("upload failed: An error occurred (AccessDenied) when calling PutObject", False),
    ("upload failed: An error occurred (SlowDown) when calling PutObject", True),
    ("API request failed with exception ... [Errno 111] Connection refused", True),
])
def test_a_servers_500_is_read_for_the_os_error_or_s3_code(message: str, transient: bool
                                                           ) -> None:
    from mlflow.exceptions import MlflowException

    assert POLICY.classify(MlflowException(message)).transient is transient
