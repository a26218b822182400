"""Lazy attributes of a package (PEP 562): public names and submodules, imported on first use.

``import raydeck`` runs in every Ray worker, so it must not import torch, Tune or Lightning.
Each package lists what it exposes; the first ``raydeck.train.checkpointing`` or
``raydeck.get_tracker`` imports the module that holds it, and later lookups are plain attribute
reads (the value is stored in the package's namespace).
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Callable, Iterable, Mapping
from typing import Any


def lazy_attributes(
    package: str, submodules: Iterable[str], names: Mapping[str, str] | None = None
) -> tuple[Callable[[str], Any], Callable[[], list[str]]]:
    """``(__getattr__, __dir__)`` for ``package``.

    Args:
        package: the package's ``__name__``.
        submodules: its public submodules (``"checkpointing"`` is ``package.checkpointing``).
        names: public names defined elsewhere, mapped to the module that defines them.
    """
    modules = frozenset(submodules)
    exported = dict(names or {})

    def __getattr__(name: str) -> Any:
        namespace = sys.modules[package].__dict__
        if name in exported:
            value = getattr(importlib.import_module(exported[name]), name)
            namespace[name] = value
            return value
        if name in modules:
            # import_module also binds the submodule as an attribute of the package.
            return importlib.import_module(f"{package}.{name}")
        raise AttributeError(f"module {package!r} has no attribute {name!r}")

    def __dir__() -> list[str]:
        return sorted({*sys.modules[package].__dict__, *exported, *modules})

    return __getattr__, __dir__
