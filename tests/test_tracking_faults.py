"""Nothing lost: MLflow down, a shard killed, a worker killed; acked points land once."""

from __future__ import annotations

import os
import signal
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from raydeck.config import Settings
from tests.fixtures.mlflow_server import MlflowServer
from tests.fixtures.processes import wait_until
from tests.fixtures.tracking import isolated_settings, metric_steps, start_isolated_server


@pytest.fixture(scope="module")
def killable_mlflow(tmp_path_factory: pytest.TempPathFactory) -> Iterator[MlflowServer]:
    """An MLflow server these tests may kill and restart (never the session's)."""
    server = start_isolated_server(tmp_path_factory.mktemp("killable"))
    yield server
    server.stop()


@pytest.fixture
def isolated(tmp_path: Path, ray_cluster: None, killable_mlflow: MlflowServer
             ) -> Iterator[tuple[MlflowServer, Settings]]:
    """A tracking proxy of its own, writing to an MLflow server this test may kill."""
    from raydeck.tracking.proxy import stop_proxy

    if not killable_mlflow.alive():
        killable_mlflow.start()  # an earlier test failed while the server was down
    settings = isolated_settings(tmp_path, killable_mlflow.uri)
    yield killable_mlflow, settings
    stop_proxy(settings.ray_namespace, 30)


def _log_range(tracker: Any, start: int, stop: int) -> None:
    for step in range(start, stop):
        tracker.log_metric("x", float(step), step=step)


def _shard_state(settings: Settings) -> list[dict[str, Any]]:
    import ray

    from raydeck.tracking.proxy import find_router

    router = find_router(settings.ray_namespace)
    return ray.get(router.status.remote(), timeout=30)["shards"]


@pytest.mark.timeout(300)
def test_no_points_lost_when_mlflow_restarts(isolated: tuple[MlflowServer, Settings]) -> None:
    from mlflow.tracking import MlflowClient

    import raydeck

    server, settings = isolated
    tracker = raydeck.get_tracker(run_name="mlflow-outage", settings=settings)
    _log_range(tracker, 0, 1000)
    tracker.flush()
    server.kill()
    _log_range(tracker, 1000, 3000)
    tracker.flush()  # the shard accepts and spools while MLflow is down
    wait_until(lambda: any(s["state"] == "backing_off" for s in _shard_state(settings)), 60,
               "shard backing off")
    time.sleep(3)
    assert any(s["queued_points"] > 0 and s["last_error"] for s in _shard_state(settings))
    server.start()
    _log_range(tracker, 3000, 4000)
    report = tracker.finish()
    assert report.landed
    assert metric_steps(MlflowClient(server.uri), tracker.run_id, "x") == list(range(4000))


@pytest.mark.timeout(300)
def test_no_points_lost_when_a_shard_is_killed_mid_stream(
    isolated: tuple[MlflowServer, Settings]
) -> None:
    import ray
    from mlflow.tracking import MlflowClient

    import raydeck
    from raydeck.tracking.proxy import get_shard

    server, settings = isolated
    tracker = raydeck.get_tracker(run_name="shard-kill", settings=settings)
    total = 20000
    done = threading.Event()

    def produce() -> None:
        for chunk in range(0, total, 500):
            _log_range(tracker, chunk, chunk + 500)
            time.sleep(0.02)
        done.set()

    producer = threading.Thread(target=produce)
    producer.start()
    time.sleep(0.3)
    shard = get_shard(settings.ray_namespace, tracker._binding.shard_index)
    ray.kill(shard, no_restart=False)
    producer.join(120)
    assert done.is_set()
    report = tracker.finish()
    assert report.landed
    assert metric_steps(MlflowClient(server.uri), tracker.run_id, "x") == list(range(total))


@pytest.mark.timeout(300)
def test_a_killed_shard_replays_its_spool_without_duplicates(
    isolated: tuple[MlflowServer, Settings]
) -> None:
    import ray
    from mlflow.tracking import MlflowClient

    import raydeck
    from raydeck.tracking.proxy import get_shard

    server, settings = isolated
    tracker = raydeck.get_tracker(run_name="spool-replay", settings=settings)
    _log_range(tracker, 0, 500)
    tracker.flush()
    wait_until(lambda: all(s["queued_points"] == 0 for s in _shard_state(settings)), 60,
               "first points written")
    server.kill()
    _log_range(tracker, 500, 3000)
    tracker.flush()  # spooled, not written: MLflow is down
    ray.kill(get_shard(settings.ray_namespace, tracker._binding.shard_index), no_restart=False)
    wait_until(lambda: any(s.get("replay_backlog", 0) > 0 for s in _shard_state(settings)), 60,
               "restarted shard replaying its spool")
    server.start()
    _log_range(tracker, 3000, 3500)
    assert tracker.finish().landed
    assert metric_steps(MlflowClient(server.uri), tracker.run_id, "x") == list(range(3500))


@pytest.mark.timeout(300)
def test_a_sigkilled_worker_keeps_what_it_flushed_and_cannot_end_the_run(
    ray_cluster: None, mlflow_client: Any
) -> None:
    import uuid

    import ray

    import raydeck

    key = f"sigkill-{uuid.uuid4().hex[:8]}"
    driver = raydeck.get_tracker(key, run_name="sigkill-worker")

    @ray.remote(max_restarts=0)
    class Worker:
        def log(self, key: str) -> int:
            import raydeck

            tracker = raydeck.get_tracker(key)
            for step in range(300):
                tracker.log_metric("worker_x", float(step), step=step)
            tracker.flush()
            for step in range(300, 400):  # buffered, never flushed: dies with the process
                tracker.log_metric("worker_x", float(step), step=step)
            return os.getpid()

    worker = Worker.remote()
    pid = ray.get(worker.log.remote(key), timeout=120)
    os.kill(pid, signal.SIGKILL)
    time.sleep(3)
    assert mlflow_client.get_run(driver.run_id).info.status == "RUNNING"
    driver.finish()
    wait_until(lambda: mlflow_client.get_run(driver.run_id).info.status == "FINISHED", 60,
               "run ended once the dead worker was presumed gone")
    steps = metric_steps(mlflow_client, driver.run_id, "worker_x")
    assert steps[:300] == list(range(300))
    assert len(steps) == len(set(steps))
