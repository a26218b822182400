"""The trackers of this process and how they end when the process does.

Owns: the process's active trackers (what ``get_tracker`` returns again), and every way a run's
data is handed over when its process stops:

- normal exit: an ``atexit`` hook finishes each tracker, ``FAILED`` after an uncaught exception,
  else ``FINISHED``; a ``finish()`` that raised earlier is retried here;
- ``SIGTERM`` and ``SIGINT`` in a driver (``ray job stop`` sends SIGTERM and kills 3 s later):
  the data is handed to the proxy and the run ends ``KILLED``, then the signal takes its usual
  course; a run that was active when the signal came ends ``KILLED`` whichever status a later
  ``finish`` names (a framework that turns the signal into an exception, such as Lightning's
  ``finalize("failed")`` after Ray's handler raised ``SystemExit``, finishes ``FAILED``);
- Ray Train workers, which Train v2 stops with ``ray.kill`` after a short grace period (no atexit
  runs there): ``train_handoff.TrainWorkerHandoff``, a Ray Train worker callback that raydeck
  registers in every job (``RAY_TRAIN_CALLBACKS``), hands the buffer to the proxy in
  ``before_worker_shutdown``, so a training function that returns without ``finish()`` loses
  nothing and its rank leaves the run at once (``FINISHED``, ``FAILED`` if it raised, ``KILLED``
  if its worker group was torn down mid-training).
"""

from __future__ import annotations

import atexit
import logging
import os
import signal
import sys
import threading
import time
import weakref
from dataclasses import dataclass
from types import FrameType, TracebackType
from typing import Any, Protocol

logger = logging.getLogger(__name__)

SIGNAL_FINISH_TIMEOUT_S = 2.5
# After a signal, how long the exit keeps handing the runs over, counted from the signal
# (``ray job stop`` kills at 3 s anyway; a plain SIGTERM gets this long before the interpreter
# exits, so a proxy that is slow for a few seconds still gets the data).
SIGNAL_EXIT_GRACE_S = 10.0
# Between two hand-over attempts at exit.
SIGNAL_RETRY_PAUSE_S = 0.2
TRAIN_HANDOFF_TIMEOUT_S = 4.0
# The scope of a guest's tracker (a process that only writes to a run by id): handed over and
# stopped at exit like the others, never what ``get_tracker`` finds.
GUEST_SCOPE = "guest"


class LiveTracker(Protocol):
    """What the registry needs of a tracker (a :class:`~raydeck.tracking.client.tracker.Tracker`;
    typed by its shape so this module, which the tracker uses, never imports it)."""

    @property
    def run_key(self) -> str: ...

    def finish(self, status: str = "FINISHED", timeout_s: float | None = None,
               wait: bool = True) -> Any: ...

    def abandon(self) -> None: ...


@dataclass
class _Entry:
    tracker: LiveTracker
    key: str | None
    run_name: str | None
    parent: str | None
    scope: str


_entries: list[_Entry] = []
lock = threading.RLock()
_hooks_installed = False
_signals_installed = False
_uncaught_exception = False
_previous_handlers: dict[int, Any] = {}
_signal_finisher: threading.Thread | None = None
_signalled_at = 0.0
# The trackers that were active when this process got SIGTERM or SIGINT: they end KILLED.
_signalled: weakref.WeakSet[LiveTracker] = weakref.WeakSet()


def register(tracker: LiveTracker, key: str | None, run_name: str | None, parent: str | None,
             scope: str) -> None:
    with lock:
        _entries.append(_Entry(tracker, key, run_name, parent, scope))


def forget(tracker: LiveTracker) -> None:
    with lock:
        _entries[:] = [entry for entry in _entries if entry.tracker is not tracker]


def find(key: str | None, run_name: str | None, parent: str | None, scope: str
         ) -> LiveTracker | None:
    """The active tracker this process already has for that identity, newest first.

    - ``key`` given: the tracker of that run key.
    - else ``run_name`` given: the tracker this process created under that name.
    - else: the process's current tracker in its context (its Ray Train run, its Tune trial,
      or the driver's latest run), like ``mlflow.active_run()``.
    """
    with lock:
        for entry in reversed(_entries):
            if entry.scope == GUEST_SCOPE:
                continue
            if key is not None:
                if parent == entry.parent and key in (entry.key, entry.tracker.run_key):
                    return entry.tracker
            elif run_name is not None:
                if (entry.key is None and entry.run_name == run_name and parent == entry.parent
                        and entry.scope == scope):
                    return entry.tracker
            elif entry.scope == scope:
                return entry.tracker
    return None


def active() -> list[LiveTracker]:
    with lock:
        return [entry.tracker for entry in _entries]


def end_status(tracker: LiveTracker, status: str) -> str:
    """The status ``tracker``'s run ends with when its ``finish`` names ``status``: KILLED once
    this process was signalled while the run was active (the contract's "SIGTERMed before its
    ``finish()`` returned"), whatever the signal's own hand-over managed before it."""
    with lock:
        return "KILLED" if tracker in _signalled else status


def finish_all(status: str, wait: bool, timeout_s: float | None = None) -> None:
    """Finish every active tracker with ``status``; problems are logged, never raised."""
    for tracker in active():
        try:
            tracker.finish(status, timeout_s=timeout_s, wait=wait)
        except Exception as exc:
            logger.warning("could not finish run %s: %s", tracker.run_key, exc)


# --- process exit -----------------------------------------------------------------------------
def install_hooks(in_main_thread_driver: bool) -> None:
    """Install the exit hooks once per process (signal handlers only in a driver's main thread)."""
    global _hooks_installed
    with lock:
        if not _hooks_installed:
            _hooks_installed = True
            previous = sys.excepthook

            def hook(kind: type[BaseException], value: BaseException,
                     tb: TracebackType | None) -> None:
                global _uncaught_exception
                _uncaught_exception = True
                previous(kind, value, tb)

            sys.excepthook = hook
            atexit.register(_finish_at_exit)
        if in_main_thread_driver:
            _install_signal_handlers()


def _finish_at_exit() -> None:
    """End this process's runs, then stop the trackers that could not be ended.

    Ray's own exit hook (registered before this one, so it runs after it) shuts Ray down next;
    a tracker thread calling Ray after that would start a new local Ray inside the exiting
    process. So whatever is still active here is abandoned: the proxy ends those runs when it
    finds the process gone, with everything it already holds.
    """
    import ray

    if _signal_finisher is not None:
        _finish_after_signal(_signal_finisher)
    elif active():
        if ray.is_initialized():
            finish_all("FAILED" if _uncaught_exception else "FINISHED", wait=True)
        else:
            # Ray was shut down first (its own atexit hook, or the program): the proxy cannot
            # be reached from here any more.
            logger.warning("exiting after ray.shutdown(): %d run(s) not finished; their "
                           "processes are presumed gone when Ray reports their job ended",
                           len(active()))
    for tracker in active():
        tracker.abandon()


def _finish_after_signal(finisher: threading.Thread) -> None:
    """At exit after a signal: hand the runs over until ``SIGNAL_EXIT_GRACE_S`` after the signal,
    never starting a second hand-over beside the signal's own.

    A second finish racing the first could end the run FINISHED, and waiting for MLflow (the
    normal exit's ``wait=True``) would keep a stopped process alive while MLflow is slow; the
    proxy holds the data either way. A hand-over that failed (a proxy slow for a few seconds)
    is tried again, as KILLED, until the grace ends.
    """
    import ray

    deadline = _signalled_at + SIGNAL_EXIT_GRACE_S
    finisher.join(max(0.0, deadline - time.monotonic()))
    while not finisher.is_alive() and active() and ray.is_initialized():
        left = deadline - time.monotonic()
        if left <= 0:
            break
        finish_all("KILLED", wait=False, timeout_s=min(SIGNAL_FINISH_TIMEOUT_S, left))
        if active():
            time.sleep(min(SIGNAL_RETRY_PAUSE_S, max(0.0, deadline - time.monotonic())))
    if active():
        logger.warning("exiting %.0f s after the signal with %d run(s) not handed to the "
                       "tracking proxy; it ends them when this process is gone",
                       SIGNAL_EXIT_GRACE_S, len(active()))


def _install_signal_handlers() -> None:
    global _signals_installed
    if _signals_installed or threading.current_thread() is not threading.main_thread():
        return
    _signals_installed = True
    for signum in (signal.SIGTERM, signal.SIGINT):
        current = signal.getsignal(signum)
        if current is signal.SIG_IGN:
            continue
        _previous_handlers[signum] = current
        signal.signal(signum, _on_signal)


def _on_signal(signum: int, frame: FrameType | None) -> None:
    """Hand the data over and end the runs KILLED, then let the signal do what it did before.

    The work runs in a thread joined with a timeout: the interrupted main thread may be inside
    a Ray call, and ``ray job stop`` kills the process a few seconds after its SIGTERM. If the
    previous handler exits the interpreter (Ray's does), the exit hook waits for that thread
    instead of finishing the runs a second time.
    """
    global _signal_finisher, _signalled_at
    _signalled_at = time.monotonic()
    with lock:
        _signalled.update(tracker for tracker in active())
    logger.warning("signal %s: ending this process's runs as KILLED", signal.Signals(signum).name)
    worker = threading.Thread(target=finish_all, args=("KILLED", False, SIGNAL_FINISH_TIMEOUT_S),
                              name="raydeck-signal-finish", daemon=True)
    _signal_finisher = worker
    worker.start()
    worker.join(SIGNAL_FINISH_TIMEOUT_S + 0.5)
    previous = _previous_handlers.get(signum, signal.SIG_DFL)
    signal.signal(signum, previous)
    if callable(previous):
        previous(signum, frame)
    elif previous == signal.SIG_DFL:
        os.kill(os.getpid(), signum)


# --- Ray Train workers --------------------------------------------------------------------------
def train_thread_status() -> str:
    """FINISHED if the training function returned, FAILED if it raised, KILLED if running."""
    try:
        from ray.train.v2._internal.execution.context import get_train_context

        runner = get_train_context().execution_context.training_thread_runner
        if runner.is_running():
            return "KILLED"
        return "FAILED" if runner.get_error() is not None else "FINISHED"
    except Exception:
        return "FINISHED"
