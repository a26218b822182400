"""Ray's job server as the queue's :class:`~raydeck.scheduling.queue.job_queue.Launcher`.

Owns: submitting a queued job with its stored working-dir package (uploaded again when Ray has
deleted it: Ray keeps an uploaded package only while a job uses it), reading a job's status and
whether Ray has placed its placement groups (Ray's state API), and each node's free and total
resources (what is free counts jobs started outside the queue). Runs
inside the queue's actor, which is connected to the cluster.

The job server is the queue's own cluster's, never a caller's
(:class:`~raydeck.scheduling.queue.job_server.QueueServer` says which and why). Ray's job client
sends its HTTP requests without a timeout (a dashboard that accepts a connection and never
answers would hold a call forever): every request is sent here with the server's timeout,
building the client included (:meth:`raydeck.jobs.submission.JobServer.client`).
"""

from __future__ import annotations

import json
import logging
import math
from collections.abc import Collection
from typing import Any

from raydeck._internal.contract import QUEUE_JOB_ENV, QUEUE_TOKEN_ENV, QUEUE_WORKERS_ENV
from raydeck._internal.redaction import redact_text
from raydeck.errors import JobSubmissionError
from raydeck.jobs.submission import JobServer
from raydeck.scheduling.policies.resources import Resources
from raydeck.scheduling.queue.job_server import QueueServer
from raydeck.scheduling.queue.launcher import JobState, Launcher
from raydeck.scheduling.queue.store import JobRow

logger = logging.getLogger(__name__)

# The lines of a failed job's log the queue keeps with its record (raydeck queue, raydeck jobs).
LOG_TAIL_LINES = 20


def queue_env(row: JobRow) -> dict[str, str]:
    """The variables the queue sets in a job's runtime env (driver and every worker): its queue
    id (preemption asks by it), its attempt's token (which it sends with each call:
    :mod:`raydeck.tracking.client.preemption`) and, for an elastic job, the most workers the
    queue allows it now (:func:`raydeck.train.trainer.fit` keeps Ray Train within it)."""
    allowed = {QUEUE_WORKERS_ENV: str(row.workers)} if row.elastic else {}
    return {QUEUE_JOB_ENV: row.id, QUEUE_TOKEN_ENV: row.token, **allowed}


def _queue_id(runtime_env: dict[str, Any] | None) -> str:
    """The queue's id of a job the queue started (its runtime env carries it), else ""."""
    return str(((runtime_env or {}).get("env_vars") or {}).get(QUEUE_JOB_ENV, ""))


class RayJobs(Launcher):
    """Jobs on the Ray cluster whose job server ``servers`` gives (by default the cluster's
    own, found from the connected process: the queue's actor)."""

    def __init__(self, servers: QueueServer | None = None) -> None:
        self._servers = servers or QueueServer()
        # (server, client) of the last request's server: made again only when it changes.
        self._client: tuple[JobServer, Any] | None = None
        self._state_client: tuple[JobServer, Any] | None = None

    def _jobs(self) -> Any:
        """Ray's job client for the current server, every request of it (its construction's
        included) with the server's timeout."""
        server = self._servers.current()
        made = self._client
        if made is None or made[0] != server:
            made = (server, server.client(self._servers.timeout_s))
            self._client = made
        return made[1]

    def _state(self) -> Any:
        """Ray's state API client for the same server (it sends no request when made)."""
        from ray.util.state.api import StateApiClient

        server = self._servers.current()
        made = self._state_client
        if made is None or made[0] != server:
            made = (server, StateApiClient(address=server.address))
            self._state_client = made
        # Exactly the server's headers, read now (a token file rotates), as the job client's:
        # Ray's adds its own process's token to a request without one.
        made[1]._headers = {"Content-Type": "application/json", **server.headers()}
        return made[1]

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

    def statuses(self, submission_ids: Collection[str]) -> dict[str, JobState]:
        wanted = set(submission_ids)
        if not wanted:
            return {}
        return {job.submission_id: JobState(str(job.status.value), job.driver_exit_code,
                                            _queue_id(job.runtime_env))
                for job in self._jobs().list_jobs() if job.submission_id in wanted}

    def log_tail(self, submission_id: str) -> str:
        try:
            text = self._jobs().get_job_logs(submission_id)
        except Exception as exc:  # the contract: "" when it cannot be read
            logger.warning("cannot read job %s's log: %s", submission_id, exc)
            return ""
        return redact_text("\n".join(text.rstrip().splitlines()[-LOG_TAIL_LINES:]))

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
                                       timeout=max(1, math.ceil(self._servers.timeout_s))),
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
