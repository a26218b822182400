"""Issue 25, defect 5 and issue 52, item 6: who may do what to the queue. The real
:class:`JobQueue` in front of the in-memory job server, called as different OS users: each job
records its submitter; cancel and priority changes are allowed to the submitter, the team's
members and an admin; only an admin changes the teams file; a team's ``max_priority`` bounds its
jobs; a team must be the teams file's. Every refusal is one line naming the field and the fix,
and changes nothing.

Issue 52: the caller is its process's OS account, whatever ``LOGNAME``/``USER`` say, and the
admins are the head's file's (a real file, checked as the head's account reads it), never the
first teams file's.
"""

from __future__ import annotations

import os
import pwd
import stat
from pathlib import Path
from typing import Any

import pytest

from raydeck.errors import ConfigError
from raydeck.scheduling.policies.core import Resources
from raydeck.scheduling.queue.access import ADMINS_FILE, AdminsFile
from raydeck.scheduling.queue.identity import Identity
from raydeck.scheduling.queue.job_queue import JobQueue, JobSpec
from raydeck.scheduling.queue.store import Store
from tests.fixtures.fake_job_server import FakeJobServer

pytestmark = pytest.mark.timeout(60)

ANA, BO, CY, ROOT = (Identity(user, "node-1") for user in ("ana", "bo", "cy", "root"))
TEAMS: dict[str, Any] = {"vision": {"members": ["ana", "bo"], "max_priority": 5},
                         "nlp": {"members": ["cy"]}}


def _spec(job_id: str, who: Identity, team: str = "vision", priority: int = 0) -> JobSpec:
    return JobSpec(job_id, team, priority, "custom", Resources(cpus=1), job_id, "python job.py",
                   {}, submitter=who)


def _admins(tmp_path: Path, text: str) -> AdminsFile:
    """The head's admins file in ``tmp_path`` (its data dir), written as the head's account
    writes it (this process's: the queue reads it here too)."""
    path = tmp_path / ADMINS_FILE
    path.write_text(text)
    path.chmod(0o644)
    return AdminsFile(path)


def _queue(tmp_path: Path) -> JobQueue:
    queue = JobQueue(Store(f"sqlite:///{tmp_path / 'q.db'}"), FakeJobServer(),
                     admins=_admins(tmp_path, "root\n"))
    queue.configure(ROOT, teams=TEAMS)
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
    assert queue.configure(ROOT, "priority") == "priority"
    # The head's account names another admin: it holds from the next call on.
    _admins(tmp_path, "# the queue's admins\nroot, ana  # ana runs the vision team\n")
    assert queue.teams_file().admins == {"root", "ana"}
    assert queue.configure(ANA, "fifo") == "fifo"


def test_admins_are_the_heads_never_a_teams_files(tmp_path: Path) -> None:
    """Issue 52: whoever sent the first teams file chose the admins."""
    open_queue = JobQueue(Store(f"sqlite:///{tmp_path / 'open.db'}"), FakeJobServer())
    refused = (r"^--teams: the file's admins \(ana\) are not the queue's \(none: the queue has "
               r"no admins\): a teams file does not choose them, RAYDECK_DATA_DIR/queue-admins "
               r"on the head does; remove `admins:` from the teams file$")
    with pytest.raises(ConfigError, match=refused):
        open_queue.configure(ANA, teams={**TEAMS, "admins": ["ana"]})
    assert open_queue.teams_file().teams == {}
    open_queue.configure(ANA, teams=TEAMS)  # no admins: anyone may change the settings
    assert open_queue.configure(CY, "priority") == "priority"

    queue = _queue(tmp_path)
    path = tmp_path / ADMINS_FILE
    with pytest.raises(ConfigError, match=rf"^--teams: the file's admins \(ana, root\) are not "
                                          rf"the queue's \(root\): a teams file does not choose "
                                          rf"them, {path} on the head does; remove"):
        queue.configure(ROOT, teams={**TEAMS, "admins": ["root", "ana"]})
    # A file that names the queue's own admins is taken (an older teams file), and its admins
    # are not kept as the file's.
    queue.configure(ROOT, teams={**TEAMS, "admins": ["root"]})
    path.unlink()
    assert queue.teams_file().admins == set()


def test_the_caller_is_its_processes_account_whatever_logname_and_user_say(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Issue 52: ``getpass.getuser()`` reads LOGNAME/USER first, so ``LOGNAME=<admin>
    raydeck ...`` passed every check."""
    account = pwd.getpwuid(os.getuid()).pw_name
    assert account != "boss"
    queue = JobQueue(Store(f"sqlite:///{tmp_path / 'q.db'}"), FakeJobServer(),
                     admins=_admins(tmp_path, "boss\n"))
    for name in ("LOGNAME", "USER", "LNAME", "USERNAME"):
        monkeypatch.setenv(name, "boss")
    me = Identity.here()
    assert me.user == account
    with pytest.raises(ConfigError, match=rf"only the queue's admins \(boss\) may change them, "
                                          rf"not user {account};"):
        queue.configure(me, "priority")
    view = queue.submit(JobSpec("mine", "vision", 0, "custom", Resources(cpus=1), "mine",
                                "python job.py", {}))  # submitter: Identity.here()
    assert view.user == account


def test_an_admins_file_others_could_write_answers_no_call_that_needs_the_admins(
        tmp_path: Path) -> None:
    queue = _queue(tmp_path)
    path = tmp_path / ADMINS_FILE
    path.chmod(0o664)
    unsafe = (rf"^the queue's admins file {path} may be written by its group or others \(mode "
              rf"-rw-rw-r--\); `chmod go-w {path}` on the head$")
    for call in (lambda: queue.configure(ROOT, "priority"),
                 lambda: queue.submit(_spec("j", ANA)), lambda: queue.cancel("j", ROOT)):
        with pytest.raises(ConfigError, match=unsafe):
            call()
    assert queue.policy_name() == "fifo" and queue.listing() == [] and queue.tick() == []
    path.unlink()
    os.mkfifo(path)  # read without waiting for a writer that never comes
    with pytest.raises(ConfigError, match=rf"^the queue's admins file {path} is not a regular "
                                          r"file; replace it"):
        queue.configure(ROOT, "priority")
    path.unlink()
    _admins(tmp_path, "root\nnot a name!\n")
    with pytest.raises(ConfigError, match=rf"^the queue's admins file {path} 'name!': a user "
                                          r"name is"):
        queue.configure(ROOT, "priority")


@pytest.mark.skipif(os.getuid() != 0, reason="giving a file to another account needs root")
def test_an_admins_file_of_another_account_is_refused(tmp_path: Path) -> None:
    queue = _queue(tmp_path)
    path = tmp_path / ADMINS_FILE
    os.chown(path, 4242, 4242)
    assert stat.S_IMODE(path.stat().st_mode) == 0o644
    with pytest.raises(ConfigError, match=rf"^the queue's admins file {path} is owned by uid "
                                          r"4242, not the head's account \(uid 0\)"):
        queue.configure(ROOT, "priority")


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
                         ({"x": {"members": ["a b"]}}, r"^team x: members 'a b': a user name is"),
                         ({"x": {"max_priority": -1}}, r"^team x: max_priority=-1 must be >= 0$"),
                         ({"x": {"max_priority": "high"}},
                          r"^team x: max_priority='high' must be a whole number$")):
        with pytest.raises(ConfigError, match=message):
            queue.configure(ROOT, teams=bad)
    assert set(queue.teams_file().teams) == {"vision", "nlp"}
