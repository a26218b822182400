"""The queue's home: one detached, named Ray actor on the head node, ticking.

Owns: :class:`QueueActor` (a :class:`~raydeck.scheduling.queue.job_queue.JobQueue` with a thread
that ticks every ``RAYDECK_QUEUE_TICK_S``, 2 s by default) and :func:`queue_handle`, which finds it
or starts it. The actor restarts after a crash (``max_restarts=-1``) and reads everything from its
database, so killing it loses and duplicates nothing; its database is SQLite in the head's
``RAYDECK_DATA_DIR`` unless ``RAYDECK_QUEUE_DATABASE_URL`` (on the head) names another
(PostgreSQL). It reads its settings from the head's environment, like Ray's own processes, and
its admins from ``queue-admins`` in that data dir
(:class:`~raydeck.scheduling.queue.access.AdminsFile`).

Calls answer ``(True, value)`` or ``(False, message)``: a refusal is one line for the CLI, not
a Ray traceback. Calls that change a job or the configuration carry the caller's
:class:`~raydeck.scheduling.queue.identity.Identity` (a submission: its spec's submitter), which the
queue checks (:mod:`raydeck.scheduling.queue.access`); a job's own calls carry its attempt's
token instead. Calls run concurrently
(``max_concurrency``) with the tick: the queue's own lock is never held across a call to the
job server or MLflow (:mod:`raydeck.scheduling.queue.job_queue`), and every job-server call is
bounded (:class:`~raydeck.scheduling.queue.launcher.TimedLauncher`). The actor talks to the job
server of the cluster it runs on, found from its head, for Serve's REST API on the same dashboard
too (:class:`~raydeck.scheduling.queue.serve_apps.RayServe`); the job server a CLI call passes is
only a hint for that call (:mod:`raydeck.scheduling.queue.job_server`).
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from raydeck._internal.contract import QUEUE_ACTOR_NAME
from raydeck.errors import ConfigError, RaydeckError
from raydeck.jobs.submission import JobServer
from raydeck.scheduling.queue.config_change import ConfigChange
from raydeck.scheduling.queue.identity import Identity
from raydeck.scheduling.queue.job_server import QueueServer
from raydeck.scheduling.queue.launcher import Observer
from raydeck.scheduling.queue.serve_apps import RayServe

if TYPE_CHECKING:  # the queue's clients import this module without SQLAlchemy (job_view.py)
    from raydeck.scheduling.queue.store import JobRow

logger = logging.getLogger(__name__)

ACTOR_NAME = QUEUE_ACTOR_NAME
DATABASE_URL_ENV = "RAYDECK_QUEUE_DATABASE_URL"


class QueueActor:
    """The queue actor (created through :func:`queue_handle`)."""

    def __init__(self) -> None:
        from raydeck.config.settings import load_settings
        from raydeck.scheduling.queue.access import ADMINS_FILE, AdminsFile
        from raydeck.scheduling.queue.history import MlflowHistory
        from raydeck.scheduling.queue.job_queue import JobQueue
        from raydeck.scheduling.queue.launcher import TimedLauncher
        from raydeck.scheduling.queue.ray_jobs import RayJobs
        from raydeck.scheduling.queue.store import Store
        from raydeck.scheduling.queue.witness import MlflowRuns

        logging.getLogger("raydeck").setLevel(logging.INFO)
        settings = load_settings()
        settings.data_dir.mkdir(parents=True, exist_ok=True)
        url = os.environ.get(DATABASE_URL_ENV) or f"sqlite:///{settings.data_dir / 'queue.db'}"
        tracking = settings.tracking.enabled
        # The job server of the cluster the actor runs on (its head), never a caller's.
        self._servers = QueueServer()
        history = MlflowHistory(settings.tracking.uri) if tracking else None
        self._queue = JobQueue(
            Store(url), TimedLauncher(RayJobs(self._servers)), observer=QueueMetrics(),
            history=history, run_finished=MlflowRuns(settings.tracking.uri) if tracking else None,
            cluster=history.cluster if history is not None else None,
            serve=RayServe(self._servers),
            admins=AdminsFile(settings.data_dir / ADMINS_FILE))
        self._stop = threading.Event()
        self._tick_s = settings.queue_tick_s
        threading.Thread(target=self._loop, name="raydeck-queue-tick", daemon=True).start()

    def _loop(self) -> None:
        while not self._stop.wait(self._tick_s):
            try:
                started = self._queue.tick()
                if started:
                    logger.info("started %s", ", ".join(started))
            except Exception:
                # The job server or the database is briefly unreachable: try at the next tick.
                logger.exception("queue tick failed; retrying in %.0f s", self._tick_s)

    def _call(self, fn: Callable[[], Any], server: JobServer | None = None
              ) -> tuple[bool, Any]:
        """``fn()``'s answer; ``server``: the caller's job server, a hint for this call only
        (:meth:`~raydeck.scheduling.queue.job_server.QueueServer.hinted`)."""
        try:
            with self._servers.hinted(server):
                return True, fn()
        except RaydeckError as exc:
            return False, str(exc)

    def submit(self, spec: Any, package: bytes | None, server: JobServer | None = None
               ) -> tuple[bool, Any]:
        return self._call(lambda: self._queue.submit(spec, package), server)

    def cancel(self, job_id: str, who: Identity, server: JobServer | None = None
               ) -> tuple[bool, Any]:
        return self._call(lambda: self._queue.cancel(job_id, who), server)

    def reprioritize(self, job_id: str, priority: int, who: Identity,
                     server: JobServer | None = None) -> tuple[bool, Any]:
        return self._call(lambda: self._queue.reprioritize(job_id, priority, who), server)

    def listing(self, server: JobServer | None = None, ended: bool = False
                ) -> tuple[bool, Any]:
        return self._call(lambda: (self._queue.describe(), self._queue.listing(ended)), server)

    def configure(self, change: ConfigChange, who: Identity, server: JobServer | None = None
                  ) -> tuple[bool, Any]:
        """Apply ``change`` (validated again here: the caller's check is not trusted)."""
        return self._call(lambda: self._queue.configure(
            who, change.policy, change.aging_s, change.teams, change.thresholds_s,
            change.min_run_s), server)

    def tick(self) -> tuple[bool, Any]:
        return self._call(self._queue.tick)

    # A job's own calls: ``token`` is its attempt's (raydeck.tracking.client.preemption).
    def checkpointed(self, job_id: str, token: str) -> tuple[bool, Any]:
        return self._call(lambda: self._queue.checkpointed(job_id, token))

    def preempted(self, job_id: str, token: str) -> tuple[bool, Any]:
        return self._call(lambda: self._queue.preempted(job_id, token))

    def completed(self, job_id: str, token: str) -> tuple[bool, Any]:
        return self._call(lambda: self._queue.completed(job_id, token))


class QueueMetrics(Observer):
    """The queue's reports as Prometheus metrics (raydeck.observability.metrics ``QUEUE_*``)."""

    def __init__(self) -> None:
        super().__init__()
        from raydeck.observability.metrics import (
            QUEUE_DURATION_RATIO,
            QUEUE_JOBS,
            QUEUE_PREEMPTIONS,
            QUEUE_WAIT,
            counter,
            gauge,
            histogram,
        )

        self._jobs = gauge(QUEUE_JOBS)
        self._wait = histogram(QUEUE_WAIT)
        self._ratio = histogram(QUEUE_DURATION_RATIO)
        self._preemptions = counter(QUEUE_PREEMPTIONS)
        self._seen: set[tuple[str, str]] = set()

    def started(self, row: JobRow, now: float) -> None:
        self._wait.observe(max(now - row.submitted_at, 0.0), {"team": row.team})

    def ended(self, row: JobRow, now: float) -> None:
        if row.started_at is not None and row.estimate_s > 0:
            self._ratio.observe((now - row.started_at) / row.estimate_s, {"team": row.team})

    def preempted(self, row: JobRow, now: float) -> None:
        self._preemptions.inc(1, {"team": row.team})

    def counts(self, by_team_and_state: dict[tuple[str, str], int]) -> None:
        # A team whose jobs all left shows 0, not a stale count.
        for team, state in self._seen | set(by_team_and_state):
            self._jobs.set(by_team_and_state.get((team, state), 0),
                           {"team": team, "state": state})
        self._seen |= set(by_team_and_state)


def queue_handle(namespace: str) -> Any:
    """The running queue actor, or a new one pinned to the head node. The caller is connected
    to the cluster (``raydeck.cluster.connection.connect_existing``)."""
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    try:
        return ray.get_actor(ACTOR_NAME, namespace=namespace)
    except ValueError:
        pass
    head = next((n["NodeID"] for n in ray.nodes()
                 if n["Alive"] and "node:__internal_head__" in n["Resources"]), None)
    options: dict[str, Any] = {
        "name": ACTOR_NAME, "namespace": namespace, "lifetime": "detached",
        "get_if_exists": True, "num_cpus": 0, "max_restarts": -1, "max_concurrency": 8,
    }
    if head is not None:
        options["scheduling_strategy"] = NodeAffinitySchedulingStrategy(head, soft=False)
    return ray.remote(QueueActor).options(**options).remote()


def answer(reply: tuple[bool, Any]) -> Any:
    """The value of a queue call, or its refusal raised as :class:`ConfigError`."""
    ok, value = reply
    if not ok:
        raise ConfigError(str(value))
    return value
