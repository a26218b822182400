"""How a distributed run is laid out in MLflow: the three tracking modes.

- ``rank_zero``: only rank 0 (and the driver) write; other ranks get a no-op tracker.
- ``all_ranks``: one MLflow run; rank ``i`` writes ``<key>/rank_<i>`` so ranks stay apart, and
  (``RAYDECK_TRACKING_CROSS_RANK_STATS``, on by default) the shard also writes ``<key>/mean``,
  ``/min``, ``/max`` and ``/straggler_rank`` once every rank reported a step.
- ``per_rank``: one child run per rank under the run (``mlflow.parentRunId``), tagged with rank,
  node and role, like W&B's ``group``/``job_type``; params and console logs go to the parent.

In every mode params are written once, by the primary (the process that created the run) or by
rank 0; other ranks' ``log_params`` calls are no-ops, so every rank may call it with the config.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import get_args

from raydeck.config.settings import TrackingMode
from raydeck.errors import ConfigError
from raydeck.tracking.messages import ProcessInfo

MODES: tuple[str, ...] = get_args(TrackingMode)


def check_mode(mode: str) -> str:
    if mode not in MODES:
        raise ConfigError(f"mode={mode!r}: must be one of {', '.join(MODES)}")
    return mode


@dataclass(frozen=True)
class ModePolicy:
    """What one process's tracker does in one run. One object, so the rules live in one place."""

    mode: str
    process: ProcessInfo

    @property
    def writes_anything(self) -> bool:
        """False means the process gets a no-op tracker and never contacts the proxy."""
        return self.mode != "rank_zero" or self.process.world_rank in (None, 0)

    def writes_params(self, is_primary: bool) -> bool:
        return is_primary or self.process.world_rank in (None, 0)

    def metric_key(self, key: str) -> str:
        if self.mode == "all_ranks" and self.process.world_rank is not None:
            return f"{key}/rank_{self.process.world_rank}"
        return key

    @property
    def log_name(self) -> str:
        """File name of this process's console log under the run's ``logs/``."""
        if self.process.world_rank is not None:
            return f"rank_{self.process.world_rank}.txt"
        if self.process.trial_id:
            return f"trial_{self.process.trial_id}.txt"
        return f"{self.process.role}_{self.process.pid}.txt"
