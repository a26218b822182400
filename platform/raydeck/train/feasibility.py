"""Whether a cluster can ever run a preset, and where its workers would go.

Owns: :func:`check_feasible` (turns "pending forever" into an immediate, explained error, or says
the job waits for resources in use), :func:`place` and :func:`placeable` (a gang's workers on the
nodes' free resources under a placement strategy, exact for 1/k GPU shares; the queue's
placement-aware admission and the simulator use the same function), :func:`cluster_resources`
(the nodes' totals and what is free now, as Ray reports them) and :func:`describe_resources`.
Does not own: what a preset is (:mod:`raydeck.train.presets`) or accounting (Ray does that).
"""

from __future__ import annotations

import logging
import math
import re
from dataclasses import dataclass

from raydeck.errors import InfeasibleResourcesError
from raydeck.train.presets import GIB, Preset

logger = logging.getLogger(__name__)

# Resources Ray derives from placement groups (``CPU_group_<pg id>``, ``bundle_group_...``): they
# are views of the base resources, not capacity of their own.
_PLACEMENT_GROUP_RESOURCE = re.compile(r"_group_")
MAX_NODES_SHOWN = 8


@dataclass(frozen=True)
class Feasibility:
    """The answer of :func:`check_feasible` for a request the cluster can run."""

    runs_now: bool
    message: str


NodeResources = dict[str, float]


def _fits(bundle: NodeResources, node: NodeResources, count: int = 1) -> bool:
    return all(node.get(name, 0.0) + 1e-9 >= amount * count for name, amount in bundle.items())


def _capacity(bundle: NodeResources, node: NodeResources) -> int:
    """How many ``bundle``s one node holds. Exact for 1/k GPU shares: k of them fill a GPU."""
    counts = [
        math.floor((node.get(name, 0.0) + 1e-9) / amount)
        for name, amount in bundle.items() if amount > 0
    ]
    return min(counts) if counts else 10**9


def place(bundle: NodeResources, workers: int, strategy: str,
          nodes: list[NodeResources]) -> list[int] | None:
    """A node (index into ``nodes``) for each of ``workers`` bundles under ``strategy``, or None
    when Ray could not place them all on ``nodes``.

    STRICT_PACK needs one node for all, STRICT_SPREAD a distinct node for each; PACK and SPREAD
    are preferences, so any node with room counts (PACK fills the roomiest nodes first, SPREAD
    takes one per node in turn). Strict gangs go to the node(s) with the least room that fits
    (best fit), which keeps large holes for large gangs. GPU shares are summed per node: Ray
    fills one GPU with fractional requests before it starts the next, so a node's free share
    is whole free GPUs plus at most one partly used one, and 1/k shares pack onto that one
    first.
    """
    room = [_capacity(bundle, node) for node in nodes]
    by_room = sorted(range(len(nodes)), key=lambda i: (room[i], i))
    if strategy == "STRICT_PACK":
        node = next((i for i in by_room if room[i] >= workers), None)
        return None if node is None else [node] * workers
    if strategy == "STRICT_SPREAD":
        fitting = [i for i in by_room if room[i] >= 1]
        return sorted(fitting[:workers]) if len(fitting) >= workers else None
    if sum(room) < workers:
        return None
    chosen: list[int] = []
    if strategy == "SPREAD":
        while len(chosen) < workers:
            for i in range(len(nodes)):
                if room[i] > chosen.count(i) and len(chosen) < workers:
                    chosen.append(i)
        return sorted(chosen)
    for i in reversed(by_room):
        chosen.extend([i] * min(room[i], workers - len(chosen)))
    return sorted(chosen)


def placeable(bundle: NodeResources, workers: int, strategy: str,
              nodes: list[NodeResources]) -> bool:
    """Whether Ray can place ``workers`` bundles on ``nodes`` under ``strategy`` (:func:`place`)."""
    return place(bundle, workers, strategy, nodes) is not None


def describe_resources(resources: NodeResources) -> str:
    shown = []
    for name in ("CPU", "GPU", "memory"):
        if name in resources:
            value = resources[name]
            shown.append(f"{value / GIB:.1f} GiB memory" if name == "memory"
                         else f"{value:g} {name}")
    custom = sorted(k for k in resources if k not in ("CPU", "GPU", "memory"))
    shown.extend(f"{resources[k]:g} {k}" for k in custom)
    return ", ".join(shown) or "nothing"


def _base_resources(resources: dict[str, float]) -> NodeResources:
    """A node's schedulable resources, without Ray's per-node and placement-group markers."""
    return {
        name: float(amount) for name, amount in resources.items()
        if not _PLACEMENT_GROUP_RESOURCE.search(name) and not name.startswith("node:")
        and name != "object_store_memory"
    }


def cluster_resources() -> tuple[list[NodeResources], list[NodeResources]]:
    """Total and currently available resources of each alive node of the connected cluster.

    Returns:
        Two lists, aligned by node: totals and what is free right now (resources held by
        running tasks, actors and placement groups are not free).
    """
    # Ray's public API has per-node totals (ray.nodes()) but only cluster-wide availability;
    # its DeveloperAPI in ray._private.state has both per node, which placement needs.
    from ray._private.state import available_resources_per_node, total_resources_per_node

    totals = total_resources_per_node()
    available = available_resources_per_node()
    node_ids = sorted(totals)
    return ([_base_resources(totals[n]) for n in node_ids],
            [_base_resources(available.get(n, {})) for n in node_ids])


def check_feasible(
    preset: Preset,
    *,
    extra_per_worker: dict[str, float] | None = None,
    node_totals: list[NodeResources] | None = None,
    node_available: list[NodeResources] | None = None,
) -> Feasibility:
    """Compare a request with the cluster before launching it.

    Args:
        preset: the request.
        extra_per_worker: resources each worker needs on top of the preset (Tune trial drivers).
        node_totals, node_available: per-node resources (aligned lists); default: read from
            the connected Ray cluster with :func:`cluster_resources`.

    An elastic preset is checked at its minimum: Ray Train starts it with what fits.

    Returns:
        ``runs_now`` True when the workers fit into what is free now; False (with a message
        saying it is queued) when they fit into the empty cluster but not into what running
        work leaves free. Per-node GPU availability is a sum: on a node whose free GPU is split
        across devices (0.5 + 0.5), a whole-GPU worker is reported as fitting although Ray
        waits; it then queues, it does not fail.

    Raises:
        InfeasibleResourcesError: the cluster, even empty, can never place the request; the
            message says what was asked and what each node has.
    """
    if node_totals is None or node_available is None:
        node_totals, node_available = cluster_resources()
    bundle = dict(preset.resources_per_worker())
    for name, amount in (extra_per_worker or {}).items():
        bundle[name] = bundle.get(name, 0.0) + amount
    totals: NodeResources = {}
    for node in node_totals:
        for name, amount in node.items():
            totals[name] = totals.get(name, 0.0) + amount
    workers = preset.min_workers
    at_least = f"at least {workers} (up to {preset.max_workers})" if preset.elastic else workers
    asked = f"{at_least} worker(s) x ({describe_resources(bundle)}), {preset.placement_strategy}"
    if not placeable(bundle, workers, preset.placement_strategy, node_totals):
        shown_nodes = "; ".join(
            f"node {index}: {describe_resources({k: v for k, v in node.items() if k in bundle})}"
            for index, node in enumerate(node_totals[:MAX_NODES_SHOWN])
        )
        more = (f"; and {len(node_totals) - MAX_NODES_SHOWN} more"
                if len(node_totals) > MAX_NODES_SHOWN else "")
        raise InfeasibleResourcesError(
            f"preset {preset.name!r} asks for {asked}, but the cluster has "
            f"{len(node_totals)} node(s) with {describe_resources(totals)} in total "
            f"({shown_nodes}"
            f"{more}); it would wait forever. Pick a smaller preset (`raydeck presets`) or "
            "add nodes."
        )
    if placeable(bundle, workers, preset.placement_strategy, node_available):
        return Feasibility(True, f"{asked}: fits now")
    message = (f"{asked}: feasible, but the cluster is busy; queued until running work frees "
               "resources")
    logger.info(message)
    return Feasibility(False, message)
