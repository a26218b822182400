"""The tracking proxy as Ray actors: names, options, creation, attaching and shutdown.

The proxy is one router and ``RAYDECK_TRACKING_SHARDS`` shards, named detached actors in
raydeck's Ray namespace, created race-free (``get_if_exists``) by whichever process needs them
first and restarted by Ray if they die; one dead for good (``ray.kill`` with ``no_restart``) is
created again: a shard by the router (:mod:`~raydeck.tracking.proxy.shard_pool`), the router by
the next tracker that reaches for it. They run on the head node, where their spool survives a
restart, and take no CPU. Each has two concurrency groups (``io`` for calls that never wait,
``wait`` for calls that block until something happened), so a tracker waiting in ``finish()``
never holds the thread another tracker's ``ingest`` or heartbeat needs.

Life: they run while any run is active or any data is pending; after
``RAYDECK_TRACKING_IDLE_TIMEOUT_S`` with neither, the router stops the shards and itself (the next
tracker creates them again). ``raydeck tracking stop`` does the same on demand, after draining.
"""

from __future__ import annotations

import logging
import threading
import time
from pathlib import Path
from typing import Any

import ray

from raydeck._internal.redaction import redact_text
from raydeck.config.settings import Settings
from raydeck.errors import TrackingUnavailableError
from raydeck.tracking.messages import AttachRequest, ProxyConfig, RunBinding, ShardConfig
from raydeck.tracking.proxy.direct_store import write_target
from raydeck.tracking.proxy.liveness import ray_liveness
from raydeck.tracking.proxy.membership import MembershipStore
from raydeck.tracking.proxy.outbox import Control
from raydeck.tracking.proxy.router import REAP_INTERVAL_S, STOPPING, RouterCore
from raydeck.tracking.proxy.run_lookup import MlflowLookup
from raydeck.tracking.proxy.shard_actor import Shard
from raydeck.tracking.proxy.shard_pool import ShardPool

logger = logging.getLogger(__name__)

ROUTER_NAME = "raydeck-router"
SHARD_NAME_PREFIX = "raydeck-shard-"
STATS_TIMEOUT_S = 10.0
CONTROL_TIMEOUT_S = 10.0
RESOLVE_AT_ATTACH_S = 3.0
SHARD_LOOKUP_S = 10.0
CONCURRENCY_GROUPS = {"io": 32, "wait": 64}
ACTOR_OPTIONS: dict[str, Any] = {
    "lifetime": "detached",
    "get_if_exists": True,
    "max_restarts": -1,
    "max_task_retries": -1,
    "num_cpus": 0,
    # Pin to the head node: a restarted shard must find its spool on the same disk.
    "resources": {"node:__internal_head__": 0.001},
}


def _actor_class(cls: type) -> Any:
    """``cls`` as a Ray actor class with raydeck's concurrency groups."""
    return ray.remote(concurrency_groups=CONCURRENCY_GROUPS)(cls)  # type: ignore[call-overload]


def shard_name(index: int) -> str:
    return f"{SHARD_NAME_PREFIX}{index}"


def proxy_config(settings: Settings) -> ProxyConfig:
    from raydeck.storage import secret_env

    tracking = settings.tracking
    write_uri = write_target(tracking.uri, tracking.write_db.reveal())
    writers = 1 if write_uri.startswith("sqlite") else tracking.writers
    return ProxyConfig(
        namespace=settings.ray_namespace,
        tracking_uri=tracking.uri,
        artifact_location=tracking.artifact_location,
        shards=tracking.shards,
        writers=writers,
        spool_dir=str(settings.data_dir / "spool"),
        fsync=tracking.spool_fsync,
        lost_after_s=tracking.lost_after_s,
        idle_timeout_s=tracking.idle_timeout_s,
        heartbeat_interval_s=tracking.heartbeat_interval_s,
        mlflow_timeout_s=tracking.mlflow_timeout_s,
        retry_max_s=tracking.retry_max_s,
        env=secret_env(settings.storage),
        write_uri="" if write_uri == tracking.uri else write_uri,
    )


class Router:
    """The router actor: :class:`RouterCore` wired to its shards, MLflow and Ray's state."""

    def __init__(self, config: ProxyConfig) -> None:
        self.config = config
        self.shards = ShardPool(config.shards, self._create_shard)
        # Membership on the head's disk beside the spools: a restarted router knows its runs.
        self.core = RouterCore(config, self._send,
                               MlflowLookup(config.tracking_uri, config.mlflow_timeout_s),
                               ray_liveness, MembershipStore(Path(config.spool_dir) / "router.db"))
        from raydeck.tracking.proxy.metrics import RouterMetrics

        self.metrics = RouterMetrics()
        threading.Thread(target=self._reap_forever, name="raydeck-router-reaper",
                         daemon=True).start()

    def _create_shard(self, index: int) -> Any:
        """Shard ``index``'s actor: found by name if it runs, else created (with its spool)."""
        config = self.config
        return _shard_actor.options(name=shard_name(index), namespace=config.namespace,
                                    **ACTOR_OPTIONS).remote(
            ShardConfig(index=index, tracking_uri=config.tracking_uri,
                        spool_dir=f"{config.spool_dir}/shard-{index}", fsync=config.fsync,
                        writers=config.writers, mlflow_timeout_s=config.mlflow_timeout_s,
                        retry_max_s=config.retry_max_s, env=config.env,
                        write_uri=config.write_uri))

    def _send(self, control: Control) -> None:
        shard = self.shards[control.shard_index]
        try:
            ray.get(shard.control.remote(control.run_key, control.kind, control.payload),
                    timeout=CONTROL_TIMEOUT_S)
        except ray.exceptions.ActorDiedError:
            self.shards.revive(control.shard_index, shard)  # the outbox's retry finds it
            raise

    @ray.method(concurrency_group="wait")
    def attach(self, request: AttachRequest) -> RunBinding:
        binding = self.core.attach(request)
        self.shards.ensure(binding.shard_index)  # the tracker looks it up by name next
        if not binding.run_id:
            # MLflow answering: the shard creates the run within milliseconds; answer with its
            # id (silent ranks too: their metrics and logs are labelled with it). MLflow down:
            # answer now, the tracker learns the id later.
            try:
                found = ray.get(self.shards[binding.shard_index].resolve.remote(
                    binding.run_key, RESOLVE_AT_ATTACH_S), timeout=RESOLVE_AT_ATTACH_S + 5)
            except (ray.exceptions.GetTimeoutError, ray.exceptions.RayActorError):
                found = None
            if found is not None:
                from dataclasses import replace

                binding = replace(binding, run_id=found.run_id, mode=found.mode,
                                  resumed=binding.resumed or found.resumed,
                                  existing_params={**found.params, **binding.existing_params})
        return binding

    @ray.method(concurrency_group="io")
    def heartbeat(self, client_ids: list[str]) -> list[str]:
        return self.core.heartbeat(client_ids)

    @ray.method(concurrency_group="io")
    def detach(self, client_id: str, status: str) -> list[str] | None:
        return self.core.detach(client_id, status)

    @ray.method(concurrency_group="io")
    def end_run(self, key: str, status: str, tags: dict[str, str]) -> bool:
        return self.core.end_run(key, status, tags)

    @ray.method(concurrency_group="io")
    def end_unowned(self, key: str, status: str) -> list[str]:
        return self.core.end_unowned(key, status)

    @ray.method(concurrency_group="io")
    def set_trial_outcome(self, trial_id: str, status: str) -> list[str]:
        return self.core.set_trial_outcome(trial_id, status)

    @ray.method(concurrency_group="io")
    def shard_of(self, run_key: str) -> int:
        return self.core.shard_of(run_key)

    @ray.method(concurrency_group="wait")
    def status(self) -> dict[str, Any]:
        shards = self._shard_stats()
        # The router hands a new run to its shard, which creates it in MLflow: the shard knows
        # the run id first.
        created = {key: run_id for shard in shards
                   for key, run_id in shard.get("run_ids", {}).items()}
        runs = [{**run, "run_id": run["run_id"] or created.get(run["key"], "")}
                for run in self.core.status()]
        return {"runs": runs, "shards": shards, "outbox": self.core.outbox.size()}

    def _shard_stats(self) -> list[dict[str, Any]]:
        refs = [shard.stats.remote() for shard in self.shards.all()]
        stats = []
        for index, ref in enumerate(refs):
            try:
                stats.append(ray.get(ref, timeout=STATS_TIMEOUT_S))
            except (ray.exceptions.GetTimeoutError, ray.exceptions.RayActorError) as exc:
                stats.append({"index": index, "state": f"unreachable ({type(exc).__name__})"})
        return stats

    def _drained(self) -> bool:
        return self.core.outbox.size() == 0 and all(
            s.get("queued_entities") == 0 for s in self._shard_stats())

    @ray.method(concurrency_group="wait")
    def shutdown(self, drain_timeout_s: float) -> bool:
        """Wait up to ``drain_timeout_s`` for the shards to write everything, then stop all.

        Returns whether everything was written (data not written stays in the spool and is
        written by the next proxy).
        """
        deadline = time.monotonic() + drain_timeout_s
        drained = self._drained()
        while not drained and time.monotonic() < deadline:
            time.sleep(0.5)
            self.core.outbox.retry()
            drained = self._drained()
        self._stop_all()
        return drained

    def _stop_all(self) -> None:
        for shard in self.shards.close():
            ray.kill(shard, no_restart=True)
        ray.kill(ray.get_runtime_context().current_actor, no_restart=True)

    def _reap_forever(self) -> None:
        while True:
            time.sleep(REAP_INTERVAL_S)
            try:
                self.shards.check()
                idle = self.core.reap()
                self.metrics.set_active_runs(self.core.active_runs)
                # claim_stop checks again, atomically with attaches: one that came while the
                # shards were asked (slow on a loaded machine) keeps the proxy, and none binds
                # to it once it decided to stop.
                if idle and self._drained() and self.core.claim_stop():
                    logger.info("tracking proxy idle for %.0f s; stopping",
                                self.config.idle_timeout_s)
                    self._stop_all()
                    return
            except Exception:
                logger.exception("router reaper failed; retrying")


# Between two attaches while the proxy stops itself (it is gone within moments).
STOPPING_RETRY_S = 0.2

_shard_actor = _actor_class(Shard)
_router_actor = _actor_class(Router)


def get_router(settings: Settings) -> Any:
    """The router's handle, creating the proxy if no process has yet.

    Raises:
        TrackingUnavailableError: Ray refused to create or find the actor.
    """
    try:
        return _router_actor.options(
            name=ROUTER_NAME, namespace=settings.ray_namespace, **ACTOR_OPTIONS
        ).remote(proxy_config(settings))
    except ValueError as exc:
        raise TrackingUnavailableError(f"cannot create the tracking proxy: {exc}") from None


def attach_to_router(settings: Settings, request: AttachRequest, timeout_s: float
                     ) -> tuple[RunBinding, Any]:
    """Attach ``request`` to its run; returns the binding and the router that gave it.

    A proxy that is stopping itself (idle) refuses attaches (``STOPPING``) until it is gone;
    this attaches again until the next proxy (created by ``get_router``) answers, within
    ``timeout_s``.

    Raises:
        whatever the last try raised (``ray.get``'s errors, a refusal), once ``timeout_s`` is
        spent.
    """
    deadline = time.monotonic() + timeout_s
    while True:
        router = get_router(settings)
        try:
            binding: RunBinding = ray.get(router.attach.remote(request),
                                          timeout=max(0.1, deadline - time.monotonic()))
            return binding, router
        except (ray.exceptions.RayTaskError, ray.exceptions.RayActorError) as exc:
            stopping = isinstance(exc, ray.exceptions.RayActorError) or STOPPING in str(exc)
            if not stopping or time.monotonic() + STOPPING_RETRY_S >= deadline:
                raise
            time.sleep(STOPPING_RETRY_S)


def find_router(namespace: str) -> Any | None:
    """The router's handle if the proxy is running, else None (never creates it)."""
    try:
        return ray.get_actor(ROUTER_NAME, namespace=namespace)
    except ValueError:
        return None


def stop_proxy(namespace: str, drain_timeout_s: float) -> bool | None:
    """Drain and stop the proxy in ``namespace``; None if none runs, else whether all landed."""
    router = find_router(namespace)
    if router is None:
        return None
    try:
        return bool(ray.get(router.shutdown.remote(drain_timeout_s),
                            timeout=drain_timeout_s + STATS_TIMEOUT_S * 3))
    except ray.exceptions.RayActorError:
        return True  # the router stopped itself while answering, after draining


def get_shard(namespace: str, index: int) -> Any:
    """Shard ``index``'s handle. A shard dead for good is created again by the router within
    moments (:mod:`raydeck.tracking.proxy.shard_pool`): the lookup waits for it up to
    ``SHARD_LOOKUP_S``.

    Raises:
        ValueError: no shard of that name (the proxy is not running) after that wait.
    """
    deadline = time.monotonic() + SHARD_LOOKUP_S
    while True:
        try:
            return ray.get_actor(shard_name(index), namespace=namespace)
        except ValueError:
            if time.monotonic() >= deadline:
                raise
            time.sleep(0.2)


def wait_runs_landed(namespace: str, run_keys: list[str], timeout_s: float) -> str:
    """Wait up to ``timeout_s`` until the runs of ``run_keys`` exist in MLflow and everything
    the proxy accepted for them is written (or set aside).

    Returns "" when it all landed, else what is still pending, run by run, redacted (for the
    error a caller raises). For a supervisor that reads the runs back from MLflow (a sweep's
    summary): data logged by processes that have ended may still be in the proxy, e.g. after
    an MLflow outage.
    """
    router = find_router(namespace)
    if router is None or not run_keys:
        return ""  # no proxy: nothing is pending anywhere
    deadline = time.monotonic() + timeout_s
    by_shard: dict[int, list[str]] = {}
    for key, index in zip(run_keys, ray.get([router.shard_of.remote(k) for k in run_keys],
                                            timeout=timeout_s), strict=True):
        by_shard.setdefault(index, []).append(key)
    stuck: list[str] = []
    for index, keys in by_shard.items():
        left = max(0.0, deadline - time.monotonic())
        report = ray.get(get_shard(namespace, index).wait_landed.remote(keys, left),
                         timeout=left + STATS_TIMEOUT_S)
        if not report.landed:
            stuck += list(report.stuck) or [f"shard {index}: {report.pending.describe()}"]
    return redact_text("; ".join(stuck))  # MLflow's errors can hold the URI's password


def end_unowned_run(settings: Settings, run_key: str, status: str, timeout_s: float) -> bool:
    """A guest's end of run ``run_key`` (see :meth:`RouterCore.end_unowned`): ends it with
    ``status`` if no process holds it, then waits up to ``timeout_s`` until the run's data (and
    the end, if this ended it) is in MLflow. True when it all landed.

    Raises:
        TrackingUnavailableError: the proxy did not answer.
    """
    deadline = time.monotonic() + timeout_s
    try:
        ended = ray.get(get_router(settings).end_unowned.remote(run_key, status),
                        timeout=timeout_s)
    except (ray.exceptions.GetTimeoutError, ray.exceptions.RayActorError) as exc:
        raise TrackingUnavailableError(
            f"tracking proxy did not take the end of run {run_key} ({type(exc).__name__})"
        ) from None
    keys = sorted({run_key, *ended})
    return not wait_runs_landed(settings.ray_namespace, keys,
                                max(1.0, deadline - time.monotonic()))
