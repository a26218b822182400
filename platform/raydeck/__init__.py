"""raydeck: a Ray-native training platform with tuning and tracking.

The public API, all of it re-exported here. Everything else is internal.
"""

from raydeck._version import __version__
from raydeck.config import Settings, load_settings
from raydeck.errors import (
    ClusterUnavailableError,
    ConfigError,
    InfeasibleResourcesError,
    PresetError,
    RaydeckError,
    StorageError,
    TrackingUnavailableError,
    TrackingValidationError,
    TrackingWriteError,
)
from raydeck.tracking import NoOpTracker, Tracker, get_tracker

__all__ = [
    "ClusterUnavailableError",
    "ConfigError",
    "InfeasibleResourcesError",
    "NoOpTracker",
    "PresetError",
    "RaydeckError",
    "Settings",
    "StorageError",
    "Tracker",
    "TrackingUnavailableError",
    "TrackingValidationError",
    "TrackingWriteError",
    "__version__",
    "get_tracker",
    "load_settings",
]
