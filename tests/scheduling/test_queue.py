"""The job queue on a real Ray cluster: real jobs through Ray's job server, queued with
`raydeck submit --queue`, ordered by the policy, held by team quotas, surviving its actor.

The module starts one head (`ray start --head`, token auth) that Ray believes has 4 GPUs and 8
CPUs; the jobs (tests/fixtures/queue_job.py) hold their preset's resources by running, and
write when they started and ended to a shared file, which is what the tests read. The
three-team test joins a second node (4 CPUs, 2 fake GPUs) for its duration and queues the real
digits job (jobs/digits_torch.py) beside two of these; the preemption test preempts it and its
Lightning twin (jobs/digits_lightning.py). Fake GPUs cannot run torch, so digits jobs use CPU
presets, and the jobs holding the nodes take real Ray resources.
"""

from __future__ import annotations

import json
import os
import pwd
import re
import shutil
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import Any

import psutil
import pytest
import yaml

from raydeck.scheduling.queue.store import Store
from tests.fixtures.processes import wait_until
from tests.fixtures.prometheus import DASHBOARDS_DIR, PrometheusServer, for_ray_session
from tests.fixtures.ray_head import RayHead, head_env

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures"
PRESETS = {
    "q1": {"num_workers": 1, "cpus_per_worker": 1, "gpus_per_worker": 1},
    "q2": {"num_workers": 2, "cpus_per_worker": 1, "gpus_per_worker": 1},
    "q8": {"num_workers": 8, "cpus_per_worker": 1, "gpus_per_worker": 1},
    # The preemption test's: two low-priority jobs fit the 8 CPUs together, the high one
    # needs all of them.
    "d3": {"num_workers": 1, "cpus_per_worker": 3},
    "d8": {"num_workers": 1, "cpus_per_worker": 8},
    # A node each: fits the cluster's totals, but this cluster has one node.
    "s2": {"num_workers": 2, "cpus_per_worker": 1, "placement_strategy": "STRICT_SPREAD"},
    # The two-node test's: holders that fit one node each, and the teams' digits jobs.
    "h6": {"num_workers": 1, "cpus_per_worker": 6},
    "h3": {"num_workers": 1, "cpus_per_worker": 3, "gpus_per_worker": 1},
    "t3": {"num_workers": 2, "cpus_per_worker": 1.5, "placement_strategy": "STRICT_PACK"},
    "c1": {"num_workers": 1, "cpus_per_worker": 1},
    # The elastic test's: a digits job of one or two 3-CPU workers, a holder that leaves it
    # room for one, and a higher-priority job that fits beside one but not beside two.
    "e3": {"num_workers": [1, 2], "cpus_per_worker": 3},
    "h5": {"num_workers": 1, "cpus_per_worker": 5},
    "u4": {"num_workers": 1, "cpus_per_worker": 4},
    # The Serve test's: three 2-CPU replicas.
    "v2": {"num_workers": 3, "cpus_per_worker": 2},
}
REPO = Path(__file__).resolve().parents[2]
TEAMS = {"a": {"cpus": 3}, "b": {"weight": 2}, "c": {}}
CLI_TIMEOUT_S = 120
QUEUE_SCRAPE_INTERVAL_S = 5.0
# How often a wait asks the job server or MLflow: each check sends requests that a server on
# the same 2 cores must answer, for minutes; seeing a change up to 1 s late costs nothing.
SERVER_POLL_S = 1.0
# How often a wait runs `raydeck queue` to read what a user reads: each is a new process that
# imports Ray and connects to the head as a driver (about 2 CPU-s, the head's work besides).
CLI_POLL_S = 3.0
# How long the three-team test's 1-CPU jobs hold their gang: they end on their own, while the
# digits job started before them trains.
LIGHT_JOB_S = 3.0


@dataclass(frozen=True)
class Cluster:
    head: RayHead
    workdir: Path
    env: dict[str, str]
    log: Path
    prometheus: PrometheusServer

    def cli(self, *args: str, columns: int | None = None) -> subprocess.CompletedProcess[str]:
        """``raydeck ARGS``; ``columns``: the terminal's width, when a table's row must fit one
        line."""
        env = {**self.env, "COLUMNS": str(columns)} if columns else self.env
        return subprocess.run([sys.executable, "-m", "raydeck.cli", *args], cwd=self.workdir,
                              env=env, capture_output=True, text=True, timeout=CLI_TIMEOUT_S)

    def submit(self, name: str, preset: str, seconds: float, team: str, priority: int = 0,
               hold: bool = False, unseen_end: bool = False, until: Path | None = None
               ) -> subprocess.CompletedProcess[str]:
        """Queue tests/fixtures/queue_job.py; ``until``: it also holds until that file exists
        (:meth:`release_file`)."""
        return self.cli("submit", "queue_job.py", "--queue", "--no-check", "--runtime-env",
                        "runtime.yaml", "--preset", preset, "--run-name", name, "--run-id",
                        name, "--team", team, "--priority", str(priority), "--",
                        "--seconds", str(seconds), "--log", str(self.log),
                        *(["--hold"] if hold else []),
                        *(["--unseen-end"] if unseen_end else []),
                        *(["--until", str(until)] if until else []))

    def release_file(self, name: str) -> Path:
        """A file that releases the jobs submitted with ``until=`` it once the test creates
        it."""
        return self.workdir.parent / f"release-{name}"

    def digits(self, name: str, preset: str, team: str, priority: int, epochs: int,
               job: str = "digits_torch.py", gate: Path | None = None,
               pause_at_world_sizes: tuple[int, ...] = ()) -> str:
        """Queue a real digits job (``job``: jobs/digits_torch.py or digits_lightning.py); its
        run is tagged ``name``. ``gate``: after its first checkpoint an attempt waits until that
        file exists, unless the queue told it to stop there; given ``pause_at_world_sizes``,
        only an attempt of one of those sizes, each at ``gate.w<size>``
        (tests/fixtures/gated_digits.py)."""
        kind = "lightning" if "lightning" in job else "torch"
        entry = ["gated_digits.py", "--queue"] if gate else [job, "--queue"]
        gated = [kind, str(gate)] if gate else []
        if gate and pause_at_world_sizes:
            gated += ["--pause-at-world-size", ",".join(map(str, pause_at_world_sizes))]
        return _ok(self.cli(
            "submit", *entry, "--no-check", "--runtime-env",
            "runtime.yaml", "--preset", preset, "--run-name", name, "--run-id", name, "--team",
            team, "--priority", str(priority), "--", *gated, "--epochs", str(epochs)))

    @cached_property
    def jobs(self) -> Any:
        """The head's job server client (a ``JobSubmissionClient``), made once: making one
        checks the server and lists every job (here about 1 s and 0.1 CPU-s, against 0.02 s
        for a job's status), which a wait polling three jobs every 0.2 s would pay each time."""
        from raydeck.jobs.submission import JobServer

        return JobServer.from_env(env=self.head.client_env).client()

    def python(self, script: str) -> str:
        """Run ``script`` in a Python connected to this cluster (as a driver); its stdout."""
        done = subprocess.run([sys.executable, "-c", script],
                              env={**self.env, "RAY_ADDRESS": self.head.gcs_address},
                              capture_output=True, text=True, timeout=CLI_TIMEOUT_S)
        assert done.returncode == 0, done.stderr[-3000:]
        return done.stdout

    def events(self) -> dict[str, dict[str, list[float]]]:
        """run name -> {"start": [times], "end": [times]}."""
        found: dict[str, dict[str, list[float]]] = {}
        if self.log.exists():
            for line in self.log.read_text().splitlines():
                event = json.loads(line)
                found.setdefault(event["run"], {"start": [], "end": []})[event["event"]].append(
                    event["t"])
        return found


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory, raydeck_env: dict[str, str]
            ) -> Iterator[Cluster]:
    root = tmp_path_factory.mktemp("queue")
    workdir = root / "work"
    workdir.mkdir()
    for fixture in ("queue_job.py", "gated_digits.py"):
        shutil.copy(FIXTURES / fixture, workdir / fixture)
    shutil.copy(REPO / "jobs" / "digits_torch.py", workdir / "digits_torch.py")
    shutil.copy(REPO / "jobs" / "digits_lightning.py", workdir / "digits_lightning.py")
    (workdir / "runtime.yaml").write_text("working_dir: .\n")
    (root / "presets.yaml").write_text(yaml.safe_dump(PRESETS))
    env = head_env(raydeck_env["RAYDECK_TRACKING_URI"], root / "data",
                   RAYDECK_PRESETS_FILE=str(root / "presets.yaml"))
    head = RayHead(root / "head", env, num_cpus=8, num_gpus=4).start()
    prometheus = None
    try:
        # Scraping from the start: the Queue dashboard's rates need the jobs' whole history.
        # Every 5 s: the module runs for minutes, and the dashboard's rates span 10 minutes.
        prometheus = for_ray_session(root / "prometheus", head.temp_dir / "session_latest",
                                     scrape_interval_s=QUEUE_SCRAPE_INTERVAL_S)
        yield Cluster(head, workdir, {**env, **head.client_env, "COLUMNS": "250",
                                      "RAYDECK_RAY_ADDRESS": head.gcs_address},
                      root / "runs.jsonl", prometheus)
    finally:
        if prometheus is not None:
            prometheus.stop()
        head.stop()


def _ok(result: subprocess.CompletedProcess[str]) -> str:
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return result.stdout


def _one_error_line(result: subprocess.CompletedProcess[str]) -> str:
    assert result.returncode == 2, result.stdout[-3000:] + result.stderr[-3000:]
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: "), result.stderr
    return lines[0]


def _row(listing: str, job: str) -> str:
    return next(line for line in listing.splitlines() if job in line)


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_bad_input_is_one_line_exit_2_and_queues_nothing(cluster: Cluster) -> None:
    _ok(cluster.cli("queue", "--policy", "priority", "--teams", str(_teams(cluster))))
    assert "is not one of the queue's teams: a, b, c" in _one_error_line(
        cluster.submit("bad-team", "q1", 1, "nobody"))
    assert "--priority=-1" in _one_error_line(cluster.submit("bad-prio", "q1", 1, "a", -1))
    assert "the whole cluster has 4 GPU, 8 CPU: it could never start" in _one_error_line(
        cluster.submit("too-large", "q8", 1, "b"))
    assert ("needs 2 x (1 CPU), STRICT_SPREAD, which no placement on the cluster's 1 "
            "node(s) (node 0: 4 GPU, 8 CPU) holds even when idle") in _one_error_line(
        cluster.submit("unplaceable", "s2", 1, "b"))
    estimate = cluster.cli("submit", "queue_job.py", "--queue", "--runtime-env",
                           "runtime.yaml", "--preset", "q1", "--team", "a", "--estimate",
                           "soon")
    assert "duration 'soon'" in _one_error_line(estimate)
    assert "policy 'lottery' is not one of" in _one_error_line(
        cluster.cli("queue", "--policy", "lottery"))
    # Who may, through the CLI and the actor: while the head's admins file names another
    # account, this one may not change the teams file, whatever LOGNAME and USER say (issue
    # 52). The other rules: tests/scheduling/test_queue_identity.py.
    teams = _teams(cluster)  # written first: it names this account the admin
    admins = _admins(cluster, "mallory")
    spoofed = {**cluster.env, "LOGNAME": "mallory", "USER": "mallory"}
    refused = subprocess.run([sys.executable, "-m", "raydeck.cli", "queue", "--teams",
                              str(teams)], cwd=cluster.workdir, env=spoofed,
                             capture_output=True, text=True, timeout=CLI_TIMEOUT_S)
    assert (f"--teams/--policy/--aging: only the queue's admins (mallory) may change them, not "
            f"user {_me()}") in _one_error_line(refused)
    admins.write_text(f"{_me()}\n")
    listing = _ok(cluster.cli("queue"))
    assert "policy priority" in listing
    for name in ("bad-team", "bad-prio", "too-large", "unplaceable"):
        assert name not in listing
    # Each command above connected to the cluster as a driver, and Ray lists each driver as a
    # job (issue 51: `raydeck jobs` showed them as SUCCEEDED jobs); raydeck jobs lists none,
    # even with --drivers.
    commands = {job.job_id for job in cluster.jobs.list_jobs()
                if job.type.value == "DRIVER"
                and (job.metadata or {}).get("raydeck_kind") == "command"}
    assert len(commands) >= 5, cluster.jobs.list_jobs()
    listed = json.loads(_ok(cluster.cli("jobs", "--drivers", "--json")))
    assert not commands & {row["job_id"] for row in listed}, listed


def _me() -> str:
    """This process's OS account, as raydeck's commands name it."""
    return pwd.getpwuid(os.getuid()).pw_name


def _admins(cluster: Cluster, names: str) -> Path:
    """The head's admins file (in its data dir, written by its account: this one), naming
    ``names``."""
    path = cluster.workdir.parent / "data" / "queue-admins"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(f"{names}\n")
    path.chmod(0o644)
    return path


def _teams(cluster: Cluster) -> Path:
    """The teams file, this user the queue's admin (on the head)."""
    _admins(cluster, _me())
    path = cluster.workdir.parent / "teams.yaml"
    path.write_text(yaml.safe_dump(TEAMS))
    return path


# A command's driver (here a probe command run as `raydeck` runs one) connects to the real
# head, then exits 3. An exit hook registered before Ray's own (so it runs after Ray's would)
# finds Ray still connected: the command left without Ray's teardown, where a finished command
# died with SIGSEGV in OpenCensus's harvester thread.
COMMAND_DRIVER_SCRIPT = """
import atexit, sys
import typer
from raydeck.cli import main as cli
from raydeck.cluster.connection import connect_existing

@cli.app.command("probe")
def probe(address: str) -> None:
    atexit.register(lambda: print("connected at exit", sys.modules["ray"].is_initialized(),
                                  flush=True))
    connect_existing(address)
    print("worked", flush=True)
    raise typer.Exit(3)

cli.main()
"""


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_a_command_driver_leaves_without_rays_teardown_and_keeps_its_exit_code(
        cluster: Cluster) -> None:
    result = subprocess.run([sys.executable, "-c", COMMAND_DRIVER_SCRIPT, "probe",
                             cluster.head.gcs_address], cwd=cluster.workdir, env=cluster.env,
                            capture_output=True, text=True, timeout=CLI_TIMEOUT_S)
    assert result.returncode == 3, result.stdout + result.stderr
    assert result.stdout.splitlines() == ["worked", "connected at exit True"], result.stderr


@pytest.fixture
def second_node(cluster: Cluster) -> Iterator[None]:
    """A second node (4 CPUs, 2 fake GPUs) for one test; the cluster is the head alone again
    after it."""
    cluster.head.add_worker_node(num_cpus=4, num_gpus=2)
    try:
        yield
    finally:
        cluster.head.remove_worker_nodes()


def _ray_instances() -> int:
    """Ray instances running on this machine: one GCS server each."""
    found = 0
    for proc in psutil.process_iter(["name"]):
        found += proc.info["name"] == "gcs_server"
    return found


@pytest.fixture
def another_ray(tmp_path: Path, raydeck_env: dict[str, str]) -> Iterator[None]:
    """A second Ray instance on this machine besides the queue's, for one test: the one that
    already runs, when there is one (the session's, under two xdist streams in the other
    stream's process), else a small head of its own (the session's cluster may not be up in
    this process: this module runs where nothing else needs it)."""
    if _ray_instances() >= 2:
        yield
        return
    root = tmp_path / "another-ray"
    head = RayHead(root, head_env(raydeck_env["RAYDECK_TRACKING_URI"], root / "data"),
                   num_cpus=1).start()
    try:
        yield
    finally:
        head.stop()


def _explained(cluster: Cluster, check: Callable[[], bool], timeout_s: float, what: str,
               *submission_ids: str, interval_s: float = SERVER_POLL_S) -> None:
    """wait_until, failing with the queue, the jobs and the named jobs' logs."""
    try:
        wait_until(check, timeout_s, what, interval_s=interval_s)
    except TimeoutError as exc:
        logs = []
        for submission_id in submission_ids:
            try:
                logs.append(f"{submission_id}:\n"
                            f"{cluster.jobs.get_job_logs(submission_id)[-3000:]}")
            except RuntimeError as missing:
                logs.append(f"{submission_id}: {missing}")
        raise AssertionError(f"{exc}\n{cluster.cli('queue').stdout}\n"
                             f"{cluster.cli('jobs').stdout}\n" + "\n".join(logs)) from None


def _placement_groups(cluster: Cluster) -> dict[str, Any]:
    """Every placement group of the cluster (creator job, scheduling attempts, bundles' nodes)
    and each alive node's CPUs, from Ray's state API."""
    script = (
        "import json, ray\n"
        "from ray.util.state import list_placement_groups\n"
        "ray.init(address='auto', logging_level='ERROR')\n"
        "groups = [{'job': g.creator_job_id, 'attempts': int(g.stats['scheduling_attempt']),\n"
        "           'nodes': sorted({b['node_id'] for b in g.bundles})}\n"
        "          for g in list_placement_groups(detail=True, limit=10000)]\n"
        "nodes = {n['NodeID']: n['Resources'].get('CPU', 0) for n in ray.nodes() if n['Alive']}\n"
        "print(json.dumps({'groups': groups, 'nodes': nodes}))\n")
    found: dict[str, Any] = json.loads(cluster.python(script).splitlines()[-1])
    return found


def _placed_as_the_queue_sees_it(cluster: Cluster, submission_id: str) -> bool:
    """``RayJobs.placed`` in a process connected to the queue's cluster as its actor is: its job
    server found from the cluster, no RAY_ADDRESS or RAY_API_SERVER_ADDRESS in its environment."""
    script = (
        "import os, ray\n"
        f"ray.init(address={cluster.head.gcs_address!r}, logging_level='ERROR')\n"
        "for name in ('RAY_ADDRESS', 'RAY_API_SERVER_ADDRESS'):\n"
        "    os.environ.pop(name, None)\n"
        "from raydeck.scheduling.queue.ray_jobs import RayJobs\n"
        f"print(RayJobs().placed({submission_id!r}))\n")
    return cluster.python(script).splitlines()[-1] == "True"


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_three_teams_digits_jobs_on_two_nodes_start_in_policy_order_whole_within_quotas(
        cluster: Cluster, second_node: None, mlflow_client: Any, another_ray: None) -> None:
    _ok(cluster.cli("queue", "--policy", "priority", "--teams", str(_teams(cluster))))
    # Two jobs hold real resources until cancelled, each on the only node it fits: b-hold
    # (6 CPU) on the head (8 CPU), then a-hold (3 CPU, 1 GPU) on the new node (4 CPU, 2 GPU).
    # That leaves 2 CPU on the head and 1 on the new node, and team a at its quota of 3 CPU.
    for name, preset, team in (("b-hold", "h6", "b"), ("a-hold", "h3", "a")):
        _ok(cluster.submit(name, preset, 900, team, hold=True))
        _explained(cluster, lambda job=name: job in cluster.events(), 120, f"{name} to hold",
                   f"raydeck-{name}")
    # The queue sees a started gang placed as soon as Ray placed it, though this machine runs
    # a second Ray (another_ray): it once asked Ray's state API for "the" local
    # cluster, failed, and held every next start back CLAIM_S (120 s).
    assert _placed_as_the_queue_sees_it(cluster, "raydeck-a-hold")
    epochs = 2
    # c-big (2 x 1.5 CPU, STRICT_PACK, priority 5) fits the 3 free CPUs but no node; a2 is
    # held by team a's quota; b2 fits the head now but waits behind c-big (no backfill).
    # c-big is a real digits job; a2 and b2 (1 CPU each) take their gang in Ray as a training
    # job's worker group would and end on their own: a 1-worker gang proves no more as a fit.
    cluster.digits("c-big", "t3", "c", 5, epochs)
    for name, team in (("a2", "a"), ("b2", "b")):
        _ok(cluster.submit(name, "c1", LIGHT_JOB_S, team, hold=True))
    listing = _ok(cluster.cli("queue"))
    positions = {job: _row(listing, f"raydeck-{job}").split()[1] for job in ("c-big", "a2", "b2")}
    assert positions == {"c-big": "1", "a2": "2", "b2": "3"}, listing
    assert "fits the free total, but no node placement holds it now" in _row(
        listing, "raydeck-c-big"), listing
    assert "team a uses 1 GPU, 3 CPU of its 3 CPU" in _row(listing, "raydeck-a2"), listing
    assert "behind raydeck-c-big" in _row(listing, "raydeck-b2"), listing

    cancelled_at = time.time()
    assert "cancelled raydeck-a-hold" in _ok(cluster.cli("cancel", "raydeck-a-hold"))
    jobs = ("c-big", "a2", "b2")
    _explained(cluster, lambda: all(_ended(cluster, f"raydeck-{job}") for job in jobs), 600,
               "the three teams' jobs to end", *(f"raydeck-{job}" for job in jobs))
    _ok(cluster.cli("cancel", "raydeck-b-hold"))
    wait_until(lambda: _ended(cluster, "raydeck-b-hold"), 120, "b-hold to end",
               interval_s=SERVER_POLL_S)

    infos = {job: _job_info(cluster, f"raydeck-{job}") for job in jobs}
    assert all(info.status.value == "SUCCEEDED" for info in infos.values()), infos
    start = {job: info.start_time / 1000 for job, info in infos.items()}
    # Policy order: nothing started while a-hold held its node, b2 not even though it fit the
    # head all along; c-big, first in the queue, was started first.
    assert min(start.values()) >= cancelled_at, (start, cancelled_at)
    assert start["c-big"] <= start["a2"] <= start["b2"], start
    # Each job started once, whole: every placement group its Ray job created was placed on
    # Ray's first scheduling attempt (a gang started half-placed waits, and Ray retries it),
    # and c-big's workers share the one node that had room for both.
    placement = _placement_groups(cluster)
    for job, info in infos.items():
        groups = [g for g in placement["groups"] if g["job"] == info.job_id]
        assert groups and all(g["attempts"] == 1 for g in groups), (job, groups)
        if job == "c-big":
            new_node = next(n for n, cpus in placement["nodes"].items() if cpus == 4)
            assert [g["nodes"] for g in groups] == [[new_node]], (groups, placement["nodes"])
    run = _run_of(mlflow_client, "c-big")
    assert run.info.status == "FINISHED", run.info
    history = mlflow_client.get_metric_history(run.info.run_id, "val_accuracy")
    assert sorted(point.step for point in history) == list(range(epochs)), history
    _unlisted(cluster, *(f"raydeck-{job}" for job in (*jobs, "a-hold", "b-hold")))
    print("\nqueue on two nodes: after a-hold was cancelled, c-big, a2 and b2 started in "
          + " / ".join(f"{start[job] - cancelled_at:.1f}" for job in jobs) + " s")


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_a_killed_queue_actor_loses_and_repeats_nothing(cluster: Cluster) -> None:
    _ok(cluster.cli("queue", "--policy", "fifo"))
    # The long ones hold the 4 GPUs until the checks are done: w1 and w2 wait behind them.
    release = cluster.release_file("killed-actor")
    _ok(cluster.submit("long", "q2", 0, "b", until=release))
    _ok(cluster.submit("long2", "q2", 0, "b", until=release))
    _ok(cluster.submit("w1", "q2", 3, "b"))
    _ok(cluster.submit("w2", "q1", 3, "c"))
    wait_until(lambda: {"long", "long2"} <= set(cluster.events()), 120, "the long jobs to start")
    before = _ok(cluster.cli("queue"))
    assert "queued" in _row(before, "raydeck-w1") and "queued" in _row(before, "raydeck-w2")
    cluster.python("import ray; ray.init(address='auto', logging_level='ERROR'); "
                   "ray.kill(ray.get_actor('raydeck-queue', namespace='raydeck'), "
                   "no_restart=True)")
    # `raydeck queue` starts the queue again; it reads every job back from its database.
    listing = _ok(cluster.cli("queue"))
    assert "raydeck-w1" in listing and "raydeck-w2" in listing, listing
    release.touch()
    wait_until(lambda: all(len(cluster.events().get(job, {}).get("end", [])) == 1
                           for job in ("long", "long2", "w1", "w2")), 240, "every job to end")
    events: dict[str, Any] = cluster.events()
    for job in ("long", "long2", "w1", "w2"):
        assert len(events[job]["start"]) == 1, (job, events[job])


def _job_info(cluster: Cluster, submission_id: str) -> Any:
    try:
        return cluster.jobs.get_job_info(submission_id)
    except RuntimeError:
        return None  # not submitted yet


def _ended(cluster: Cluster, submission_id: str) -> bool:
    info = _job_info(cluster, submission_id)
    return info is not None and info.status.value in ("SUCCEEDED", "FAILED", "STOPPED")


def _unlisted(cluster: Cluster, *submission_ids: str) -> None:
    """Wait until ``raydeck queue`` lists none of these ended jobs: the queue drops a job once
    its supervisor has seen it end, a moment after its process (or Ray) says it has."""
    listing = ""

    def gone() -> bool:
        nonlocal listing
        listing = _ok(cluster.cli("queue"))
        return not any(job in listing for job in submission_ids)

    try:
        wait_until(gone, 60, "the queue to drop the ended jobs", interval_s=CLI_POLL_S)
    except TimeoutError:
        raise AssertionError(listing) from None


def _run_of(client: Any, run_key: str) -> Any:
    experiment = client.get_experiment_by_name("raydeck")
    if experiment is None:
        return None  # no job has created it yet
    runs = client.search_runs([experiment.experiment_id],
                              filter_string=f"tags.`raydeck.run_key` = '{run_key}'")
    return runs[0] if runs else None


def _latest_epoch(client: Any, run_key: str) -> int:
    run = _run_of(client, run_key)
    return int(run.data.tags.get("raydeck.checkpoint.latest_epoch", -1)) if run else -1


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_low_priority_jobs_are_preempted_at_a_checkpoint_and_resume_in_their_runs(
        cluster: Cluster, mlflow_client: Any) -> None:
    """A high-priority job that needs the whole cluster preempts the two low-priority jobs on
    it: the PyTorch digits job (``report_epoch`` says stop) and the Lightning one (raydeck's
    callback stops the trainer)."""
    _ok(cluster.cli("queue", "--policy", "priority"))
    # Each waits at a gate after its first checkpoint, so both are running, with a checkpoint
    # to resume from, when the high job comes (a Lightning worker group takes up to two minutes
    # to start here, a PyTorch one seconds); the gate opens once the queue has decided, and
    # each stops at its next checkpoint, whatever the machine's speed.
    epochs = {"pre-low": 4, "pre-lit": 3}
    gate = cluster.release_file("preemption")
    cluster.digits("pre-low", "d3", "c", 0, epochs["pre-low"], gate=gate)
    cluster.digits("pre-lit", "d3", "c", 0, epochs["pre-lit"], job="digits_lightning.py",
                   gate=gate)
    _explained(cluster, lambda: all(Path(f"{gate}.{kind}.0").exists()
                                    for kind in ("torch", "lightning")), 300,
               "both low-priority jobs to wait at the gate after their first checkpoint",
               *(f"raydeck-{job}" for job in epochs))
    cluster.digits("pre-high", "d8", "c", 5, 3)
    asked_at = time.time()
    committed_before = {job: _latest_epoch(mlflow_client, job) for job in epochs}
    _explained(cluster, lambda: _ok(cluster.cli("queue", columns=WIDE_COLUMNS)).count(
        "preempted for raydeck-pre-high") == 2, 120,
        "the queue to preempt both low-priority jobs", *(f"raydeck-{job}" for job in epochs),
        interval_s=CLI_POLL_S)
    gate.touch()
    _explained(cluster, lambda: all(_ended(cluster, f"raydeck-{job}") for job in epochs), 180,
               "the low-priority jobs to stop at their next checkpoint",
               *(f"raydeck-{job}" for job in epochs))
    _explained(cluster, lambda: _ended(cluster, "raydeck-pre-high"), 300,
               "the high-priority job to end", "raydeck-pre-high")
    _explained(cluster, lambda: all(_ended(cluster, f"raydeck-{job}-r1") for job in epochs),
               400, "the low-priority jobs to resume and end",
               *(f"raydeck-{job}-r1" for job in epochs))

    high = _job_info(cluster, "raydeck-pre-high")
    assert high.status.value == "SUCCEEDED", high
    timings = []
    for job, job_epochs in epochs.items():
        stopped, resumed = (_job_info(cluster, f"raydeck-{job}{suffix}")
                            for suffix in ("", "-r1"))
        assert stopped.status.value == "FAILED" and "75" in (stopped.message or ""), stopped
        assert resumed.status.value == "SUCCEEDED", resumed
        # Never beside the high job: it started after both stopped, they resumed after it.
        assert stopped.end_time <= high.start_time and high.end_time <= resumed.start_time

        run = _run_of(mlflow_client, job)
        tags = run.data.tags
        assert run.info.status == "FINISHED" and tags["raydeck.preemptions"] == "1", tags
        stopped_epoch = int(tags["raydeck.preemption.1"].removeprefix("stopped after epoch "))
        # It stopped at a checkpoint after the high job came, well before its last epoch.
        assert committed_before[job] <= stopped_epoch < job_epochs - 1, (job, stopped_epoch)
        assert tags["raydeck.checkpoint.resumed_from_epoch"] == str(stopped_epoch)
        history = mlflow_client.get_metric_history(run.info.run_id, "val_accuracy")
        assert len(history) == job_epochs, (job, "each epoch once", len(history))
        if job == "pre-low":  # the PyTorch job logs each epoch at step=epoch
            assert sorted(point.step for point in history) == list(range(job_epochs))
        else:  # Lightning logs at its global step: one point per epoch, each step once
            assert len({point.step for point in history}) == job_epochs
        timings.append(f"{job} stopped {stopped.end_time / 1000 - asked_at:.1f} s after the "
                       f"high job was queued (after epoch {stopped_epoch} of {job_epochs}), "
                       f"resumed {(resumed.start_time - high.end_time) / 1000:.1f} s after it "
                       "ended")
    high_run = _run_of(mlflow_client, "pre-high")
    assert high_run.info.status == "FINISHED"
    _unlisted(cluster, *(f"raydeck-{job}" for job in epochs))

    # The same job again (job file, preset and arguments; another run name), no --estimate:
    # the queue expects what the earlier run took in MLflow.
    from raydeck.cli._console import format_duration

    took = (high_run.info.end_time - high_run.info.start_time) / 1000
    assert high_run.data.tags["raydeck.job_digest"] != _run_of(
        mlflow_client, "pre-low").data.tags["raydeck.job_digest"]
    # Queued behind a job the queue counts as holding the whole cluster (never a victim: it
    # has no checkpoint), so it is cancelled before it could start a driver.
    release = cluster.release_file("pre-again")
    _ok(cluster.submit("pre-hold", "d8", 0, "c", until=release))
    _explained(cluster, lambda: "pre-hold" in cluster.events(), 120, "pre-hold to start",
               "raydeck-pre-hold")
    again = cluster.digits("pre-again", "d8", "c", 5, 3)
    _ok(cluster.cli("cancel", "raydeck-pre-again"))
    assert f"expected {format_duration(took)};" in again, (took, again)
    release.touch()
    wait_until(lambda: _ended(cluster, "raydeck-pre-hold"), 120, "pre-hold to end",
               interval_s=SERVER_POLL_S)
    assert _job_info(cluster, "raydeck-pre-again") is None  # the job server never had it
    _unlisted(cluster, "raydeck-pre-hold", "raydeck-pre-again")
    last_stop = max(_job_info(cluster, f"raydeck-{job}").end_time for job in epochs)
    print("\npreemption: " + "; ".join(timings) + f"; high started "
          f"{(high.start_time - last_stop) / 1000:.1f} s after the last one stopped")


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_the_queue_dashboard_has_data_for_every_panel(cluster: Cluster) -> None:
    """After the jobs above (three teams, a preemption, a prediction): every panel of the Queue
    dashboard has data in a real Prometheus scraping this cluster."""
    from raydeck.observability.dashboard_check import check
    from raydeck.observability.dashboards import load_dashboards
    from raydeck.observability.metrics import METRICS

    dashboard = [d for d in load_dashboards(DASHBOARDS_DIR) if d.uid == "raydeck-queue"]
    missing: list[str] = []

    def every_panel_has_data() -> bool:
        results = check(dashboard, cluster.prometheus.client, range_s=1800,
                        rate_interval_s=600)
        assert not [r.error for r in results if r.error]
        missing[:] = [f"{r.panel}: {r.expr}" for r in results
                      if not r.series and not r.empty_ok]
        return not missing

    try:
        wait_until(every_panel_has_data, 120, "every Queue panel to have data", interval_s=2)
    except TimeoutError:
        raise AssertionError(f"Queue panels without data: {missing}") from None
    queue = [m for m in METRICS if m.name.startswith("raydeck_queue_")]
    assert not cluster.prometheus.unexported(queue, 1800)


# Issue 28: a short job preempts a long one by attained service (las), not by priority.
LAS_EPOCHS = 20


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_under_las_a_short_job_preempts_a_long_one_past_its_threshold_and_finishes_first(
        cluster: Cluster, mlflow_client: Any) -> None:
    """Same priority, same team: only attained service tells them apart. The long digits job
    (8 CPUs) passes the first threshold (16 CPU-seconds) within 2 s of running; the short job
    queued behind it stays below it, so at the long job's next checkpoint after its first it
    is stopped, the short job runs and finishes, and the long job resumes in its MLflow run,
    each epoch logged once."""
    shown = _ok(cluster.cli("queue", "--policy", "las", "--thresholds", "16s,1h"))
    assert "policy las" in shown and "thresholds 16s,1h GPU-time" in shown, shown
    cluster.digits("las-long", "d8", "c", 0, LAS_EPOCHS)
    _ok(cluster.submit("las-short", "c1", 1, "c"))  # 1 CPU for 1 s: stays under 16 CPU-s
    queued_at = time.time()
    _explained(cluster, lambda: _ended(cluster, "raydeck-las-long"), 240,
               "the long job to stop at a checkpoint", "raydeck-las-long", "raydeck-las-short")
    stopped = _job_info(cluster, "raydeck-las-long")
    assert stopped.status.value == "FAILED" and "75" in (stopped.message or ""), stopped
    _explained(cluster, lambda: _ended(cluster, "raydeck-las-long-r1"), 300,
               "the long job to resume and end", "raydeck-las-long-r1", "raydeck-las-short")

    resumed, short = (_job_info(cluster, f"raydeck-{job}") for job in ("las-long-r1",
                                                                        "las-short"))
    assert resumed.status.value == "SUCCEEDED" and short.status.value == "SUCCEEDED"
    # The short job ran in the room the long one freed and ended before it resumed.
    assert stopped.end_time <= short.start_time and short.end_time <= resumed.start_time
    run = _run_of(mlflow_client, "las-long")
    tags = run.data.tags
    assert run.info.status == "FINISHED" and tags["raydeck.preemptions"] == "1", tags
    stopped_epoch = int(tags["raydeck.preemption.1"].removeprefix("stopped after epoch "))
    # Told at a checkpoint after its first (a job without one is never a victim).
    assert 1 <= stopped_epoch < LAS_EPOCHS - 1, stopped_epoch
    assert tags["raydeck.checkpoint.resumed_from_epoch"] == str(stopped_epoch)
    history = mlflow_client.get_metric_history(run.info.run_id, "val_accuracy")
    assert sorted(point.step for point in history) == list(range(LAS_EPOCHS))
    steps = sorted(history, key=lambda point: point.step)
    epoch_s = (steps[stopped_epoch].timestamp - steps[0].timestamp) / 1000 / stopped_epoch
    print(f"\nlas preemption: the long job stopped {stopped.end_time / 1000 - queued_at:.1f} s "
          f"after the short one was queued (after epoch {stopped_epoch} of {LAS_EPOCHS}, "
          f"{epoch_s:.2f} s an epoch); the short one started "
          f"{(short.start_time - stopped.end_time) / 1000:.1f} s after the stop; the long one "
          f"resumed {(resumed.start_time - short.end_time) / 1000:.1f} s after it ended "
          f"({(resumed.start_time - stopped.end_time) / 1000:.1f} s after its stop)")


# Each attempt that is to be resized waits at a gate after its first checkpoint until the
# queue has decided its resize, then stops at its next one: the first (one worker) trains
# epochs 0-1, the grown one (two) 2-3, the shrunk one (one, its gate open) the rest. Ungated,
# the first attempt trained 12 of 16 epochs before the grow stopped it in a CI run where the
# suite's other stream had the cores, and the grown one once trained to the end while the
# urgent job's `raydeck submit` ran, never shrinking; 32 epochs were needed to leave room.
ELASTIC_EPOCHS = 6
WORLD_SIZE_METRIC = "raydeck/world_size"


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_an_elastic_job_starts_small_grows_when_a_holder_ends_and_shrinks_for_a_higher_one(
        cluster: Cluster, mlflow_client: Any) -> None:
    """Issue 29: an elastic digits job (one or two 3-CPU workers) queued beside a holder of 5
    of the 8 CPUs starts at one worker; when the holder ends it is asked to grow and restarts
    at two from its next checkpoint (``-r1``); a higher-priority job that needs 4 CPUs then
    shrinks it back to one (``-r2``) instead of waiting or preempting it. The job finishes with
    every epoch once in one MLflow run, trained at world sizes 1, 2, 1."""
    _ok(cluster.cli("queue", "--policy", "priority", "--min-run", "1s"))
    holder, urgent, gate = (cluster.release_file(name)
                            for name in ("el-holder", "el-urgent", "el-gate"))
    small_gate, grown_gate = (Path(f"{gate}.w{size}") for size in (1, 2))
    try:
        _ok(cluster.submit("el-holder", "h5", 0, "c", until=holder))
        _explained(cluster, lambda: "el-holder" in cluster.events(), 120,
                   "the holder to start", "raydeck-el-holder")
        cluster.digits("el", "e3", "c", 0, ELASTIC_EPOCHS, gate=gate,
                       pause_at_world_sizes=(1, 2))
        # Started at one worker (the room beside the holder), shown while its workers start.
        _explained(cluster, lambda: re.search(r"raydeck-el\s.*workers 1 of 1-2 .*running",
                                              _ok(cluster.cli("queue"))) is not None, 120,
                   "the elastic job to start at one worker", "raydeck-el",
                   interval_s=CLI_POLL_S)
        # It may be resized once it has a checkpoint to restart from: it waits at its gate
        # after the first.
        _explained(cluster, lambda: Path(f"{small_gate}.torch.0").exists(), 240,
                   "the elastic job to commit a checkpoint", "raydeck-el")
        holder.touch()
        released_at = time.time()
        _explained(cluster, lambda: re.search(
            r"raydeck-el\s.*grows to 2 workers", _ok(cluster.cli("queue", columns=WIDE_COLUMNS)))
            is not None, 180, "the queue to ask the elastic job to grow", "raydeck-el",
            interval_s=CLI_POLL_S)
        small_gate.touch()  # it stops at its next checkpoint; the shrunk attempt never waits
        _explained(cluster, lambda: _job_info(cluster, "raydeck-el-r1") is not None, 180,
                   "the elastic job to restart at two workers", "raydeck-el")
        _ok(cluster.submit("el-urgent", "u4", 0, "c", priority=5, until=urgent))
        urgent_at = time.time()
        # The grown attempt, paused after its first checkpoint, goes on once the queue has
        # asked it to shrink (at its next checkpoint: it trains two epochs at two workers).
        _explained(cluster, lambda: re.search(
            r"raydeck-el\s.*shrinks to 1 workers for raydeck-el-urgent",
            _ok(cluster.cli("queue", columns=WIDE_COLUMNS))) is not None, 180,
            "the queue to ask the elastic job to shrink", "raydeck-el-r1",
            interval_s=CLI_POLL_S)
        grown_gate.touch()
        _explained(cluster, lambda: _ended(cluster, "raydeck-el-r2"), 400,
                   "the elastic job to shrink for the urgent one and end",
                   "raydeck-el-r1", "raydeck-el-r2", "raydeck-el-urgent")
        assert "el-urgent" in cluster.events()  # it started beside the shrunk job
    finally:
        for release in (holder, urgent, small_gate, grown_gate):
            release.touch()
        _ok(cluster.cli("queue", "--min-run", "10m"))

    grown, shrunk, last, high = (_job_info(cluster, f"raydeck-{job}") for job in (
        "el", "el-r1", "el-r2", "el-urgent"))
    for stopped in (grown, shrunk):
        assert stopped.status.value == "FAILED" and "75" in (stopped.message or ""), stopped
    assert last.status.value == "SUCCEEDED", last
    # The urgent job started once the job shrank, beside it, not after it ended.
    assert shrunk.end_time <= high.start_time <= last.end_time
    run = _run_of(mlflow_client, "el")
    tags = run.data.tags
    assert run.info.status == "FINISHED" and tags["raydeck.preemptions"] == "2", tags
    history = mlflow_client.get_metric_history(run.info.run_id, "val_accuracy")
    assert sorted(point.step for point in history) == list(range(ELASTIC_EPOCHS))
    sizes = [int(point.value) for point in sorted(mlflow_client.get_metric_history(
        run.info.run_id, WORLD_SIZE_METRIC), key=lambda point: point.step)]
    assert [size for index, size in enumerate(sizes)
            if index == 0 or size != sizes[index - 1]] == [1, 2, 1], sizes
    _explained(cluster, lambda: _ended(cluster, "raydeck-el-urgent"), 120,
               "the urgent job to end", "raydeck-el-urgent")
    _unlisted(cluster, "raydeck-el", "raydeck-el-urgent", "raydeck-el-holder")
    print(f"\nelastic resizes: grow (holder released; the gate opened once the queue showed "
          f"the grow) -> stopped {grown.end_time / 1000 - released_at:.1f} s after the "
          f"release -> relaunched at 2 workers "
          f"{(shrunk.start_time - grown.end_time) / 1000:.1f} s after the stop; shrink (urgent "
          f"job queued) -> stopped {shrunk.end_time / 1000 - urgent_at:.1f} s later -> "
          f"relaunched at 1 worker {(last.start_time - shrunk.end_time) / 1000:.1f} s after "
          f"the stop; world sizes per epoch {sizes}")


# A terminal wide enough for a Serve row of `raydeck queue` on one line.
WIDE_COLUMNS = 400


def _predict(url: str) -> float:
    """The summer model's answer for one row [1, 2]."""
    import requests

    answer = requests.post(url, json={"inputs": [[1.0, 2.0]]}, timeout=30)
    answer.raise_for_status()
    return float(answer.json()["predictions"][0])


def _serve_details(cluster: Cluster) -> dict[str, Any]:
    """Serve's own view (``GET /api/serve/applications/`` on the head's dashboard)."""
    import requests

    from raydeck.jobs.submission import JobServer

    server = JobServer.from_env(env=cluster.head.client_env)
    answer = requests.get(f"{server.address}/api/serve/applications/",
                          headers=server.headers(), timeout=30)
    answer.raise_for_status()
    return dict(answer.json())


def _served(cluster: Cluster, app: str) -> tuple[int, set[str]]:
    """``raydeck serve``'s deployment's max_replicas and the ids of its replicas that are not
    stopping (0, none: not deployed yet)."""
    deployment = _serve_details(cluster)["applications"].get(app, {}).get(
        "deployments", {}).get("ModelServer")
    if deployment is None:
        return 0, set()
    return (deployment["deployment_config"]["autoscaling_config"]["max_replicas"],
            {r["replica_id"] for r in deployment["replicas"] if r["state"] != "STOPPING"})


# The queue's Serve client, whose read is followed by a user's deploy of the same application
# with its own downscale_delay_s (7 s), before the client writes max_replicas 1.
_RACING_DEPLOY = """
import ray
from raydeck.scheduling.queue.serve_apps import RayServe, ServeConfigChanged
from raydeck.serving.deploy_config import deployed_config, with_application

ray.init()


class Racing(RayServe):
    armed = False

    def _request(self, method, body=None):
        answer = super()._request(method, body)
        if method == "GET" and Racing.armed:
            Racing.armed = False
            config = deployed_config(answer, APP)
            for entry in config["deployments"]:
                entry["autoscaling_config"] = {**entry["autoscaling_config"],
                                               "downscale_delay_s": 7.0}
            super()._request("PUT", with_application(answer, config))
        return answer


serve = Racing()
(app,) = [a for a in serve.applications() if a.app == APP]
Racing.armed = True
try:
    serve.limit(app, 1)
    print("written")
except ServeConfigChanged:
    print("kept")
"""


def _autoscaling(cluster: Cluster, app: str) -> dict[str, Any]:
    """The autoscaling config Serve has for ``raydeck serve``'s deployment of ``app``."""
    deployment = _serve_details(cluster)["applications"][app]["deployments"]["ModelServer"]
    return dict(deployment["deployment_config"]["autoscaling_config"])


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_served_model_gives_back_replicas_for_a_waiting_job_and_gets_them_back(
        cluster: Cluster, tmp_path: Path, mlflow_client: Any) -> None:
    """Issue 29, item 4: `raydeck serve --autoscale 1:3` (three 2-CPU replicas) is counted by
    the queue; a job needing 4 of the 8 CPUs lowers its max_replicas to 2 through Serve's own
    config API (no preemption, no replica restarted), starts once Serve stopped the third,
    and the ceiling goes back to 3 when it ended; the model answers throughout."""
    from tests.fixtures.processes import free_port
    from tests.fixtures.summer_model import SUMMER_CODE, register_summer

    started_at = time.monotonic()
    code = tmp_path / "summer_model.py"
    code.write_text(SUMMER_CODE)
    app = f"summer-{uuid.uuid4().hex[:6]}"
    assert register_summer(mlflow_client.tracking_uri, app, code, tmp_path / "down") == "1"
    port = free_port()
    _ok(cluster.cli("queue", "--policy", "fifo"))
    _ok(cluster.cli("serve", f"models:/{app}/1", "--preset", "v2", "--autoscale", "1:3",
                    "--port", str(port), "--detach"))
    url = f"http://127.0.0.1:{port}/invocations"
    try:
        _, replicas = _served(cluster, app)
        assert len(replicas) == 3, replicas
        listing = _ok(cluster.cli("queue", columns=WIDE_COLUMNS))
        assert re.search(rf"serve {app} .*replicas 3 of 1-3", listing), listing
        release = cluster.release_file("sv-job")
        _ok(cluster.submit("sv-job", "u4", 0, "c", until=release))
        _explained(cluster, lambda: _served(cluster, app)[0] == 2, 60,
                   "the queue to lower the served model's max_replicas", "raydeck-sv-job")
        _explained(cluster, lambda: "sv-job" in cluster.events(), 120,
                   "the job to start in the room the replica freed", "raydeck-sv-job")
        listing = _ok(cluster.cli("queue", columns=WIDE_COLUMNS))
        assert re.search(rf"serve {app} .*replicas 2 of 1-3 -> 2", listing), listing
        # Lowered once, in place: two of the first three replicas serve, none started since.
        assert _served(cluster, app)[1] <= replicas
        assert _predict(url) == 3.0
        release.touch()
        _explained(cluster, lambda: bool(cluster.events()["sv-job"]["end"]), 60,
                   "the job to end", "raydeck-sv-job")
        _explained(cluster, lambda: _served(cluster, app)[0] == 3, 60,
                   "the queue to raise the served model's max_replicas back", "raydeck-sv-job")
        # Raised in place: the two replicas kept are still there, beside the one it started.
        assert len(_served(cluster, app)[1] & replicas) == 2
        assert _job_info(cluster, "raydeck-sv-job").status.value == "SUCCEEDED"
        assert _predict(url) == 3.0
        # Issue 52: a `serve deploy` landing between the queue's read of Serve's config and its
        # write is never reverted by that write: the queue's own RayServe, in a driver on the
        # cluster, with a user's deploy made (through the same REST API) right after its read.
        assert cluster.python(_RACING_DEPLOY.replace("APP", repr(app))).split()[-1] == "kept"
        _explained(cluster, lambda: _autoscaling(cluster, app)["downscale_delay_s"] == 7.0, 60,
                   "the user's deploy to apply", "raydeck-sv-job")
        assert _autoscaling(cluster, app)["max_replicas"] == 3  # not the queue's 1
    finally:
        cluster.release_file("sv-job").touch()
        cluster.cli("serve", "--stop", "--name", app)
        cluster.python("import ray; from ray import serve; ray.init(); serve.shutdown()")
    _unlisted(cluster, "raydeck-sv-job")
    print(f"\nserve shares the cluster: {time.monotonic() - started_at:.1f} s")


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_a_head_restart_loses_no_job_and_reruns_what_died_with_it(cluster: Cluster) -> None:
    """Last in the module: it restarts the head (the queue's database is in the head's data
    dir; Ray's job table and the queue actor are not kept by a restarted head)."""
    _ok(cluster.cli("queue", "--policy", "fifo"))
    # Held until they ran again: they are running when the head goes down, die with it and
    # run again; hr-wait waits behind them.
    release = cluster.release_file("head-restart")
    _ok(cluster.submit("hr-run1", "q2", 0, "b", until=release))
    _ok(cluster.submit("hr-run2", "q2", 0, "b", until=release))
    # Ends (its MLflow run FINISHED) but the head goes down before its exit is seen: its run
    # is its witness, so it runs exactly once.
    _ok(cluster.submit("hr-done", "c1", 0, "c", unseen_end=True))
    _ok(cluster.submit("hr-wait", "q1", 3, "c"))
    wait_until(lambda: {"hr-run1", "hr-run2"} <= set(cluster.events())
               and cluster.events().get("hr-done", {}).get("end"), 120,
               "the two long jobs to start and hr-done to end")
    cluster.head.stop()
    cluster.head.start()
    assert "hr-wait" in _ok(cluster.cli("queue"))  # a new queue actor, from its database
    try:
        wait_until(lambda: all(len(cluster.events()[job]["start"]) == 2
                               for job in ("hr-run1", "hr-run2")), 300,
                   "the two long jobs to start again")
        release.touch()
        wait_until(lambda: all(len(cluster.events().get(job, {}).get("end", [])) == 1
                               for job in ("hr-run1", "hr-run2", "hr-wait")), 300,
                   "every job to end once")
    except TimeoutError:
        logs = "\n".join(line for path in cluster.head.temp_dir.rglob("*.err")
                         for line in path.read_text(errors="replace").splitlines()
                         if "scheduling" in line or "queue" in line)
        raise AssertionError(f"{cluster.events()}\n{cluster.cli('queue').stdout}\n"
                             f"{cluster.cli('jobs').stdout}\n{logs[-5000:]}") from None
    events = cluster.events()
    # The running jobs died with the head and ran again (same run id, so a real job resumes
    # from its checkpoint); the queued one started once, and so did the one that ended unseen.
    assert len(events["hr-wait"]["start"]) == 1, events["hr-wait"]
    assert len(events["hr-done"]["start"]) == 1 == len(events["hr-done"]["end"]), events
    done = Store(f"sqlite:///{cluster.workdir.parent / 'data' / 'queue.db'}").get(
        "raydeck-hr-done")
    assert done is not None and done.state == "succeeded", done and done.reason
    for job in ("hr-run1", "hr-run2"):
        assert len(events[job]["start"]) == 2 and len(events[job]["end"]) == 1, events[job]
    run_ids = {json.loads(line)["run_id"] for line in cluster.log.read_text().splitlines()
               if json.loads(line)["run"] == "hr-run1"}
    assert run_ids == {"hr-run1"}, run_ids
    # A job's end event is written just before its process exits.
    _unlisted(cluster, "raydeck-hr-run1", "raydeck-hr-run2", "raydeck-hr-wait")
