"""Tracked Ray Train runs with object storage: what lands in S3, resume from S3, S3 outages.

Each run is ``raydeck demo`` in its own process, configured only through ``RAYDECK_*``
variables as a user would, connected to the session's Ray cluster as a second job. Its own job
runtime env (built by ``raydeck.cluster.connection.connect``) carries the storage settings to its
Ray workers, and its own Ray namespace gives it a tracking proxy whose shards hold the S3
credentials, so the rest of the suite keeps running without object storage.

The MLflow server of this module has the S3 credentials in its environment, as a production
server must, so that the MLflow UI can read artifacts back.
"""

from __future__ import annotations

import os
import signal
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psutil
import pytest
import requests

from raydeck.config.settings import Settings, load_settings
from tests.conftest import TEST_ENV
from tests.fixtures.mlflow_server import MlflowServer
from tests.fixtures.processes import ManagedProcess, wait_until
from tests.fixtures.s3_server import S3Server

EPOCHS = 4
RUN_TIMEOUT_S = 420.0
CHECKPOINT_WAIT_S = 300.0
OUTAGE_S = 6.0
ARTIFACTS_BUCKET = "runs-artifacts"
CHECKPOINTS_BUCKET = "runs-checkpoints"
KEPT_CHECKPOINTS = 2  # raydeck.train.trainer.DEFAULT_CHECKPOINTS_TO_KEEP


@dataclass
class DemoRun:
    """One finished ``raydeck demo`` process and where to look for what it wrote."""

    key: str
    settings: Settings
    env: dict[str, str]
    log_path: Path
    returncode: int | None
    run: Any

    @property
    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    @property
    def checkpoint_prefix(self) -> str:
        return f"{self.settings.storage.prefix}/{self.key}/"


@pytest.fixture(scope="module")
def s3_mlflow(tmp_path_factory: pytest.TempPathFactory, s3_server: S3Server,
              ray_cluster: None) -> Iterator[MlflowServer]:
    """An MLflow server that can read the artifact bucket (the UI serves artifacts from S3)."""
    from raydeck.storage import init_buckets, secret_env

    settings = load_settings(env=s3_server.settings_env(
        RAYDECK_S3_ARTIFACTS_BUCKET=ARTIFACTS_BUCKET,
        RAYDECK_S3_CHECKPOINTS_BUCKET=CHECKPOINTS_BUCKET))
    init_buckets(settings.storage, probe=False)
    server = MlflowServer(tmp_path_factory.mktemp("mlflow-s3"))
    with pytest.MonkeyPatch.context() as patch:
        for name, value in secret_env(settings.storage).items():
            patch.setenv(name, value)
        server.start()
    yield server
    server.stop()


def _driver_env(s3_server: S3Server, mlflow_uri: str, root: Path, key: str) -> dict[str, str]:
    import ray

    return {
        "RAY_ADDRESS": ray.get_runtime_context().gcs_address,
        "RAYDECK_RAY_NAMESPACE": f"storage-{key}",
        "RAYDECK_RUN_ID": key,
        "RAYDECK_TRACKING_URI": mlflow_uri,
        "RAYDECK_TRACKING_EXPERIMENT": f"storage-{key}",
        "RAYDECK_TRACKING_IDLE_TIMEOUT_S": "20",
        # The suite's short waits after a fault: the proxy tries an upload that failed while
        # S3 was down again at most a second after it is back.
        **{name: TEST_ENV[name] for name in ("RAYDECK_TRACKING_RETRY_MAX_S",
                                             "RAYDECK_TRACKING_HEARTBEAT_INTERVAL_S")},
        # One shard is enough for one run and starts one process fewer on a small machine.
        "RAYDECK_TRACKING_SHARDS": "1",
        "RAYDECK_DATA_DIR": str(root / "data"),
        **s3_server.settings_env(RAYDECK_S3_ARTIFACTS_BUCKET=ARTIFACTS_BUCKET,
                                 RAYDECK_S3_CHECKPOINTS_BUCKET=CHECKPOINTS_BUCKET,
                                 RAYDECK_S3_PREFIX=f"t-{key}"),
    }


def _start_demo(env: dict[str, str], root: Path, *extra: str) -> ManagedProcess:
    """``raydeck demo`` with ``env`` and no ``AWS_*`` variable: the S3 credentials reach it only
    as raydeck's settings (``RAYDECK_S3_*``), as on a user's machine."""
    import sys

    clean = {k: v for k, v in os.environ.items() if not k.startswith(("RAYDECK_", "AWS_"))}
    process = ManagedProcess(
        [sys.executable, "-m", "raydeck.cli", "demo", "--epochs", str(EPOCHS),
         "--run-name", "storage-demo", *extra],
        log_path=root / "demo.log", cwd=root,
    )
    process.env = {**clean, "RAYDECK_LOG_LEVEL": "INFO", **env}
    return process.start()


def _object_exists(server: S3Server, bucket: str, key: str) -> bool:
    try:
        server.client().stat_object(bucket, key)
    except Exception:
        return False
    return True


def _read_object(server: S3Server, bucket: str, key: str) -> bytes | None:
    try:
        answer = server.client().get_object(bucket, key)
    except Exception:
        return None
    try:
        return bytes(answer.read())
    finally:
        answer.close()
        answer.release_conn()


def _wait_for_checkpoint(server: S3Server, process: ManagedProcess, prefix: str, epoch: int
                         ) -> None:
    """Until Ray Train registered checkpoint ``epoch``: its index in the bucket names it."""
    index = f"{prefix}checkpoint_manager_snapshot.json"
    name = f'"epoch_{epoch:06d}"'.encode()

    def registered() -> bool:
        if not process.alive():
            raise AssertionError(f"demo exited before checkpoint {epoch}:\n{process.log_tail()}")
        return name in (_read_object(server, CHECKPOINTS_BUCKET, index) or b"")

    wait_until(registered, CHECKPOINT_WAIT_S, f"checkpoint {epoch} in {index}", interval_s=0.1)


def _finish(process: ManagedProcess) -> int | None:
    assert process.proc is not None
    try:
        return process.proc.wait(RUN_TIMEOUT_S)
    except Exception:
        process.kill()
        raise


def _find_run(mlflow_uri: str, env: dict[str, str]) -> Any:
    from mlflow.tracking import MlflowClient

    client = MlflowClient(mlflow_uri)
    experiment = client.get_experiment_by_name(env["RAYDECK_TRACKING_EXPERIMENT"])
    assert experiment is not None, "the run's experiment was not created"
    runs = client.search_runs([experiment.experiment_id],
                              filter_string=f"tags.`raydeck.run_key` = '{env['RAYDECK_RUN_ID']}'")
    assert len(runs) == 1
    return runs[0]


def _kill_one_train_worker(namespace: str) -> int:
    """SIGKILL one Ray Train worker of the demo's job (found by its runtime env), as a crash."""
    for proc in psutil.process_iter(["pid", "cmdline"]):
        try:
            if "RayTrainWorker" not in " ".join(proc.info["cmdline"] or []):
                continue
            if proc.environ().get("RAYDECK_RAY_NAMESPACE") != namespace:
                continue
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
        os.kill(proc.info["pid"], signal.SIGKILL)
        return int(proc.info["pid"])
    raise AssertionError(f"no Ray Train worker of namespace {namespace} found")


@pytest.fixture(scope="module")
def run_with_worker_death(s3_server: S3Server, s3_mlflow: MlflowServer,
                          tmp_path_factory: pytest.TempPathFactory) -> DemoRun:
    """A demo run whose worker is killed after epoch 1 was checkpointed to S3."""
    root = tmp_path_factory.mktemp("storage-run")
    key = f"s3run-{uuid.uuid4().hex[:8]}"
    env = _driver_env(s3_server, s3_mlflow.uri, root, key)
    settings = load_settings(env=env)
    # Registering reads the run's model from S3 in the demo's own process (issue: it had no
    # credentials there and failed with botocore's NoCredentialsError after the job succeeded).
    process = _start_demo(env, root, "--register-as", f"storage-{key}")
    prefix = f"{settings.storage.prefix}/{key}/"
    _wait_for_checkpoint(s3_server, process, prefix, 1)
    _kill_one_train_worker(env["RAYDECK_RAY_NAMESPACE"])
    returncode = _finish(process)
    return DemoRun(key=key, settings=settings, env=env, log_path=process.log_path,
                   returncode=returncode, run=_find_run(s3_mlflow.uri, env))


def _history_steps(mlflow_uri: str, run_id: str, key: str) -> list[int]:
    from mlflow.tracking import MlflowClient

    return sorted(m.step for m in MlflowClient(mlflow_uri).get_metric_history(run_id, key))


def _checkpoint_tags_point_at_s3(run: DemoRun, may_lack: int | None = None) -> None:
    """Each epoch's checkpoint tag is its ``s3://`` URI (``may_lack``: one epoch may be absent)."""
    tags = run.run.data.tags
    expected = f"s3://{CHECKPOINTS_BUCKET}/{run.checkpoint_prefix}"
    for epoch in range(EPOCHS):
        key = f"raydeck.checkpoint.epoch_{epoch}"
        if epoch == may_lack and key not in tags:
            continue
        assert tags[key] == f"{expected}epoch_{epoch:06d}"
    assert tags["raydeck.checkpoint.latest"] == f"{expected}epoch_{EPOCHS - 1:06d}"


def _kept_checkpoints_are_objects(server: S3Server, run: DemoRun) -> None:
    client = server.client()
    for epoch in range(EPOCHS - KEPT_CHECKPOINTS, EPOCHS):
        folder = f"{run.checkpoint_prefix}epoch_{epoch:06d}/"
        names = {o.object_name.removeprefix(folder)
                 for o in client.list_objects(CHECKPOINTS_BUCKET, folder, recursive=True)}
        assert {"train_state.pt", "metrics_rank_0.json", "metrics_rank_1.json"} <= names


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_tracked_run_keeps_artifacts_and_checkpoints_in_s3(
    run_with_worker_death: DemoRun, s3_server: S3Server, s3_mlflow: MlflowServer,
    tmp_path: Path,
) -> None:
    import mlflow.artifacts
    import mlflow.pytorch
    import torch

    from raydeck.examples.digits import DigitsMLP
    from raydeck.storage import checkpoint_at, secret_env
    from raydeck.train.checkpointing import load_model_state

    run = run_with_worker_death
    assert run.returncode == 0, run.log[-4000:]
    info = run.run.info
    # --register-as worked with the credentials of raydeck's settings alone: the version
    # points at the run, and the demo said so.
    from mlflow.tracking import MlflowClient

    (version,) = MlflowClient(s3_mlflow.uri).search_model_versions(f"name='storage-{run.key}'")
    assert version.run_id == info.run_id and version.tags["raydeck.run_id"] == info.run_id
    assert f"registered model:    models:/storage-{run.key}/1" in run.log
    artifact_root = f"s3://{ARTIFACTS_BUCKET}/{run.settings.storage.prefix}/mlflow"
    assert info.artifact_uri == f"{artifact_root}/{info.run_id}/artifacts"

    # The model is a set of objects in the artifacts bucket...
    client = s3_server.client()
    model_prefix = f"{run.settings.storage.prefix}/mlflow/{info.run_id}/artifacts/model/"
    stored = {o.object_name.removeprefix(model_prefix)
              for o in client.list_objects(ARTIFACTS_BUCKET, model_prefix, recursive=True)}
    assert {"MLmodel", "data/model.pth"} <= stored
    # ...that MLflow's client downloads and loads...
    with pytest.MonkeyPatch.context() as patch:
        for name, value in secret_env(run.settings.storage).items():
            patch.setenv(name, value)
        local = mlflow.artifacts.download_artifacts(
            run_id=info.run_id, artifact_path="model", tracking_uri=s3_mlflow.uri,
            dst_path=str(tmp_path))
    model = mlflow.pytorch.load_model(local)
    assert tuple(model(torch.zeros(3, 64)).shape) == (3, 10)
    # ...and the MLflow server serves to its UI.
    answer = requests.get(f"{s3_mlflow.uri}/get-artifact",
                          params={"path": "model/MLmodel", "run_uuid": info.run_id}, timeout=30)
    assert answer.status_code == 200, answer.text[:500]
    assert answer.content == Path(local, "MLmodel").read_bytes()

    # Checkpoints went straight to the checkpoint bucket, the run links them, and they were
    # not copied again as MLflow artifacts or to local disk. The tag of the epoch training
    # resumed from may be missing: rank 0 sets it after the commit, and when rank 0 is the
    # worker killed right then, the tag dies in its buffer (restore() re-logs that epoch's
    # metrics but not its tag).
    _checkpoint_tags_point_at_s3(
        run, may_lack=int(run.run.data.tags["raydeck.checkpoint.resumed_from_epoch"]))
    _kept_checkpoints_are_objects(s3_server, run)
    # The URI a run records opens with raydeck's settings (e.g. to serve the model).
    latest = checkpoint_at(run.settings, run.run.data.tags["raydeck.checkpoint.latest"])
    with latest.as_directory() as directory:
        restored = load_model_state(directory, DigitsMLP())
    assert tuple(restored(torch.zeros(2, 64)).shape) == (2, 10)
    artifacts = [o.object_name for o in client.list_objects(
        ARTIFACTS_BUCKET, f"{run.settings.storage.prefix}/", recursive=True)]
    assert not [name for name in artifacts if "train_state" in name or "epoch_0" in name]
    assert not (run.settings.data_dir / "checkpoints").exists()


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_a_killed_worker_resumes_from_the_s3_checkpoint(
    run_with_worker_death: DemoRun, s3_mlflow: MlflowServer
) -> None:
    run = run_with_worker_death
    assert run.returncode == 0, run.log[-4000:]
    # The worker died after Ray Train registered epoch 1 (maybe 2): the restarted workers
    # continued from that checkpoint, read from the bucket (nothing is on local disk).
    resumed_from = int(run.run.data.tags["raydeck.checkpoint.resumed_from_epoch"])
    assert resumed_from in (1, 2)
    assert "Traceback" not in run.log
    # Every epoch is in the history, and those up to the restored one exactly once (the
    # restored epoch's values were re-sent with their original timestamps). An epoch that was
    # uploaded but not yet registered by Ray Train when the worker died is trained again and
    # may appear twice: that is the training runtime's concern, not storage's.
    steps = _history_steps(s3_mlflow.uri, run.run.info.run_id, "val_accuracy")
    assert set(steps) == set(range(EPOCHS))
    assert [steps.count(epoch) for epoch in range(resumed_from + 1)] == [1] * (resumed_from + 1)


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_the_secret_appears_nowhere_after_a_run(
    run_with_worker_death: DemoRun, s3_server: S3Server, s3_mlflow: MlflowServer
) -> None:
    from mlflow.tracking import MlflowClient

    run = run_with_worker_death
    secret = s3_server.secret_access_key
    assert secret in run.env.values(), "the run was not configured with the secret"
    client = MlflowClient(s3_mlflow.uri)
    found = client.get_run(run.run.info.run_id)
    assert secret not in repr(found.data.params) + repr(found.data.tags)
    assert secret not in repr(sorted(found.data.metrics))

    # Every object either bucket holds for this run: artifacts (logs, model, runtime env) and
    # checkpoints (state, metrics, Ray's checkpoint index).
    s3 = s3_server.client()
    prefix = f"{run.settings.storage.prefix}/"
    checked = 0
    for bucket in (ARTIFACTS_BUCKET, CHECKPOINTS_BUCKET):
        for obj in s3.list_objects(bucket, prefix, recursive=True):
            content = _read_object(s3_server, bucket, obj.object_name)
            assert content is not None and secret.encode() not in content, obj.object_name
            checked += 1
    assert checked > 10
    runtime_env = _read_object(s3_server, ARTIFACTS_BUCKET, f"{prefix}mlflow/{found.info.run_id}"
                               "/artifacts/raydeck/runtime_env.json")
    assert runtime_env is not None
    text = runtime_env.decode()
    # The runtime env carries the storage settings but never a secret.
    assert '"RAYDECK_S3_ENDPOINT"' in text and "SECRET" not in text and secret not in text

    # raydeck's own output and files: the driver's console and log, the proxy's spool and
    # captured worker logs, and the MLflow server's log.
    assert secret not in run.log
    for path in run.settings.data_dir.rglob("*"):
        if path.is_file():
            assert secret.encode() not in path.read_bytes(), path
    assert secret not in (s3_mlflow.root / "server.log").read_text(errors="replace")

    # Ray's own logs on this node: its runtime env agent writes every runtime env it creates,
    # so the secret must never be part of one.
    import ray

    session = Path(ray._private.worker._global_node.get_session_dir_path())
    for path in (session / "logs").rglob("*"):
        if path.is_file():
            assert secret.encode() not in path.read_bytes(), path


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_a_run_survives_the_s3_server_restarting(
    s3_server: S3Server, s3_mlflow: MlflowServer, tmp_path: Path
) -> None:
    key = f"outage-{uuid.uuid4().hex[:8]}"
    env = _driver_env(s3_server, s3_mlflow.uri, tmp_path, key)
    settings = load_settings(env=env)
    process = _start_demo(env, tmp_path)
    prefix = f"{settings.storage.prefix}/{key}/"
    _wait_for_checkpoint(s3_server, process, prefix, 0)
    s3_server.stop()
    stopped_at = time.time()
    time.sleep(OUTAGE_S)
    s3_server.start()
    restarted_at = time.time()
    returncode = _finish(process)
    run = DemoRun(key=key, settings=settings, env=env, log_path=process.log_path,
                  returncode=returncode, run=_find_run(s3_mlflow.uri, env))
    outage = f"S3 down for {restarted_at - stopped_at:.1f} s"
    assert returncode == 0, f"{outage}:\n{run.log[-4000:]}"
    # Nothing was lost and nothing restarted: the uploads waited for S3 instead of failing.
    assert "raydeck.checkpoint.resumed_from_epoch" not in run.run.data.tags
    assert _history_steps(s3_mlflow.uri, run.run.info.run_id, "val_accuracy") == list(
        range(EPOCHS))
    # The outage fell inside training (each epoch ends with a checkpoint upload): the last
    # epoch was reported after S3 came back.
    from mlflow.tracking import MlflowClient

    last = MlflowClient(s3_mlflow.uri).get_metric_history(run.run.info.run_id, "val_accuracy")
    assert max(point.timestamp for point in last) / 1000 > restarted_at, outage
    _checkpoint_tags_point_at_s3(run)
    _kept_checkpoints_are_objects(s3_server, run)
    model = f"{settings.storage.prefix}/mlflow/{run.run.info.run_id}/artifacts/model/MLmodel"
    assert _object_exists(s3_server, ARTIFACTS_BUCKET, model)
