"""Object storage against a real S3 server (SeaweedFS): bucket bootstrap, health, clear errors.

Every test uses its own bucket names on the session's server, so "an empty server" means
"none of this test's buckets exist yet".
"""

from __future__ import annotations

import os
import pickle
import subprocess
import sys
import uuid
from pathlib import Path
from typing import Any

import pytest

from raydeck.config.settings import Settings, load_settings
from tests.fixtures.processes import free_port
from tests.fixtures.s3_server import S3Server

CLI_TIMEOUT_S = 120


def _names(tag: str) -> dict[str, str]:
    unique = uuid.uuid4().hex[:8]
    return {"RAYDECK_S3_ARTIFACTS_BUCKET": f"{tag}-art-{unique}",
            "RAYDECK_S3_CHECKPOINTS_BUCKET": f"{tag}-ckpt-{unique}"}


def _settings(env: dict[str, str]) -> Settings:
    return load_settings(env=env)


def _raydeck(args: list[str], env: dict[str, str], tmp_path: Path
             ) -> subprocess.CompletedProcess[str]:
    """Run the real ``raydeck`` CLI with only these raydeck settings (Ray not involved)."""
    base = {k: v for k, v in os.environ.items() if not k.startswith(("RAYDECK_", "AWS_"))}
    full = {**base, "RAYDECK_RAY_ADDRESS": "local", "RAYDECK_DATA_DIR": str(tmp_path / "data"),
            "COLUMNS": "200", **env}
    return subprocess.run([sys.executable, "-m", "raydeck.cli", *args], env=full,
                          capture_output=True, text=True, timeout=CLI_TIMEOUT_S, cwd=tmp_path,
                          check=False)


def _error_lines(done: subprocess.CompletedProcess[str]) -> list[str]:
    return [line for line in done.stderr.splitlines() if line.startswith("error:")]


def _snapshot(server: S3Server, buckets: list[str]) -> dict[str, Any]:
    client = server.client()
    listed = {b.name: b.creation_date for b in client.list_buckets() if b.name in buckets}
    objects = {b: sorted(o.object_name for o in client.list_objects(b, recursive=True))
               for b in listed}
    return {"buckets": listed, "objects": objects}


@pytest.mark.timeout(180)
def test_storage_init_creates_missing_buckets_and_is_idempotent(
    s3_server: S3Server, tmp_path: Path
) -> None:
    names = _names("init")
    env = s3_server.settings_env(**names)
    buckets = sorted(names.values())
    assert _snapshot(s3_server, buckets)["buckets"] == {}

    first = _raydeck(["storage", "init"], env, tmp_path)
    assert first.returncode == 0, first.stderr
    after_first = _snapshot(s3_server, buckets)
    assert sorted(after_first["buckets"]) == buckets
    assert after_first["objects"] == {b: [] for b in buckets}, "the probe object was left behind"
    for bucket in buckets:
        row = next(line for line in first.stdout.splitlines() if bucket in line)
        assert "created" in row and "write, read, delete ok" in row

    second = _raydeck(["storage", "init"], env, tmp_path)
    assert second.returncode == 0, second.stderr
    assert _snapshot(s3_server, buckets) == after_first
    for bucket in buckets:
        row = next(line for line in second.stdout.splitlines() if bucket in line)
        assert "exists" in row and "created" not in row
    assert s3_server.secret_access_key not in first.stdout + first.stderr + second.stdout


@pytest.mark.timeout(180)
def test_status_shows_buckets_and_accepted_credentials(
    s3_server: S3Server, mlflow_server: Any, tmp_path: Path
) -> None:
    names = _names("status")
    env = {**s3_server.settings_env(**names), "RAYDECK_TRACKING_URI": mlflow_server.uri}
    from raydeck.storage import init_buckets

    init_buckets(_settings(env).storage)
    done = _raydeck(["status"], env, tmp_path)
    assert done.returncode == 0, done.stdout + done.stderr
    assert f"credentials of '{s3_server.access_key_id}' accepted" in done.stdout
    for bucket in names.values():
        assert any(bucket in line and "exists" in line for line in done.stdout.splitlines())
    assert s3_server.secret_access_key not in done.stdout + done.stderr


def _problem_env(s3_server: S3Server, case: str) -> tuple[dict[str, str], str, str]:
    """Settings for one broken setup, the endpoint they name and the bucket the line names."""
    names = _names("bad")
    env = s3_server.settings_env(**names)
    endpoint = s3_server.endpoint
    bucket = names["RAYDECK_S3_ARTIFACTS_BUCKET"]
    if case == "wrong secret":
        env["RAYDECK_S3_SECRET_ACCESS_KEY"] = "not-the-secret"
    elif case == "unknown bucket":
        from raydeck.storage import init_buckets

        init_buckets(_settings(env).storage)
        bucket = f"missing-{uuid.uuid4().hex[:8]}"
        env["RAYDECK_S3_CHECKPOINTS_BUCKET"] = bucket
    else:
        endpoint = f"http://127.0.0.1:{free_port()}"
        env["RAYDECK_S3_ENDPOINT"] = endpoint
    return env, endpoint, bucket


EXPECTED = {
    "wrong secret": "refused the credentials",
    "unknown bucket": "does not exist",
    "unreachable endpoint": "is unreachable",
}


@pytest.mark.timeout(180)
@pytest.mark.parametrize(("case", "command"), [
    ("wrong secret", ["storage", "init"]),
    ("wrong secret", ["status"]),
    ("unknown bucket", ["status"]),
    ("unreachable endpoint", ["storage", "init"]),
    ("unreachable endpoint", ["status"]),
])
def test_storage_problems_are_one_clear_line_and_exit_2(
    s3_server: S3Server, tmp_path: Path, case: str, command: list[str]
) -> None:
    env, endpoint, bucket = _problem_env(s3_server, case)
    done = _raydeck(command, env, tmp_path)
    assert done.returncode == 2, done.stdout + done.stderr
    errors = _error_lines(done)
    assert len(errors) == 1, done.stderr
    line = errors[0]
    assert EXPECTED[case] in line
    assert endpoint in line and f"'{bucket}'" in line
    assert f"access key id '{s3_server.access_key_id}'" in line
    assert "Traceback" not in done.stderr
    secret = env["RAYDECK_S3_SECRET_ACCESS_KEY"]
    assert secret not in done.stdout + done.stderr


@pytest.mark.timeout(60)
def test_training_refuses_to_start_when_a_bucket_is_missing(s3_server: S3Server) -> None:
    from raydeck.errors import StorageError
    from raydeck.tracking import NoOpTracker
    from raydeck.train.trainer import fit

    names = _names("fit")
    settings = _settings(s3_server.settings_env(**names))
    with pytest.raises(StorageError) as caught:
        fit(lambda config: None, tracker=NoOpTracker(), settings=settings,
            train_loop_config={}, scaling_config=None)
    message = str(caught.value)
    assert "does not exist" in message and s3_server.endpoint in message
    assert names["RAYDECK_S3_ARTIFACTS_BUCKET"] in message


@pytest.mark.timeout(60)
def test_checkpoint_filesystem_reaches_s3_and_keeps_its_retries_when_shipped(
    s3_server: S3Server, ray_cluster: None
) -> None:
    """Ray ships the filesystem to Ray Train's controller and workers (and Tune's trials) with
    its retries and credentials; pickled to a file (Tune's experiment state) it drops the secret.
    """
    import ray

    from raydeck.storage import CHECKPOINT_S3_MAX_ATTEMPTS, checkpoint_storage, init_buckets

    settings = _settings(s3_server.settings_env(**_names("fs")))
    init_buckets(settings.storage, probe=False)
    target = checkpoint_storage(settings)
    assert target.uri == f"s3://{settings.storage.checkpoints_bucket}/raydeck"
    assert target.storage_path == f"{settings.storage.checkpoints_bucket}/raydeck"
    assert s3_server.secret_access_key.encode() not in pickle.dumps(target.filesystem)
    shipped = ray.get(ray.put(target.filesystem))
    assert shipped._max_attempts == CHECKPOINT_S3_MAX_ATTEMPTS
    assert shipped.type_name == "s3"
    path = f"{target.storage_path}/probe/file.bin"
    with shipped.open_output_stream(path) as stream:
        stream.write(b"checkpoint bytes")
    stat = s3_server.client().stat_object(settings.storage.checkpoints_bucket,
                                          "raydeck/probe/file.bin")
    assert stat.size == len(b"checkpoint bytes")
    assert s3_server.secret_access_key not in repr(settings) + repr(target)
