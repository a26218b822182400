"""The plugin's registry default: with a ``raydeck+`` URI as the process's tracking URI and no
registry URI set, the plugin sets MLflow's registry URI (to the tracking URI, whose registry is
the backend's), so MLflow's fluent API stops looking for a Spark session on every call; a
registry URI the user set wins.

Each case is a separate Python driver (the registry URI is per process), as a user's script
runs; registry writes are read back from the session's MLflow server or the user's registry.
"""

from __future__ import annotations

import uuid
from pathlib import Path
from typing import Any

import pytest

from tests.fixtures.mlflow_server import MlflowServer
from tests.fixtures.tracking import driver_process, read_line_with

STEPS = 20

# Counts the imports of ``pyspark`` the process attempts (it is not installed: each attempt is
# MLflow's per-call probe for a Spark session, what made plain MLflow code slow). A finder that
# only looks: it finds nothing, so the import fails as it would without it.
LOOKUP_COUNTER = """
    import sys

    class PysparkLookups:
        count = 0

        @classmethod
        def find_spec(cls, name, path=None, target=None):
            if name.split(".")[0] == "pyspark":
                cls.count += 1
            return None

    sys.meta_path.insert(0, PysparkLookups)
"""


def _registered(client: Any, name: str) -> list[str]:
    return [m.name for m in client.search_registered_models(filter_string=f"name='{name}'")]


@pytest.mark.timeout(120)
def test_the_plugin_defaults_the_registry_uri_to_its_backends_registry(
        ray_cluster: None, mlflow_server: MlflowServer, mlflow_client: Any) -> None:
    """A client with an explicit ``raydeck+`` URI sets nothing (the fluent API does not use
    it); once the process's tracking URI is that URI, starting a run sets the registry URI,
    the fluent loop looks for no Spark session, and the registry is the server's."""
    uri = f"raydeck+{mlflow_server.uri}"
    model = f"registry-default-{uuid.uuid4().hex[:6]}"
    proc = driver_process(LOOKUP_COUNTER + f"""
    import os
    import mlflow
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri="{uri}")
    client.set_terminated(client.create_run("0", run_name="explicit-client").info.run_id)
    print("EXPLICIT", os.environ.get("MLFLOW_REGISTRY_URI", "unset"), flush=True)

    mlflow.set_tracking_uri("{uri}")
    with mlflow.start_run(run_name="registry-default"):
        before = PysparkLookups.count
        for step in range({STEPS}):
            mlflow.log_metric("loss", step / 10, step=step)
        print("LOOKUPS", PysparkLookups.count - before, flush=True)
    print("REGISTRY", mlflow.get_registry_uri(), os.environ.get("MLFLOW_REGISTRY_URI"),
          flush=True)
    MlflowClient().create_registered_model("{model}")
    print("ENDED", flush=True)
    """)
    assert read_line_with(proc, "EXPLICIT") == "unset"
    assert read_line_with(proc, "LOOKUPS") == "0"
    # mlflow.set_registry_uri's effect: in this process and for the processes it starts.
    assert read_line_with(proc, "REGISTRY").split() == [uri, uri]
    read_line_with(proc, "ENDED")
    assert proc.wait(timeout=60) == 0
    assert _registered(mlflow_client, model) == [model]


@pytest.mark.timeout(120)
def test_a_registry_uri_the_user_set_wins_over_the_plugins_default(
        ray_cluster: None, mlflow_server: MlflowServer, mlflow_client: Any,
        tmp_path: Path) -> None:
    """``MLFLOW_REGISTRY_URI`` (a registry of its own, SQLite) and ``mlflow.set_registry_uri``
    before the run: the plugin keeps them, and registry calls go to the user's registry."""
    from mlflow.tracking import MlflowClient

    uri = f"raydeck+{mlflow_server.uri}"
    users_registry = f"sqlite:///{tmp_path / 'registry.db'}"
    model = f"users-registry-{uuid.uuid4().hex[:6]}"
    loop = f"""
    import mlflow
    from mlflow.tracking import MlflowClient

    {{set_in_code}}
    with mlflow.start_run(run_name="users-registry"):
        for step in range({STEPS}):
            mlflow.log_metric("loss", step / 10, step=step)
    print("REGISTRY", mlflow.get_registry_uri(), flush=True)
    {{register}}
    print("ENDED", flush=True)
    """
    by_env = driver_process(
        loop.format(set_in_code="", register=f'MlflowClient().create_registered_model("{model}")'),
        env={"MLFLOW_TRACKING_URI": uri, "MLFLOW_REGISTRY_URI": users_registry})
    by_code = driver_process(
        loop.format(set_in_code=f'mlflow.set_registry_uri("{mlflow_server.uri}")', register=""),
        env={"MLFLOW_TRACKING_URI": uri})
    assert read_line_with(by_env, "REGISTRY") == users_registry
    assert read_line_with(by_code, "REGISTRY") == mlflow_server.uri
    for proc in (by_env, by_code):
        read_line_with(proc, "ENDED")
        assert proc.wait(timeout=60) == 0
    assert _registered(MlflowClient(registry_uri=users_registry), model) == [model]
    assert _registered(mlflow_client, model) == []
