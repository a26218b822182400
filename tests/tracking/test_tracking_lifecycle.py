"""Run lifecycle across processes: shared run ids, exits without finish(), killed drivers."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import Any

import pytest

from tests.fixtures.mlflow_server import MlflowServer
from tests.fixtures.processes import wait_until
from tests.fixtures.tracking import (
    driver_process,
    isolated_settings,
    metric_steps,
    read_line_with,
)

LOGGING_DRIVER = """
    import sys
    import raydeck
    tracker = raydeck.get_tracker()
    tracker.log_metric("{key}", 1.0, step=0)
    tracker.flush()
    print("RUN", tracker.run_id, tracker.resumed, tracker.is_primary, flush=True)
"""


@pytest.mark.timeout(120)
def test_one_heartbeat_a_process_names_all_its_trackers(ray_cluster: None) -> None:
    """Two trackers in one process: the process's heartbeat thread tells the router about both
    in one call (heartbeats.py), the router knows both, and one that finished is no longer
    named while the other still is."""
    import ray

    import raydeck
    from raydeck.tracking.client.heartbeats import PROCESS_HEARTBEAT

    first = raydeck.get_tracker(run_name=f"beat-a-{uuid.uuid4().hex[:6]}")
    second = raydeck.get_tracker(run_name=f"beat-b-{uuid.uuid4().hex[:6]}")
    router = first._open_delivery.heartbeat_router()
    clients = {first._open_delivery.client_id, second._open_delivery.client_id}

    def named() -> set[str]:
        """Who the outstanding call to this router names (the heartbeat thread's record)."""
        pending = PROCESS_HEARTBEAT._pending.get(router._actor_id.hex())
        return {member.client_id for member in pending[1]} if pending else set()

    wait_until(lambda: clients <= named(), 30, "one heartbeat call naming both trackers")
    assert ray.get(router.heartbeat.remote(sorted(clients)), timeout=30) == []
    first.finish()
    # (other trackers of this test process, from earlier tests, may be named too)
    wait_until(lambda: second._open_delivery.client_id in named()
               and first._open_delivery.client_id not in named(), 30,
               "a call naming the tracker still in its run, not the one that finished")
    second.finish()


@pytest.mark.timeout(300)
def test_two_processes_with_one_run_id_share_a_run_and_only_the_primary_ends_it(
    ray_cluster: None, mlflow_client: Any
) -> None:
    env = {"RAYDECK_RUN_ID": f"shared-{uuid.uuid4().hex[:8]}"}
    first = driver_process(LOGGING_DRIVER.format(key="from_first") + """
    sys.stdin.readline()
    tracker.finish()
    """, env)
    run_id, resumed, primary = read_line_with(first, "RUN ").split()
    assert (resumed, primary) == ("False", "True")

    second = driver_process(LOGGING_DRIVER.format(key="from_second") + """
    tracker.finish()
    """, env)
    second_id, resumed, primary = read_line_with(second, "RUN ").split()
    _, errors = second.communicate(timeout=120)
    assert second.returncode == 0, errors[-3000:]
    assert (second_id, resumed, primary) == (run_id, "True", "False")
    assert mlflow_client.get_run(run_id).info.status == "RUNNING"

    first.communicate("go\n", timeout=120)
    assert first.returncode == 0
    run = mlflow_client.get_run(run_id)
    assert run.info.status == "FINISHED"
    assert set(run.data.metrics) >= {"from_first", "from_second"}


@pytest.mark.timeout(300)
def test_a_driver_exiting_without_finish_ends_its_run(ray_cluster: None, mlflow_client: Any
                                                      ) -> None:
    proc = driver_process(LOGGING_DRIVER.format(key="x"))
    run_id = read_line_with(proc, "RUN ").split()[0]
    assert proc.wait(120) == 0
    assert mlflow_client.get_run(run_id).info.status == "FINISHED"
    assert metric_steps(mlflow_client, run_id, "x") == [0]


@pytest.mark.timeout(120)
def test_a_tracker_left_open_after_ray_shutdown_never_starts_ray_again(ray_cluster: None
                                                                       ) -> None:
    """A process that shut Ray down with a tracker still open (a notebook's ``ray.shutdown()``,
    a test session's end): neither the tracker's flusher nor the process's heartbeat calls Ray,
    which would start or join a Ray of its own (Ray's auto-init); what it logs stays buffered.
    The driver watches for 4 s: several flush rounds and heartbeats (1 s apart in tests)."""
    proc = driver_process(LOGGING_DRIVER.format(key="x") + """
    import os
    import time

    import ray

    ray.shutdown()
    tracker.log_metric("x", 2.0, step=1)
    deadline = time.monotonic() + 4
    while time.monotonic() < deadline and not ray.is_initialized():
        time.sleep(0.1)
    print("INITIALIZED", ray.is_initialized(), tracker._open_delivery.buffered().points,
          flush=True)
    os._exit(0)  # no exit hooks: this test is about the threads alone
    """)
    assert read_line_with(proc, "INITIALIZED ").split() == ["False", "1"]
    assert proc.wait(60) == 0


@pytest.mark.timeout(300)
def test_a_killed_driver_leaves_its_run_killed_not_running(ray_cluster: None, mlflow_client: Any
                                                           ) -> None:
    proc = driver_process(LOGGING_DRIVER.format(key="x") + """
    import time
    time.sleep(600)
    """)
    run_id = read_line_with(proc, "RUN ").split()[0]
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait(30)
    wait_until(lambda: mlflow_client.get_run(run_id).info.status == "KILLED", 90,
               "router marks the run KILLED")
    assert metric_steps(mlflow_client, run_id, "x") == [0]


@pytest.mark.timeout(180)
def test_a_run_records_how_it_was_made(ray_cluster: None, mlflow_client: Any,
                                       monkeypatch: pytest.MonkeyPatch) -> None:
    import ray
    from mlflow.environment_variables import MLFLOW_ENABLE_SYSTEM_METRICS_LOGGING

    import raydeck

    monkeypatch.setenv("RAYDECK_TRACKING_SYSTEM_METRICS_INTERVAL_S", "1")

    def system_metrics_landed(run_id: str) -> bool:
        keys = mlflow_client.get_run(run_id).data.metrics
        return all(any(k.startswith("system/") and k.endswith(suffix) for k in keys)
                   for suffix in ("/cpu_utilization_percentage",
                                  "/system_memory_usage_megabytes"))

    with raydeck.get_tracker(run_name="repro") as tracker:
        # Samples every second at this test's interval; wait until they are in MLflow.
        wait_until(lambda: system_metrics_landed(tracker.run_id), 60, "system metrics",
                   interval_s=0.5)
    run = mlflow_client.get_run(tracker.run_id)
    tags = run.data.tags
    assert len(tags["mlflow.source.git.commit"]) == 40
    assert tags["raydeck.git.dirty"] in ("true", "false")
    assert tags["raydeck.version.ray"].startswith("2.")
    assert tags["raydeck.ray_job_id"]
    assert tags["raydeck.entrypoint"]
    # raydeck's own tracker samples by default (RAYDECK_TRACKING_SYSTEM_METRICS=auto), MLflow's
    # switch off, under MLflow's names and its system/<node_id>/ form.
    assert not MLFLOW_ENABLE_SYSTEM_METRICS_LOGGING.get()
    system = [k for k in run.data.metrics if k.startswith("system/")]
    node = ray.util.get_node_ip_address()
    assert f"system/{node}/cpu_utilization_percentage" in system
    assert f"system/{node}/system_memory_usage_percentage" in system
    path = mlflow_client.download_artifacts(tracker.run_id, "raydeck/runtime_env.json")
    env = json.loads(Path(path).read_text())
    assert env["env_vars"]["RAYDECK_TRACKING_URI"].startswith("http://127.0.0.1:")


@pytest.mark.timeout(300)
def test_the_proxy_stops_itself_when_idle(tmp_path: Path, ray_cluster: None,
                                          mlflow_server: MlflowServer) -> None:
    import raydeck
    from raydeck.tracking.proxy.actors import find_router, stop_proxy

    settings = isolated_settings(tmp_path, mlflow_server.uri, idle_timeout_s=3.0)
    try:
        tracker = raydeck.get_tracker(settings=settings)
        tracker.log_metric("x", 1.0)
        tracker.flush()
        assert find_router(settings.ray_namespace) is not None  # busy: it stays
        tracker.finish()
        wait_until(lambda: find_router(settings.ray_namespace) is None, 60, "proxy idle stop")
    finally:
        stop_proxy(settings.ray_namespace, 0)


@pytest.mark.timeout(300)
def test_tracking_status_and_stop_commands(tmp_path: Path, ray_cluster: None,
                                           mlflow_server: MlflowServer) -> None:
    import ray

    import raydeck
    from raydeck.tracking.proxy.actors import find_router, stop_proxy

    settings = isolated_settings(tmp_path, mlflow_server.uri)
    env = {**os.environ, "RAY_ADDRESS": ray.get_runtime_context().gcs_address,
           "RAYDECK_RAY_NAMESPACE": settings.ray_namespace, "COLUMNS": "200"}
    try:
        tracker = raydeck.get_tracker(run_name="cli-status", settings=settings)
        tracker.log_metric("x", 1.0)
        tracker.flush()
        status = subprocess.Popen([sys.executable, "-m", "raydeck.cli", "tracking", "status"],
                                  env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                  text=True)
        shown, errors = status.communicate(timeout=120)
        assert status.returncode == 0, errors
        assert tracker.run_key in shown and tracker.run_id in shown, shown
        # The command's driver ran no metrics harvester (whose thread can crash a process as it
        # exits): its core worker's log, named for its pid, says Ray's stats were off.
        logs = Path(ray._private.worker._global_node.get_session_dir_path()) / "logs"
        driver_log, = logs.glob(f"python-core-driver-*_{status.pid}.log")
        assert "Disabled stats." in driver_log.read_text()
        tracker.finish()
        stopped = subprocess.run([sys.executable, "-m", "raydeck.cli", "tracking", "stop"],
                                 env=env, capture_output=True, text=True, timeout=180)
        assert stopped.returncode == 0, stopped.stderr
        assert "everything was written" in stopped.stdout
        wait_until(lambda: find_router(settings.ray_namespace) is None, 30, "proxy stopped")
    finally:
        stop_proxy(settings.ray_namespace, 0)


@pytest.mark.timeout(180)
def test_last_step_counts_values_still_on_their_way_to_mlflow(ray_cluster: None,
                                                              mlflow_client: Any) -> None:
    import raydeck

    with raydeck.get_tracker(run_name="last-step") as tracker:
        for step in (0, 7, 3):
            tracker.log_metric("loss", 1.0 / (step + 1), step=step)
        # Asked right away: the proxy writes what it holds of the run before answering.
        assert tracker.last_steps(["loss", "never_logged"]) == {"loss": 7, "never_logged": -1}
    assert metric_steps(mlflow_client, tracker.run_id, "loss") == [0, 3, 7]


@pytest.mark.timeout(180)
def test_a_job_restarted_from_an_older_checkpoint_logs_each_step_once(ray_cluster: None,
                                                                       mlflow_client: Any) -> None:
    import raydeck
    from raydeck.train.checkpointing import mark_resumed

    logged_at = int(time.time() * 1000)
    with raydeck.get_tracker(run_name="restarted") as tracker:
        for epoch in range(3):
            tracker.log_metrics({"loss": 1.0 / (epoch + 1)}, step=epoch,
                                timestamp=logged_at + epoch)
        # The restarted job restored epoch 1's checkpoint, which stored epoch 1's point (epoch 2
        # was logged but its checkpoint lost), and trains epochs 2 and 3 again.
        mark_resumed(tracker, 1, [("loss", 0.5, logged_at + 1, 1)])
        for epoch in (2, 3):
            tracker.log_metrics({"loss": 0.01}, step=epoch)
    history = {m.step: m.value for m in mlflow_client.get_metric_history(tracker.run_id, "loss")}
    assert metric_steps(mlflow_client, tracker.run_id, "loss") == [0, 1, 2, 3]
    assert history[2] == pytest.approx(1 / 3) and history[3] == pytest.approx(0.01)
