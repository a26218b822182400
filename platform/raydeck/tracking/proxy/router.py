"""The router: owns run membership for every tracker in the cluster.

Owns: mapping run keys (a shared ``RAYDECK_RUN_ID``, a Ray Train run name, a generated key) to
runs, knowing which processes take part in each run and which one is primary, deciding when a
run ends (its primary finished and every other participant left; ``KILLED`` when its processes
died), and stopping the proxy after a quiet period. Does not own: any MLflow write. Creating,
reopening and ending a run are *entities* the router hands to the run's shard (:class:`OpenRun`,
``end``, through :mod:`~raydeck.tracking.proxy.outbox`), which writes them in order with the run's
data, when MLflow answers. So attaching works while MLflow is down or slow, and no MLflow call
ever runs under the router's lock (a slow server never delays a heartbeat).

Membership of open runs, and every run update decided with it until a shard took it, is written
through to the head's disk (:class:`~raydeck.tracking.proxy.membership.MembershipStore`): a
router Ray restarted starts with its predecessor's, so a run whose remaining processes died
meanwhile still ends, and an end decided while its shard was unreachable is still delivered.
Beyond that, state is soft: a router that has no membership rebuilds a run from MLflow (the
``raydeck.run_key`` tag) when a tracker re-attaches, and trackers re-attach when a heartbeat
is not recognised.

Rules:
- Run key: explicit key > the Ray Train run name (when that name is bound to a run, or when the
  job has exactly one run created by its driver, which then gets bound) > a new key.
- Primary: the first driver/rank-0/trial process attached to a run with no live primary. A
  restarted process (same ``role_key``) replaces its predecessor, primary role included.
- End: when the primary has finished (its status is used) and no participant is left. A
  primary that died ends its run ``KILLED``. A plain Tune trial's run ends with the outcome
  Tune reported for it (``set_trial_outcome``), if Tune did before the trial's process left.
- Guests (a process that only writes to a run by its id, ``AttachRequest.guest``) are not
  participants: they get the run's binding and write through its shard, but never hold the run
  open, reopen it or end it by leaving. A guest's explicit end (``end_unowned``) ends only a
  run that no process holds.
- Liveness, from Ray itself: a participant is gone when its Ray job ended, or when it is an
  actor Ray reports dead. A participant whose heartbeats stopped is asked about after two missed
  beats; one Ray cannot vouch for (a plain task) is presumed dead after ``lost_after_s`` of
  silence. A heartbeat delayed by a slow MLflow cannot happen: nothing here waits for MLflow.
- Leaving is final for a client: a heartbeat or an attach of a client that detached (sent before
  its detach, answered after) neither reports it unknown nor joins it again, so it never
  reopens the run its detach ended; a detach repeated gets the first one's answer.
- Stopping when idle (no active run and no attach under way for ``idle_timeout_s``) is decided
  atomically with attaches (:meth:`RouterCore.claim_stop`); from then on attaches are refused
  (:data:`STOPPING`) and trackers attach to the next proxy.
"""

from __future__ import annotations

import logging
import threading
import time
import uuid
import zlib
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import replace
from typing import Any

from raydeck._internal.redaction import redact_text
from raydeck.config.settings import RUN_KEY_PATTERN
from raydeck.errors import ConfigError, TrackingUnavailableError
from raydeck.tracking.messages import AttachRequest, ProcessInfo, ProxyConfig, RunBinding
from raydeck.tracking.proxy.bindings import binding, guest_binding, open_child, open_run
from raydeck.tracking.proxy.membership import MembershipStore, Participant, Run
from raydeck.tracking.proxy.outbox import Control, Outbox, Sender
from raydeck.tracking.proxy.run_lookup import Lookup, looks_like_run_id

logger = logging.getLogger(__name__)

REAP_INTERVAL_S = 1.0
# A participant silent for this many heartbeat intervals is a suspect: Ray is asked about it.
SUSPECT_AFTER_BEATS = 2.5
# Clients that left (detach) whose late heartbeats are not answered "unknown" (that answer makes
# a tracker attach again); the oldest are forgotten first.
MAX_DEPARTED = 10_000
# The message of the error an attach gets while the proxy stops itself; clients attach again to
# the next proxy (:func:`raydeck.tracking.proxy.actors.attach_to_router`).
STOPPING = "the tracking proxy is stopping itself (idle)"


# (every participant, those whose heartbeats stopped) -> role keys Ray says are gone.
Liveness = Callable[[list[ProcessInfo], list[ProcessInfo]], set[str]]


class RouterCore:
    """The router's logic. MLflow lookups, shard calls and Ray queries are injected."""

    def __init__(self, config: ProxyConfig, send: Sender, lookup: Callable[[str, str], Lookup],
                 gone: Liveness, store: MembershipStore | None = None) -> None:
        self.config = config
        self.outbox = Outbox(send, self._sent)
        self._lookup = lookup
        self._gone = gone
        self._lock = threading.RLock()
        self._runs: dict[str, Run] = {}
        self._aliases: dict[str, str] = {}
        self._by_client: dict[str, str] = {}
        # Clients whose part end_run ended for them: their own detach has nothing left to do.
        self._released: set[str] = set()
        # Clients that left: a heartbeat of theirs sent before they left is late, not a sign
        # that this router forgot them (see heartbeat).
        self._departed: OrderedDict[str, list[str]] = OrderedDict()  # -> the runs it ended
        self._idle_since: float | None = time.monotonic()
        # Attaches under way: the proxy is never idle while one is (it may be about to open a
        # run), and once it decided to stop (claim_stop) it takes none.
        self._attaching = 0
        self._stopping = False
        self.active_runs = 0
        # The open runs of the router this one replaces (Ray restarted it): their processes
        # are asked about by the reaper as usual, and the runs end when they are gone.
        self._store = store
        for run in store.load() if store is not None else []:
            self._runs[run.key] = run
            for client_id in run.participants:
                self._by_client[client_id] = run.key
            self._idle_since = None
        # Its updates no shard took (an end decided while the run's shard was unreachable):
        # sent again, first, by the reaper's next retry.
        unsent = store.load_controls() if store is not None else []
        self.outbox.resume(unsent)
        if self._runs or unsent:
            logger.info("router restarted with %d open run(s) and %d unsent run update(s) of "
                        "its predecessor", len(self._runs), len(unsent))

    # --- attach ------------------------------------------------------------------------------
    def attach(self, request: AttachRequest) -> RunBinding:
        """Bind a tracker to its run; the run is created or reopened by its shard, in order.

        Never waits for MLflow longer than one fast lookup of a key this router does not know.

        Raises:
            ConfigError: a driver configured for another MLflow than this proxy writes to; a run
                key that breaks the rules.
            TrackingUnavailableError: the proxy is stopping itself (:data:`STOPPING`); the
                caller attaches again, to the next proxy.
        """
        with self._lock:
            if self._stopping:
                raise TrackingUnavailableError(STOPPING)
            self._attaching += 1
            if not request.guest and request.client_id in self._departed:
                # A late attach of a tracker that already left (a reconnect that crossed its
                # detach): it gets the run's binding as a guest would; it must not join again,
                # nor reopen the run its detach ended (nobody would end it again).
                request = replace(request, guest=True)
        try:
            return self._attach(request)
        finally:
            with self._lock:
                self._attaching -= 1

    def _attach(self, request: AttachRequest) -> RunBinding:
        process = request.process
        if process.role == "driver" and (
            redact_text(request.tracking_uri) != redact_text(self.config.tracking_uri)
        ):
            raise ConfigError(
                f"the tracking proxy in Ray namespace {self.config.namespace!r} writes to "
                f"{redact_text(self.config.tracking_uri)}, but this process is configured for "
                f"{redact_text(request.tracking_uri)}: to log where the proxy writes, set "
                "RAYDECK_TRACKING_URI to its URI (or unset what chose the other one: "
                "`raydeck config` shows where each value comes from); to log to "
                f"{redact_text(request.tracking_uri)}, give this process a proxy of its own "
                "with RAYDECK_RAY_NAMESPACE=<another name>"
            )
        with self._lock:
            key = self._resolve_key(request)
            run = self._runs.get(key)
        if not RUN_KEY_PATTERN.match(key):
            raise ConfigError(f"run id {key!r}: may hold 1-128 letters, digits, _ . - only")
        if run is None:
            found = self._lookup(key, request.experiment)
            if found.known and not found.run_id and looks_like_run_id(key):
                raise ConfigError(
                    f"run id {key!r} looks like an MLflow run id, but MLflow at "
                    f"{redact_text(self.config.tracking_uri)} has no such run; pass an existing "
                    "run id, or a name of your own (letters, digits, _ . -) to create a shared "
                    "run")
            if request.guest:
                # A guest of a run this router does not hold: nothing to join or open; the
                # run's shard finds the run in MLflow for the guest's writes.
                return guest_binding(_run_record(key, request, found), request,
                                     self.shard_of(key))
            with self._lock:
                run = self._runs.get(key) or self._new_run(key, request, found)
        with self._lock:
            if request.guest:
                return guest_binding(run, request, self.shard_of(run.key))
            if process.train_run_name and process.train_run_name != key:
                self._aliases[process.train_run_name] = key
            # Logging after the end reopens the run (the next finish ends it again), but a rank
            # that stays silent in rank_zero mode never joins, so it must not reopen a run it
            # would never end (a slow rank 1 attaching after rank 0 ended the run).
            silent = run.mode == "rank_zero" and not process.is_primary_candidate
            if run.terminated and not silent:
                run.terminated = False
                run.needs_open = True
                run.primary = None
                run.primary_status = None
                run.outcome = None
            controls = open_run(run, self.config.artifact_location, self.shard_of(run.key))
            bound, child_open = self._join(run, request)
            if child_open is not None:
                controls.append(child_open)
            self._idle_since = None
            controls = self._keep([run], controls)
        self.outbox.deliver(controls)
        return bound

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

    def _new_run(self, key: str, request: AttachRequest, found: Lookup) -> Run:
        run = self._runs[key] = _run_record(key, request, found)
        return run

    def shard_of(self, root_key: str) -> int:
        """A run, its per-rank children and all their data share one shard (order holds)."""
        return zlib.crc32(root_key.encode()) % self.config.shards

    def _join(self, run: Run, request: AttachRequest) -> tuple[RunBinding, Control | None]:
        process = request.process
        now = time.monotonic()
        if run.first_client is None:
            run.first_client = request.client_id
        for client_id, participant in list(run.participants.items()):
            if participant.process.role_key == process.role_key and client_id != request.client_id:
                self._drop(run, client_id, replaced=True)
        if run.mode == "rank_zero" and not process.is_primary_candidate:
            return binding(run, request, self.shard_of(run.key), active=False), None
        run.participants[request.client_id] = Participant(request.client_id, process, now)
        self._by_client[request.client_id] = run.key
        if process.is_primary_candidate and (
            run.primary is None or run.primary not in run.participants
        ):
            run.primary = request.client_id
            run.primary_status = None
        shard = self.shard_of(run.key)
        child_open = open_child(run, process, self.config.artifact_location, shard)
        return binding(run, request, shard, active=True), child_open

    # --- heartbeat / detach / end ------------------------------------------------------------
    def heartbeat(self, client_ids: list[str]) -> list[str]:
        """Mark clients alive; returns the ids this router does not know (they re-attach)."""
        now = time.monotonic()
        unknown = []
        with self._lock:
            for client_id in client_ids:
                key = self._by_client.get(client_id)
                run = self._runs.get(key) if key else None
                if run is None or client_id not in run.participants:
                    if client_id not in self._departed:
                        unknown.append(client_id)
                else:
                    run.participants[client_id].last_seen = now
        return unknown

    def detach(self, client_id: str, status: str) -> list[str] | None:
        """A tracker left. The run ends only when its primary has and nobody is left.

        Returns the keys of the runs this ended (the run, per-rank children), so the caller
        can wait until their end is written; None when this router does not know the client
        (it restarted since the client attached): the client attaches again, then detaches.
        """
        _check_status(status)
        with self._lock:
            key = self._by_client.get(client_id)
            run = self._runs.get(key) if key else None
            if run is None or client_id not in run.participants:
                if client_id in self._released:
                    self._released.discard(client_id)
                    return []
                if client_id in self._departed:
                    # Its detach again (the answer to the first was lost): the same answer.
                    return list(self._departed[client_id])
                return None
            controls = self._drop(run, client_id, status=status)
            controls += self._maybe_end(run)
            ended = [c.run_key for c in controls if c.kind == "end"]
            controls = self._keep([run], controls)
            self._departed[client_id] = ended
            while len(self._departed) > MAX_DEPARTED:
                self._departed.popitem(last=False)
        self.outbox.deliver(controls)
        return ended

    def end_run(self, key: str, status: str, tags: dict[str, str]) -> bool:
        """End a run for a supervisor that knows better than its processes (Tune's scheduler).

        Sets ``tags``, releases every participant and ends the run with ``status``. Returns
        False if the router does not know the run.
        """
        _check_status(status)
        with self._lock:
            run = self._runs.get(key)
            if run is None:
                return False
            controls = [Control(self.shard_of(run.key), run.key, "tags", dict(tags))]
            for client_id in list(run.participants):
                controls += self._drop(run, client_id, status=status)
                self._released.add(client_id)
            run.primary_status = status
            controls += self._maybe_end(run)
            controls = self._keep([run], controls)
        self.outbox.deliver(controls)
        return True

    def end_unowned(self, key: str, status: str) -> list[str]:
        """A guest's explicit end (``MlflowClient().set_terminated`` in a process that only
        wrote to the run): ends the run with ``status`` only if no process holds it (no
        participant, not ended here yet), as plain MLflow would; a run with participants is
        ended by its primary, and an ended one is not ended twice. Returns the keys this
        ended. The guest handed its writes to the shard first, so the end follows them.
        """
        _check_status(status)
        with self._lock:
            run = self._runs.get(key)
            if run is not None:
                if run.participants or run.terminated:
                    return []
                run.terminated = True
                run.primary_status = status
            controls = self._keep([run] if run is not None else [],
                                  [Control(self.shard_of(key), key, "end", status)])
        self.outbox.deliver(controls)
        return [key]

    def _drop(self, run: Run, client_id: str, status: str = "KILLED",
              replaced: bool = False) -> list[Control]:
        participant = run.participants.pop(client_id)
        self._by_client.pop(client_id, None)
        controls = []
        rank = participant.process.world_rank
        if run.mode == "per_rank" and rank is not None and run.children.get(rank) and not replaced:
            run.children[rank] = False
            controls.append(Control(self.shard_of(run.key), f"{run.key}.rank_{rank}", "end",
                                    status))
        if run.primary == client_id:
            run.primary = None
            if not replaced:
                run.primary_status = status
        return controls

    def set_trial_outcome(self, trial_id: str, status: str) -> list[str]:
        """Tune's word on how a trial ended (FINISHED: its function returned or the scheduler
        stopped it; FAILED: it raised), from the driver's Tune callback
        (:mod:`raydeck.tracking.client.tune_outcome`). The runs that trial's process owns, still
        open, that no sweep supervises (no parent run), end with ``status`` when the process leaves
        or is gone: not ``KILLED`` because Tune killed the process before its exit handed the
        run over, nor the ``FINISHED`` MLflow's exit hook gives a trial whose function raised.
        The end still follows everything the process handed over. A run the trial function
        ended itself (``mlflow.end_run()``) is ended already. Returns the keys it applies to.
        """
        _check_status(status)
        keys = []
        with self._lock:
            for run in self._runs.values():
                owner = run.participants.get(run.primary or "")
                if (owner is not None and owner.process.trial_id == trial_id
                        and run.parent_key is None and not run.terminated):
                    run.outcome = status
                    keys.append(run.key)
                    self._keep([run])
        return keys

    def _maybe_end(self, run: Run) -> list[Control]:
        if run.terminated or run.primary_status is None or run.participants:
            return []
        run.terminated = True
        status = run.outcome or run.primary_status
        logger.info("run %s ends as %s", run.key, status)
        return [Control(self.shard_of(run.key), run.key, "end", status)]

    # --- liveness ----------------------------------------------------------------------------
    def reap(self) -> bool:
        """Drop participants Ray says are gone; True when the proxy may stop (idle long enough)."""
        now = time.monotonic()
        with self._lock:
            everyone = [p for run in self._runs.values() for p in run.participants.values()]
        suspect_after_s = SUSPECT_AFTER_BEATS * self.config.heartbeat_interval_s
        suspects = [p.process for p in everyone if now - p.last_seen > suspect_after_s]
        gone = self._gone([p.process for p in everyone], suspects) if everyone else set()
        controls: list[Control] = []
        with self._lock:
            changed = []
            for run in list(self._runs.values()):
                for client_id, participant in list(run.participants.items()):
                    silent_s = now - participant.last_seen
                    dead = participant.process.role_key in gone
                    lost = (silent_s > self.config.lost_after_s
                            and participant.process.actor_id is None
                            and participant.process.role != "driver")
                    if dead or lost:
                        logger.warning("run %s: %s (%s) %s; presumed dead", run.key,
                                       participant.process.role_key, client_id,
                                       "is gone (Ray)" if dead else "went silent")
                        controls += self._drop(run, client_id, status="KILLED")
                        changed.append(run)
                ended = self._maybe_end(run)
                if ended and run not in changed:
                    changed.append(run)
                controls += ended
            controls = self._keep(changed, controls)
            idle = self._idle(now)
        self.outbox.deliver(controls)
        self.outbox.retry()
        return idle and not self.outbox.size()

    def _keep(self, runs: list[Run], controls: list[Control] | None = None) -> list[Control]:
        """Write ``runs``' membership, and the updates ``controls`` it decided, through to the
        store in one step (caller holds the lock); returns the controls as kept, to deliver."""
        if self._store is None:
            return list(controls or [])
        return self._store.save(runs, list(controls or []))

    def _sent(self, control: Control) -> None:
        """A shard took ``control``: it leaves the store."""
        if self._store is not None:
            self._store.sent(control)

    def _idle(self, now: float) -> bool:
        """Whether the proxy has had nothing to do for ``idle_timeout_s``: no active run and no
        attach under way (one may be about to open a run). Caller holds the lock."""
        active = sum(1 for run in self._runs.values() if not run.terminated)
        self.active_runs = active
        if active or self._attaching:
            self._idle_since = None
        elif self._idle_since is None:
            self._idle_since = now
        return self._idle_since is not None and now - self._idle_since > (
            self.config.idle_timeout_s)

    def claim_stop(self) -> bool:
        """Decide, atomically with attaches, that the proxy stops: True if it is still idle
        (checked again now: an attach may have come since ``reap`` said so) and nothing waits
        in the outbox; from then on every attach is refused with :data:`STOPPING`, so no
        tracker binds to a proxy that is about to go (it attaches to the next one).
        """
        waiting = self.outbox.size()  # never under the lock: a send may hold the outbox's
        with self._lock:
            if self._stopping:
                return True
            if not self._idle(time.monotonic()) or waiting:
                return False
            self._stopping = True
            return True

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


def _run_record(key: str, request: AttachRequest, found: Lookup) -> Run:
    """The router's record of a run it did not hold, from what MLflow said about ``key``."""
    existed = found.known and bool(found.run_id)
    return Run(
        key=key, name=(found.name if existed else "") or request.run_name or key,
        experiment=request.experiment, mode=(found.mode if existed else "") or request.mode,
        created_by_role=request.process.role, job_id=request.process.job_id,
        run_id=found.run_id, existed=existed, params=dict(found.params),
        parent_key=request.parent_key,
    )


def _check_status(status: str) -> None:
    if status not in ("FINISHED", "FAILED", "KILLED"):
        raise ConfigError(f"status={status!r}: must be FINISHED, FAILED or KILLED")
