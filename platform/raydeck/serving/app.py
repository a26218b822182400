"""``raydeck serve``'s applications: the Serve application and its life on a cluster.

Owns: :func:`build_app` (one deployment of
:class:`~raydeck.serving.server.ModelServer` sized by a scaling preset or Serve's autoscaling),
:func:`deploy`, :func:`status`, :func:`stop`, and :func:`serve_config`, the Serve config file for
``serve deploy`` on a cluster (its ``import_path`` is :func:`app_builder`). A model URI that does
not exist fails in :func:`deploy` before anything reaches the cluster.

Secrets: the tracking URI and storage credentials reach replicas as the deployment's pickled
constructor arguments (held by Serve's controller, never in a runtime env, the dashboard or a
log). A written config file carries neither: replicas started by ``serve deploy`` read raydeck's
settings (``RAYDECK_TRACKING_URI``, S3 credentials) from their node's environment, as Ray Train
workers do.
"""

from __future__ import annotations

import logging
from dataclasses import asdict
from typing import TYPE_CHECKING, Any

from raydeck.errors import ConfigError
from raydeck.serving.options import ServeOptions

if TYPE_CHECKING:
    from raydeck.config import Settings
    from raydeck.models import ModelRef

logger = logging.getLogger(__name__)

DEPLOYMENT_NAME = "ModelServer"
IMPORT_PATH = "raydeck.serving.app:app_builder"
APP_TAG = "raydeck-serve"


def build_app(options: ServeOptions, settings: Settings) -> Any:
    """The Serve application: one :class:`ModelServer` deployment bound to ``options``."""
    # Deferred for start-up time: the server module imports Ray Serve and numpy, which the CLI
    # and `serve_config` never need.
    from ray import serve

    from raydeck.serving.server import ModelServer

    deployment: Any = serve.deployment(ModelServer, name=DEPLOYMENT_NAME)
    return deployment.options(**options.deployment_options(settings)).bind(options, settings)


def app_builder(args: dict[str, Any]) -> Any:
    """Serve's application builder for ``serve deploy`` (the config's ``import_path``).

    ``args`` are :class:`ServeOptions` fields; settings (tracking URI, credentials) come from
    the replica node's environment.
    """
    from raydeck.config import load_settings

    return build_app(ServeOptions(**args), load_settings())


def deploy(options: ServeOptions, settings: Settings) -> ModelRef:
    """Check the model exists, then deploy it and wait until every replica serves it.

    Returns:
        The version the alias (or URI) names now.

    Raises:
        ConfigError: the model URI does not exist (nothing is deployed), or the preset is
            unknown.
    """
    from ray import serve

    from raydeck.cluster import connect
    from raydeck.models import resolve_model_uri

    ref = resolve_model_uri(options.model_uri, settings.tracking.uri)
    options.deployment_options(settings)  # the preset exists
    connect(settings, log_to_driver=False)
    serve.start(http_options={"host": options.host, "port": options.port})
    serve.run(build_app(options, settings), name=options.name,
              route_prefix=options.route_prefix)
    return ref


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
    """Delete one application (or, without a name, all of them); returns the names deleted."""
    from ray import serve

    names = list(serve.status().applications)
    if name is not None:
        if name not in names:
            raise ConfigError(f"no Serve application named {name!r}; running: "
                              f"{', '.join(names) or 'none'}")
        names = [name]
    for each in names:
        serve.delete(each)
    return names


def serve_config(options: ServeOptions, settings: Settings) -> dict[str, Any]:
    """A Serve config for ``serve deploy``: the same application, sized the same way.

    The cluster's image must have raydeck installed (docker/ does), and its nodes raydeck's
    settings in their environment; no secret is written.
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
