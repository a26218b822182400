"""Scheduling jobs on a shared cluster: policies and a trace simulator.

Modules: :mod:`~raydeck.scheduling.policies` (FIFO, priority with aging, shortest job first,
fair share with quotas, EASY backfill; one interface) and :mod:`~raydeck.scheduling.simulator`
(replaying a trace through a policy without Ray; seeded heavy-tailed traces).
"""

from raydeck.scheduling.policies import (
    Backfill,
    FairShare,
    Fifo,
    Policy,
    PriorityAging,
    QueuedJob,
    Resources,
    RunningJob,
    ShortestJobFirst,
    make_policy,
)
from raydeck.scheduling.simulator import (
    Report,
    Scheduled,
    TraceJob,
    generate_trace,
    read_trace,
    simulate,
    write_trace,
)

__all__ = [
    "Backfill", "FairShare", "Fifo", "Policy", "PriorityAging", "QueuedJob", "Report",
    "Resources", "RunningJob", "Scheduled", "ShortestJobFirst", "TraceJob", "generate_trace",
    "make_policy", "read_trace", "simulate", "write_trace",
]
