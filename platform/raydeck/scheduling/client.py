"""The queue's client side: what ``raydeck submit --queue``, ``raydeck queue`` and ``raydeck
cancel`` do, as functions.

Owns: turning a :class:`~raydeck.jobs.JobRequest` into a :class:`JobSpec` (the preset's whole
gang as its resources, a key naming "the same job" for duration prediction, and the working dir
zipped here, as Ray's job client would, so the queue can start it hours later), and the calls
to the queue actor. Every function connects to the cluster first.
"""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Any

from raydeck.cluster import connect_running
from raydeck.config import Settings
from raydeck.jobs import JobRequest, JobServer, submitted_metadata, submitted_runtime_env
from raydeck.scheduling.actor import answer, queue_handle
from raydeck.scheduling.policies import Gang
from raydeck.scheduling.queue import DEFAULT_TEAM, Entry, JobSpec
from raydeck.scheduling.store import JobView


def _package(runtime_env: dict[str, Any]) -> tuple[dict[str, Any], str, bytes | None]:
    """The runtime env with its local working dir replaced by the package's URI, the URI and
    the zip's bytes (no package for a working dir that is already a URI)."""
    from ray._private.runtime_env.packaging import create_package, get_uri_for_directory

    working_dir = runtime_env.get("working_dir")
    if not working_dir or "://" in str(working_dir):
        return runtime_env, "", None
    excludes = list(runtime_env.get("excludes", []))
    uri = get_uri_for_directory(str(working_dir), include_gitignore=True, excludes=excludes)
    with tempfile.TemporaryDirectory() as tmp:
        target = Path(tmp) / "package.zip"
        create_package(str(working_dir), target, include_gitignore=True, excludes=excludes)
        data = target.read_bytes()
    # The package already leaves out what `excludes` names.
    packaged = {k: v for k, v in runtime_env.items() if k != "excludes"}
    return {**packaged, "working_dir": uri}, uri, data


def job_spec(request: JobRequest, settings: Settings, team: str, priority: int,
             estimate_s: float | None) -> tuple[JobSpec, bytes | None]:
    """What the queue stores for ``request`` (see the module docstring)."""
    from raydeck.scaling import get_preset

    preset = get_preset(request.preset, settings.presets_file)
    gang = Gang.of(preset)
    runtime_env, uri, data = _package(submitted_runtime_env(request))
    return JobSpec(id=request.submission_id, team=team or DEFAULT_TEAM, priority=priority,
                   preset=request.preset, needs=gang.needs, key=request.digest,
                   entrypoint=request.entrypoint, runtime_env=runtime_env,
                   metadata=submitted_metadata(request), package_uri=uri,
                   estimate_s=estimate_s, gang=gang), data


def enqueue(settings: Settings, server: JobServer, spec: JobSpec, package: bytes | None
            ) -> JobView:
    import ray

    connect_running(settings.ray_address)
    handle = queue_handle(server, settings.ray_namespace)
    return answer(ray.get(handle.submit.remote(spec, package)))


def listing(settings: Settings, server: JobServer, policy: str | None = None,
            aging_s: float | None = None, teams: dict[str, Any] | None = None
            ) -> tuple[str, list[Entry]]:
    """The queue's policy and entries, after applying any new policy or teams."""
    import ray

    connect_running(settings.ray_address)
    handle = queue_handle(server, settings.ray_namespace)
    if policy is not None or aging_s is not None or teams is not None:
        answer(ray.get(handle.configure.remote(policy, aging_s, teams)))
    return answer(ray.get(handle.listing.remote()))


def cancel(settings: Settings, server: JobServer, job_id: str) -> JobView:
    import ray

    connect_running(settings.ray_address)
    handle = queue_handle(server, settings.ray_namespace)
    return answer(ray.get(handle.cancel.remote(job_id)))
