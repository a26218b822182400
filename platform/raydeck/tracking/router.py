"""The router: owns run lifecycle for every tracker in the cluster.

Owns: mapping run keys (a shared ``RAYDECK_RUN_ID``, a Ray Train run name, a generated key) to
MLflow runs, creating them (and per-rank children) race-free, knowing which processes take part
in each run and which one is primary, ending a run once its primary finished and every other
participant left, marking it ``KILLED`` when its processes vanished, and stopping the proxy
after a quiet period. Does not own: any metric data (the shards do).

State kept here is soft: a restarted router rebuilds a run from MLflow (the ``raydeck.run_key``
tag) the moment a tracker re-attaches, and trackers re-attach when a heartbeat is not recognised.

Rules:
- Run key: explicit key > the Ray Train run name (when that name is bound to a run, or when the
  job has exactly one run created by its driver, which then gets bound) > a new key.
- Primary: the first driver/rank-0/trial process attached to a run with no live primary. A
  restarted process (same ``role_key``) replaces its predecessor, primary role included.
- End: when the primary has finished (its status is used) and no participant is left; a
  participant silent for ``lost_after_s`` is dropped, and a lost primary means ``KILLED``.
"""

from __future__ import annotations

import logging
import os
import re
import threading
import time
import uuid
import zlib
from dataclasses import dataclass, field
from typing import Any

from mlflow.entities import RunStatus, RunTag
from mlflow.exceptions import MlflowException
from mlflow.tracking import MlflowClient

from raydeck.config import RUN_KEY_PATTERN
from raydeck.errors import ConfigError, TrackingUnavailableError
from raydeck.tracking.messages import AttachRequest, ProcessInfo, RunBinding
from raydeck.tracking.metrics import RouterMetrics

logger = logging.getLogger(__name__)

REAP_INTERVAL_S = 1.0
RUN_KEY_TAG = "raydeck.run_key"
_MLFLOW_RUN_ID = re.compile(r"^[0-9a-f]{32}$")
# The router's own MLflow calls (create a run, end a run) may retry a little: they are rare and
# a user is waiting on them.
ROUTER_MLFLOW_ENV = {
    "MLFLOW_HTTP_REQUEST_MAX_RETRIES": "2",
    "MLFLOW_HTTP_REQUEST_TIMEOUT": "10",
    "MLFLOW_SUPPRESS_PRINTING_URL_TO_STDOUT": "true",
}


@dataclass(frozen=True)
class ProxyConfig:
    """Everything the proxy actors need, fixed by the process that first creates them."""

    namespace: str
    tracking_uri: str
    artifact_location: str
    shards: int
    spool_dir: str
    fsync: bool
    lost_after_s: float
    idle_timeout_s: float
    env: dict[str, str] = field(default_factory=dict, repr=False)


@dataclass
class _Participant:
    client_id: str
    process: ProcessInfo
    last_seen: float


@dataclass
class _Run:
    key: str
    run_id: str
    experiment_id: str
    name: str
    mode: str
    created_by_role: str
    job_id: str | None
    primary: str | None = None
    primary_status: str | None = None
    participants: dict[str, _Participant] = field(default_factory=dict)
    children: dict[int, str] = field(default_factory=dict)
    samplers: dict[str, str] = field(default_factory=dict)
    terminated: bool = False


class RouterCore:
    """The router's logic, independent of Ray so it can be exercised directly."""

    def __init__(self, config: ProxyConfig) -> None:
        os.environ.update(config.env)
        os.environ.update(ROUTER_MLFLOW_ENV)
        self.config = config
        self.client = MlflowClient(tracking_uri=config.tracking_uri)
        self.metrics = RouterMetrics()
        self._lock = threading.RLock()
        self._runs: dict[str, _Run] = {}
        self._aliases: dict[str, str] = {}
        self._by_client: dict[str, str] = {}
        self._idle_since: float | None = time.monotonic()

    # --- attach ------------------------------------------------------------------------------
    def attach(self, request: AttachRequest) -> RunBinding:
        """Bind a tracker to its run, creating the run (or its per-rank child) if needed.

        Raises:
            ConfigError: a driver configured for another MLflow than this proxy writes to.
            TrackingUnavailableError: MLflow cannot be reached to create or find the run.
        """
        process = request.process
        if process.role == "driver" and request.tracking_uri != self.config.tracking_uri:
            raise ConfigError(
                f"the tracking proxy in Ray namespace {self.config.namespace!r} writes to "
                f"{_redact(self.config.tracking_uri)}, but this process is configured for "
                f"{_redact(request.tracking_uri)}; run `raydeck tracking stop` first, or set "
                "RAYDECK_RAY_NAMESPACE to run a second proxy"
            )
        with self._lock:
            self._drop_gone(time.monotonic())
            try:
                key = self._resolve_key(request)
                run, created = self._find_or_create(key, request)
                if process.train_run_name and process.train_run_name != key:
                    self._aliases[process.train_run_name] = key
                binding = self._join(run, request, created)
            except MlflowException as exc:
                raise TrackingUnavailableError(
                    f"MLflow at {_redact(self.config.tracking_uri)} refused or did not answer "
                    f"({str(exc).splitlines()[0][:200]}); check that it is running"
                ) from None
            self._idle_since = None
            return binding

    def _resolve_key(self, request: AttachRequest) -> str:
        if request.run_key:
            return request.run_key
        train_name = request.process.train_run_name
        if train_name:
            if train_name in self._aliases:
                return self._aliases[train_name]
            if train_name in self._runs:
                return train_name
            driver_runs = [
                run for run in self._runs.values()
                if not run.terminated and run.created_by_role == "driver"
                and run.job_id == request.process.job_id
            ]
            if len(driver_runs) == 1:
                return driver_runs[0].key
            return train_name
        return f"run-{uuid.uuid4().hex[:12]}"

    def _find_or_create(self, key: str, request: AttachRequest) -> tuple[_Run, bool]:
        run = self._runs.get(key)
        if run is not None:
            if run.terminated:
                self._reopen(run)
            return run, False
        found = self._find_in_mlflow(key, request.experiment)
        if found is None and _MLFLOW_RUN_ID.match(key):
            raise ConfigError(
                f"run id {key!r} looks like an MLflow run id, but MLflow at "
                f"{_redact(self.config.tracking_uri)} has no such run; pass an existing run id, "
                "or a name of your own (letters, digits, _ . -) to create a shared run"
            )
        if found is not None:
            run = _Run(
                key=key, run_id=found.info.run_id, experiment_id=found.info.experiment_id,
                name=found.info.run_name or key,
                mode=found.data.tags.get("raydeck.mode", request.mode),
                created_by_role=found.data.tags.get("raydeck.created_by", ""),
                job_id=found.data.tags.get("raydeck.ray_job_id"),
            )
            if found.info.status != "RUNNING":
                self._reopen(run)
            self._runs[key] = run
            return run, False
        return self._create(key, request), True

    def _find_in_mlflow(self, key: str, experiment: str) -> Any:
        if _MLFLOW_RUN_ID.match(key):
            try:
                return self.client.get_run(key)
            except MlflowException as exc:
                if exc.get_http_status_code() != 404:
                    raise
        exp = self.client.get_experiment_by_name(experiment)
        if exp is None:
            return None
        hits = self.client.search_runs(
            [exp.experiment_id], filter_string=f"tags.`{RUN_KEY_TAG}` = '{key}'", max_results=1
        )
        return hits[0] if hits else None

    def _experiment_id(self, name: str) -> str:
        exp = self.client.get_experiment_by_name(name)
        if exp is not None:
            return str(exp.experiment_id)
        try:
            return str(self.client.create_experiment(
                name, artifact_location=self.config.artifact_location or None
            ))
        except MlflowException:
            # Another router (a restart racing its predecessor) created it first.
            exp = self.client.get_experiment_by_name(name)
            if exp is None:
                raise
            return str(exp.experiment_id)

    def _create(self, key: str, request: AttachRequest) -> _Run:
        if not RUN_KEY_PATTERN.match(key):
            raise ConfigError(f"run id {key!r}: may hold 1-128 letters, digits, _ . - only")
        process = request.process
        experiment_id = self._experiment_id(request.experiment)
        tags = {
            RUN_KEY_TAG: key,
            "raydeck.mode": request.mode,
            "raydeck.created_by": process.role,
            **request.tags,
        }
        if process.job_id:
            tags["raydeck.ray_job_id"] = process.job_id
        if request.parent_key:
            parent = self._runs.get(request.parent_key) or self._find_in_mlflow(
                request.parent_key, request.experiment
            )
            if parent is None:
                raise ConfigError(f"parent run {request.parent_key!r} does not exist")
            tags["mlflow.parentRunId"] = (
                parent.run_id if isinstance(parent, _Run) else parent.info.run_id
            )
        name = request.run_name or key
        created = self.client.create_run(experiment_id, run_name=name, tags=tags)
        run = _Run(
            key=key, run_id=created.info.run_id, experiment_id=experiment_id, name=name,
            mode=request.mode, created_by_role=process.role, job_id=process.job_id,
        )
        self._runs[key] = run
        logger.info("created run %s (%s) for key %s", run.run_id, name, key)
        return run

    def _reopen(self, run: _Run) -> None:
        self.client.update_run(run.run_id, status="RUNNING")
        run.terminated = False
        run.primary = None
        run.primary_status = None

    def _join(self, run: _Run, request: AttachRequest, created: bool) -> RunBinding:
        process = request.process
        now = time.monotonic()
        for client_id, participant in list(run.participants.items()):
            if participant.process.role_key == process.role_key and client_id != request.client_id:
                self._drop(run, client_id, replaced=True)
        if run.mode == "rank_zero" and not process.is_primary_candidate:
            return self._binding(run, request, created, active=False)
        run.participants[request.client_id] = _Participant(request.client_id, process, now)
        self._by_client[request.client_id] = run.key
        if process.is_primary_candidate and (
            run.primary is None or run.primary not in run.participants
        ):
            run.primary = request.client_id
            run.primary_status = None
        return self._binding(run, request, created, active=True)

    def _binding(
        self, run: _Run, request: AttachRequest, created: bool, active: bool
    ) -> RunBinding:
        process = request.process
        run_id = run.run_id
        sample_system = False
        existing: dict[str, str] = {}
        if active:
            if run.mode == "per_rank" and process.world_rank is not None:
                run_id = self._child(run, process)
            sampler = run.samplers.get(process.node_ip)
            sample_system = sampler is None or sampler not in run.participants
            if sample_system:
                run.samplers[process.node_ip] = request.client_id
            if not created:
                existing = dict(self.client.get_run(run.run_id).data.params)
        return RunBinding(
            run_key=run.key, run_id=run_id, params_run_id=run.run_id,
            experiment_id=run.experiment_id, run_name=run.name, mode=run.mode,
            shard_index=zlib.crc32(run.key.encode()) % self.config.shards,
            is_primary=run.primary == request.client_id, created=created, resumed=not created,
            sample_system=sample_system, active=active, existing_params=existing,
        )

    def _child(self, run: _Run, process: ProcessInfo) -> str:
        rank = process.world_rank
        assert rank is not None
        child_key = f"{run.key}.rank_{rank}"
        if rank not in run.children:
            found = self._find_in_mlflow(child_key, self._experiment_name(run))
            if found is not None:
                run.children[rank] = found.info.run_id
                if found.info.status != "RUNNING":
                    self.client.update_run(found.info.run_id, status="RUNNING")
            else:
                child = self.client.create_run(
                    run.experiment_id, run_name=f"{run.name}-rank{rank}",
                    tags={
                        RUN_KEY_TAG: child_key, "mlflow.parentRunId": run.run_id,
                        "raydeck.rank": str(rank), "raydeck.node": process.node_ip,
                        "raydeck.role": process.role, "raydeck.mode": run.mode,
                    },
                )
                run.children[rank] = child.info.run_id
        else:
            self.client.update_run(run.children[rank], status="RUNNING")
        return run.children[rank]

    def _experiment_name(self, run: _Run) -> str:
        return str(self.client.get_experiment(run.experiment_id).name)

    # --- heartbeat / detach / reaping --------------------------------------------------------
    def heartbeat(self, client_ids: list[str]) -> list[str]:
        """Mark clients alive; returns the ids this router does not know (they re-attach)."""
        now = time.monotonic()
        unknown = []
        with self._lock:
            for client_id in client_ids:
                key = self._by_client.get(client_id)
                run = self._runs.get(key) if key else None
                if run is None or client_id not in run.participants:
                    unknown.append(client_id)
                else:
                    run.participants[client_id].last_seen = now
        return unknown

    def detach(self, client_id: str, status: str) -> None:
        """A tracker finished. The run ends only when its primary has and nobody is left."""
        RunStatus.from_string(status)
        with self._lock:
            key = self._by_client.get(client_id)
            run = self._runs.get(key) if key else None
            if run is None or client_id not in run.participants:
                return
            self._drop(run, client_id, status=status)
            self._maybe_end(run)

    def end_run(self, key: str, status: str, tags: dict[str, str]) -> bool:
        """End a run for a supervisor that knows better than its processes (Tune's scheduler).

        Sets ``tags``, releases every participant and ends the run with ``status``. Returns
        False if the router does not know the run.
        """
        RunStatus.from_string(status)
        with self._lock:
            run = self._runs.get(key)
            if run is None:
                return False
            self.client.log_batch(run.run_id, tags=[RunTag(k, v) for k, v in tags.items()],
                                  synchronous=True)
            for client_id in list(run.participants):
                self._drop(run, client_id, status=status)
            run.primary_status = status
            self._maybe_end(run)
            return True

    def _drop(self, run: _Run, client_id: str, status: str = "KILLED",
              replaced: bool = False) -> None:
        participant = run.participants.pop(client_id)
        self._by_client.pop(client_id, None)
        rank = participant.process.world_rank
        if run.mode == "per_rank" and rank in run.children and not replaced:
            self._end_quietly(run.children[rank], status)
        if run.primary == client_id:
            run.primary = None
            if not replaced:
                run.primary_status = status

    def _maybe_end(self, run: _Run) -> None:
        if run.terminated or run.primary_status is None or run.participants:
            return
        if self._end_quietly(run.run_id, run.primary_status):
            run.terminated = True
            logger.info("run %s ended as %s", run.run_id, run.primary_status)

    def _end_quietly(self, run_id: str, status: str) -> bool:
        try:
            self.client.set_terminated(run_id, status=status, end_time=int(time.time() * 1000))
            return True
        except MlflowException as exc:
            logger.warning("could not end run %s yet (%s); will retry", run_id, exc)
            return False

    def _drop_gone(self, now: float) -> None:
        """Drop participants whose Ray job ended or that went silent. Caller holds the lock.

        A dead job is known to Ray's control store within a second of its driver exiting, so
        a killed driver's run ends right away; silence (``lost_after_s``) catches the rest: a
        worker SIGKILLed inside a living job, a partitioned node.
        """
        dead_jobs = _dead_job_ids()
        for run in list(self._runs.values()):
            for client_id, participant in list(run.participants.items()):
                job_gone = participant.process.job_id in dead_jobs
                silent = now - participant.last_seen > self.config.lost_after_s
                if job_gone or silent:
                    logger.warning("run %s: %s (%s) %s; presumed dead", run.run_id,
                                   participant.process.role_key, client_id,
                                   "ended with its Ray job" if job_gone else "went silent")
                    self._drop(run, client_id, status="KILLED")
            self._maybe_end(run)

    def reap(self) -> bool:
        """Drop gone participants, end finished runs; True when the proxy should stop."""
        now = time.monotonic()
        with self._lock:
            self._drop_gone(now)
            active = sum(1 for run in self._runs.values() if not run.terminated)
            self.metrics.set_active_runs(active)
            if active:
                self._idle_since = None
                return False
            if self._idle_since is None:
                self._idle_since = now
            return now - self._idle_since > self.config.idle_timeout_s

    def status(self) -> list[dict[str, Any]]:
        with self._lock:
            return [
                {
                    "key": run.key, "run_id": run.run_id, "name": run.name, "mode": run.mode,
                    "participants": len(run.participants),
                    "primary": run.participants[run.primary].process.role_key
                    if run.primary in run.participants else "",
                    "state": "ended" if run.terminated else "active",
                }
                for run in self._runs.values()
            ]

    def run_id_for(self, key: str) -> str | None:
        with self._lock:
            run = self._runs.get(self._aliases.get(key, key))
            return run.run_id if run else None


def _dead_job_ids() -> set[str]:
    """Ray jobs that have ended, from Ray's control store; empty if it cannot be asked."""
    try:
        import ray._private.state as ray_state

        return {job["JobID"] for job in ray_state.jobs() if job.get("IsDead")}
    except Exception:
        return set()


def _redact(uri: str) -> str:
    """A URI without its password, for messages."""
    return re.sub(r"//([^:/@]+):[^@/]+@", r"//\1:***@", uri)
