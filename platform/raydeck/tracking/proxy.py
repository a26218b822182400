"""The tracking proxy as Ray actors: names, options, creation and shutdown.

The proxy is one router and ``RAYDECK_TRACKING_SHARDS`` shards, named detached actors in
raydeck's Ray namespace, created race-free (``get_if_exists``) by whichever process needs them
first and restarted by Ray if they die. They run on the head node, where their spool survives a
restart, and take no CPU.

Life: they run while any run is active or any data is pending; after
``RAYDECK_TRACKING_IDLE_TIMEOUT_S`` with neither, the router stops the shards and itself (the next
tracker creates them again). ``raydeck tracking stop`` does the same on demand, after draining.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any

import ray

from raydeck.config import Settings
from raydeck.errors import TrackingUnavailableError
from raydeck.tracking.messages import AttachRequest, RunBinding
from raydeck.tracking.router import REAP_INTERVAL_S, ProxyConfig, RouterCore
from raydeck.tracking.shard import Shard, ShardConfig

logger = logging.getLogger(__name__)

ROUTER_NAME = "raydeck-router"
SHARD_NAME_PREFIX = "raydeck-shard-"
STATS_TIMEOUT_S = 10.0
ACTOR_OPTIONS: dict[str, Any] = {
    "lifetime": "detached",
    "get_if_exists": True,
    "max_restarts": -1,
    "max_task_retries": -1,
    "num_cpus": 0,
    "max_concurrency": 64,
    # Pin to the head node: a restarted shard must find its spool on the same disk.
    "resources": {"node:__internal_head__": 0.001},
}


def shard_name(index: int) -> str:
    return f"{SHARD_NAME_PREFIX}{index}"


def proxy_config(settings: Settings) -> ProxyConfig:
    from raydeck.storage import secret_env

    tracking = settings.tracking
    return ProxyConfig(
        namespace=settings.ray_namespace,
        tracking_uri=tracking.uri,
        artifact_location=tracking.artifact_location,
        shards=tracking.shards,
        spool_dir=str(settings.data_dir / "spool"),
        fsync=tracking.spool_fsync,
        lost_after_s=tracking.lost_after_s,
        idle_timeout_s=tracking.idle_timeout_s,
        env=secret_env(settings.storage),
    )


class Router:
    """The router actor: :class:`RouterCore` plus the shards it owns and a reaper thread."""

    def __init__(self, config: ProxyConfig) -> None:
        self.config = config
        self.core = RouterCore(config)
        # Create MLflow's tables before the shards start, so three processes never race to
        # initialize a fresh database (SQLite locks for each of them in turn). Best effort: an
        # unreachable MLflow is reported by the first attach, not by a crashing constructor.
        try:
            self.core.client.search_experiments(max_results=1)
        except Exception as exc:
            logger.warning("MLflow not reachable yet: %s", exc)
        shard_actor: Any = ray.remote(Shard)
        self.shards: list[Any] = [
            shard_actor.options(name=shard_name(i), namespace=config.namespace,
                                **ACTOR_OPTIONS).remote(
                ShardConfig(index=i, tracking_uri=config.tracking_uri,
                            spool_dir=f"{config.spool_dir}/shard-{i}", fsync=config.fsync,
                            env=config.env)
            )
            for i in range(config.shards)
        ]
        threading.Thread(target=self._reap_forever, name="raydeck-router-reaper",
                         daemon=True).start()

    def attach(self, request: AttachRequest) -> RunBinding:
        return self.core.attach(request)

    def heartbeat(self, client_ids: list[str]) -> list[str]:
        return self.core.heartbeat(client_ids)

    def detach(self, client_id: str, status: str) -> None:
        self.core.detach(client_id, status)

    def end_run(self, key: str, status: str, tags: dict[str, str]) -> bool:
        return self.core.end_run(key, status, tags)

    def get_config(self) -> ProxyConfig:
        return self.config

    def run_id_for(self, key: str) -> str | None:
        return self.core.run_id_for(key)

    def status(self) -> dict[str, Any]:
        return {"runs": self.core.status(), "shards": self._shard_stats()}

    def _shard_stats(self) -> list[dict[str, Any]]:
        refs = [shard.stats.remote() for shard in self.shards]
        stats = []
        for index, ref in enumerate(refs):
            try:
                stats.append(ray.get(ref, timeout=STATS_TIMEOUT_S))
            except (ray.exceptions.GetTimeoutError, ray.exceptions.RayActorError) as exc:
                stats.append({"index": index, "state": f"unreachable ({type(exc).__name__})"})
        return stats

    def _drained(self) -> bool:
        return all(
            s.get("queued_points") == 0 and s.get("queued_batches") == 0
            and not s.get("runs_pending")
            for s in self._shard_stats()
        )

    def shutdown(self, drain_timeout_s: float) -> bool:
        """Wait up to ``drain_timeout_s`` for the shards to write everything, then stop all.

        Returns whether everything was written (data not written stays in the spool and is
        replayed by the next proxy).
        """
        deadline = time.monotonic() + drain_timeout_s
        drained = self._drained()
        while not drained and time.monotonic() < deadline:
            time.sleep(0.5)
            drained = self._drained()
        self._stop_all()
        return drained

    def _stop_all(self) -> None:
        for shard in self.shards:
            ray.kill(shard, no_restart=True)
        ray.kill(ray.get_runtime_context().current_actor, no_restart=True)

    def _reap_forever(self) -> None:
        while True:
            time.sleep(REAP_INTERVAL_S)
            try:
                if self.core.reap() and self._drained():
                    logger.info("tracking proxy idle for %.0f s; stopping",
                                self.config.idle_timeout_s)
                    self._stop_all()
                    return
            except Exception:
                logger.exception("router reaper failed; retrying")


_router_actor = ray.remote(Router)


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
    return ray.get_actor(shard_name(index), namespace=namespace)
