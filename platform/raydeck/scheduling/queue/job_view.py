"""A queued job as the queue's clients see it: :class:`JobView`, detached from the database.

Its own module, apart from :mod:`raydeck.scheduling.queue.store` (the SQLAlchemy tables), because
the queue's answers carry it to every ``raydeck queue``, ``raydeck submit --queue`` and ``raydeck
cancel``: unpickling it there must not import SQLAlchemy, which is half a CPU second of each
such command (tests/scheduling/test_queue_client_imports.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from raydeck.scheduling.queue.store import JobRow


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
    # An elastic job: the size the queue allows it now (``cpus``/``gpus`` are at it), its range
    # and the size it restarts at from its next checkpoint (0: none); all 0 for a fixed gang.
    workers: int = 0
    min_workers: int = 0
    max_workers: int = 0
    resize_to: int = 0
    # What the size counts: a Serve deployment (raydeck.scheduling.queue.serve_apps) counts
    # replicas, its range its autoscaling bounds, ``resize_to`` the ceiling the queue holds it to.
    unit: str = "workers"
    # How its last attempt ended: the driver's exit code and, for a failure, its log's end.
    exit_code: int | None = None
    log_tail: str = ""

    @classmethod
    def of(cls, row: JobRow) -> JobView:
        elastic = row.max_workers > 0
        return cls(row.id, row.team, row.priority, row.cpus, row.gpus, row.preset, row.key,
                   row.entrypoint, row.estimate_s, row.state, row.reason, row.submitted_at,
                   row.started_at, row.ended_at, row.submission_id, row.preemptions,
                   row.user, row.host, row.workers if elastic else 0, row.min_workers,
                   row.max_workers, row.resize_to, exit_code=row.exit_code,
                   log_tail=row.log_tail)

    @property
    def size(self) -> str:
        """An elastic job's size in words: ``workers 1 of 1-2`` (``-> 2`` when it restarts at
        2 from its next checkpoint); "" for a fixed gang (a Serve deployment's: ``replicas
        2``)."""
        if not self.max_workers:
            return f"{self.unit} {self.workers}" if self.workers else ""
        resizing = f" -> {self.resize_to}" if self.resize_to else ""
        return f"{self.unit} {self.workers} of {self.min_workers}-{self.max_workers}{resizing}"
