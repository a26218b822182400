"""The tracking proxy with many ranks on two Ray nodes (``benchmarks/tracking_scale.py`` at small
N): every point counted, no run ended or rank dropped while nothing died, and a node removed
while its ranks log loses only what its processes held, never a landed point, and its runs end
KILLED.

The harness runs as its own Ray driver (this process may already be the session cluster's
driver), on one two-node cluster the module starts; the node test runs last: it removes the
worker node.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.fixtures.mlflow_server import MlflowServer
from tests.fixtures.ray_head import MARKER_ENV, SLOW_MACHINE_ENV, RayHead, head_env
from tests.fixtures.tracking import read_line_with

REPO = Path(__file__).resolve().parents[2]
HARNESS = REPO / "benchmarks" / "tracking_scale.py"
# 64 ranks in four hosts (two per node), each host's ranks one run: a node's runs are its own.
LOAD_ARGS = ["--ranks", "64", "--ranks-per-host", "16", "--ranks-per-run", "16",
             "--metrics", "10", "--step-interval", "0.2", "--no-baseline", "--json"]
HARNESS_TIMEOUT_S = 300

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def two_nodes(tmp_path_factory: pytest.TempPathFactory, mlflow_server: MlflowServer
              ) -> Iterator[RayHead]:
    """A ``ray start`` head and one ``ray start --address`` node, with token auth."""
    root = tmp_path_factory.mktemp("scale")
    head = RayHead(root / "ray", head_env(mlflow_server.uri, root / "data", **SLOW_MACHINE_ENV),
                   num_cpus=1)
    try:
        head.start()
        head.add_worker_node(num_cpus=1)
        yield head
    finally:
        head.stop()


def _harness(head: RayHead, server: MlflowServer, work_dir: Path, *args: str
             ) -> subprocess.Popen[str]:
    # Two shards, as a cluster past one shard's ~700 ranks runs (the default is one): the
    # proxy's routing of runs to shards stays proved under load and a node's removal.
    env = {**os.environ, **head.client_env, MARKER_ENV: head.marker,
           "RAYDECK_TRACKING_SHARDS": "2",
           "PYTHONPATH": os.pathsep.join([str(REPO / "platform"), str(REPO)])}
    return subprocess.Popen(
        [sys.executable, str(HARNESS), "--address", head.gcs_address, "--mlflow-uri",
         server.uri, "--mlflow-db", str(server.root / "mlflow.db"), "--work-dir",
         str(work_dir), *LOAD_ARGS, *args],
        env=env, text=True, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
        stderr=subprocess.PIPE, cwd=REPO)


def _report(proc: subprocess.Popen[str]) -> dict[str, Any]:
    out, err = proc.communicate(timeout=HARNESS_TIMEOUT_S)
    assert proc.returncode == 0, err[-4000:]
    return dict(json.loads(out.strip().splitlines()[-1]))


@pytest.mark.timeout(600)
def test_64_ranks_on_two_nodes_land_every_point_and_end_every_run_finished(
        two_nodes: RayHead, mlflow_server: MlflowServer, tmp_path: Path) -> None:
    report = _report(_harness(two_nodes, mlflow_server, tmp_path, "--steps", "5"))

    assert report["nodes"] == 2 and report["dead_hosts"] == []
    assert report["logged_points"] == 64 * 10 * 5
    assert report["landed_points"] == report["logged_points"]
    assert report["keys_with_holes"] == 0
    assert report["participants_at_load_end"] == {k: 16 for k in report["run_status"]}
    assert report["false_dropped_ranks"] == 0 and report["false_killed_runs"] == 0
    assert set(report["run_status"].values()) == {"FINISHED"}


@pytest.mark.timeout(600)
def test_a_node_removed_while_its_ranks_log_loses_only_their_unsent_tail_and_its_runs_end_killed(
        two_nodes: RayHead, mlflow_server: MlflowServer, tmp_path: Path) -> None:
    proc = _harness(two_nodes, mlflow_server, tmp_path, "--until-stopped")
    try:
        line = read_line_with(proc, "logging ")
        on_head = json.loads(line)["hosts_on_head"]
        two_nodes.remove_worker_nodes()  # `ray stop` of that node, while its ranks log
        assert proc.stdin is not None
        proc.stdin.write("stop\n")
        proc.stdin.flush()
        report = _report(proc)
    finally:
        proc.kill()

    dead = sorted(set(range(4)) - set(on_head))
    assert report["dead_hosts"] == dead and len(dead) == 2
    # Every logged point of every rank either landed or went down with its process: the
    # landed ones are each key's first steps (no gap), the rest is the dead ranks' tail.
    assert report["keys_with_holes"] == 0
    assert report["landed_points"] + report["lost_with_process_points"] == (
        report["logged_points"])
    assert report["dead_runs"] == report["dead_runs_killed"] == 2
    assert report["false_killed_runs"] == 0 and report["false_dropped_ranks"] == 0
