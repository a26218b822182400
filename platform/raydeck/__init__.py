"""raydeck: a Ray-native training platform with tuning and tracking.

The public API, all of it re-exported here; everything else is internal. Names load lazily
(PEP 562), so ``import raydeck`` stays cheap in every Ray worker: torch, Tune and Lightning are
imported only when a name that needs them is used.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from raydeck._internal.lazy import lazy_attributes
from raydeck._version import __version__
from raydeck.config.settings import Settings, load_settings
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
    from raydeck.integrations.lightning import RaydeckLogger, RaydeckReportCallback
    from raydeck.storage import checkpoint_at
    from raydeck.tracking import NoOpTracker, Tracker, get_tracker
    from raydeck.train.checkpointing import report_epoch, restore
    from raydeck.train.feasibility import check_feasible
    from raydeck.train.presets import Preset, get_preset
    from raydeck.tune import SearchSpace, SweepConfig, SweepJob, sweep

_LAZY = {
    "get_tracker": "raydeck.tracking",
    "Tracker": "raydeck.tracking",
    "NoOpTracker": "raydeck.tracking",
    "Preset": "raydeck.train.presets",
    "get_preset": "raydeck.train.presets",
    "check_feasible": "raydeck.train.feasibility",
    "report_epoch": "raydeck.train.checkpointing",
    "restore": "raydeck.train.checkpointing",
    "checkpoint_at": "raydeck.storage",
    "sweep": "raydeck.tune",
    "SweepConfig": "raydeck.tune",
    "SweepJob": "raydeck.tune",
    "SearchSpace": "raydeck.tune",
    "RaydeckLogger": "raydeck.integrations.lightning",
    "RaydeckReportCallback": "raydeck.integrations.lightning",
    "ServeOptions": "raydeck.serving",
    "register_run_model": "raydeck.models",
}


# Public packages, reachable as attributes after a plain ``import raydeck``
# (``raydeck.tune.sweep(...)``) and imported on first use only.
_SUBMODULES = (
    "cluster", "config", "errors", "examples", "integrations", "jobs", "k8s", "models",
    "observability", "scheduling", "serving", "stack", "storage", "tracking", "train", "tune",
)
__getattr__, __dir__ = lazy_attributes(__name__, _SUBMODULES, _LAZY)


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
    "ServeOptions",
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
    "register_run_model",
    "report_epoch",
    "restore",
    "sweep",
]
