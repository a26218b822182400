"""What a job needs and how its workers are placed: :class:`Resources` (CPUs and GPUs) and
:class:`Gang` (a preset's workers under its placement strategy, an elastic preset's with its
range).

Its own module, below :mod:`raydeck.scheduling.policies.core`, because the policies, the queue's
records and its clients all count in these; where a gang fits on the nodes is
:class:`~raydeck.scheduling.policies.core.Capacity`'s business.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from raydeck.errors import ConfigError
from raydeck.train.feasibility import describe_resources
from raydeck.train.presets import Preset


@dataclass(frozen=True)
class Resources:
    """CPUs and GPUs (GPUs may be fractional, as in the fractional presets; a quota may be
    infinite in one of them)."""

    cpus: float = 0.0
    gpus: float = 0.0

    def __post_init__(self) -> None:
        for name in ("cpus", "gpus"):
            value = getattr(self, name)
            if math.isnan(value) or value < 0:
                raise ConfigError(f"{name}={value}: must be a number >= 0 (inf: no limit)")

    def fits(self, need: Resources) -> bool:
        return need.cpus <= self.cpus + 1e-9 and need.gpus <= self.gpus + 1e-9

    def __add__(self, other: Resources) -> Resources:
        return Resources(self.cpus + other.cpus, self.gpus + other.gpus)

    def __sub__(self, other: Resources) -> Resources:
        return Resources(max(self.cpus - other.cpus, 0.0), max(self.gpus - other.gpus, 0.0))

    def describe(self) -> str:
        """``2 GPU, 8 CPU`` (parts without a limit left out)."""
        parts = [f"{value:g} {unit}" for value, unit in ((self.gpus, "GPU"), (self.cpus, "CPU"))
                 if math.isfinite(value) and (value or unit == "CPU")]
        return ", ".join(parts) or "no limit"

    def weight(self) -> float:
        """One number for usage accounting: GPUs dominate (a GPU counts as 8 CPUs)."""
        return self.gpus * 8 + self.cpus

    @classmethod
    def of_node(cls, node: Mapping[str, float]) -> Resources:
        """A node's CPUs and GPUs from Ray's resource dict (``{"CPU": 8, "GPU": 2, ...}``)."""
        return cls(node.get("CPU", 0.0), node.get("GPU", 0.0))

    def as_node(self) -> dict[str, float]:
        """As Ray's resource dict, the form :func:`raydeck.train.feasibility.place` takes (no GPU
        key when there is none)."""
        return {"CPU": self.cpus, **({"GPU": self.gpus} if self.gpus else {})}

    @staticmethod
    def total(parts: Iterable[Resources]) -> Resources:
        summed = Resources()
        for part in parts:
            summed = summed + part
        return summed


PLACEMENT_STRATEGIES = ("PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD")


@dataclass(frozen=True)
class Gang:
    """A job's workers as Ray places them: ``workers`` bundles of ``per_worker`` under a
    placement strategy (the preset's), all at once or not at all. An elastic gang (an elastic
    preset's) is counted at ``workers`` (the size it starts or runs at) and may run at up to
    ``max_workers`` (0: a fixed gang)."""

    workers: int
    per_worker: Resources
    strategy: str = "PACK"
    max_workers: int = 0

    def __post_init__(self) -> None:
        if self.workers < 1:
            raise ConfigError(f"workers={self.workers}: must be >= 1")
        if self.max_workers and self.max_workers < self.workers:
            raise ConfigError(f"max_workers={self.max_workers}: must be >= workers="
                              f"{self.workers} (0: a fixed gang)")
        if self.strategy not in PLACEMENT_STRATEGIES:
            raise ConfigError(f"placement {self.strategy!r} is not one of "
                              f"{', '.join(PLACEMENT_STRATEGIES)}")

    @classmethod
    def of(cls, preset: Preset) -> Gang:
        """The gang a scaling preset starts: an elastic preset counted at its minimum (the queue
        admits it when that fits), ``max_workers`` its maximum."""
        return cls(preset.min_workers,
                   Resources(preset.cpus_per_worker, preset.gpus_per_worker),
                   preset.placement_strategy, preset.max_workers if preset.elastic else 0)

    @property
    def elastic(self) -> bool:
        """Whether it may run at other sizes than ``workers`` (up to ``max_workers``)."""
        return self.max_workers > 0

    def at(self, workers: int) -> Gang:
        """The same gang counted at ``workers`` workers."""
        return dataclasses.replace(self, workers=workers)

    @property
    def needs(self) -> Resources:
        return Resources(self.workers * self.per_worker.cpus, self.workers * self.per_worker.gpus)

    def bundle(self) -> dict[str, float]:
        """One worker's Ray resources."""
        return self.per_worker.as_node()

    def describe(self) -> str:
        """``4 x (1 CPU, 0.5 GPU), STRICT_PACK``."""
        return f"{self.workers} x ({describe_resources(self.bundle())}), {self.strategy}"
