"""The whole platform on one machine: `raydeck up` from nothing, real work against it, the
notebooks, and `raydeck down` leaving nothing behind.

One stack for the module (starting it is the expensive part), in a directory other users cannot
pass through, as under ``/root``: run as root (as CI runs), PostgreSQL runs as the ``postgres``
user and keeps its data in ``/var/lib/raydeck/<stack id>``. It walks a new user's journeys with
the docs' own commands, in order: ``up`` from an empty directory; ``up`` again changes nothing;
``raydeck submit --register-as`` and ``raydeck sweep`` with nothing set but the stack's
connection file, checked in PostgreSQL's tables, the S3 buckets and Prometheus; ``models
promote``, ``serve``, one prediction, ``serve status`` and ``serve --stop``; plain MLflow code
through ``raydeck://``; a crashed service shown by ``ps`` and restarted by ``up``; every
notebook run headless against the stack; ``down`` frees every process and port, listens on
loopback only while up, and leaves nothing in the temp directory; a service that dies during
``up`` takes down what that ``up`` started; and ``down --purge`` deletes everything,
PostgreSQL's data outside the stack's directory included.

Recorded (``record_property`` and stdout with ``-s``): ``up``'s wall time, the idle stack's
memory, each notebook's execution time.
"""

from __future__ import annotations

import json
import os
import pwd
import re
import shutil
import signal
import stat
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psutil
import pytest

from raydeck.cluster.serve_ingress import HAPROXY_ENV, HAPROXY_PORT_ENVS
from raydeck.stack import postgres, processes
from raydeck.stack.launchers import RayHeadLauncher
from raydeck.stack.services import SERVICE_ENV, SERVICES
from tests.fixtures.processes import free_port, wait_until
from tests.fixtures.stack import StackUnderTest

ROOT = Path(__file__).resolve().parents[2]
NOTEBOOKS = sorted((ROOT / "notebooks").glob("*.ipynb"))
SERVICE_NAMES = [spec.name for spec in SERVICES]
UP_TIMEOUT_S = 900
JOB_RUN = "stack-job"
JOB_MODEL = "stack-digits"
SWEEP = "stack-sweep"
SWEEP_MODEL = "stack-sweep-best"
PROMETHEUS_WAIT_S = 90.0
# Each notebook's parameters for the suite: short trainings, small sweeps.
SWEEP_NOTEBOOK_TRIALS = 2
NOTEBOOK_PARAMETERS = {
    "01-quickstart": "EPOCHS = 2",
    "02-compare-runs": "MODEL_NAME = 'stack-compare-best'",
    "03-sweeps": f"NUM_SAMPLES = {SWEEP_NOTEBOOK_TRIALS}\nMAX_T = 3\n"
                 "REGISTER_AS = 'stack-notebook-sweep'",
    "04-cluster-jobs": "EPOCHS = 1",
}
NOTEBOOK_TIMEOUT_S = 600

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]


def _memory_mib(ps_output: str) -> int:
    match = re.search(r"memory \(RSS, all processes of the stack\): (\d+) MiB", ps_output)
    assert match, ps_output
    return int(match.group(1))


LOOPBACK_IPS = frozenset({"127.0.0.1", "::1", "::ffff:127.0.0.1"})


def _listeners(port: int | None = None, pids: set[int] | None = None
               ) -> list[tuple[int, str, str, int]]:
    """``(pid, process name, address, port)`` of every listening TCP socket (of ``pids``, or on
    ``port``), as ``ss -ltnp`` shows them."""
    found = []
    for conn in psutil.net_connections(kind="tcp"):
        if conn.status != psutil.CONN_LISTEN or conn.pid is None:
            continue
        if (port is not None and conn.laddr.port != port) or (pids and conn.pid not in pids):
            continue
        try:
            name = psutil.Process(conn.pid).name()
        except psutil.Error:
            continue
        found.append((conn.pid, name, conn.laddr.ip, conn.laddr.port))
    return found


@pytest.fixture(scope="module")
def stack() -> Iterator[dict[str, Any]]:
    under_test = StackUnderTest(mode=0o700)
    started = time.perf_counter()
    try:
        answer = under_test.cli("up", "--free-ports", "--num-cpus", "4", timeout_s=UP_TIMEOUT_S)
        wall_time_s = time.perf_counter() - started
        assert answer.returncode == 0, answer.stdout[-3000:] + answer.stderr[-3000:]
        yield {"stack": under_test, "up": answer, "up_wall_time_s": wall_time_s}
    finally:
        under_test.destroy()
        # Only if the purge test did not run or failed.
        shutil.rmtree(postgres.SYSTEM_DATA_ROOT / under_test.paths.stack_id, ignore_errors=True)


AS_ROOT = os.geteuid() == 0


@pytest.mark.timeout(UP_TIMEOUT_S + 120)
def test_up_from_nothing_starts_every_service_and_shows_no_secret(
    stack: dict[str, Any], record_property: Any
) -> None:
    under_test: StackUnderTest = stack["stack"]
    up = stack["up"]
    for name in SERVICE_NAMES:
        assert re.search(rf"^\s+{name}\s+ready in", up.stdout, re.M), up.stdout
    ps = under_test.cli("ps")
    assert ps.returncode == 0, ps.stdout + ps.stderr
    for name in SERVICE_NAMES:
        assert re.search(rf"{name}\s.*running", ps.stdout), ps.stdout
    memory_mib = _memory_mib(ps.stdout)
    record_property("up_wall_time_s", round(stack["up_wall_time_s"], 1))
    record_property("idle_memory_mib", memory_mib)
    print(f"\nraydeck up from nothing: {stack['up_wall_time_s']:.1f} s; idle stack RSS "
          f"{memory_mib} MiB")

    for secret in under_test.secrets():
        assert secret not in up.stdout + up.stderr + ps.stdout + ps.stderr
    for path in (under_test.paths.credentials, under_test.stack_file,
                 under_test.paths.ray_auth_token):
        assert stat.S_IMODE(path.stat().st_mode) == 0o600, path
    assert str(under_test.stack_file) in up.stdout

    # Serve's ingress is HAProxy (raydeck.cluster.serve_ingress), on ports of this stack's own.
    head = psutil.Process(under_test.state().services["ray-head"].pid).environ()
    assert head[HAPROXY_ENV] == "1"
    internal = under_test.state().internal_ports["ray-head"]
    assert [int(head[name]) for name in HAPROXY_PORT_ENVS] == [
        internal[name] for name in RayHeadLauncher.haproxy_port_names]

    # Where PostgreSQL keeps its data, said by `up` and `ps`: as root, out of the stack's
    # private directory, somewhere the postgres user can reach and nobody else can.
    state = under_test.state()
    pgdata = state.pgdata(under_test.paths)
    assert (pgdata / "PG_VERSION").exists()
    assert f"PostgreSQL data: {pgdata}" in up.stdout and f"PostgreSQL data: {pgdata}" in ps.stdout
    if AS_ROOT:
        home = postgres.SYSTEM_DATA_ROOT / under_test.paths.stack_id
        assert state.postgres_home(under_test.paths) == home and pgdata.parent == home
        assert not under_test.paths.postgres.exists()
        info = home.stat()
        assert (info.st_uid, stat.S_IMODE(info.st_mode)) == (
            pwd.getpwnam(postgres.SYSTEM_USER).pw_uid, 0o700)


def test_up_again_starts_nothing(stack: dict[str, Any]) -> None:
    under_test: StackUnderTest = stack["stack"]
    before = {name: record.pid for name, record in under_test.state().services.items()}
    again = under_test.cli("up")
    assert again.returncode == 0, again.stderr
    assert again.stdout.count("already running") == len(SERVICE_NAMES), again.stdout
    assert {name: r.pid for name, r in under_test.state().services.items()} == before


def _database(under_test: StackUnderTest) -> Any:
    from raydeck.stack import postgres

    return postgres.connect(under_test.state().ports["postgres"],
                            under_test.credentials().postgres_password, dbname="mlflow")


def _objects(under_test: StackUnderTest, bucket: str, prefix: str) -> list[str]:
    from raydeck.config.settings import load_settings
    from raydeck.storage import minio_client

    settings = load_settings(env={"RAYDECK_STACK_FILE": str(under_test.stack_file)})
    return [o.object_name for o in minio_client(settings.storage).list_objects(
        bucket, prefix, recursive=True)]


def test_submit_registers_its_model_and_a_sweep_runs_with_nothing_else_set(
        stack: dict[str, Any]) -> None:
    """docs/serving.md's "Register" journey: ``raydeck submit`` of the torch job with
    ``--register-as``, from a checkout, with nothing set but the stack's connection file. The
    registration reads the run's model from the stack's S3 in the command's own process (it
    failed there with botocore's NoCredentialsError, after the job had succeeded)."""
    under_test: StackUnderTest = stack["stack"]
    submit = under_test.cli("submit", "jobs/digits_torch.py", "--preset", "cpu-2", "--run-name",
                            JOB_RUN, "--register-as", JOB_MODEL, "--", "--epochs", "2",
                            cwd=ROOT)
    assert submit.returncode == 0, submit.stdout[-3000:] + submit.stderr[-3000:]
    assert f"registered: models:/{JOB_MODEL}/1" in submit.stdout, submit.stdout[-3000:]
    sweep = under_test.cli("sweep", "--name", SWEEP, "--space",
                           str(ROOT / "jobs" / "sweep_digits.yaml"), "--num-samples", "1",
                           "--max-t", "2", "--register-as", SWEEP_MODEL)
    assert sweep.returncode == 0, sweep.stdout[-3000:] + sweep.stderr[-3000:]
    assert f"models:/{SWEEP_MODEL}/1" in sweep.stdout

    # MLflow's rows are in the stack's PostgreSQL.
    with _database(under_test) as db:
        runs = dict(db.execute("SELECT name, status FROM runs").fetchall())
        assert runs[JOB_RUN] == "FINISHED" and runs[SWEEP] == "FINISHED"
        steps = db.execute(
            "SELECT m.step FROM metrics m JOIN runs r ON r.run_uuid = m.run_uuid "
            "WHERE r.name = %s AND m.key = 'val_accuracy' ORDER BY m.step", (JOB_RUN,)).fetchall()
        assert [step for (step,) in steps] == [0, 1]
        (job_uuid, artifact_uri), = db.execute(
            "SELECT run_uuid, artifact_uri FROM runs WHERE name = %s", (JOB_RUN,)).fetchall()
        checkpoint = db.execute(
            "SELECT value FROM tags WHERE run_uuid = %s AND key = 'raydeck.checkpoint.latest'",
            (job_uuid,)).fetchone()[0]
        versions = db.execute(
            "SELECT name, version, run_id FROM model_versions WHERE name IN (%s, %s) "
            "ORDER BY name", (JOB_MODEL, SWEEP_MODEL)).fetchall()
        assert [(name, version) for name, version, _ in versions] == [
            (JOB_MODEL, 1), (SWEEP_MODEL, 1)]
        assert versions[0][2] == job_uuid

    # Artifacts and checkpoints are objects in the stack's S3.
    bucket, _, prefix = artifact_uri.removeprefix("s3://").partition("/")
    assert f"{prefix}/model/MLmodel" in _objects(under_test, bucket, prefix)
    bucket, _, prefix = checkpoint.removeprefix("s3://").partition("/")
    assert bucket == "checkpoints" and _objects(under_test, bucket, prefix + "/")


def test_queued_jobs_cancelled_waiting_or_running_stay_on_record(stack: dict[str, Any]
                                                                  ) -> None:
    """docs/scheduling.md's journey on the stack: queue two jobs that each need all 4 CPUs,
    cancel the one waiting and the one running. Both stay on record, in ``raydeck queue
    --all`` and ``raydeck jobs`` (the waiting one vanished from both), and the running one is
    stopped on the job server."""
    under_test: StackUnderTest = stack["stack"]
    ids = []
    for run_id in ("stack-queued-runs", "stack-queued-waits"):
        queued = under_test.cli("submit", "jobs/digits_torch.py", "--queue", "--preset",
                                "cpu-4", "--run-id", run_id, "--", "--epochs", "500", cwd=ROOT)
        assert queued.returncode == 0, queued.stdout[-3000:] + queued.stderr[-3000:]
        ids.append(f"raydeck-{run_id}")  # the job's id: its submission id on the job server
        assert f"queued {ids[-1]} " in queued.stdout, queued.stdout

    def states() -> dict[str, str]:
        shown = under_test.cli("queue", "--all", "--json")
        assert shown.returncode == 0, shown.stderr[-3000:]
        return {row["id"]: row["state"] for row in json.loads(shown.stdout)
                if row["id"] in ids}

    wait_until(lambda: states() == {ids[0]: "running", ids[1]: "queued"}, 120,
               "the first queued job to start and the second to wait")
    for job_id in reversed(ids):
        cancelled = under_test.cli("cancel", job_id)
        assert cancelled.returncode == 0, cancelled.stderr[-3000:]
    assert states() == {job_id: "cancelled" for job_id in ids}

    def jobs() -> dict[str, dict[str, Any]]:
        listed = under_test.cli("jobs", "--json")
        assert listed.returncode == 0, listed.stderr[-3000:]
        return {row["id"]: row for row in json.loads(listed.stdout) if row["id"] in ids}

    # Ray marks a job STOPPED once its driver is gone (it was stopped when cancel returned).
    wait_until(lambda: jobs().get(ids[0], {}).get("status") == "STOPPED", 60,
               "the cancelled running job to show STOPPED")
    waited = jobs()[ids[1]]
    assert (waited["type"], waited["status"]) == ("QUEUED", "CANCELLED"), waited


def test_the_registered_model_is_promoted_served_answers_and_stops(stack: dict[str, Any]
                                                                   ) -> None:
    """docs/serving.md's journey after registering: promote, serve the alias, one prediction,
    ``serve status``, ``serve --stop``, as a user types them against the stack."""
    import requests

    from raydeck.examples.digits import raw_split

    under_test: StackUnderTest = stack["stack"]
    promoted = under_test.cli("models", "promote", JOB_MODEL, "1")
    assert promoted.returncode == 0, promoted.stderr
    assert f"models:/{JOB_MODEL}@champion -> version 1" in promoted.stdout
    port = free_port()
    served = under_test.cli("serve", f"models:/{JOB_MODEL}@champion", "--port", str(port))
    assert served.returncode == 0, served.stdout[-3000:] + served.stderr[-3000:]
    url = f"http://127.0.0.1:{port}/invocations"
    assert url in served.stdout, served.stdout
    # Serve's ingress (HAProxy) listens where `raydeck serve` says, loopback by default.
    assert {address for _, _, address, _ in _listeners(port)} <= LOOPBACK_IPS, _listeners(port)
    _, _, rows, _ = raw_split(0)
    answer = requests.post(url, json={"inputs": rows[:4].tolist()}, timeout=60)
    assert answer.status_code == 200, answer.text[:500]
    assert len(answer.json()["predictions"]) == 4
    status = under_test.cli("serve", "status")
    assert status.returncode == 0, status.stderr
    assert JOB_MODEL in status.stdout and "RUNNING" in status.stdout
    assert "Started" not in status.stdout + status.stderr  # no line of Serve's own
    stopped = under_test.cli("serve", "--stop", "--name", JOB_MODEL)
    assert stopped.returncode == 0, stopped.stderr
    assert f"deleted {JOB_MODEL}" in stopped.stdout
    # Nothing is served any more: the HAProxy listener is gone too (it answered 404 until
    # `raydeck down`).
    wait_until(lambda: not processes.listening(port), 60, "Serve's HTTP port to close")


def test_mlflow_code_logs_to_the_stack_through_the_raydeck_uri(stack: dict[str, Any]) -> None:
    """docs/mlflow-plugin.md: plain MLflow code with ``MLFLOW_TRACKING_URI=raydeck://`` logs to
    raydeck's configured backend, the running stack's MLflow (it went to the embedded SQLite,
    and the proxy refused the process)."""
    import sys

    under_test: StackUnderTest = stack["stack"]
    code = ("import mlflow\n"
            "mlflow.set_experiment('plugin-journey')\n"
            "with mlflow.start_run(run_name='plugin-journey') as run:\n"
            "    mlflow.log_param('lr', 0.1)\n"
            "    for step in range(3):\n"
            "        mlflow.log_metric('loss', 1.0 / (step + 1), step=step)\n")
    answer = under_test.run([sys.executable, "-c", code], timeout_s=300,
                            env={"MLFLOW_TRACKING_URI": "raydeck://"})
    assert answer.returncode == 0, answer.stdout[-3000:] + answer.stderr[-3000:]
    with _database(under_test) as db:
        (run_uuid, status), = db.execute(
            "SELECT run_uuid, status FROM runs WHERE name = 'plugin-journey'").fetchall()
        assert status == "FINISHED"
        points = db.execute("SELECT step FROM metrics WHERE run_uuid = %s AND key = 'loss' "
                            "ORDER BY step", (run_uuid,)).fetchall()
        assert [step for (step,) in points] == [0, 1, 2]
    assert not (under_test.root / "data" / "mlflow.db").exists()  # never the embedded SQLite


def test_prometheus_has_raydeck_and_ray_series(stack: dict[str, Any]) -> None:
    from raydeck.observability.prometheus import PrometheusClient

    under_test: StackUnderTest = stack["stack"]
    client = PrometheusClient(f"http://127.0.0.1:{under_test.state().ports['prometheus']}")
    found: dict[str, list[Any]] = {}
    queries = {
        "training": f'last_over_time(ray_raydeck_train_step{{run="{JOB_RUN}"}}[30m])',
        "tracking": "last_over_time(ray_raydeck_tracking_points_written_total[30m])",
        "sweep": f'last_over_time(ray_raydeck_sweep_trials{{sweep="{SWEEP}"}}[30m])',
        "ray": "ray_node_cpu_count",
    }

    def all_found() -> bool:
        for name, expr in queries.items():
            found[name] = client.query(expr)
        return all(found.values())

    wait_until(all_found, PROMETHEUS_WAIT_S, f"series in the stack's Prometheus ({found})", 1.0)
    assert {series["metric"]["ray_io_cluster"] for series in found["ray"]} == {"local"}
    rules = {rule["name"] for group in client.rules() for rule in group["rules"]}
    assert "TrainingStalled" in rules


def test_a_crashed_service_is_reported_and_up_restarts_it(stack: dict[str, Any]) -> None:
    under_test: StackUnderTest = stack["stack"]
    record = under_test.state().services["prometheus"]
    processes.stop(record, under_test.paths.marker, "prometheus", signal.SIGKILL, grace_s=10)
    ps = under_test.cli("ps")
    assert ps.returncode == 2
    assert re.search(r"prometheus\s.*crashed", ps.stdout), ps.stdout
    assert "prometheus crashed" in ps.stderr and "raydeck up" in ps.stderr
    up = under_test.cli("up")
    assert up.returncode == 0, up.stderr
    assert re.search(r"prometheus\s+ready in", up.stdout)
    assert up.stdout.count("already running") == len(SERVICE_NAMES) - 1
    assert under_test.cli("ps").returncode == 0


def _parameters(notebook: Any, overrides: str) -> None:
    cell = next(c for c in notebook.cells if "parameters" in c.metadata.get("tags", []))
    cell.source += f"\n# set by the test suite\n{overrides}\n"


@pytest.mark.timeout(NOTEBOOK_TIMEOUT_S + 60)
@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.stem for p in NOTEBOOKS])
def test_notebook_runs_against_the_stack(
    path: Path, stack: dict[str, Any], tmp_path: Path, record_property: Any
) -> None:
    import nbformat
    from mlflow.tracking import MlflowClient
    from nbclient import NotebookClient

    under_test: StackUnderTest = stack["stack"]
    notebook = nbformat.read(path, as_version=4)
    _parameters(notebook, NOTEBOOK_PARAMETERS[path.stem])
    client = NotebookClient(notebook, timeout=NOTEBOOK_TIMEOUT_S, kernel_name="python3",
                            resources={"metadata": {"path": str(tmp_path)}})
    started = time.perf_counter()
    # Raises CellExecutionError, with the cell and its traceback, on any error cell.
    client.execute(env=under_test.env, cwd=str(tmp_path))
    elapsed_s = time.perf_counter() - started
    record_property("notebook_s", round(elapsed_s, 1))
    print(f"\n{path.name}: {elapsed_s:.1f} s")

    outputs = [output for cell in notebook.cells if cell.cell_type == "code"
               for output in cell.outputs]
    text = "".join(o.get("text", "") for o in outputs if o.output_type == "stream")
    assert not [o for o in outputs if o.output_type == "error"]
    assert any("image/png" in o.get("data", {}) for o in outputs), f"{path.name} drew no plot"
    mlflow = MlflowClient(f"http://127.0.0.1:{under_test.state().ports['mlflow']}")
    if path.stem == "01-quickstart":
        assert any("application/vnd.jupyter.widget-view+json" in o.get("data", {})
                   for o in outputs), "no notebook progress bar"
        experiment = mlflow.get_experiment_by_name("raydeck")
        runs = mlflow.search_runs([experiment.experiment_id], "attributes.run_name = 'quickstart'")
        assert [run.info.status for run in runs] == ["FINISHED"]
    elif path.stem == "02-compare-runs":
        (version,) = mlflow.search_model_versions("name = 'stack-compare-best'")
        assert version.run_id in text
    elif path.stem == "03-sweeps":
        versions = mlflow.search_model_versions("name = 'stack-notebook-sweep'")
        assert len(versions) == 1 and "registered: models:/stack-notebook-sweep/1" in text
        counts = re.search(r"\{'completed': (\d+), 'stopped_early': (\d+), "
                           r"'preempted': (\d+), 'errored': (\d+)\}", text)
        assert counts and int(counts.group(1)) >= 1
        assert sum(map(int, counts.groups())) == SWEEP_NOTEBOOK_TRIALS
    elif path.stem == "04-cluster-jobs":
        assert text.count("/d/raydeck-training/raydeck-training?var-run=notebook-") == 2
        assert "SUCCEEDED" in text


def test_down_stops_every_process_and_frees_every_port(stack: dict[str, Any]) -> None:
    """While up, every service raydeck starts listens on loopback only, and so do Ray's
    dashboard and job server; Ray 2.60's own gRPC servers (GCS, raylet, workers, agents, Ray
    Client) bind the host's interfaces whatever ``--node-ip-address`` says, which
    docs/deployment.md states with how the stack guards them. ``down`` stops everything and
    leaves nothing in the temp directory: Ray's temp dir, HAProxy's files, what jobs' processes
    wrote there, and no tracker's staging folder."""
    import tempfile

    under_test: StackUnderTest = stack["stack"]
    ports = under_test.ports()
    assert under_test.marked()
    by_service: dict[str, list[tuple[int, str, str, int]]] = {}
    for proc in under_test.marked():
        service = proc.environ().get(SERVICE_ENV, "")
        by_service.setdefault(service, []).extend(_listeners(pids={proc.pid}))
    for service, sockets in by_service.items():
        wide = [s for s in sockets if s[2] not in LOOPBACK_IPS]
        if service == "ray-head":
            dashboard = under_test.state().ports["ray-dashboard"]
            assert not [s for s in wide if s[3] == dashboard], wide
            print(f"\nRay's own listeners on the host's interfaces: {sorted(wide)}")
        else:
            assert not wide, f"{service} listens beyond loopback: {wide}"
    ray_temp = under_test.paths.ray_temp_dir
    assert ray_temp.is_dir()  # also the TMPDIR of the stack's Ray processes
    down = under_test.cli("down")
    assert down.returncode == 0, down.stderr
    assert not under_test.marked()
    assert [port for port in ports if processes.listening(port)] == []
    assert not under_test.stack_file.exists()  # raydeck commands no longer use it
    assert (under_test.state().pgdata(under_test.paths) / "PG_VERSION").exists()  # data stays
    assert not ray_temp.exists()
    # No command or script this module ran (each has ended) left a tracker's staging folder.
    staging = [Path(tempfile.gettempdir()) / f"raydeck-staging-{pid}" for pid in under_test.pids]
    assert under_test.pids and not [folder for folder in staging if folder.exists()]
    ps = under_test.cli("ps")
    assert ps.returncode == 0 and ps.stdout.count("stopped") == len(SERVICE_NAMES)


def test_a_service_dying_during_up_stops_what_that_up_started(stack: dict[str, Any]) -> None:
    """Ray's temp dir taken by a file: the head exits at every start; PostgreSQL, S3 and MLflow,
    started by the same ``up``, are stopped again."""
    under_test: StackUnderTest = stack["stack"]
    blocked = under_test.paths.ray_temp_dir
    shutil.rmtree(blocked, ignore_errors=True)
    blocked.write_text("not a directory")
    try:
        up = under_test.cli("up")
    finally:
        blocked.unlink()
    assert up.returncode == 2, up.stdout + up.stderr
    errors = up.stderr.strip().splitlines()
    assert len(errors) == 1 and errors[0].startswith("error: ray-head: exited while starting")
    assert "raydeck logs ray-head" in errors[0]
    for name in ("mlflow", "s3", "postgres"):
        assert f"{name}" in up.stdout and re.search(rf"{name}\s+stopping", up.stdout)
    assert not under_test.marked()
    assert [port for port in under_test.ports() if processes.listening(port)] == []
    assert not under_test.stack_file.exists()


def test_down_purge_deletes_the_stack_and_postgres_data_outside_it(
    stack: dict[str, Any]
) -> None:
    """Last in the module: it deletes the stack."""
    under_test: StackUnderTest = stack["stack"]
    home = under_test.state().postgres_home(under_test.paths)
    down = under_test.cli("down", "--purge", timeout_s=300)
    assert down.returncode == 0, down.stdout + down.stderr
    assert not under_test.paths.root.exists() and not home.exists()
    assert not under_test.marked()
    if AS_ROOT:
        assert f"deleted {home}" in down.stdout, down.stdout
        # No empty /var/lib/raydeck is left (another stack's files may keep it).
        root = postgres.SYSTEM_DATA_ROOT
        assert not root.exists() or any(root.iterdir())
