"""Named resource shapes for Ray Train (presets), and whether the cluster can ever run them.

Owns: the registry of built-in and user presets (a YAML/TOML file named by
``RAYDECK_PRESETS_FILE``), their validation, their translation into Ray's own ``ScalingConfig``,
and the feasibility check that turns "pending forever" into an immediate, explained error.
Does not own: launching (``raydeck.training``) or resource accounting (Ray does that).

GPU shares: a worker takes a whole number of GPUs, or a fraction 1/k (k = 2..8) so that k workers
share one GPU exactly (Ray packs fractional requests onto the same device). Other fractions
(0.3, 1.5) are rejected because they strand capacity.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import tomllib

from raydeck.errors import InfeasibleResourcesError, PresetError

PLACEMENT_STRATEGIES = ("PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD")
GPU_FRACTION_DENOMINATORS = range(2, 9)
_GIB = 1024**3


@dataclass(frozen=True)
class Preset:
    """A named Ray Train resource shape. Every field is validated at construction."""

    name: str
    num_workers: int
    cpus_per_worker: float = 1.0
    gpus_per_worker: float = 0.0
    memory_per_worker_gb: float = 0.0
    placement_strategy: str = "PACK"
    max_failures: int = 3
    description: str = ""

    def __post_init__(self) -> None:
        where = f"preset {self.name!r}"
        if isinstance(self.num_workers, bool) or not isinstance(self.num_workers, int):
            raise PresetError(f"{where}: num_workers={self.num_workers!r} must be an integer")
        if self.num_workers < 1:
            raise PresetError(f"{where}: num_workers={self.num_workers} must be >= 1")
        if self.cpus_per_worker < 0:
            raise PresetError(f"{where}: cpus_per_worker={self.cpus_per_worker} must be >= 0")
        if self.memory_per_worker_gb < 0:
            raise PresetError(
                f"{where}: memory_per_worker_gb={self.memory_per_worker_gb} must be >= 0"
            )
        gpus = self.gpus_per_worker
        if gpus < 0:
            raise PresetError(f"{where}: gpus_per_worker={gpus} must be >= 0")
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
            raise PresetError(f"{where}: max_failures={self.max_failures} must be >= -1")

    @property
    def use_gpu(self) -> bool:
        return self.gpus_per_worker > 0

    def resources_per_worker(self) -> dict[str, float]:
        """The bundle Ray reserves for each worker."""
        resources = {"CPU": float(self.cpus_per_worker)}
        if self.use_gpu:
            resources["GPU"] = float(self.gpus_per_worker)
        if self.memory_per_worker_gb:
            resources["memory"] = float(self.memory_per_worker_gb * _GIB)
        return resources

    def scaling_config(self) -> Any:
        """Ray's own ``ray.train.ScalingConfig`` for this preset."""
        from ray.train import ScalingConfig

        return ScalingConfig(
            num_workers=self.num_workers,
            use_gpu=self.use_gpu,
            resources_per_worker=self.resources_per_worker(),
            placement_strategy=self.placement_strategy,
        )

    def with_workers(self, num_workers: int) -> Preset:
        return dataclasses.replace(self, num_workers=num_workers)


BUILTIN_PRESETS: dict[str, Preset] = {
    p.name: p
    for p in (
        Preset("cpu-1", 1, description="1 CPU worker"),
        Preset("cpu-2", 2, description="2 CPU workers (the default)"),
        Preset("cpu-4", 4, description="4 CPU workers"),
        Preset("gpu-1", 1, cpus_per_worker=4, gpus_per_worker=1, description="1 worker, 1 GPU"),
        Preset("gpu-2", 2, cpus_per_worker=4, gpus_per_worker=1,
               description="2 workers, 1 GPU each"),
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

    File format: a mapping ``name -> {num_workers, cpus_per_worker, gpus_per_worker,
    memory_per_worker_gb, placement_strategy, max_failures, description}``, optionally under a
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


@dataclass(frozen=True)
class Feasibility:
    """The answer of :func:`check_feasible` for a request the cluster can run."""

    runs_now: bool
    message: str


def _fits(bundle: dict[str, float], node: dict[str, float], count: int = 1) -> bool:
    return all(node.get(name, 0.0) + 1e-9 >= amount * count for name, amount in bundle.items())


def _capacity(bundle: dict[str, float], node: dict[str, float]) -> int:
    counts = [
        math.floor((node.get(name, 0.0) + 1e-9) / amount)
        for name, amount in bundle.items() if amount > 0
    ]
    return min(counts) if counts else 10**9


def _placeable(bundle: dict[str, float], workers: int, strategy: str,
               nodes: list[dict[str, float]]) -> bool:
    if strategy == "STRICT_PACK":
        return any(_fits(bundle, node, workers) for node in nodes)
    if strategy == "STRICT_SPREAD":
        return sum(1 for node in nodes if _fits(bundle, node)) >= workers
    return sum(_capacity(bundle, node) for node in nodes) >= workers


def _describe(resources: dict[str, float]) -> str:
    shown = []
    for name in ("CPU", "GPU", "memory"):
        if name in resources:
            value = resources[name]
            shown.append(f"{value / _GIB:.1f} GiB memory" if name == "memory"
                         else f"{value:g} {name}")
    return ", ".join(shown) or "nothing"


def check_feasible(
    preset: Preset,
    *,
    extra_per_worker: dict[str, float] | None = None,
    node_totals: list[dict[str, float]] | None = None,
    node_available: list[dict[str, float]] | None = None,
) -> Feasibility:
    """Compare a request with the cluster before launching it.

    Args:
        preset: the request.
        extra_per_worker: resources each worker needs on top of the preset (Tune trial drivers).
        node_totals, node_available: per-node resources; default: read from the connected Ray
            cluster (alive nodes).

    Returns:
        Whether it runs now, or a message saying it is queued behind running work.

    Raises:
        InfeasibleResourcesError: the cluster, even empty, can never place the request; the
            message says what was asked and what exists.
    """
    if node_totals is None or node_available is None:
        import ray

        alive = [n for n in ray.nodes() if n.get("Alive")]
        node_totals = [dict(n.get("Resources", {})) for n in alive]
        available = ray.available_resources()
        # ray.available_resources() is cluster-wide; per-node availability only matters for
        # the "queued" message, so scale each node's share by the cluster-wide ratio.
        node_available = _split_available(node_totals, available)
    bundle = dict(preset.resources_per_worker())
    for name, amount in (extra_per_worker or {}).items():
        bundle[name] = bundle.get(name, 0.0) + amount
    totals: dict[str, float] = {}
    for node in node_totals:
        for name, amount in node.items():
            totals[name] = totals.get(name, 0.0) + amount
    asked = f"{preset.num_workers} worker(s) x ({_describe(bundle)}), {preset.placement_strategy}"
    if not _placeable(bundle, preset.num_workers, preset.placement_strategy, node_totals):
        largest = max(node_totals, key=lambda n: n.get("GPU", 0.0) + n.get("CPU", 0.0),
                      default={})
        raise InfeasibleResourcesError(
            f"preset {preset.name!r} asks for {asked}, but the cluster has "
            f"{len(node_totals)} node(s) with {_describe(totals)} in total (largest node: "
            f"{_describe(largest)}); it would wait forever. Pick a smaller preset "
            "(`raydeck presets`) or add nodes."
        )
    if _placeable(bundle, preset.num_workers, preset.placement_strategy, node_available):
        return Feasibility(True, f"{asked}: fits now")
    return Feasibility(
        False,
        f"{asked}: feasible, but the cluster is busy; queued until running work frees "
        "resources",
    )


def _split_available(node_totals: list[dict[str, float]], available: dict[str, float]
                     ) -> list[dict[str, float]]:
    totals: dict[str, float] = {}
    for node in node_totals:
        for name, amount in node.items():
            totals[name] = totals.get(name, 0.0) + amount
    return [
        {name: amount * (available.get(name, 0.0) / totals[name] if totals.get(name) else 0.0)
         for name, amount in node.items()}
        for node in node_totals
    ]
