"""Two Ray Train workers in each tracking mode: MLflow holds exactly what was logged."""

from __future__ import annotations

from typing import Any

import pytest

POINTS = 50


def _train_fn(config: dict[str, Any]) -> None:
    import ray.train

    import raydeck

    rank = ray.train.get_context().get_world_rank()
    with raydeck.get_tracker() as tracker:
        tracker.log_params({"lr": 0.1, "layers": 2})
        for step in range(POINTS):
            tracker.log_metrics({"loss": rank * 1000.0 + step, "acc": step / POINTS}, step=step)
        print(f"rank {rank} says hello")


def _fit(mode: str, name: str, workers: int = 2) -> Any:
    from ray.train import ScalingConfig
    from ray.train.torch import TorchTrainer

    import raydeck

    tracker = raydeck.get_tracker(run_name=name, mode=mode)
    TorchTrainer(_train_fn, scaling_config=ScalingConfig(num_workers=workers),
                 run_config=tracker.run_config()).fit()
    tracker.finish()
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


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_rank_zero_mode_writes_rank_zero_only(ray_cluster: None, mlflow_client: Any) -> None:
    tracker = _fit("rank_zero", "mode-rank-zero")
    run = mlflow_client.get_run(tracker.run_id)
    assert run.info.status == "FINISHED"
    assert _history(mlflow_client, tracker.run_id, "loss") == [
        (s, float(s)) for s in range(POINTS)
    ]
    assert not [k for k in run.data.metrics if "rank_" in k]
    assert run.data.params == {"lr": "0.1", "layers": "2"}
    logs = {a.path for a in mlflow_client.list_artifacts(tracker.run_id, "logs")}
    assert logs == {"logs/rank_0"}
    assert "rank 0 says hello" in _log_text(mlflow_client, tracker.run_id, "rank_0")


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_all_ranks_mode_keeps_ranks_apart_with_cross_rank_views(
    ray_cluster: None, mlflow_client: Any
) -> None:
    workers = 4
    tracker = _fit("all_ranks", "mode-all-ranks", workers=workers)
    run = mlflow_client.get_run(tracker.run_id)
    assert run.info.status == "FINISHED"
    for rank in range(workers):
        assert _history(mlflow_client, tracker.run_id, f"loss/rank_{rank}") == [
            (s, rank * 1000.0 + s) for s in range(POINTS)
        ]
    # Per step, from what the four ranks logged: loss = rank * 1000 + step.
    assert _history(mlflow_client, tracker.run_id, "loss/mean") == [
        (s, 1500.0 + s) for s in range(POINTS)]
    assert _history(mlflow_client, tracker.run_id, "loss/min") == [
        (s, float(s)) for s in range(POINTS)]
    assert _history(mlflow_client, tracker.run_id, "loss/max") == [
        (s, 3000.0 + s) for s in range(POINTS)]
    stragglers = _history(mlflow_client, tracker.run_id, "loss/straggler_rank")
    assert [s for s, _ in stragglers] == list(range(POINTS))
    assert {rank for _, rank in stragglers} <= {0.0, 1.0, 2.0, 3.0}
    assert "loss" not in run.data.metrics
    assert run.data.params == {"lr": "0.1", "layers": "2"}
    logs = {a.path for a in mlflow_client.list_artifacts(tracker.run_id, "logs")}
    assert logs == {f"logs/rank_{rank}" for rank in range(workers)}
    assert "rank 1 says hello" in _log_text(mlflow_client, tracker.run_id, "rank_1")


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_per_rank_mode_makes_one_child_run_per_rank(ray_cluster: None, mlflow_client: Any
                                                    ) -> None:
    tracker = _fit("per_rank", "mode-per-rank")
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
