"""The preflight probe: a tiny job that checks the cluster's Python can import raydeck and reads
each node's resources, so a submission fails at once with the Python and the fix named, instead
of a ``No module named 'ray'`` deep in a job's log.
"""

from __future__ import annotations

import json
import logging
import re
import shlex
import sys
import uuid
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from raydeck._internal.contract import JOB_KIND_METADATA
from raydeck.errors import JobSubmissionError
from raydeck.jobs.submission import (
    TERMINAL_STATUSES,
    submit_waiting_for_agent,
    wait_for,
)

if TYPE_CHECKING:
    from ray.job_submission import JobSubmissionClient

    from raydeck.train.feasibility import NodeResources

PROBE_TIMEOUT_S = 300.0
PROBE_MARKER = "RAYDECK_PROBE="
PROBE_PYTHON_MARKER = "RAYDECK_PROBE_PYTHON="


@dataclass(frozen=True)
class ClusterProbe:
    """What the preflight job saw on the cluster."""

    python: str
    raydeck_version: str
    ray_version: str
    node_totals: list[NodeResources] = field(default_factory=list)
    node_available: list[NodeResources] = field(default_factory=list)


PROBE_ENTRYPOINT = "python -c " + shlex.quote(
    "import sys; print('" + PROBE_PYTHON_MARKER + "' + sys.executable, flush=True); "
    "from raydeck.jobs.probe import probe_main; probe_main()"
)


def probe_main() -> None:
    """The probe job's body (runs on the cluster): versions and per-node resources as JSON."""
    import ray

    from raydeck._version import __version__
    from raydeck.train.feasibility import cluster_resources

    ray.init(logging_level=logging.WARNING)
    totals, available = cluster_resources()
    print(PROBE_MARKER + json.dumps({
        "python": sys.executable, "raydeck_version": __version__,
        "ray_version": ray.__version__, "node_totals": totals, "node_available": available,
    }), flush=True)


def _probe_failure(logs: str, address: str) -> str:
    python_line = re.search(rf"^{re.escape(PROBE_PYTHON_MARKER)}(\S+)$", logs, re.MULTILINE)
    python = python_line.group(1) if python_line else ""
    missing = re.search(r"No module named '?([\w.]+)'?", logs)
    fix = (
        "start the head (and every worker node) with raydeck's environment first on PATH, e.g. "
        "`PATH=/path/to/venv/bin:$PATH ray start --head`, or install raydeck and its "
        "dependencies into the Python `ray start` runs with (py_modules in the runtime env ships "
        "raydeck's code, not its dependencies)"
    )
    if python and missing:
        return (f"the cluster runs jobs with {python}, which cannot import {missing.group(1)!r} "
                f"(needed by raydeck); {fix}")
    if not python:
        tail = " | ".join(line for line in logs.strip().splitlines()[-3:] if line.strip())
        return (f"the cluster could not start a Python job (`python` is whatever comes first "
                f"on the PATH of `ray start` on {address}): {tail[:300] or 'no output'}; {fix}")
    tail = " | ".join(logs.strip().splitlines()[-3:])
    return f"the probe job failed on the cluster with {python}: {tail[:400]}"


def probe(client: JobSubmissionClient, runtime_env: dict[str, Any], *,
          timeout_s: float = PROBE_TIMEOUT_S) -> ClusterProbe:
    """Run a tiny job with ``runtime_env``: can the cluster's Python import raydeck?

    Raises:
        JobSubmissionError: it cannot (the message names the Python and the fix), or the probe
            did not finish within ``timeout_s``.
    """
    submission_id = f"raydeck-probe-{uuid.uuid4().hex[:8]}"
    submit_waiting_for_agent(client, entrypoint=PROBE_ENTRYPOINT, submission_id=submission_id,
            runtime_env=runtime_env, metadata={JOB_KIND_METADATA: "probe"})
    status = wait_for(client, submission_id, timeout_s)
    logs = client.get_job_logs(submission_id)
    found = [line for line in logs.splitlines() if line.startswith(PROBE_MARKER)]
    if status != "SUCCEEDED" or not found:
        if status not in TERMINAL_STATUSES:
            client.stop_job(submission_id)
            raise JobSubmissionError(
                f"the preflight job {submission_id} did not finish within {timeout_s:.0f} s "
                f"(status {status}); is the cluster busy? `ray job logs {submission_id}`"
            )
        raise JobSubmissionError(_probe_failure(logs, client.get_address()))
    answer = json.loads(found[-1][len(PROBE_MARKER):])
    return ClusterProbe(
        python=answer["python"], raydeck_version=answer["raydeck_version"],
        ray_version=answer["ray_version"], node_totals=answer["node_totals"],
        node_available=answer["node_available"],
    )
