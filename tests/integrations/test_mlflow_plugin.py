"""Existing MLflow code, with only ``MLFLOW_TRACKING_URI`` changed to a ``raydeck+`` URI, logs
through raydeck's proxy: every value lands exactly once, runs end with the right status, no
stray runs; bad input raises MLflow's own exception where MLflow would raise it.

Counts are read back through the real MLflow server's REST API (the session's server).
"""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
import uuid
from pathlib import Path
from typing import Any

import pytest

from raydeck.config.settings import load_settings
from raydeck.config.tracking_uri import unwrap_tracking_uri
from raydeck.errors import ConfigError
from raydeck.tracking.messages import AttachRequest, ProcessInfo, ProxyConfig
from raydeck.tracking.proxy.outbox import Control
from raydeck.tracking.proxy.router import RouterCore
from raydeck.tracking.proxy.run_lookup import Lookup
from tests.fixtures.mlflow_server import MlflowServer
from tests.fixtures.processes import wait_until
from tests.fixtures.tracking import driver_process, metric_steps, read_line_with

STEPS = 40
KEYS = ("loss", "acc", "lr")
# The names MLflow's own monitors give a node's system metrics (CPU, disk, network).
MLFLOW_SYSTEM_METRICS = (
    "cpu_utilization_percentage", "system_memory_usage_megabytes",
    "system_memory_usage_percentage", "disk_usage_megabytes", "disk_usage_percentage",
    "disk_available_megabytes", "network_receive_megabytes", "network_transmit_megabytes")


def _all_runs(client: Any) -> list[Any]:
    from mlflow.entities import ViewType

    experiments = [e.experiment_id for e in client.search_experiments(view_type=ViewType.ALL)]
    return list(client.search_runs(experiments, run_view_type=ViewType.ALL, max_results=5000))


def test_raydeck_uris_name_their_backend_in_raydecks_settings() -> None:
    assert unwrap_tracking_uri("raydeck+http://h:5000") == "http://h:5000"
    assert unwrap_tracking_uri("raydeck+sqlite:////tmp/m.db") == "sqlite:////tmp/m.db"
    assert unwrap_tracking_uri("raydeck://") == ""
    assert unwrap_tracking_uri("http://h:5000") == "http://h:5000"
    settings = load_settings({"MLFLOW_TRACKING_URI": "raydeck+http://h:5000"})
    assert settings.tracking.uri == "http://h:5000"
    # raydeck:// is raydeck's own resolution: the embedded default here.
    assert load_settings({"MLFLOW_TRACKING_URI": "raydeck://"}).tracking.uri.startswith(
        "sqlite:")


def test_proxied_artifact_locations_resolve_against_a_raydeck_uris_backend() -> None:
    """MLflow resolves ``mlflow-artifacts:`` against the tracking URI and accepts only http(s);
    raydeck's repository (entry point ``mlflow.artifact_repository``) gives it the backend."""
    from mlflow.store.artifact.artifact_repository_registry import get_artifact_repository

    location = "mlflow-artifacts:/1/abc/artifacts"
    served = "http://h:5000/api/2.0/mlflow-artifacts/artifacts/1/abc/artifacts"
    for tracking_uri in ("raydeck+http://h:5000", "http://h:5000"):
        assert get_artifact_repository(location, tracking_uri=tracking_uri).artifact_uri == served


@pytest.mark.timeout(120)
@pytest.mark.parametrize("first", ["mlflow.store.artifact.artifact_repository_registry",
                                   "raydeck.integrations.mlflow_artifacts"])
def test_the_repository_is_registered_whichever_is_imported_first(first: str) -> None:
    """A fresh process, in both orders: MLflow's registry loading the entry point (the usual
    order), and the repository's module imported first, so that MLflow's registry loads the
    entry point while that module is half imported (and warns); both end with raydeck's class
    registered for ``mlflow-artifacts``."""
    code = (f"import {first}\n"  # nothing else imports raydeck's module again
            "from mlflow.store.artifact.artifact_repository_registry import "
            "get_registered_artifact_repositories\n"
            "repository = get_registered_artifact_repositories()['mlflow-artifacts']\n"
            "print(repository.__module__, repository.__name__)\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=100, check=True)
    assert done.stdout.split() == ["raydeck.integrations.mlflow_artifacts",
                                   "RaydeckArtifactsRepository"], done.stderr[-2000:]


@pytest.mark.timeout(120)
def test_plain_mlflow_loop_in_a_python_script_lands_exactly_once(
        ray_cluster: None, mlflow_server: MlflowServer, mlflow_client: Any,
        tmp_path: Path) -> None:
    before = {r.info.run_id for r in _all_runs(mlflow_client)}
    proc = driver_process(f"""
        import mlflow

        with mlflow.start_run(run_name="plain-loop") as run:
            print("RUN", run.info.run_id, flush=True)
            mlflow.log_params({{"lr": 0.1, "layers": 2}})
            mlflow.set_tag("team", "vision")
            for step in range({STEPS}):
                for key in {KEYS!r}:
                    mlflow.log_metric(key, step / 10, step=step)
            # The server proxies artifacts (mlflow-artifacts:/ locations): MLflow resolves them
            # against the tracking URI, here a raydeck+ one.
            mlflow.log_dict({{"layers": 2}}, "config/model.json")
        print("ENDED", flush=True)
        """, env={"MLFLOW_TRACKING_URI": f"raydeck+{mlflow_server.uri}"})
    run_id = read_line_with(proc, "RUN")
    read_line_with(proc, "ENDED")
    assert proc.wait(timeout=60) == 0
    # end_run returned: the run's data is in MLflow (read-your-writes after end_run).
    run = mlflow_client.get_run(run_id)
    assert run.info.status == "FINISHED"
    assert run.info.run_name == "plain-loop"
    assert run.data.params == {"lr": "0.1", "layers": "2"}
    assert run.data.tags["team"] == "vision"
    assert run.info.artifact_uri.startswith("mlflow-artifacts:")
    local = mlflow_client.download_artifacts(run_id, "config/model.json", str(tmp_path))
    assert json.loads(Path(local).read_text()) == {"layers": 2}
    for key in KEYS:
        history = mlflow_client.get_metric_history(run_id, key)
        assert sorted((m.step, m.value) for m in history) == [
            (s, s / 10) for s in range(STEPS)]
    assert {r.info.run_id for r in _all_runs(mlflow_client)} - before == {run_id}


@pytest.mark.timeout(60)
def test_bad_input_raises_mlflows_own_exception_at_the_call_site(
        ray_cluster: None, mlflow_server: MlflowServer, mlflow_client: Any) -> None:
    from mlflow.exceptions import MlflowException
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=f"raydeck+{mlflow_server.uri}")
    run_id = client.create_run("0", run_name=f"bad-input-{uuid.uuid4().hex[:6]}").info.run_id
    with pytest.raises(MlflowException) as raised:
        client.log_metric(run_id, "bad key!", 1.0)
    assert raised.value.error_code == "INVALID_PARAMETER_VALUE"
    client.log_param(run_id, "lr", "0.1")
    with pytest.raises(MlflowException):
        client.log_param(run_id, "lr", "0.2")  # params are immutable, as in MLflow
    client.log_metric(run_id, "good", 2.0, step=3)
    client.set_terminated(run_id, "FAILED")
    run = mlflow_client.get_run(run_id)
    assert run.info.status == "FAILED"
    assert run.data.params == {"lr": "0.1"}
    assert metric_steps(mlflow_client, run_id, "good") == [3]
    assert "bad key!" not in run.data.metrics


def test_plugin_runs_sample_system_metrics_only_when_mlflow_or_raydeck_says_so(
        monkeypatch: pytest.MonkeyPatch) -> None:
    base = load_settings({})

    def settings(policy: str, interval_s: float = 10.0) -> Any:
        return dataclasses.replace(base, tracking=dataclasses.replace(
            base.tracking, system_metrics=policy, system_metrics_interval_s=interval_s))

    import mlflow

    # Imported after MLflow, which loads the plugin (its entry point) as it starts.
    from raydeck.integrations.mlflow_runs import system_metrics_interval_s

    monkeypatch.setenv("MLFLOW_ENABLE_SYSTEM_METRICS_LOGGING", "false")
    monkeypatch.delenv("MLFLOW_SYSTEM_METRICS_SAMPLING_INTERVAL", raising=False)
    assert system_metrics_interval_s(settings("auto")) == 0  # as plain MLflow: none
    assert system_metrics_interval_s(settings("on")) == 10.0
    mlflow.enable_system_metrics_logging()  # MLflow's own switch
    assert system_metrics_interval_s(settings("auto")) == 10.0
    assert system_metrics_interval_s(settings("off")) == 0
    assert system_metrics_interval_s(settings("auto", interval_s=0)) == 0
    monkeypatch.setenv("MLFLOW_SYSTEM_METRICS_SAMPLING_INTERVAL", "0.5")  # MLflow's period
    assert system_metrics_interval_s(settings("auto")) == 0.5
    assert system_metrics_interval_s(settings("on", interval_s=2.0)) == 2.0
    for variable, value in (("MLFLOW_SYSTEM_METRICS_SAMPLING_INTERVAL", "-1"),
                            ("MLFLOW_SYSTEM_METRICS_SAMPLING_INTERVAL", "fast"),
                            ("MLFLOW_ENABLE_SYSTEM_METRICS_LOGGING", "yes")):
        with monkeypatch.context() as bad:
            bad.setenv(variable, value)
            with pytest.raises(ConfigError, match=variable):
                system_metrics_interval_s(settings("auto"))


def _system_metrics_driver(experiment: str) -> str:
    """Two runs made with ``MlflowClient`` (as Lightning's logger and Tune's callback make
    theirs), the first before MLflow's switch is on, the second after; both held open until
    the test writes a line."""
    return f"""
        import mlflow
        from mlflow.tracking import MlflowClient

        client = MlflowClient()
        experiment_id = client.create_experiment("{experiment}")
        off = client.create_run(experiment_id, run_name="switch-off").info.run_id
        mlflow.enable_system_metrics_logging()
        on = client.create_run(experiment_id, run_name="switch-on").info.run_id
        for run_id in (off, on):
            client.log_metric(run_id, "loss", 0.5, step=0)
        print("RUNS", off, on, flush=True)
        input()
        for run_id in (off, on):
            client.set_terminated(run_id)
        print("ENDED", flush=True)
        """


@pytest.mark.timeout(150)
def test_system_metrics_only_when_asked_under_mlflows_names_per_node(
        ray_cluster: None, mlflow_server: MlflowServer, mlflow_client: Any) -> None:
    """MLflow's switch off: no ``system/`` metric, as plain MLflow. On (the second run), or
    ``RAYDECK_TRACKING_SYSTEM_METRICS=on`` (both runs of a second driver): MLflow's names under
    ``system/<node ip>/``, at steps 0, 1, ... as MLflow's monitor logs them."""
    import ray

    name = f"system-metrics-{uuid.uuid4().hex[:6]}"
    uri = f"raydeck+{mlflow_server.uri}"
    by_mlflow = driver_process(_system_metrics_driver(f"{name}-mlflow"), env={
        "MLFLOW_TRACKING_URI": uri, "MLFLOW_ENABLE_SYSTEM_METRICS_LOGGING": "false",
        "MLFLOW_SYSTEM_METRICS_SAMPLING_INTERVAL": "0.5"})
    by_raydeck = driver_process(_system_metrics_driver(f"{name}-raydeck"), env={
        "MLFLOW_TRACKING_URI": uri, "MLFLOW_ENABLE_SYSTEM_METRICS_LOGGING": "false",
        "RAYDECK_TRACKING_SYSTEM_METRICS": "on",
        "RAYDECK_TRACKING_SYSTEM_METRICS_INTERVAL_S": "0.5"})
    node = ray.util.get_node_ip_address()
    cpu = f"system/{node}/cpu_utilization_percentage"
    try:
        off, on = read_line_with(by_mlflow, "RUNS").split()
        raydeck_off, raydeck_on = read_line_with(by_raydeck, "RUNS").split()
        sampled = (on, raydeck_off, raydeck_on)
        # The switched-off run is open in the same process all the while its sibling is
        # sampled: had it a sampler, it would have sampled at the same moments.
        wait_until(lambda: all(len(metric_steps(mlflow_client, run_id, cpu)) >= 2
                               for run_id in sampled), 90, "two samples in each sampled run",
                   interval_s=0.5)
        for proc in (by_mlflow, by_raydeck):
            assert proc.stdin is not None
            proc.stdin.write("\n")
            proc.stdin.flush()
        for proc in (by_mlflow, by_raydeck):
            read_line_with(proc, "ENDED")
            assert proc.wait(timeout=60) == 0
    finally:
        by_mlflow.kill()
        by_raydeck.kill()
    assert not [k for k in mlflow_client.get_run(off).data.metrics if k.startswith("system/")]
    for run_id in sampled:
        system = {k for k in mlflow_client.get_run(run_id).data.metrics
                  if k.startswith("system/")}
        assert {f"system/{node}/{metric}" for metric in MLFLOW_SYSTEM_METRICS} <= system
        assert all(k.startswith(f"system/{node}/") for k in system), system
        assert metric_steps(mlflow_client, run_id, cpu)[:2] == [0, 1]


def _rank_calls_start_run(config: dict[str, Any]) -> None:
    import mlflow
    import ray.train

    rank = ray.train.get_context().get_world_rank()
    mlflow.set_tracking_uri(config["uri"])
    with mlflow.start_run() as run:
        for step in range(STEPS):
            mlflow.log_metric("loss", float(step), step=step)
        Path(config["out"], f"rank_{rank}").write_text(run.info.run_id)


@pytest.mark.timeout(180)
def test_every_rank_calling_start_run_makes_one_run(
        ray_cluster: None, mlflow_server: MlflowServer, mlflow_client: Any,
        tmp_path: Path) -> None:
    from ray.train import RunConfig, ScalingConfig
    from ray.train.torch import TorchTrainer

    before = {r.info.run_id for r in _all_runs(mlflow_client)}
    name = f"mlflow-ranks-{uuid.uuid4().hex[:6]}"
    TorchTrainer(_rank_calls_start_run,
                 train_loop_config={"uri": f"raydeck+{mlflow_server.uri}", "out": str(tmp_path)},
                 scaling_config=ScalingConfig(num_workers=2),
                 run_config=RunConfig(name=name, storage_path=str(tmp_path / "train"))).fit()
    run_ids = {(tmp_path / f"rank_{rank}").read_text() for rank in (0, 1)}
    assert len(run_ids) == 1
    run_id = run_ids.pop()
    run = mlflow_client.get_run(run_id)
    assert run.info.status == "FINISHED"
    assert run.data.tags["raydeck.run_key"] == name
    # rank_zero mode (the default): rank 0's series, once; rank 1 wrote nothing.
    assert metric_steps(mlflow_client, run_id, "loss") == list(range(STEPS))
    assert {r.info.run_id for r in _all_runs(mlflow_client)} - before == {run_id}


def _train_worker(rank: int) -> AttachRequest:
    process = ProcessInfo(role="train_worker", role_key=f"train:job:fit:{rank}", job_id="job",
                          node_ip="10.0.0.1", hostname="node", pid=100 + rank, world_rank=rank,
                          world_size=2, train_run_name="fit")
    return AttachRequest(client_id=f"client-{rank}", process=process, tracking_uri="http://m",
                         run_key=None, run_name=None, experiment="Default", mode="rank_zero")


def _router(sent: list[Control], gone: set[str] | None = None) -> RouterCore:
    """A router whose shards are ``sent``; MLflow knows every run id asked for, Ray reports
    the processes of role keys in ``gone`` dead (none by default)."""
    config = ProxyConfig(namespace="test", tracking_uri="http://m", artifact_location="",
                         shards=1, writers=1, spool_dir="/nonexistent", fsync=False,
                         lost_after_s=60.0, idle_timeout_s=900.0, heartbeat_interval_s=5.0,
                         mlflow_timeout_s=20, retry_max_s=5.0)
    return RouterCore(config, sent.append,
                      lambda key, experiment: Lookup(known=True, run_id=key),
                      lambda everyone, quiet: set(gone or ()))


def test_a_silent_rank_starting_late_does_not_reopen_the_ended_run() -> None:
    # rank 1 of a rank_zero run may call mlflow.start_run() after rank 0 already ended the
    # run (it imports slower): it gets the run's id, and the run stays ended.
    sent: list[Control] = []
    router = _router(sent)
    assert router.attach(_train_worker(0)).active
    assert router.detach("client-0", "FINISHED") == ["fit"]
    sent.clear()
    assert not router.attach(_train_worker(1)).active
    assert sent == []


def _by_run_id(role: str, pid: int, run_id: str, guest: bool) -> AttachRequest:
    process = ProcessInfo(role=role, role_key=f"{role}:job:{pid}", job_id="job",
                          node_ip="10.0.0.1", hostname="node", pid=pid,
                          actor_id="actor" if role == "task" else None)
    return AttachRequest(client_id=f"client-{pid}", process=process, tracking_uri="http://m",
                         run_key=run_id, run_name=None, experiment="Default", mode="rank_zero",
                         guest=guest)


@pytest.mark.timeout(10)
def test_a_guest_writer_neither_holds_nor_reopens_nor_ends_its_run() -> None:
    # The driver's run (an MLflow run id), written to by id from a live Ray actor: the driver's
    # end ends it at once, the actor's later write does not reopen it, and the actor's own
    # set_terminated ends only a run nobody holds.
    sent: list[Control] = []
    router = _router(sent)
    run_id, unowned = "a" * 32, "b" * 32
    assert router.attach(_by_run_id("driver", 1, run_id, guest=False)).is_primary
    opened = list(sent)
    guest = router.attach(_by_run_id("task", 2, run_id, guest=True))
    assert guest.active and not guest.is_primary and guest.run_key == run_id
    assert sent == opened  # the guest opened nothing
    assert router.heartbeat(["client-2"]) == ["client-2"]  # and is no participant
    assert router.end_unowned(run_id, "FINISHED") == []  # held by the driver
    assert router.detach("client-1", "FINISHED") == [run_id]  # the guest is still alive
    sent.clear()
    assert router.attach(_by_run_id("task", 2, run_id, guest=True)).active
    assert router.end_unowned(run_id, "KILLED") == []  # ended once
    assert sent == []
    assert [r["state"] for r in router.status()] == ["ended"]
    assert router.attach(_by_run_id("task", 3, unowned, guest=True)).run_id == unowned
    assert router.end_unowned(unowned, "FAILED") == [unowned]
    assert [(c.run_key, c.kind, c.payload) for c in sent] == [(unowned, "end", "FAILED")]


@pytest.mark.timeout(10)
def test_a_stopped_plain_trials_run_ends_with_the_outcome_tune_reported() -> None:
    # Tune's driver callback (raydeck.tracking.client.tune_outcome) reports a trial's outcome before
    # Tune stops its process. Its run ends with it once the process is gone (Tune may kill it
    # before its exit hands the run over) or leaves (MLflow's exit hook says FINISHED even when
    # the function raised). A sweep's child runs (with a parent) are the sweep's to end; a run
    # the function ended itself is ended already; no word from Tune: KILLED, as before.
    sent: list[Control] = []
    gone: set[str] = set()
    router = _router(sent, gone)
    trials = {"returned": ("FINISHED", None), "raised": ("FAILED", None), "silent": (None, None),
              "child": ("FINISHED", "sweep"), "exited": ("FAILED", None),
              "ended": ("FINISHED", None)}
    for trial_id, (_, parent) in trials.items():
        process = ProcessInfo(role="trial", role_key=f"trial:{trial_id}", job_id="job",
                              node_ip="10.0.0.1", hostname="node", pid=1, trial_id=trial_id,
                              actor_id=trial_id)
        assert router.attach(AttachRequest(
            client_id=trial_id, process=process, tracking_uri="http://m", run_key=trial_id,
            run_name=None, experiment="Default", mode="rank_zero", parent_key=parent)).is_primary
    assert router.detach("ended", "FAILED") == ["ended"]
    for trial_id, (outcome, parent) in trials.items():
        if outcome:
            applies = parent is None and trial_id != "ended"
            assert router.set_trial_outcome(trial_id, outcome) == ([trial_id] if applies else [])
    assert router.detach("exited", "FINISHED") == ["exited"]
    gone.update(f"trial:{trial_id}" for trial_id in trials)
    router.reap()
    ends = {c.run_key: c.payload for c in sent if c.kind == "end"}
    assert ends == {"returned": "FINISHED", "raised": "FAILED", "silent": "KILLED",
                    "child": "KILLED", "exited": "FAILED", "ended": "FAILED"}
