"""Credentials in raydeck's Kubernetes manifests: each one lives in a Secret and reaches a pod
by ``secretKeyRef`` or as a mounted file, never as a value in any other object.

Two Secrets are involved:

- the credentials Secret (``--secret``), created by the user with ``kubectl create secret
  generic --from-env-file`` from the stack's credentials file: Ray's token (mounted as a file),
  the S3 keys, and, when MLflow or the queue's PostgreSQL need them, ``MLFLOW_TRACKING_TOKEN``,
  ``MLFLOW_TRACKING_USERNAME``/``_PASSWORD`` and ``POSTGRES_PASSWORD`` (referenced as
  optional keys: a Secret without them leaves the variable unset);
- the URI credentials Secret, rendered only when a URI given on the command line carries a
  credential (``--tracking-uri https://user:password@...``, ``--queue-database-url
  postgresql://user:password@...``): the URI is split into the URI without its password,
  written as a value, and the credential, written into this Secret, which the pods reference.
  MLflow's client reads ``MLFLOW_TRACKING_USERNAME``/``_PASSWORD``; libpq (the queue's
  psycopg) reads ``PGPASSWORD``.

Owns: splitting a credentialed URI, the pods' credential variables and the rendered Secret.
Does not own: the credentials Secret's values (never read here).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import parse_qsl, unquote, urlsplit, urlunsplit

from raydeck.config.secrets import Secret
from raydeck.errors import ConfigError

# Ray's token, mounted from the credentials Secret's RAY_AUTH_TOKEN key.
TOKEN_KEY = "RAY_AUTH_TOKEN"
TOKEN_DIR = "/etc/raydeck/ray-auth"
TOKEN_FILE = "token"
TOKEN_MOUNT = {"name": "ray-auth", "mountPath": TOKEN_DIR, "readOnly": True}
# Ray's images run as user ray in group users (100): with the pods' fsGroup, the token file is
# readable by that group only (0440).
TOKEN_FILE_MODE = 0o440
# MLflow's client reads these (mlflow.environment_variables); raydeck passes them through.
MLFLOW_USERNAME = "MLFLOW_TRACKING_USERNAME"
MLFLOW_PASSWORD = "MLFLOW_TRACKING_PASSWORD"
MLFLOW_TOKEN = "MLFLOW_TRACKING_TOKEN"
MLFLOW_ENV = (MLFLOW_USERNAME, MLFLOW_PASSWORD, MLFLOW_TOKEN)
# The queue's database on the head (raydeck.scheduling.queue.actor.DATABASE_URL_ENV; a test
# checks the two agree) and libpq's password variable, filled from the Secret's key named as
# in the stack's credentials file.
QUEUE_DATABASE_ENV = "RAYDECK_QUEUE_DATABASE_URL"
PG_PASSWORD_ENV = "PGPASSWORD"
POSTGRES_PASSWORD_KEY = "POSTGRES_PASSWORD"
URI_SECRET_SUFFIX = "-uri-credentials"


@dataclass(frozen=True)
class SplitUri:
    """A URI as the pods get it (no password in it) and the credentials taken out of it."""

    uri: str
    username: str = ""
    password: Secret = field(default_factory=Secret)


def split_credentials(uri: str, option: str, *, keep_username: bool) -> SplitUri:
    """``uri`` without its credentials, and the credentials.

    Args:
        option: the CLI option that gave ``uri`` (named in errors).
        keep_username: leave the user name in the URI (PostgreSQL's: not a secret, and libpq
            takes only the password from its variable); otherwise it is taken out too (MLflow
            reads both from variables).

    Raises:
        ConfigError: a user name without a password where the user is taken out (MLflow's
            basic auth needs both), or a
            password in the query string (``?password=``, ``?token=``...), which would stay
            in a manifest.
    """
    parts = urlsplit(uri)
    for name, _ in parse_qsl(parts.query, keep_blank_values=True):
        if re.search(r"pass|secret|token|key", name, re.IGNORECASE):
            raise ConfigError(f"{option}: its query parameter {name!r} would be written into "
                              "every pod; give the credential as user:password@ in the URI or "
                              "in the credentials Secret instead")
    if parts.username is None or (keep_username and not parts.password):
        return SplitUri(uri)
    if not parts.password:
        raise ConfigError(f"{option}: a user name without a password; give user:password@, or "
                          f"leave the user out and put {MLFLOW_TOKEN} (MLflow) or "
                          f"{POSTGRES_PASSWORD_KEY} (PostgreSQL) in the credentials Secret")
    host = parts.hostname or ""
    if ":" in host:  # an IPv6 literal
        host = f"[{host}]"
    netloc = host + (f":{parts.port}" if parts.port else "")
    if keep_username:
        netloc = f"{parts.username}@{netloc}"
    return SplitUri(urlunsplit(parts._replace(netloc=netloc)), unquote(parts.username),
                    Secret(unquote(parts.password)))


@dataclass(frozen=True)
class Credentials:
    """Where each credential of the pods comes from.

    Attributes:
        secret: the credentials Secret (``--secret``).
        tracking: ``--tracking-uri`` split; its user and password, if any, go into the URI
            credentials Secret.
        queue_database: ``--queue-database-url`` split (empty: the queue uses SQLite).
        uri_secret: the URI credentials Secret's name.
    """

    secret: str
    tracking: SplitUri
    queue_database: SplitUri
    uri_secret: str

    @property
    def rendered(self) -> dict[str, Secret]:
        """The URI credentials Secret's keys and values; empty: no such Secret."""
        values: dict[str, Secret] = {}
        if self.tracking.password:
            values[MLFLOW_USERNAME] = Secret(self.tracking.username)
            values[MLFLOW_PASSWORD] = self.tracking.password
        if self.queue_database.password:
            values[PG_PASSWORD_ENV] = self.queue_database.password
        return values


def _ref(name: str, secret: str, key: str, optional: bool = False) -> dict[str, Any]:
    selector: dict[str, Any] = {"name": secret, "key": key}
    if optional:
        selector["optional"] = True
    return {"name": name, "valueFrom": {"secretKeyRef": selector}}


def credential_env(credentials: Credentials, secret_settings: tuple[str, ...], *,
                   head: bool) -> list[dict[str, Any]]:
    """The credential variables of a Ray container: raydeck's secret settings (the S3 keys),
    MLflow's, and on the head the queue's database password; each a ``secretKeyRef``."""
    secret, rendered = credentials.secret, credentials.rendered
    env = [_ref(name, secret, name) for name in secret_settings]
    for name in MLFLOW_ENV:
        env.append(_ref(name, credentials.uri_secret, name) if name in rendered
                   else _ref(name, secret, name, optional=True))
    if head and credentials.queue_database.uri:
        env.append({"name": QUEUE_DATABASE_ENV, "value": credentials.queue_database.uri})
        env.append(_ref(PG_PASSWORD_ENV, credentials.uri_secret, PG_PASSWORD_ENV)
                    if PG_PASSWORD_ENV in rendered
                    else _ref(PG_PASSWORD_ENV, secret, POSTGRES_PASSWORD_KEY, optional=True))
    return env


def token_volume(secret: str) -> dict[str, Any]:
    """Ray's shared token as a file, readable by Ray's group only."""
    return {"name": TOKEN_MOUNT["name"], "secret": {
        "secretName": secret, "defaultMode": TOKEN_FILE_MODE,
        "items": [{"key": TOKEN_KEY, "path": TOKEN_FILE}]}}


def uri_secret(credentials: Credentials, labels: dict[str, str],
               namespace: str = "") -> dict[str, Any] | None:
    """The URI credentials Secret, or None when no URI carried a credential. The only object
    raydeck renders with a credential in it: its file is written readable by its owner only."""
    values = credentials.rendered
    if not values:
        return None
    metadata: dict[str, Any] = {"name": credentials.uri_secret, "labels": dict(labels)}
    if namespace:
        metadata["namespace"] = namespace
    return {"apiVersion": "v1", "kind": "Secret", "metadata": metadata, "type": "Opaque",
            "stringData": {key: value.reveal() for key, value in values.items()}}
