"""Ray's job server as the queue's :class:`~raydeck.scheduling.queue.job_queue.Launcher`.

Owns: submitting a queued job with its stored working-dir package (uploaded again when Ray has
deleted it: Ray keeps an uploaded package only while a job uses it), reading a job's status and
whether Ray has placed its placement groups (Ray's state API), and each node's free and total
resources (what is free counts jobs started outside the queue). Runs
inside the queue's actor, which is connected to the cluster.

Ray's job client sends its HTTP requests without a timeout (a dashboard that accepts a
connection and never answers would hold a call forever): every request is sent here with
``REQUEST_TIMEOUT_S``. The job server's address and token are the latest caller's
(:meth:`RayJobs.use`): the actor outlives the client that started it.
"""

from __future__ import annotations

import functools
import json
import logging
from typing import Any

from raydeck._internal.contract import QUEUE_JOB_ENV, QUEUE_WORKERS_ENV
from raydeck._internal.redaction import redact_url
from raydeck.errors import JobSubmissionError
from raydeck.jobs.submission import JobServer
from raydeck.scheduling.policies.resources import Resources
from raydeck.scheduling.queue.launcher import LAUNCHER_TIMEOUT_S, Launcher
from raydeck.scheduling.queue.store import JobRow

logger = logging.getLogger(__name__)

# Each HTTP request to the job server (connect, and each read); the queue bounds whole calls
# with LAUNCHER_TIMEOUT_S too (raydeck.scheduling.queue.launcher.TimedLauncher).
REQUEST_TIMEOUT_S = LAUNCHER_TIMEOUT_S


def queue_env(row: JobRow) -> dict[str, str]:
    """The variables the queue sets in a job's runtime env (driver and every worker): its queue
    id (preemption asks by it) and, for an elastic job, the most workers the queue allows it
    now (:func:`raydeck.train.trainer.fit` keeps Ray Train within it)."""
    allowed = {QUEUE_WORKERS_ENV: str(row.workers)} if row.elastic else {}
    return {QUEUE_JOB_ENV: row.id, **allowed}


class RayJobs(Launcher):
    """Jobs on the Ray cluster whose job server is ``server``."""

    def __init__(self, server: JobServer) -> None:
        self._server = server
        self._client: Any = None
        self._state_client: Any = None

    def use(self, server: JobServer) -> None:
        """Send the next calls to ``server``: a caller's address and token, which may have
        changed since the actor started (a new token, a moved dashboard)."""
        if server != self._server:
            logger.info("the queue now reaches the job server at %s", redact_url(server.address))
            self._server, self._client, self._state_client = server, None, None

    def _jobs(self) -> Any:
        client: Any = self._client
        if client is None:
            client = self._server.client()
            # Every request of Ray's job client goes through _do_request, whose extra keywords
            # reach requests.request.
            client._do_request = functools.partial(client._do_request,
                                                   timeout=REQUEST_TIMEOUT_S)
            self._client = client
        return client

    def _state(self) -> Any:
        """Ray's state API client for the same server, made once per server (as the jobs')."""
        from ray.util.state.api import StateApiClient

        if self._state_client is None:
            self._state_client = StateApiClient(address=self._server.address,
                                                headers=self._server.headers() or None)
        return self._state_client

    def submit(self, row: JobRow, package: bytes | None) -> None:
        from ray._private.runtime_env import packaging

        if row.package_uri and not packaging.package_exists(row.package_uri):
            if package is None:
                raise JobSubmissionError(f"job {row.id}: its working dir package "
                                         f"{row.package_uri} is gone and was not kept")
            packaging.upload_package_to_gcs(row.package_uri, package)
        runtime_env = json.loads(row.runtime_env)
        runtime_env["env_vars"] = {**runtime_env.get("env_vars", {}), **queue_env(row)}
        try:
            self._jobs().submit_job(entrypoint=row.entrypoint, submission_id=row.submission_id,
                                    runtime_env=runtime_env,
                                    metadata=json.loads(row.metadata_json))
        except RuntimeError as exc:
            if "already exists" in str(exc):
                return  # submitted before the queue restarted: started once, not twice
            # Anything else reaches the queue as Ray raised it: the queue classifies it
            # (raydeck.scheduling.queue.failures), the HTTP status in its text included.
            raise

    def status(self, submission_id: str) -> str | None:
        try:
            return str(self._jobs().get_job_status(submission_id).value)
        except RuntimeError as exc:
            if "does not exist" in str(exc) or "not found" in str(exc).lower():
                return None
            raise

    def stop(self, submission_id: str) -> None:
        # A job the job server never got answers 404 (a RuntimeError): the queue decides.
        self._jobs().stop_job(submission_id)

    def placed(self, submission_id: str) -> bool:
        from ray.util.state.common import ListApiOptions, StateResource

        try:
            job_id = self._jobs().get_job_info(submission_id).job_id
            if job_id is None:
                return False  # its driver has not started
            # Asked of this job server's own state API: without an address, Ray's state API
            # looks for "the" local cluster and fails where a machine runs two (it then
            # failed on every call, and every gang held the next job back CLAIM_S).
            groups = self._state().list(
                StateResource.PLACEMENT_GROUPS,
                options=ListApiOptions(filters=[("creator_job_id", "=", job_id)],
                                       timeout=int(REQUEST_TIMEOUT_S)),
                raise_on_missing_output=False)
        except Exception as exc:  # the state API is down: the gang waits at most CLAIM_S
            logger.warning("cannot read job %s's placement groups: %s", submission_id, exc)
            return False
        # Placed, or already given back (its training ended); none still waiting for nodes.
        return bool(groups) and all(g.state in ("CREATED", "REMOVED") for g in groups)

    def resources(self) -> tuple[tuple[Resources, ...], tuple[Resources, ...]]:
        from raydeck.train.feasibility import cluster_resources

        totals, available = cluster_resources()
        return (tuple(map(Resources.of_node, available)), tuple(map(Resources.of_node, totals)))
