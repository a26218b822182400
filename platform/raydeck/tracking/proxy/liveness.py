"""Asking Ray which of a run's processes are gone, for the router's reaper.

Owns: :func:`ray_liveness`. The router (:mod:`raydeck.tracking.proxy.router`) suspects a process
that missed heartbeats; Ray's control store says whether its job ended or its actor died.
"""

from __future__ import annotations

from raydeck.tracking.messages import ProcessInfo


def ray_liveness(processes: list[ProcessInfo], suspects: list[ProcessInfo]) -> set[str]:
    """Which participants Ray says are gone: their job ended, or (suspects) their actor died.

    Asking Ray (its control store) instead of trusting silence alone means a process that is
    alive but slow to beat is never dropped, and a killed actor is dropped within seconds.
    """
    import ray._private.state as ray_state

    result: set[str] = set()
    try:
        dead_jobs = {job["JobID"] for job in ray_state.jobs() if job.get("IsDead")}
    except Exception:
        dead_jobs = set()
    for process in processes:
        if process.job_id in dead_jobs:
            result.add(process.role_key)
    for process in suspects:
        if process.actor_id is None or process.role_key in result:
            continue
        try:
            info = ray_state.state.actor_table(process.actor_id)
        except Exception:
            continue
        if info and info.get("State") == "DEAD":
            result.add(process.role_key)
    return result
