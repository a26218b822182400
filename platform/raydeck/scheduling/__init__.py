"""Scheduling jobs on a shared cluster: policies, a trace simulator and the job queue.

Modules: :mod:`~raydeck.scheduling.policies.core` (FIFO, priority with aging, shortest job first,
fair share with quotas, EASY backfill, preemption victims, placement-aware admission; one
interface), :mod:`~raydeck.scheduling.policies.attained_service` (Tiresias' LAS and Gittins),
:mod:`~raydeck.scheduling.simulator.replay` (replaying a trace through a policy without Ray),
:mod:`~raydeck.scheduling.simulator.report` (what a replay returns, and the figures per policy),
:mod:`~raydeck.scheduling.simulator.trace` (the trace format; seeded heavy-tailed traces),
:mod:`~raydeck.scheduling.policies.elastic` (elastic jobs: scaling curves, when they shrink and
grow), the queue (:mod:`~raydeck.scheduling.queue.job_queue`, its store, actor, client and
job server), :mod:`~raydeck.scheduling.queue.history` (earlier durations of a job, from MLflow) and
the queue's side of preemption (a job's side, the signal it reads, is
:mod:`raydeck.tracking.client.preemption`).
"""

from raydeck.scheduling.policies.attained_service import Gittins, LeastAttainedService
from raydeck.scheduling.policies.core import (
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
)
from raydeck.scheduling.policies.registry import make_policy
from raydeck.scheduling.policies.resources import Gang, Resources
from raydeck.scheduling.simulator.replay import RESTART_OVERHEAD_S, PreemptionCost, simulate
from raydeck.scheduling.simulator.report import Report, Scheduled
from raydeck.scheduling.simulator.trace import TraceJob, generate_trace, read_trace, write_trace

__all__ = [
    "RESTART_OVERHEAD_S", "Backfill", "Capacity", "FairShare", "Fifo", "Gang", "Gittins",
    "LeastAttainedService", "Policy", "Preemption", "PreemptionCost", "PriorityAging",
    "QueuedJob", "Report", "Resources", "RunningJob", "Scheduled", "ShortestJobFirst", "TraceJob",
    "generate_trace", "make_policy", "read_trace", "simulate", "write_trace",
]
