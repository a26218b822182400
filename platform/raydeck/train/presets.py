"""Named resource shapes for Ray Train (presets), and whether the cluster can ever run them.

Owns: the registry of built-in and user presets (a YAML/TOML file named by
``RAYDECK_PRESETS_FILE``), their validation, their translation into Ray's own ``ScalingConfig``,
and the feasibility check that turns "pending forever" into an immediate, explained error.
Does not own: launching (``raydeck.train.trainer``) or resource accounting (Ray does that).

GPU shares: a worker takes a whole number of GPUs, or a fraction 1/k (k = 2..8) so that k workers
share one GPU exactly (Ray packs fractional requests onto the same device). Other fractions
(0.3, 1.5) are rejected because they strand capacity.

Elastic presets: ``num_workers`` may be a range ``(min_workers, max_workers)`` (``[1, 4]`` in a
presets file), as in Ray Train v2's own ``ScalingConfig(num_workers=(min, max))``. Ray Train then
starts with as many workers as its share of the cluster holds (at least the minimum), grows the
worker group when that share grows (checked every ``elastic_resize_monitor_interval_s``) and
restarts it smaller from the latest checkpoint when workers are lost. Ray 2.60 computes the share
from the nodes' total resources, divided among the elastic jobs and Ray Data; work that holds
resources outside them (a fixed-size job, a placement group) is not subtracted, so an elastic job
may wait for them like a fixed one. Such a preset is feasible when its minimum can ever be
placed.

Each preset also carries its fault-tolerance defaults: how many worker-group restarts Ray Train
makes from the latest checkpoint (``max_failures``, Ray's ``FailureConfig``) and how many
checkpoints it keeps (``checkpoints_to_keep``, Ray's ``CheckpointConfig``).
"""

from __future__ import annotations

import dataclasses
import logging
import math
import tomllib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from raydeck.errors import PresetError

logger = logging.getLogger(__name__)

PLACEMENT_STRATEGIES = ("PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD")
GPU_FRACTION_DENOMINATORS = range(2, 9)
DEFAULT_MAX_FAILURES = 3
DEFAULT_CHECKPOINTS_TO_KEEP = 2
GIB = 1024**3


@dataclass(frozen=True)
class Preset:
    """A named Ray Train resource shape. Every field is validated at construction.

    ``num_workers``: a fixed worker count, or a ``(min_workers, max_workers)`` range for an
    elastic job (a two-item list is accepted and stored as a tuple).
    """

    name: str
    num_workers: int | tuple[int, int]
    cpus_per_worker: float = 1.0
    gpus_per_worker: float = 0.0
    memory_per_worker_gb: float = 0.0
    placement_strategy: str = "PACK"
    max_failures: int = DEFAULT_MAX_FAILURES
    checkpoints_to_keep: int = DEFAULT_CHECKPOINTS_TO_KEEP
    description: str = ""

    def __post_init__(self) -> None:
        where = f"preset {self.name!r}"
        self._check_num_workers(where)
        for name in ("max_failures", "checkpoints_to_keep"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int):
                raise PresetError(f"{where}: {name}={value!r} must be an integer")
        for name in ("cpus_per_worker", "gpus_per_worker", "memory_per_worker_gb"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or value < 0:
                raise PresetError(f"{where}: {name}={value!r} must be a number >= 0")
        gpus = self.gpus_per_worker
        if gpus >= 1 and not float(gpus).is_integer():
            raise PresetError(
                f"{where}: gpus_per_worker={gpus}: whole GPUs must be an integer (1, 2, ...)"
            )
        if 0 < gpus < 1 and not any(
            math.isclose(gpus, 1 / k, rel_tol=1e-9) for k in GPU_FRACTION_DENOMINATORS
        ):
            shares = ", ".join(f"{1 / k:.4g}" for k in GPU_FRACTION_DENOMINATORS)
            raise PresetError(
                f"{where}: gpus_per_worker={gpus}: a GPU share must be 1/k for k = 2..8 "
                f"({shares}) so workers divide a GPU exactly"
            )
        if self.placement_strategy not in PLACEMENT_STRATEGIES:
            raise PresetError(
                f"{where}: placement_strategy={self.placement_strategy!r} must be one of "
                f"{', '.join(PLACEMENT_STRATEGIES)}"
            )
        if self.max_failures < -1:
            raise PresetError(
                f"{where}: max_failures={self.max_failures} must be >= -1 "
                "(-1: retry forever, 0: fail on the first worker death)"
            )
        if self.checkpoints_to_keep < 1:
            raise PresetError(
                f"{where}: checkpoints_to_keep={self.checkpoints_to_keep} must be >= 1 "
                "(a restart resumes from the latest checkpoint)"
            )

    def _check_num_workers(self, where: str) -> None:
        value = self.num_workers
        if isinstance(value, list):
            value = tuple(value)
            object.__setattr__(self, "num_workers", value)
        if isinstance(value, tuple):
            if len(value) != 2 or not all(isinstance(v, int) and not isinstance(v, bool)
                                          for v in value):
                raise PresetError(
                    f"{where}: num_workers={list(value)!r} must be a worker count or a range "
                    "[min_workers, max_workers] of two integers (e.g. [1, 4])"
                )
            low, high = value
            if low < 1:
                raise PresetError(f"{where}: num_workers={list(value)!r}: min_workers={low} "
                                  "must be >= 1 (an elastic job runs at least one worker)")
            if low > high:
                raise PresetError(f"{where}: num_workers={list(value)!r}: min_workers={low} "
                                  f"must be <= max_workers={high}; write [{high}, {low}]")
            return
        if isinstance(value, bool) or not isinstance(value, int):
            raise PresetError(f"{where}: num_workers={value!r} must be an integer or a range "
                              "[min_workers, max_workers]")
        if value < 1:
            raise PresetError(f"{where}: num_workers={value} must be >= 1")

    @property
    def elastic(self) -> bool:
        """Whether Ray Train may run this preset at any size in ``[min_workers, max_workers]``."""
        return isinstance(self.num_workers, tuple)

    @property
    def min_workers(self) -> int:
        """The fewest workers the job runs with (the fixed count when not elastic)."""
        return self.num_workers[0] if isinstance(self.num_workers, tuple) else self.num_workers

    @property
    def max_workers(self) -> int:
        """The most workers the job runs with (the fixed count when not elastic)."""
        return self.num_workers[1] if isinstance(self.num_workers, tuple) else self.num_workers

    @property
    def workers_label(self) -> str:
        """``2``, or ``1-4`` for an elastic preset (how tables show it)."""
        return (f"{self.min_workers}-{self.max_workers}" if self.elastic
                else str(self.num_workers))

    @property
    def use_gpu(self) -> bool:
        return self.gpus_per_worker > 0

    def resources_per_worker(self) -> dict[str, float]:
        """The bundle Ray reserves for each worker."""
        resources = {"CPU": float(self.cpus_per_worker)}
        if self.use_gpu:
            resources["GPU"] = float(self.gpus_per_worker)
        if self.memory_per_worker_gb:
            resources["memory"] = float(self.memory_per_worker_gb * GIB)
        return resources

    def scaling_config(self) -> Any:
        """Ray's own ``ray.train.ScalingConfig`` for this preset; elastic (``num_workers=(min,
        max)``) when the preset names a range."""
        from ray.train import ScalingConfig

        return ScalingConfig(
            # mypy reads Ray Train v1's annotation (an int); v2, Ray's default, takes the range.
            num_workers=self.num_workers,  # type: ignore[arg-type]
            use_gpu=self.use_gpu,
            resources_per_worker=self.resources_per_worker(),
            placement_strategy=self.placement_strategy,
        )

    def failure_config(self) -> Any:
        """Ray's ``ray.train.FailureConfig``: restarts from the latest checkpoint."""
        from ray.train import FailureConfig

        return FailureConfig(max_failures=self.max_failures)

    def checkpoint_config(self) -> Any:
        """Ray's ``ray.train.CheckpointConfig``: keep the newest ``checkpoints_to_keep``."""
        from ray.train import CheckpointConfig

        return CheckpointConfig(num_to_keep=self.checkpoints_to_keep)

    def with_workers(self, num_workers: int | tuple[int, int]) -> Preset:
        return dataclasses.replace(self, num_workers=num_workers)

    @classmethod
    def from_scaling_config(cls, scaling_config: Any, name: str = "custom") -> Preset:
        """The preset equivalent to a user's own ``ray.train.ScalingConfig`` (validated alike).

        Raises:
            PresetError: the ScalingConfig breaks a preset rule (e.g. a 0.3 GPU share).
        """
        resources = dict(scaling_config.resources_per_worker or {})
        gpus = float(resources.pop("GPU", 1.0 if scaling_config.use_gpu else 0.0))
        memory_bytes = float(resources.pop("memory", 0.0))
        return cls(
            name=name,
            num_workers=(scaling_config.num_workers if isinstance(scaling_config.num_workers, tuple)
                         else int(scaling_config.num_workers)),
            cpus_per_worker=float(resources.pop("CPU", 1.0)),
            gpus_per_worker=int(gpus) if gpus.is_integer() else gpus,
            memory_per_worker_gb=memory_bytes / GIB,
            placement_strategy=str(scaling_config.placement_strategy),
            description="a ScalingConfig passed by the caller",
        )


BUILTIN_PRESETS: dict[str, Preset] = {
    p.name: p
    for p in (
        Preset("cpu-1", 1, description="1 CPU worker"),
        Preset("cpu-2", 2, description="2 CPU workers (the default)"),
        Preset("cpu-4", 4, description="4 CPU workers"),
        Preset("cpu-1-2", (1, 2), description="elastic: 1 to 2 CPU workers, as many as fit"),
        Preset("cpu-1-4", (1, 4), description="elastic: 1 to 4 CPU workers, as many as fit"),
        Preset("gpu-1", 1, cpus_per_worker=4, gpus_per_worker=1, description="1 worker, 1 GPU"),
        Preset("gpu-2", 2, cpus_per_worker=4, gpus_per_worker=1,
               description="2 workers, 1 GPU each"),
        Preset("gpu-1-4", (1, 4), cpus_per_worker=4, gpus_per_worker=1,
               description="elastic: 1 to 4 workers, 1 GPU each, as many as fit"),
        Preset("gpu-half", 2, cpus_per_worker=1, gpus_per_worker=0.5,
               description="2 workers sharing one GPU (0.5 each)"),
        Preset("gpu-quarter", 4, cpus_per_worker=1, gpus_per_worker=0.25,
               description="4 workers sharing one GPU (0.25 each)"),
        Preset("gpu-pack", 4, cpus_per_worker=1, gpus_per_worker=0.5, placement_strategy="PACK",
               description="4 half-GPU workers packed onto as few nodes as possible"),
        Preset("gpu-spread", 4, cpus_per_worker=1, gpus_per_worker=0.5,
               placement_strategy="SPREAD", description="4 half-GPU workers spread over nodes"),
        Preset("gpu-strict-pack", 4, cpus_per_worker=1, gpus_per_worker=0.5,
               placement_strategy="STRICT_PACK", description="4 half-GPU workers on one node"),
        Preset("gpu-strict-spread", 2, cpus_per_worker=4, gpus_per_worker=1,
               placement_strategy="STRICT_SPREAD",
               description="2 one-GPU workers, each on its own node"),
    )
}
DEFAULT_PRESET = "cpu-2"


def _read_file(path: Path) -> dict[str, Any]:
    if not path.is_file():
        raise PresetError(f"RAYDECK_PRESETS_FILE={str(path)!r}: no such file")
    text = path.read_text()
    try:
        if path.suffix == ".toml":
            document = tomllib.loads(text)
        else:
            import yaml

            document = yaml.safe_load(text) or {}
    except Exception as exc:
        raise PresetError(f"{path}: cannot be parsed ({exc})") from None
    presets = document.get("presets", document)
    if not isinstance(presets, dict):
        raise PresetError(f"{path}: expected a mapping of preset name -> fields")
    return presets


def load_presets(presets_file: str | Path | None = None) -> dict[str, Preset]:
    """Built-in presets plus those of ``presets_file`` (YAML or TOML), which may override them.

    File format: a mapping ``name -> {num_workers (a count, or ``[min, max]`` for an elastic
    preset), cpus_per_worker, gpus_per_worker,
    memory_per_worker_gb, placement_strategy, max_failures, checkpoints_to_keep,
    description}``, optionally under a
    top-level ``presets`` key.
    """
    presets = dict(BUILTIN_PRESETS)
    if not presets_file:
        return presets
    known = {f.name for f in dataclasses.fields(Preset)} - {"name"}
    for name, fields in _read_file(Path(presets_file)).items():
        if not isinstance(fields, dict):
            raise PresetError(f"preset {name!r} in {presets_file}: expected a mapping of fields")
        unknown = sorted(set(fields) - known)
        if unknown:
            raise PresetError(
                f"preset {name!r} in {presets_file}: unknown field(s) {', '.join(unknown)}; "
                f"known: {', '.join(sorted(known))}"
            )
        if "num_workers" not in fields:
            raise PresetError(f"preset {name!r} in {presets_file}: num_workers is required")
        presets[str(name)] = Preset(name=str(name), **fields)
    return presets


def resolve(scaling: str | Preset | Any, presets_file: str | Path | None = None) -> Preset:
    """A preset from a name, a :class:`Preset` or a ``ray.train.ScalingConfig``.

    Raises:
        PresetError: unknown name, or a ScalingConfig that breaks a preset rule.
    """
    if isinstance(scaling, Preset):
        return scaling
    if isinstance(scaling, str):
        return get_preset(scaling, presets_file)
    return Preset.from_scaling_config(scaling)


def get_preset(name: str, presets_file: str | Path | None = None) -> Preset:
    """The preset called ``name``.

    Raises:
        PresetError: no such preset; the message lists the known names.
    """
    presets = load_presets(presets_file)
    if name not in presets:
        raise PresetError(
            f"unknown preset {name!r}; known presets: {', '.join(sorted(presets))} "
            "(add your own in RAYDECK_PRESETS_FILE)"
        )
    return presets[name]


def presets_markdown() -> str:
    """README's table of the built-in presets, rendered from :data:`BUILTIN_PRESETS`."""
    lines = ["| preset | workers | CPU / worker | GPU / worker | placement | max failures | "
             "checkpoints kept | what for |", "|---|---|---|---|---|---|---|---|"]
    for preset in BUILTIN_PRESETS.values():
        lines.append(
            f"| `{preset.name}` | {preset.workers_label} | {preset.cpus_per_worker:g} | "
            f"{preset.gpus_per_worker:g} | {preset.placement_strategy} | {preset.max_failures} | "
            f"{preset.checkpoints_to_keep} | {preset.description} |"
        )
    return "\n".join(lines)
