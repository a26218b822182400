"""Issue 28: the queue's settings beyond its policy are the queue's too: ``las``' thresholds and
the minimum run between two preemptions of a job (with ``--aging``, the starvation bound) are
validated whole (one line naming the option and the fix; a bad change changes nothing), kept
in the queue's database so a restarted queue actor applies them, and shown by ``raydeck
queue``. The real :class:`JobQueue` on the fake job server (one node, 4 CPUs), its clock set by
the test; the CLI with the queue actor's call answered by such a queue.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from typer.testing import CliRunner

from raydeck.cli.main import app
from raydeck.errors import ConfigError
from raydeck.scheduling.policies.core import Resources
from raydeck.scheduling.queue import client
from raydeck.scheduling.queue.config_change import ConfigChange, parse_thresholds
from raydeck.scheduling.queue.identity import Identity
from raydeck.scheduling.queue.job_queue import JobQueue, JobSpec
from raydeck.scheduling.queue.listing import Entry
from raydeck.scheduling.queue.store import Store
from tests.fixtures.fake_job_server import FakeJobServer

pytestmark = pytest.mark.timeout(30)


def _spec(job_id: str) -> JobSpec:
    # The whole fake node, CPU-only: one job at a time, its service in CPU-seconds.
    return JobSpec(job_id, "a", 0, "custom", Resources(cpus=4), job_id, "python job.py", {})


def _queue(path: Path, server: FakeJobServer, clock: list[float]) -> JobQueue:
    """A queue on the database at ``path``: a second one on the same path is the queue actor
    restarted."""
    return JobQueue(Store(f"sqlite:///{path}"), server, clock=lambda: clock[0])


def _state(queue: JobQueue, job_id: str) -> tuple[str, str]:
    (entry,) = [e for e in queue.listing() if e.job.id == job_id]
    return entry.job.state, entry.rank


@pytest.mark.parametrize(("change", "message"), [
    (dict(thresholds_s=(600.0, 60.0)), r"^--thresholds=600s,60s: must be increasing GPU-times "
                                       r"> 0, e.g. 1h,10h$"),
    (dict(thresholds_s=(60.0, 60.0)), r"^--thresholds=60s,60s: must be increasing"),
    (dict(thresholds_s=(0.0,)), r"^--thresholds=0s: must be increasing"),
    (dict(min_run_s=0.0), r"^--min-run=0.0: must be > 0 seconds, e.g. 10m$"),
    (dict(min_run_s=float("inf")), r"^--min-run=inf: must be > 0 seconds"),
    (dict(aging_s=-1.0), r"^--aging=-1.0: must be > 0 seconds$"),
    (dict(policy="las", thresholds_s=(1.0,), min_run_s=-5.0), r"^--min-run=-5.0"),
])
def test_a_bad_setting_is_one_line_naming_it_and_changes_nothing(
        tmp_path: Path, change: dict[str, object], message: str) -> None:
    queue = _queue(tmp_path / "q.db", FakeJobServer(), [0.0])
    before = queue.describe()
    with pytest.raises(ConfigError, match=message):
        queue.configure(Identity.here(), **change)  # type: ignore[arg-type]
    assert queue.describe() == before == "policy fifo; aging 1h; min run 10m"


def test_thresholds_parse_as_gpu_times_and_a_bad_one_names_the_option() -> None:
    assert parse_thresholds("1h,10h") == (3600.0, 36000.0)
    assert parse_thresholds("30,5m") == (30.0, 300.0)
    assert parse_thresholds("auto") == ()  # adaptive levels again
    for bad in ("1h,,10h", "soon", "-1"):
        with pytest.raises(ConfigError, match=rf"^--thresholds={bad}: must be comma-separated "
                                              r"GPU-times, each a positive duration, e.g. "
                                              r"1h,10h \(1 then 10 GPU-hours\), or auto "):
            parse_thresholds(bad)


def test_pinned_las_thresholds_go_back_to_adaptive_with_auto(tmp_path: Path) -> None:
    queue = _queue(tmp_path / "q.db", FakeJobServer(), [1e6])
    queue.configure(Identity.here(), "las", thresholds_s=(60.0, 600.0))
    assert "thresholds 1m,10m GPU-time" in queue.describe()
    queue.configure(Identity.here(), thresholds_s=parse_thresholds("auto"))
    assert "thresholds adaptive: " in queue.describe()


def test_las_thresholds_and_the_minimum_run_outlive_the_queue_actor(tmp_path: Path) -> None:
    """Set once, then a new queue on the same database (the actor restarted) ranks by the
    thresholds (80 CPU-s is level 1 of 60 s, 10 m; level 0 of the default 1 h) and lets a
    resumed job be preempted again after 30 s of running (not the default 10 minutes)."""
    server, clock = FakeJobServer(), [1e6]  # not 0: a start at 0 reads as none
    _queue(tmp_path / "q.db", server, clock).configure(
        Identity.here(), "las", thresholds_s=(60.0, 600.0), min_run_s=30.0)
    queue = _queue(tmp_path / "q.db", server, clock)  # restarted
    assert queue.describe() == "policy las; aging 1h; thresholds 1m,10m GPU-time; min run 30s"
    queue.submit(_spec("long"))
    assert queue.tick() == ["long"]
    clock[0] += 20.0  # 4 CPUs x 20 s = 80 CPU-s: past 60
    assert queue.checkpointed("long", server.tokens["long"]) is False
    queue.submit(_spec("short"))
    assert queue.tick() == []
    assert _state(queue, "long") == ("preempting", "Q1 of 3")
    assert queue.checkpointed("long", server.tokens["long"]) is True
    server.exit("long", 75)
    assert queue.tick() == ["short"]
    server.exit("short", 0)
    assert queue.tick() == ["long"]
    resumed = clock[0]
    queue.submit(_spec("next"))
    clock[0] += 10.0
    # A new checkpoint, but 10 s < 30 s of running.
    assert queue.checkpointed("long", server.tokens["long"]) is False
    assert queue.tick() == [] and _state(queue, "long")[0] == "running"
    clock[0] = resumed + 30.0
    assert queue.tick() == [] and _state(queue, "long")[0] == "preempting"


def test_raydeck_queue_sets_the_thresholds_and_minimum_run_and_shows_them(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    queue = _queue(tmp_path / "q.db", FakeJobServer(), [0.0])

    def listing(settings: object, server: object, change: ConfigChange, ended: bool = False
                ) -> tuple[str, list[Entry]]:  # the queue actor's answer, without Ray
        queue.configure(Identity.here(), change.policy, change.aging_s, change.teams,
                        change.thresholds_s, change.min_run_s)
        return queue.describe(), queue.listing(ended)

    monkeypatch.setattr(client, "listing", listing)
    monkeypatch.setenv("COLUMNS", "300")
    shown = CliRunner().invoke(app, ["queue", "--policy", "las", "--thresholds", "30s,2h",
                                     "--min-run", "5m", "--aging", "4h"])
    assert shown.exit_code == 0, shown.output
    assert "queue (policy las; aging 4h; thresholds 30s,2h GPU-time; min run 5m)" in shown.output
    for args, error in ((["--thresholds", "2h,30s"], "--thresholds=7200s,30s: must be "
                                                     "increasing GPU-times > 0, e.g. 1h,10h"),
                        (["--thresholds", "1h;10h"], "--thresholds=1h;10h: must be "
                                                     "comma-separated GPU-times"),
                        (["--min-run", "0"], "--min-run=0: duration '0': must be a positive "
                                             "number")):
        # Refused before the queue is called (raydeck's main prints it as one line, exit 2).
        refused = CliRunner().invoke(app, ["queue", *args])
        assert isinstance(refused.exception, ConfigError), refused.output
        assert str(refused.exception).startswith(error)
    assert queue.describe() == "policy las; aging 4h; thresholds 30s,2h GPU-time; min run 5m"
