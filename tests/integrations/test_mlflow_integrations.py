"""MLflow's own integrations, unchanged but for a ``raydeck+`` tracking URI, against a real
MLflow server: Lightning's ``MLFlowLogger`` in a 2-worker Ray Train job (its MLflow server
SIGKILLed mid-training), ``mlflow.pytorch.autolog()`` around a Lightning fit (its params,
metrics and model), Ray Tune's ``MLflowLoggerCallback`` and ``setup_mlflow`` in an ASHA sweep,
and ``MlflowClient().log_batch`` from Ray actors. A plain ``mlflow.log_metric`` loop
(``jobs/mlflow_loop.py``) while its MLflow server is SIGKILLed runs as a ``ray job submit``
driver in tests/jobs/test_jobs.py. Every metric, param and tag lands once at its step, each run ends
with the right status, no stray run appears (counted through MLflow's REST API), and, MLflow's
system-metrics switch being off, no ``system/`` metric is added. The
integrations' code is in :mod:`tests.fixtures.mlflow_integrations`.
"""

from __future__ import annotations

import json
import time
import uuid
from pathlib import Path
from typing import Any

import pytest

from tests.fixtures import mlflow_integrations as integrations
from tests.fixtures.mlflow_server import MlflowServer
from tests.fixtures.processes import wait_until
from tests.fixtures.tracking import (
    driver_process,
    metric_steps,
    read_line_with,
)

RUN_END_TIMEOUT_S = 60.0


def _runs(client: Any, experiment: str) -> list[Any]:
    from mlflow.entities import ViewType

    found = client.get_experiment_by_name(experiment)
    if found is None:
        return []
    return list(client.search_runs([found.experiment_id], run_view_type=ViewType.ALL))


def _assert_once_each(client: Any, run_id: str, key: str, steps: list[int]) -> None:
    assert metric_steps(client, run_id, key) == steps, key


def _assert_no_system_metrics(client: Any, run_id: str) -> None:
    """As plain MLflow: MLflow's switch (MLFLOW_ENABLE_SYSTEM_METRICS_LOGGING) is off."""
    system = [k for k in client.get_run(run_id).data.metrics if k.startswith("system/")]
    assert system == [], system


@pytest.mark.timeout(600)
def test_lightning_mlflow_logger_in_a_ray_train_job_keeps_every_step_while_mlflow_is_killed(
        ray_cluster: None, killable_mlflow: MlflowServer, tmp_path: Path) -> None:
    """Lightning's own logger in a 2-worker Ray Train job; MLflow SIGKILLed after step 2 and
    kept down until rank 0 has trained its last step: training never waits on it, and the
    run, ended once MLflow is back, has every step once."""
    from concurrent.futures import ThreadPoolExecutor

    from mlflow.tracking import MlflowClient
    from ray.train import RunConfig, ScalingConfig
    from ray.train.torch import TorchTrainer

    from raydeck.tracking.proxy.actors import stop_proxy

    client = MlflowClient(killable_mlflow.uri)
    experiment = f"lightning-{uuid.uuid4().hex[:6]}"
    namespace = f"raydeck-test-{uuid.uuid4().hex[:8]}"  # a proxy of its own for this server
    gate = tmp_path / "gate"
    gate.mkdir()
    epochs = 5
    trainer = TorchTrainer(
        integrations.lightning_train_loop,
        train_loop_config={"uri": f"raydeck+{killable_mlflow.uri}", "experiment": experiment,
                           "epochs": epochs, "gate": str(gate), "namespace": namespace},
        scaling_config=ScalingConfig(num_workers=2),
        run_config=RunConfig(name=experiment, storage_path=str(tmp_path / "train")))
    with ThreadPoolExecutor(1) as pool:
        fitted = pool.submit(trainer.fit)
        try:
            wait_until(lambda: (gate / "paused").exists() or fitted.done(), 300,
                       "rank 0 to pause after its second step")
            killable_mlflow.kill()
            killed_at = time.monotonic()
            (gate / "go").touch()
            wait_until(lambda: (gate / "trained").exists() or fitted.done(), 120,
                       "rank 0 to train its last step with MLflow down")
            down_s = time.monotonic() - killed_at
        finally:
            (gate / "go").touch()
            if not killable_mlflow.alive():
                killable_mlflow.start()
        fitted.result(timeout=300)
    stop_proxy(namespace, 60)
    assert (gate / "trained").exists()
    runs = _runs(client, experiment)
    assert len(runs) == 1, [(r.info.run_id, r.info.run_name) for r in runs]
    run_id = runs[0].info.run_id
    wait_until(lambda: client.get_run(run_id).info.status == "FINISHED", RUN_END_TIMEOUT_S,
               "the Lightning run to end")
    run = client.get_run(run_id)
    # Each worker sees half the samples: 2 batches per epoch, one global step per batch.
    steps_per_epoch = integrations.LIGHTNING_SAMPLES // integrations.LIGHTNING_BATCH_SIZE // 2
    # Every step of rank 0 once; validation at each epoch's last step; hparams once.
    _assert_once_each(client, run_id, "train_loss", list(range(steps_per_epoch * epochs)))
    _assert_once_each(client, run_id, "val_loss",
                      [steps_per_epoch * (e + 1) - 1 for e in range(epochs)])
    assert run.data.params["lr"] == str(integrations.LEARNING_RATE)
    assert run.data.tags["raydeck.run_key"] == experiment
    _assert_no_system_metrics(client, run_id)
    print(f"\nLightning with MLflow killed: down {down_s:.1f} s while rank 0 trained steps "
          f"{integrations.PAUSE_AT_STEP + 1}-{steps_per_epoch * epochs - 1}")


@pytest.mark.timeout(300)
def test_tune_mlflow_callback_and_setup_mlflow_in_an_asha_sweep(
        ray_cluster: None, mlflow_server: MlflowServer, mlflow_client: Any,
        tmp_path: Path) -> None:
    """A plain Tuner driver, nothing of raydeck imported; its environment names raydeck's Tune
    callback (as raydeck's own drivers and jobs do), so each trial's own run ends with the
    trial's outcome."""
    from raydeck.cluster.connection import RAY_TUNE_CALLBACKS_ENV, TUNE_OUTCOME_CALLBACK

    experiment = f"tune-{uuid.uuid4().hex[:6]}"
    proc = driver_process("\n".join([
        "import runpy, sys",
        f"sys.argv = ['x', 'sweep', 'raydeck+{mlflow_server.uri}', '{experiment}', "
        f"'{tmp_path}']",
        "runpy.run_module('tests.fixtures.mlflow_integrations', run_name='__main__')",
    ]), env={RAY_TUNE_CALLBACKS_ENV: TUNE_OUTCOME_CALLBACK})
    trials = json.loads(read_line_with(proc, "RESULT"))
    assert proc.wait(timeout=60) == 0, proc.stderr.read()[-3000:] if proc.stderr else ""
    assert len(trials) == 2
    runs = _runs(mlflow_client, experiment)
    # Per trial: the callback's run (made on the driver, named for the trial) and the run the
    # trial's setup_mlflow started, bound to raydeck's run of that trial process. Nothing else.
    assert len(runs) == 4, [(r.info.run_name, r.data.tags) for r in runs]
    for trial in trials:
        iterations = trial["iterations"]
        callback_run, = (r for r in runs if r.info.run_name.endswith(trial["trial_id"]))
        # The callback logs each reported result at its training_iteration, and ends the run.
        _assert_once_each(mlflow_client, callback_run.info.run_id, "loss",
                          list(range(1, iterations + 1)))
        assert callback_run.data.params["lr"] == str(trial["lr"])
        assert callback_run.info.status == "FINISHED"
        _assert_no_system_metrics(mlflow_client, callback_run.info.run_id)
        trial_run, = (r for r in runs if r.data.tags.get("raydeck.created_by") == "trial"
                      and r.data.params["lr"] == str(trial["lr"]))
        _assert_once_each(mlflow_client, trial_run.info.run_id, "trial_loss",
                          list(range(iterations)))
        # Nothing in the trial ends setup_mlflow's run (plain MLflow leaves it RUNNING): raydeck
        # ends it with the outcome Tune reported (ASHA's stop or the function's return) once
        # Tune stopped the trial's process.
        wait_until(lambda r=trial_run: mlflow_client.get_run(r.info.run_id).info.status
                   != "RUNNING", RUN_END_TIMEOUT_S, "the trial's run to end")
        assert mlflow_client.get_run(trial_run.info.run_id).info.status == "FINISHED"
        _assert_no_system_metrics(mlflow_client, trial_run.info.run_id)


@pytest.mark.timeout(120)
def test_mlflow_client_log_batch_from_ray_actors_lands_once(
        ray_cluster: None, mlflow_server: MlflowServer, mlflow_client: Any) -> None:
    """Ray actors write to the driver's run by id and live on: the driver's ``set_terminated``
    ends the run at once with every point landed, and a write after the end lands in the
    ended run without reopening it (as in plain MLflow)."""
    import ray
    from mlflow.tracking import MlflowClient

    uri = f"raydeck+{mlflow_server.uri}"
    client = MlflowClient(tracking_uri=uri)
    experiment = f"actors-{uuid.uuid4().hex[:6]}"
    experiment_id = client.create_experiment(experiment)
    run_id = client.create_run(experiment_id, run_name="actors").info.run_id
    actor_class = ray.remote(num_cpus=0)(integrations.BatchLogger)
    actors = [actor_class.remote(uri) for _ in range(3)]
    try:
        keys = [f"actor_{i}" for i in range(len(actors))]
        ray.get([actor.log.remote(run_id, key) for actor, key in zip(actors, keys, strict=True)],
                timeout=60)
        client.set_terminated(run_id)
        # Returned once MLflow showed the run ended, while its writers are alive.
        assert mlflow_client.get_run(run_id).info.status == "FINISHED"
        for key in keys:
            _assert_once_each(mlflow_client, run_id, key, list(range(integrations.ACTOR_STEPS)))
        ray.get(actors[0].log.remote(run_id, "late"), timeout=60)
        wait_until(lambda: len(metric_steps(mlflow_client, run_id, "late"))
                   >= integrations.ACTOR_STEPS, RUN_END_TIMEOUT_S, "the late write to land")
        _assert_once_each(mlflow_client, run_id, "late", list(range(integrations.ACTOR_STEPS)))
        assert mlflow_client.get_run(run_id).info.status == "FINISHED"
        _assert_no_system_metrics(mlflow_client, run_id)
    finally:
        for actor in actors:
            ray.kill(actor)
    assert [r.info.run_id for r in _runs(mlflow_client, experiment)] == [run_id]


@pytest.mark.timeout(300)
def test_pytorch_autolog_around_a_lightning_fit_logs_one_finished_run_and_its_model(
        ray_cluster: None, mlflow_server: MlflowServer, mlflow_client: Any,
        tmp_path: Path) -> None:
    experiment = f"autolog-{uuid.uuid4().hex[:6]}"
    epochs = 2
    proc = driver_process(
        "import runpy, sys\n"
        f"sys.argv = ['mlflow_integrations', 'autolog', '{experiment}', '{epochs}']\n"
        "runpy.run_module('tests.fixtures.mlflow_integrations', run_name='__main__')\n",
        env={"MLFLOW_TRACKING_URI": f"raydeck+{mlflow_server.uri}",
             "RAYDECK_DATA_DIR": str(tmp_path)})
    try:
        run_id = read_line_with(proc, "RESULT")
        assert proc.wait(timeout=120) == 0, proc.stderr.read()[-3000:] if proc.stderr else ""
    finally:
        proc.kill()
    wait_until(lambda: mlflow_client.get_run(run_id).info.status == "FINISHED",
               RUN_END_TIMEOUT_S, "the autolog run to end")
    run = mlflow_client.get_run(run_id)
    # Autolog's params (the fit's and the optimizer's), each epoch's metrics once at its epoch.
    assert {k: run.data.params[k] for k in ("epochs", "optimizer_name", "lr")} == {
        "epochs": str(epochs), "optimizer_name": "SGD", "lr": str(integrations.LEARNING_RATE)}
    for key in ("train_loss", "val_loss"):
        _assert_once_each(mlflow_client, run_id, key, list(range(epochs)))
    # Its artifacts went through the raydeck+ URI too: the model summary, and the model.
    assert "model_summary.txt" in {a.path for a in mlflow_client.list_artifacts(run_id)}
    [model] = run.outputs.model_outputs
    assert mlflow_client.get_logged_model(model.model_id).status.name == "READY"
    assert "MLmodel" in {a.path for a in mlflow_client.list_logged_model_artifacts(
        model.model_id)}
    assert [r.info.run_id for r in _runs(mlflow_client, experiment)] == [run_id]
