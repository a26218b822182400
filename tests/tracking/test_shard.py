"""A shard on its own, writing to a real MLflow server: per-run queues, refusals set aside
exactly, runs created and ended in order with their data, console logs in parts.

These drive the shard's logic in this process (no Ray actors), so every branch is quick to
reach; the fault matrix in ``test_tracking_contract.py`` runs the same code as Ray actors.
"""

from __future__ import annotations

import json
import threading
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from raydeck.config.settings import load_settings
from raydeck.tracking.messages import Batch, FileRef, OpenRun, ShardConfig
from raydeck.tracking.proxy.dead_letters import DEAD_LETTERS_TAG
from raydeck.tracking.proxy.shard import ShardCore
from tests.fixtures.mlflow_server import MlflowServer
from tests.fixtures.processes import wait_until
from tests.fixtures.tcp_forwarder import TcpForwarder


def _config(tracking_uri: str, spool_dir: Path, writers: int, index: int = 0) -> ShardConfig:
    """A shard's config as the proxy builds it from the session's settings."""
    tracking = load_settings().tracking
    return ShardConfig(index=index, tracking_uri=tracking_uri, spool_dir=str(spool_dir),
                       fsync=False, writers=writers, mlflow_timeout_s=tracking.mlflow_timeout_s,
                       retry_max_s=tracking.retry_max_s, env={})


@pytest.fixture
def shard(tmp_path: Path, mlflow_server: MlflowServer) -> Iterator[ShardCore]:
    core = ShardCore(_config(mlflow_server.uri, tmp_path / "spool", writers=4))
    yield core
    core.stop()


def _open(core: ShardCore, key: str, artifact_location: str = "",
          experiment: str = "shard-tests") -> None:
    core.control(key, "open", OpenRun(key=key, name=key, experiment=experiment,
                                      artifact_location=artifact_location, mode="rank_zero"))


def _batch(key: str, seq: int, **fields: Any) -> Batch:
    return Batch(client_id=f"client-{key}", seq=seq, run_key=key, params_run_key=key, **fields)


def test_runs_are_created_written_and_ended_in_order(shard: ShardCore, mlflow_client: Any
                                                     ) -> None:
    key = f"order-{uuid.uuid4().hex[:8]}"
    _open(shard, key)
    points = [("loss", float(i), 1_000 + i, i) for i in range(2_500)]
    shard.ingest(_batch(key, 0, points=points, params={"lr": "0.1"}, tags={"team": "a"},
                        logs=[("rank_0.txt", "epoch 0\n")]))
    shard.ingest(_batch(key, 0, points=points))  # a re-delivery: acknowledged, dropped
    shard.ingest(_batch(key, 1, logs=[("rank_0.txt", "epoch 1\n")]))
    shard.control(key, "end", "FINISHED")
    report = shard.wait_landed([key], 120)
    assert report.landed and not report.dead_letters
    run = mlflow_client.get_run(shard.resolve(key, 1).run_id)
    assert run.info.status == "FINISHED"
    assert run.data.params == {"lr": "0.1"} and run.data.tags["team"] == "a"
    history = mlflow_client.get_metric_history(run.info.run_id, "loss")
    assert sorted(m.step for m in history) == list(range(2_500))
    parts = [a.path for a in mlflow_client.list_artifacts(run.info.run_id, "logs/rank_0")]
    text = "".join(Path(mlflow_client.download_artifacts(run.info.run_id, p)).read_text()
                   for p in sorted(parts))
    assert text == "epoch 0\nepoch 1\n"


def test_a_refused_value_is_set_aside_alone_and_recorded_on_the_run(
    shard: ShardCore, mlflow_client: Any, tmp_path: Path
) -> None:
    key = f"refused-{uuid.uuid4().hex[:8]}"
    # An artifact location whose parent is a file: every upload fails with ENOTDIR for good.
    blocker = tmp_path / "not-a-directory"
    blocker.write_text("x")
    _open(shard, key, artifact_location=(blocker / "artifacts").as_uri(),
          experiment=f"refusals-{uuid.uuid4().hex[:6]}")
    other = f"healthy-{uuid.uuid4().hex[:8]}"
    _open(shard, other)
    upload = uuid.uuid4().hex
    shard.put_chunk(upload, 0, b"weights")
    shard.ingest(_batch(key, 0, points=[("acc", 0.5, 1, 0)], params={"lr": "0.1"},
                        files=[FileRef(upload, "model", "weights.bin", 7)]))
    shard.ingest(_batch(key, 1, params={"lr": "0.2"}))  # MLflow refuses a changed param
    shard.ingest(_batch(other, 0, points=[("acc", 0.9, 1, 0)]))
    shard.control(key, "end", "FINISHED")
    report = shard.wait_landed([key], 120)
    assert report.landed
    assert {(d.kind, d.key) for d in report.dead_letters} == {("file", "weights.bin"),
                                                              ("param", "lr")}
    run = mlflow_client.get_run(shard.resolve(key, 1).run_id)
    assert run.data.params == {"lr": "0.1"}
    assert [m.value for m in mlflow_client.get_metric_history(run.info.run_id, "acc")] == [0.5]
    assert run.info.status == "FINISHED"
    assert int(run.data.tags[DEAD_LETTERS_TAG]) >= 2
    kept = next(d.kept_at for d in report.dead_letters if d.key == "weights.bin")
    assert Path(kept).read_bytes() == b"weights"  # set aside, not deleted
    # The other run on the same shard was not held up.
    assert shard.wait_landed([other], 60).landed
    healthy = mlflow_client.get_run(shard.resolve(other, 1).run_id)
    assert [m.value for m in mlflow_client.get_metric_history(healthy.info.run_id, "acc")] \
        == [0.9]


def test_a_restarted_shard_continues_from_its_spool(tmp_path: Path, mlflow_server: MlflowServer,
                                                     mlflow_client: Any) -> None:
    config = _config("http://127.0.0.1:9", tmp_path / "spool", writers=2)
    key = f"restart-{uuid.uuid4().hex[:8]}"
    down = ShardCore(config)  # MLflow "down": nothing listens on port 9
    _open(down, key)
    down.ingest(_batch(key, 0, points=[("x", float(i), i, i) for i in range(3_000)]))
    report = down.wait_landed([key], 2)
    assert not report.landed
    # The report names the run that is stuck and what it holds, for the caller's error.
    assert report.stuck == (f"run {key}: 3000 metric points, 1 run updates (last error: "
                            f"{report.pending.last_error})",), report.stuck
    assert report.pending.last_error
    assert down.stats()["queued_points"] == 3_000
    down.stop()
    up = ShardCore(ShardConfig(**{**config.__dict__, "tracking_uri": mlflow_server.uri}))
    try:
        assert up.stats()["replay_backlog"] >= 3
        assert up.wait_landed([key], 120).landed
        run_id = up.resolve(key, 1).run_id
        steps = sorted(m.step for m in mlflow_client.get_metric_history(run_id, "x"))
        assert steps == list(range(3_000))
    finally:
        up.stop()


def test_all_ranks_views_per_step(shard: ShardCore, mlflow_client: Any) -> None:
    key = f"ranks-{uuid.uuid4().hex[:8]}"
    _open(shard, key)
    values = {0: [1.0, 2.0], 1: [3.0, 10.0], 2: [2.0, 0.0], 3: [4.0, 4.0]}
    for order, rank in enumerate((2, 0, 3, 1)):  # rank 1 logs each step last: the straggler
        shard.ingest(Batch(client_id=f"r{rank}", seq=0, run_key=key, params_run_key=key,
                           points=[(f"loss/rank_{rank}", v, 1_000 * (step + 1) + order, step)
                                   for step, v in enumerate(values[rank])],
                           rank_of=(rank, 4)))
    assert shard.wait_landed([key], 60).landed
    run_id = shard.resolve(key, 1).run_id

    def series(name: str) -> list[float]:
        history = sorted(mlflow_client.get_metric_history(run_id, name), key=lambda m: m.step)
        return [m.value for m in history]

    assert series("loss/mean") == [2.5, 4.0]
    assert series("loss/min") == [1.0, 0.0]
    assert series("loss/max") == [4.0, 10.0]
    assert series("loss/straggler_rank") == [1.0, 1.0]


@pytest.mark.timeout(120)
def test_steps_a_run_holds_never_go_back_when_older_points_are_logged_again(
    tmp_path: Path, mlflow_server: MlflowServer
) -> None:
    """A job restarted from a checkpoint re-logs that checkpoint's points, then asks which steps
    its run holds so that it drops the steps it trains again. While MLflow does not answer
    the shard answers from what it received: the highest step, not the last one received."""
    link = TcpForwarder(mlflow_server.port)  # MLflow, until this shard loses it
    core = ShardCore(_config(link.url, tmp_path / "spool", writers=2))
    key = f"resume-{uuid.uuid4().hex[:8]}"
    try:
        _open(core, key)
        # The attempt that failed: steps up to 23 in a committed checkpoint, 27 after it.
        core.ingest(_batch(key, 0, points=[("loss", 1.0, 1_000 + step, step)
                                           for step in (3, 7, 11, 15, 19, 23, 27)]))
        assert core.wait_landed([key], 60).landed  # written to MLflow: no longer pending
        link.cut()
        # The restarted attempt re-logs the restored checkpoint's points first.
        core.ingest(Batch(client_id="restarted", seq=0, run_key=key, params_run_key=key,
                          points=[("loss", 1.0, 1_000 + step, step) for step in (15, 19, 23)]))
        assert core.last_steps(key, ["loss", "never_logged"], 30) == {"loss": 27,
                                                                      "never_logged": -1}
    finally:
        core.stop()
        link.cut()


@pytest.mark.timeout(120)
def test_the_steps_a_run_holds_are_answered_without_waiting_for_its_console_text(
    shard: ShardCore
) -> None:
    """A restarted worker asks which steps its run holds before it trains; the answer waits for
    the run's metric points, not for console text, which is uploaded every 30 s."""
    key = f"steps-logs-{uuid.uuid4().hex[:8]}"
    _open(shard, key)
    shard.ingest(_batch(key, 0, points=[("loss", 1.0, 1_000 + step, step) for step in range(3)],
                        logs=[("console/rank_0.log", "epoch 0 done\n")]))
    assert shard.last_steps(key, ["loss"], 60) == {"loss": 2}
    pending = [run["pending"] for run in shard.stats()["runs"] if run["key"] == key]
    assert pending == ["13 bytes of console log"], shard.stats()["runs"]


@pytest.mark.timeout(120)
@pytest.mark.parametrize("late_first", [True, False],
                         ids=["late-batch-lands-first", "resumed-attempt-lands-first"])
def test_a_resumed_attempt_and_a_late_batch_of_the_dead_one_keep_one_value_per_step(
    shard: ShardCore, mlflow_client: Any, late_first: bool
) -> None:
    """The dead attempt's last batch reaches the shard only after the resumed attempt was told
    which steps the run holds, so both log steps 10-14: whichever batch comes first keeps them,
    the other's values there are dropped. A step the resumed attempt logs twice itself, and
    keys it did not name, keep every value, as in MLflow."""
    key = f"fence-{uuid.uuid4().hex[:8]}"
    _open(shard, key)

    def batch(client: str, seq: int, steps: range, offset: float, *extra: Any) -> Batch:
        points = [("loss", step + offset, 1_000 + step, step) for step in steps]
        return Batch(client_id=client, seq=seq, run_key=key, params_run_key=key,
                     points=points + list(extra))

    shard.ingest(batch("dead", 0, range(10), 0.0, ("system/cpu", 1.0, 1_000, 0)))
    assert shard.last_steps(key, ["loss"], 60, resumed_by="resumed") == {"loss": 9}
    late = batch("dead", 1, range(10, 15), 0.0)
    if late_first:
        shard.ingest(late)
    shard.ingest(batch("resumed", 0, range(10, 20), 0.5, ("loss", 99.0, 5_000, 19),
                       ("system/cpu", 2.0, 2_000, 0)))
    if not late_first:
        shard.ingest(late)
    assert shard.wait_landed([key], 60).landed
    run_id = shard.resolve(key, 1).run_id

    def history(name: str) -> list[tuple[int, float]]:
        return sorted((m.step, m.value) for m in mlflow_client.get_metric_history(run_id, name))

    dead_steps = range(10, 15) if late_first else range(0)
    assert history("loss") == sorted(
        [(step, float(step)) for step in range(10)]
        + [(step, float(step) if step in dead_steps else step + 0.5) for step in range(10, 20)]
        + [(19, 99.0)])
    assert history("system/cpu") == [(0, 1.0), (0, 2.0)]
    assert shard.stats()["repeats_dropped"] == 5


def test_a_fence_takes_in_what_arrives_while_the_answer_is_read() -> None:
    """Between the moment a resumed attempt's question opens the fences and its answer, a late
    batch of the dead attempt counts in the answer; and only so many runs keep fences."""
    from raydeck.tracking.proxy.step_fences import StepFences

    fences = StepFences(max_runs=2)
    fences.open("run", ["loss"])
    assert fences.admit("run", "dead", [("loss", 1.0, 1, step) for step in range(10, 15)]) is None
    held = {"loss": 9}
    fences.close("run", held)
    assert held == {"loss": 14}
    kept = fences.admit("run", "resumed", [("loss", 2.0, 2, step) for step in range(10, 20)])
    assert [point[3] for point in kept or []] == list(range(15, 20))
    assert fences.dropped == 5
    fences.open("second", ["loss"])
    fences.open("third", ["loss"])
    assert "run" not in fences and "third" in fences


def test_dead_letters_survive_a_restart_and_show_in_stats(tmp_path: Path,
                                                         mlflow_server: MlflowServer) -> None:
    config = _config(mlflow_server.uri, tmp_path / "spool", writers=1, index=1)
    key = f"letters-{uuid.uuid4().hex[:8]}"
    first = ShardCore(config)
    _open(first, key)
    first.ingest(_batch(key, 0, params={"p": "1"}))
    first.ingest(_batch(key, 1, params={"p": "2"}))
    assert first.wait_landed([key], 60).landed
    first.stop()
    second = ShardCore(config)
    try:
        stats = second.stats()
        assert stats["dead_letters"] == 1
        letters = json.loads(json.dumps([d.__dict__ for d in second.spool.dead_letters(key)]))
        assert letters[0]["kind"] == "param" and letters[0]["key"] == "p"
    finally:
        second.stop()


def test_retries_back_off_doubling_up_to_the_configured_cap() -> None:
    from raydeck.tracking.proxy.run_queue import backoff_s

    # RAYDECK_TRACKING_RETRY_MAX_S caps the wait; the default (5 s) after five failures in a row.
    assert [backoff_s(n, 1.0) for n in range(1, 6)] == [0.25, 0.5, 1.0, 1.0, 1.0]
    assert [backoff_s(n, 5.0) for n in (5, 6, 50)] == [4.0, 5.0, 5.0]


@pytest.mark.timeout(120)
def test_a_batch_written_before_its_thread_counted_it_still_lands(
    shard: ShardCore, mlflow_client: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Two batches of one run on two threads: the first is spooled, and its thread held there,
    while the second's thread counts its own and a writer writes both from the spool. Counted
    only after the spool took it, the first stayed pending for good (the writer had uncounted
    it, never below zero) and the run never landed: 1,024 ranks on the bulk direct path, where
    writes are fast enough to get there first. Held by the test here, not by luck."""
    key = f"count-race-{uuid.uuid4().hex[:8]}"
    _open(shard, key)
    assert shard.wait_landed([key], 60).landed
    real_accept = shard.spool.accept
    spooled, release = threading.Event(), threading.Event()

    def accept_then_hold(client_id: str | None, seq: int | None, entities: Any) -> Any:
        accepted = real_accept(client_id, seq, entities)
        if threading.current_thread().name == "held":
            spooled.set()
            assert release.wait(60)
        return accepted

    monkeypatch.setattr(shard.spool, "accept", accept_then_hold)
    held = threading.Thread(name="held", target=shard.ingest, args=(
        _batch(key, 0, points=[("loss", float(i), 1_000 + i, i) for i in range(10)]),))
    held.start()
    assert spooled.wait(60)
    shard.ingest(_batch(key, 1, points=[("loss", float(i), 1_000 + i, i) for i in range(10, 20)]))
    wait_until(lambda: shard.stats()["points_written"] >= 20, 60,
               "the writer to write both batches from the spool")
    release.set()
    held.join(60)
    shard.control(key, "end", "FINISHED")
    report = shard.wait_landed([key], 30)
    assert report.landed, report.stuck
    run_id = shard.resolve(key, 1).run_id
    assert sorted(m.step for m in mlflow_client.get_metric_history(run_id, "loss")) == list(
        range(20))
