"""The tracking proxy: every Ray process logs to MLflow through named actors, in batches.

Public surface: :func:`get_tracker`, :class:`Tracker`, :class:`NoOpTracker`. The modules behind
it: ``client`` (worker side), ``router`` and ``shard`` (the actors), ``proxy`` (their names and
life), ``spool`` (durability), ``writer`` (MLflow calls), ``modes``, ``validation``,
``system_metrics``, ``repro``, ``metrics`` (the proxy's own Prometheus metrics).
"""

from raydeck.tracking.client import NoOpTracker, Tracker, get_tracker

__all__ = ["NoOpTracker", "Tracker", "get_tracker"]
