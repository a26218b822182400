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


def _fit(mode: str, name: str, worker_env: dict[str, str] | None = None) -> Any:
    from ray.train import ScalingConfig
    from ray.train.torch import TorchTrainer

    import raydeck

    tracker = raydeck.get_tracker(run_name=name, mode=mode)
    run_config = tracker.run_config(
        worker_runtime_env={"env_vars": worker_env} if worker_env else None
    )
    TorchTrainer(_train_fn, scaling_config=ScalingConfig(num_workers=2),
                 run_config=run_config).fit()
    tracker.finish()
    return tracker


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
    assert logs == {"logs/rank_0.txt"}


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_all_ranks_mode_keeps_ranks_apart_with_a_cross_rank_mean(
    ray_cluster: None, mlflow_client: Any
) -> None:
    tracker = _fit("all_ranks", "mode-all-ranks", {"RAYDECK_TRACKING_CROSS_RANK_MEAN": "true"})
    run = mlflow_client.get_run(tracker.run_id)
    assert run.info.status == "FINISHED"
    for rank in (0, 1):
        assert _history(mlflow_client, tracker.run_id, f"loss/rank_{rank}") == [
            (s, rank * 1000.0 + s) for s in range(POINTS)
        ]
    assert _history(mlflow_client, tracker.run_id, "loss/mean") == [
        (s, 500.0 + s) for s in range(POINTS)
    ]
    assert "loss" not in run.data.metrics
    assert run.data.params == {"lr": "0.1", "layers": "2"}
    logs = {a.path for a in mlflow_client.list_artifacts(tracker.run_id, "logs")}
    assert logs == {"logs/rank_0.txt", "logs/rank_1.txt"}
    text = mlflow_client.download_artifacts(tracker.run_id, "logs/rank_1.txt")
    with open(text) as fh:
        assert "rank 1 says hello" in fh.read()


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
