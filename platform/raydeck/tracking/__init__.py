"""The tracking proxy: every Ray process logs to MLflow through named actors, in batches.

Public surface: :func:`get_tracker`, :class:`Tracker`, :class:`NoOpTracker`. The modules behind
it, worker side: ``attach`` (``get_tracker``), ``tracker`` (the MLflow-like API), ``delivery``
(bounded buffer, flusher, heartbeats), ``lifecycle`` (exit, signals, Ray Train hand-off),
``console``, ``system_metrics``, ``artifacts``, ``repro``, ``validation``, ``modes``; proxy
side: ``proxy`` (actor names and life), ``router`` (run membership; ``outbox``: its updates to
the shards), ``shard`` (per-run queues and MLflow writes), ``spool`` (SQLite durability),
``writer`` (MLflow calls and the failure policy), ``metrics``; ``messages`` is what travels
between them. ``docs/tracking-contract.md``
says what each fault does to a run's data.
"""

from raydeck.tracking.client.attach import get_tracker
from raydeck.tracking.client.noop import NoOpTracker
from raydeck.tracking.client.tracker import Tracker

__all__ = ["NoOpTracker", "Tracker", "get_tracker"]
