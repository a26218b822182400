"""The job queue on a real Ray cluster: real jobs through Ray's job server, queued with
`raydeck submit --queue`, ordered by the policy, held by team quotas, surviving its actor.

The module starts one head (`ray start --head`, token auth) that Ray believes has 4 GPUs and 8
CPUs; the jobs (tests/fixtures/queue_job.py) hold their preset's resources by running, and
write when they started and ended to a shared file, which is what the tests read. The
preemption test runs the real digits job (jobs/digits_torch.py) on CPU presets and reads its
MLflow runs.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.fixtures.processes import wait_until
from tests.fixtures.prometheus import DASHBOARDS_DIR, PrometheusServer, for_ray_session
from tests.fixtures.ray_head import RayHead, head_env

FIXTURES = Path(__file__).resolve().parent / "fixtures"
PRESETS = {
    "q1": {"num_workers": 1, "cpus_per_worker": 1, "gpus_per_worker": 1},
    "q2": {"num_workers": 2, "cpus_per_worker": 1, "gpus_per_worker": 1},
    "q8": {"num_workers": 8, "cpus_per_worker": 1, "gpus_per_worker": 1},
    # Two of these never fit the 8 CPUs together.
    "d5": {"num_workers": 1, "cpus_per_worker": 5},
    # A node each: fits the cluster's totals, but this cluster has one node.
    "s2": {"num_workers": 2, "cpus_per_worker": 1, "placement_strategy": "STRICT_SPREAD"},
}
REPO = Path(__file__).resolve().parents[1]
TEAMS = {"a": {"gpus": 2}, "b": {"weight": 2}, "c": {}}
CLI_TIMEOUT_S = 120


@dataclass(frozen=True)
class Cluster:
    head: RayHead
    workdir: Path
    env: dict[str, str]
    log: Path
    prometheus: PrometheusServer

    def cli(self, *args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, "-m", "raydeck.cli", *args], cwd=self.workdir,
                              env=self.env, capture_output=True, text=True,
                              timeout=CLI_TIMEOUT_S)

    def submit(self, name: str, preset: str, seconds: float, team: str, priority: int = 0,
               ) -> subprocess.CompletedProcess[str]:
        return self.cli("submit", "queue_job.py", "--queue", "--no-check", "--runtime-env",
                        "runtime.yaml", "--preset", preset, "--run-name", name, "--run-id",
                        name, "--team", team, "--priority", str(priority), "--",
                        "--seconds", str(seconds), "--log", str(self.log))

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
    shutil.copy(FIXTURES / "queue_job.py", workdir / "queue_job.py")
    shutil.copy(REPO / "jobs" / "digits_torch.py", workdir / "digits_torch.py")
    (workdir / "runtime.yaml").write_text("working_dir: .\n")
    (root / "presets.yaml").write_text(yaml.safe_dump(PRESETS))
    env = head_env(raydeck_env["RAYDECK_TRACKING_URI"], root / "data",
                   RAYDECK_PRESETS_FILE=str(root / "presets.yaml"))
    head = RayHead(root / "head", env, num_cpus=8, num_gpus=4).start()
    prometheus = None
    try:
        # Scraping from the start: the Queue dashboard's rates need the jobs' whole history.
        prometheus = for_ray_session(root / "prometheus", head.temp_dir / "session_latest")
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
    listing = _ok(cluster.cli("queue"))
    assert "policy priority" in listing
    for name in ("bad-team", "bad-prio", "too-large", "unplaceable"):
        assert name not in listing


def _teams(cluster: Cluster) -> Path:
    path = cluster.workdir.parent / "teams.yaml"
    path.write_text(yaml.safe_dump(TEAMS))
    return path


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_three_teams_start_in_priority_order_within_quotas_and_each_job_once(
        cluster: Cluster) -> None:
    _ok(cluster.cli("queue", "--policy", "priority", "--teams", str(_teams(cluster))))
    # a1 and b1 fill the 4 GPUs until they are cancelled (so how long the submissions take
    # does not matter); a2 waits on team a's quota (2 GPUs); c2 (priority 5) goes before the
    # older a2 and c1 once a1 is gone; c1 waits until one of them ends (b1 still holds 2).
    _ok(cluster.submit("a1", "q2", 600, "a"))
    _ok(cluster.submit("b1", "q2", 600, "b"))
    wait_until(lambda: {"a1", "b1"} <= set(cluster.events()), 120, "a1 and b1 to start")
    _ok(cluster.submit("a2", "q1", 5, "a"))
    _ok(cluster.submit("c1", "q1", 3, "c"))
    _ok(cluster.submit("c2", "q1", 5, "c", priority=5))

    listing = _ok(cluster.cli("queue"))
    assert "team a uses 2 GPU, 2 CPU of its 2 GPU" in _row(listing, "raydeck-a2"), listing
    positions = {job: _row(listing, f"raydeck-{job}").split()[1]
                 for job in ("c2", "a2", "c1")}
    assert positions == {"c2": "1", "a2": "2", "c1": "3"}, listing

    cancelled_at = time.time()
    assert "cancelled raydeck-a1" in _ok(cluster.cli("cancel", "raydeck-a1"))
    wait_until(lambda: all(len(cluster.events().get(job, {}).get("end", [])) == 1
                           for job in ("a2", "c1", "c2")), 240, "a2, c1 and c2 to end")
    _ok(cluster.cli("cancel", "raydeck-b1"))
    events = cluster.events()
    start = {job: times["start"][0] for job, times in events.items()}
    end = {job: times["end"][0] for job, times in events.items() if times["end"]}
    assert all(len(times["start"]) == 1 for times in events.values()), events
    assert start["a2"] >= cancelled_at, "team a's quota of 2 GPUs was exceeded"
    assert start["c2"] >= cancelled_at
    assert start["c1"] >= min(end["c2"], end["a2"]), "c1 started before a GPU was free"
    print(f"\nqueue: after a1 was cancelled, c2 and a2 started in "
          f"{start['c2'] - cancelled_at:.1f} / {start['a2'] - cancelled_at:.1f} s; c1 "
          f"{start['c1'] - min(end['c2'], end['a2']):.1f} s after a GPU was free")
    final = _ok(cluster.cli("jobs"))
    for job in ("a2", "c1", "c2"):
        assert "SUCCEEDED" in _row(final, f"raydeck-{job}")
    after = _ok(cluster.cli("queue"))
    assert "raydeck-a1" not in after and "raydeck-b1" not in after, after


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_a_killed_queue_actor_loses_and_repeats_nothing(cluster: Cluster) -> None:
    _ok(cluster.cli("queue", "--policy", "fifo"))
    # Submitting takes seconds per job: the long ones hold the 4 GPUs well past the checks.
    _ok(cluster.submit("long", "q2", 60, "b"))
    _ok(cluster.submit("long2", "q2", 60, "b"))
    _ok(cluster.submit("w1", "q2", 3, "b"))
    _ok(cluster.submit("w2", "q1", 3, "c"))
    before = _ok(cluster.cli("queue"))
    assert "queued" in _row(before, "raydeck-w1") and "queued" in _row(before, "raydeck-w2")
    killed = subprocess.run(
        [sys.executable, "-c", "import ray; ray.init(address='auto', logging_level='ERROR'); "
         "ray.kill(ray.get_actor('raydeck-queue', namespace='raydeck'), no_restart=True)"],
        env={**cluster.env, "RAY_ADDRESS": cluster.head.gcs_address}, capture_output=True,
        text=True, timeout=CLI_TIMEOUT_S)
    assert killed.returncode == 0, killed.stderr
    # `raydeck queue` starts the queue again; it reads every job back from its database.
    listing = _ok(cluster.cli("queue"))
    assert "raydeck-w1" in listing and "raydeck-w2" in listing, listing
    wait_until(lambda: all(len(cluster.events().get(job, {}).get("end", [])) == 1
                           for job in ("long", "long2", "w1", "w2")), 240, "every job to end")
    events: dict[str, Any] = cluster.events()
    for job in ("long", "long2", "w1", "w2"):
        assert len(events[job]["start"]) == 1, (job, events[job])


def _job_info(cluster: Cluster, submission_id: str) -> Any:
    from raydeck.jobs import JobServer

    try:
        return JobServer.from_env(env=cluster.head.client_env).client().get_job_info(
            submission_id)
    except RuntimeError:
        return None  # not submitted yet


def _ended(cluster: Cluster, submission_id: str) -> bool:
    info = _job_info(cluster, submission_id)
    return info is not None and info.status.value in ("SUCCEEDED", "FAILED", "STOPPED")


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
def test_a_low_priority_job_is_preempted_at_a_checkpoint_and_resumes_in_its_run(
        cluster: Cluster, mlflow_client: Any) -> None:
    _ok(cluster.cli("queue", "--policy", "priority"))
    epochs = 60

    def digits(name: str, priority: int, epochs: int) -> str:
        return _ok(cluster.cli(
            "submit", "digits_torch.py", "--queue", "--no-check", "--runtime-env",
            "runtime.yaml", "--preset", "d5", "--run-name", name, "--run-id", name, "--team",
            "c", "--priority", str(priority), "--", "--epochs", str(epochs)))

    digits("pre-low", 0, epochs)
    wait_until(lambda: _latest_epoch(mlflow_client, "pre-low") >= 1, 300,
               "the low-priority job to commit a checkpoint")
    digits("pre-high", 5, 3)
    asked_at = time.time()
    # Any checkpoint the low job commits from now on may be the one it stops at.
    committed_before = _latest_epoch(mlflow_client, "pre-low")
    wait_until(lambda: _ended(cluster, "raydeck-pre-low"), 120,
               "the low-priority job to stop at its next checkpoint")
    wait_until(lambda: _ended(cluster, "raydeck-pre-high"), 300, "the high-priority job to end")
    wait_until(lambda: _ended(cluster, "raydeck-pre-low-r1"), 300,
               "the low-priority job to resume and end")

    stopped, high, resumed = (_job_info(cluster, f"raydeck-{job}")
                              for job in ("pre-low", "pre-high", "pre-low-r1"))
    assert stopped.status.value == "FAILED" and "75" in (stopped.message or ""), stopped
    assert high.status.value == "SUCCEEDED" and resumed.status.value == "SUCCEEDED"
    # Never both on the 8 CPUs: high started after low stopped, low resumed after high ended.
    assert stopped.end_time <= high.start_time and high.end_time <= resumed.start_time

    low_run = _run_of(mlflow_client, "pre-low")
    tags = low_run.data.tags
    assert low_run.info.status == "FINISHED"
    assert tags["raydeck.preemptions"] == "1"
    stopped_epoch = int(tags["raydeck.preemption.1"].removeprefix("stopped after epoch "))
    # It stopped at a checkpoint after the high job came, well before its last epoch.
    assert committed_before <= stopped_epoch < epochs - 1, (committed_before, stopped_epoch)
    assert tags["raydeck.checkpoint.resumed_from_epoch"] == str(stopped_epoch)
    history = mlflow_client.get_metric_history(low_run.info.run_id, "val_accuracy")
    assert sorted(point.step for point in history) == list(range(epochs)), "each epoch once"
    high_run = _run_of(mlflow_client, "pre-high")
    assert high_run.info.status == "FINISHED"
    assert "raydeck-pre-low" not in _ok(cluster.cli("queue"))

    # The same job again (job file, preset and arguments; another run name), no --estimate:
    # the queue expects what the earlier run took in MLflow.
    from raydeck.cli._console import format_duration

    took = (high_run.info.end_time - high_run.info.start_time) / 1000
    assert high_run.data.tags["raydeck.job_digest"] != low_run.data.tags["raydeck.job_digest"]
    again = digits("pre-again", 5, 3)
    _ok(cluster.cli("cancel", "raydeck-pre-again"))
    assert f"expected {format_duration(took)};" in again, (took, again)
    print(f"\npreemption: low stopped {stopped.end_time / 1000 - asked_at:.1f} s after the "
          f"high job was queued (after epoch {stopped_epoch} of {epochs}); high started "
          f"{(high.start_time - stopped.end_time) / 1000:.1f} s after; low resumed "
          f"{(resumed.start_time - high.end_time) / 1000:.1f} s after high ended")


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_the_queue_dashboard_has_data_for_every_panel(cluster: Cluster) -> None:
    """After the jobs above (three teams, a preemption, a prediction): every panel of the Queue
    dashboard has data in a real Prometheus scraping this cluster."""
    from raydeck.observability.dashboards import check, load_dashboards
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


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_a_head_restart_loses_no_job_and_reruns_what_died_with_it(cluster: Cluster) -> None:
    """Last in the module: it restarts the head (the queue's database is in the head's data
    dir; Ray's job table and the queue actor are not kept by a restarted head)."""
    _ok(cluster.cli("queue", "--policy", "fifo"))
    # Long enough to be running when the head goes down: a job that ends while the head stops
    # cannot be seen ending, and runs again (the queue's guarantee is at least once).
    _ok(cluster.submit("hr-run1", "q2", 75, "b"))
    _ok(cluster.submit("hr-run2", "q2", 75, "b"))
    _ok(cluster.submit("hr-wait", "q1", 3, "c"))
    wait_until(lambda: {"hr-run1", "hr-run2"} <= set(cluster.events()), 120,
               "the two running jobs to start")
    cluster.head.stop()
    cluster.head.start()
    assert "hr-wait" in _ok(cluster.cli("queue"))  # a new queue actor, from its database
    try:
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
    # from its checkpoint); the queued one started once.
    assert len(events["hr-wait"]["start"]) == 1, events["hr-wait"]
    for job in ("hr-run1", "hr-run2"):
        assert len(events[job]["start"]) == 2 and len(events[job]["end"]) == 1, events[job]
    run_ids = {json.loads(line)["run_id"] for line in cluster.log.read_text().splitlines()
               if json.loads(line)["run"] == "hr-run1"}
    assert run_ids == {"hr-run1"}, run_ids
    final = _ok(cluster.cli("queue"))
    assert not any(job in final for job in ("hr-run1", "hr-run2", "hr-wait")), final
