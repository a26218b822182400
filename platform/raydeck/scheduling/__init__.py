"""Scheduling jobs on a shared cluster: policies, a trace simulator and the job queue.

Modules: :mod:`~raydeck.scheduling.policies` (FIFO, priority with aging, shortest job first,
fair share with quotas, EASY backfill, preemption victims, placement-aware admission; one
interface), :mod:`~raydeck.scheduling.attained_service` (Tiresias' LAS and Gittins),
:mod:`~raydeck.scheduling.simulator` (replaying a trace through a policy without Ray),
:mod:`~raydeck.scheduling.replay_report` (what a replay returns, and the figures per policy),
:mod:`~raydeck.scheduling.trace` (the trace format; seeded heavy-tailed traces),
:mod:`~raydeck.scheduling.elastic` (elastic jobs: scaling curves, when they shrink and grow), the
queue (:mod:`~raydeck.scheduling.queue`, its store, actor, client and
job server), :mod:`~raydeck.scheduling.history` (earlier durations of a job, from MLflow) and
the queue's side of preemption (a job's side, the signal it reads, is
:mod:`raydeck.preemption`).
"""

from raydeck.scheduling.attained_service import Gittins, LeastAttainedService
from raydeck.scheduling.policies import (
    Backfill,
    Capacity,
    FairShare,
    Fifo,
    Policy,
    Preemption,
    PriorityAging,
    QueuedJob,
    RunningJob,
    ShortestJobFirst,
    make_policy,
)
from raydeck.scheduling.replay_report import Report, Scheduled
from raydeck.scheduling.resources import Gang, Resources
from raydeck.scheduling.simulator import RESTART_OVERHEAD_S, PreemptionCost, simulate
from raydeck.scheduling.trace import TraceJob, generate_trace, read_trace, write_trace

__all__ = [
    "RESTART_OVERHEAD_S", "Backfill", "Capacity", "FairShare", "Fifo", "Gang", "Gittins",
    "LeastAttainedService", "Policy", "Preemption", "PreemptionCost", "PriorityAging",
    "QueuedJob", "Report", "Resources", "RunningJob", "Scheduled", "ShortestJobFirst", "TraceJob",
    "generate_trace", "make_policy", "read_trace", "simulate", "write_trace",
]
