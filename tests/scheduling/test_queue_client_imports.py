"""The queue's commands (``raydeck queue``, ``raydeck submit --queue``, ``raydeck cancel``) load
no SQLAlchemy: only the queue's actor reads its database, and importing SQLAlchemy and building
the tables' classes was about half a CPU second of every such command (of about two; the rest
is mostly ``import ray``). The answers they read come pickled from the actor, so what they
unpickle is checked too: the real :class:`JobQueue`'s listing and a submission's view."""

from __future__ import annotations

import pickle
import subprocess
import sys
from pathlib import Path

import pytest

from raydeck.scheduling.policies.core import Resources
from raydeck.scheduling.queue.identity import Identity
from raydeck.scheduling.queue.job_queue import JobQueue, JobSpec
from raydeck.scheduling.queue.store import Store
from tests.fixtures.fake_job_server import FakeJobServer

# Every module a queue command imports before it calls the actor.
COMMAND_MODULES = ("raydeck.cli.main", "raydeck.cli.queue", "raydeck.cli.jobs",
                   "raydeck.scheduling.queue.client")


@pytest.mark.timeout(60)
def test_the_queue_commands_and_the_answers_they_read_load_no_sqlalchemy(tmp_path: Path
                                                                         ) -> None:
    queue = JobQueue(Store(f"sqlite:///{tmp_path / 'q.db'}"), FakeJobServer())
    queue.configure(Identity.here(), "priority")
    submitted = queue.submit(JobSpec("j1", "a", 0, "custom", Resources(cpus=4), "j1",
                                     "python job.py", {}))
    queue.submit(JobSpec("j2", "a", 0, "custom", Resources(cpus=4), "j2", "python job.py", {}))
    queue.tick()
    answers = tmp_path / "answers.pickle"
    answers.write_bytes(pickle.dumps((submitted, (queue.policy_name(), queue.listing()))))
    code = ("import pickle, sys\n"
            + "".join(f"import {module}\n" for module in COMMAND_MODULES)
            + f"view, (policy, entries) = pickle.loads(open({str(answers)!r}, 'rb').read())\n"
            "assert view.id == 'j1' and [e.job.id for e in entries] == ['j1', 'j2'], entries\n"
            "print(sorted(m for m in sys.modules if m.split('.')[0] == 'sqlalchemy'))\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=60)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip() == "[]", done.stdout
