"""The installed distribution's version (one source: pyproject.toml)."""

from importlib import metadata

try:
    __version__ = metadata.version("raydeck")
except metadata.PackageNotFoundError:  # running from a source tree that was never installed
    __version__ = "0.0.0+unknown"
