"""Issue 25, defect 5: who may do what to the queue. The real :class:`JobQueue` in front of the
in-memory job server, called as different OS users: each job records its submitter; cancel and
priority changes are allowed to the submitter, the team's members and an admin; only an admin
changes the teams file; a team's ``max_priority`` bounds its jobs; a team must be the teams
file's. Every refusal is one line naming the field and the fix, and changes nothing.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from raydeck.errors import ConfigError
from raydeck.scheduling.policies.core import Resources
from raydeck.scheduling.queue.identity import Identity
from raydeck.scheduling.queue.job_queue import JobQueue, JobSpec
from raydeck.scheduling.queue.store import Store
from tests.fixtures.fake_job_server import FakeJobServer

pytestmark = pytest.mark.timeout(60)

ANA, BO, CY, ROOT = (Identity(user, "node-1") for user in ("ana", "bo", "cy", "root"))
TEAMS: dict[str, Any] = {"admins": ["root"],
                         "vision": {"members": ["ana", "bo"], "max_priority": 5},
                         "nlp": {"members": ["cy"]}}


def _spec(job_id: str, who: Identity, team: str = "vision", priority: int = 0) -> JobSpec:
    return JobSpec(job_id, team, priority, "custom", Resources(cpus=1), job_id, "python job.py",
                   {}, submitter=who)


def _queue(tmp_path: Path) -> JobQueue:
    queue = JobQueue(Store(f"sqlite:///{tmp_path / 'q.db'}"), FakeJobServer())
    queue.configure(ROOT, teams=TEAMS)  # no admins yet: the first file names them
    return queue


def test_cancel_and_reprioritize_are_for_the_submitter_its_team_and_admins(
        tmp_path: Path) -> None:
    queue = _queue(tmp_path)
    view = queue.submit(_spec("ana-job", ANA))
    assert (view.user, view.host) == ("ana", "node-1")
    queue.submit(_spec("ana-run", ANA))
    assert queue.tick() == ["ana-job", "ana-run"]
    with pytest.raises(ConfigError, match=r"^cancel ana-run: user cy may not; it was submitted "
                                          r"by ana@node-1 for team vision, and only its "
                                          r"submitter, team vision's members or an admin "
                                          r"\(root\) may cancel it$"):
        queue.cancel("ana-run", CY)
    with pytest.raises(ConfigError, match=r"^reprioritize ana-job: user cy may not"):
        queue.reprioritize("ana-job", 1, CY)
    assert [e.job.state for e in queue.listing()] == ["starting", "starting"]
    assert queue.reprioritize("ana-job", 3, BO).priority == 3  # a team member
    assert queue.cancel("ana-run", BO).state == "cancelled"
    assert queue.cancel("ana-job", ROOT).state == "cancelled"  # an admin


def test_only_an_admin_changes_the_teams_file_or_the_policy(tmp_path: Path) -> None:
    queue = _queue(tmp_path)
    with pytest.raises(ConfigError, match=r"^--teams/--policy/--aging: only the queue's admins "
                                          r"\(root\) may change them, not user ana; ask one of "
                                          r"them$"):
        queue.configure(ANA, teams={"vision": {"weight": 100}})
    with pytest.raises(ConfigError, match="only the queue's admins"):
        queue.configure(ANA, policy="priority")
    assert queue.teams_file().teams["vision"].weight == 1.0 and queue.policy_name() == "fifo"
    with pytest.raises(ConfigError, match=r"^--teams: the file's admins \(ana\) do not include "
                                          r"you \(root\), so you could not change it again; "
                                          r"add yourself$"):
        queue.configure(ROOT, teams={**TEAMS, "admins": ["ana"]})
    assert queue.configure(ROOT, "priority", teams={**TEAMS, "admins": ["root", "ana"]}) \
        == "priority"
    assert queue.teams_file().admins == {"root", "ana"}


def test_a_team_bounds_its_priorities_and_its_members_and_must_exist(tmp_path: Path) -> None:
    queue = _queue(tmp_path)
    with pytest.raises(ConfigError, match=r"^--priority=6: team vision's max_priority is 5; use "
                                          r"5 or less, or ask an admin to change the teams file "
                                          r"\(root\)$"):
        queue.submit(_spec("high", ANA, priority=6))
    with pytest.raises(ConfigError, match=r"^--team nlp: user ana is not one of its members "
                                          r"\(cy\); use your own team, or ask an admin"):
        queue.submit(_spec("elsewhere", ANA, team="nlp"))
    with pytest.raises(ConfigError, match=r"^--team 'nobody' is not one of the queue's teams: "
                                          r"nlp, vision \(`raydeck queue --teams FILE`\)$"):
        queue.submit(_spec("lost", ANA, team="nobody"))
    with pytest.raises(ConfigError, match=r"^--team 'Vision!': use 1-64 of a-z 0-9 _ -"):
        _spec("bad", ANA, team="Vision!")
    assert queue.listing() == []
    queue.submit(_spec("ok", ANA, priority=5))
    with pytest.raises(ConfigError, match=r"^--priority=9: team vision's max_priority is 5"):
        queue.reprioritize("ok", 9, ANA)
    assert queue.reprioritize("ok", 9, ROOT).priority == 9  # admins are not bound
    queue.submit(_spec("urgent", ROOT, priority=50))


def test_a_bad_teams_file_names_the_field_and_changes_nothing(tmp_path: Path) -> None:
    queue = _queue(tmp_path)
    for bad, message in (({"admins": "root"}, r"^teams file: admins: must be a list"),
                         ({"admins": ["root"], "x": {"members": ["a b"]}},
                          r"^team x: members 'a b': a user name is"),
                         ({"admins": ["root"], "x": {"max_priority": -1}},
                          r"^team x: max_priority=-1 must be >= 0$"),
                         ({"admins": ["root"], "x": {"max_priority": "high"}},
                          r"^team x: max_priority='high' must be a whole number$")):
        with pytest.raises(ConfigError, match=message):
            queue.configure(ROOT, teams=bad)
    assert set(queue.teams_file().teams) == {"vision", "nlp"}
