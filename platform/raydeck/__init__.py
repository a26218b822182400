"""raydeck: a Ray-native training platform with tuning and tracking.

The public API, all of it re-exported here; everything else is internal. Names load lazily
(PEP 562), so ``import raydeck`` stays cheap in every Ray worker: torch, Tune and Lightning are
imported only when a name that needs them is used.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from raydeck._version import __version__
from raydeck.config import Settings, load_settings
from raydeck.errors import (
    ClusterUnavailableError,
    ConfigError,
    InfeasibleResourcesError,
    JobSubmissionError,
    MonitoringError,
    PresetError,
    QueryError,
    RaydeckError,
    StorageError,
    TrackingUnavailableError,
    TrackingValidationError,
    TrackingWriteError,
)

if TYPE_CHECKING:
    from raydeck.checkpointing import report_epoch, restore
    from raydeck.integrations.lightning import RaydeckLogger, RaydeckReportCallback
    from raydeck.scaling import Preset, check_feasible, get_preset
    from raydeck.storage import checkpoint_at
    from raydeck.tracking import NoOpTracker, Tracker, get_tracker
    from raydeck.tune import SearchSpace, SweepConfig, SweepJob, sweep

_LAZY = {
    "get_tracker": "raydeck.tracking",
    "Tracker": "raydeck.tracking",
    "NoOpTracker": "raydeck.tracking",
    "Preset": "raydeck.scaling",
    "get_preset": "raydeck.scaling",
    "check_feasible": "raydeck.scaling",
    "report_epoch": "raydeck.checkpointing",
    "restore": "raydeck.checkpointing",
    "checkpoint_at": "raydeck.storage",
    "sweep": "raydeck.tune",
    "SweepConfig": "raydeck.tune",
    "SweepJob": "raydeck.tune",
    "SearchSpace": "raydeck.tune",
    "RaydeckLogger": "raydeck.integrations.lightning",
    "RaydeckReportCallback": "raydeck.integrations.lightning",
}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        value = getattr(importlib.import_module(_LAZY[name]), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'raydeck' has no attribute {name!r}")


__all__ = [
    "ClusterUnavailableError",
    "ConfigError",
    "InfeasibleResourcesError",
    "JobSubmissionError",
    "MonitoringError",
    "NoOpTracker",
    "Preset",
    "PresetError",
    "QueryError",
    "RaydeckError",
    "RaydeckLogger",
    "RaydeckReportCallback",
    "SearchSpace",
    "Settings",
    "StorageError",
    "SweepConfig",
    "SweepJob",
    "Tracker",
    "TrackingUnavailableError",
    "TrackingValidationError",
    "TrackingWriteError",
    "__version__",
    "check_feasible",
    "checkpoint_at",
    "get_preset",
    "get_tracker",
    "load_settings",
    "report_epoch",
    "restore",
    "sweep",
]
