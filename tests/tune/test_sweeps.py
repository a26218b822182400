"""Sweeps: truthful statuses, any search space, PBT lineage, exactly-once resume, S3 on 2 nodes.

In-process sweeps run on the session's Ray cluster; sweeps that are killed or stopped run as
``raydeck sweep`` processes, as a user (or the job queue, with ``ray job stop``) would run them.
The fast trials of ``tests/sweep_jobs.py`` stand in for training where the test is about the
sweep's bookkeeping; the digits job trains for real where the model matters.
"""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from raydeck.errors import ConfigError
from tests.fixtures.mlflow_server import MlflowServer
from tests.fixtures.processes import ManagedProcess, wait_until
from tests.fixtures.ray_head import RayHead
from tests.fixtures.s3_server import S3Server

REPO = Path(__file__).resolve().parents[2]
SPACE = {
    "lr": {"loguniform": [0.0003, 0.03]},
    "hidden": {"choice": [16, 32, 64, 128]},
    "batch_size": {"choice": [32, 64]},
    "dropout": {"uniform": [0.0, 0.4]},
}
# Values a trial's config may hold that MLflow tags cannot: lists, None, nested groups.
RICH_SPACE = {
    **SPACE,
    "layers": {"choice": [[64], [128, 64], None]},
    "optimizer": {"name": {"choice": ["adam", "adamw"]}, "betas": [0.9, 0.999]},
}
RUN_TIMEOUT_S = 480


def _children(client: Any, parent_run_id: str, order_by: list[str] | None = None
              ) -> list[Any]:
    parent = client.get_run(parent_run_id)
    return client.search_runs(
        [parent.info.experiment_id],
        filter_string=f"tags.mlflow.parentRunId = '{parent_run_id}'", max_results=1000,
        order_by=order_by,
    )


def _parent(client: Any, name: str) -> Any:
    runs = client.search_runs(
        [e.experiment_id for e in client.search_experiments()],
        filter_string=f"tags.`raydeck.run_key` = 'sweep-{name}'",
    )
    assert len(runs) == 1, [r.info.run_id for r in runs]
    return runs[0]


def _steps(client: Any, run_id: str, key: str = "val_accuracy") -> list[int]:
    return sorted(m.step for m in client.get_metric_history(run_id, key))


def _running_best(client: Any, run_id: str, key: str = "val_accuracy") -> list[tuple[int, float]]:
    """(step, best value so far) of ``key`` in run ``run_id``: what ``best_<key>`` should hold."""
    best: float | None = None
    running = []
    for point in sorted(client.get_metric_history(run_id, key), key=lambda m: m.step):
        best = point.value if best is None else max(best, point.value)
        running.append((point.step, best))
    return running


def _rng_state() -> tuple[Any, bytes]:
    return random.getstate(), np.random.get_state()[1].tobytes()


# --- in-process sweeps --------------------------------------------------------------------------
@pytest.mark.slow
@pytest.mark.timeout(600)
def test_asha_sweep_over_lists_nested_groups_and_none_records_the_best_and_registers_it(
    ray_cluster: None, mlflow_client: Any
) -> None:
    import mlflow

    from raydeck.examples.digits import digits_sweep_job, raw_split
    from raydeck.tune import SweepConfig, sweep

    name = f"asha-{uuid.uuid4().hex[:6]}"
    model_name = f"digits-{name}"
    random.seed(7)
    np.random.seed(7)
    before = _rng_state()
    result = sweep(digits_sweep_job(), RICH_SPACE,
                   SweepConfig(name=name, num_samples=8, max_t=8, grace_period=1,
                               reduction_factor=2, register_model_as=model_name, seed=3))
    # The search is seeded through its own generator; the caller's global state is untouched.
    assert _rng_state() == before

    parent = mlflow_client.get_run(result.parent_run_id)
    assert parent.info.status == "FINISHED"
    assert parent.data.params["space.layers"] == "choice([64], [128, 64], null)"
    assert parent.data.params["space.optimizer.name"] == 'choice("adam", "adamw")'
    assert parent.data.params["fixed.optimizer.betas"] == "[0.9, 0.999]"
    children = _children(mlflow_client, result.parent_run_id)
    assert len(children) == 8
    by_trial = {t.trial_id: t for t in result.trials}
    statuses = {c.data.tags["raydeck.trial_status"] for c in children}
    assert statuses <= {"completed", "stopped_early"} and "stopped_early" in statuses
    for child in children:
        tags = child.data.tags
        trial = by_trial[tags["raydeck.trial_id"]]
        stop = int(tags["raydeck.stop_iteration"])
        assert stop == trial.stop_iteration and trial.status == tags["raydeck.trial_status"]
        if trial.status == "stopped_early":
            # ASHA stops at rungs: grace 1, reduction factor 2, max_t 8.
            assert int(tags["raydeck.stopped_at_rung"]) == stop and stop in (1, 2, 4)
        else:
            assert stop == 8 and "raydeck.stopped_at_rung" not in tags
        assert _steps(mlflow_client, child.info.run_id) == list(range(1, stop + 1))
        assert child.data.params["optimizer.betas"] == "[0.9, 0.999]"
        assert json.loads(child.data.params["layers"]) in ([64], [128, 64], None)
        assert child.info.status == "FINISHED"
    assert result.trial_iterations < 8 * 8

    # Each child shows its best val_accuracy so far (not its latest) as best_val_accuracy, at
    # every step, ending at the score the summary ranks by: sorting the children by it in MLflow
    # puts the summary's best first.
    assert result.best_metric == "best_val_accuracy"
    for child in children:
        trial = by_trial[child.data.tags["raydeck.trial_id"]]
        best = sorted((m.step, m.value) for m in mlflow_client.get_metric_history(
            child.info.run_id, "best_val_accuracy"))
        assert best == _running_best(mlflow_client, child.info.run_id)
        assert child.data.metrics["best_val_accuracy"] == trial.best_score == best[-1][1]
    ranked = _children(mlflow_client, result.parent_run_id,
                       order_by=["metrics.best_val_accuracy DESC"])
    assert ranked[0].data.metrics["best_val_accuracy"] == result.best_score
    best_child = next(c for c in ranked if c.info.run_id == result.best_run_id)
    assert best_child.data.metrics["best_val_accuracy"] == result.best_score  # ties share it

    # The best config, lists and None included, survives to the parent: scalars as tags,
    # all of it as JSON.
    tags = parent.data.tags
    assert json.loads(tags["raydeck.best_config"]) == result.best_config
    assert result.best_config["optimizer"]["betas"] == [0.9, 0.999]
    assert tags["best.optimizer.name"] == result.best_config["optimizer"]["name"]
    if result.best_config["layers"] is None:
        assert tags["best.layers"] == "null"
    else:
        assert "best.layers" not in tags
    assert "best.optimizer.betas" not in tags
    assert tags["raydeck.trials_stopped_early"] == str(result.count("stopped_early"))
    assert tags["raydeck.trials_completed"] == str(result.count("completed"))
    assert tags["raydeck.trials_errored"] == "0" and tags["raydeck.trials_preempted"] == "0"
    assert parent.data.metrics["best_val_accuracy"] == pytest.approx(result.best_score)
    # The parent's description (MLflow's note) links the best child run, as the UI shows it.
    assert (f"(#/experiments/{parent.info.experiment_id}/runs/{result.best_run_id})"
            in tags["mlflow.note.content"])
    best_history = mlflow_client.get_metric_history(result.best_run_id, "val_accuracy")
    assert max(m.value for m in best_history) == pytest.approx(result.best_score)
    assert result.slot_usage is not None and 0 <= result.slot_usage.idle_fraction < 1

    assert result.registered_model_uri == f"models:/{model_name}/1"
    version = mlflow_client.get_model_version(model_name, "1")
    assert version.tags["raydeck.sweep_run_id"] == result.parent_run_id
    assert version.tags["raydeck.trial_id"] == result.best_trial_id
    mlflow.set_tracking_uri(mlflow_client.tracking_uri)
    # Self-contained: raw pixels in, the trial's scaling inside the model.
    model = mlflow.pyfunc.load_model(result.registered_model_uri)
    _, _, x_val, y_val = raw_split(0)
    predictions = np.asarray(model.predict(x_val)).argmax(axis=1)
    assert (predictions == y_val).mean() > 0.5


@pytest.mark.timeout(300)
def test_fifo_stops_no_trial_early_and_marks_an_erroring_trial_with_its_error(
    ray_cluster: None, mlflow_client: Any
) -> None:
    import dataclasses

    from raydeck.errors import SweepFinalizeError
    from raydeck.tune import SweepConfig, sweep
    from tests.sweep_jobs import score_job

    def unbuildable(config: dict[str, Any]) -> Any:
        raise RuntimeError("model factory is broken")

    name = f"fifo-{uuid.uuid4().hex[:6]}"
    model_name = f"score-{name}"
    space = {"lr": {"uniform": [0.01, 0.1]}, "fail_at": {"grid": [None, 2]}}
    config = SweepConfig(name=name, scheduler="fifo", num_samples=2, max_t=3,
                         register_model_as=model_name)
    # The registry step fails after every trial ran: the error says what is kept and what to
    # run; --resume then registers without re-running a trial.
    with pytest.raises(SweepFinalizeError, match=rf"sweep {name!r}: the best trial .* is recorded "
                       rf".* registering it as {model_name!r} failed \(RuntimeError: model "
                       rf"factory is broken\); fix that and run `raydeck sweep --name {name} "
                       rf"--resume`"):
        sweep(dataclasses.replace(score_job(), model_factory=unbuildable), space, config)
    assert _parent(mlflow_client, name).data.tags["raydeck.sweep_state"] == "registry_failed"
    result = sweep(score_job(), None, SweepConfig(name=name), resume=True)
    assert result.registered_model_uri == f"models:/{model_name}/1"
    assert _parent(mlflow_client, name).data.tags["raydeck.sweep_state"] == "finished"

    children = _children(mlflow_client, result.parent_run_id)
    assert len(children) == 4
    for child in children:
        tags = child.data.tags
        params = child.data.params
        assert "raydeck.stopped_at_rung" not in tags
        if params["fail_at"] == "null":
            assert tags["raydeck.trial_status"] == "completed"
            assert tags["raydeck.stop_iteration"] == "3" and child.info.status == "FINISHED"
            assert _steps(mlflow_client, child.info.run_id) == [1, 2, 3]
        else:
            assert tags["raydeck.trial_status"] == "errored" and child.info.status == "FAILED"
            assert tags["raydeck.trial_error"] == (
                f"ValueError: diverged at iteration 2 (lr={float(params['lr'])})")
            assert tags["raydeck.stop_iteration"] == "1"
            assert _steps(mlflow_client, child.info.run_id) == [1]
    # The best so far at each step, errored trials included, and nothing more when a resume
    # summarizes again.
    by_trial = {t.trial_id: t for t in result.trials}
    for child in children:
        best = sorted((m.step, m.value) for m in mlflow_client.get_metric_history(
            child.info.run_id, "best_val_accuracy"))
        assert best == _running_best(mlflow_client, child.info.run_id)
        assert best[-1][1] == by_trial[child.data.tags["raydeck.trial_id"]].best_score
    assert {t.status for t in result.trials} == {"completed", "errored"}
    assert all(t.error and t.error.startswith("ValueError: diverged") for t in result.trials
               if t.status == "errored")
    tags = mlflow_client.get_run(result.parent_run_id).data.tags
    assert (tags["raydeck.trials_completed"], tags["raydeck.trials_errored"],
            tags["raydeck.trials_stopped_early"]) == ("2", "2", "0")


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_pbt_exploits_record_lineage_and_every_curve_once(
    ray_cluster: None, mlflow_client: Any
) -> None:
    from raydeck.tune import SweepConfig, sweep
    from tests.sweep_jobs import score_job

    name = f"pbt-{uuid.uuid4().hex[:6]}"
    before = _rng_state()
    result = sweep(score_job(), {"lr": {"loguniform": [0.001, 0.1]}},
                   SweepConfig(name=name, scheduler="pbt", num_samples=8, max_t=8,
                               perturbation_interval=2, seed=1))
    assert _rng_state() == before

    children = _children(mlflow_client, result.parent_run_id)
    assert len(children) == 8
    exploited = [c for c in children if "raydeck.pbt.source_trial" in c.data.tags]
    assert exploited, "PBT never exploited"
    # An exploited trial stops logging its best (its process does not know its own before the
    # exploit); the summary writes the score, and it is the value MLflow shows.
    by_trial = {t.trial_id: t for t in result.trials}
    for child in children:
        score = by_trial[child.data.tags["raydeck.trial_id"]].best_score
        assert child.data.metrics["best_val_accuracy"] == score
    trial_ids = {c.data.tags["raydeck.trial_id"] for c in children}
    for child in children:
        tags = child.data.tags
        assert child.info.status == "FINISHED" and tags["raydeck.trial_status"] == "completed"
        assert "raydeck.trial_error" not in tags
        steps = _steps(mlflow_client, child.info.run_id)
        assert steps == list(range(1, len(steps) + 1)), (tags["raydeck.trial_id"], steps)
    for child in exploited:
        tags = child.data.tags
        assert tags["raydeck.pbt.source_trial"] in trial_ids - {tags["raydeck.trial_id"]}
        changed = json.loads(tags["raydeck.pbt.changed"])
        assert set(changed) == {"lr"} and changed["lr"][0] != changed["lr"][1]
        # The params keep the trial's first values; the current ones are in its config tag.
        assert json.loads(tags["raydeck.trial_config"])["lr"] == changed["lr"][1]
        files = [f.path for f in mlflow_client.list_artifacts(child.info.run_id, "pbt")]
        assert files and all(f.startswith("pbt/exploit-") for f in files)
        local = mlflow_client.download_artifacts(child.info.run_id, files[-1])
        lineage = json.loads(Path(local).read_text())
        assert lineage["source_trial"] in trial_ids and lineage["source_checkpoint"]
        assert lineage["from_step"] >= 2 and lineage["config"]["lr"] == lineage["changed"]["lr"][1]
        # The exploit continued the source's model: the score jumped to the source's.
        history = sorted(mlflow_client.get_metric_history(child.info.run_id, "score"),
                         key=lambda m: m.step)
        assert len(history) >= lineage["from_step"]


@pytest.mark.timeout(120)
@pytest.mark.parametrize(
    ("space", "overrides", "message"),
    [
        ({**SPACE, "lr": {"lognormal": [0.1, 1]}}, {}, "unknown distribution 'lognormal'"),
        ({**SPACE, "hidden": {"choice": []}}, {}, "choice needs at least one value"),
        (SPACE, {"metric": "val_acc"}, "metric='val_acc' is never reported by this job"),
        (SPACE, {"grace_period": 9}, "grace_period=9 > max_t=8"),
        ({**SPACE, "dropout": {"uniform": [0.5, 0.1]}}, {}, "uniform needs low < high"),
        (SPACE, {"scheduler": "pbt", "pbt_mutations": ("depth",)},
         "search space has no dimension 'depth'"),
        ({"hidden": {"grid": [16, 32]}}, {"scheduler": "pbt"}, "needs a dimension to perturb"),
    ],
)
def test_bad_sweep_input_fails_before_any_trial_starts(
    ray_cluster: None, mlflow_client: Any, space: dict[str, Any], overrides: dict[str, Any],
    message: str
) -> None:
    from raydeck.config.settings import load_settings
    from raydeck.examples.digits import digits_sweep_job
    from raydeck.tune import SweepConfig, sweep, sweep_storage_path

    name = f"bad-{uuid.uuid4().hex[:6]}"
    with pytest.raises(ConfigError, match=message):
        sweep(digits_sweep_job(), space, SweepConfig(name=name, **overrides))
    assert not (Path(sweep_storage_path(load_settings())) / name).exists()
    assert not mlflow_client.search_runs(
        [e.experiment_id for e in mlflow_client.search_experiments()],
        filter_string=f"tags.`raydeck.run_key` = 'sweep-{name}'",
    )


# --- killed and stopped drivers -------------------------------------------------------------------
def _sweep_command(*args: str) -> list[str]:
    return [sys.executable, "-m", "raydeck.cli", "sweep", *args]


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_a_sweep_killed_inside_a_report_resumes_with_every_iteration_once(
    ray_cluster: None, mlflow_client: Any, tmp_path: Path
) -> None:
    import ray

    name = f"kill-{uuid.uuid4().hex[:6]}"
    pid_file = tmp_path / "driver.pid"
    space = tmp_path / "space.yaml"
    space.write_text(json.dumps({"lr": {"uniform": [0.01, 0.1]}, "kill_driver_at": 3,
                                 "driver_pid_file": str(pid_file)}))
    args = _sweep_command("--space", str(space), "--name", name, "--job",
                          "tests.sweep_jobs:score_job", "--num-samples", "4", "--max-t", "6",
                          "--scheduler", "fifo", "--max-concurrent", "2", "--register-as", "")
    env = {**os.environ, "RAY_ADDRESS": ray.get_runtime_context().gcs_address}
    driver = subprocess.Popen(args, env=env, cwd=REPO, stdout=subprocess.DEVNULL,
                              stderr=subprocess.PIPE, text=True, start_new_session=True)
    pid_file.write_text(str(driver.pid))
    try:
        # A trial kills the driver while it reports iteration 3: after the point was logged,
        # before Tune heard of it.
        returncode = driver.wait(RUN_TIMEOUT_S)
    finally:
        if driver.poll() is None:
            os.killpg(driver.pid, signal.SIGKILL)
    assert returncode == -signal.SIGKILL, driver.stderr.read() if driver.stderr else ""
    assert Path(f"{pid_file}.killed").exists()

    # Resume at once: the resumed driver itself waits for the killed one's trial processes.
    resumed = subprocess.run([*args, "--resume"], env=env, cwd=REPO, capture_output=True,
                             text=True, timeout=RUN_TIMEOUT_S)
    assert resumed.returncode == 0, resumed.stdout[-3000:] + resumed.stderr[-3000:]

    parent = _parent(mlflow_client, name)
    assert parent.info.status == "FINISHED" and parent.info.run_name == name
    # The summary prints what MLflow shows: the score's key and a link to the sweep's run.
    link = (f"{mlflow_client.tracking_uri}/#/experiments/{parent.info.experiment_id}/runs/"
            f"{parent.info.run_id}")
    assert f"open: {link}" in resumed.stdout, resumed.stdout[-3000:]
    best = parent.data.tags["raydeck.best_trial_id"]
    assert (f"best trial {best}: best_val_accuracy "
            f"{parent.data.metrics['best_val_accuracy']:.4f}") in resumed.stdout
    children = _children(mlflow_client, parent.info.run_id)
    assert len(children) == 4
    assert any(c.data.tags.get("raydeck.trial_resumed") == "true" for c in children)
    for child in children:
        for key in ("val_accuracy", "score", "best_val_accuracy"):
            points = mlflow_client.get_metric_history(child.info.run_id, key)
            # Every iteration exactly once: count the points, not just the steps.
            assert sorted(m.step for m in points) == [1, 2, 3, 4, 5, 6], (
                child.data.tags["raydeck.trial_id"], key,
                sorted((m.step, m.timestamp, m.value) for m in points))
        assert child.data.metrics["best_val_accuracy"] == max(
            m.value for m in mlflow_client.get_metric_history(child.info.run_id,
                                                              "val_accuracy"))
        assert child.data.tags["raydeck.trial_status"] == "completed"


def _clean_env() -> dict[str, str]:
    return {k: v for k, v in os.environ.items()
            if not k.startswith(("RAYDECK_", "RAY_", "AWS_", "MLFLOW_"))}


@pytest.fixture(scope="module")
def two_node_cluster(tmp_path_factory: pytest.TempPathFactory, raydeck_env: dict[str, str]
                     ) -> Iterator[RayHead]:
    """Two ``ray start`` nodes on this machine (2 CPUs each), as two machines would be."""
    from tests.conftest import TEST_ENV

    root = tmp_path_factory.mktemp("two-nodes")
    env = {**_clean_env(), **{k: v for k, v in TEST_ENV.items() if k != "RAY_AUTH_MODE"},
           "PATH": f"{Path(sys.executable).parent}:{os.environ.get('PATH', '')}"}
    head = _started_head(root, env)
    try:
        head.add_worker_node(num_cpus=2)
        yield head
    finally:
        head.stop()


def _started_head(root: Path, env: dict[str, str], attempts: int = 3) -> RayHead:
    """A started head; on a busy machine Ray's fixed 30 s registration deadline can fail one."""
    for attempt in range(1, attempts + 1):
        try:
            return RayHead(root / f"head-{attempt}", env, num_cpus=2).start()
        except (TimeoutError, RuntimeError):
            if attempt == attempts:
                raise
    raise AssertionError("unreachable")


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_distributed_trials_on_two_nodes_keep_their_state_in_s3_and_resume_after_sigterm(
    two_node_cluster: RayHead, s3_server: S3Server, mlflow_server: MlflowServer,
    mlflow_client: Any, tmp_path: Path
) -> None:
    from raydeck.config.settings import load_settings
    from raydeck.storage import init_buckets

    key = uuid.uuid4().hex[:6]
    name = f"dist-{key}"
    model_name = f"digits-{name}"
    buckets = {"RAYDECK_S3_ARTIFACTS_BUCKET": f"sw-art-{key}",
               "RAYDECK_S3_CHECKPOINTS_BUCKET": f"sw-ckpt-{key}", "RAYDECK_S3_PREFIX": "team"}
    init_buckets(load_settings(env=s3_server.settings_env(**buckets)).storage, probe=False)
    # Six epochs, stopped once the first is in MLflow: a SIGTERM lets the trial train on while
    # the driver marks it (1.5 s) and Tune stops it, and an epoch takes about 2 s here; with three
    # epochs the trial could report its last one first, end "completed", and leave nothing to
    # resume (CI saw that: 0 trials marked preempted).
    epochs = 6
    space = tmp_path / "space.yaml"
    space.write_text(json.dumps({"lr": {"loguniform": [0.003, 0.01]},
                                 "hidden": {"choice": [32, 64]}, "epochs": epochs}))
    # One trial of two 1-CPU workers, one on each node: both nodes train it, and it is running
    # when the driver is stopped. (A second trial would prove nothing more about S3 or the
    # resume, and it doubles the processes a trial starts: its Tune actor, Ray Train's four and
    # its workers, twice with the resume.)
    presets = tmp_path / "presets.yaml"
    presets.write_text(json.dumps({"spread-2": {"num_workers": 2, "cpus_per_worker": 1,
                                                "placement_strategy": "STRICT_SPREAD"}}))
    args = _sweep_command("--space", str(space), "--name", name, "--job",
                          "raydeck.examples.digits:digits_distributed_sweep_job",
                          "--preset", "spread-2", "--num-samples", "1", "--max-t", str(epochs),
                          "--scheduler", "fifo", "--register-as", model_name)

    def driver_env(data_dir: Path) -> dict[str, str]:
        return {**_clean_env(), **two_node_cluster.client_env,
                "RAY_ADDRESS": two_node_cluster.gcs_address,
                "RAYDECK_TRACKING_URI": mlflow_server.uri,
                "RAYDECK_TRACKING_EXPERIMENT": f"sweeps-{key}",
                "RAYDECK_RAY_NAMESPACE": f"sweeps-{key}",
                "RAYDECK_DATA_DIR": str(data_dir), "RAYDECK_LOG_LEVEL": "INFO",
                "RAYDECK_TRACKING_SYSTEM_METRICS_INTERVAL_S": "0",
                "RAY_TRAIN_HEALTH_CHECK_INTERVAL_S": "0.5",
                "RAYDECK_PRESETS_FILE": str(presets),
                **s3_server.settings_env(**buckets)}

    first_dir = tmp_path / "first"
    first_dir.mkdir()
    driver = ManagedProcess(args, log_path=tmp_path / "first.log", cwd=first_dir)
    driver.env = driver_env(first_dir / "data")
    driver.start()
    try:
        # Stop it as `ray job stop` does (SIGTERM) once its first epoch landed.
        wait_until(lambda: _epochs_logged(mlflow_client, name) >= 1 or not driver.alive(),
                   RUN_TIMEOUT_S, "an epoch logged", interval_s=0.5)
        assert driver.alive(), driver.log_tail()
        assert driver.proc is not None
        driver.proc.send_signal(signal.SIGTERM)
        returncode = driver.proc.wait(60)
    finally:
        driver.stop()
    log = (tmp_path / "first.log").read_text()
    assert returncode == 2 and "marked preempted" in log and "--resume" in log, log[-3000:]
    parent = _parent(mlflow_client, name)
    assert parent.info.status == "KILLED"
    assert parent.data.tags["raydeck.sweep_state"] == "preempted"
    marked = int(parent.data.tags["raydeck.trials_preempted"])

    def preempted_children() -> list[Any]:
        return [c for c in _children(mlflow_client, parent.info.run_id)
                if c.data.tags.get("raydeck.trial_status") == "preempted"]

    # The marks go through the tracking proxy, which lands them moments after the driver exits.
    wait_until(lambda: len(preempted_children()) == marked, 60, "preempted trials landed",
               interval_s=0.5)
    assert marked and all(c.info.status == "KILLED" for c in preempted_children()), log[-3000:]

    # Resume from another directory, with a data dir of its own: the state is in the bucket.
    second_dir = tmp_path / "second"
    second_dir.mkdir()
    resumed = subprocess.run([*args, "--resume"], env=driver_env(second_dir / "data"),
                             cwd=second_dir, capture_output=True, text=True,
                             timeout=RUN_TIMEOUT_S)
    assert resumed.returncode == 0, resumed.stdout[-3000:] + resumed.stderr[-3000:]

    parent = _parent(mlflow_client, name)
    assert parent.info.status == "FINISHED" and parent.data.tags["raydeck.trials_preempted"] == "0"
    children = _children(mlflow_client, parent.info.run_id)
    assert len(children) == 1
    for child in children:
        assert child.data.tags["raydeck.trial_status"] == "completed", child.data.tags
        assert _steps(mlflow_client, child.info.run_id) == list(range(epochs))
        assert child.data.tags.get("raydeck.trial_resumed") == "true", child.data.tags
        # The resumed trial's process never saw its first epochs: the summary wrote its score.
        assert child.data.metrics["best_val_accuracy"] == max(
            m.value for m in mlflow_client.get_metric_history(child.info.run_id,
                                                              "val_accuracy"))
    assert f"open: {mlflow_server.uri}/#/experiments/{parent.info.experiment_id}/runs/" \
           f"{parent.info.run_id}" in resumed.stdout, resumed.stdout[-3000:]
    assert len(_train_worker_nodes(two_node_cluster)) == 2
    assert parent.data.tags["raydeck.registered_model"] == f"models:/{model_name}/1"
    version = mlflow_client.get_model_version(model_name, "1")
    assert version.tags["raydeck.run_id"] in {c.info.run_id for c in children}

    # Sweep state and every trial's checkpoints are in the bucket, and the secret nowhere.
    s3 = s3_server.client()
    objects = [o.object_name for o in s3.list_objects(buckets["RAYDECK_S3_CHECKPOINTS_BUCKET"],
                                                      "team/", recursive=True)]
    assert any(o.startswith(f"team/sweeps/{name}/experiment_state") for o in objects)
    for child in children:
        trial_key = f"sweep-{name}.{child.data.tags['raydeck.trial_id']}"
        assert any(o.startswith(f"team/{trial_key}/epoch_") for o in objects), trial_key
    secret = s3_server.secret_access_key.encode()
    for bucket in (buckets["RAYDECK_S3_ARTIFACTS_BUCKET"],
                   buckets["RAYDECK_S3_CHECKPOINTS_BUCKET"]):
        for obj in s3.list_objects(bucket, "team/", recursive=True):
            answer = s3.get_object(bucket, obj.object_name)
            try:
                assert secret not in answer.read(), obj.object_name
            finally:
                answer.close()
                answer.release_conn()


def _epochs_logged(client: Any, name: str) -> int:
    runs = client.search_runs(
        [e.experiment_id for e in client.search_experiments()],
        filter_string=f"tags.`raydeck.sweep` = 'sweep-{name}'", max_results=100)
    return sum(len(client.get_metric_history(r.info.run_id, "val_accuracy")) for r in runs)


def _train_worker_nodes(head: RayHead) -> set[str]:
    """Nodes on which the cluster ran Ray Train workers (Ray's state API on the head)."""
    import urllib.request

    request = urllib.request.Request(
        f"{head.address}/api/v0/actors?limit=1000&detail=1&filter_keys=class_name"
        "&filter_predicates=%3D&filter_values=RayTrainWorker",
        headers={"Authorization": f"Bearer {head.token_path.read_text()}"},
    )
    with urllib.request.urlopen(request, timeout=30) as answer:
        actors = json.loads(answer.read())["data"]["result"]["result"]
    return {actor["node_id"] for actor in actors}
