"""A router that forgot its trackers, or stops itself while one attaches (issue 53).

Two interleavings that left runs RUNNING or a tracker without a proxy on a loaded machine:

- A heartbeat answered "unknown" after its tracker's own detach (sent before the detach, or to a
  router restarted since the tracker attached): the heartbeat thread attached the departed
  tracker again, which reopened the run its detach had just ended, and nobody ended it again.
- The idle self-stop decided "idle" while an attach was under way (its MLflow look-up runs
  outside the router's lock) or while it asked the shards whether they were drained (seconds
  on a loaded machine): it then killed the proxy the new tracker had just bound to.

Each is triggered here deterministically: by holding an attach in flight (the router's logic,
with an MLflow look-up that waits for the test), or by handing the tracker the late heartbeat
answer at the moment the race gives it (real Ray actors, real MLflow server).

And two a dead or unreachable shard caused: a shard killed for good was never created again
(the router and its trackers kept calling the dead actor: its runs' data waited for ever), and
a run's end decided while its shard was unreachable lived only in the router's memory, so a
router dying then lost it (the run stayed RUNNING).
"""

from __future__ import annotations

import re
import threading
import time
import uuid
from pathlib import Path
from typing import Any

import pytest

from raydeck.errors import TrackingUnavailableError
from raydeck.tracking.client import heartbeats
from raydeck.tracking.messages import AttachRequest, ProcessInfo, ProxyConfig
from raydeck.tracking.proxy.membership import MembershipStore
from raydeck.tracking.proxy.outbox import Control
from raydeck.tracking.proxy.router import STOPPING, RouterCore
from raydeck.tracking.proxy.run_lookup import Lookup
from tests.fixtures.mlflow_server import MlflowServer
from tests.fixtures.processes import wait_until
from tests.fixtures.tracking import isolated_settings, metric_steps


def _driver(pid: int) -> AttachRequest:
    process = ProcessInfo(role="driver", role_key=f"driver:job:{pid}", job_id="job",
                          node_ip="10.0.0.1", hostname="node", pid=pid)
    return AttachRequest(client_id=f"client-{pid}", process=process, tracking_uri="http://m",
                         run_key=f"run-{pid}", run_name=None, experiment="Default",
                         mode="rank_zero")


def _actor(pid: int, run_key: str) -> AttachRequest:
    process = ProcessInfo(role="task", role_key=f"task:job:{pid}", job_id="job",
                          node_ip="10.0.0.1", hostname="node", pid=pid, actor_id=f"actor-{pid}")
    return AttachRequest(client_id=f"client-{pid}", process=process, tracking_uri="http://m",
                         run_key=run_key, run_name=None, experiment="Default", mode="rank_zero")


def _router(sent: list[Control], lookup: Any = None, idle_timeout_s: float = 0.0,
            store: MembershipStore | None = None, gone: set[str] | None = None) -> RouterCore:
    config = ProxyConfig(namespace="test", tracking_uri="http://m", artifact_location="",
                         shards=1, writers=1, spool_dir="/nonexistent", fsync=False,
                         lost_after_s=60.0, idle_timeout_s=idle_timeout_s,
                         heartbeat_interval_s=5.0, mlflow_timeout_s=20, retry_max_s=5.0)
    return RouterCore(config, sent.append,
                      lookup or (lambda key, experiment: Lookup(known=True)),
                      lambda everyone, quiet: set(gone or ()), store)


@pytest.mark.timeout(30)
def test_a_restarted_router_ends_the_run_whose_primary_left_and_whose_worker_died(
        tmp_path: Path) -> None:
    """The chaos soak's stuck run (seed 5300009): the driver raised after its actor was
    SIGKILLed and left the run FAILED while the dead actor still took part; then the router
    was killed. The restarted router knew nothing of the run and nobody attached again: the run
    stayed RUNNING. Now it reads its predecessor's membership and ends the run FAILED."""
    store = tmp_path / "router.db"
    sent: list[Control] = []
    first = _router(sent, idle_timeout_s=900.0, store=MembershipStore(store))
    first.attach(_driver(1))
    first.attach(_actor(2, "run-1"))
    assert first.detach("client-1", "FAILED") == []  # the actor still takes part
    assert [r["state"] for r in first.status()] == ["active"]
    sent.clear()
    # Ray restarted the router: a new one, on the same disk; Ray reports the actor dead.
    second = _router(sent, idle_timeout_s=900.0, store=MembershipStore(store),
                     gone={"task:job:2"})
    assert [(r["key"], r["participants"]) for r in second.status()] == [("run-1", 1)]
    assert second.heartbeat(["client-2"]) == []  # a living one would not attach again
    second.reap()
    assert [(c.run_key, c.kind, c.payload) for c in sent] == [("run-1", "end", "FAILED")]
    # Ended: a third router starts with nothing open.
    third = _router([], idle_timeout_s=900.0, store=MembershipStore(store))
    assert third.status() == []


@pytest.mark.timeout(30)
def test_the_idle_stop_never_takes_a_proxy_an_attach_is_binding_to() -> None:
    looking_up = threading.Event()
    answer = threading.Event()

    def slow_lookup(key: str, experiment: str) -> Lookup:
        looking_up.set()
        assert answer.wait(20)
        return Lookup(known=True)

    router = _router([], slow_lookup)
    attached: list[Any] = []
    attach = threading.Thread(target=lambda: attached.append(router.attach(_driver(1))))
    attach.start()
    assert looking_up.wait(20)
    # The attach is under way (its MLflow look-up, outside the lock); no run exists yet.
    assert not router.reap()
    assert not router.claim_stop()
    answer.set()
    attach.join(20)
    assert attached and attached[0].is_primary
    assert not router.reap() and not router.claim_stop()  # its run is active
    assert router.detach("client-1", "FINISHED") == ["run-1"]
    router.reap()  # idle from now (idle_timeout_s=0)
    assert router.reap() and router.claim_stop()
    # Decided: a tracker arriving now is told to attach to the next proxy, not bound to this.
    with pytest.raises(TrackingUnavailableError, match=re.escape(STOPPING)):
        router.attach(_driver(2))


@pytest.mark.timeout(30)
def test_a_late_heartbeat_or_attach_of_a_departed_tracker_never_reopens_its_run() -> None:
    sent: list[Control] = []
    router = _router(sent, idle_timeout_s=900.0)
    router.attach(_driver(1))
    assert router.detach("client-1", "FINISHED") == ["run-1"]
    # A heartbeat sent before the detach, answered after it: late, not "forgotten".
    assert router.heartbeat(["client-1"]) == []
    sent.clear()
    # A reconnect of the departed tracker that crossed its detach: no reopen, no join.
    binding = router.attach(_driver(1))
    assert binding.run_key == "run-1" and not binding.is_primary
    assert [c.kind for c in sent] == []
    assert [r["state"] for r in router.status()] == ["ended"]
    # Its detach again (the first answer lost): the same answer, no second end.
    assert router.detach("client-1", "FINISHED") == ["run-1"]
    assert sent == []


def _router_run(namespace: str, key: str) -> dict[str, Any]:
    import ray

    from raydeck.tracking.proxy.actors import find_router

    router = find_router(namespace)
    assert router is not None
    runs = {r["key"]: r for r in ray.get(router.status.remote(), timeout=60)["runs"]}
    return dict(runs.get(key, {}))


@pytest.mark.timeout(300)
@pytest.mark.parametrize("membership", ["kept", "lost"])
def test_the_router_restarted_while_a_tracker_logs_then_finish(
        tmp_path: Path, ray_cluster: None, mlflow_server: MlflowServer, membership: str) -> None:
    """The router killed (Ray restarts it) between two halves of the logging.

    - kept: the restarted router reads its predecessor's membership and knows the tracker.
    - lost: its membership file gone too, it starts empty; the tracker's next heartbeat is
      answered "unknown", and that answer reaches the heartbeat thread only after the
      tracker's detach (its finish) attached it again and left, as on a loaded machine.

    The run ends FINISHED, once, with every step exactly once."""
    import ray
    from mlflow.tracking import MlflowClient

    from raydeck.tracking.proxy.actors import find_router, stop_proxy

    # Heartbeats only where the test places them: the interleaving is the test's, not luck's.
    settings = isolated_settings(tmp_path, mlflow_server.uri, shards=1,
                                 heartbeat_interval_s=3600.0, system_metrics_interval_s=0.0,
                                 capture_logs=False)
    namespace = settings.ray_namespace
    try:
        tracker = _tracker_with_steps(settings, "router-restarted", "x", range(300))
        key = tracker.run_key
        tracker.flush()
        old = find_router(namespace)
        assert old is not None
        if membership == "lost":
            for path in (settings.data_dir / "spool").glob("router.db*"):
                path.unlink()
        ray.kill(old, no_restart=False)
        participants = 1 if membership == "kept" else None
        wait_until(lambda: _answers(namespace) and _router_run(namespace, key).get(
            "participants") == participants, 120, "the router restarted")
        _log_steps(tracker, "x", range(300, 600))
        tracker.flush()
        delivery = tracker._open_delivery
        router = find_router(namespace)
        assert router is not None
        late = router.heartbeat.remote([delivery.client_id])
        assert ray.get(late, timeout=60) == ([] if membership == "kept"
                                             else [delivery.client_id])
        # The finish's own detach; a router that forgot the tracker makes it attach again
        # (the run is found in MLflow and reopened) and leave, ending the run.
        ended = delivery.detach("FINISHED", time.monotonic() + 60)
        assert ended == [key]
        # Now the process's heartbeat thread reads that answer, as its next round would.
        heartbeats.answered(late, [delivery])
        run = _router_run(namespace, key)
        assert (run["state"], run["participants"]) == ("ended", 0), run
        report = tracker.finish()
        assert report.landed
        client = MlflowClient(mlflow_server.uri)
        assert client.get_run(tracker.run_id).info.status == "FINISHED"
        history = client.get_metric_history(tracker.run_id, "x")
        assert metric_steps(client, tracker.run_id, "x") == list(range(600))
        assert all(m.value == float(m.step) for m in history)
        assert _router_run(namespace, key)["state"] == "ended"
    finally:
        stop_proxy(namespace, 30)


@pytest.mark.timeout(300)
def test_a_run_whose_primary_left_ends_when_its_killed_worker_is_found_after_a_router_restart(
        tmp_path: Path, ray_cluster: None, mlflow_server: MlflowServer) -> None:
    """Real actors: the driver's actor SIGKILLed, the driver's finish("FAILED") (the run waits
    for the actor, which Ray has not reported yet), then the router killed and restarted. The
    run ends FAILED, with everything acknowledged, exactly once."""
    import os
    import signal

    import ray
    from mlflow.tracking import MlflowClient

    import raydeck
    from raydeck.tracking.proxy.actors import find_router, stop_proxy

    settings = isolated_settings(tmp_path, mlflow_server.uri, shards=1,
                                 system_metrics_interval_s=0.0, capture_logs=False)
    namespace = settings.ray_namespace

    @ray.remote(num_cpus=0)
    class Worker:
        def log(self, run_key: str, settings: Any) -> int:
            tracker = raydeck.get_tracker(run_key, settings=settings)
            _log_steps(tracker, "worker", range(50))
            tracker.flush()
            return os.getpid()

    try:
        tracker = _tracker_with_steps(settings, "primary-left", "driver", range(50))
        key = tracker.run_key
        worker = Worker.remote()  # type: ignore[attr-defined]
        pid = ray.get(worker.log.remote(key, settings), timeout=120)
        assert _router_run(namespace, key)["participants"] == 2
        os.kill(pid, signal.SIGKILL)
        assert tracker.finish("FAILED").landed
        run = _router_run(namespace, key)
        if run["state"] == "active":  # the usual case: Ray has not reported the actor yet
            router = find_router(namespace)
            assert router is not None
            ray.kill(router, no_restart=False)
        client = MlflowClient(mlflow_server.uri)
        wait_until(lambda: client.get_run(tracker.run_id).info.status != "RUNNING", 120,
                   "the run ended")
        assert client.get_run(tracker.run_id).info.status == "FAILED"
        for metric in ("driver", "worker"):
            assert metric_steps(client, tracker.run_id, metric) == list(range(50))
    finally:
        stop_proxy(namespace, 30)


def _answers(namespace: str) -> bool:
    import ray

    from raydeck.tracking.proxy.actors import find_router

    router = find_router(namespace)
    try:
        return router is not None and isinstance(
            ray.get(router.status.remote(), timeout=10), dict)
    except (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError):
        return False


def _log_steps(tracker: Any, metric: str, steps: range) -> None:
    """``metric`` = step at each of ``steps``: any value lost or written twice shows."""
    for step in steps:
        tracker.log_metric(metric, float(step), step=step)


def _tracker_with_steps(settings: Any, name: str, metric: str, steps: range) -> Any:
    """A tracker of a new run ``name-<random>`` that logged ``metric`` at ``steps``."""
    import raydeck

    tracker = raydeck.get_tracker(run_name=f"{name}-{uuid.uuid4().hex[:6]}", settings=settings)
    _log_steps(tracker, metric, steps)
    return tracker


@pytest.mark.timeout(300)
def test_a_shard_killed_for_good_is_created_again_and_its_run_lands_exactly_once(
        tmp_path: Path, ray_cluster: None, mlflow_server: MlflowServer) -> None:
    """The run's shard killed with ``no_restart`` between two halves of the logging: Ray
    never restarts it, so the router creates it again (same name, same spool); the tracker
    finds it when it attaches again, and the run ends FINISHED with every step once.

    A process attaching to the run at once, while the shard is dead (the chaos soak's plain
    job, seed 5300033: its actor's ``get_tracker`` raised), finds the shard too."""
    import ray
    from mlflow.tracking import MlflowClient

    from raydeck.tracking.client.attach import attach_guest
    from raydeck.tracking.proxy.actors import get_shard, stop_proxy

    settings = isolated_settings(tmp_path, mlflow_server.uri, shards=1,
                                 system_metrics_interval_s=0.0, capture_logs=False)
    try:
        tracker = _tracker_with_steps(settings, "shard-killed", "x", range(300))
        tracker.flush()  # spooled by the shard, maybe not yet written to MLflow
        ray.kill(get_shard(settings.ray_namespace, 0), no_restart=True)
        guest = attach_guest(tracker.run_key, settings)
        _log_steps(guest, "guest", range(50))
        guest.finish()
        _log_steps(tracker, "x", range(300, 600))
        assert tracker.finish().landed
        client = MlflowClient(mlflow_server.uri)
        assert client.get_run(tracker.run_id).info.status == "FINISHED"
        assert metric_steps(client, tracker.run_id, "x") == list(range(600))
        assert metric_steps(client, tracker.run_id, "guest") == list(range(50))
    finally:
        stop_proxy(settings.ray_namespace, 30)


@pytest.mark.timeout(300)
def test_a_runs_end_decided_while_its_shard_is_unreachable_survives_the_routers_death(
        tmp_path: Path, ray_cluster: None, mlflow_server: MlflowServer) -> None:
    """The run's end is decided while its shard is unreachable, then the router dies: the
    restarted router still delivers the end once the shard is back; the run ends FINISHED.

    Held, not raced: the router is stopped for good first (no revival can intervene), the
    shard killed, and its name taken by an actor that refuses every call; a new router is
    created for the tracker's detach. Ray restarts that router after ``ray.kill``; then the
    test frees the shard's name and the restarted router creates the shard again."""
    import ray
    from mlflow.tracking import MlflowClient

    from raydeck.tracking.client import lifecycle
    from raydeck.tracking.proxy.actors import find_router, get_shard, shard_name, stop_proxy

    @ray.remote(num_cpus=0)
    class Unreachable:
        """Holds a shard's name and takes no run update: the shard is unreachable."""

        def ping(self) -> bool:
            raise ConnectionError("held unreachable by the test")

        def control(self, run_key: str, kind: str, payload: Any) -> None:
            raise ConnectionError("held unreachable by the test")

        def resolve(self, run_key: str, timeout_s: float) -> None:
            return None  # as a shard that cannot reach MLflow yet

        def stats(self) -> dict[str, Any]:
            return {"index": 0, "state": "held unreachable by the test"}

    settings = isolated_settings(tmp_path, mlflow_server.uri, shards=1,
                                 heartbeat_interval_s=3600.0, system_metrics_interval_s=0.0,
                                 capture_logs=False)
    namespace = settings.ray_namespace
    client = MlflowClient(mlflow_server.uri)
    tracker = _tracker_with_steps(settings, "end-unreachable", "x", range(50))
    try:
        tracker.flush()
        run_id = tracker.run_id  # asked now: the shard that knows it is held away below
        wait_until(lambda: metric_steps(client, run_id, "x") == list(range(50)), 60,
                   "the steps written")
        router = find_router(namespace)
        assert router is not None
        ray.kill(router, no_restart=True)
        ray.kill(get_shard(namespace, 0), no_restart=True)
        wait_until(lambda: _name_free(namespace), 30, "the shard's name freed")
        holder = Unreachable.options(  # type: ignore[attr-defined]
            name=shard_name(0), namespace=namespace, lifetime="detached").remote()
        # The finish's own detach: the tracker attaches to a new router, which decides the end
        # and cannot hand it to the shard.
        delivery = tracker._open_delivery
        assert delivery.detach("FINISHED", time.monotonic() + 60) == [tracker.run_key]
        assert _router_run(namespace, tracker.run_key)["state"] == "ended"
        router = find_router(namespace)
        assert router is not None
        ray.kill(router, no_restart=False)
        wait_until(lambda: _answers(namespace), 60, "the router restarted")
        assert client.get_run(run_id).info.status == "RUNNING"
        ray.kill(holder, no_restart=True)  # the shard reachable again: created anew
        wait_until(lambda: client.get_run(run_id).info.status != "RUNNING", 60,
                   "the run's end written")
        assert client.get_run(run_id).info.status == "FINISHED"
        assert metric_steps(client, run_id, "x") == list(range(50))
    finally:
        lifecycle.forget(tracker)
        tracker._open_delivery.close()
        stop_proxy(namespace, 30)


def _name_free(namespace: str) -> bool:
    import ray

    from raydeck.tracking.proxy.actors import shard_name

    try:
        ray.get_actor(shard_name(0), namespace=namespace)
    except ValueError:
        return True
    return False
