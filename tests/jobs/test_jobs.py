"""Jobs on a real cluster: `ray job submit` and `raydeck submit` with the files in runtime_envs/.

The module starts one Ray head with `ray start --head` on free ports, token authentication pinned
on with a token file of its own, the venv first on its PATH (so a job's `python` imports raydeck)
and the session's MLflow server in its environment, as an operator would start it. Jobs write to
that MLflow server, where the tests find their runs. The head is stopped by killing exactly the
processes it started.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import uuid
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.fixtures.mlflow_server import MlflowServer
from tests.fixtures.processes import free_port
from tests.fixtures.ray_head import RayHead, head_env
from tests.fixtures.tracking import loop_through_an_mlflow_kill, metric_steps

REPO = Path(__file__).resolve().parents[2]
RUNTIME_ENVS = sorted((REPO / "runtime_envs").glob("*.yaml"))
EPOCHS = 3
JOB_TIMEOUT_S = 600


def _clean_env() -> dict[str, str]:
    return {k: v for k, v in os.environ.items()
            if not k.startswith(("RAYDECK_", "RAY_", "AWS_", "MLFLOW_"))}


@pytest.fixture(scope="module")
def ray_head(tmp_path_factory: pytest.TempPathFactory, raydeck_env: dict[str, str]
             ) -> Iterator[RayHead]:
    root = tmp_path_factory.mktemp("ray-head")
    env = head_env(raydeck_env["RAYDECK_TRACKING_URI"], root / "data")
    head = RayHead(root, env).start()
    yield head
    head.stop()


def _submit_env(head: RayHead, **extra: str) -> dict[str, str]:
    """A submitting shell: knows the cluster, its token file and the MLflow server."""
    return {**_clean_env(), **head.client_env,
            "RAYDECK_TRACKING_URI": head.env["RAYDECK_TRACKING_URI"], "COLUMNS": "250", **extra}


def _raydeck(*args: str, env: dict[str, str], cwd: Path = REPO, timeout: float = JOB_TIMEOUT_S
             ) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "raydeck.cli", *args], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=timeout)


def _one_error_line(result: subprocess.CompletedProcess[str]) -> str:
    assert result.returncode == 2, result.stdout[-3000:] + result.stderr[-3000:]
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: "), result.stderr
    return lines[0]


def _run_of(client: Any, run_id: str, experiment_name: str = "raydeck") -> Any:
    experiment = client.get_experiment_by_name(experiment_name)
    runs = client.search_runs([experiment.experiment_id],
                              filter_string=f"tags.`raydeck.run_key` = '{run_id}'")
    assert len(runs) == 1, runs
    return runs[0]


def _client(head: RayHead) -> Any:
    """Ray's job client for this head (its dashboard URL, its token)."""
    from raydeck.jobs.submission import JobServer

    return JobServer.from_env(env=head.client_env).client()


def _job_info(head: RayHead, submission_id: str) -> Any:
    return _client(head).get_job_info(submission_id)


def _job_status(head: RayHead, submission_id: str) -> str:
    return str(_job_info(head, submission_id).status.value)


def _job_seconds(head: RayHead, submission_id: str) -> float:
    info = _job_info(head, submission_id)
    return float(info.end_time - info.start_time) / 1000


# An error-level line of a job's log: Python logging's ERROR or CRITICAL, or a Ray process's C++
# log line at E or F, e.g. "(TrainController pid=1) [2026-12-07 10:13:07,340 E 1 2] core_worker.cc".
ERROR_LINE = re.compile(r"\b(ERROR|CRITICAL)\b|\[\d{4}-\d\d-\d\d [\d:,.]+ [EF] \d+ \d+\]")


def _assert_no_error_lines(head: RayHead, submission_id: str) -> None:
    """A healthy job's log has no error-level line. Issue 51: every job's log carried Ray Core's
    ERROR about the constructor arguments of Ray Train's PreemptionWatcher (a false alarm;
    raydeck.train.trainer.without_preemption_watcher). The head's environment leaves Ray
    Train's switch unset, as an operator's does."""
    assert "RAY_TRAIN_ENABLE_PREEMPTION_WATCHER" not in head.env
    log = _client(head).get_job_logs(submission_id)
    errors = [line for line in log.splitlines() if ERROR_LINE.search(line)]
    assert not errors, "\n".join(errors)


def _assert_both_workers_logged(client: Any, run: Any, keys: tuple[str, ...]) -> None:
    for rank in (0, 1):
        for key in keys:
            history = client.get_metric_history(run.info.run_id, f"{key}/rank_{rank}")
            assert len(history) == EPOCHS, (key, rank)
    assert run.info.status == "FINISHED"


# --- runtime env files ----------------------------------------------------------------------
@pytest.mark.timeout(60)
@pytest.mark.parametrize("path", RUNTIME_ENVS, ids=lambda p: p.name)
def test_runtime_env_files_are_valid_ray_runtime_envs_without_secrets(path: Path) -> None:
    from ray.runtime_env import RuntimeEnv

    from raydeck._internal.redaction import is_secret_name
    from raydeck.config.settings import load_settings, settings_reference
    from raydeck.jobs.runtime_env import PLACEHOLDER, check_runtime_env

    document = yaml.safe_load(path.read_text())
    RuntimeEnv(**document)
    check_runtime_env(document, path.name)
    assert document["working_dir"] == "."
    assert {".venv", ".git", ".raydeck"} <= set(document["excludes"])
    env_vars = document["env_vars"]
    known = {variable for variable, *_ in settings_reference()}
    for name, value in env_vars.items():
        if name.startswith("RAYDECK_"):
            assert name in known, name
            # Filled in from the environment, never written here.
            assert PLACEHOLDER.search(str(value)), (name, value)
        assert not is_secret_name(name), "Ray logs runtime envs: no secrets in them"
    # On a node where a variable is unset, Ray fills in "": raydeck must read it as the default.
    load_settings(env={name: "" for name in env_vars if name.startswith("RAYDECK_")})


@pytest.mark.timeout(60)
def test_raydeck_fills_runtime_envs_from_the_submitting_environment_but_never_secrets(
    tmp_path: Path
) -> None:
    from raydeck.errors import ConfigError
    from raydeck.jobs.runtime_env import load_runtime_env

    submitting = {"RAYDECK_TRACKING_URI": "http://mlflow:5000", "RAYDECK_DATA_DIR": "/data",
                  "RAYDECK_S3_ENDPOINT": "http://minio:9000", "RAYDECK_S3_ACCESS_KEY_ID": "ak",
                  "RAYDECK_S3_SECRET_ACCESS_KEY": "the-secret"}
    runtime_env = load_runtime_env(REPO / "runtime_envs/cpu.yaml", env=submitting,
                                   working_dir=REPO)
    assert runtime_env["working_dir"] == str(REPO)
    assert runtime_env["py_modules"] == [str(REPO / "platform/raydeck")]
    assert runtime_env["env_vars"] == {
        "RAYDECK_TRACKING_URI": "http://mlflow:5000", "RAYDECK_DATA_DIR": "/data",
        "RAYDECK_S3_ENDPOINT": "http://minio:9000", "RAYDECK_S3_ACCESS_KEY_ID": "ak",
    }
    assert "the-secret" not in str(runtime_env)
    # Unset variables are left out, so the cluster's own environment applies; ${PWD} is the
    # directory the submission is made from.
    assert load_runtime_env(REPO / "runtime_envs/gpu.yaml", env={})["env_vars"] == {
        "TORCH_NCCL_ASYNC_ERROR_HANDLING": "1", "NCCL_DEBUG": "WARN",
    }
    assert load_runtime_env(REPO / "runtime_envs/local.yaml", env={}, working_dir=tmp_path
                            )["env_vars"] == {"RAYDECK_DATA_DIR": f"{tmp_path}/.raydeck"}
    # MLflow's own variable, when raydeck's is not set: the job logs where the shell points
    # (and where `raydeck submit` looks its run up), not where the head's environment does.
    mlflow_only = load_runtime_env(REPO / "runtime_envs/cpu.yaml", env={
        "MLFLOW_TRACKING_URI": "http://mlflow.internal:5000"})["env_vars"]
    assert mlflow_only["RAYDECK_TRACKING_URI"] == "http://mlflow.internal:5000"
    # The MLflow plugin's URIs: raydeck+<backend> names the backend, raydeck:// none.
    for uri, expected in (("raydeck+http://mlflow.internal:5000", "http://mlflow.internal:5000"),
                          ("raydeck://", None)):
        assert load_runtime_env(REPO / "runtime_envs/cpu.yaml", env={
            "MLFLOW_TRACKING_URI": uri})["env_vars"].get("RAYDECK_TRACKING_URI") == expected
    assert load_runtime_env(REPO / "runtime_envs/cpu.yaml", env={
        **submitting, "MLFLOW_TRACKING_URI": "http://other:5000"}
    )["env_vars"]["RAYDECK_TRACKING_URI"] == "http://mlflow:5000"
    # --cluster-env: everything as written, for the nodes to fill in.
    as_written = load_runtime_env(REPO / "runtime_envs/cpu.yaml", env=submitting, fill=False)
    assert as_written["env_vars"]["RAYDECK_TRACKING_URI"] == "${RAYDECK_TRACKING_URI}"
    # A secret may be referenced (Ray fills it in on the node; raydeck never does), not written.
    referencing = tmp_path / "referencing.yaml"
    referencing.write_text("working_dir: .\nenv_vars:\n"
                           "  RAYDECK_S3_SECRET_ACCESS_KEY: ${RAYDECK_S3_SECRET_ACCESS_KEY}\n")
    assert load_runtime_env(referencing, env=submitting)["env_vars"] == {
        "RAYDECK_S3_SECRET_ACCESS_KEY": "${RAYDECK_S3_SECRET_ACCESS_KEY}"}
    leaky = tmp_path / "leaky.yaml"
    leaky.write_text("working_dir: .\nenv_vars:\n  RAYDECK_S3_SECRET_ACCESS_KEY: hunter2\n")
    with pytest.raises(ConfigError) as raised:
        load_runtime_env(leaky)
    assert "env_vars.RAYDECK_S3_SECRET_ACCESS_KEY holds a value" in str(raised.value)
    assert "hunter2" not in str(raised.value)


@pytest.mark.timeout(60)
def test_what_the_shell_sets_for_raydeck_reaches_the_job_but_never_a_secret() -> None:
    from raydeck.jobs.runtime_env import shell_settings

    shell = {"RAYDECK_TRACKING_EXPERIMENT": "team-x", "RAYDECK_TRACKING_MODE": "all_ranks",
             "RAYDECK_S3_PREFIX": "team-x/", "RAYDECK_S3_ARTIFACTS_BUCKET": "art",
             "MLFLOW_TRACKING_URI": "http://mlflow:5000",
             # secrets: by name, and by a value carrying credentials
             "RAYDECK_S3_SECRET_ACCESS_KEY": "the-secret", "RAYDECK_GRAFANA_TOKEN": "glsa_x",
             "RAYDECK_TRACKING_URI": "http://bob:pw@mlflow:5000",
             # the submitting process's own view, and empty values
             "RAYDECK_RAY_ADDRESS": "head:6379", "RAYDECK_STACK_FILE": "/home/me/stack.json",
             "RAYDECK_PRESETS_FILE": "/home/me/presets.yaml", "RAYDECK_QUEUE_JOB": "parent",
             "RAYDECK_LOG_LEVEL": "", "HOME": "/home/me", "AWS_SECRET_ACCESS_KEY": "aws"}
    assert shell_settings(shell) == {
        "RAYDECK_TRACKING_EXPERIMENT": "team-x", "RAYDECK_TRACKING_MODE": "all_ranks",
        "RAYDECK_S3_PREFIX": "team-x/", "RAYDECK_S3_ARTIFACTS_BUCKET": "art",
        "MLFLOW_TRACKING_URI": "http://mlflow:5000"}


@pytest.mark.timeout(60)
def test_the_token_follows_rays_rules(tmp_path: Path) -> None:
    from raydeck.errors import ConfigError
    from raydeck.jobs.submission import auth_token

    token_file = tmp_path / "token"
    token_file.write_text("file-token\n")
    home = {"HOME": str(tmp_path / "home")}
    assert auth_token({**home, "RAY_AUTH_MODE": "disabled", "RAY_AUTH_TOKEN": "x"}) is None
    assert auth_token({**home, "RAY_AUTH_TOKEN": "env-token",
                       "RAY_AUTH_TOKEN_PATH": str(token_file)}).reveal() == "env-token"
    token = auth_token({**home, "RAY_AUTH_MODE": "token",
                        "RAY_AUTH_TOKEN_PATH": str(token_file)})
    assert token.reveal() == "file-token" and "file-token" not in repr(token)
    assert auth_token(home) is None
    with pytest.raises(ConfigError, match="RAY_AUTH_MODE=token but no token found"):
        auth_token({**home, "RAY_AUTH_MODE": "token"})


# TEST-NET-3 (RFC 5737): never an address of this machine.
REMOTE = "http://203.0.113.7:8265"


@pytest.mark.timeout(60)
def test_the_implicit_token_file_goes_only_to_a_head_on_this_machine(tmp_path: Path) -> None:
    import socket

    from raydeck.errors import ConfigError
    from raydeck.jobs.submission import JobServer, auth_token

    home = tmp_path / "home"
    (home / ".ray").mkdir(parents=True)
    (home / ".ray" / "auth_token").write_text("local-head-token\n")
    env = {"HOME": str(home)}
    # ~/.ray/auth_token belongs to the head `ray start --head` ran here: loopback or this
    # machine's own name and addresses get it ...
    for address in ("http://127.0.0.1:8265", "http://localhost:8265", "127.0.0.1:6379",
                    f"http://{socket.gethostname()}:8265"):
        assert auth_token(env, job_server=address).reveal() == "local-head-token", address
    # ... any other address does not, even when asked to authenticate.
    assert auth_token(env, job_server=REMOTE) is None
    # Without an address, the token is for the job server the environment names.
    assert auth_token({**env, "RAY_ADDRESS": REMOTE}) is None
    assert auth_token(env).reveal() == "local-head-token"  # the default, 127.0.0.1:8265
    with pytest.raises(ConfigError) as raised:
        auth_token({**env, "RAY_AUTH_MODE": "token"}, job_server=REMOTE)
    assert "not sent to http://203.0.113.7:8265; set RAY_AUTH_TOKEN_PATH" in str(raised.value)
    # Named explicitly, a token is the user's choice and goes to any address.
    explicit = {**env, "RAY_AUTH_TOKEN_PATH": str(home / ".ray" / "auth_token")}
    assert auth_token(explicit, job_server=REMOTE).reveal() == "local-head-token"
    assert auth_token({**env, "RAY_AUTH_TOKEN": "t"}, job_server=REMOTE).reveal() == "t"
    # A refusal explains why nothing was sent.
    server = JobServer.from_env(REMOTE, env)
    assert server.token is None and "is not sent to http://203.0.113.7:8265" in server.withheld


@pytest.mark.timeout(120)
@pytest.mark.parametrize("command", [["submit", "jobs/digits_torch.py"], ["jobs"]])
def test_an_unreachable_cluster_is_one_line_and_exit_2(command: list[str]) -> None:
    address = f"http://127.0.0.1:{free_port()}"
    line = _one_error_line(_raydeck(*command, "--address", address,
                                    env={**_clean_env(), "RAY_AUTH_MODE": "disabled"},
                                    timeout=100))
    assert line.startswith(f"error: cannot reach the Ray job server at {address} (")


@pytest.mark.timeout(60)
def test_jobs_train_without_ray_trains_preemption_watcher_unless_the_user_sets_it(
    monkeypatch: pytest.MonkeyPatch
) -> None:
    """raydeck's fits switch Ray Train's PreemptionWatcher off (its creation logs a Ray Core
    ERROR in every job: _assert_no_error_lines), through the variable Ray Train hands from the
    driver to its controller; a user's own setting wins."""
    from ray.train.v2._internal.constants import get_env_vars_to_propagate

    from raydeck.train.trainer import PREEMPTION_WATCHER_ENV, without_preemption_watcher

    monkeypatch.delenv(PREEMPTION_WATCHER_ENV, raising=False)
    without_preemption_watcher()
    assert get_env_vars_to_propagate()[PREEMPTION_WATCHER_ENV] == "0"
    monkeypatch.setenv(PREEMPTION_WATCHER_ENV, "1")
    without_preemption_watcher()
    assert get_env_vars_to_propagate()[PREEMPTION_WATCHER_ENV] == "1"


# --- against a real head --------------------------------------------------------------------
@pytest.mark.slow
@pytest.mark.timeout(JOB_TIMEOUT_S + 120)
def test_ray_job_submit_runs_the_torch_job_with_the_cpu_runtime_env(
    ray_head: RayHead, mlflow_client: Any
) -> None:
    run_id = f"ray-job-submit-{uuid.uuid4().hex[:8]}"
    submission_id = f"test-{run_id}"
    # Exactly the documented command line; the client sends the token because of
    # RAY_AUTH_MODE=token and RAY_AUTH_TOKEN_PATH.
    done = subprocess.run(
        ["ray", "job", "submit", "--runtime-env", "runtime_envs/cpu.yaml", "--working-dir", ".",
         "--submission-id", submission_id, "--",
         "python", "jobs/digits_torch.py", "--epochs", str(EPOCHS), "--run-id", run_id,
         "--mode", "all_ranks"],
        cwd=REPO, env={**_submit_env(ray_head), "PATH": ray_head.env["PATH"]},
        capture_output=True, text=True, timeout=JOB_TIMEOUT_S,
    )
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-3000:]
    assert _job_status(ray_head, submission_id) == "SUCCEEDED", done.stdout[-4000:]
    print(f"\nray job submit digits_torch ({EPOCHS} epochs, 2 workers on 2 cores): "
          f"{_job_seconds(ray_head, submission_id):.0f} s")
    run = _run_of(mlflow_client, run_id)
    _assert_both_workers_logged(mlflow_client, run, ("train_loss", "val_accuracy"))
    assert run.data.params["preset"] == "cpu-2"
    assert run.data.tags["raydeck.checkpoint.latest_epoch"] == str(EPOCHS - 1)
    _assert_no_error_lines(ray_head, submission_id)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_plain_mlflow_loop_as_a_ray_job_submit_driver_keeps_every_point_while_mlflow_is_sigkilled(
    ray_head: RayHead, killable_mlflow: MlflowServer
) -> None:
    """MLflow code that knows nothing of raydeck, submitted with ``ray job submit``; only its
    tracking URI says ``raydeck+``. MLflow is SIGKILLed from step 20 until the loop's last step
    (about 18 s): the loop never waits on it, ``end_run()`` returns once MLflow is back, and
    every point lands once in the driver's one run. (The same loop run as a plain process
    beside the session's Ray was a test of its own in
    tests/integrations/test_mlflow_integrations.py, with the same assertions; a job's driver is such
    a process, its environment from the job.)"""
    from mlflow.entities import ViewType
    from mlflow.tracking import MlflowClient

    client = MlflowClient(killable_mlflow.uri)

    def all_run_ids() -> set[str]:
        experiments = [e.experiment_id for e in client.search_experiments(
            view_type=ViewType.ALL)]
        return {r.info.run_id for r in client.search_runs(
            experiments, run_view_type=ViewType.ALL, max_results=5000)}

    before = all_run_ids()
    steps, down_at_step = 200, 20
    run_name = f"mlflow-loop-{uuid.uuid4().hex[:8]}"
    # A proxy of its own on this head for this server (the module's other jobs use the
    # session's MLflow through the head's default namespace); it ends with the head.
    env_vars = {"MLFLOW_TRACKING_URI": f"raydeck+{killable_mlflow.uri}",
                "RAYDECK_RAY_NAMESPACE": f"raydeck-test-{uuid.uuid4().hex[:8]}"}
    submit = subprocess.Popen(
        ["ray", "job", "submit", "--working-dir", "jobs",
         "--runtime-env-json", json.dumps({"env_vars": env_vars}), "--",
         "python", "mlflow_loop.py", "--steps", str(steps), "--step-time-s", "0.1",
         "--run-name", run_name],
        cwd=REPO, env={**_submit_env(ray_head), "PATH": ray_head.env["PATH"]},
        text=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
    )
    run_id = loop_through_an_mlflow_kill(submit, killable_mlflow, down_at_step, 120)
    # end_run returned in the driver: everything is in MLflow, the run ended.
    run = client.get_run(run_id)
    assert run.info.status == "FINISHED"
    assert run.data.params == {"steps": str(steps), "lr": "0.1"}
    assert run.data.tags["example"] == "mlflow_loop"
    for key in ("loss", "accuracy"):
        assert metric_steps(client, run_id, key) == list(range(steps)), key
    assert run.info.run_name == run_name
    assert all_run_ids() - before == {run_id}  # the driver's run, no other


def _raw_accuracy(mlflow_client: Any, uri: str) -> float:
    """Accuracy of a registered model on the raw validation rows, through MLflow's pyfunc only."""
    import mlflow
    import numpy as np

    from raydeck.examples.digits import raw_split

    mlflow.set_tracking_uri(mlflow_client.tracking_uri)
    _, _, x_val, y_val = raw_split(0)
    predictions = np.asarray(mlflow.pyfunc.load_model(uri).predict(x_val)).argmax(axis=1)
    return float((predictions == y_val).mean())


@pytest.mark.slow
@pytest.mark.timeout(JOB_TIMEOUT_S + 120)
def test_raydeck_submit_runs_the_lightning_job_then_lists_it(
    ray_head: RayHead, mlflow_client: Any
) -> None:
    # A shell as an MLflow and Ray user has it: the cluster named by RAY_ADDRESS in its GCS
    # form (raydeck reads the job server's address from the head's GCS), MLflow only by
    # MLFLOW_TRACKING_URI, spelled differently from the head's own RAYDECK_TRACKING_URI so the
    # run shows which one the job used. An experiment set only in this shell: the job logs
    # there (the head's environment does not name it), and submit finds the run there.
    experiment = f"shell-only-{uuid.uuid4().hex[:6]}"
    shell_uri = ray_head.env["RAYDECK_TRACKING_URI"].replace("127.0.0.1", "localhost")
    assert shell_uri != ray_head.env["RAYDECK_TRACKING_URI"]
    # Its own Ray namespace: the module's other jobs started a proxy in the default one, which
    # writes to the head's URI and (rightly) refuses a job configured for another.
    env = {**_clean_env(), **ray_head.client_env, "RAY_ADDRESS": ray_head.gcs_address,
           "MLFLOW_TRACKING_URI": shell_uri, "COLUMNS": "250",
           "RAYDECK_DATA_DIR": ray_head.env["RAYDECK_DATA_DIR"],
           "RAYDECK_TRACKING_EXPERIMENT": experiment,
           "RAYDECK_RAY_NAMESPACE": f"shell-{uuid.uuid4().hex[:6]}"}
    model_name = f"lightning-{uuid.uuid4().hex[:6]}"
    done = _raydeck("submit", "jobs/digits_lightning.py", "--runtime-env",
                    "runtime_envs/cpu.yaml", "--preset", "cpu-2", "--run-name", "submitted",
                    "--register-as", model_name,
                    "--", "--epochs", str(EPOCHS), "--mode", "all_ranks", env=env)
    out = done.stdout
    assert done.returncode == 0, out[-4000:] + done.stderr[-3000:]
    assert f"Python {sys.executable}" in out
    assert "Started training worker group of size 2" in out or "Trainer.fit" in out
    submission_id = out.split("submitted ")[1].split()[0]
    run_id = submission_id.removeprefix("raydeck-")
    assert run_id.startswith("submitted-")
    print(f"\nraydeck submit digits_lightning ({EPOCHS} epochs, 2 workers on 2 cores): "
          f"{_job_seconds(ray_head, submission_id):.0f} s")
    run = _run_of(mlflow_client, run_id, experiment)
    _assert_both_workers_logged(mlflow_client, run, ("train_loss_epoch", "val_accuracy"))
    _assert_no_error_lines(ray_head, submission_id)
    link = f"{shell_uri}/#/experiments/{run.info.experiment_id}/runs/{run.info.run_id}"
    assert f"SUCCEEDED {submission_id}" in out and link in out
    # The job's own tracker logged to the shell's MLFLOW_TRACKING_URI, not the head's URI.
    job_env = json.loads(Path(mlflow_client.download_artifacts(
        run.info.run_id, "raydeck/runtime_env.json")).read_text())["env_vars"]
    assert job_env.get("RAYDECK_TRACKING_URI") == shell_uri, job_env
    token = Path(ray_head.token_path).read_text()
    assert token not in out + done.stderr

    # --register-as: a new version pointing at the run, and the model takes raw pixels.
    assert f"registered: models:/{model_name}/1" in out
    version = mlflow_client.get_model_version(model_name, "1")
    assert version.tags["raydeck.run_id"] == run.info.run_id
    rank_zero = run.data.metrics["val_accuracy/rank_0"]  # all_ranks mode: one key per rank
    assert float(version.tags["raydeck.metric.val_accuracy"]) == pytest.approx(rank_zero)
    assert _raw_accuracy(mlflow_client, f"models:/{model_name}/1") == pytest.approx(
        rank_zero, abs=0.03)  # a rank's half of the split vs all of it

    listed = _raydeck("jobs", env=env, timeout=120)
    assert listed.returncode == 0, listed.stderr
    row = next(line for line in listed.stdout.splitlines() if submission_id in line)
    assert "SUCCEEDED" in row and run.info.run_id in listed.stdout
    assert "raydeck-probe" not in listed.stdout


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_ray_address_in_its_ray_client_form_reaches_the_heads_job_server(
    ray_head: RayHead
) -> None:
    """``RAY_ADDRESS=ray://...``: raydeck asks a Ray Client session where the head's dashboard
    is, so the job commands reach this head, not whatever answers at the dashboard's default
    port (here the session's own cluster)."""
    submission_id = f"ray-client-{uuid.uuid4().hex[:8]}"
    _client(ray_head).submit_job(entrypoint="python -c pass", submission_id=submission_id)
    env = {**_clean_env(), **ray_head.client_env, "RAY_ADDRESS": ray_head.client_address,
           "COLUMNS": "250"}
    listed = _raydeck("jobs", env=env, timeout=120)
    assert listed.returncode == 0, listed.stdout[-3000:] + listed.stderr[-3000:]
    assert submission_id in listed.stdout, listed.stdout
    # Commands' drivers through Ray Client, which takes ray.init's arguments as JSON (so no
    # job config marking them as raydeck's commands): they connect all the same, three at once.
    # The client server forks a server process for each session from its gRPC threads; without
    # GRPC_ENABLE_FORK_SUPPORT=0 on the head (raydeck.cluster.node_env) a child crashed in gRPC's
    # fork handler about once in 20 such sessions ("Initialization failure from server").
    status_env = {**env, "RAYDECK_RAY_ADDRESS": ray_head.client_address}
    with ThreadPoolExecutor(3) as pool:
        statuses = list(pool.map(lambda _: _raydeck("status", env=status_env, timeout=180),
                                 range(3)))
    for status in statuses:
        assert "Ray node" in status.stdout, status.stdout[-3000:] + status.stderr[-3000:]


# A user's own training script: a driver that connects with ray.init (Ray lists it as a job of
# type DRIVER, as it lists every process that connects).
USER_DRIVER_SCRIPT = """
import ray
ray.init()
print(ray.get_runtime_context().get_job_id())
"""


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_raydeck_jobs_lists_submissions_never_raydecks_own_commands_and_cuts_no_run_url(
    ray_head: RayHead, mlflow_client: Any, tmp_path: Path
) -> None:
    """Issue 51: `raydeck jobs` listed `raydeck status`/`queue`/`cancel` calls as SUCCEEDED
    jobs (Ray lists every driver as a job), and cut the MLflow run's URL. A submission is
    listed with its whole run URL at 80 columns in a pipe; a command's driver never, even with
    --drivers, which adds a user's own ray.init script."""
    from raydeck._internal.contract import JOB_KIND_METADATA
    from raydeck.jobs.submission import METADATA_RUN_ID

    experiment = f"jobs-listing-{uuid.uuid4().hex[:6]}"
    env = {**_clean_env(), **ray_head.client_env,
           "RAYDECK_TRACKING_URI": ray_head.env["RAYDECK_TRACKING_URI"],
           "RAYDECK_TRACKING_EXPERIMENT": experiment,
           "RAYDECK_DATA_DIR": ray_head.env["RAYDECK_DATA_DIR"],
           "RAYDECK_RAY_ADDRESS": ray_head.gcs_address, "COLUMNS": "80"}
    client = _client(ray_head)
    before = {job.job_id for job in client.list_jobs()}
    status = _raydeck("status", env=env, timeout=120)
    assert "Ray node" in status.stdout, status.stdout[-3000:] + status.stderr[-3000:]
    # Ray lists the command's driver as a job, marked as raydeck's command.
    (command,) = [job for job in client.list_jobs() if job.job_id not in before]
    assert command.type.value == "DRIVER", command
    assert (command.metadata or {}).get(JOB_KIND_METADATA) == "command", command.metadata
    script = tmp_path / f"train_{uuid.uuid4().hex[:8]}.py"
    script.write_text(USER_DRIVER_SCRIPT)
    user = subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                          env={**env, "RAY_ADDRESS": ray_head.gcs_address}, timeout=120)
    assert user.returncode == 0, user.stderr[-3000:]
    user_job_id = user.stdout.split()[-1]

    run_key = f"listed-{uuid.uuid4().hex[:8]}"
    run = mlflow_client.create_run(mlflow_client.create_experiment(experiment),
                                   tags={"raydeck.run_key": run_key})
    url = (f"{env['RAYDECK_TRACKING_URI']}/#/experiments/{run.info.experiment_id}/runs/"
           f"{run.info.run_id}")
    submission_id = f"raydeck-{run_key}"
    client.submit_job(entrypoint="python -c pass", submission_id=submission_id,
                      metadata={JOB_KIND_METADATA: "job", METADATA_RUN_ID: run_key})

    listed = _raydeck("jobs", env=env, timeout=120)
    assert listed.returncode == 0, listed.stdout[-3000:] + listed.stderr[-3000:]
    (row,) = [line for line in listed.stdout.splitlines() if f" {submission_id} " in line]
    assert f" {url} " in row, listed.stdout
    assert script.name not in listed.stdout, listed.stdout

    with_drivers = _raydeck("jobs", "--drivers", "--json", env=env, timeout=120)
    assert with_drivers.returncode == 0, with_drivers.stderr[-3000:]
    rows = {row["id"]: row for row in json.loads(with_drivers.stdout)}
    assert rows[submission_id]["type"] == "SUBMISSION"
    assert rows[submission_id]["mlflow_run_url"] == url
    assert rows[submission_id]["mlflow_run_id"] == run.info.run_id
    assert rows[user_job_id]["type"] == "DRIVER"
    assert script.name in rows[user_job_id]["entrypoint"]
    assert command.job_id not in rows, rows[command.job_id]
    # Nor the drivers of the `raydeck jobs` calls themselves, nor any other command's.
    commands = {job.job_id for job in client.list_jobs()
                if (job.metadata or {}).get(JOB_KIND_METADATA) == "command"}
    assert len(commands) >= 2 and not commands & set(rows), rows


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_cluster_python_without_raydeck_is_named_with_the_fix(
    ray_head: RayHead, tmp_path: Path
) -> None:
    # A head started without the venv on PATH runs jobs with the system Python: simulate it
    # with a `python` that is the system interpreter, first on the job's PATH.
    system_bin = tmp_path / "bin"
    system_bin.mkdir()
    (system_bin / "python").symlink_to("/usr/bin/python3")
    runtime_env = tmp_path / "system-python.yaml"
    runtime_env.write_text(yaml.safe_dump({
        "working_dir": ".", "excludes": [".git", ".venv", ".raydeck"],
        "env_vars": {"PATH": f"{system_bin}:/usr/bin:/bin"},
    }))
    line = _one_error_line(_raydeck("submit", "jobs/digits_torch.py", "--runtime-env",
                                    str(runtime_env), env=_submit_env(ray_head), timeout=280))
    assert line.startswith(f"error: the cluster runs jobs with {system_bin / 'python'}, which "
                           "cannot import 'raydeck'")
    assert "PATH=/path/to/venv/bin:$PATH ray start --head" in line


@pytest.mark.slow
@pytest.mark.timeout(120)
@pytest.mark.parametrize(
    ("auth", "expected"),
    [
        ({"RAY_AUTH_MODE": "disabled"}, "the job server requires a token: set RAY_AUTH_MODE="
                                        "token and RAY_AUTH_TOKEN_PATH"),
        ({"RAY_AUTH_TOKEN": "not-the-token"}, "it rejected the token that was sent"),
    ],
)
def test_a_missing_or_wrong_token_is_one_clear_line(
    ray_head: RayHead, auth: dict[str, str], expected: str
) -> None:
    env = {**_clean_env(), "RAY_ADDRESS": ray_head.address, "HOME": str(ray_head.root), **auth}
    line = _one_error_line(_raydeck("jobs", env=env, timeout=100))
    assert line.startswith(f"error: the Ray job server at {ray_head.address} refused")
    assert expected in line
    assert "not-the-token" not in line


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_an_infeasible_preset_is_refused_before_the_job_is_submitted(ray_head: RayHead) -> None:
    from raydeck.jobs.submission import JobServer

    line = _one_error_line(_raydeck("submit", "jobs/digits_torch.py", "--runtime-env",
                                    "runtime_envs/cpu.yaml", "--preset", "gpu-1",
                                    env=_submit_env(ray_head), timeout=280))
    assert line.startswith("error: preset 'gpu-1' asks for 1 worker(s) x (4 CPU, 1 GPU), PACK, "
                           "but the cluster has 1 node(s) with 2 CPU")
    client = JobServer.from_env(env=ray_head.client_env).client()
    assert not [job for job in client.list_jobs()
                if (job.metadata or {}).get("raydeck_preset") == "gpu-1"]
