"""``raydeck serve``'s applications: the Serve application and its life on a cluster.

Owns: :func:`build_app` (one deployment of
:class:`~raydeck.serving.server.ModelServer`, sized by its config's entry from a scaling preset
or Serve's autoscaling),
:func:`deploy`, :func:`status`, :func:`stop`, and :func:`serve_config`, the Serve config file for
``serve deploy`` on a cluster (its ``import_path`` is :func:`app_builder`). A model URI that does
not exist fails in :func:`deploy` before anything reaches the cluster.

Deployed from a config: :func:`deploy` sends Serve the same config :func:`serve_config` writes
(Serve's declarative API, as ``serve deploy`` does), added to the cluster's other
config-deployed applications (:func:`raydeck.serving.deploy_config.with_application`). So an
application with ``--autoscale`` has an ``autoscaling_config`` in its config, which the queue
can send back with a lower ``max_replicas`` in place (:mod:`raydeck.scheduling.queue.serve_apps`);
one deployed with ``serve.run`` has none that could change without rebuilding it.

Secrets: the tracking URI and storage credentials reach replicas as the deployment's pickled
constructor arguments, never in a runtime env, the config, the dashboard or a log. The settings
:func:`deploy` was given are kept, pickled, in Ray's KV under a key the config names
(``serve-settings:<app>:<random id>``: the same settings keep their key, new settings get a
new one, which is new code to Serve and rebuilds the replicas; no digest of a secret is
shown); :func:`app_builder` reads them there. That is where
Serve's own controller keeps the pickled constructor arguments of every deployment, so it shows
the credentials to nobody the cluster did not already. A config file written for ``serve
deploy`` names no key: replicas started from it read raydeck's settings
(``RAYDECK_TRACKING_URI``, S3 credentials) from their node's environment, as Ray Train workers
do.
"""

from __future__ import annotations

import logging
import pickle
import time
import uuid
from dataclasses import asdict
from typing import TYPE_CHECKING, Any

from raydeck._internal.contract import KV_NAMESPACE
from raydeck._internal.redaction import redact_text
from raydeck.errors import ConfigError
from raydeck.serving.deploy_config import deployed_config, with_application
from raydeck.serving.options import ServeOptions

if TYPE_CHECKING:
    from raydeck.config.settings import Settings
    from raydeck.models import ModelRef

logger = logging.getLogger(__name__)

DEPLOYMENT_NAME = "ModelServer"
IMPORT_PATH = "raydeck.serving.app:app_builder"
APP_TAG = "raydeck-serve"
SETTINGS_KEY = "serve-settings:"
# The config's argument that names the settings' key (absent from a written config file).
SETTINGS_ARG = "settings_key"
# How often a deploy asks Serve whether its application runs.
DEPLOY_POLL_S = 0.5


def build_app(options: ServeOptions, settings: Settings) -> Any:
    """The Serve application: one :class:`ModelServer` deployment bound to ``options``.

    Sized by its config: the deployment's entry in :func:`serve_config` (replicas, resources,
    autoscaling, batching) is what Serve applies over the code's defaults, so building it reads
    no preset file (a client's presets file is not on the cluster's nodes).
    """
    # Deferred for start-up time: the server module imports Ray Serve and numpy, which the CLI
    # and `serve_config` never need.
    from ray import serve

    from raydeck.serving.server import ModelServer

    deployment: Any = serve.deployment(ModelServer, name=DEPLOYMENT_NAME)
    return deployment.bind(options, settings)


def app_builder(args: dict[str, Any]) -> Any:
    """Serve's application builder (the config's ``import_path``).

    ``args`` are :class:`ServeOptions` fields, and from :func:`deploy` the KV key of the
    settings it was given; without one (``serve deploy`` of a written config), settings come
    from the replica node's environment.

    Raises:
        ConfigError: the settings the key names are gone (the cluster's KV was lost): deploy
            again.
    """
    from raydeck.config.settings import load_settings

    args = dict(args)
    key = args.pop(SETTINGS_ARG, None)
    return build_app(ServeOptions(**args), _stored_settings(key) if key else load_settings())


def deploy(options: ServeOptions, settings: Settings) -> ModelRef:
    """Check the model exists, then deploy it from a config and wait until it serves.

    Returns once Serve reports the application running with none of the replicas it replaces
    left (a new application, or new code: every replica is new; the same config again is
    applied in place and keeps them).

    Returns:
        The version the alias (or URI) names now.

    Raises:
        ConfigError: the model URI does not exist (nothing is deployed), the preset is
            unknown, or Serve could not deploy the application (its reason, redacted).
    """
    from ray import serve
    from ray.serve.context import _get_global_client
    from ray.serve.schema import ServeDeploySchema

    from raydeck.cluster.connection import connect
    from raydeck.models import resolve_model_uri
    from raydeck.storage import credentials_in_env

    with credentials_in_env(settings.storage):
        ref = resolve_model_uri(options.model_uri, settings.tracking.uri)
    # An unknown preset fails here, before anything reaches Ray.
    (application,) = serve_config(options, settings)["applications"]
    connect(settings, log_to_driver=False)
    serve.start(http_options={"host": options.host, "port": options.port})
    client = _get_global_client()
    assert client is not None, "serve.start() made Serve's client"
    key = application["args"][SETTINGS_ARG] = _store_settings(options.name, settings)
    details = client.get_serve_details()
    replaced = _replaced(details, application)
    client.deploy_apps(ServeDeploySchema.model_validate(with_application(details, application)))
    _wait_running(client, options.name, replaced)
    _drop_settings(options.name, keep=key)
    return ref


def _store_settings(app: str, settings: Settings) -> str:
    """The KV key of ``settings`` for ``app``: the one they are stored under already, or a new
    one."""
    from ray.experimental.internal_kv import (
        _internal_kv_get,
        _internal_kv_list,
        _internal_kv_put,
    )

    stored = pickle.dumps(settings)
    for found in _internal_kv_list(f"{SETTINGS_KEY}{app}:", namespace=KV_NAMESPACE):
        if _internal_kv_get(found, namespace=KV_NAMESPACE) == stored:
            return found.decode() if isinstance(found, bytes) else str(found)
    key = f"{SETTINGS_KEY}{app}:{uuid.uuid4().hex[:16]}"
    _internal_kv_put(key, stored, overwrite=True, namespace=KV_NAMESPACE)
    return key


def _stored_settings(key: str) -> Settings:
    from ray.experimental.internal_kv import _internal_kv_get

    stored = _internal_kv_get(key, namespace=KV_NAMESPACE)
    if stored is None:
        raise ConfigError(f"the settings this application was deployed with ({key}) are no "
                          "longer in the cluster's KV; deploy it again with `raydeck serve`")
    settings: Settings = pickle.loads(stored)
    return settings


def _drop_settings(app: str, keep: str | None = None) -> None:
    """Delete the stored settings of ``app`` other than ``keep``."""
    from ray.experimental.internal_kv import _internal_kv_del, _internal_kv_list

    for key in _internal_kv_list(f"{SETTINGS_KEY}{app}:", namespace=KV_NAMESPACE):
        name = key.decode() if isinstance(key, bytes) else key
        if name != keep:
            _internal_kv_del(name, namespace=KV_NAMESPACE)


def _replaced(details: dict[str, Any], config: dict[str, Any]) -> set[str]:
    """The replicas a deploy of ``config`` replaces: every live one of the application when its
    code changes (Serve's code version: import path, args, runtime env), none when the same
    code is applied in place."""
    from ray.serve._private.deploy_utils import get_app_code_version
    from ray.serve.schema import ServeApplicationSchema

    app = (details.get("applications") or {}).get(config["name"])
    if app is None:
        return set()
    deployed = deployed_config(details, config["name"])
    if deployed is not None and get_app_code_version(
            ServeApplicationSchema.model_validate(deployed)) == get_app_code_version(
            ServeApplicationSchema.model_validate(config)):
        return set()
    return _replica_ids(app)


def _replica_ids(app: dict[str, Any]) -> set[str]:
    """Every replica of application ``app`` (Serve's details of it), whatever its state."""
    return {replica["replica_id"] for deployment in (app.get("deployments") or {}).values()
            for replica in deployment.get("replicas") or []}


def _wait_running(client: Any, name: str, replaced: set[str]) -> None:
    """Until Serve reports ``name`` running on replicas none of which is in ``replaced``."""
    while True:
        app = (client.get_serve_details().get("applications") or {}).get(name) or {}
        if app.get("status") == "DEPLOY_FAILED":
            raise ConfigError(f"Serve could not deploy application {name!r}: "
                              f"{redact_text(str(app.get('message', ''))).strip()}")
        replicas = _replica_ids(app)
        if app.get("status") == "RUNNING" and replicas and not replicas & replaced:
            return
        time.sleep(DEPLOY_POLL_S)


def status() -> list[dict[str, Any]]:
    """Every Serve application of the cluster: its state and what each replica serves."""
    from ray import serve

    rows = []
    for name, app in serve.status().applications.items():
        row: dict[str, Any] = {"name": name, "status": str(app.status.value)}
        deployment = app.deployments.get(DEPLOYMENT_NAME)
        if deployment is not None:
            row["replicas"] = dict(deployment.replica_states)
            try:
                row.update(serve.get_app_handle(name).describe.remote().result(
                    timeout_s=10))
            except Exception as exc:
                row["error"] = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        rows.append(row)
    return rows


def stop(name: str | None) -> list[str]:
    """Delete one application (or, without a name, all of them); returns the names deleted.

    When nothing would be left serving, Serve itself shuts down: its controller, proxies and
    the HAProxy listener go with the last application, in seconds. Deleting that application
    alone would wait out its replicas' draining period (30 s under HAProxy, so that the ingress
    stops sending to a replica before it stops) for an ingress nobody uses, and HAProxy kept
    answering 404 on the port until the cluster stopped. With other applications still
    serving, only the one is deleted, and that wait is what keeps their ingress correct.
    """
    from ray import serve

    running = list(serve.status().applications)
    names = running
    if name is not None:
        if name not in running:
            raise ConfigError(f"no Serve application named {name!r}; running: "
                              f"{', '.join(running) or 'none'}")
        names = [name]
    if names and set(names) == set(running):
        serve.shutdown()
    else:
        for each in names:
            serve.delete(each)
    for each in names:
        _drop_settings(each)
    return names


def serve_config(options: ServeOptions, settings: Settings) -> dict[str, Any]:
    """A Serve config for ``serve deploy``: the same application, sized the same way.

    The cluster's image must have raydeck installed (docker/ does), and its nodes raydeck's
    settings in their environment; no secret is written (:func:`deploy` adds the KV key of the
    settings it stores instead).
    """
    args = {k: v for k, v in asdict(options).items() if k not in ("host", "port")}
    deployment = {"name": DEPLOYMENT_NAME, **options.deployment_options(settings)}
    return {
        "proxy_location": "EveryNode",
        "http_options": {"host": options.host, "port": options.port},
        "applications": [{
            "name": options.name, "route_prefix": options.route_prefix,
            "import_path": IMPORT_PATH, "args": args, "deployments": [deployment],
        }],
    }
