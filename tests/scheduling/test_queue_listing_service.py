"""Issue 28: under an attained-service policy ``raydeck queue`` shows each job's attained
service and where it ranks the job (its LAS queue, its Gittins index); under the others,
neither. The real :class:`JobQueue` on the fake job server, its clock set by the test; the
CLI's table with the queue actor's call answered by that queue."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from raydeck.cli.main import app
from raydeck.scheduling.policies.core import Resources
from raydeck.scheduling.queue import client
from raydeck.scheduling.queue.config_change import ConfigChange
from raydeck.scheduling.queue.identity import Identity
from raydeck.scheduling.queue.job_queue import JobQueue, JobSpec
from raydeck.scheduling.queue.listing import Entry
from raydeck.scheduling.queue.store import Store
from tests.fixtures.fake_job_server import FakeJobServer

pytestmark = pytest.mark.timeout(30)


def _spec(job_id: str) -> JobSpec:
    # The fake node's 4 CPUs: one job at a time; CPU-only, so service is CPU-seconds.
    return JobSpec(job_id, "a", 0, "custom", Resources(cpus=4), job_id, "python job.py", {})


def _shown(queue: JobQueue) -> dict[str, tuple[str, str]]:
    return {e.job.id: (e.service, e.rank) for e in queue.listing()}


def test_las_shows_each_jobs_service_and_queue_level(tmp_path: Path) -> None:
    now = [1e6]
    server = FakeJobServer()
    queue = JobQueue(Store(f"sqlite:///{tmp_path / 'q.db'}"), server, clock=lambda: now[0])
    queue.configure(Identity.here(), "las")
    queue.submit(_spec("long"))
    assert queue.tick() == ["long"]
    now[0] += 1000.0  # 4 CPUs x 1000 s: past the first threshold (3600)
    queue.submit(_spec("new"))
    assert _shown(queue) == {"long": ("1.11 CPU-h", "Q1 of 3"),
                             "new": ("0.00 CPU-h", "Q0 of 3")}
    server.exit(server.submitted[0], 0)
    assert queue.tick() == ["new"]
    now[0] += 450.0
    assert _shown(queue) == {"new": ("0.50 CPU-h", "Q0 of 3")}
    queue.configure(Identity.here(), "fifo")  # ranks by no service: nothing shown
    assert _shown(queue) == {"new": ("", "")}


def test_gittins_shows_each_jobs_service_and_index(tmp_path: Path) -> None:
    # Earlier runs of "new" took 100 s: 400 CPU-s, an index of 1/400 per CPU-s (9 per CPU-h).
    queue = JobQueue(Store(f"sqlite:///{tmp_path / 'q.db'}"), FakeJobServer(),
                     clock=lambda: 1e6, history=lambda key: [100.0] if key == "new" else [])
    queue.configure(Identity.here(), "gittins")
    queue.submit(_spec("new"))
    queue.submit(_spec("other"))  # no runs anywhere: index 0
    assert _shown(queue) == {"new": ("0.00 CPU-h", "index 9 per CPU-h"),
                             "other": ("0.00 CPU-h", "index 0 per CPU-h")}


def test_raydeck_queue_shows_the_service_columns_only_for_an_attained_service_policy(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    now = [1e6]
    queue = JobQueue(Store(f"sqlite:///{tmp_path / 'q.db'}"), FakeJobServer(),
                     clock=lambda: now[0])
    queue.submit(_spec("long"))
    queue.tick()
    now[0] += 1000.0

    def listing(settings: object, server: object, change: ConfigChange, ended: bool = False
                ) -> tuple[str, list[Entry]]:  # the queue actor's answer, without Ray
        queue.configure(Identity.here(), change.policy)
        return queue.describe(), queue.listing(ended)

    monkeypatch.setattr(client, "listing", listing)
    monkeypatch.setenv("COLUMNS", "300")
    shown = CliRunner().invoke(app, ["queue", "--policy", "las"])
    assert shown.exit_code == 0, shown.output
    assert "service" in shown.output and "1.11 CPU-h" in shown.output
    assert "Q1 of 3" in shown.output
    shown = CliRunner().invoke(app, ["queue", "--policy", "fifo"])
    assert shown.exit_code == 0 and "CPU-h" not in shown.output and "long" in shown.output


def test_raydeck_queue_keeps_each_job_id_whole_on_its_row_and_lists_them_as_json(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Issue 51: identifiers a user copies are never cut. Out of a terminal (here the CLI's
    output captured, as in a pipe) each job is one line with its whole id, whatever COLUMNS
    says; ``--json`` lists the same jobs in the same order."""
    queue = JobQueue(Store(f"sqlite:///{tmp_path / 'q.db'}"), FakeJobServer(),
                     clock=lambda: 1e6)
    ids = [f"raydeck-digits-torch-{index}{'0123456789abcdef' * 2}" for index in range(3)]
    for job_id in ids:
        queue.submit(_spec(job_id))
    queue.tick()

    def listing(settings: object, server: object, change: ConfigChange, ended: bool = False
                ) -> tuple[str, list[Entry]]:  # the queue actor's answer, without Ray
        return queue.describe(), queue.listing(ended)

    monkeypatch.setattr(client, "listing", listing)
    monkeypatch.setenv("COLUMNS", "80")
    as_json = CliRunner().invoke(app, ["queue", "--json"])
    assert as_json.exit_code == 0, as_json.output
    rows = json.loads(as_json.output)
    assert [row["id"] for row in rows] == ids
    assert [(row["position"], row["state"]) for row in rows] == [
        (None, "starting"), (1, "queued"), (2, "queued")], rows
    shown = CliRunner().invoke(app, ["queue"])
    assert shown.exit_code == 0, shown.output
    for job in rows:
        (row,) = [line for line in shown.output.splitlines() if f" {job['id']} " in line]
        assert f" {job['state']} " in row and f" {job['why']} " in row, row


def test_raydeck_queue_all_keeps_the_record_of_cancelled_and_failed_jobs(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Issues 51 and 52: a job cancelled while queued, or while it ran, stays on record in
    ``raydeck queue --all`` (the live listing drops it), and a failed job shows its exit code
    and its log's last line."""
    server, now = FakeJobServer(), [1e6]
    queue = JobQueue(Store(f"sqlite:///{tmp_path / 'q.db'}"), server, clock=lambda: now[0])
    for job_id in ("ran", "waited", "crashed"):
        queue.submit(_spec(job_id))
        now[0] += 1
    assert queue.tick() == ["ran"]
    queue.cancel("ran", Identity.here())  # stopped while it ran
    queue.cancel("waited", Identity.here())  # taken out while queued
    assert queue.tick() == ["crashed"]
    server.exit("crashed", 3)
    queue.tick()

    def listing(settings: object, server: object, change: ConfigChange, ended: bool = False
                ) -> tuple[str, list[Entry]]:  # the queue actor's answer, without Ray
        return queue.describe(), queue.listing(ended)

    monkeypatch.setattr(client, "listing", listing)
    live = CliRunner().invoke(app, ["queue", "--json"])
    assert live.exit_code == 0 and json.loads(live.output) == [], live.output
    shown = CliRunner().invoke(app, ["queue", "--all", "--json"])
    assert shown.exit_code == 0, shown.output
    rows = {row["id"]: row for row in json.loads(shown.output)}
    assert {job_id: row["state"] for job_id, row in rows.items()} == {
        "ran": "cancelled", "waited": "cancelled", "crashed": "failed"}
    assert rows["crashed"]["exit_code"] == 3
    assert rows["crashed"]["why"] == "exited with code 3; its log ends: driver exited with 3"
    table = CliRunner().invoke(app, ["queue", "--all"])
    assert table.exit_code == 0 and "exited with code 3" in table.output, table.output
    assert server.jobs["ran"] == "STOPPED"
