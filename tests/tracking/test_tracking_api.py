"""The tracker as MLflow users expect it: MLflow's method names, one step policy, predictable
``get_tracker`` rules, and raydeck's own paths that never fail a job for a value (a Ray Train
job reporting a NaN and an illegal key: tests/tracking/test_tracking_modes.py, on its rank_zero
fit)."""

from __future__ import annotations

import json
import math
import os
import tempfile
import threading
import uuid
from pathlib import Path
from typing import Any

import pytest

from raydeck.errors import TrackingValidationError
from tests.fixtures.processes import wait_until


def _listing(client: Any, run_id: str, path: str | None = None) -> set[str]:
    found: set[str] = set()
    for item in client.list_artifacts(run_id, path):
        found |= _listing(client, run_id, item.path) if item.is_dir else {item.path}
    return found


@pytest.mark.timeout(300)
def test_mlflow_methods_move_over_by_renaming_the_object(ray_cluster: None, mlflow_client: Any,
                                                         tmp_path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import mlflow.data
    import numpy as np
    import pandas as pd
    from sklearn.linear_model import LogisticRegression

    import raydeck

    tracker = raydeck.get_tracker(run_name=f"mlflow-api-{uuid.uuid4().hex[:6]}")
    assert tracker.log_param("lr", 0.1) == 0.1
    tracker.set_tag("team", "vision")
    tracker.log_metric("loss", 0.5, 3, None, 1_700_000_000_000)  # MLflow's argument order
    (tmp_path / "out" / "sub").mkdir(parents=True)
    (tmp_path / "out" / "a.txt").write_text("a")
    (tmp_path / "out" / "sub" / "b.txt").write_text("b")
    tracker.log_artifacts(tmp_path / "out", "outputs")
    figure, axes = plt.subplots()
    axes.plot([0, 1], [1, 0])
    tracker.log_figure(figure, "plots/curve.png")
    tracker.log_image(np.zeros((8, 8, 3), dtype=np.uint8), key="samples", step=2)
    tracker.log_image(np.ones((4, 4), dtype=np.uint8) * 255, "images/static.png")
    tracker.log_table({"x": [1, 2], "y": ["a", "b"]}, "tables/predictions.json")
    tracker.log_table({"x": [3], "y": ["c"]}, "tables/predictions.json")  # appends
    frame = pd.DataFrame({"feature": [1.0, 2.0], "label": [0, 1]})
    tracker.log_input(mlflow.data.from_pandas(frame, name="digits-train"), context="training")
    model = LogisticRegression().fit(frame[["feature"]], frame["label"])
    uri = tracker.log_model(model, "classifier")
    staging = Path(tempfile.gettempdir()) / f"raydeck-staging-{os.getpid()}"
    assert staging.is_dir()  # the files above were copied there until handed over
    tracker.finish()
    # Nothing of the staging is left: the tracker's folder, and the process's once it is empty.
    assert not staging.exists() or any(staging.iterdir())

    run_id = tracker.run_id
    assert uri == f"runs:/{run_id}/classifier"
    run = mlflow_client.get_run(run_id)
    assert run.data.params["lr"] == "0.1" and run.data.tags["team"] == "vision"
    [point] = mlflow_client.get_metric_history(run_id, "loss")
    assert (point.step, point.timestamp, point.value) == (3, 1_700_000_000_000, 0.5)
    files = _listing(mlflow_client, run_id)
    assert {"outputs/a.txt", "outputs/sub/b.txt", "plots/curve.png", "images/static.png",
            "tables/predictions.json", "classifier/MLmodel"} <= files
    charts = [f for f in files if f.startswith("images/samples+step+2+")]
    assert len(charts) == 2 and any(f.endswith("+compressed.webp") for f in charts)
    assert run.data.tags["mlflow.loggedImages"] == "true"
    table = json.loads(Path(mlflow_client.download_artifacts(
        run_id, "tables/predictions.json")).read_text())
    assert table["data"] == [[1, "a"], [2, "b"], [3, "c"]]
    assert json.loads(run.data.tags["mlflow.loggedArtifacts"]) == [
        {"path": "tables/predictions.json", "type": "table"}]
    [dataset_input] = run.inputs.dataset_inputs
    assert dataset_input.dataset.name == "digits-train" and dataset_input.dataset.digest
    assert {t.key: t.value for t in dataset_input.tags}["mlflow.data.context"] == "training"
    mlflow.set_tracking_uri(mlflow_client.tracking_uri)
    loaded = mlflow.pyfunc.load_model(uri)
    assert list(loaded.predict(frame[["feature"]])) == list(model.predict(frame[["feature"]]))


@pytest.mark.timeout(120)
def test_one_step_counter_per_tracker_unless_step_is_given(ray_cluster: None,
                                                           mlflow_client: Any) -> None:
    import raydeck

    tracker = raydeck.get_tracker(run_name=f"steps-{uuid.uuid4().hex[:6]}")
    tracker.log_metrics({"loss": 1.0, "acc": 0.1})      # step 0
    tracker.log_metrics({"loss": 0.9})                  # step 1
    tracker.log_metrics({"acc": 0.3})                   # step 2: a shared x-axis
    tracker.log_metrics({"lr": 0.01}, step=10)          # explicit step
    tracker.log_metrics({"loss": 0.5})                  # continues at 11
    tracker.finish()

    def steps(key: str) -> list[int]:
        return sorted(m.step for m in mlflow_client.get_metric_history(tracker.run_id, key))

    assert steps("loss") == [0, 1, 11]
    assert steps("acc") == [0, 2]
    assert steps("lr") == [10]


@pytest.mark.timeout(120)
def test_an_idle_flusher_sleeps_until_data_arrives(ray_cluster: None, mlflow_client: Any
                                                   ) -> None:
    """With nothing buffered the flusher sleeps (no round every 0.2 s in every process); the
    next value wakes it at once and lands without a flush, and a tracker finishing while its
    flusher sleeps stops it."""
    import raydeck

    tracker = raydeck.get_tracker(run_name=f"idle-{uuid.uuid4().hex[:6]}")
    delivery = tracker._open_delivery
    tracker.log_metrics({"loss": 1.0}, step=0)
    wait_until(lambda: delivery._idle, 30, "the flusher asleep with nothing buffered")
    tracker.log_metrics({"loss": 0.5}, step=1)
    assert not delivery._idle  # the value woke it
    wait_until(lambda: len(mlflow_client.get_metric_history(tracker.run_id, "loss")) == 2, 60,
               "both values in MLflow, sent by the flusher")
    wait_until(lambda: delivery._idle, 30, "the flusher asleep again")
    tracker.finish()
    assert not delivery._thread.is_alive()


@pytest.mark.timeout(180)
def test_get_tracker_returns_the_run_it_names_and_is_thread_safe(ray_cluster: None,
                                                                  mlflow_client: Any) -> None:
    import raydeck

    first = raydeck.get_tracker(run_name=f"first-{uuid.uuid4().hex[:6]}")
    second = raydeck.get_tracker(run_name=f"second-{uuid.uuid4().hex[:6]}", params={"b": 2})
    assert second.run_key != first.run_key  # another run, never the active one
    assert raydeck.get_tracker(run_name=first.run_name) is first
    assert raydeck.get_tracker() is second  # the newest active run, like mlflow.active_run()

    key = f"threads-{uuid.uuid4().hex[:6]}"
    got: list[Any] = []
    threads = [threading.Thread(target=lambda: got.append(raydeck.get_tracker(key)))
               for _ in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(120)
    assert len(got) == 8 and all(tracker is got[0] for tracker in got)
    for tracker in (first, second, got[0]):
        tracker.finish()
    assert mlflow_client.get_run(second.run_id).data.params == {"b": "2"}
    assert "b" not in mlflow_client.get_run(first.run_id).data.params


@pytest.mark.timeout(120)
def test_lenient_paths_repair_count_and_never_raise(ray_cluster: None,
                                                    mlflow_client: Any) -> None:
    import raydeck

    tracker = raydeck.get_tracker(run_name=f"lenient-{uuid.uuid4().hex[:6]}")
    tracker.log_metrics({"recall@5": 0.5, "text": "n/a", "loss": float("nan")}, step=0,
                        strict=False)
    tracker.log_params({"notes": "x" * 10_000, "ok": 1}, strict=False)
    with pytest.raises(TrackingValidationError, match="recall5"):  # strict names the fix
        tracker.log_metrics({"recall@5": 0.5})
    tracker.finish()
    run = mlflow_client.get_run(tracker.run_id)
    assert run.data.metrics["recall5"] == 0.5 and math.isnan(run.data.metrics["loss"])
    assert "text" not in run.data.metrics
    assert len(run.data.params["notes"]) == 6000 and run.data.params["ok"] == "1"
    assert run.data.tags["raydeck.sanitized_values"] == "2"  # recall@5, notes
    assert run.data.tags["raydeck.dropped_values"] == "1"    # text
