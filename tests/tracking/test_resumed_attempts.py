"""A worker killed just after a flush, its last batch still on its way to the shard, and the
restarted worker: each step lands once, whichever of them reaches the shard first.

The restarted attempt asks which steps the run holds before the batch in flight arrives, so the
caller's own skip (``Tracker.skip_logged_steps``) cannot drop those steps; the shard keeps one
attempt's values per step (docs/tracking-contract.md, "Idempotence"). The interleaving is made,
not waited for: the killed attempt reaches its shard through a relay actor (the way between the
two processes), which the test holds while the batch is on it and releases once the restarted
attempt has its answer. The trackers, the router and the shard are the real ones, as Ray actors.
"""

from __future__ import annotations

import os
import signal
import threading
import uuid
from pathlib import Path
from typing import Any

import pytest

from raydeck.config.settings import Settings
from tests.fixtures.mlflow_server import MlflowServer
from tests.fixtures.processes import wait_until
from tests.fixtures.tracking import isolated_settings

KEY = "loss"
FLUSHED = range(10)  # logged by the first attempt and acknowledged by the shard
IN_FLIGHT = range(10, 15)  # the first attempt's last batch, on its way when it is killed
RETRAINED = range(10, 20)  # what the restarted attempt logs after its checkpoint
RELAY_TIMEOUT_S = 120.0


class InFlight:
    """The way from one process to its shard's ``ingest``: while held, a batch sent on it stays
    here, sent and not yet received, until released (as on a stalled network)."""

    def __init__(self, namespace: str) -> None:
        from raydeck.tracking.proxy.actors import get_shard

        self._shard = get_shard(namespace, 0)
        self._cv = threading.Condition()
        self._holding = False
        self._held = 0
        self._delivered = 0

    def hold(self) -> None:
        with self._cv:
            self._holding = True

    def held(self) -> int:
        with self._cv:
            return self._held

    def ingest(self, batch: Any) -> Any:
        import ray

        with self._cv:
            held = self._holding
            if held:
                self._held += 1
                self._cv.wait_for(lambda: not self._holding, timeout=RELAY_TIMEOUT_S)
        result = ray.get(self._shard.ingest.remote(batch), timeout=RELAY_TIMEOUT_S)
        if held:
            with self._cv:
                self._delivered += 1
                self._cv.notify_all()
        return result

    def release(self) -> int:
        """Let the held batches go on; returns how many, once the shard has taken them."""
        with self._cv:
            self._holding = False
            self._cv.notify_all()
            self._cv.wait_for(lambda: self._delivered == self._held, timeout=RELAY_TIMEOUT_S)
            return self._delivered


class _Relayed:
    """A shard's actor handle whose ``ingest`` calls go through an :class:`InFlight` relay."""

    def __init__(self, shard: Any, relay: Any) -> None:
        self._shard = shard
        self.ingest = relay.ingest

    def __getattr__(self, name: str) -> Any:
        return getattr(self._shard, name)


class Attempt:
    """One attempt of a job's worker: a process with a tracker in the run."""

    def start(self, key: str, settings: Settings, relay: Any | None) -> int:
        import raydeck

        if relay is not None:
            from raydeck.tracking.client import delivery

            find_shard = delivery.get_shard
            delivery.get_shard = lambda namespace, index: _Relayed(find_shard(namespace, index),
                                                                   relay)
        self.tracker = raydeck.get_tracker(key, settings=settings)
        return os.getpid()

    def log(self, steps: list[int], offset: float) -> None:
        for step in steps:
            self.tracker.log_metric(KEY, step + offset, step=step)

    def flush(self) -> None:
        self.tracker.flush()

    def flush_in_background(self) -> None:
        threading.Thread(target=self.tracker.flush, daemon=True).start()

    def resume(self) -> dict[str, int]:
        """What a restored checkpoint's resume does: ask which steps the run holds, skip them."""
        held = self.tracker.last_steps([KEY])
        self.tracker.skip_logged_steps([KEY])
        return dict(held)

    def finish(self) -> bool:
        return bool(self.tracker.finish().landed)


def _actor_class(cls: type, **options: Any) -> Any:
    """``cls`` as a Ray actor class (typed loosely: Ray's stubs do not know its methods)."""
    import ray

    return ray.remote(**options)(cls)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("late_first", [True, False],
                         ids=["in-flight-batch-lands-first", "restarted-attempt-lands-first"])
def test_a_killed_workers_batch_in_flight_and_its_restart_log_each_step_once(
    tmp_path: Path, ray_cluster: None, mlflow_server: MlflowServer, mlflow_client: Any,
    late_first: bool
) -> None:
    import ray

    import raydeck
    from raydeck.tracking.proxy.actors import stop_proxy

    # Batches leave a process only on flush(): the one in flight is exactly IN_FLIGHT.
    settings = isolated_settings(tmp_path, mlflow_server.uri, shards=1, flush_interval_s=600.0,
                                 system_metrics="off", capture_logs=False)
    key = f"in-flight-{uuid.uuid4().hex[:8]}"
    driver = raydeck.get_tracker(key, run_name="in-flight", settings=settings)  # holds the run
    try:
        relay = _actor_class(InFlight, max_concurrency=4).remote(settings.ray_namespace)
        attempt = _actor_class(Attempt, max_restarts=0)
        first = attempt.remote()
        pid = ray.get(first.start.remote(key, settings, relay), timeout=RELAY_TIMEOUT_S)
        ray.get(first.log.remote(list(FLUSHED), 0.0), timeout=RELAY_TIMEOUT_S)
        ray.get(first.flush.remote(), timeout=RELAY_TIMEOUT_S)
        ray.get(relay.hold.remote(), timeout=RELAY_TIMEOUT_S)
        ray.get(first.log.remote(list(IN_FLIGHT), 0.0), timeout=RELAY_TIMEOUT_S)
        ray.get(first.flush_in_background.remote(), timeout=RELAY_TIMEOUT_S)
        wait_until(lambda: ray.get(relay.held.remote(), timeout=RELAY_TIMEOUT_S) == 1,
                   RELAY_TIMEOUT_S, "the first attempt's last batch on its way")
        os.kill(pid, signal.SIGKILL)

        restarted = attempt.remote()
        ray.get(restarted.start.remote(key, settings, None), timeout=RELAY_TIMEOUT_S)
        # The batch in flight is not in the answer: the restarted attempt logs its steps again.
        assert ray.get(restarted.resume.remote(), timeout=RELAY_TIMEOUT_S) == {KEY: FLUSHED[-1]}
        if late_first:
            assert ray.get(relay.release.remote(), timeout=RELAY_TIMEOUT_S) == 1
        ray.get(restarted.log.remote(list(RETRAINED), 0.5), timeout=RELAY_TIMEOUT_S)
        ray.get(restarted.flush.remote(), timeout=RELAY_TIMEOUT_S)
        if not late_first:
            assert ray.get(relay.release.remote(), timeout=RELAY_TIMEOUT_S) == 1
        assert ray.get(restarted.finish.remote(), timeout=RELAY_TIMEOUT_S)
        assert driver.finish().landed
        history = sorted((m.step, m.value)
                         for m in mlflow_client.get_metric_history(driver.run_id, KEY))
        # Each step once: the first attempt's values where its late batch came first.
        first_attempt = set(IN_FLIGHT) if late_first else set()
        assert history == ([(step, float(step)) for step in FLUSHED]
                           + [(step, float(step) if step in first_attempt else step + 0.5)
                              for step in RETRAINED])
    finally:
        stop_proxy(settings.ray_namespace, 60)
