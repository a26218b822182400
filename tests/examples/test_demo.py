"""The main job, as a newcomer runs it: `raydeck demo` on a machine with nothing running."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest


def _demo(cwd: Path, *args: str) -> subprocess.CompletedProcess[str]:
    # Nothing of the suite's: raydeck honours MLflow's own variables, and an earlier test's
    # mlflow.set_tracking_uri() leaves MLFLOW_TRACKING_URI in this process's environment.
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("RAYDECK_", "RAY_ADDRESS", "MLFLOW_"))}
    # A Ray instance of its own, as on a fresh machine (the suite's cluster runs beside it).
    env.update({"RAYDECK_RAY_ADDRESS": "local", "COLUMNS": "200"})
    return subprocess.run([sys.executable, "-m", "raydeck.cli", "demo", *args], cwd=cwd,
                          env=env, capture_output=True, text=True, timeout=400)


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_demo_trains_to_90_percent_and_records_the_run(tmp_path: Path) -> None:
    import mlflow
    import numpy as np
    from mlflow.tracking import MlflowClient

    from raydeck.examples.digits import raw_split

    first = _demo(tmp_path, "--register-as", "digits")
    assert first.returncode == 0, first.stdout[-3000:] + first.stderr[-3000:]
    out = first.stdout
    assert "validation accuracy:" in out
    accuracy = float(out.split("validation accuracy:")[1].split()[0])
    assert accuracy >= 0.90
    db = tmp_path / ".raydeck" / "mlflow.db"
    assert f"mlflow ui --backend-store-uri sqlite:///{db}" in out

    second = _demo(tmp_path, "--epochs", "2", "--run-name", "again")
    assert second.returncode == 0, second.stdout[-3000:] + second.stderr[-3000:]

    uri = f"sqlite:///{db}"
    mlflow.set_tracking_uri(uri)
    client = MlflowClient(uri)
    experiment = client.get_experiment_by_name("raydeck")
    runs = {r.info.run_name: r for r in client.search_runs([experiment.experiment_id])}
    assert set(runs) == {"digits-demo", "again"}
    run = runs["digits-demo"]
    assert run.info.run_id in out
    assert run.info.status == "FINISHED"
    assert run.data.params["epochs"] == "10" and run.data.params["preset"] == "cpu-2"
    for key in ("train_loss", "val_loss", "val_accuracy", "samples_per_s"):
        history = client.get_metric_history(run.info.run_id, key)
        assert sorted(m.step for m in history) == list(range(10)), key
    assert run.data.metrics["val_accuracy"] == pytest.approx(accuracy, abs=1e-3)
    artifacts = {a.path for a in client.list_artifacts(run.info.run_id)}
    assert {"model", "logs"} <= artifacts
    assert "logs/rank_0" in {a.path for a in client.list_artifacts(run.info.run_id, "logs")}
    model = mlflow.pytorch.load_model(f"runs:/{run.info.run_id}/model")
    assert model(__import__("torch").zeros(1, 64)).shape == (1, 10)
    # --register-as: version 1 points at the run, and MLflow alone reproduces the run's
    # accuracy from raw pixels (the job's scaling is inside the model).
    assert "registered model:    models:/digits/1" in out
    version = client.get_model_version("digits", "1")
    assert version.tags["raydeck.run_id"] == run.info.run_id
    _, _, x_val, y_val = raw_split(0)
    served = mlflow.pyfunc.load_model("models:/digits/1")
    predicted = np.asarray(served.predict(x_val)).argmax(axis=1)
    assert (predicted == y_val).mean() == pytest.approx(accuracy, abs=1e-3)
    checkpoint = Path(run.data.tags["raydeck.checkpoint.latest"])
    assert checkpoint.name == "epoch_000009" and (checkpoint / "train_state.pt").exists()
    assert runs["again"].info.status == "FINISHED"
