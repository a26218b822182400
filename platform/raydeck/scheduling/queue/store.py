"""The job queue's durable state: one SQL table of jobs and one of settings (SQLAlchemy).

Owns: the schema and every read and write of the queue's state. SQLite in the queue's data
directory by default, PostgreSQL (or any SQLAlchemy URL) when configured. Every state change is
one committed transaction, written *before* the action it records (a job is ``starting`` with
its submission id before it is submitted), so a queue that restarts finds every job and submits
none twice: the job server refuses a second job with the same submission id.
"""

from __future__ import annotations

import json
import secrets
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any, cast

from sqlalchemy import (
    CursorResult,
    Engine,
    Float,
    Integer,
    LargeBinary,
    String,
    Text,
    create_engine,
    delete,
    inspect,
    select,
)
from sqlalchemy.orm import DeclarativeBase, Mapped, Session, mapped_column, sessionmaker
from sqlalchemy.schema import CreateColumn

from raydeck.scheduling.policies.attained_service import CLUSTER_SAMPLES
from raydeck.scheduling.queue.jobspec import JobSpec

# A ``preempting`` job still holds its resources: it was asked to stop at its next checkpoint.
ACTIVE = ("starting", "running", "preempting")
ENDED = ("succeeded", "failed", "stopped", "cancelled")
# The ends the job server reported (a cancelled job was the queue's own doing).
RAN_TO_END = ("succeeded", "failed", "stopped")


class _Base(DeclarativeBase):
    pass


class JobRow(_Base):
    """One queued job and everything the queue knows about it."""

    __tablename__ = "raydeck_queue_jobs"

    id: Mapped[str] = mapped_column(String(160), primary_key=True)
    team: Mapped[str] = mapped_column(String(64))
    priority: Mapped[int] = mapped_column(Integer)
    cpus: Mapped[float] = mapped_column(Float)
    gpus: Mapped[float] = mapped_column(Float)
    preset: Mapped[str] = mapped_column(String(64))
    key: Mapped[str] = mapped_column(String(64), index=True)
    entrypoint: Mapped[str] = mapped_column(Text)
    runtime_env: Mapped[str] = mapped_column(Text)
    metadata_json: Mapped[str] = mapped_column(Text)
    package_uri: Mapped[str] = mapped_column(String(200))
    estimate_s: Mapped[float] = mapped_column(Float)
    state: Mapped[str] = mapped_column(String(16), index=True)
    reason: Mapped[str] = mapped_column(Text, default="")
    submitted_at: Mapped[float] = mapped_column(Float)
    started_at: Mapped[float | None] = mapped_column(Float, nullable=True)
    ended_at: Mapped[float | None] = mapped_column(Float, nullable=True)
    # Each start after a preemption is a new job on the job server (its ids are never reused).
    attempt: Mapped[int] = mapped_column(Integer, default=0, server_default="0")
    preemptions: Mapped[int] = mapped_column(Integer, default=0, server_default="0")
    # The last checkpoint committed in the current attempt (None: none yet).
    checkpoint_at: Mapped[float | None] = mapped_column(Float, nullable=True)
    preempt_at: Mapped[float | None] = mapped_column(Float, nullable=True)
    # The job this one was last preempted for: it does not start again while that one is
    # queued (:mod:`raydeck.scheduling.policies.preemption`); "" when it never was.
    preempted_for: Mapped[str] = mapped_column(String(160), default="", server_default="")
    # When the current attempt's driver reported that training ran to its end (a job told to
    # stop that ends SUCCEEDED without it is taken as preempted).
    completed_at: Mapped[float | None] = mapped_column(Float, nullable=True)
    # The gang: ``workers`` bundles of (cpus, gpus) / workers placed under ``placement``
    # (0 workers: no gang, placed anywhere).
    workers: Mapped[int] = mapped_column(Integer, default=0, server_default="0")
    placement: Mapped[str] = mapped_column(String(16), default="", server_default="")
    # An elastic gang's range (0, 0: a fixed gang). ``workers`` is then the size the queue
    # allows it: its minimum while queued, the size it was started at while it runs, and
    # ``cpus``/``gpus`` hold that size (:meth:`sized`). ``resize_to``: the size it is asked to
    # restart at from its next checkpoint (0: none); ``resizes``: how many times it did.
    min_workers: Mapped[int] = mapped_column(Integer, default=0, server_default="0")
    max_workers: Mapped[int] = mapped_column(Integer, default=0, server_default="0")
    resize_to: Mapped[int] = mapped_column(Integer, default=0, server_default="0")
    resizes: Mapped[int] = mapped_column(Integer, default=0, server_default="0")
    # A queued job whose submission failed transiently (the job server down or busy): its
    # consecutive failures and when it is tried again (None: whenever the policy says).
    submit_failures: Mapped[int] = mapped_column(Integer, default=0, server_default="0")
    retry_at: Mapped[float | None] = mapped_column(Float, nullable=True)
    # Who submitted it: the OS user and host of ``raydeck submit``
    # (raydeck.scheduling.queue.identity; "" for a job queued before they were recorded).
    user: Mapped[str] = mapped_column(String(64), default="", server_default="")
    host: Mapped[str] = mapped_column(String(253), default="", server_default="")
    # How the last attempt ended on the job server: its driver's exit code (None: still
    # running, or Ray did not see it) and, for a failure, the last lines of its log.
    exit_code: Mapped[int | None] = mapped_column(Integer, nullable=True)
    log_tail: Mapped[str] = mapped_column(Text, default="", server_default="")
    # When the queue itself stopped the current attempt (a victim past its grace period): a
    # STOPPED attempt was preempted only then, never when someone else stopped it.
    stopped_at: Mapped[float | None] = mapped_column(Float, nullable=True)
    # When the job server accepted the current attempt's submission (None: not yet, or its
    # answer was lost): a ``starting`` attempt it accepted and then forgot (its head restarted)
    # is run again as a new attempt, never submitted again under the same id.
    accepted_at: Mapped[float | None] = mapped_column(Float, nullable=True)
    # When a checkpoint call of the current attempt was answered "stop" (recorded before the
    # answer leaves the queue): the attempt was told, not only asked.
    told_at: Mapped[float | None] = mapped_column(Float, nullable=True)
    # The current attempt's token (:func:`new_token`): the job gets it in its runtime env
    # (RAYDECK_QUEUE_TOKEN) and sends it with its checkpoints, its stop and its completion, so
    # no other process, nor an earlier attempt, reports them (raydeck.scheduling.queue.access).
    # A new one with each attempt: :func:`queued_row`, and :meth:`Store.update` whenever it
    # changes ``attempt``. "" for a job queued before tokens (it sends none either).
    token: Mapped[str] = mapped_column(String(64), default="", server_default="")
    # The service its attempts that ended had (GPU-seconds; CPU-seconds without GPUs), which
    # ``las`` and ``gittins`` rank by: added to as each attempt ends
    # (raydeck.scheduling.queue.reconcile.attained), never lowered.
    attained_s: Mapped[float] = mapped_column(Float, default=0.0, server_default="0")

    @property
    def submission_id(self) -> str:
        """The job server's id of the current attempt: the queue's id, then ``<id>-r<N>``."""
        return submission_id(self.id, self.attempt)

    @property
    def elastic(self) -> bool:
        return self.max_workers > 0

    def sized(self, workers: int | None = None) -> dict[str, Any]:
        """The columns that change when an elastic job is counted at ``workers`` workers (None:
        its minimum, the size it waits at in the queue); nothing for a fixed gang."""
        if not self.elastic:
            return {}
        size = self.min_workers if workers is None else workers
        return {"workers": size, "cpus": self.cpus / self.workers * size,
                "gpus": self.gpus / self.workers * size}


def queued_row(spec: JobSpec, estimate_s: float, now: float, attempt: int) -> JobRow:
    """The row of ``spec`` queued at ``now`` as attempt ``attempt`` (an elastic gang at its
    minimum), expected to run ``estimate_s``."""
    gang = spec.gang
    return JobRow(id=spec.id, team=spec.team, priority=spec.priority, cpus=spec.needs.cpus,
                  gpus=spec.needs.gpus, preset=spec.preset, key=spec.key,
                  entrypoint=spec.entrypoint, runtime_env=json.dumps(spec.runtime_env),
                  metadata_json=json.dumps(spec.metadata), package_uri=spec.package_uri,
                  estimate_s=estimate_s, state="queued", reason="", submitted_at=now,
                  started_at=None, ended_at=None, attempt=attempt, preemptions=0,
                  checkpoint_at=None, preempt_at=None, submit_failures=0, retry_at=None,
                  workers=gang.workers if gang else 0, placement=gang.strategy if gang else "",
                  min_workers=gang.workers if gang and gang.elastic else 0,
                  max_workers=gang.max_workers if gang else 0,
                  user=spec.submitter.user, host=spec.submitter.host, token=new_token())


def new_token() -> str:
    """A fresh attempt token: 256 random bits, URL-safe (it travels in an env var)."""
    return secrets.token_urlsafe(32)


def submission_id(job_id: str, attempt: int) -> str:
    """The job server's id of attempt ``attempt`` of queued job ``job_id``."""
    return job_id if not attempt else f"{job_id}-r{attempt}"


class PackageRow(_Base):
    """A job's working dir as the zip Ray's job server takes: kept here, because Ray deletes an
    uploaded package that no running job uses, and a queued job may wait for hours."""

    __tablename__ = "raydeck_queue_packages"

    uri: Mapped[str] = mapped_column(String(200), primary_key=True)
    data: Mapped[bytes] = mapped_column(LargeBinary)


class SettingRow(_Base):
    __tablename__ = "raydeck_queue_settings"

    name: Mapped[str] = mapped_column(String(64), primary_key=True)
    value: Mapped[str] = mapped_column(Text)


class Store:
    """The queue's tables behind ``url`` (created if missing)."""

    def __init__(self, url: str) -> None:
        self._engine = create_engine(url, future=True)
        _Base.metadata.create_all(self._engine)
        _add_new_columns(self._engine)
        self._sessions = sessionmaker(self._engine, expire_on_commit=False)

    @contextmanager
    def _session(self) -> Iterator[Session]:
        with self._sessions.begin() as session:
            yield session

    def add(self, row: JobRow, replacing: int | None = None) -> bool:
        """Insert a job; False (and nothing written) if its id is taken. ``replacing``: the
        attempt of an ended job with the same id that the new one replaces (in the same
        transaction: the job is still ended and still at that attempt)."""
        with self._session() as session:
            existing = session.get(JobRow, row.id)
            if existing is not None:
                if replacing is None or existing.state not in ENDED \
                        or existing.attempt != replacing:
                    return False
                session.delete(existing)
                session.flush()
            elif replacing is not None:
                return False
            session.add(row)
            return True

    def jobs(self, *states: str) -> list[JobRow]:
        with self._session() as session:
            query = select(JobRow).order_by(JobRow.submitted_at, JobRow.id)
            if states:
                query = query.where(JobRow.state.in_(states))
            return list(session.scalars(query))

    def ended_since(self, cutoff: float) -> list[JobRow]:
        """The jobs that ended at or after ``cutoff``, by submission time."""
        with self._session() as session:
            return list(session.scalars(
                select(JobRow).where(JobRow.state.in_(ENDED), JobRow.ended_at >= cutoff)
                .order_by(JobRow.submitted_at, JobRow.id)))

    def prune(self, ended_before: float) -> tuple[int, int]:
        """Delete the jobs that ended before ``ended_before``, then the packages no job left
        names; how many of each."""
        with self._session() as session:
            jobs = cast(CursorResult[Any], session.execute(
                delete(JobRow).where(JobRow.state.in_(ENDED), JobRow.ended_at < ended_before)))
            used = select(JobRow.package_uri).where(JobRow.package_uri != "")
            packages = cast(CursorResult[Any], session.execute(
                delete(PackageRow).where(PackageRow.uri.not_in(used))))
            return jobs.rowcount, packages.rowcount

    def get(self, job_id: str) -> JobRow | None:
        with self._session() as session:
            return session.get(JobRow, job_id)

    def update(self, job_id: str, **values: Any) -> None:
        """Set ``values`` on job ``job_id`` (KeyError: no such job); a new ``attempt`` gets a
        new token with it."""
        with self._session() as session:
            row = session.get(JobRow, job_id)
            if row is None:
                raise KeyError(job_id)
            if values.get("attempt", row.attempt) != row.attempt and "token" not in values:
                row.token = new_token()  # a new attempt: the earlier one's token is void
            for name, value in values.items():
                setattr(row, name, value)

    def durations(self, key: str, limit: int = 20) -> list[float]:
        """How long the last ``limit`` successful runs of the same job took."""
        with self._session() as session:
            rows = session.scalars(
                select(JobRow).where(JobRow.key == key, JobRow.state == "succeeded")
                .order_by(JobRow.ended_at.desc()).limit(limit))
            return [r.ended_at - r.started_at for r in rows
                    if r.ended_at is not None and r.started_at is not None]

    def services(self, limit: int = CLUSTER_SAMPLES) -> list[float]:
        """The service the last ``limit`` jobs that ended on the job server (not cancelled)
        attained, oldest first: the cluster's history ``las``' levels adapt to."""
        with self._session() as session:
            values = session.scalars(
                select(JobRow.attained_s).where(JobRow.state.in_(RAN_TO_END),
                                                JobRow.attained_s > 0)
                .order_by(JobRow.ended_at.desc()).limit(limit))
            return list(values)[::-1]

    def add_package(self, uri: str, data: bytes) -> None:
        with self._session() as session:
            if session.get(PackageRow, uri) is None:
                session.add(PackageRow(uri=uri, data=data))

    def package(self, uri: str) -> bytes | None:
        with self._session() as session:
            row = session.get(PackageRow, uri)
            return None if row is None else row.data

    def setting(self, name: str, default: Any) -> Any:
        with self._session() as session:
            row = session.get(SettingRow, name)
            return default if row is None else json.loads(row.value)

    def set_setting(self, name: str, value: Any) -> None:
        with self._session() as session:
            row = session.get(SettingRow, name)
            if row is None:
                session.add(SettingRow(name=name, value=json.dumps(value)))
            else:
                row.value = json.dumps(value)


def _add_new_columns(engine: Engine) -> None:
    """Add the columns a newer raydeck defines to a queue database an older one created
    (``create_all`` makes missing tables only), so an upgrade keeps every queued job; the
    rows get each column's server default."""
    table = _Base.metadata.tables[JobRow.__tablename__]
    have = {column["name"] for column in inspect(engine).get_columns(table.name)}
    with engine.begin() as connection:
        for column in table.columns:
            if column.name not in have:
                spec = CreateColumn(column).compile(dialect=engine.dialect)
                connection.exec_driver_sql(f"ALTER TABLE {table.name} ADD COLUMN {spec}")
