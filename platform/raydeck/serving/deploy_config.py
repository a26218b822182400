"""Ray Serve's declarative config of a cluster, as raydeck changes one application in it.

Owns: :func:`with_application`, the whole config to send Serve (``PUT
/api/serve/applications/``, or the controller's ``apply_config`` that call makes) when one
application is added or changed. Serve's declarative API takes the cluster's every
config-deployed application at once and deletes those a config leaves out, so a change to one
is the config deployed now (``deployed_app_config`` of each application whose ``source`` is
``declarative``, in Serve's details) with that one replaced, every other entry as it was and in
its order (Serve's code version of an application hashes its entries: a reordered or rewritten
one would restart its replicas). Applications deployed with ``serve.run`` are not part of it
and are left as they are.

Used by ``raydeck serve``'s deploy (:mod:`raydeck.serving.app`) and by the queue when it moves a
deployment's ``max_replicas`` (:mod:`raydeck.scheduling.queue.serve_apps`). Two writers changing the
config at the same moment each send what they read: the later one wins, as for two ``serve
deploy`` calls.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

DECLARATIVE = "declarative"
# Cluster-wide keys of Serve's details that a config carries back unchanged.
_CLUSTER_KEYS = ("proxy_location", "http_options", "grpc_options", "target_capacity")


def deployed_config(details: Mapping[str, Any], name: str) -> dict[str, Any] | None:
    """The config application ``name`` was deployed with, or None: none of that name, or one
    deployed with ``serve.run`` (which has no config)."""
    app = (details.get("applications") or {}).get(name) or {}
    config = app.get("deployed_app_config")
    return dict(config) if app.get("source") == DECLARATIVE and config else None


def with_application(details: Mapping[str, Any], config: Mapping[str, Any]) -> dict[str, Any]:
    """The config deployed now (Serve's ``details``, ``GET /api/serve/applications/``) with
    application ``config`` in place of the one of its name, or added after the others."""
    configs = []
    for name in details.get("applications") or {}:
        deployed = deployed_config(details, name)
        if deployed is not None:
            configs.append(dict(config) if name == config["name"] else deployed)
    if not any(each["name"] == config["name"] for each in configs):
        configs.append(dict(config))
    return {"applications": configs,
            **{key: details[key] for key in _CLUSTER_KEYS if details.get(key) is not None}}
