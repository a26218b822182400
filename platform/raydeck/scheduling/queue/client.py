"""The queue's client side: what ``raydeck submit --queue``, ``raydeck queue`` and ``raydeck
cancel`` do, as functions.

Owns: turning a :class:`~raydeck.jobs.submission.JobRequest` into a :class:`JobSpec` (the preset's
whole gang as its resources, a key naming "the same job" for duration prediction, and the working
dir zipped here, as Ray's job client would, so the queue can start it hours later), checking the
runtime env now the way Ray's job client will check it on the head (:func:`head_runtime_env`),
and the calls to the queue actor. Every function that calls the queue connects to the cluster
first, passes its job server (to the actor only a hint, used while it has found no job server
of its own: :mod:`raydeck.scheduling.queue.job_server`) and waits at most ``CALL_TIMEOUT_S`` for
the answer (:func:`call`).
"""

from __future__ import annotations

import copy
import logging
import tempfile
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

from raydeck.cluster.connection import connect_running
from raydeck.config.settings import Settings
from raydeck.errors import ClusterUnavailableError, ConfigError
from raydeck.jobs.submission import JobRequest, JobServer, submitted_metadata, submitted_runtime_env
from raydeck.scheduling.policies.resources import Gang
from raydeck.scheduling.queue.actor import ACTOR_NAME, answer, queue_handle
from raydeck.scheduling.queue.config_change import ConfigChange
from raydeck.scheduling.queue.identity import Identity
from raydeck.scheduling.queue.job_view import JobView
from raydeck.scheduling.queue.jobspec import DEFAULT_TEAM, JobSpec
from raydeck.scheduling.queue.listing import Entry

logger = logging.getLogger(__name__)

# How long ``raydeck jobs`` waits for the queue's answer before listing without it.
REFUSED_TIMEOUT_S = 30.0
# How long a queue command waits for the actor: longer than its slowest answer (a submission
# asks the job server twice, each bounded at 30 s, and MLflow twice, each bounded at 20 s).
CALL_TIMEOUT_S = 150.0
# What to do about a runtime env field the head would refuse (Ray's message says what is wrong).
_FIXES = {
    "py_modules": "use working_dir (it travels with the job) or a remote URI (s3://.../x.zip)",
    "working_dir": "leave large files out (excludes, .gitignore, .rayignore) or use a remote "
                   "zip URI",
    "pip": "list the packages, or name a requirements file that exists here",
    "conda": "name an environment, or a YAML file that exists here",
}


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
    from ray._private.runtime_env import packaging

    # The head uploads the package when the job starts; Ray refuses one this large there.
    if len(data) >= packaging.GCS_STORAGE_MAX_SIZE:
        raise ConfigError(f"runtime env working_dir {working_dir}: its package is "
                          f"{len(data) / 2**20:.0f} MiB, Ray's limit is "
                          f"{packaging.GCS_STORAGE_MAX_SIZE / 2**20:.0f} MiB; "
                          f"{_FIXES['working_dir']}")
    # The package already leaves out what `excludes` names.
    packaged = {k: v for k, v in runtime_env.items() if k != "excludes"}
    return {**packaged, "working_dir": uri}, uri, data


def head_runtime_env(runtime_env: dict[str, Any], head_is_local: bool) -> dict[str, Any]:
    """``runtime_env`` (its working dir already a package URI) as the queue will submit it from
    the head, checked now the way Ray's job client will check it there.

    Ray's job client checks a runtime env on the machine that submits, which for a queued job
    is the queue's actor on the head, hours later. The same checks run here with Ray's own
    functions (what ``JobSubmissionClient.submit_job`` runs before its request, without the
    upload), so a job the head would refuse is refused now. What Ray reads from local files is
    read here and stored as Ray's client sends it (a ``pip`` or ``conda`` file becomes its
    contents), so it travels with the job. A local ``py_modules`` path is read on the head: it
    is checked here when the head is this machine (``head_is_local``), refused otherwise.

    Raises:
        ConfigError: one line naming the field, what is wrong and the fix.
    """
    from ray._private.runtime_env.py_modules import upload_py_modules_if_needed
    from ray._private.runtime_env.working_dir import upload_working_dir_if_needed
    from ray.runtime_env import RuntimeEnv
    from ray.runtime_env.runtime_env import _validate_no_local_paths

    if not head_is_local:
        for module in runtime_env.get("py_modules") or []:
            if "://" not in str(module):
                raise ConfigError(f"runtime env py_modules path {str(module)!r} must exist on "
                                  f"the head, which is not this machine; {_FIXES['py_modules']}")
    probe = copy.deepcopy(runtime_env)
    _ray_check("working_dir", lambda: upload_working_dir_if_needed(
        probe, include_gitignore=True, upload_fn=_no_upload))
    _ray_check("py_modules", lambda: upload_py_modules_if_needed(
        probe, include_gitignore=True, upload_fn=_no_upload))
    for name, value in probe.items():
        _ray_check(name, partial(RuntimeEnv, **{name: value}))
    _ray_check("", lambda: _validate_no_local_paths(RuntimeEnv(**probe)))
    resolved = RuntimeEnv(**runtime_env).to_dict()
    return {name: resolved.get(name, value) for name, value in runtime_env.items()}


def _no_upload(*_: Any, **__: Any) -> None:
    """Ray's upload step, checks only: the queue uploads the package when the job starts."""


def _ray_check(field: str, check: Callable[[], object]) -> None:
    try:
        check()
    except (ValueError, TypeError) as exc:
        where = f"runtime env {field}" if field else "runtime env"
        fix = f"; {_FIXES[field]}" if field in _FIXES else ""
        raise ConfigError(f"{where}: {str(exc).strip().splitlines()[0]}{fix}") from None


def job_spec(request: JobRequest, settings: Settings, team: str, priority: int,
             estimate_s: float | None, head_is_local: bool) -> tuple[JobSpec, bytes | None]:
    """What the queue stores for ``request`` (see the module docstring); ``head_is_local``:
    the cluster's head is this machine (see :func:`head_runtime_env`).

    Raises:
        ConfigError: the head would refuse the job's runtime env, or its preset is unknown.
    """
    from raydeck.train.presets import get_preset

    preset = get_preset(request.preset, settings.presets_file)
    gang = Gang.of(preset)
    packaged, uri, data = _package(submitted_runtime_env(request))
    runtime_env = head_runtime_env(packaged, head_is_local)
    return JobSpec(id=request.submission_id, team=team or DEFAULT_TEAM, priority=priority,
                   preset=request.preset, needs=gang.needs, key=request.digest,
                   entrypoint=request.entrypoint, runtime_env=runtime_env,
                   metadata=submitted_metadata(request), package_uri=uri,
                   estimate_s=estimate_s, gang=gang), data


def enqueue(settings: Settings, server: JobServer, spec: JobSpec, package: bytes | None
            ) -> JobView:
    connect_running(settings.ray_address)
    handle = queue_handle(settings.ray_namespace)
    return call(handle.submit.remote(spec, package, server),
                "; it may still have been queued: `raydeck queue` lists it")


def call(reply: Any, unsure: str = "") -> Any:
    """The value of the queue actor's ``reply`` (an object ref), waited for at most
    ``CALL_TIMEOUT_S``; ``unsure``: what the caller should know when no answer came.

    Raises:
        ClusterUnavailableError: no answer in time (the actor busy or its node down).
        ConfigError: the queue refused the call (its one-line reason).
    """
    import ray
    from ray.exceptions import GetTimeoutError

    try:
        return answer(ray.get(reply, timeout=CALL_TIMEOUT_S))
    except GetTimeoutError:
        raise ClusterUnavailableError(
            f"the queue did not answer within {CALL_TIMEOUT_S:.0f} s (the job server or MLflow "
            f"may be slow to answer it){unsure}; try again") from None


def listing(settings: Settings, server: JobServer, change: ConfigChange | None = None,
            ended: bool = False) -> tuple[str, list[Entry]]:
    """The queue's settings in words (:meth:`~raydeck.scheduling.queue.job_queue.JobQueue.describe`)
    and entries (with ``ended``, the jobs that ended too), after applying ``change`` (as this
    process's OS user)."""
    connect_running(settings.ray_address)
    handle = queue_handle(settings.ray_namespace)
    if change is not None and not change.empty():
        call(handle.configure.remote(change, Identity.here(), server))
    return call(handle.listing.remote(server, ended))


def cancel(settings: Settings, server: JobServer, job_id: str) -> JobView:
    """Cancel ``job_id`` as this process's OS user."""
    connect_running(settings.ray_address)
    handle = queue_handle(settings.ray_namespace)
    return call(handle.cancel.remote(job_id, Identity.here(), server),
                f"; it may still have been cancelled: `raydeck queue` shows {job_id}")


def reprioritize(settings: Settings, server: JobServer, job_id: str, priority: int) -> JobView:
    """Give ``job_id`` a new priority as this process's OS user."""
    connect_running(settings.ray_address)
    handle = queue_handle(settings.ray_namespace)
    return call(handle.reprioritize.remote(job_id, priority, Identity.here(), server))


def never_started(settings: Settings) -> list[JobView]:
    """The queue's jobs that ended without ever becoming a job-server job (the job server
    refused them, or they were cancelled while queued): ``raydeck jobs`` adds them to Ray's
    list. Empty when no queue runs or it cannot be reached from here: ``raydeck jobs`` needs
    only the job server, and this is an extra."""
    import ray

    try:
        connect_running(settings.ray_address)
        handle = ray.get_actor(ACTOR_NAME, namespace=settings.ray_namespace)
        reply: Any = ray.get(handle.listing.remote(None, True), timeout=REFUSED_TIMEOUT_S)
        _, entries = answer(reply)
    except Exception as exc:  # no cluster or queue here; listing the job server's jobs is enough
        logger.debug("the queue's ended jobs cannot be read: %s", exc)
        return []
    return [entry.job for entry in entries
            if entry.job.state in ("failed", "cancelled") and entry.job.started_at is None]
