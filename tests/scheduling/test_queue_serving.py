"""Issue 29, item 4: training and serving share the cluster under one policy. Each Serve
deployment is an elastic job of its own: counted at its replicas, listed by ``raydeck queue``
(``serve digits ... replicas 2 of 1-3``); when the first waiting job does not fit, an autoscaling
deployment deployed from a config has its ``max_replicas`` lowered toward its minimum before any
training job is preempted, and raised back when room returns. Fixed counts and applications
deployed with ``serve.run`` are counted, never bounded.

The real :class:`JobQueue` on the fake job server (one node, 4 CPUs) with Serve in memory
(:class:`FakeServe`: replicas hold CPUs of that node; a lowered ceiling takes replicas away when
the test lets Serve's controller act, :meth:`FakeServe.settle`); the config the queue deploys to
bound a deployment, from Serve's own ``GET /api/serve/applications/`` answer
(:func:`~raydeck.scheduling.queue.serve_apps.bounded_config`), and the config ``raydeck serve``
deploys (:func:`~raydeck.serving.deploy_config.with_application`). tests/scheduling/test_queue.py's
``test_a_served_model_gives_back_replicas_for_a_waiting_job_and_gets_them_back`` does it on
Ray, with ``raydeck serve --autoscale``.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import pytest

from raydeck.scheduling.policies.resources import Gang, Resources
from raydeck.scheduling.queue.job_queue import JobQueue
from raydeck.scheduling.queue.jobspec import JobSpec
from raydeck.scheduling.queue.listing import Entry
from raydeck.scheduling.queue.serve_apps import (
    ServeApp,
    ServeApps,
    applications,
    bounded,
    bounded_config,
)
from raydeck.scheduling.queue.store import Store
from raydeck.serving.deploy_config import deployed_config, with_application
from tests.fixtures.fake_job_server import NODE_CPUS, FakeJobServer

pytestmark = pytest.mark.timeout(60)

HOUR = 3600.0


class FakeServe(ServeApps):
    """Serve's deployments in memory: ``limit`` sets a ceiling as Serve's config would, the
    replicas over it are stopping at once (as Serve marks them), and they are gone, their
    resources freed, when their graceful shutdown ends (:meth:`settle`)."""

    def __init__(self, *apps: ServeApp) -> None:
        self.apps = {app.app: app for app in apps}
        self.limits: list[tuple[str, int]] = []
        # Ray has the stopping replicas' resources back while Serve still lists them stopping.
        self.released = False

    def applications(self) -> list[ServeApp]:
        return list(self.apps.values())

    def limit(self, app: ServeApp, ceiling: int) -> None:
        self.limits.append((app.app, ceiling))
        now = self.apps[app.app]
        self.apps[app.app] = dataclasses.replace(
            now, ceiling=ceiling, replicas=min(now.replicas, ceiling),
            stopping=now.stopping + max(now.replicas - ceiling, 0))

    def settle(self) -> None:
        for name, app in self.apps.items():
            self.apps[name] = dataclasses.replace(app, stopping=0)

    def used(self) -> float:
        return sum(app.holds(app.replicas + (0 if self.released else app.stopping)).cpus
                   for app in self.apps.values())


class Cluster(FakeJobServer):
    """The fake job server's node, with Serve's replicas holding some of its CPUs, and jobs that
    Ray has not given their CPUs yet (``unclaimed``)."""

    def __init__(self, serve: FakeServe) -> None:
        super().__init__()
        self.serve = serve
        self.unclaimed: set[str] = set()  # started, not yet holding their CPUs in Ray

    def resources(self) -> tuple[tuple[Resources, ...], tuple[Resources, ...]]:
        (free,), total = super().resources()
        unclaimed = sum(self.cpus.get(job, 0.0) for job in self.unclaimed)
        return (free + Resources(cpus=unclaimed) - Resources(cpus=self.serve.used()),), total


def _app(name: str, replicas: int, low: int = 0, high: int = 0, bounded: bool = True
         ) -> ServeApp:
    return ServeApp(name, "ModelServer", replicas, Resources(cpus=1), low, high, high, bounded)


def _fixed(job_id: str, cpus: int, priority: int = 0) -> JobSpec:
    gang = Gang(cpus, Resources(cpus=1))
    return JobSpec(job_id, "a", priority, f"cpu-{cpus}", gang.needs, job_id, "python job.py", {},
                   estimate_s=HOUR, gang=gang)


def _setup(tmp_path: Path, *apps: ServeApp) -> tuple[JobQueue, Cluster, list[float]]:
    serve, clock = FakeServe(*apps), [0.0]
    server = Cluster(serve)
    queue = JobQueue(Store(f"sqlite:///{tmp_path / 'q.db'}"), server, clock=lambda: clock[0],
                     serve=serve)
    return queue, server, clock


def _entry(queue: JobQueue, job_id: str) -> Entry:
    (entry,) = [e for e in queue.listing() if e.job.id == job_id]
    return entry


def test_a_serve_ceiling_is_lowered_before_any_job_is_preempted_and_raised_when_room_returns(
        tmp_path: Path) -> None:
    queue, server, clock = _setup(tmp_path, _app("digits", 2, 1, 3))
    serve = server.serve
    digits = _entry(queue, "serve digits")
    assert (digits.job.state, digits.job.size, digits.job.cpus) == (
        "serving", "replicas 2 of 1-3", 2.0)
    assert digits.why == "Serve's autoscaler decides within 1-3"
    # L (1 CPU, priority 0) runs beside the two replicas and commits a checkpoint: it could be
    # preempted for U (2 CPUs, priority 5), but the deployment's surplus replica is enough.
    queue.submit(_fixed("L", 1))
    assert queue.tick() == ["L"]
    clock[0] = 600.0
    assert queue.checkpointed("L", server.tokens["L"]) is False
    queue.submit(_fixed("U", 2, priority=5))
    assert queue.tick() == []
    assert serve.limits == [("digits", 1)]
    assert _entry(queue, "L").job.state == "running"
    assert _entry(queue, "serve digits").job.size == "replicas 1 of 1-3 -> 1"
    # While Serve stops the replica (Ray still holds its CPU), its room counts as given back:
    # nothing more is asked, no ceiling raised, and U starts once Ray has the CPU.
    for _ in range(3):
        assert queue.tick() == [] and serve.limits == [("digits", 1)]
    assert _entry(queue, "L").job.state == "running"
    # Ray has the replica's CPU back before Serve stops listing it: U starts, and U, started
    # but not yet holding its CPUs in Ray, keeps that room: the ceiling is not raised into it.
    serve.released = True
    server.unclaimed.add("U")
    assert queue.tick() == ["U"]
    assert queue.tick() == [] and serve.limits == [("digits", 1)]
    serve.settle()
    assert queue.tick() == [] and serve.limits == [("digits", 1)]
    server.unclaimed.clear()
    lowered = _entry(queue, "serve digits")
    assert lowered.job.size == "replicas 1 of 1-3 -> 1"
    assert lowered.why == ("Serve's autoscaler decides within 1-1: the queue lowered its "
                           "ceiling for waiting jobs, raised when room returns")
    # Room returns and nothing waits: the ceiling goes back to the deployment's own maximum
    # (Serve's autoscaler decides whether to use it).
    server.exit("U", 0)
    assert queue.tick() == []
    assert serve.limits == [("digits", 1), ("digits", 3)]
    assert _entry(queue, "serve digits").job.size == "replicas 1 of 1-3"
    assert queue.tick() == [] and len(serve.limits) == 2


def test_a_ceiling_is_raised_only_as_far_as_the_free_room_holds_while_nothing_waits(
        tmp_path: Path) -> None:
    queue, server, _ = _setup(tmp_path, dataclasses.replace(_app("digits", 1, 1, 4), ceiling=1))
    queue.submit(_fixed("H", 2))
    assert queue.tick() == ["H"]
    # 1 CPU left beside H and the replica: the ceiling goes from 1 to 2, not to 4.
    assert server.serve.limits == [("digits", 2)]
    assert _entry(queue, "serve digits").job.size == "replicas 1 of 1-4 -> 2"


def test_fixed_counts_and_serve_run_deployments_are_counted_never_bounded(
        tmp_path: Path) -> None:
    queue, server, clock = _setup(tmp_path, _app("ranker", 1),
                                  _app("chat", 2, 1, 3, bounded=False))
    ranker, chat = _entry(queue, "serve ranker"), _entry(queue, "serve chat")
    assert (ranker.job.size, chat.job.size) == ("replicas 1", "replicas 2 of 1-3")
    assert ranker.why == "fixed at 1 replicas: counted, never resized by the queue"
    assert "counted, not bounded by the queue: no config of its autoscaling" in chat.why
    # Their 3 CPUs are used: L takes the last one, and U (1 CPU) gets it by preempting L.
    queue.submit(_fixed("L", 1))
    assert queue.tick() == ["L"]
    assert server.resources()[0] == (Resources(cpus=NODE_CPUS - 4),)
    clock[0] = 600.0
    queue.checkpointed("L", server.tokens["L"])
    queue.submit(_fixed("U", 1, priority=5))
    assert queue.tick() == []
    assert server.serve.limits == []
    assert _entry(queue, "L").job.state == "preempting"


def _details(**apps: dict[str, Any]) -> dict[str, Any]:
    """Serve's ``GET /api/serve/applications/`` answer, trimmed to what the queue reads."""
    return {"proxy_location": "EveryNode", "target_capacity": None,
            "http_options": {"host": "0.0.0.0", "port": 8000},
            "applications": apps}


def _application(source: str, scaling: dict[str, Any] | None, replicas: int,
                 config: dict[str, Any] | None = None) -> dict[str, Any]:
    return {"source": source, "deployed_app_config": config, "deployments": {"ModelServer": {
        "deployment_config": {"name": "ModelServer", "autoscaling_config": scaling},
        "required_resources": {"CPU": 0.5},
        "replicas": [{"state": "RUNNING"}] * replicas + [{"state": "STOPPING"}]}}}


def test_serve_applications_are_read_from_serves_answer_and_bounded_through_its_config(
        ) -> None:
    scaling = {"min_replicas": 1, "max_replicas": 4, "target_ongoing_requests": 8,
               "downscale_delay_s": 600}
    digits_config = {"name": "digits", "import_path": "raydeck.serving.app:app_builder",
                     "args": {"model_uri": "models:/digits@champion"},
                     "deployments": [{"name": "ModelServer", "max_ongoing_requests": 64,
                                      "autoscaling_config": scaling},
                                     {"name": "Other", "num_replicas": 1}]}
    other_config = {"name": "other", "import_path": "x:app"}
    details = _details(digits=_application("declarative", scaling, 2, digits_config),
                       other=_application("declarative", None, 1, other_config),
                       coded=_application("declarative", scaling, 1, other_config),
                       local=_application("imperative", scaling, 3))
    digits, other, coded, local = applications(details, {("digits", "ModelServer"): 6})
    # Its stopping replica is not among its replicas: it holds its CPU only until it exits.
    assert digits == ServeApp("digits", "ModelServer", 2, Resources(cpus=0.5), 1, 6, 4, True,
                              stopping=1)
    assert digits.lowered and digits.holds(2) == Resources(cpus=1.0)
    assert (other.max_replicas, other.elastic, other.replicas) == (0, False, 1)
    # Autoscaling in its code, or deployed with serve.run: no config of it to change.
    assert (coded.bounded, coded.elastic, coded.max_replicas) == (False, False, 4)
    assert (local.bounded, local.elastic, local.id) == (False, False, "serve local")
    lowered = bounded({**scaling, "initial_replicas": 3}, 2)
    assert lowered == {**scaling, "initial_replicas": 2, "max_replicas": 2}
    assert bounded(scaling, 4) == bounded(scaling, 5) == scaling  # its own, as deployed
    config = bounded_config(details, digits, bounded(scaling, 2))
    # Every application deployed from a config goes back (Serve deletes those a PUT leaves
    # out), the bounded one with only its max_replicas changed, its entries in their order;
    # serve.run's is not Serve's config to send.
    assert [app["name"] for app in config["applications"]] == ["digits", "other", "other"]
    assert config["applications"][1:] == [other_config, other_config]
    assert config["applications"][0] == {**digits_config, "deployments": [
        {"name": "ModelServer", "max_ongoing_requests": 64,
         "autoscaling_config": {**scaling, "max_replicas": 2}},
        {"name": "Other", "num_replicas": 1}]}
    assert digits_config["deployments"][0]["autoscaling_config"] == scaling  # not changed
    assert {key: config[key] for key in ("proxy_location", "http_options")} == {
        "proxy_location": "EveryNode", "http_options": {"host": "0.0.0.0", "port": 8000}}
    assert "target_capacity" not in config


def test_an_application_deployed_from_a_config_joins_the_others_or_replaces_its_own(
        ) -> None:
    """What `raydeck serve` sends Serve: every application deployed from a config as it is,
    with the new one added after them, or in its own place when one of its name exists;
    serve.run's applications are not part of Serve's config."""
    digits_config = {"name": "digits", "import_path": "raydeck.serving.app:app_builder",
                     "args": {"model_uri": "models:/digits/1"}}
    details = _details(digits=_application("declarative", None, 1, digits_config),
                       local=_application("imperative", None, 1))
    fresh = {"name": "fresh", "import_path": "raydeck.serving.app:app_builder", "args": {}}
    assert with_application(details, fresh)["applications"] == [digits_config, fresh]
    moved = {**digits_config, "args": {"model_uri": "models:/digits/2"}}
    config = with_application(details, moved)
    assert config["applications"] == [moved]
    assert config["http_options"] == {"host": "0.0.0.0", "port": 8000}
    assert deployed_config(details, "local") is None
    assert deployed_config(details, "digits") == digits_config
