"""Kueue objects from raydeck's teams file: on Kubernetes, Kueue is the queue.

``raydeck k8s render --teams FILE --kueue`` maps the teams file ``raydeck queue --teams`` takes
(the CLI parses it; this module gets :class:`TeamSpec` values, since the k8s layer does not
import the queue's) onto Kueue v1beta2 (Kueue v0.19):

- a ResourceFlavor per node kind: ``raydeck-cpu`` (CPU and memory, any node) and
  ``raydeck-gpu`` (``nvidia.com/gpu``, the nodes with GPUs, their taint tolerated);
- a ClusterQueue per team, all in the cohort ``raydeck``: its ``nominalQuota`` is the team's
  fair share of ``--capacity`` (weighted by the team's weight, never above its quota, what a
  capped team leaves going to the others), its ``borrowingLimit`` what its quota allows above
  that (none for a team without a quota: it may borrow all that is idle, as raydeck's queue
  lets it use whatever is free), ``fairSharing.weight`` its weight; it preempts only
  workloads of lower priority, as raydeck's queue does;
- a LocalQueue ``raydeck`` in each team's namespace;
- a WorkloadPriorityClass per raydeck priority, 0 to the highest ``max_priority``.

Memory is quota'd with the CPUs, at the pods' ratio (:data:`MEMORY_PER_CPU_MI`): Kueue admits
only what its ClusterQueue covers, and the teams file has no memory.

Owns: these objects and the labels and annotation that put a RayJob, RayService or RayCluster
in a team's queue. Does not own: Kueue's configuration (fair sharing, feature gates), which is
the cluster admin's.
"""

from __future__ import annotations

import math
import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from raydeck.errors import ConfigError

KUEUE_API_VERSION = "kueue.x-k8s.io/v1beta2"
QUEUE_LABEL = "kueue.x-k8s.io/queue-name"
PRIORITY_CLASS_LABEL = "kueue.x-k8s.io/priority-class"
ELASTIC_ANNOTATION = "kueue.x-k8s.io/elastic-job"
# The Kueue feature gate elastic RayJobs and RayClusters need (beta, on by default since
# Kueue v0.18; alpha and off in v0.13-v0.17).
ELASTIC_FEATURE_GATE = "ElasticJobsViaWorkloadSlices"
COHORT = "raydeck"
LOCAL_QUEUE = "raydeck"
CPU_FLAVOR = "raydeck-cpu"
GPU_FLAVOR = "raydeck-gpu"
GPU_RESOURCE = "nvidia.com/gpu"
# The GPU nodes' label (NVIDIA's GPU feature discovery sets it) and taint.
GPU_NODE_LABELS = {"nvidia.com/gpu.present": "true"}
GPU_TAINT = {"key": GPU_RESOURCE, "effect": "NoSchedule"}
# Every Ray pod raydeck renders asks for 4 GiB per CPU (kuberay's pod sizes; a test checks).
MEMORY_PER_CPU_MI = 4096
# The top priority class when a team has no max_priority (raydeck's priorities are unbounded).
DEFAULT_TOP_PRIORITY = 10
PART_OF_LABEL = {"app.kubernetes.io/part-of": "raydeck"}
_NAMESPACE = re.compile(r"^[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?$")


@dataclass(frozen=True)
class TeamSpec:
    """A team of the teams file, as Kubernetes needs it.

    Attributes:
        name: the team's name in raydeck's queue.
        weight: its fair-share weight (> 0).
        cpus, gpus: its quota (None: no bound on that resource).
        members: the users who may submit to it (empty: anyone, as in raydeck's queue).
        max_priority: the highest priority its jobs may have (None: no bound).
    """

    name: str
    weight: float = 1.0
    cpus: float | None = None
    gpus: float | None = None
    members: tuple[str, ...] = ()
    max_priority: int | None = None

    def __post_init__(self) -> None:
        if not _NAMESPACE.match(self.namespace):
            raise ConfigError(f"team {self.name!r}: its namespace {self.namespace!r} is not a "
                              "Kubernetes name (1-63 of a-z 0-9 -); rename the team")
        if not self.weight > 0:
            raise ConfigError(f"team {self.name}: weight={self.weight} must be > 0")
        for field in ("cpus", "gpus"):
            value = getattr(self, field)
            if value is not None and value < 0:
                raise ConfigError(f"team {self.name}: {field}={value} must be >= 0")

    @property
    def namespace(self) -> str:
        """The team's namespace: its name, ``_`` written ``-``."""
        return self.name.replace("_", "-")


@dataclass(frozen=True)
class Capacity:
    """What the teams share (``--capacity CPUS:GPUS``): the CPUs and GPUs of the nodes Kueue
    may hand out."""

    cpus: float
    gpus: int

    def __post_init__(self) -> None:
        if not (self.cpus > 0 and self.gpus >= 0):
            raise ConfigError(f"--capacity {self.cpus:g}:{self.gpus}: need CPUS > 0, GPUS >= 0")

    @classmethod
    def parse(cls, text: str) -> Capacity:
        """``CPUS:GPUS`` as the CLI takes it, e.g. ``64:8``."""
        cpus, sep, gpus = text.partition(":")
        try:
            if not sep:
                raise ValueError(text)
            return cls(float(cpus), int(gpus))
        except ValueError:
            raise ConfigError(f"--capacity {text!r}: expected CPUS:GPUS, e.g. 64:8") from None


def check_teams(teams: Sequence[TeamSpec]) -> None:
    """Refuse teams Kubernetes cannot tell apart (two names, one namespace)."""
    seen: dict[str, str] = {}
    for team in teams:
        if team.namespace in seen:
            raise ConfigError(f"teams {seen[team.namespace]!r} and {team.name!r} would share "
                              f"the namespace {team.namespace!r}; rename one")
        seen[team.namespace] = team.name


def fair_shares(total: int, weights: Sequence[float], caps: Sequence[float]) -> list[int]:
    """``total`` units divided by weight, none above its cap, what a capped team leaves going
    to the others (weighted max-min fairness: where raydeck's fair share settles when every
    team wants more); whole units, the remainder to the largest fractions."""
    shares = [0.0] * len(weights)
    open_ = set(range(len(weights)))
    left = float(total)
    while open_:
        weight = sum(weights[i] for i in open_)
        capped = {i for i in open_ if caps[i] <= left * weights[i] / weight}
        if not capped:
            for i in open_:
                shares[i] = left * weights[i] / weight
            break
        for i in capped:
            shares[i] = caps[i]
            left -= caps[i]
        open_ -= capped
    whole = [math.floor(share) for share in shares]
    spare = min(total, math.floor(sum(shares) + 1e-9)) - sum(whole)
    for i in sorted(range(len(shares)), key=lambda i: whole[i] - shares[i])[:max(spare, 0)]:
        whole[i] += 1
    return whole


def _cpu(milli: int) -> str:
    return str(milli // 1000) if milli % 1000 == 0 else f"{milli}m"


def _memory(milli_cpus: int) -> str:
    return f"{milli_cpus * MEMORY_PER_CPU_MI // 1000}Mi"


def _metadata(name: str, namespace: str = "") -> dict[str, Any]:
    metadata: dict[str, Any] = {"name": name, "labels": dict(PART_OF_LABEL)}
    if namespace:
        metadata["namespace"] = namespace
    return metadata


def resource_flavors() -> list[dict[str, Any]]:
    """The node kinds: every node's CPUs and memory, and the GPU nodes' GPUs."""
    return [
        {"apiVersion": KUEUE_API_VERSION, "kind": "ResourceFlavor",
         "metadata": _metadata(CPU_FLAVOR), "spec": {}},
        {"apiVersion": KUEUE_API_VERSION, "kind": "ResourceFlavor",
         "metadata": _metadata(GPU_FLAVOR),
         "spec": {"nodeLabels": dict(GPU_NODE_LABELS), "nodeTaints": [dict(GPU_TAINT)],
                  "tolerations": [{**GPU_TAINT, "operator": "Exists"}]}},
    ]


def cluster_queues(teams: Sequence[TeamSpec], capacity: Capacity) -> list[dict[str, Any]]:
    """A ClusterQueue per team, in one cohort (see the module's docstring for the quotas)."""
    weights = [team.weight for team in teams]
    inf = float("inf")
    cpu_caps = [inf if t.cpus is None else t.cpus * 1000 for t in teams]
    gpu_caps = [inf if t.gpus is None else math.floor(t.gpus) for t in teams]
    cpu_shares = fair_shares(math.floor(capacity.cpus * 1000), weights, cpu_caps)
    gpu_shares = fair_shares(capacity.gpus, weights, gpu_caps)
    queues = []
    for team, cpu_share, gpu_share in zip(teams, cpu_shares, gpu_shares, strict=True):
        cpu = {"name": "cpu", "nominalQuota": _cpu(cpu_share)}
        memory = {"name": "memory", "nominalQuota": _memory(cpu_share)}
        if team.cpus is not None:
            extra = max(math.floor(team.cpus * 1000) - cpu_share, 0)
            cpu["borrowingLimit"] = _cpu(extra)
            memory["borrowingLimit"] = _memory(extra)
        gpu: dict[str, Any] = {"name": GPU_RESOURCE, "nominalQuota": gpu_share}
        if team.gpus is not None:
            gpu["borrowingLimit"] = max(math.floor(team.gpus) - gpu_share, 0)
        queues.append({
            "apiVersion": KUEUE_API_VERSION, "kind": "ClusterQueue",
            "metadata": _metadata(cluster_queue_name(team)),
            "spec": {
                "cohortName": COHORT,
                "namespaceSelector": {"matchLabels": {
                    "kubernetes.io/metadata.name": team.namespace}},
                "fairSharing": {"weight": f"{team.weight:g}"},
                "queueingStrategy": "BestEffortFIFO",
                "preemption": {"withinClusterQueue": "LowerPriority",
                               "reclaimWithinCohort": "LowerPriority",
                               "borrowWithinCohort": {"policy": "LowerPriority"}},
                "resourceGroups": [
                    {"coveredResources": ["cpu", "memory"],
                     "flavors": [{"name": CPU_FLAVOR, "resources": [cpu, memory]}]},
                    {"coveredResources": [GPU_RESOURCE],
                     "flavors": [{"name": GPU_FLAVOR, "resources": [gpu]}]},
                ],
            },
        })
    return queues


def cluster_queue_name(team: TeamSpec) -> str:
    return f"raydeck-{team.namespace}"


def local_queue(team: TeamSpec) -> dict[str, Any]:
    """The team's LocalQueue: what its RayJobs, RayServices and RayCluster name."""
    return {"apiVersion": KUEUE_API_VERSION, "kind": "LocalQueue",
            "metadata": _metadata(LOCAL_QUEUE, team.namespace),
            "spec": {"clusterQueue": cluster_queue_name(team)}}


def top_priority(teams: Sequence[TeamSpec]) -> int:
    """The highest priority a class is rendered for: the highest ``max_priority``, or
    :data:`DEFAULT_TOP_PRIORITY` where a team has none."""
    bounds = [t.max_priority for t in teams if t.max_priority is not None]
    if len(bounds) < len(teams) or not bounds:
        bounds.append(DEFAULT_TOP_PRIORITY)
    return max(bounds)


def priority_class_name(priority: int) -> str:
    return f"raydeck-priority-{priority}"


def priority_classes(top: int) -> list[dict[str, Any]]:
    """A WorkloadPriorityClass per raydeck priority 0..``top``, its value the priority."""
    return [{"apiVersion": KUEUE_API_VERSION, "kind": "WorkloadPriorityClass",
             "metadata": _metadata(priority_class_name(priority)), "value": priority,
             "description": f"raydeck --priority {priority} (higher runs first)"}
            for priority in range(top + 1)]


def queue_labels(priority: int | None = None) -> dict[str, str]:
    """The labels that put an object in its namespace's LocalQueue, at ``priority``."""
    labels = {QUEUE_LABEL: LOCAL_QUEUE}
    if priority is not None:
        labels[PRIORITY_CLASS_LABEL] = priority_class_name(priority)
    return labels


def check_priority(priority: int, team: TeamSpec, top: int) -> None:
    """Refuse a priority the team may not use, or no class exists for."""
    bound = team.max_priority if team.max_priority is not None else top
    if not 0 <= priority <= bound:
        raise ConfigError(f"--priority={priority}: team {team.name} may use 0-{bound}")
