"""Issue 29: the live queue uses elasticity. An elastic job is admitted when its minimum fits and
starts at the largest size that fits then; when the first waiting job does not fit, elastic jobs
shrink (at their next checkpoint, relaunched at once at the smaller size as ``<id>-r<N>``, same
run) before any job is preempted; they grow back the same way when room returns and no waiting
job can use it. Each job's allowed size is in the queue's database (a restarted queue goes on),
reaches the job (``RAYDECK_QUEUE_WORKERS``), which keeps Ray Train within it, and ``raydeck
queue`` shows it.

The real :class:`JobQueue` on the fake job server (one node, 4 CPUs), its clock set by the test;
the CLI with the queue actor's call answered by such a queue. Which jobs shrink or grow, and by
how much, is :mod:`raydeck.scheduling.policies.elastic`'s
(tests/scheduling/test_scheduling_elastic.py).
"""

from __future__ import annotations

from pathlib import Path

import pytest
from typer.testing import CliRunner

from raydeck._internal import contract
from raydeck.cli.main import app
from raydeck.errors import ConfigError
from raydeck.scheduling.policies.preemption import MIN_RUN_BEFORE_PREEMPTION_S
from raydeck.scheduling.policies.resources import Gang, Resources
from raydeck.scheduling.queue import client
from raydeck.scheduling.queue.config_change import ConfigChange
from raydeck.scheduling.queue.identity import Identity
from raydeck.scheduling.queue.job_queue import JobQueue, JobSpec
from raydeck.scheduling.queue.listing import Entry
from raydeck.scheduling.queue.ray_jobs import queue_env
from raydeck.scheduling.queue.store import Store
from raydeck.train.trainer import within_queue
from tests.fixtures.fake_job_server import FakeJobServer

pytestmark = pytest.mark.timeout(60)

HOUR = 3600.0


def _elastic(job_id: str, low: int = 1, high: int = 4, priority: int = 0) -> JobSpec:
    """A job of ``low`` to ``high`` one-CPU workers (an elastic preset's gang)."""
    gang = Gang(low, Resources(cpus=1), "PACK", high)
    return JobSpec(job_id, "a", priority, "cpu-1-4", gang.needs, job_id, "python job.py", {},
                   estimate_s=HOUR, gang=gang)


def _fixed(job_id: str, cpus: int, priority: int = 0) -> JobSpec:
    gang = Gang(cpus, Resources(cpus=1))
    return JobSpec(job_id, "a", priority, f"cpu-{cpus}", gang.needs, job_id, "python job.py", {},
                   estimate_s=HOUR, gang=gang)


def _queue(path: Path, server: FakeJobServer, clock: list[float]) -> JobQueue:
    """A queue on the database at ``path``: a second one on the same path is the queue actor
    restarted."""
    return JobQueue(Store(f"sqlite:///{path}"), server, clock=lambda: clock[0])


def _entry(queue: JobQueue, job_id: str) -> Entry:
    (entry,) = [e for e in queue.listing() if e.job.id == job_id]
    return entry


def test_an_elastic_job_is_admitted_at_its_minimum_and_starts_at_what_fits_then(
        tmp_path: Path) -> None:
    server, clock = FakeJobServer(), [0.0]
    queue = _queue(tmp_path / "q.db", server, clock)
    queue.submit(_fixed("holder", 3))
    assert queue.tick() == ["holder"]
    # 1 CPU free: a fixed 4-worker gang would wait; the elastic one starts at its minimum.
    queue.submit(_elastic("E"))
    assert queue.tick() == ["E"]
    assert server.cpus["E"] == 1.0
    assert _entry(queue, "E").job.size == "workers 1 of 1-4"
    # A second elastic job and a fixed one on the node left when both end: the fixed one takes
    # its 2 CPUs, the elastic one the rest, never past its maximum.
    server.exit("holder", 0)
    server.exit("E", 0)
    queue.submit(_elastic("F", high=3))
    queue.submit(_fixed("G", 2))
    assert queue.tick() == ["F", "G"]
    assert (server.cpus["F"], server.cpus["G"]) == (2.0, 2.0)
    assert _entry(queue, "F").job.size == "workers 2 of 1-3"


def test_the_job_keeps_ray_train_within_the_size_the_queue_allows(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from ray.train import ScalingConfig

    server, clock = FakeJobServer(), [0.0]
    queue = _queue(tmp_path / "q.db", server, clock)
    queue.submit(_fixed("holder", 2))
    queue.submit(_elastic("E"))
    assert queue.tick() == ["E", "holder"]  # submitted together: in id order
    store = Store(f"sqlite:///{tmp_path / 'q.db'}")
    env = queue_env(store.get("E"))  # what Ray's launcher sets in the job's runtime env
    assert env == {contract.QUEUE_JOB_ENV: "E", contract.QUEUE_WORKERS_ENV: "2",
                   contract.QUEUE_TOKEN_ENV: server.tokens["E"]}
    assert queue_env(store.get("holder")) == {contract.QUEUE_JOB_ENV: "holder",
                                              contract.QUEUE_TOKEN_ENV: server.tokens["holder"]}
    elastic = ScalingConfig(num_workers=(1, 4), resources_per_worker={"CPU": 1})
    for allowed, expected in (("2", (1, 2)), ("1", 1), ("9", (1, 4))):
        monkeypatch.setenv(contract.QUEUE_WORKERS_ENV, allowed)
        assert within_queue(elastic).num_workers == expected
    assert within_queue(ScalingConfig(num_workers=3)).num_workers == 3  # a fixed gang
    monkeypatch.setenv(contract.QUEUE_WORKERS_ENV, "two")
    with pytest.raises(ConfigError, match=r"^RAYDECK_QUEUE_WORKERS='two': must be a whole "):
        within_queue(elastic)
    monkeypatch.delenv(contract.QUEUE_WORKERS_ENV)
    assert within_queue(elastic).num_workers == (1, 4)  # not started by the queue


def _shrunk_for_urgent(tmp_path: Path) -> tuple[JobQueue, FakeJobServer, list[float]]:
    """L (1 CPU, priority 0) and elastic E (3 of 1-4, priority 0) running, both with a
    checkpoint; then U (2 CPUs, priority 5) arrives: E is asked to shrink, L is not stopped."""
    server, clock = FakeJobServer(), [0.0]
    queue = _queue(tmp_path / "q.db", server, clock)
    queue.submit(_fixed("L", 1))
    queue.submit(_elastic("E"))
    assert queue.tick() == ["E", "L"]  # submitted together: in id order
    assert server.cpus["E"] == 3.0
    clock[0] = 600.0
    assert queue.checkpointed("L", server.tokens["L"]) is False
    assert queue.checkpointed("E", server.tokens["E"]) is False
    queue.submit(_fixed("U", 2, priority=5))
    assert queue.tick() == []
    e = _entry(queue, "E")
    assert (e.job.state, e.job.size) == ("preempting", "workers 3 of 1-4 -> 1")
    assert e.why == "shrinks to 1 workers for U at its next checkpoint"
    assert _entry(queue, "L").job.state == "running"  # shrinking was enough: nobody preempted
    return queue, server, clock


def test_an_elastic_job_shrinks_at_its_checkpoint_before_anyone_is_preempted_and_restarts_at_once(
        tmp_path: Path) -> None:
    queue, server, clock = _shrunk_for_urgent(tmp_path)
    clock[0] += 60
    # Told at this checkpoint; its driver exits 75.
    assert queue.checkpointed("E", server.tokens["E"]) is True
    assert queue.preempted("E", server.tokens["E"]) == 1
    server.exit("E", 75)
    # Relaunched at once at its smaller size (no queueing), and U starts in the room it freed.
    assert queue.tick() == ["U"]
    assert server.submitted == ["E", "L", "E-r1", "U"]
    assert server.cpus["E-r1"] == 1.0
    e = _entry(queue, "E").job
    assert (e.state, e.size, e.preemptions, e.submission_id) == (
        "starting", "workers 1 of 1-4", 0, "E-r1")


def test_the_allowed_size_and_a_pending_resize_survive_a_queue_restart(tmp_path: Path) -> None:
    _, server, clock = _shrunk_for_urgent(tmp_path)
    queue = _queue(tmp_path / "q.db", server, clock)  # the queue actor restarted
    assert _entry(queue, "E").job.size == "workers 3 of 1-4 -> 1"
    clock[0] += 60
    assert queue.checkpointed("E", server.tokens["E"]) is True
    server.exit("E", 75)
    assert queue.tick() == ["U"]
    assert server.cpus["E-r1"] == 1.0
    restarted = _queue(tmp_path / "q.db", server, clock)
    assert _entry(restarted, "E").job.size == "workers 1 of 1-4"
    assert restarted.tick() == []  # the relaunched job is not started twice


def test_an_elastic_job_grows_back_when_room_returns_and_no_waiting_job_can_use_it(
        tmp_path: Path) -> None:
    queue, server, clock = _shrunk_for_urgent(tmp_path)
    clock[0] += 60
    assert queue.checkpointed("E", server.tokens["E"]) is True
    server.exit("E", 75)
    assert queue.tick() == ["U"]
    relaunched = clock[0]
    server.exit("U", 0)
    # Room is back, but the restarted attempt may not stop again before its minimum run and a
    # checkpoint of its own.
    assert queue.tick() == [] and _entry(queue, "E").job.state == "running"
    clock[0] = relaunched + MIN_RUN_BEFORE_PREEMPTION_S
    assert queue.checkpointed("E", server.tokens["E"]) is False
    # A job that could use the room waits first: W (2 CPUs) starts, E does not grow into it.
    queue.submit(_fixed("W", 2))
    assert queue.tick() == ["W"]
    assert _entry(queue, "E").job.state == "running"
    server.exit("W", 0)
    assert queue.tick() == []
    e = _entry(queue, "E")
    assert (e.job.state, e.job.size, e.why) == (
        "preempting", "workers 1 of 1-4 -> 3", "grows to 3 workers at its next checkpoint")
    # The room is kept for its restart: a job arriving meanwhile does not take it.
    queue.submit(_fixed("X", 1))
    assert queue.tick() == []
    clock[0] += 60
    assert queue.checkpointed("E", server.tokens["E"]) is True
    server.exit("E-r1", 75)
    assert queue.tick() == []
    assert server.submitted[-1] == "E-r2" and server.cpus["E-r2"] == 3.0
    assert _entry(queue, "E").job.size == "workers 3 of 1-4"


def test_a_growth_not_reached_at_a_checkpoint_in_the_grace_period_is_dropped(
        tmp_path: Path) -> None:
    server, clock = FakeJobServer(), [0.0]
    queue = _queue(tmp_path / "q.db", server, clock)
    queue.submit(_fixed("holder", 2))
    queue.submit(_elastic("E"))
    assert queue.tick() == ["E", "holder"]  # submitted together: in id order
    clock[0] = 60.0
    assert queue.checkpointed("E", server.tokens["E"]) is False
    server.exit("holder", 0)
    assert queue.tick() == [] and _entry(queue, "E").job.size == "workers 2 of 1-4 -> 4"
    clock[0] += 301.0  # no checkpoint since: nothing waits on a growth, so it is not forced
    assert queue.tick() == []
    e = _entry(queue, "E").job
    assert (e.state, e.size, server.jobs["E"]) == ("running", "workers 2 of 1-4", "RUNNING")


def test_raydeck_queue_shows_each_elastic_jobs_size_and_range(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    queue = _queue(tmp_path / "q.db", FakeJobServer(), [0.0])
    queue.submit(_fixed("holder", 3))
    queue.submit(_elastic("E", high=2))
    assert queue.tick() == ["E", "holder"]  # submitted together: in id order

    def listing(settings: object, server: object, change: ConfigChange, ended: bool = False
                ) -> tuple[str, list[Entry]]:  # the queue actor's answer, without Ray
        return queue.describe(), queue.listing(ended)

    monkeypatch.setattr(client, "listing", listing)
    monkeypatch.setenv("COLUMNS", "300")
    shown = CliRunner().invoke(app, ["queue"])
    assert shown.exit_code == 0, shown.output
    (line,) = [row for row in shown.output.splitlines() if " E " in row]
    assert "1 CPU; workers 1 of 1-2" in line
    (line,) = [row for row in shown.output.splitlines() if " holder " in row]
    assert "workers" not in line


def test_an_elastic_job_grows_no_further_than_its_teams_quota(tmp_path: Path) -> None:
    server, clock = FakeJobServer(), [0.0]
    queue = _queue(tmp_path / "q.db", server, clock)
    queue.configure(Identity.here(), teams={"a": {"cpus": 3}})
    queue.submit(_elastic("E"))
    assert queue.tick() == ["E"]
    assert _entry(queue, "E").job.size == "workers 3 of 1-4"  # 4 fit the node; the quota is 3


class _TwoNodes(FakeJobServer):
    """Two 3-CPU nodes; each job's CPUs all on the node the test put it on (``node``, by job id;
    a relaunch ``<id>-r<N>`` on its job's)."""

    def __init__(self, node: dict[str, int]) -> None:
        super().__init__()
        self.node = node

    def resources(self) -> tuple[tuple[Resources, ...], tuple[Resources, ...]]:
        free = [3.0, 3.0]
        for submission_id, status in self.jobs.items():
            if status == "RUNNING":
                free[self.node[submission_id.split("-r")[0]]] -= self.cpus[submission_id]
        return tuple(Resources(cpus=cpus) for cpus in free), (Resources(cpus=3.0),) * 2


def test_an_elastic_job_grows_only_by_workers_a_node_has_room_for(tmp_path: Path) -> None:
    server, clock = _TwoNodes({"F": 1, "E": 0}), [0.0]
    queue = _queue(tmp_path / "q.db", server, clock)
    queue.submit(_fixed("F", 2))  # 2 CPUs, on node 1
    assert queue.tick() == ["F"]
    gang = Gang(1, Resources(cpus=2), "PACK", 2)
    queue.submit(JobSpec("E", "a", 0, "cpu2-1-2", gang.needs, "E", "python job.py", {},
                         estimate_s=HOUR, gang=gang))
    # Two 2-CPU workers need 2 CPUs on each of two nodes; node 1 has 1 free: E starts at 1.
    assert queue.tick() == ["E"] and server.cpus["E"] == 2.0
    clock[0] = MIN_RUN_BEFORE_PREEMPTION_S + 1
    assert queue.checkpointed("E", server.tokens["E"]) is False
    # 2 CPUs are free in all, 1 on each node: no node takes a second worker, so E does not grow.
    assert queue.tick() == []
    e = _entry(queue, "E").job
    assert (e.state, e.size) == ("running", "workers 1 of 1-2")
    server.exit("F", 0)  # node 1 is free: a second worker is placed there
    assert queue.tick() == []
    e = _entry(queue, "E").job
    assert (e.state, e.size) == ("preempting", "workers 1 of 1-2 -> 2")
