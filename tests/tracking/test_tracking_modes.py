"""Ray Train workers in each tracking mode: MLflow holds exactly what was logged.

A Ray Train fit costs about a minute of CPU, so two fits here also carry a claim of another
test, asserted by that test on the same fit (module fixtures run each fit once): the rank_zero
job also reports epochs with a NaN and an illegal key through raydeck's own paths, which never
fail a job (docs/tracking-contract.md, "bad values"); the all_ranks workers return without
``finish()``, and Ray Train's worker callback hands their data over (the contract's "a Ray Train
worker returns without finish()").
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import pytest

from tests.fixtures.tracking import participants

# As many points per rank as a worker still holds in its buffer when it returns without finish.
POINTS = 200
EPOCHS = 3
ALL_RANKS_WORKERS = 4


@dataclass(frozen=True)
class AllRanksFit:
    """The all_ranks fit's run, and what the driver saw between ``fit()`` and its ``finish()``."""

    tracker: Any
    participants_after_fit: int  # processes still in the run once fit() returned
    landed: bool                 # the driver's finish() saw everything in MLflow


def _report_nan_and_an_illegal_key(tracker: Any) -> None:
    """Three checkpointed epochs, as a job reports them: epoch 1's loss is NaN, epoch 2 adds
    ``recall@5`` (MLflow refuses ``@``)."""
    import torch

    from raydeck.train.checkpointing import report_epoch, restore

    model = torch.nn.Linear(2, 1)
    state = restore(tracker, model=model)
    for epoch in range(state.epoch + 1 if state else 0, EPOCHS):
        metrics = {"val_loss": 1.0 / (epoch + 1)}
        if epoch == 1:
            metrics["val_loss"] = float("nan")
        if epoch == 2:
            metrics["recall@5"] = 0.75
        report_epoch(tracker, metrics, epoch=epoch, model=model)


def _log(tracker: Any, rank: int, bad_values: bool) -> None:
    tracker.log_params({"lr": 0.1, "layers": 2})
    for step in range(POINTS):
        tracker.log_metrics({"loss": rank * 1000.0 + step, "acc": step / POINTS}, step=step)
    print(f"rank {rank} says hello")
    if bad_values:
        _report_nan_and_an_illegal_key(tracker)


def _train_fn(config: dict[str, Any]) -> None:
    import ray.train

    import raydeck

    rank = ray.train.get_context().get_world_rank()
    tracker = raydeck.get_tracker()
    if config["finish"]:
        with tracker:
            _log(tracker, rank, config["bad_values"])
    else:
        # No finish(), no flush(): Ray Train kills this worker after it returns.
        _log(tracker, rank, config["bad_values"])


def _fit(mode: str, name: str, workers: int = 2, finish: bool = True,
         bad_values: bool = False) -> Any:
    """Run the job; returns the driver's tracker, not finished yet."""
    from ray.train import ScalingConfig
    from ray.train.torch import TorchTrainer

    import raydeck
    from raydeck.train.trainer import checkpoint_storage_path

    tracker = raydeck.get_tracker(run_name=name, mode=mode)
    TorchTrainer(_train_fn, train_loop_config={"finish": finish, "bad_values": bad_values},
                 scaling_config=ScalingConfig(num_workers=workers),
                 run_config=tracker.run_config(
                     storage_path=checkpoint_storage_path(raydeck.load_settings()))).fit()
    return tracker


def _log_text(client: Any, run_id: str, name: str) -> str:
    """A console log as the run holds it: the parts under ``logs/<name>/``, in order."""
    parts = sorted(a.path for a in client.list_artifacts(run_id, f"logs/{name}"))
    text = ""
    for part in parts:
        with open(client.download_artifacts(run_id, part)) as fh:
            text += fh.read()
    return text


def _history(client: Any, run_id: str, key: str) -> list[tuple[int, float]]:
    return sorted((m.step, m.value) for m in client.get_metric_history(run_id, key))


def _assert_every_rank_apart(client: Any, run_id: str) -> None:
    """Each all_ranks rank's loss under its own key: every step once, with that rank's values."""
    for rank in range(ALL_RANKS_WORKERS):
        assert _history(client, run_id, f"loss/rank_{rank}") == [
            (s, rank * 1000.0 + s) for s in range(POINTS)
        ]


@pytest.fixture(scope="module")
def rank_zero_fit(ray_cluster: None) -> Any:
    """Two rank_zero workers that log the series and report epochs with bad values; the run."""
    tracker = _fit("rank_zero", "mode-rank-zero", bad_values=True)
    tracker.finish()
    return tracker


@pytest.fixture(scope="module")
def all_ranks_fit(ray_cluster: None) -> AllRanksFit:
    """Four all_ranks workers that log the series and return without ``finish()``."""
    tracker = _fit("all_ranks", "mode-all-ranks", workers=ALL_RANKS_WORKERS, finish=False)
    left = participants(tracker.run_key)
    return AllRanksFit(tracker, left, tracker.finish().landed)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_rank_zero_mode_writes_rank_zero_only(rank_zero_fit: Any, mlflow_client: Any) -> None:
    run_id = rank_zero_fit.run_id
    run = mlflow_client.get_run(run_id)
    assert run.info.status == "FINISHED"
    assert _history(mlflow_client, run_id, "loss") == [(s, float(s)) for s in range(POINTS)]
    assert not [k for k in run.data.metrics if "rank_" in k]
    assert run.data.params == {"lr": "0.1", "layers": "2"}
    logs = {a.path for a in mlflow_client.list_artifacts(run_id, "logs")}
    assert logs == {"logs/rank_0"}
    assert "rank 0 says hello" in _log_text(mlflow_client, run_id, "rank_0")


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_train_job_with_nan_and_an_illegal_key_completes(rank_zero_fit: Any,
                                                           mlflow_client: Any) -> None:
    run_id = rank_zero_fit.run_id
    run = mlflow_client.get_run(run_id)
    history = sorted(mlflow_client.get_metric_history(run_id, "val_loss"), key=lambda m: m.step)
    assert [m.step for m in history] == list(range(EPOCHS))
    assert math.isnan(history[1].value)  # as MLflow stores it
    assert [m.value for m in mlflow_client.get_metric_history(run_id, "recall5")] == [0.75]
    assert run.data.tags["raydeck.sanitized_values"] == "1"
    assert run.info.status == "FINISHED"


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_all_ranks_mode_keeps_ranks_apart_with_cross_rank_views(
    all_ranks_fit: AllRanksFit, mlflow_client: Any
) -> None:
    run_id = all_ranks_fit.tracker.run_id
    run = mlflow_client.get_run(run_id)
    assert run.info.status == "FINISHED"
    _assert_every_rank_apart(mlflow_client, run_id)
    # Per step, from what the four ranks logged: loss = rank * 1000 + step.
    assert _history(mlflow_client, run_id, "loss/mean") == [
        (s, 1500.0 + s) for s in range(POINTS)]
    assert _history(mlflow_client, run_id, "loss/min") == [
        (s, float(s)) for s in range(POINTS)]
    assert _history(mlflow_client, run_id, "loss/max") == [
        (s, 3000.0 + s) for s in range(POINTS)]
    stragglers = _history(mlflow_client, run_id, "loss/straggler_rank")
    assert [s for s, _ in stragglers] == list(range(POINTS))
    assert {rank for _, rank in stragglers} <= {0.0, 1.0, 2.0, 3.0}
    assert "loss" not in run.data.metrics
    assert run.data.params == {"lr": "0.1", "layers": "2"}
    logs = {a.path for a in mlflow_client.list_artifacts(run_id, "logs")}
    assert logs == {f"logs/rank_{rank}" for rank in range(ALL_RANKS_WORKERS)}
    assert "rank 1 says hello" in _log_text(mlflow_client, run_id, "rank_1")


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_train_worker_returning_without_finish_loses_nothing(all_ranks_fit: AllRanksFit,
                                                               mlflow_client: Any) -> None:
    # Every rank handed its data over and left before fit() returned: only the driver is left.
    assert all_ranks_fit.participants_after_fit == 1
    assert all_ranks_fit.landed
    _assert_every_rank_apart(mlflow_client, all_ranks_fit.tracker.run_id)
    assert mlflow_client.get_run(all_ranks_fit.tracker.run_id).info.status == "FINISHED"


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_per_rank_mode_makes_one_child_run_per_rank(ray_cluster: None, mlflow_client: Any
                                                    ) -> None:
    tracker = _fit("per_rank", "mode-per-rank")
    tracker.finish()
    parent = mlflow_client.get_run(tracker.run_id)
    assert parent.info.status == "FINISHED"
    assert parent.data.params == {"lr": "0.1", "layers": "2"}
    children = mlflow_client.search_runs(
        [parent.info.experiment_id],
        filter_string=f"tags.mlflow.parentRunId = '{tracker.run_id}'",
    )
    by_rank = {int(c.data.tags["raydeck.rank"]): c for c in children}
    assert sorted(by_rank) == [0, 1]
    for rank, child in by_rank.items():
        assert child.info.status == "FINISHED"
        assert child.data.tags["raydeck.role"] == "train_worker"
        assert child.data.tags["raydeck.node"]
        assert _history(mlflow_client, child.info.run_id, "loss") == [
            (s, rank * 1000.0 + s) for s in range(POINTS)
        ]
        assert child.data.params == {}
