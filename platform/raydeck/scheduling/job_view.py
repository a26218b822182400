"""A queued job as the queue's clients see it: :class:`JobView`, detached from the database.

Its own module, apart from :mod:`raydeck.scheduling.store` (the SQLAlchemy tables), because the
queue's answers carry it to every ``raydeck queue``, ``raydeck submit --queue`` and ``raydeck
cancel``: unpickling it there must not import SQLAlchemy, which is half a CPU second of each
such command (tests/test_queue_client_imports.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from raydeck.scheduling.store import JobRow


@dataclass(frozen=True)
class JobView:
    """A job as clients see it (detached from the database session)."""

    id: str
    team: str
    priority: int
    cpus: float
    gpus: float
    preset: str
    key: str
    entrypoint: str
    estimate_s: float
    state: str
    reason: str
    submitted_at: float
    started_at: float | None
    ended_at: float | None
    submission_id: str
    preemptions: int
    user: str = ""
    host: str = ""

    @classmethod
    def of(cls, row: JobRow) -> JobView:
        return cls(row.id, row.team, row.priority, row.cpus, row.gpus, row.preset, row.key,
                   row.entrypoint, row.estimate_s, row.state, row.reason, row.submitted_at,
                   row.started_at, row.ended_at, row.submission_id, row.preemptions,
                   row.user, row.host)
