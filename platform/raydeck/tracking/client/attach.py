"""``get_tracker``: how a process finds its run and attaches to it.

Rules a user can predict (README "Tracking"):

- ``get_tracker(run_id=K)`` (or ``RAYDECK_RUN_ID=K``): the run with key K (created by the first
  process that asks, attached to by the others). Called again in the same process, it returns
  the same tracker until that one is finished.
- ``get_tracker(run_name=N)``: this process's tracker created under the name N, else a new run
  named N. A *different* name starts another run alongside the active one (like
  ``mlflow.start_run(nested=True)``, linked only if you pass ``parent_run_id``); it never returns
  a run of another name.
- ``get_tracker()``: the process's current tracker in its context (its Ray Train run, its Tune
  trial, else the driver's newest active run), or a new run if there is none.

Thread-safe: two threads asking for the same run get the same tracker. Attaching never waits
for MLflow (the proxy creates the run when MLflow answers); if the proxy itself does not answer
within :data:`ATTACH_TIMEOUT_S`, the tracker buffers and attaches in the background.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import threading
import uuid
from typing import Any, cast

from raydeck._internal.contract import JOB_DIGEST_ENV, JOB_DIGEST_TAG
from raydeck.cluster.connection import connect
from raydeck.config.settings import RUN_KEY_PATTERN, Settings, load_settings
from raydeck.errors import ConfigError
from raydeck.tracking.client import lifecycle
from raydeck.tracking.client.context import detect_process
from raydeck.tracking.client.modes import check_mode
from raydeck.tracking.client.noop import NoOpTracker
from raydeck.tracking.client.tracker import Tracker
from raydeck.tracking.messages import AttachRequest, RunBinding
from raydeck.tracking.proxy.actors import attach_to_router

logger = logging.getLogger(__name__)

ATTACH_TIMEOUT_S = 30.0


def get_tracker(
    run_id: str | None = None,
    *,
    run_name: str | None = None,
    experiment: str | None = None,
    mode: str | None = None,
    parent_run_id: str | None = None,
    params: dict[str, Any] | None = None,
    tags: dict[str, Any] | None = None,
    settings: Settings | None = None,
) -> Tracker:
    """The tracker for this process's run, creating or attaching to the run as needed.

    Args:
        run_id: a shared run key (1-128 of ``[A-Za-z0-9_.-]``, or an existing MLflow run id)
            that several processes use to log to one run; default ``RAYDECK_RUN_ID``, else the
            Ray Train run this worker belongs to, else a new run.
        run_name: MLflow run name when this call creates the run; see the module docstring for
            what a different name does.
        experiment: MLflow experiment (default ``RAYDECK_TRACKING_EXPERIMENT``).
        mode: ``rank_zero``, ``all_ranks`` or ``per_rank`` (default
            ``RAYDECK_TRACKING_MODE``); the run keeps the mode it was created with.
        parent_run_id: key of a parent run (sweeps use it for trial runs).
        params, tags: logged right away (params only by the primary/rank 0).
        settings: settings to use instead of the environment's.

    Returns:
        A :class:`Tracker`, or a :class:`NoOpTracker` when tracking is disabled or this rank
        is silent in the run's mode.

    Raises:
        ConfigError: a bad argument or setting (named in the message).
        ClusterUnavailableError: Ray itself cannot be reached.
    """
    settings = settings or load_settings()
    if not settings.tracking.enabled:
        return NoOpTracker()
    requested_mode = check_mode(mode) if mode else settings.tracking.mode
    key = run_id or settings.run_id or None
    for name, value in (("run_id", key), ("parent_run_id", parent_run_id)):
        if value is not None and (not isinstance(value, str) or not RUN_KEY_PATTERN.match(value)):
            raise ConfigError(f"{name}={value!r}: may hold 1-128 letters, digits, _ . - only")
    connect(settings)
    process = detect_process()
    scope = (f"train:{process.train_run_name}" if process.train_run_name
             else f"trial:{process.trial_id}" if process.trial_id else "")
    with lifecycle.lock:
        # The registry holds only the trackers registered here.
        tracker = cast(Tracker | None, lifecycle.find(key, run_name, parent_run_id, scope))
        attached = tracker is None
        if tracker is None:
            tracker = _attach_new(settings, process, key, run_name, experiment, requested_mode,
                                  parent_run_id)
            lifecycle.register(tracker, key, run_name, parent_run_id, scope)
        elif mode and tracker.active and tracker.mode != mode:
            logger.warning("run %s was created in mode %s; ignoring mode=%s", tracker.run_key,
                           tracker.mode, mode)
    lifecycle.install_hooks(
        in_main_thread_driver=process.role == "driver"
        and threading.current_thread() is threading.main_thread())
    if params:
        tracker.log_params(params)
    digest = os.environ.get(JOB_DIGEST_ENV)
    if digest and attached and process.role == "driver":
        # A submitted job's run names the job it is a run of: the queue predicts durations
        # from earlier runs of the same job.
        tags = {**(tags or {}), JOB_DIGEST_TAG: digest}
    if tags:
        tracker.set_tags(tags)
    return tracker


def attach_guest(run_id: str, settings: Settings) -> Tracker:
    """A tracker that writes to the existing run ``run_id`` as a guest, for a process that
    only writes to it by id (``MlflowClient().log_batch(run_id, ...)`` in a Ray actor).

    A guest takes no part in the run's life (``AttachRequest.guest``): the run's owner ends it
    whether the guest's process lives on or not, and a write after the end lands in the ended
    run, as in plain MLflow. So the caller hands each write to the proxy before returning
    (``flush``). A guest carries only what is written through it: no console capture, no system
    metrics (they would go on landing in the run after its end). At exit its trackers are
    handed over and stopped like any other; never ended.

    Raises:
        ConfigError: the router refused ``run_id`` (a bad key, an MLflow run id with no run).
    """
    if not settings.tracking.enabled:
        return NoOpTracker()
    connect(settings)
    process = detect_process()
    request = AttachRequest(
        client_id=uuid.uuid4().hex, process=process, tracking_uri=settings.tracking.uri,
        run_key=run_id, run_name=None, experiment=settings.tracking.experiment,
        mode=settings.tracking.mode, guest=True)
    binding = _first_binding(settings, request)
    tracker: Tracker
    if binding is not None and not binding.active:
        tracker = NoOpTracker(binding, process)
    else:
        quiet = dataclasses.replace(settings.tracking, capture_logs=False,
                                    system_metrics_interval_s=0.0)
        tracker = Tracker(dataclasses.replace(settings, tracking=quiet), process, request,
                          binding)
    with lifecycle.lock:
        lifecycle.register(tracker, run_id, None, None, lifecycle.GUEST_SCOPE)
    lifecycle.install_hooks(in_main_thread_driver=False)
    return tracker


def _attach_new(settings: Settings, process: Any, key: str | None, run_name: str | None,
                experiment: str | None, mode: str, parent_key: str | None) -> Tracker:
    if key is None and process.train_run_name is None:
        # A run of our own: its key is made here, so the run stays the same one if the proxy
        # only answers later.
        key = f"run-{uuid.uuid4().hex[:12]}"
    request = AttachRequest(
        client_id=uuid.uuid4().hex, process=process, tracking_uri=settings.tracking.uri,
        run_key=key, run_name=run_name, experiment=experiment or settings.tracking.experiment,
        mode=mode, parent_key=parent_key,
    )
    binding = _first_binding(settings, request)
    if binding is not None and not binding.active:
        return NoOpTracker(binding, process)
    if binding is not None and run_name and binding.resumed and binding.run_name != run_name:
        logger.warning("run %s is named %r; ignoring run_name=%r (attached to the existing run)",
                       binding.run_key, binding.run_name, run_name)
    return Tracker(settings, process, request, binding)


def _first_binding(settings: Settings, request: AttachRequest) -> RunBinding | None:
    """Ask the router once; None if it does not answer in time (the tracker retries)."""
    import ray

    try:
        binding, _ = attach_to_router(settings, request, ATTACH_TIMEOUT_S)
        return binding
    except ray.exceptions.RayTaskError as exc:
        cause = exc.cause if isinstance(exc.cause, Exception) else exc
        if isinstance(cause, ConfigError):
            raise ConfigError(str(cause)) from None
        logger.warning("tracking proxy failed to attach (%s); this process buffers its data "
                       "and attaches in the background", cause)
    except Exception as exc:
        logger.warning("tracking proxy did not answer (%s: %s); this process buffers its data "
                       "and attaches in the background", type(exc).__name__, exc)
    return None
