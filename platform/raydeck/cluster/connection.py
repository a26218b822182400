"""Connecting a process to Ray with raydeck's settings, and reading the cluster's shape.

Owns: the one ``ray.init`` call raydeck makes (address, namespace, and what carries raydeck's
settings to every worker of the job: the job's runtime env, or for a local Ray that the call
starts, its processes' environment, :func:`starting_ray`), and read-only views of nodes and
resources.
Does not own: starting or stopping clusters (``ray start``/compose do that) or job submission;
the local Ray that ``ray.init`` starts when no cluster is named gets the variables of every
node raydeck starts (:mod:`raydeck.cluster.node_env`) and Serve's ingress as
:mod:`raydeck.cluster.serve_ingress` chooses it (:func:`local_node_variables`).
"""

from __future__ import annotations

import atexit
import contextlib
import importlib
import json
import logging
import os
import re
import socket
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from raydeck._internal import contract
from raydeck._internal.environ import environment
from raydeck.cluster import node_env
from raydeck.cluster.serve_ingress import local_node_env
from raydeck.config.settings import Settings, load_settings
from raydeck.config.stack_connection import ray_auth_env
from raydeck.errors import ClusterUnavailableError

logger = logging.getLogger(__name__)

TRAIN_POLL_ENV = "RAY_TRAIN_HEALTH_CHECK_INTERVAL_S"
RAY_TRAIN_CALLBACKS_ENV = "RAY_TRAIN_CALLBACKS"
# Hands a Train worker's tracking data to the proxy before Ray Train kills the worker.
TRAIN_HANDOFF_CALLBACK = "raydeck.tracking.client.train_handoff.TrainWorkerHandoff"
RAY_TUNE_CALLBACKS_ENV = "RAY_TUNE_CALLBACKS"
# Tells the proxy how each plain Tune trial ended, so its run ends with that status.
TUNE_OUTCOME_CALLBACK = "raydeck.tracking.client.tune_outcome.TrialOutcome"

PROBE_TIMEOUT_S = 3.0
# A command's driver (``raydeck queue``, ``submit --queue``, ``status``...) lives for seconds and
# exports no metric anyone reads; with metrics on, Ray's core worker runs OpenCensus's harvester
# thread, which at the process's exit can race C++'s static destructors and die with SIGSEGV
# after the command's work is done (seen once in a suite run: ``raydeck submit`` printed its
# job and exited -6). Ray reads the variable when the driver's core worker starts. It did not
# suffice (the same crash, exit -11), so a command's driver also leaves without Ray's teardown
# (leave_as_command_driver) and C++'s (raydeck.cli.main).
COMMAND_DRIVER_ENV = {"RAY_enable_metrics_collection": "0"}
# Every Ray job that connects is listed by Ray's job server (`ray job list`) as a DRIVER job,
# a command's as much as a training script's; a command's says what it is.
COMMAND_DRIVER_METADATA = {contract.JOB_KIND_METADATA: contract.COMMAND_DRIVER_KIND}
# Whether this process connected through connect_existing (a command's driver).
_command_driver = False


def unreachable_reason(address: str) -> str | None:
    """Why a ``host:port`` (or ``ray://host:port``) cluster address cannot be reached, or None.

    Ray itself retries an absent head for a minute or more before failing; a plain TCP connect
    tells within seconds, so raydeck fails fast with a clear line instead.
    """
    match = re.match(r"^(?:ray://|https?://)?([\w.\-]+):(\d+)$", address)
    if not match:
        return None
    host, port = match.group(1), int(match.group(2))
    try:
        with socket.create_connection((host, port), timeout=PROBE_TIMEOUT_S):
            return None
    except OSError as exc:
        return f"{type(exc).__name__}: {exc.strerror or exc}"


def callbacks_env(current: str | None, callback: str) -> str:
    """A comma-separated list of callbacks (``RAY_TRAIN_CALLBACKS``, ``RAY_TUNE_CALLBACKS``)
    with ``callback`` added once."""
    names = [name.strip() for name in (current or "").split(",") if name.strip()]
    if callback not in names:
        names.append(callback)
    return ",".join(names)


def _raydeck_callbacks() -> dict[str, str]:
    """The Ray Train and Ray Tune callback variables with raydeck's callbacks added."""
    return {name: callbacks_env(os.environ.get(name), callback) for name, callback in (
        (RAY_TRAIN_CALLBACKS_ENV, TRAIN_HANDOFF_CALLBACK),
        (RAY_TUNE_CALLBACKS_ENV, TUNE_OUTCOME_CALLBACK))}


def job_runtime_env(settings: Settings, extra: dict[str, Any] | None = None) -> dict[str, Any]:
    """The runtime env that makes every task and actor of a job see the driver's settings.

    ``extra`` (a user's runtime env) wins for keys it sets, and its ``env_vars`` are merged over
    raydeck's. Secrets are never part of it: Ray's runtime env agent writes every runtime env
    it creates, variables included, to its log on every node. Ray Train workers reach S3
    through the pickled filesystem of :func:`raydeck.storage.checkpoint_storage`, and the
    tracking proxy gets its credentials from the process that creates it.
    """
    env_vars = settings.to_env()
    # An epoch is logged once Ray Train has committed its checkpoint, which happens when the
    # controller next polls the workers; Ray's 2 s default would add up to 2 s to every epoch
    # (measured: the demo's 10 epochs took 16 s longer). A value the user set wins.
    env_vars[TRAIN_POLL_ENV] = os.environ.get(TRAIN_POLL_ENV, str(settings.train_poll_interval_s))
    # Every TorchTrainer of the job (the user's own RunConfig too) gets raydeck's worker callback
    # that hands a worker's tracking data to the proxy before Ray Train kills the worker, and
    # every Tuner the one that reports each trial's outcome to the proxy.
    env_vars.update(_raydeck_callbacks())
    runtime_env: dict[str, Any] = dict(extra or {})
    runtime_env["env_vars"] = {**env_vars, **runtime_env.get("env_vars", {})}
    return runtime_env


def _beside_submitted_job(runtime_env: dict[str, Any]) -> dict[str, Any]:
    """``runtime_env`` without the variables a ``ray job submit`` runtime env already sets.

    Ray merges a submitted job's runtime env with the one its driver passes to ``ray.init`` and
    refuses to start when both set the same variable. The job's own value wins: the driver read
    its settings from it (Ray fills ``${NAME}`` on every node alike).
    """
    injected = os.environ.get("RAY_JOB_CONFIG_JSON_ENV_VAR")
    if not injected:
        return runtime_env
    job_env_vars = (json.loads(injected).get("runtime_env") or {}).get("env_vars") or {}
    env_vars = {k: v for k, v in runtime_env.get("env_vars", {}).items() if k not in job_env_vars}
    return {**runtime_env, "env_vars": env_vars}


@contextlib.contextmanager
def local_node_variables(address: str | None) -> Iterator[None]:
    """Around a ``ray.init``: a local Ray it starts gets the variables of every node raydeck
    starts (:data:`raydeck.cluster.node_env.NODE_ENV`) and Serve's ingress as raydeck chooses it.

    ``ray.init`` starts a local Ray, whose processes inherit this process's environment as it
    is then, when ``address`` is ``local``, or empty with no ``RAY_ADDRESS`` and no ``ray
    start`` cluster on this machine (Ray's rule). Ray's processes read them when they start
    (Serve's ``RAY_SERVE_ENABLE_HA_PROXY`` when its controller starts), so they are in the
    environment for the call (a value the user set is kept) and this process's environment is
    as before afterwards: nothing else this process starts inherits HAProxy's ports.
    """
    if (address and address != "local") or (not address and os.environ.get("RAY_ADDRESS")):
        yield
        return
    with environment({**node_env.local_env(os.environ), **local_node_env(os.environ)}):
        yield


def starts_local_ray(address: str | None) -> bool:
    """Whether ``ray.init(address=address)`` starts a new local Ray rather than joining a
    cluster, by Ray's rule: ``local``; or no address, no ``RAY_ADDRESS`` and no cluster that
    ``ray start`` recorded on this machine."""
    if address:
        return address == "local"
    return not os.environ.get("RAY_ADDRESS") and _recorded_ray_address() is None


@contextlib.contextmanager
def starting_ray(address: str | None, runtime_env: dict[str, Any]
                 ) -> Iterator[dict[str, Any] | None]:
    """Around a ``ray.init(address=..., runtime_env=<the value yielded>)``.

    Joining a cluster, ``runtime_env`` is passed whole. A local Ray that the call starts
    inherits this process's environment as it is then, so ``runtime_env``'s variables (raydeck's
    settings) and the node's variables (:func:`local_node_variables`) are set for the call and reach
    every worker that way, and only the rest of ``runtime_env`` is passed: none, unless the
    caller added more. Ray then starts each worker directly instead of through its runtime-env
    setup process, one interpreter and one ``import ray`` (about 0.8 CPU-s) less per worker,
    which is what a local Ray spends most of its time on.
    """
    if not starts_local_ray(address):
        yield runtime_env
        return
    rest = {key: value for key, value in runtime_env.items() if key != "env_vars"}
    with local_node_variables(address), environment(runtime_env.get("env_vars", {})):
        yield rest or None


def use_stack_auth(address: str | None) -> None:
    """Make Ray present the stack's token when ``address`` is the running stack's head.

    Ray sends a token on an explicit address only with ``RAY_AUTH_MODE=token`` in the
    process's environment (and finds it through ``RAY_AUTH_TOKEN_PATH``), so both are set here
    for the stack's own address, and only when the process chose no mode or token itself. Ray's
    cached configuration is refreshed, as Ray's own token setup does.
    """
    variables = ray_auth_env(address)
    if not variables:
        return
    os.environ.update(variables)
    try:
        raylet = importlib.import_module("ray._raylet")
        raylet.Config.initialize("")
    except (ImportError, AttributeError):  # a Ray without the cache: the environment suffices
        pass


def connect(
    settings: Settings | None = None,
    *,
    runtime_env: dict[str, Any] | None = None,
    log_to_driver: bool = True,
) -> Settings:
    """Connect this process to Ray once, as raydeck's settings say; a no-op if already connected.

    An empty ``ray_address`` follows Ray's own rule (``RAY_ADDRESS``, else a cluster started with
    ``ray start`` on this machine, else a new local instance); ``local`` always starts a new one.

    Returns:
        The settings used, so callers that passed none can reuse them.

    Raises:
        ClusterUnavailableError: the configured cluster cannot be reached.
    """
    import ray

    settings = settings or load_settings()
    # The driver builds its TorchTrainers' and Tuners' callbacks from its own environment.
    os.environ.update(_raydeck_callbacks())
    if ray.is_initialized():
        return settings
    address = settings.ray_address or None
    reason = unreachable_reason(address) if address else None
    if reason:
        raise ClusterUnavailableError(
            f"cannot reach the Ray cluster at {address!r} ({reason}); start it with `ray start "
            "--head` or set RAYDECK_RAY_ADDRESS / RAY_ADDRESS to a reachable head"
        )
    if address is None and not os.environ.get("RAY_ADDRESS"):
        _refuse_a_stale_ray_record()
    use_stack_auth(address)
    try:
        job_env = _beside_submitted_job(job_runtime_env(settings, runtime_env))
        with starting_ray(address, job_env) as passed:
            ray.init(
                address=address,
                runtime_env=passed,
                log_to_driver=log_to_driver,
                logging_level=logging.WARNING,
                configure_logging=True,
            )
    except (ConnectionError, TimeoutError) as exc:
        raise ClusterUnavailableError(
            f"cannot reach the Ray cluster at {address!r} ({exc}); start it with `ray start "
            "--head` or set RAYDECK_RAY_ADDRESS / RAY_ADDRESS to a reachable head"
        ) from None
    logger.debug("connected to Ray at %s", address or "(auto)")
    return settings


def _recorded_ray_address() -> str | None:
    """The address ``ray start`` recorded in ``<Ray's temp dir>/ray_current_cluster``, if any:
    where ``ray.init`` with no address goes."""
    from ray._common.utils import get_ray_address_file  # where `ray start` records it

    try:
        with open(get_ray_address_file(None), encoding="utf-8") as fh:
            return fh.read().strip() or None
    except OSError:
        return None


def _refuse_a_stale_ray_record() -> None:
    """Fail fast if Ray's record of a cluster on this machine names one that is gone.

    With no address, ``ray.init`` joins the cluster that ``ray start`` recorded
    (:func:`_recorded_ray_address`). A cluster stopped without ``ray stop`` (killed, or its
    machine rebooted) leaves the record behind, and Ray then retries the dead address for
    minutes before it fails; raydeck says what happened and the fix in seconds instead.

    Raises:
        ClusterUnavailableError: the recorded address does not answer.
    """
    from ray._common.utils import get_ray_address_file

    recorded = _recorded_ray_address()
    reason = unreachable_reason(recorded) if recorded else None
    if reason:
        raise ClusterUnavailableError(
            f"Ray's record of a cluster started on this machine ({get_ray_address_file(None)}) "
            f"names {recorded!r}, where nothing answers ({reason}): that cluster was stopped "
            "without `ray stop`. Run `ray stop` (it clears the record) to use a new local Ray, "
            "or set RAYDECK_RAY_ADDRESS / RAY_ADDRESS to a reachable head"
        )


def connect_existing(address: str) -> None:
    """Connect to an already running cluster to inspect it; never starts one. The driver
    exports no metrics (``COMMAND_DRIVER_ENV``): a command must not crash as it exits. Its Ray
    job carries the metadata ``raydeck_kind=command`` (:data:`COMMAND_DRIVER_METADATA`), so
    that ``raydeck jobs`` never lists a command as a job (except through Ray Client, which
    takes no job config from its caller).

    Raises:
        ClusterUnavailableError: nothing answers at ``address`` (``auto``: no cluster found).
    """
    import ray
    from ray.job_config import JobConfig

    if address == "auto" and not os.environ.get("RAY_ADDRESS"):
        _refuse_a_stale_ray_record()
    reason = unreachable_reason(address)
    if reason is None:
        use_stack_auth(address)
        try:
            # Through Ray Client (ray://) the driver is the client server's, on the head, and
            # Ray Client sends ray.init's arguments as JSON, which a JobConfig is not: such a
            # command's driver is unmarked, and listed only by `raydeck jobs --drivers`.
            with environment(COMMAND_DRIVER_ENV):
                if address.startswith("ray://"):
                    ray.init(address=address, logging_level=logging.ERROR, log_to_driver=False)
                else:
                    ray.init(address=address, logging_level=logging.ERROR, log_to_driver=False,
                             job_config=JobConfig(metadata=dict(COMMAND_DRIVER_METADATA)))
            global _command_driver
            _command_driver = True
            return
        except (ConnectionError, RuntimeError, ValueError) as exc:
            reason = _failure_summary(exc)
    raise ClusterUnavailableError(
        f"Ray cluster at {address!r} is unreachable ({reason}); start it or fix "
        "RAYDECK_RAY_ADDRESS / RAY_ADDRESS"
    )


def _failure_summary(exc: Exception) -> str:
    """One line for why ``ray.init`` failed. Ray Client puts the server's traceback under a
    heading ("Initialization failure from server:"): its last line is the server's reason
    (e.g. "RuntimeError: Starting Ray client server failed. See ray_client_server_23001.err
    ..."), so a heading is followed by it."""
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    if not lines:
        return type(exc).__name__
    if lines[0].endswith(":") and len(lines) > 1:
        return node_env.explain_client_failure(f"{lines[0]} {lines[-1]}")
    return lines[0]


def leave_as_command_driver() -> None:
    """In a process that connected through :func:`connect_existing`, once its command is done:
    drop Ray's own exit hook (``ray.shutdown``), so the process ends without Ray's teardown and
    the raylet ends its Ray job as for any driver that exits. Even with metrics off, a command's
    driver died in or after that teardown (SIGSEGV in OpenCensus's harvester thread, after the
    command had printed its result). A process that started its own local Ray keeps the hook:
    it stops that cluster.
    """
    if not _command_driver:
        return
    import ray

    atexit.unregister(ray.shutdown)


@dataclass(frozen=True)
class NodeView:
    """One Ray node as ``raydeck status`` shows it."""

    node_id: str
    address: str
    alive: bool
    is_head: bool
    resources: dict[str, float]


def nodes() -> list[NodeView]:
    """The nodes Ray knows, alive or dead, head first."""
    import ray

    views = [
        NodeView(
            node_id=n["NodeID"],
            address=n.get("NodeManagerAddress", ""),
            alive=bool(n.get("Alive")),
            is_head="node:__internal_head__" in n.get("Resources", {}),
            resources={k: float(v) for k, v in n.get("Resources", {}).items()},
        )
        for n in ray.nodes()
    ]
    return sorted(views, key=lambda v: (not v.is_head, v.address))


def connect_running(address: str = "") -> None:
    """Connect to the running cluster a command is about: ``address`` (raydeck's
    ``ray_address``), else ``RAY_ADDRESS`` unless it is the job server's ``http://`` URL (as
    for ``ray job submit``), else the cluster started on this machine.

    Raises:
        ClusterUnavailableError: nothing answers there.
    """
    address = address or os.environ.get("RAY_ADDRESS", "")
    connect_existing(address if address and not address.startswith("http") else "auto")
