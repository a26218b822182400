"""What ``raydeck queue`` shows for each job: its place, its predicted start and why it waits,
and under an attained-service policy (``las``, ``gittins``) the service it has had and where
that ranks it (:func:`service`).

Owns: :class:`Entry`, the explanations (:func:`why_waiting`), the predicted starts (the policy
replayed by the simulator, :func:`predicted_starts`) and the rule that a strict gang starts
alone (:func:`held_back`), which the queue's tick applies too. Pure functions of what the queue
read: no store, no job server.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING

from raydeck.errors import ConfigError
from raydeck.scheduling.policies.attained_service import AttainedService, service_unit
from raydeck.scheduling.policies.core import (
    Capacity,
    Policy,
    QueuedJob,
    Resources,
    RunningJob,
    team_usage,
)
from raydeck.scheduling.queue.job_view import JobView
from raydeck.scheduling.queue.jobspec import Team

if TYPE_CHECKING:  # the queue's clients import this module without SQLAlchemy (job_view.py)
    from raydeck.scheduling.queue.store import JobRow


@dataclass(frozen=True)
class Entry:
    """One job in ``raydeck queue``: where it is and why it waits; ``service`` (e.g. ``1.5
    GPU-h``) and ``rank`` (``Q0 of 3``, ``index 0.5 per GPU-h``): what an attained-service
    policy ranks it by, empty under the others."""

    job: JobView
    position: int | None
    predicted_start_s: float | None
    why: str
    service: str = ""
    rank: str = ""


def explain(rows: Mapping[str, JobRow], ordered: list[QueuedJob], active: list[JobRow],
            running: list[RunningJob], free: Capacity, claiming: list[QueuedJob],
            teams: Mapping[str, Team], policy: Policy, predicted: Mapping[str, float],
            now: float) -> list[Entry]:
    """The started jobs (``active``, as ``running``), then the queued ones (``rows`` by id) in
    ``ordered`` (start order), each with why it waits: its submission's retry, the job it was
    preempted for, or :func:`why_waiting`; ``predicted``: their predicted starts; each with
    its :func:`service` under ``policy`` at ``now``."""
    entries = [Entry(JobView.of(r), None, r.started_at,
                     r.reason if r.state == "preempting" else r.state,
                     *service(policy, piece.job, piece.started_s, now))
               for r, piece in zip(active, running, strict=True)]
    for position, job in enumerate(ordered, start=1):
        row = rows[job.id]
        if row.retry_at is not None:  # retries later
            why = row.reason
        elif row.preempted_for in rows:
            why = f"waits for {row.preempted_for} to start (it was preempted for it)"
        else:
            why = why_waiting(job, ordered, running, free, claiming, teams, policy.name)
        if row.preemptions:
            why += f" (preempted {row.preemptions}x; resumes from its checkpoint)"
        entries.append(Entry(JobView.of(row), position, predicted.get(job.id), why,
                             *service(policy, job, None, now)))
    return entries


def service(policy: Policy, job: QueuedJob, started_s: float | None, now: float
            ) -> tuple[str, str]:
    """The service ``job`` has had (running since ``started_s``, None: queued) at ``now`` and
    its rank in words, when ``policy`` ranks by attained service; else ``("", "")``."""
    if not isinstance(policy, AttainedService):
        return "", ""
    attained = policy.attained(job, started_s, now)
    return (f"{attained / 3600:.2f} {service_unit(job.needs)}-h",
            policy.describe_rank(job, attained))


def why_waiting(job: QueuedJob, ordered: list[QueuedJob], running: list[RunningJob],
                free: Capacity, claiming: list[QueuedJob], teams: Mapping[str, Team],
                policy: str) -> str:
    """Why queued ``job`` has not started: its team's quota, the free resources, no node
    placement, the jobs ahead of it in ``policy`` order, or a strict gang being placed."""
    team = teams.get(job.team)
    if team is not None and team.quota is not None:
        used = team_usage(job.team, running)
        if not team.quota.fits(used + job.needs):
            return (f"needs {job.needs.describe()}; team {job.team} uses {used.describe()} "
                    f"of its {team.quota.describe()}")
    if not free.pool.fits(job.needs):
        return (f"needs {job.needs.describe()}; {free.pool.gpus:g} GPU, "
                f"{free.pool.cpus:g} CPU free")
    if not free.fits(job) and job.gang is not None:
        return (f"needs {job.gang.describe()}: fits the free total, but no node "
                f"placement holds it now ({free.describe_nodes()} free)")
    ahead = ordered[:ordered.index(job)]
    if ahead:
        return f"behind {ahead[0].id} ({policy} order)"
    if held_back(job, claiming):
        return (f"waits for Ray to place {', '.join(j.id for j in claiming)} first (a "
                "STRICT_ gang starts alone)")
    return "starts at the next tick"


def predicted_starts(policy: Policy, ordered: list[QueuedJob], running: list[RunningJob],
                     total: Resources, now: float) -> dict[str, float]:
    """When each queued job should start: a copy of ``policy`` (the replay charges its usage,
    and the listing shows the service ``policy`` knows) replayed with running jobs ending at
    their estimates and no new arrivals."""
    from raydeck.scheduling.simulator.replay import simulate
    from raydeck.scheduling.simulator.trace import TraceJob

    ahead = [TraceJob(r.job.id, now, max(r.expected_end_s - now, 0.0), r.job.needs,
                      r.job.team, 0) for r in running]
    trace = ahead + [TraceJob(j.id, j.submitted_s, j.estimate_s, j.needs, j.team,
                              j.priority, j.estimate_s, attained_s=j.attained_s)
                     for j in ordered]
    try:
        schedule = simulate(trace, copy.deepcopy(policy), total, pinned=[a.id for a in ahead])
    except ConfigError:
        return {}
    pinned = {a.id for a in ahead}
    return {s.job.id: max(s.start_s, now) for s in schedule if s.job.id not in pinned}


def strict(job: QueuedJob) -> bool:
    """A gang whose placement depends on which nodes Ray chose for the jobs beside it."""
    return job.gang is not None and job.gang.strategy.startswith("STRICT_")


def held_back(job: QueuedJob, claiming: list[QueuedJob]) -> bool:
    """Whether ``job`` waits for Ray to place the ``claiming`` jobs: a strict gang starts
    alone (see :mod:`raydeck.scheduling.queue.job_queue`)."""
    return any(map(strict, claiming)) or (bool(claiming) and strict(job))
