"""The files raydeck's commands default to, wherever raydeck is installed.

``raydeck submit`` defaults to ``runtime_envs/local.yaml``, ``raydeck sweep`` to
``jobs/sweep_digits.yaml``, ``raydeck dashboards`` to ``dashboards/`` and ``raydeck monitoring
config`` to ``dashboards/alerts/raydeck.rules.yml``: paths in the repository's top-level
folders, whose layout their users fix (``ray job submit --runtime-env runtime_envs/cpu.yaml``,
Docker Compose, Prometheus). Those folders are the only copy in the repository; building the
wheel copies them to ``raydeck/_data/`` (``setup.py``), so an installed raydeck carries them.

A default (never a path given explicitly, which is used as it is) is found, first hit wins:

1. in the current directory: a checkout, or a project with its own ``runtime_envs/local.yaml``
   (what raydeck always did; an edit there takes effect, and ``raydeck dashboards render``
   writes there);
2. in the installed package (``importlib.resources``: ``raydeck/_data/...``);
3. in the checkout an editable install imports raydeck from, run from another directory.
"""

from __future__ import annotations

from importlib import resources
from pathlib import Path

from raydeck.errors import ConfigError

DATA_DIR = "_data"


def packaged_path(relative: str | Path) -> Path | None:
    """``relative`` in the installed package's data (``raydeck/_data``), if it is there."""
    found = resources.files("raydeck").joinpath(DATA_DIR, *Path(relative).parts)
    # raydeck is installed as files (never imported from a zip), so this is a real path.
    return Path(str(found)) if found.is_file() or found.is_dir() else None


def checkout_path(relative: str | Path) -> Path | None:
    """``relative`` in the checkout raydeck is imported from (an editable install), if any."""
    root = Path(__file__).resolve().parents[3]  # <root>/platform/raydeck/config/this
    if (root / "pyproject.toml").is_file() and (root / relative).exists():
        return root / relative
    return None


def default_path(relative: str | Path) -> Path:
    """Where the default ``relative`` is (see the module docstring for the order).

    Raises:
        ConfigError: it is nowhere (an install built without its data).
    """
    here = Path(relative)
    if here.exists():
        return here
    found = packaged_path(relative) or checkout_path(relative)
    if found is None:
        raise ConfigError(f"{relative}: not in this directory, and this raydeck install does "
                          "not carry it (reinstall raydeck from its wheel, or pass the path)")
    return found


def is_packaged(path: Path) -> bool:
    """``path`` is (inside) the installed package's copy, which is not to be written."""
    data = packaged_path(".")
    return data is not None and path.resolve().is_relative_to(data.resolve())
