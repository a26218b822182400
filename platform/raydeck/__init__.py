"""raydeck: a Ray-native training platform with tuning and tracking.

The public API, all of it re-exported here; everything else is internal. Names load lazily
(PEP 562), so ``import raydeck`` stays cheap in every Ray worker: torch, Tune and Lightning are
imported only when a name that needs them is used.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from raydeck._internal.lazy import lazy_attributes
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
    "ServeOptions": "raydeck.serving",
    "register_run_model": "raydeck.models",
}


# Public submodules, reachable as attributes after a plain ``import raydeck``
# (``raydeck.checkpointing.restore(...)``) and imported on first use only.
_SUBMODULES = (
    "checkpointing", "cluster", "config", "errors", "examples", "integrations", "job_probe",
    "job_server_address", "jobs", "kuberay", "models", "observability", "package_data",
    "preemption", "redaction", "runtime_env", "scaling", "scheduling", "secrets",
    "serve_ingress", "serving", "settings_sections",
    "stack", "stack_connection", "stack_credentials", "storage", "tracking", "tracking_uri",
    "training", "tune",
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
