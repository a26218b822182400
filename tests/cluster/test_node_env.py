"""The variables every Ray node raydeck starts carries (:mod:`raydeck.cluster.node_env`).

That Ray Client sessions opened at once all connect on a head started with them is
``test_ray_address_in_its_ray_client_form_reaches_the_heads_job_server``
(``tests/jobs/test_jobs.py``); that compose's, ``raydeck up``'s and the manifests' nodes carry
them is the stack's and ``tests/k8s``' tests of their variables.
"""

from __future__ import annotations

import os

import psutil
import pytest
import ray

from raydeck.cluster.connection import _failure_summary, local_node_variables
from raydeck.cluster.node_env import GRPC_FORK_SUPPORT_ENV, NODE_ENV, local_env


def test_a_value_the_user_set_wins_and_an_empty_one_does_not() -> None:
    assert local_env({}) == dict(NODE_ENV)
    assert local_env({GRPC_FORK_SUPPORT_ENV: "1"})[GRPC_FORK_SUPPORT_ENV] == "1"
    assert local_env({GRPC_FORK_SUPPORT_ENV: ""})[GRPC_FORK_SUPPORT_ENV] == "0"


def test_they_are_set_only_around_the_start_of_a_local_ray(monkeypatch: pytest.MonkeyPatch
                                                            ) -> None:
    monkeypatch.delenv(GRPC_FORK_SUPPORT_ENV, raising=False)
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    with local_node_variables("local"):
        assert os.environ[GRPC_FORK_SUPPORT_ENV] == "0"
    assert GRPC_FORK_SUPPORT_ENV not in os.environ
    with local_node_variables("10.0.0.1:6379"):  # a cluster of its own: its nodes' choice
        assert GRPC_FORK_SUPPORT_ENV not in os.environ


@ray.remote
def _worker_variable() -> str | None:
    return os.environ.get(GRPC_FORK_SUPPORT_ENV)


@pytest.mark.timeout(120)
def test_the_local_ray_raydeck_starts_runs_without_grpcs_fork_handlers(ray_cluster: None) -> None:
    """The session's Ray is started as raydeck starts its own (``starting_ray``): its raylet,
    GCS and workers, the processes that fork to start others, have gRPC's fork handlers off."""
    assert ray.get(_worker_variable.remote()) == "0"
    raylet = psutil.Process(ray.get(_raylet_pid.remote()))
    assert raylet.environ().get(GRPC_FORK_SUPPORT_ENV) == "0"


@ray.remote
def _raylet_pid() -> int:
    """The raylet that started this worker (its parent, or the parent of Ray's setup process)."""
    proc = psutil.Process()
    while proc.parent() is not None and proc.name() != "raylet":
        proc = proc.parent()
    return proc.pid


def test_a_failed_ray_client_session_says_the_servers_reason_and_the_fix() -> None:
    """What ``ray.init("ray://...")`` raised in the suite's one failure: the server's traceback
    under a heading; raydeck's one line is the heading, the traceback's last line and the fix."""
    raised = ConnectionAbortedError(
        "Initialization failure from server:\nTraceback (most recent call last):\n"
        '  File "proxier.py", line 770, in Datapath\n'
        "RuntimeError: Starting Ray client server failed. See ray_client_server_23001.err for "
        "detailed logs.\n")
    line = _failure_summary(raised)
    assert line.startswith("Initialization failure from server: RuntimeError: Starting Ray "
                           "client server failed. See ray_client_server_23001.err")
    assert f"{GRPC_FORK_SUPPORT_ENV}=0" in line and "docs/deployment.md" in line
    assert _failure_summary(ConnectionError("Could not connect\nmore")) == "Could not connect"
