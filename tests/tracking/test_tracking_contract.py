"""The tracking contract (docs/tracking-contract.md), one test per fault a cluster produces.

Each test kills, freezes or starves a real process (MLflow server, S3 server, proxy actors,
Ray workers, a driver), then counts through MLflow's API what landed: every key's exact steps,
no duplicates, the run's final status, and that a second run on the same shard got all of its
data meanwhile. Every proxy here is isolated (its own Ray namespace, spool and MLflow server,
one shard so that every run of the test shares it). A Ray Train worker returning without
``finish()`` is proven on tests/tracking/test_tracking_modes.py's all_ranks fit (one Ray Train fit
fewer).
"""

from __future__ import annotations

import dataclasses
import logging
import os
import signal
import subprocess
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from raydeck.config.settings import Settings
from tests.fixtures.mlflow_server import MlflowServer
from tests.fixtures.processes import wait_until
from tests.fixtures.tracking import (
    driver_process,
    isolated_settings,
    participants,
    read_line_with,
)


@pytest.fixture
def proxy(tmp_path: Path, ray_cluster: None, killable_mlflow: MlflowServer
          ) -> Iterator[tuple[MlflowServer, Settings]]:
    """A tracking proxy of its own (one shard), writing to an MLflow server the test may kill."""
    from raydeck.tracking.proxy.actors import stop_proxy

    if not killable_mlflow.alive():
        killable_mlflow.start()  # an earlier test failed while the server was down
    settings = isolated_settings(tmp_path, killable_mlflow.uri, shards=1)
    yield killable_mlflow, settings
    if not killable_mlflow.alive():
        killable_mlflow.start()
    stop_proxy(settings.ray_namespace, 60)


def _client(server: MlflowServer) -> Any:
    from mlflow.tracking import MlflowClient

    return MlflowClient(server.uri)


def _log_range(tracker: Any, key: str, start: int, stop: int) -> None:
    for step in range(start, stop):
        tracker.log_metric(key, float(step), step=step)


def _assert_exact(client: Any, run_id: str, key: str, steps: range | list[int]) -> None:
    """MLflow holds ``key`` at exactly these steps, each once, with value == step."""
    history = client.get_metric_history(run_id, key)
    assert sorted(m.step for m in history) == list(steps)
    assert all(m.value == float(m.step) for m in history)


def _shards(settings: Settings) -> list[dict[str, Any]]:
    import ray

    from raydeck.tracking.proxy.actors import find_router

    router = find_router(settings.ray_namespace)
    assert router is not None
    return list(ray.get(router.status.remote(), timeout=60)["shards"])


def _router_runs(settings: Settings) -> dict[str, dict[str, Any]]:
    import ray

    from raydeck.tracking.proxy.actors import find_router

    router = find_router(settings.ray_namespace)
    if router is None:  # not created yet
        return {}
    return {run["key"]: run for run in ray.get(router.status.remote(), timeout=60)["runs"]}


def _backing_off(settings: Settings) -> bool:
    return any(s.get("state") == "backing_off" for s in _shards(settings))


class _SecondRun:
    """A run on the same shard that keeps logging through the fault: it must be unaffected."""

    def __init__(self, settings: Settings, name: str) -> None:
        import raydeck

        self.tracker = raydeck.get_tracker(run_name=name, settings=settings)
        self.logged = 0

    def log(self, n: int) -> None:
        _log_range(self.tracker, "other", self.logged, self.logged + n)
        self.logged += n

    def check(self, client: Any) -> None:
        assert self.tracker.finish().landed
        _assert_exact(client, self.tracker.run_id, "other", range(self.logged))
        assert client.get_run(self.tracker.run_id).info.status == "FINISHED"


@pytest.mark.timeout(300)
def test_mlflow_killed_and_restarted(proxy: tuple[MlflowServer, Settings]) -> None:
    import raydeck

    server, settings = proxy
    tracker = raydeck.get_tracker(run_name="mlflow-killed", settings=settings)
    second = _SecondRun(settings, "mlflow-killed-neighbour")
    _log_range(tracker, "x", 0, 1_000)
    second.log(100)
    tracker.flush()
    server.kill()
    _log_range(tracker, "x", 1_000, 3_000)
    second.log(100)
    tracker.flush()  # accepted and spooled while MLflow is down
    wait_until(lambda: _backing_off(settings), 120, "shard backing off")
    server.start()
    _log_range(tracker, "x", 3_000, 4_000)
    report = tracker.finish()
    assert report.landed and not report.dead_letters
    client = _client(server)
    _assert_exact(client, tracker.run_id, "x", range(4_000))
    assert client.get_run(tracker.run_id).info.status == "FINISHED"
    second.check(client)


@pytest.mark.timeout(300)
def test_mlflow_frozen_longer_than_every_client_timeout(proxy: tuple[MlflowServer, Settings]
                                                       ) -> None:
    import raydeck

    server, settings = proxy
    # Every MLflow client of the proxy gives up after 5 s (the router's lookups too: theirs is
    # the shorter of this and run_lookup.LOOKUP_TIMEOUT_S), so the freeze outlasts them all in
    # seconds.
    settings = dataclasses.replace(
        settings, tracking=dataclasses.replace(settings.tracking, mlflow_timeout_s=5))
    tracker = raydeck.get_tracker(run_name="mlflow-frozen", settings=settings)
    second = _SecondRun(settings, "mlflow-frozen-neighbour")
    _log_range(tracker, "x", 0, 500)
    tracker.flush()
    freeze_s = settings.tracking.mlflow_timeout_s + 3
    errors_before = sum(s["write_errors"] for s in _shards(settings))
    assert server.process is not None
    server.process.signal(signal.SIGSTOP)
    try:
        frozen_until = time.monotonic() + freeze_s
        step = 500

        def writes_timed_out() -> bool:
            # A frozen server still accepts connections (the kernel does): every write that
            # failed meanwhile waited out its timeout.
            return sum(s["write_errors"] for s in _shards(settings)) > errors_before

        # Keeps logging through the freeze, until it is longer than every client timeout and
        # a write of the shard has timed out.
        while time.monotonic() < frozen_until or not writes_timed_out():
            assert time.monotonic() < frozen_until + 60, "no MLflow request timed out"
            _log_range(tracker, "x", step, step + 100)
            second.log(10)
            tracker.flush()
            step += 100
            time.sleep(0.5)
        # Nothing waits for MLflow under the router's lock: this process never went silent.
        run = _router_runs(settings)[tracker.run_key]
        assert run["state"] == "active" and run["participants"] == 1
    finally:
        server.process.signal(signal.SIGCONT)
    report = tracker.finish()
    assert report.landed
    client = _client(server)
    _assert_exact(client, tracker.run_id, "x", range(step))
    assert client.get_run(tracker.run_id).info.status == "FINISHED"
    second.check(client)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("path", ["server", "direct"])
def test_shard_and_router_sigkilled_mid_stream(proxy: tuple[MlflowServer, Settings], path: str
                                               ) -> None:
    """``direct``: the shard writes the server's database itself (``write_db``), so it is
    killed inside MLflow's database transactions, not while a server finishes them."""
    import ray

    import raydeck
    from raydeck.config.secrets import Secret
    from raydeck.tracking.proxy.actors import ROUTER_NAME, get_shard

    server, settings = proxy
    if path == "direct":
        settings = dataclasses.replace(settings, tracking=dataclasses.replace(
            settings.tracking, write_db=Secret(server.backend_store_uri)))
    tracker = raydeck.get_tracker(run_name="proxy-killed", settings=settings)
    second = _SecondRun(settings, "proxy-killed-neighbour")
    total = 20_000
    produced = threading.Event()

    def produce() -> None:
        for chunk in range(0, total, 500):
            _log_range(tracker, "x", chunk, chunk + 500)
            second.log(5)
            time.sleep(0.02)
        produced.set()

    producer = threading.Thread(target=produce)
    producer.start()
    wait_until(lambda: sum(s.get("points_received", 0) for s in _shards(settings)) > 2_000,
               60, "points flowing")
    ray.kill(get_shard(settings.ray_namespace, 0), no_restart=False)
    ray.kill(ray.get_actor(ROUTER_NAME, namespace=settings.ray_namespace), no_restart=False)
    producer.join(240)
    assert produced.is_set()
    report = tracker.finish()
    assert report.landed
    client = _client(server)
    _assert_exact(client, tracker.run_id, "x", range(total))
    assert client.get_run(tracker.run_id).info.status == "FINISHED"
    second.check(client)


@pytest.mark.timeout(300)
def test_a_shard_killed_while_mlflow_is_down_replays_its_spool_once(
        proxy: tuple[MlflowServer, Settings]) -> None:
    import ray

    import raydeck
    from raydeck.tracking.proxy.actors import get_shard

    server, settings = proxy
    tracker = raydeck.get_tracker(run_name="spool-replay", settings=settings)
    _log_range(tracker, "x", 0, 500)
    tracker.flush()
    wait_until(lambda: all(s["queued_entities"] == 0 for s in _shards(settings)), 60,
               "first points written")
    server.kill()
    _log_range(tracker, "x", 500, 3000)
    tracker.flush()  # spooled, not written: MLflow is down
    ray.kill(get_shard(settings.ray_namespace, 0), no_restart=False)
    wait_until(lambda: any(s.get("replay_backlog", 0) > 0 for s in _shards(settings)), 60,
               "restarted shard replaying its spool")
    server.start()
    _log_range(tracker, "x", 3000, 3500)
    assert tracker.finish().landed
    _assert_exact(_client(server), tracker.run_id, "x", range(3500))


@pytest.mark.timeout(300)
def test_a_sigkilled_worker_keeps_what_it_flushed_and_cannot_end_the_run(
    ray_cluster: None, mlflow_client: Any
) -> None:
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
    # Ray reports the actor dead; the router drops it from the run, which stays open.
    wait_until(lambda: participants(key) == 1, 60, "dead worker dropped from the run")
    assert mlflow_client.get_run(driver.run_id).info.status == "RUNNING"
    driver.finish()
    assert mlflow_client.get_run(driver.run_id).info.status == "FINISHED"
    steps = sorted(m.step for m in mlflow_client.get_metric_history(driver.run_id, "worker_x"))
    assert steps[:300] == list(range(300))
    assert len(steps) == len(set(steps))


SIGTERMED_EXIT_TIMEOUT_S = 60
# Longer than the signal handler's own wait for the hand-over (3 s), well within the exit's
# grace (lifecycle.SIGNAL_EXIT_GRACE_S, 10 s from the signal).
PROXY_FROZEN_S = 5.0
SIGTERM_DRIVER = """
    import sys, time
    import raydeck
    tracker = raydeck.get_tracker(run_name="sigterm-driver")
    for step in range(500):
        tracker.log_metric("x", float(step), step=step)
    tracker.flush()
    for step in range(500, 800):  # still in the buffer when the signal comes
        tracker.log_metric("x", float(step), step=step)
    print("RUN", tracker.run_id, flush=True)
    time.sleep(600)
"""


def _sigterm(driver: subprocess.Popen[str]) -> str:
    """SIGTERM the driver (what `ray job stop` sends) and wait for it to exit (killed if not);
    returns what it printed after."""
    driver.send_signal(signal.SIGTERM)
    try:
        printed, errors = driver.communicate(timeout=SIGTERMED_EXIT_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        driver.kill()
        _, errors = driver.communicate()
        raise AssertionError(f"the driver still ran {SIGTERMED_EXIT_TIMEOUT_S} s after SIGTERM: "
                             f"{errors[-3000:]}") from None
    # Ray's own SIGTERM handler in a driver exits with the signal's number (raydeck's runs
    # first, then hands over to it).
    assert driver.returncode in (signal.SIGTERM, -signal.SIGTERM), errors[-3000:]
    return printed


def _assert_ended_killed_with_everything(mlflow_client: Any, run_id: str) -> None:
    wait_until(lambda: mlflow_client.get_run(run_id).info.status != "RUNNING", 60,
               "run ended")
    assert mlflow_client.get_run(run_id).info.status == "KILLED"
    _assert_exact(mlflow_client, run_id, "x", range(800))


@pytest.mark.timeout(300)
def test_a_sigtermed_driver_ends_its_run_killed_with_its_data(ray_cluster: None,
                                                              mlflow_client: Any) -> None:
    driver = driver_process(SIGTERM_DRIVER)
    run_id = read_line_with(driver, "RUN ")
    _sigterm(driver)
    _assert_ended_killed_with_everything(mlflow_client, run_id)


def _proxy_pids() -> list[int]:
    """The session cluster's tracking routers and shards (every namespace's)."""
    import ray
    from ray.util.state import list_actors

    from raydeck.tracking.proxy.actors import ROUTER_NAME, SHARD_NAME_PREFIX

    alive = list_actors(address=ray.get_runtime_context().gcs_address,
                        filters=[("state", "=", "ALIVE")], limit=10_000)
    return [actor.pid for actor in alive
            if actor.name == ROUTER_NAME or (actor.name or "").startswith(SHARD_NAME_PREFIX)]


def _signal_all(pids: list[int], sig: signal.Signals) -> None:
    for pid in pids:
        os.kill(pid, sig)


@pytest.mark.timeout(300)
def test_a_sigtermed_driver_whose_proxy_is_slow_hands_its_data_over_and_ends_killed(
        ray_cluster: None, mlflow_client: Any) -> None:
    """The proxy frozen for 5 s around the SIGTERM: the signal's own hand-over times out, the
    exit keeps trying until the proxy answers (never finishing the run a second time,
    FINISHED), then exits with the signal; no tracker thread calls Ray after Ray's exit hook
    (which would start a new local Ray in the dying driver)."""
    driver = driver_process(SIGTERM_DRIVER)
    run_id = read_line_with(driver, "RUN ")
    pids = _proxy_pids()
    assert pids, "the driver's tracker started the proxy"
    _signal_all(pids, signal.SIGSTOP)
    thaw = threading.Timer(PROXY_FROZEN_S, _signal_all, (pids, signal.SIGCONT))
    thaw.start()
    try:
        _sigterm(driver)
    finally:
        thaw.cancel()
        _signal_all(pids, signal.SIGCONT)
    _assert_ended_killed_with_everything(mlflow_client, run_id)


SIGTERM_INTO_EXCEPTION_DRIVER = SIGTERM_DRIVER.replace("""    time.sleep(600)
""", """    try:
        time.sleep(600)
    except BaseException:
        # Ray's SIGTERM handler (called after raydeck's) raises SystemExit here; a framework
        # ends its run FAILED on it, as Lightning's fit does (`RaydeckLogger.finalize("failed")`).
        print("ENDING FAILED", flush=True)
        tracker.finish("FAILED", wait=False)
        raise
""")


@pytest.mark.timeout(300)
def test_a_sigtermed_driver_ends_killed_when_its_framework_later_finishes_failed(
        ray_cluster: None, mlflow_client: Any) -> None:
    """The chaos soak's seed 5300055, held: the proxy frozen for 5 s, so the signal's own
    hand-over gives up; the exception the signal became then finishes the run FAILED once the
    proxy is back. The run was active when the driver was signalled, so it ends KILLED."""
    driver = driver_process(SIGTERM_INTO_EXCEPTION_DRIVER)
    run_id = read_line_with(driver, "RUN ")
    pids = _proxy_pids()
    _signal_all(pids, signal.SIGSTOP)
    thaw = threading.Timer(PROXY_FROZEN_S, _signal_all, (pids, signal.SIGCONT))
    thaw.start()
    try:
        printed = _sigterm(driver)
    finally:
        thaw.cancel()
        _signal_all(pids, signal.SIGCONT)
    assert "ENDING FAILED" in printed
    _assert_ended_killed_with_everything(mlflow_client, run_id)


def _restarting_train_fn(config: dict[str, Any]) -> None:
    """Three epochs with raydeck checkpoints; once, while the test holds MLflow down, rank 0
    dies (SIGKILL) right after Ray Train committed epoch 1's checkpoint, as it is about to
    record that checkpoint in the run's tags: a worker group restart from epoch 1."""
    import ray.train
    import torch

    import raydeck
    from raydeck.train.checkpointing import CHECKPOINT_TAG_PREFIX, report_epoch, restore

    marker = Path(config["marker"])
    tracker = raydeck.get_tracker(settings=config["settings"])
    if ray.train.get_context().get_world_rank() == 0 and not marker.exists():
        set_tags = tracker.set_tags

        def dies_recording_epoch_1(tags: dict[str, Any], **kwargs: Any) -> None:
            if f"{CHECKPOINT_TAG_PREFIX}epoch_1" in tags:
                wait_for = Path(config["mlflow_down"])
                deadline = time.monotonic() + 120
                while not wait_for.exists() and time.monotonic() < deadline:
                    time.sleep(0.2)
                marker.write_text("died once")
                os.kill(os.getpid(), signal.SIGKILL)
            set_tags(tags, **kwargs)

        tracker.set_tags = dies_recording_epoch_1  # type: ignore[method-assign]
    model = torch.nn.Linear(2, 1)
    state = restore(tracker, model=model)
    for epoch in range(state.epoch + 1 if state else 0, 3):
        report_epoch(tracker, {"x": float(epoch)}, epoch=epoch, model=model)


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_a_worker_group_restarted_while_mlflow_is_down_completes(
    proxy: tuple[MlflowServer, Settings], tmp_path: Path
) -> None:
    from ray.train import FailureConfig, ScalingConfig
    from ray.train.torch import TorchTrainer

    import raydeck
    from raydeck.train.trainer import checkpoint_storage_path

    server, settings = proxy
    tracker = raydeck.get_tracker(run_name="restart-during-outage", settings=settings)
    mlflow_down = tmp_path / "mlflow-down"
    done = threading.Event()

    def outage() -> None:
        wait_until(lambda: "x" in tracker.latest(), 240, "epoch 0 logged")
        server.kill()
        mlflow_down.write_text("down")
        done.wait(400)
        server.start()

    killer = threading.Thread(target=outage)
    killer.start()
    try:
        TorchTrainer(
            _restarting_train_fn,
            train_loop_config={"marker": str(tmp_path / "died"), "mlflow_down": str(mlflow_down),
                               "settings": settings},
            scaling_config=ScalingConfig(num_workers=2),
            run_config=tracker.run_config(
                storage_path=checkpoint_storage_path(settings),
                failure_config=FailureConfig(max_failures=2)),
        ).fit()
    finally:
        done.set()
        killer.join(120)
    assert (tmp_path / "died").exists()  # the group really restarted, with MLflow down
    report = tracker.finish()
    assert report.landed
    client = _client(server)
    _assert_exact(client, tracker.run_id, "x", range(3))
    run = client.get_run(tracker.run_id)
    assert run.info.status == "FINISHED"
    # Rank 0 died before it recorded epoch 1's committed checkpoint; the restarted group resumed
    # from it and recorded it: every committed checkpoint is in the run's record.
    tags = run.data.tags
    assert tags["raydeck.checkpoint.resumed_from_epoch"] == "1"
    assert {tags[f"raydeck.checkpoint.epoch_{epoch}"].rsplit("/", 1)[-1] for epoch in range(3)
            } == {"epoch_000000", "epoch_000001", "epoch_000002"}
    assert tags["raydeck.checkpoint.latest_epoch"] == "2"


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_tune_trials_that_start_while_mlflow_is_down_do_not_error(
    proxy: tuple[MlflowServer, Settings], tmp_path: Path
) -> None:
    from raydeck.tune import SweepConfig, SweepJob, report, sweep

    server, settings = proxy
    released = tmp_path / "mlflow-back"

    def train(config: dict[str, Any], data: Any) -> None:
        for iteration in range(3):
            if iteration == 1:  # hold every trial until MLflow is back
                deadline = time.monotonic() + 300
                while not released.exists() and time.monotonic() < deadline:
                    time.sleep(0.2)
            report({"score": config["a"] * (iteration + 1)})

    name = f"outage-{uuid.uuid4().hex[:6]}"
    job = SweepJob(train_fn=train, reports=("score",))
    config = SweepConfig(name=name, num_samples=4, max_t=3, grace_period=3, metric="score",
                         mode="max", scheduler="fifo")
    result: dict[str, Any] = {}

    def run_sweep() -> None:
        result["value"] = sweep(job, {"a": {"choice": [1, 2, 3, 4]}}, config, settings=settings)

    parent_key = config.key
    sweeper = threading.Thread(target=run_sweep)
    # MLflow goes down before any trial starts: the parent run is created first, then killed.
    sweeper.start()
    wait_until(lambda: parent_key in _router_runs(settings), 240, "sweep's parent run")
    server.kill()
    wait_until(lambda: sum(1 for k in _router_runs(settings) if k.startswith(f"{parent_key}."))
               == 4, 300, "4 trials attached while MLflow is down")
    server.start()
    released.write_text("go")
    sweeper.join(400)
    assert "value" in result, "sweep did not finish"
    client = _client(server)
    trials = result["value"].trials
    assert len(trials) == 4 and {t.status for t in trials} == {"completed"}
    for trial in trials:
        history = client.get_metric_history(trial.run_id, "score")
        assert sorted(m.step for m in history) == [1, 2, 3]


def _tiny_disk_remount(path: Path, size: str) -> None:
    subprocess.run(["mount", "-o", f"remount,size={size}", str(path)], check=True)


@pytest.mark.timeout(420)
def test_a_full_spool_disk_is_a_clear_error_and_loses_nothing_acknowledged(
    tmp_path: Path, ray_cluster: None, killable_mlflow: MlflowServer,
    caplog: pytest.LogCaptureFixture
) -> None:
    import raydeck
    from raydeck.errors import TrackingUnavailableError
    from raydeck.tracking.proxy.actors import stop_proxy

    disk = tmp_path / "disk"
    disk.mkdir()
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(disk)],
                             capture_output=True, text=True, check=False)
    if mounted.returncode != 0:
        pytest.skip(f"mounting a tmpfs needs root (CI runs as root): {mounted.stderr.strip()}")
    settings = isolated_settings(tmp_path, killable_mlflow.uri, shards=1)
    settings = dataclasses.replace(settings, data_dir=disk)
    try:
        tracker = raydeck.get_tracker(run_name="disk-full", settings=settings)
        tracker.flush()
        killable_mlflow.kill()  # nothing drains: the spool fills up
        step = 0
        with caplog.at_level(logging.WARNING, logger="raydeck"):
            while "is full" not in caplog.text and step < 2_000_000:
                _log_range(tracker, "x", step, step + 20_000)
                step += 20_000
                tracker.flush(timeout_s=5)
        assert "free disk space on the head node" in caplog.text
        with pytest.raises(TrackingUnavailableError, match="is full"):
            tracker.finish(timeout_s=5)
        _tiny_disk_remount(disk, "512m")
        killable_mlflow.start()
        assert tracker.finish(timeout_s=240).landed  # the failed finish() is retried
        _assert_exact(_client(killable_mlflow), tracker.run_id, "x", range(step))
    finally:
        if not killable_mlflow.alive():
            killable_mlflow.start()
        stop_proxy(settings.ray_namespace, 30)
        subprocess.run(["umount", "-l", str(disk)], check=False)


@pytest.mark.timeout(300)
def test_a_permanently_refused_artifact_is_set_aside_and_blocks_nothing(
    proxy: tuple[MlflowServer, Settings], tmp_path: Path
) -> None:
    import json

    import raydeck
    from raydeck.errors import TrackingWriteError

    server, settings = proxy
    tracker = raydeck.get_tracker(run_name="refused-artifact", settings=settings)
    second = _SecondRun(settings, "refused-artifact-neighbour")
    (tmp_path / "model").write_text("a file named model")
    (tmp_path / "nested").mkdir()
    (tmp_path / "nested" / "weights.bin").write_bytes(b"\x00" * 1024)
    (tmp_path / "notes.txt").write_text("fine")
    tracker.log_artifact(tmp_path / "model")
    # `model` is a file in the artifact store, so `model/weights.bin` can never be stored:
    # the server's artifact proxy refuses it for good ([Errno 17/20]).
    tracker.log_artifact(tmp_path / "nested" / "weights.bin", artifact_path="model")
    tracker.log_artifact(tmp_path / "notes.txt")
    _log_range(tracker, "x", 0, 100)
    second.log(100)
    with pytest.raises(TrackingWriteError, match=r"weights\.bin"):
        tracker.finish()
    client = _client(server)
    run = client.get_run(tracker.run_id)
    assert run.info.status == "FINISHED"
    assert run.data.tags["raydeck.dead_letters"] == "1"
    letters = json.loads(Path(client.download_artifacts(
        tracker.run_id, "raydeck/dead_letters.json")).read_text())
    assert [(d["kind"], d["key"]) for d in letters] == [("file", "weights.bin")]
    assert {a.path for a in client.list_artifacts(tracker.run_id)} >= {"model", "notes.txt"}
    _assert_exact(client, tracker.run_id, "x", range(100))
    second.check(client)
    shard = _shards(settings)[0]
    assert shard["dead_letters"] == 1


@pytest.mark.timeout(300)
def test_log_artifact_resolves_paths_and_never_writes_outside_the_spool(
    proxy: tuple[MlflowServer, Settings], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import raydeck
    from raydeck.errors import TrackingValidationError

    server, settings = proxy
    workdir = tmp_path / f"workdir-{uuid.uuid4().hex[:6]}"
    (workdir / "sub").mkdir(parents=True)
    (workdir / "a.txt").write_text("a")
    (workdir / "sub" / "b.txt").write_text("b")
    monkeypatch.chdir(workdir)
    tracker = raydeck.get_tracker(run_name="artifact-paths", settings=settings)
    tracker.log_artifact(".")  # the current directory, under its own name
    tracker.log_artifact("sub/../a.txt", artifact_path="flat")
    with pytest.raises(TrackingValidationError, match=r"without '\.\.'"):
        tracker.log_artifact("a.txt", artifact_path="../escape")
    assert tracker.finish().landed
    client = _client(server)

    def listing(path: str | None = None) -> set[str]:
        found: set[str] = set()
        for item in client.list_artifacts(tracker.run_id, path):
            found |= listing(item.path) if item.is_dir else {item.path}
        return found

    assert listing() >= {f"{workdir.name}/a.txt", f"{workdir.name}/sub/b.txt", "flat/a.txt"}
    assert not (Path("/") / workdir.name).exists()
    assert not any(p.name in ("a.txt", "b.txt") for p in Path("/").iterdir())


@pytest.mark.timeout(420)
def test_s3_stopped_during_artifact_uploads(tmp_path: Path, ray_cluster: None,
                                           killable_mlflow: MlflowServer, s3_server: Any) -> None:
    import raydeck
    from raydeck.config.settings import load_settings
    from raydeck.storage import init_buckets
    from raydeck.tracking.proxy.actors import stop_proxy

    bucket = f"contract-{uuid.uuid4().hex[:6]}"
    storage_settings = load_settings(env=s3_server.settings_env(
        RAYDECK_S3_ARTIFACTS_BUCKET=bucket, RAYDECK_S3_PREFIX="contract"))
    init_buckets(storage_settings.storage, probe=False)
    base = isolated_settings(tmp_path, killable_mlflow.uri, shards=1)
    settings = dataclasses.replace(
        base, storage=storage_settings.storage,
        tracking=dataclasses.replace(base.tracking, artifact_location=f"s3://{bucket}/contract",
                                     experiment=f"s3-outage-{uuid.uuid4().hex[:6]}"))
    files = tmp_path / "files"
    files.mkdir()
    for index in range(20):
        (files / f"part-{index:02d}.bin").write_bytes(os.urandom(64 * 1024))
    try:
        tracker = raydeck.get_tracker(run_name="s3-outage", settings=settings)
        for index in range(5):
            tracker.log_artifact(files / f"part-{index:02d}.bin", artifact_path="parts")
        tracker.flush()
        wait_until(lambda: len(_objects(s3_server, bucket)) >= 5, 120, "first uploads")
        s3_server.stop()
        for index in range(5, 20):
            tracker.log_artifact(files / f"part-{index:02d}.bin", artifact_path="parts")
        _log_range(tracker, "x", 0, 200)
        tracker.flush()
        wait_until(lambda: _backing_off(settings), 120, "uploads backing off")
        s3_server.start()
        report = tracker.finish(timeout_s=240)
        assert report.landed and not report.dead_letters
        uploaded = [key for key in _objects(s3_server, bucket) if "/parts/" in key]
        assert sorted(Path(key).name for key in uploaded) == [f"part-{i:02d}.bin"
                                                              for i in range(20)]
        _assert_exact(_client(killable_mlflow), tracker.run_id, "x", range(200))
    finally:
        if not s3_server.alive():
            s3_server.start()
        stop_proxy(settings.ray_namespace, 30)


def _objects(s3_server: Any, bucket: str) -> list[str]:
    try:
        return [o.object_name for o in s3_server.client().list_objects(bucket, recursive=True)]
    except Exception:
        return []
