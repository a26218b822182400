"""The live queue's elastic jobs: the size a starting one gets, which running ones shrink for the
first waiting job (before any job is preempted) and which grow back into room no waiting job can
use.

Owns: :func:`make_room` (shrink, else preempt, for the first waiting job; or grow),
:func:`start_sizes`, :func:`shrinks` and :func:`grows`, which turn the queue's rows and the
policy's views into the inputs of :func:`raydeck.scheduling.policies.elastic.shrink` and
:func:`~raydeck.scheduling.policies.elastic.grow` (the rules, which the simulator carries out too)
and
return their answers; and :func:`at`, a queued job counted at another size. Pure functions of
what the queue read. The queue (:mod:`raydeck.scheduling.queue.job_queue`) records each answer as a
request the job learns at its next checkpoint, as a preemption is
(:mod:`raydeck.tracking.client.preemption`), and relaunches the job at once at its new size when it
stopped there (:func:`~raydeck.scheduling.queue.reconcile.verdict`'s ``relaunch``); the job's driver
keeps Ray Train within the size the queue allowed (``RAYDECK_QUEUE_WORKERS``,
:func:`raydeck.train.trainer.fit`).

Only jobs that may be preempted (:func:`~raydeck.scheduling.policies.preemption.preemptible`: a
checkpoint committed in this attempt, and a restarted attempt's minimum run) are resized, so a
resize, like a preemption, never loops. A Serve deployment the queue may bound
(:class:`~raydeck.scheduling.queue.serve_apps.ServeApp`) is one more elastic job in the same rules,
sized by its replica ceiling: its replicas above its minimum are given back first (priority 0,
no work lost), before any job is preempted, and its ceiling is raised back last. A growth is
decided on the pool and then cut to the workers Ray can place now: the added workers' bundles
must fit what the nodes have free, under the gang's strategy (Ray places the restarted gang; its
present workers' room is its own). Which node a ``STRICT_PACK`` gang runs on is Ray's, so its
added workers are only checked to fit one node.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from raydeck.scheduling.policies import elastic
from raydeck.scheduling.policies.core import Capacity, Policy, QueuedJob, RunningJob
from raydeck.scheduling.policies.preemption import preempt, preemptible
from raydeck.scheduling.policies.resources import Gang, Resources
from raydeck.scheduling.queue.reconcile import holds
from raydeck.scheduling.queue.serve_apps import TEAM, ServeApp
from raydeck.scheduling.queue.store import JobRow


def at(job: QueuedJob, workers: int) -> QueuedJob:
    """``job`` (an elastic gang) counted at ``workers`` workers."""
    assert job.gang is not None
    gang = job.gang.at(workers)
    return dataclasses.replace(job, gang=gang, needs=gang.needs)


def _resizable(piece: RunningJob, gang: Gang, minimum: int) -> elastic.Resizable:
    return elastic.Resizable(piece, gang.workers, elastic.Elasticity(gang.max_workers, minimum),
                             gang.at(gang.max_workers).needs)


def start_sizes(policy: Policy, starting: Sequence[QueuedJob], waiting: Sequence[QueuedJob],
                running: Sequence[RunningJob], free: Capacity, now: float) -> dict[str, int]:
    """The size each elastic job of ``starting`` (the policy's choice, each at its minimum, in
    start order on ``free``) starts at: the largest
    :func:`~raydeck.scheduling.policies.elastic.grow` gives it when none of ``waiting`` could use
    the room, within which it and every job after it are still placed whole; else its minimum."""
    left = free
    for job in starting:
        after = left.after(job)
        assert after is not None, "the policy placed it on this same capacity"
        left = after
    fresh = [RunningJob(job, now) for job in starting]
    resizable = [_resizable(piece, piece.job.gang, piece.job.gang.workers) for piece in fresh
                 if piece.job.gang is not None and piece.job.gang.elastic]
    proposed = dict(elastic.grow(policy, waiting, [*running, *fresh], resizable, left.pool, now,
                                 lambda job: True))
    sizes: dict[str, int] = {}
    capacity = free
    for index, job in enumerate(starting):
        if job.gang is None or not job.gang.elastic:
            placed = capacity.after(job)
        else:
            size = proposed.get(job.id, job.gang.workers)
            while size > job.gang.workers and not _placed(capacity, [at(job, size),
                                                                     *starting[index + 1:]]):
                size -= 1
            sizes[job.id] = size
            placed = capacity.after(at(job, size))
        assert placed is not None
        capacity = placed
    return sizes


def _placed(capacity: Capacity, jobs: Sequence[QueuedJob]) -> bool:
    """Whether ``jobs`` are all placed whole on ``capacity``, in order."""
    for job in jobs:
        left = capacity.after(job)
        if left is None:
            return False
        capacity = left
    return True


def resizable(rows: Mapping[str, JobRow], running: Sequence[RunningJob]
              ) -> list[elastic.Resizable]:
    """The elastic jobs of ``running`` (views of the queue's ``rows``, by id) as
    :mod:`~raydeck.scheduling.policies.elastic` decides on them (a job started in this tick has no
    row there and no checkpoint: it is not resized)."""
    found = []
    for piece in running:
        row = rows.get(piece.job.id)
        if row is not None and row.elastic and piece.job.gang is not None:
            found.append(_resizable(piece, piece.job.gang, row.min_workers))
    return found


def serving(app: ServeApp, now: float) -> elastic.Resizable:
    """Serve deployment ``app`` as an elastic job sized by its replicas, at most its ceiling
    (those above it are being given back), between its floor and its own maximum; it may be
    resized at any time (a ceiling loses no work)."""
    size = min(app.replicas, app.ceiling)
    piece = RunningJob(QueuedJob(app.id, TEAM, 0, app.holds(size), now, 0.0), now, now)
    return elastic.Resizable(piece, size, elastic.Elasticity(app.max_replicas, app.floor),
                             app.holds(app.max_replicas))


def shrinks(policy: Policy, waiting: Sequence[QueuedJob], running: Sequence[RunningJob],
            rows: Mapping[str, JobRow], free: Resources, now: float, min_run_s: float,
            serve: Sequence[elastic.Resizable] = ()
            ) -> tuple[QueuedJob | None, list[tuple[str, int]]]:
    """:func:`raydeck.scheduling.policies.elastic.shrink` over the queue's running elastic jobs that
    may be preempted and the ``serve`` deployments (:func:`serving`); ``running`` and ``free`` leave
    out, and count as free, what jobs already stopping or shrinking give back."""
    return elastic.shrink(policy, waiting, running, [*resizable(rows, running), *serve], free,
                          now, lambda job: preemptible(job.running, now, min_run_s))


def grows(policy: Policy, waiting: Sequence[QueuedJob], running: Sequence[RunningJob],
          rows: Mapping[str, JobRow], free: Resources, now: float, min_run_s: float,
          serve: Sequence[elastic.Resizable] = ()) -> list[tuple[str, int]]:
    """:func:`raydeck.scheduling.policies.elastic.grow` over the queue's running elastic jobs that
    may be preempted and the ``serve`` deployments: which grow into ``free``, and to what size."""
    return elastic.grow(policy, waiting, running, [*resizable(rows, running), *serve], free,
                        now, lambda job: preemptible(job.running, now, min_run_s))


@dataclass(frozen=True)
class Room:
    """What :func:`make_room` decided: ``resizes`` (``(id, new size)``) and ``victims`` (ids to
    stop), each at its next checkpoint, for waiting ``job``; or, with no ``job``, ``resizes``
    that grow elastic jobs into room no waiting job can use. ``ceilings``: Serve deployments'
    new ``max_replicas`` (lower for ``job``, else raised). Empty: nothing to do."""

    job: QueuedJob | None = None
    resizes: tuple[tuple[str, int], ...] = ()
    victims: tuple[str, ...] = ()
    ceilings: tuple[tuple[ServeApp, int], ...] = ()


def make_room(policy: Policy, waiting: Sequence[QueuedJob], preempted_for: Mapping[str, str],
              running: Sequence[RunningJob], rows: Mapping[str, JobRow], free: Capacity,
              now: float, min_run_s: float, serve: Sequence[ServeApp] = ()) -> Room:
    """For the first of ``waiting`` (less the victims ``preempted_for`` holds back) that cannot
    start on ``free``: shrink elastic jobs and lower Serve ceilings if that makes it fit
    (:func:`shrinks`), else stop the policy's victims
    (:func:`~raydeck.scheduling.policies.preemption.preempt`). With nothing to make room for and
    no job stopping or resizing (room being made belongs to the job it is made for), grow
    elastic jobs and raise lowered ceilings (:func:`grows`), each job's growth cut to what its
    nodes have free (:func:`placed_growths`).

    ``running``: the started jobs as the policy sees them, ``rows`` the queue's active rows by
    id; a job asked to stop counts as gone, one asked to shrink as its new size; ``serve``: the
    cluster's Serve deployments (their replicas above a lowered ceiling count as given back;
    those Serve is stopping are in ``free`` already: :func:`~raydeck.scheduling.reconcile.
    free_capacity`).
    """
    stopping = {job_id for job_id, row in rows.items() if row.state == "preempting"}
    pool = free.pool
    for job_id in stopping:
        row = rows[job_id]
        kept = row.sized(row.resize_to) if row.resize_to else {}
        pool = pool + holds(row) - Resources(kept.get("cpus", 0.0), kept.get("gpus", 0.0))
    apps = {app.id: app for app in serve if app.elastic}
    for app in apps.values():
        pool = pool + app.holds(max(app.replicas - app.ceiling, 0))
    others = [piece for piece in running if piece.job.id not in stopping]
    queue = [job for job in waiting if job.id not in preempted_for]
    if queue:
        head, shrunk = shrinks(policy, queue, others, rows, pool, now, min_run_s,
                               [serving(app, now) for app in apps.values()])
        if shrunk:
            resizes, lowered = _split(shrunk, apps)
            return Room(head, resizes, ceilings=lowered)
        decision = preempt(policy, queue, others, pool, now, min_run_s)
        if decision is not None:
            return Room(decision.job, victims=tuple(v.job.id for v in decision.victims))
    if stopping or preempted_for:
        return Room()
    grown = grows(policy, queue, others, rows, pool, now, min_run_s,
                  [serving(app, now) for app in apps.values() if app.lowered])
    resizes, ceilings = _split(grown, apps)
    return Room(resizes=placed_growths(resizes, others, free),
                ceilings=tuple((app, size) for app, size in ceilings if size > app.ceiling))


def placed_growths(sizes: Sequence[tuple[str, int]], running: Sequence[RunningJob],
                   free: Capacity) -> tuple[tuple[str, int], ...]:
    """Each growth of ``sizes`` (``(id, new size)`` of jobs in ``running``) cut to the largest
    whose added workers are placed on ``free``'s nodes now, in order, each taking its room;
    those left with nothing to add are dropped. Without per-node figures, ``sizes`` as they are.
    """
    if not free.nodes:
        return tuple(sizes)
    jobs = {piece.job.id: piece.job for piece in running}
    placed = []
    for job_id, size in sizes:
        job = jobs[job_id]
        assert job.gang is not None, "only elastic gangs grow"
        added = size - job.gang.workers
        while added > 0 and (left := free.after(at(job, added))) is None:
            added -= 1
        if added > 0:
            assert left is not None
            free = left
            placed.append((job_id, job.gang.workers + added))
    return tuple(placed)


def _split(sizes: Sequence[tuple[str, int]], apps: Mapping[str, ServeApp]
           ) -> tuple[tuple[tuple[str, int], ...], tuple[tuple[ServeApp, int], ...]]:
    """``sizes`` as ``(job resizes, Serve ceilings)``: the ids of ``apps`` are deployments."""
    return (tuple((job_id, size) for job_id, size in sizes if job_id not in apps),
            tuple((apps[job_id], size) for job_id, size in sizes if job_id in apps))
