"""What the router tells about a run: a tracker's binding and the shard's ``open`` updates.

Owns: :func:`binding` (the :class:`~raydeck.tracking.messages.RunBinding` a tracker gets: where
its values go, whether it is the primary, whether it samples its node's system metrics) and the
:class:`~raydeck.tracking.messages.OpenRun` updates that create or reopen a run
(:func:`open_run`) and a ``per_rank`` run's child (:func:`open_child`). Does not own: membership
or any decision about it (:mod:`raydeck.tracking.proxy.router`), the caller passes the run's
shard (``shard``) and holds the router's lock.
"""

from __future__ import annotations

from raydeck.tracking.messages import AttachRequest, OpenRun, ProcessInfo, RunBinding
from raydeck.tracking.proxy.membership import Run
from raydeck.tracking.proxy.outbox import Control

RANK_TAGS = ("raydeck.rank", "raydeck.node", "raydeck.role")


def open_run(run: Run, artifact_location: str, shard: int) -> list[Control]:
    """The update that creates or reopens ``run`` in MLflow, if it needs one (once)."""
    if not run.needs_open:
        return []
    run.needs_open = False
    tags = {"raydeck.created_by": run.created_by_role}
    if run.job_id:
        tags["raydeck.ray_job_id"] = run.job_id
    spec = OpenRun(key=run.key, name=run.name, experiment=run.experiment,
                   artifact_location=artifact_location, mode=run.mode, tags=tags,
                   parent_key=run.parent_key)
    return [Control(shard, run.key, "open", spec)]


def open_child(run: Run, process: ProcessInfo, artifact_location: str,
               shard: int) -> Control | None:
    """The update that opens ``process``'s per-rank child of ``run``, if it is not open."""
    rank = process.world_rank
    if run.mode != "per_rank" or rank is None or run.children.get(rank):
        return None
    run.children[rank] = True
    spec = OpenRun(
        key=f"{run.key}.rank_{rank}", name=f"{run.name}-rank{rank}", experiment=run.experiment,
        artifact_location=artifact_location, mode=run.mode,
        tags=dict(zip(RANK_TAGS, (str(rank), process.node_ip, process.role), strict=True)),
        parent_key=run.key)
    return Control(shard, spec.key, "open", spec)


def guest_binding(run: Run, request: AttachRequest, shard: int) -> RunBinding:
    """A guest's binding: the run's, as a process that is not a participant sees it (a silent
    rank of a ``rank_zero`` run writes nothing, as a participant would)."""
    silent = run.mode == "rank_zero" and not request.process.is_primary_candidate
    return binding(run, request, shard, active=not silent)


def binding(run: Run, request: AttachRequest, shard: int, active: bool) -> RunBinding:
    """``request``'s binding to ``run``; an active participant may become its node's system
    metrics sampler (recorded in ``run.samplers``)."""
    process = request.process
    run_key = run.key
    sample_system = False
    if active and not request.guest:
        if run.mode == "per_rank" and process.world_rank is not None:
            run_key = f"{run.key}.rank_{process.world_rank}"
        sampler = run.samplers.get(process.node_ip)
        sample_system = sampler is None or sampler not in run.participants
        if sample_system:
            run.samplers[process.node_ip] = request.client_id
    return RunBinding(
        run_key=run_key, params_run_key=run.key,
        run_id=run.run_id if run_key == run.key else "",
        experiment=run.experiment, run_name=run.name, mode=run.mode,
        shard_index=shard,
        is_primary=run.primary == request.client_id,
        # Created by this process only if its attach opened a run new to MLflow; every other
        # attach (another process, or this run's process again after it left, as a restarted
        # Tune trial does) resumes a run that exists or is being opened.
        created=not run.existed and run.first_client == request.client_id,
        resumed=run.existed or run.first_client != request.client_id,
        sample_system=sample_system, active=active,
        existing_params=dict(run.params),
    )
