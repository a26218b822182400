"""No secret in any output: a deployment with credentials everywhere, every output grepped.

The setup is the documented production one: a Ray head (``ray start --head``, token auth)
whose environment holds the tracking URI *with* ``user:password`` (an MLflow server on
PostgreSQL behind basic auth; this MLflow server ignores the credentials) and the S3 secret, and
a submitting shell with the same settings plus a Grafana token. Through it run every ``raydeck``
command, a submitted job, a driver on the head (``raydeck demo``), a sweep with a registered
model, and an MLflow outage that leaves errors in the tracking proxy. Then a driver on the head
starts the proxy again on the direct write path (``RAYDECK_TRACKING_WRITE_DB``, the server's
PostgreSQL URI with its password) and PostgreSQL stops while it logs, which leaves the
database's own errors in the proxy. Then every output is searched for the secrets (the
password, in clear and as the basic-auth header, the PostgreSQL password, the S3 secret, the
Grafana token and password, the Ray token):

- each command's stdout and stderr,
- the head's Ray session directory (every log, the runtime env agent's included) and the job
  server's record of each job (entrypoint, runtime env, metadata),
- MLflow: the runs' params, tags, metric keys and names, the registered model, the server's
  database (``pg_dump``),
- the buckets (artifacts such as ``raydeck/runtime_env.json``, checkpoints) and the proxy's
  spool and data directories.

Each category is its own test, so a failure names where a secret leaked (with context, the
secret itself shown as ``<name>``). The scenario runs once per module.
"""

from __future__ import annotations

import base64
import json
import os
import secrets
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from raydeck.stack import postgres as stack_postgres
from raydeck.stack.services import LOOPBACK, POSTGRES_DB, POSTGRES_USER
from tests.conftest import TEST_ENV
from tests.fixtures.mlflow_server import MlflowServer
from tests.fixtures.postgres import PostgresServer, postgres_server
from tests.fixtures.processes import free_port, wait_until
from tests.fixtures.ray_head import RayHead
from tests.fixtures.s3_server import S3Server

REPO = Path(__file__).resolve().parents[1]
SCENARIO_TIMEOUT_S = 2400
COMMAND_TIMEOUT_S = 600
CONTEXT_CHARS = 60

pytestmark = [pytest.mark.slow, pytest.mark.timeout(SCENARIO_TIMEOUT_S)]


@dataclass
class Scenario:
    """What the deployment produced: command outputs and every other place to search."""

    secrets: dict[str, str]
    # The S3 prefix set only in the submitting shell of `raydeck submit` (not on the head).
    submit_prefix: str = ""
    outputs: dict[str, str] = field(default_factory=dict)  # command -> stdout + stderr
    seconds: dict[str, float] = field(default_factory=dict)  # command -> wall time
    # category -> {source: content}
    sources: dict[str, dict[str, bytes]] = field(default_factory=dict)

    def hits(self, sources: dict[str, bytes]) -> list[str]:
        """Every occurrence of a secret in ``sources``, with context, the secret shown by name."""
        found = []
        for source, content in sources.items():
            for name, value in self.secrets.items():
                needle = value.encode()
                start = content.find(needle)
                while start != -1:
                    before = content[max(0, start - CONTEXT_CHARS):start]
                    after = content[start + len(needle):start + len(needle) + CONTEXT_CHARS]
                    context = (before + f"<{name}>".encode() + after).decode(errors="replace")
                    found.append(f"{source}: ...{context!r}...")
                    start = content.find(needle, start + 1)
        return found


def _clean_env() -> dict[str, str]:
    return {k: v for k, v in os.environ.items()
            if not k.startswith(("RAYDECK_", "RAY_", "AWS_", "MLFLOW_", "GRAFANA_"))}


def _files(root: Path, label: str, skip: tuple[Path, ...] = ()) -> dict[str, bytes]:
    found = {}
    for path in sorted(root.rglob("*")):
        if path in skip:
            continue
        if path.is_file() and not path.is_symlink() and path.suffix != ".zip":
            try:
                found[f"{label}/{path.relative_to(root)}"] = path.read_bytes()
            except OSError:
                continue  # removed while we walked (Ray rotates files)
    return found


def _run(scenario: Scenario, name: str, args: list[str], env: dict[str, str],
         expect: tuple[int, ...] = (0,)) -> str:
    started = time.monotonic()
    done = subprocess.run([sys.executable, "-m", "raydeck.cli", *args], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=COMMAND_TIMEOUT_S)
    scenario.seconds[name] = scenario.seconds.get(name, 0.0) + time.monotonic() - started
    text = done.stdout + done.stderr
    scenario.outputs[name] = text
    assert done.returncode in expect, f"{name}: exit {done.returncode}\n{text[-5000:]}"
    return text


def _outage(scenario: Scenario, env: dict[str, str], name: str, down: Callable[[], object],
            up: Callable[[], object]) -> None:
    """A run logs while ``down`` has stopped what the proxy writes to: the proxy's shards hold
    the failing writer's error messages (outputs ``<name> driver`` and ``tracking status
    (<name>)``); ``up`` starts it again and the run finishes."""
    code = (
        "import sys, raydeck\n"
        "tracker = raydeck.get_tracker(run_name='leak-outage')\n"
        "print('RUN', tracker.run_id, flush=True)\n"
        "sys.stdin.readline()\n"
        "tracker.log_metrics({'x': 1.0}, step=0)\n"
        "tracker.log_params({'p': 1})\n"
        "sys.stdin.readline()\n"
        "tracker.finish()\n"
        "print('DONE', flush=True)\n"
    )
    driver = subprocess.Popen([sys.executable, "-c", code], cwd=REPO, env=env, text=True,
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT)
    assert driver.stdin is not None and driver.stdout is not None
    status = f"tracking status ({name})"
    is_down = False
    try:
        printed = []  # Ray forwards the proxy actors' logs to the driver, before or after RUN
        for line in driver.stdout:
            printed.append(line)
            if line.startswith("RUN "):
                break
        first = "".join(printed)
        assert printed and printed[-1].startswith("RUN "), first[-3000:]
        down()
        is_down = True
        driver.stdin.write("go\n")
        driver.stdin.flush()
        polls: list[str] = []

        def shard_error_shown() -> bool:
            polls.append(_run(scenario, status, ["tracking", "status"], env))
            scenario.outputs[status] = "".join(polls)
            return any(sign in polls[-1] for sign in ("API request", "Connection", "refused"))

        wait_until(shard_error_shown, 300, f"a shard error in `raydeck {status}`",
                   interval_s=2.0)
        up()
        is_down = False
        driver.stdin.write("go\n")
        driver.stdin.flush()
        rest, _ = driver.communicate(timeout=300)
    finally:
        if driver.poll() is None:
            driver.kill()
            driver.wait(30)
        if is_down:
            up()
    scenario.outputs[f"{name} driver"] = first + rest
    assert "DONE" in rest, rest[-3000:]


def _database_dump(postgres: PostgresServer) -> bytes:
    """Everything in MLflow's PostgreSQL database, as ``pg_dump`` writes it."""
    install = stack_postgres.find_install(postgres.pgdata)
    return subprocess.run(
        [install.binary("pg_dump"), "-h", LOOPBACK, "-p", str(postgres.port), "-U",
         POSTGRES_USER, POSTGRES_DB], env={**os.environ, **postgres.env}, capture_output=True,
        check=True, timeout=COMMAND_TIMEOUT_S).stdout


def _mlflow_sources(uri: str, experiment: str, model: str) -> dict[str, bytes]:
    from mlflow.tracking import MlflowClient

    client = MlflowClient(uri)
    exp = client.get_experiment_by_name(experiment)
    assert exp is not None
    found = {f"experiment {experiment}": json.dumps(
        {"artifact_location": exp.artifact_location, "tags": exp.tags}).encode()}
    runs = client.search_runs([exp.experiment_id], max_results=1000)
    assert len(runs) >= 4, [r.info.run_name for r in runs]  # submit, demo, sweep, outage
    for run in runs:
        found[f"run {run.info.run_name} ({run.info.run_id})"] = json.dumps({
            "name": run.info.run_name, "params": run.data.params, "tags": run.data.tags,
            "metrics": sorted(run.data.metrics),
        }).encode()
    versions = client.search_model_versions(f"name = '{model}'")
    assert versions, f"the sweep registered no {model}"  # else the registry goes unchecked
    for version in versions:
        found[f"model {model} v{version.version}"] = json.dumps({
            "source": version.source, "tags": version.tags, "run_id": version.run_id,
            "description": version.description}).encode()
    return found


def _bucket_sources(s3: S3Server, buckets: list[str]) -> dict[str, bytes]:
    client = s3.client()
    found = {}
    for bucket in buckets:
        for obj in client.list_objects(bucket, recursive=True):
            answer = client.get_object(bucket, obj.object_name)
            try:
                found[f"s3://{bucket}/{obj.object_name}"] = answer.read()
            finally:
                answer.close()
                answer.release_conn()
    return found


def _job_sources(head: RayHead) -> dict[str, bytes]:
    from raydeck.jobs.submission import JobServer

    client = JobServer.from_env(env=head.client_env).client()
    return {f"job {job.submission_id}": json.dumps(
        {"entrypoint": job.entrypoint, "runtime_env": job.runtime_env,
         "metadata": job.metadata, "message": job.message}, default=str).encode()
        for job in client.list_jobs()}


@pytest.fixture(scope="module")
def postgres() -> Iterator[PostgresServer]:
    """MLflow's database (README's first command installs PostgreSQL)."""
    with postgres_server("raydeck-secrets-pg-") as server:
        yield server


@pytest.fixture(scope="module")
def scenario(tmp_path_factory: pytest.TempPathFactory, s3_server: S3Server,
             postgres: PostgresServer) -> Iterator[Scenario]:
    root = tmp_path_factory.mktemp("secrets-e2e")
    tag = secrets.token_hex(4)
    password = f"s3cretpw-{secrets.token_hex(8)}"
    grafana_password = f"grafana-pw-{secrets.token_hex(8)}"
    grafana_token = f"glsa_{secrets.token_hex(16)}"
    experiment = f"leak-check-{tag}"
    model = f"leak-model-{tag}"
    buckets = {"RAYDECK_S3_ARTIFACTS_BUCKET": f"leak-artifacts-{tag}",
               "RAYDECK_S3_CHECKPOINTS_BUCKET": f"leak-checkpoints-{tag}"}

    mlflow = MlflowServer(root / "mlflow", backend_store_uri=postgres.uri,
                          env=postgres.env).start()
    uri = f"http://bob:{password}@127.0.0.1:{mlflow.port}"
    settings = {
        "RAYDECK_TRACKING_URI": uri, "RAYDECK_TRACKING_EXPERIMENT": experiment,
        **s3_server.settings_env(**buckets),
        **{k: v for k, v in TEST_ENV.items()
           if k not in ("RAY_AUTH_MODE", "MLFLOW_SUPPRESS_PRINTING_URL_TO_STDOUT")},
    }
    assert settings["RAYDECK_S3_SECRET_ACCESS_KEY"] == s3_server.secret_access_key
    venv_bin = str(Path(sys.executable).parent)
    started = time.monotonic()
    head = RayHead(root / "head", {
        **_clean_env(), **settings, "PATH": f"{venv_bin}:{os.environ.get('PATH', '')}",
        "RAYDECK_DATA_DIR": str(root / "head-data")}).start()
    scenario = Scenario(secrets={
        "tracking password": password,
        "basic-auth header": base64.b64encode(f"bob:{password}".encode()).decode(),
        "PostgreSQL password": postgres.password.reveal(),
        "S3 secret": s3_server.secret_access_key,
        "Grafana token": grafana_token,
        "Grafana password": grafana_password,
        "Ray token": head.token_path.read_text().strip(),
    }, submit_prefix=f"shell-{tag}")
    scenario.seconds["ray head start"] = time.monotonic() - started
    shell = {**_clean_env(), **settings, **head.client_env, "COLUMNS": "250",
             "RAYDECK_RAY_ADDRESS": head.gcs_address, "RAYDECK_DATA_DIR": str(root / "data"),
             "GRAFANA_TOKEN": grafana_token}
    try:
        _run(scenario, "config", ["config"], shell)
        _run(scenario, "config (bad URI)", ["config"],
             {**shell, "RAYDECK_TRACKING_URI": f"bob:{password}@127.0.0.1:{mlflow.port}"},
             expect=(2,))
        _run(scenario, "presets", ["presets"], shell)
        _run(scenario, "storage init", ["storage", "init"], shell)
        _run(scenario, "status", ["status"], shell)
        _run(scenario, "submit", ["submit", "jobs/digits_torch.py", "--runtime-env",
                                  "runtime_envs/cpu.yaml", "--preset", "cpu-1", "--no-check",
                                  "--run-name", "leak-submit", "--", "--epochs", "2"],
             {**shell, "RAYDECK_DATA_DIR": str(root / "head-data"),
              "RAYDECK_S3_PREFIX": scenario.submit_prefix})
        _run(scenario, "jobs", ["jobs"], shell)
        _run(scenario, "demo", ["demo", "--epochs", "3", "--preset", "cpu-1",
                                "--run-name", "leak-demo"], shell)
        # The best trial's model is logged to the artifact bucket and registered: the
        # registry's version and its tags are among what is searched for secrets.
        _run(scenario, "sweep", ["sweep", "--name", f"leak-sweep-{tag}", "--num-samples", "1",
                                 "--max-t", "2", "--preset", "cpu-1", "--register-as", model],
             shell)
        started = time.monotonic()
        _outage(scenario, shell, "MLflow down", mlflow.stop, mlflow.start)
        scenario.seconds["MLflow outage, all"] = time.monotonic() - started
        _run(scenario, "tracking status", ["tracking", "status"], shell)
        # The direct write path: the proxy started again by a driver on the head whose
        # settings name the server's database, with its password.
        _run(scenario, "tracking stop (before the direct path)", ["tracking", "stop"], shell)
        direct = {**shell, "RAYDECK_TRACKING_WRITE_DB": postgres.uri_with_password}
        _run(scenario, "config (direct)", ["config"], direct)
        started = time.monotonic()
        _outage(scenario, direct, "PostgreSQL down", postgres.stop, postgres.start)
        scenario.seconds["PostgreSQL outage, all"] = time.monotonic() - started
        _run(scenario, "tracking status (direct)", ["tracking", "status"], direct)
        _run(scenario, "monitoring config", ["monitoring", "config", "-o",
                                             str(root / "prometheus.yml")], shell)
        _run(scenario, "dashboards push", ["dashboards", "push", "--url",
                                           f"http://admin:{grafana_password}@127.0.0.1:"
                                           f"{free_port()}"], shell, expect=(2,))
        _run(scenario, "dashboards check", ["dashboards", "check", "--prometheus-url",
                                            f"http://admin:{grafana_password}@127.0.0.1:"
                                            f"{free_port()}"], shell, expect=(2,))
        _run(scenario, "tracking stop", ["tracking", "stop"], shell)

        with pytest.MonkeyPatch.context() as patch:
            patch.setenv("RAY_AUTH_MODE", "token")
            patch.setenv("RAY_AUTH_TOKEN_PATH", str(head.token_path))
            scenario.sources["Ray"] = {
                **_files(head.temp_dir, "ray-session"),
                # The token file is where the token lives, not an output.
                **_files(head.root, "ray-head", skip=(head.token_path,)),
                **_job_sources(head),
            }
        scenario.sources["MLflow"] = {
            **_mlflow_sources(mlflow.uri, experiment, model),
            "MLflow's database": _database_dump(postgres),
        }
        scenario.sources["storage"] = {
            **_bucket_sources(s3_server, list(buckets.values())),
            **_files(root / "head-data", "head-data"),
            **_files(root / "data", "shell-data"),
        }
        yield scenario
    finally:
        head.stop()
        mlflow.stop()


def test_an_s3_prefix_set_only_in_the_submitting_shell_reaches_the_job(
    scenario: Scenario
) -> None:
    """`raydeck submit` sends the shell's raydeck settings with the job: its checkpoints land
    under the prefix the shell set, which the head's environment does not name."""
    prefix = f"/{scenario.submit_prefix}/"
    under = [source for source in scenario.sources["storage"]
             if source.startswith("s3://leak-checkpoints-") and prefix in source]
    # The submitted run's folder, and nothing else of substance (folder markers aside): the
    # demo and the sweep, run from a shell without the prefix, wrote elsewhere.
    assert any(f"{prefix}leak-submit-" in source for source in under), under
    assert all(f"{prefix}leak-submit-" in source for source in under
               if not source.endswith("/")), under


def test_every_command_ran_and_outputs_were_collected(scenario: Scenario) -> None:
    print("\nseconds per command: " + ", ".join(
        f"{name} {seconds:.0f}" for name, seconds in scenario.seconds.items()))
    # The searches below are only worth something if they searched real outputs.
    out = scenario.outputs
    assert "http://127.0.0.1:" in out["config"]  # the tracking URI, shown without credentials
    assert "left as ${RAYDECK_TRACKING_URI}" in out["submit"]
    assert "SUCCEEDED" in out["submit"] and "validation accuracy" in out["demo"]
    assert "best trial" in out["sweep"]
    assert "******** (set)" in out["config (direct)"]
    assert "direct to postgresql://" in out["tracking status (direct)"]
    assert "direct to postgresql://" in out["tracking status (PostgreSQL down)"]
    ray = scenario.sources["Ray"]
    assert any("runtime_env_agent" in source for source in ray), sorted(ray)[:50]
    assert any("job-driver-raydeck-" in source for source in ray), sorted(ray)[:50]
    assert any(source.endswith("raydeck/runtime_env.json") for source in
               scenario.sources["storage"])
    assert any("raydeck.entrypoint" in content.decode(errors="replace")
               for content in scenario.sources["MLflow"].values())


@pytest.mark.parametrize("command", [
    "config", "config (bad URI)", "presets", "storage init", "status", "submit", "jobs", "demo",
    "sweep", "MLflow down driver", "tracking status (MLflow down)", "tracking status",
    "tracking stop (before the direct path)", "config (direct)", "PostgreSQL down driver",
    "tracking status (PostgreSQL down)", "tracking status (direct)", "monitoring config",
    "dashboards push", "dashboards check", "tracking stop",
])
def test_no_secret_in_the_output_of(scenario: Scenario, command: str) -> None:
    assert command in scenario.outputs
    hits = scenario.hits({command: scenario.outputs[command].encode()})
    assert not hits, "\n".join(hits)


@pytest.mark.parametrize("category", ["Ray", "MLflow", "storage"])
def test_no_secret_in(scenario: Scenario, category: str) -> None:
    hits = scenario.hits(scenario.sources[category])
    assert not hits, f"{len(hits)} hit(s):\n" + "\n".join(hits[:40])
