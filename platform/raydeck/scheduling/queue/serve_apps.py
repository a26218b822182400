"""Ray Serve applications as the queue sees them: each deployment's replicas a job of its own,
elastic between its autoscaling bounds, so training and serving share the cluster under one
policy.

Owns: :class:`ServeApp` (one deployment: its replicas now, what one holds, its autoscaling
bounds and the ceiling the queue set), the :class:`ServeApps` interface the queue reads and
bounds them through, and :class:`RayServe`, Serve's own REST API on the dashboard (the queue's
job server, :class:`~raydeck.scheduling.queue.job_server.QueueServer`, each request with its
timeout): ``GET /api/serve/applications/`` to read, and ``PUT`` of the same config with a lower
``max_replicas`` to bound. Serve applies a config whose code (import path,
args, runtime env) is unchanged in place: no replica restarts, and a lower ``max_replicas``
takes effect at the controller's next step (bounds skip the autoscaler's downscale delay).

What the queue controls, and what it does not: Serve's autoscaler decides the replica count, on
request load, between the deployment's minimum and the queue's ceiling; the queue only moves
that ceiling, between the deployment's own ``max_replicas`` and ``max(min_replicas, 1)`` (never
below one replica), and only for a deployment whose config (``raydeck serve --autoscale``,
which deploys from a config, or ``serve deploy``) gives it an ``autoscaling_config``. It never
stops a replica itself, never touches a fixed ``num_replicas``, an application deployed with
``serve.run`` or a deployment whose autoscaling is in its code (Serve has no call that changes
the bounds of those without restarting them or the code that built them: they are counted, as
every replica is, and shown), and does not model request load. The deployment's own
``max_replicas`` is kept in Ray's KV (``serve-bound:<app>/<deployment>``, its whole
``autoscaling_config``) while the queue holds it lower, and comes back as it was; a config
deployed meanwhile with another ``max_replicas`` is the new own bound. An ``initial_replicas``
over a lowered ceiling is lowered with it (Serve refuses it over ``max_replicas``, and a config
Serve fails to apply takes the deployment down: each is checked with Serve's own
``AutoscalingConfig`` before it is sent). The decisions are
:func:`raydeck.scheduling.queue.resizing.make_room`'s.
"""

from __future__ import annotations

import abc
import json
import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import requests

from raydeck._internal.contract import KV_NAMESPACE
from raydeck.errors import ConfigError
from raydeck.scheduling.policies.resources import Resources
from raydeck.scheduling.queue.failures import classify
from raydeck.scheduling.queue.job_server import QueueServer
from raydeck.scheduling.queue.job_view import JobView
from raydeck.serving.deploy_config import deployed_config, with_application

logger = logging.getLogger(__name__)

SERVE_PATH = "/api/serve/applications/"
# Replica states that hold (or are about to hold) their resources.
_LIVE = frozenset({"STARTING", "UPDATING", "RECOVERING", "RUNNING", "PENDING_MIGRATION"})
_BOUND_KEY = "serve-bound:"
# How the queue's listing and decisions name a deployment among jobs.
ID_PREFIX = "serve "
TEAM = "serve"


@dataclass(frozen=True)
class ServeApp:
    """One Serve deployment: ``replicas`` starting or running, each holding ``per_replica``;
    ``min_replicas``-``max_replicas`` its own autoscaling bounds (both 0: a fixed count) and
    ``ceiling`` the ``max_replicas`` Serve has now (lower than its own when the queue lowered
    it); ``bounded``: its config (``serve deploy``) gives it an ``autoscaling_config``, which
    the queue may send back with another ``max_replicas``; ``stopping``: replicas Serve is
    stopping (a graceful shutdown of seconds), which hold their resources in Ray until they
    exit and are not among ``replicas``."""

    app: str
    deployment: str
    replicas: int
    per_replica: Resources
    min_replicas: int = 0
    max_replicas: int = 0
    ceiling: int = 0
    bounded: bool = False
    only_deployment: bool = True
    stopping: int = 0

    @property
    def id(self) -> str:
        """``serve digits`` (``serve app/deployment`` for an application of several)."""
        name = self.app if self.only_deployment else f"{self.app}/{self.deployment}"
        return f"{ID_PREFIX}{name}"

    @property
    def floor(self) -> int:
        """The lowest ceiling the queue sets: its minimum, never below one replica."""
        return max(self.min_replicas, 1)

    @property
    def elastic(self) -> bool:
        """Whether the queue may move its ceiling (autoscaling, from a config, with room)."""
        return self.bounded and self.floor < self.max_replicas

    @property
    def lowered(self) -> bool:
        return self.elastic and self.ceiling < self.max_replicas

    def holds(self, replicas: int) -> Resources:
        return Resources(self.per_replica.cpus * replicas, self.per_replica.gpus * replicas)

    def why(self) -> str:
        """What decides its size, in words (``raydeck queue``'s reason)."""
        if not self.max_replicas:
            return f"fixed at {self.replicas} replicas: counted, never resized by the queue"
        if not self.bounded:
            return (f"Serve's autoscaler decides within {self.min_replicas}-"
                    f"{self.max_replicas}; counted, not bounded by the queue: no config of "
                    "its autoscaling to change (serve deploy one with autoscaling_config)")
        if self.lowered:
            return (f"Serve's autoscaler decides within {self.min_replicas}-{self.ceiling}: "
                    "the queue lowered its ceiling for waiting jobs, raised when room returns")
        return f"Serve's autoscaler decides within {self.min_replicas}-{self.max_replicas}"

    def view(self, now: float) -> JobView:
        """As ``raydeck queue`` lists it: ``replicas 3 of 1-4`` (``-> 2``: the ceiling the
        queue holds it to)."""
        held = self.holds(self.replicas)
        return JobView(self.id, TEAM, 0, held.cpus, held.gpus, "", "", "", 0.0, "serving",
                       self.why(), now, now, None, "", 0, workers=self.replicas,
                       min_workers=self.min_replicas, max_workers=self.max_replicas,
                       resize_to=self.ceiling if self.lowered else 0, unit="replicas")


def applications(details: Mapping[str, Any], own: Mapping[tuple[str, str], int]
                 ) -> list[ServeApp]:
    """Every deployment of Serve's ``details`` (``GET /api/serve/applications/``); ``own``:
    the own ``max_replicas`` of each ``(app, deployment)`` whose ceiling the queue lowered."""
    found = []
    for name, app in (details.get("applications") or {}).items():
        deployments = app.get("deployments") or {}
        for deployment, detail in deployments.items():
            scaling = detail.get("deployment_config", {}).get("autoscaling_config") or {}
            ceiling = int(scaling.get("max_replicas", 0))
            found.append(ServeApp(
                name, deployment,
                sum(1 for replica in detail.get("replicas") or []
                    if replica.get("state") in _LIVE),
                Resources.of_node(detail.get("required_resources") or {}),
                int(scaling.get("min_replicas", 0)), own.get((name, deployment), ceiling),
                ceiling, _scaling(details, name, deployment) is not None,
                len(deployments) == 1,
                sum(1 for replica in detail.get("replicas") or []
                    if replica.get("state") == "STOPPING")))
    return found


def _scaling(details: Mapping[str, Any], app: str, deployment: str) -> dict[str, Any] | None:
    """The ``autoscaling_config`` ``app``'s config gives ``deployment``, or None when there is
    none for the queue to bound: an application deployed with ``serve.run`` (no config), or a
    config that leaves the deployment's scaling to its code (Serve counts an added
    ``autoscaling_config`` entry as new code: the application would restart)."""
    config = deployed_config(details, app)
    if config is None:
        return None
    entry: dict[str, Any] = next(
        (d for d in config.get("deployments") or [] if d.get("name") == deployment), {})
    scaling = entry.get("autoscaling_config")
    return dict(scaling) if scaling else None


def bounded(scaling: Mapping[str, Any], ceiling: int) -> dict[str, Any]:
    """The deployment's own ``autoscaling_config`` (``scaling``) with its ``max_replicas`` at
    ``ceiling`` (as it is at its own maximum or above), and an ``initial_replicas`` over the
    ceiling lowered to it (Serve refuses a config whose initial count is over its maximum)."""
    if ceiling >= int(scaling["max_replicas"]):
        return dict(scaling)
    initial = scaling.get("initial_replicas")
    return {**scaling, "max_replicas": ceiling,
            **({"initial_replicas": min(int(initial), ceiling)} if initial is not None else {})}


def bounded_config(details: Mapping[str, Any], app: ServeApp, scaling: Mapping[str, Any]
                   ) -> dict[str, Any]:
    """The config deployed now, with ``app``'s deployment's ``autoscaling_config`` replaced by
    ``scaling`` and nothing else changed
    (:func:`raydeck.serving.deploy_config.with_application`)."""
    config = deployed_config(details, app.app)
    assert config is not None, f"{app.id} has no config"
    return with_application(details, {**config, "deployments": [
        {**entry, "autoscaling_config": dict(scaling)}
        if entry.get("name") == app.deployment else entry
        for entry in config["deployments"]]})


class ServeConfigChanged(RuntimeError):
    """Serve's deployed config changed between the queue's read and its write: the write is
    not made (it would revert that deploy)."""


def deployments(details: Mapping[str, Any]) -> dict[str, Any]:
    """What identifies each application's deploy in Serve's answer: when it was last deployed
    and the config it was deployed with."""
    return {name: (app.get("last_deployed_time_s"), app.get("deployed_app_config"))
            for name, app in (details.get("applications") or {}).items()}


class ServeApps(abc.ABC):
    """The cluster's Serve applications, as the queue reads and bounds them."""

    @abc.abstractmethod
    def applications(self) -> list[ServeApp]:
        """Every deployment now (none when Serve is not running); raises what the call
        raised."""

    @abc.abstractmethod
    def limit(self, app: ServeApp, ceiling: int) -> None:
        """Set ``app``'s ``max_replicas`` to ``ceiling`` (its own maximum: back as deployed),
        in place; raises what the call raised."""

    def read(self) -> list[ServeApp]:
        """:meth:`applications`, or none when they cannot be read now (their replicas still
        count as used: the cluster's free resources leave them out)."""
        try:
            return self.applications()
        except Exception as exc:
            logger.warning("cannot read Serve's applications now: %s", classify(exc).reason)
            return []

    def bound(self, ceilings: Sequence[tuple[ServeApp, int]]) -> None:
        """:meth:`limit` each; one that fails is logged and decided again at the next tick."""
        for app, ceiling in ceilings:
            try:
                self.limit(app, ceiling)
            except Exception as exc:
                logger.warning("cannot set %s's max_replicas to %d now: %s", app.id, ceiling,
                               classify(exc).reason)


class NoServe(ServeApps):
    """A queue without Serve (or tests of jobs alone): no deployments, nothing to bound."""

    def applications(self) -> list[ServeApp]:
        return []

    def limit(self, app: ServeApp, ceiling: int) -> None:
        raise AssertionError("NoServe has no deployment to bound")


class RayServe(ServeApps):
    """Serve's REST API on the dashboard that ``servers`` gives (the queue's job server, by
    default the cluster's own); the bounds the queue lowered in Ray's KV. Runs inside the
    queue's actor (connected to the cluster)."""

    def __init__(self, servers: QueueServer | None = None) -> None:
        self._servers = servers or QueueServer()

    def _request(self, method: str, body: Mapping[str, Any] | None = None) -> Any:
        server = self._servers.current()
        response = requests.request(method, server.address.rstrip("/") + SERVE_PATH,
                                    json=body, headers=server.headers(),
                                    timeout=self._servers.timeout_s)
        if method == "GET" and response.status_code == 404:
            return {}  # a dashboard without Serve's module (Ray's minimal install): no Serve
        response.raise_for_status()
        return response.json() if method == "GET" else None

    def _own(self, details: Mapping[str, Any]) -> dict[tuple[str, str], dict[str, Any]]:
        """The own ``autoscaling_config`` of each deployment the queue holds lower (its KV
        record, dropped when the ceiling is no longer the queue's: a config deployed since)."""
        from ray.experimental.internal_kv import _internal_kv_del, _internal_kv_get

        own = {}
        for app in applications(details, {}):
            key = f"{_BOUND_KEY}{app.app}/{app.deployment}"
            stored = _internal_kv_get(key, namespace=KV_NAMESPACE)
            if stored is None:
                continue
            record = json.loads(stored)
            if record["set"] == app.ceiling:
                own[(app.app, app.deployment)] = record["own"]
            else:
                _internal_kv_del(key, namespace=KV_NAMESPACE)
        return own

    def applications(self) -> list[ServeApp]:
        details = self._request("GET")
        return applications(details, {deployment: int(scaling["max_replicas"]) for
                                      deployment, scaling in self._own(details).items()})

    def limit(self, app: ServeApp, ceiling: int) -> None:
        from ray.experimental.internal_kv import _internal_kv_del, _internal_kv_put
        from ray.serve.config import AutoscalingConfig

        details = self._request("GET")  # what is deployed now: the PUT sends it back
        own = self._own(details).get((app.app, app.deployment)) or _scaling(
            details, app.app, app.deployment)
        if own is None:
            raise ConfigError(f"{app.id} has no autoscaling_config in its config to bound")
        scaling = bounded(own, ceiling)
        # Checked as Serve will: a config Serve fails to apply takes the deployment down.
        AutoscalingConfig(**scaling)
        body = bounded_config(details, app, scaling)
        # Serve's REST API has no conditional PUT: the config is read again right before it is
        # written back, and a deploy that landed since (someone's `serve deploy`) wins; the
        # ceiling is decided again at the next tick, on what is deployed then.
        if deployments(self._request("GET")) != deployments(details):
            raise ServeConfigChanged(f"Serve's config changed while {app.id}'s max_replicas "
                                     "was being set; set again at the next tick")
        key = f"{_BOUND_KEY}{app.app}/{app.deployment}"
        # Recorded first: a PUT that fails leaves a record whose ``set`` Serve does not have,
        # which the next read drops.
        lowered = ceiling < int(own["max_replicas"])
        if lowered:
            _internal_kv_put(key, json.dumps({"own": own, "set": ceiling}), overwrite=True,
                             namespace=KV_NAMESPACE)
        self._request("PUT", body)
        if not lowered:
            _internal_kv_del(key, namespace=KV_NAMESPACE)
        logger.info("Serve deployment %s: max_replicas %d (its own: %d)", app.id, ceiling,
                    app.max_replicas)
