"""The router's question to MLflow when a tracker attaches: does this run key exist already?

Owns: :class:`Lookup` (MLflow's answer, or "did not answer") and :class:`MlflowLookup`, which
asks fast and stays silent while MLflow is down: an unknown answer is fine, because the run's
shard creates or finds the run later (:mod:`raydeck.tracking.proxy.router`).
"""

from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass, field

from raydeck._internal.redaction import redact_text
from raydeck.tracking.proxy.writer import MlflowWriter, PermanentWriteError, TransientWriteError

logger = logging.getLogger(__name__)

LOOKUP_BACKOFF_S = 10.0
# The router's own MLflow calls (looking a run key up when a tracker attaches) fail fast, within
# this or the shards' request timeout if that is shorter: an unknown answer is fine, the shard
# creates or finds the run later.
LOOKUP_TIMEOUT_S = 5


@dataclass(frozen=True)
class Lookup:
    """What MLflow said about a run key: ``known`` False means MLflow did not answer."""

    known: bool
    run_id: str = ""
    name: str = ""
    mode: str = ""
    params: dict[str, str] = field(default_factory=dict)


class MlflowLookup:
    """Finds run keys in MLflow for the router: fast, and silent while MLflow is down."""

    def __init__(self, tracking_uri: str, request_timeout_s: int) -> None:
        os.environ["MLFLOW_SUPPRESS_PRINTING_URL_TO_STDOUT"] = "true"
        self._writer = MlflowWriter(tracking_uri,
                                    request_timeout_s=min(LOOKUP_TIMEOUT_S, request_timeout_s))
        self._failed_at = 0.0

    def __call__(self, key: str, experiment: str) -> Lookup:
        if time.monotonic() - self._failed_at < LOOKUP_BACKOFF_S:
            return Lookup(known=False)
        try:
            exp = self._writer.client.get_experiment_by_name(experiment)
            ids = [exp.experiment_id] if exp is not None else []
            found = self._writer.find_run(key, ids) if ids or looks_like_run_id(key) else None
        except (TransientWriteError, PermanentWriteError, Exception) as exc:
            self._failed_at = time.monotonic()
            logger.warning("MLflow did not answer a run lookup (%s); the run is bound now and "
                           "created or found when MLflow answers", redact_text(str(exc))[:200])
            return Lookup(known=False)
        if found is None:
            return Lookup(known=True)
        return Lookup(known=True, run_id=found.info.run_id, name=found.info.run_name or "",
                      mode=found.data.tags.get("raydeck.mode", ""),
                      params=dict(found.data.params))


def looks_like_run_id(key: str) -> bool:
    """Whether ``key`` has the shape of an MLflow run id (32 hex digits)."""
    return len(key) == 32 and all(c in "0123456789abcdef" for c in key)
