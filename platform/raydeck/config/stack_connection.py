"""The stack's connection file: how every raydeck process on this machine finds a running stack.

``raydeck up`` writes it once every service is healthy and ``raydeck down`` removes it. It lives
outside any project, at ``$RAYDECK_STACK_FILE`` (default ``$XDG_CONFIG_HOME/raydeck/stack.toml``,
that is ``~/.config/raydeck/stack.toml``), so a command run from any directory finds the stack.
``RAYDECK_STACK_FILE=`` (empty) ignores a running stack; the test suite sets it so.

What it holds (TOML, mode 0600, no secret):

- the settings that point raydeck at the stack, in ``raydeck.toml``'s shape (``data_dir``,
  ``ray_address``, ``[tracking]``, ``[storage]``). :func:`raydeck.config.settings.load_settings`
  reads them at the lowest precedence: environment variables and ``raydeck.toml`` win,
  ``RAY_ADDRESS`` in the environment wins over its ``ray_address`` and ``MLFLOW_TRACKING_URI``
  over its ``[tracking].uri``. The S3 secret is read from
  the stack's credentials file (0600), which the ``[stack]`` table names, never copied here.
- ``[stack]``: the state directory, the credentials and Ray token files, the job server and
  the URLs of the services (for ``raydeck submit``, the notebooks and ``raydeck ps``).

Ray's token is sent only to the stack's own cluster: :func:`ray_auth_env` and
:func:`token_for` answer only for the stack's GCS address and job server.
"""

from __future__ import annotations

import json
import os
import tomllib
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from raydeck._internal.atomic_file import atomic_write
from raydeck.config.secrets import Secret
from raydeck.config.stack_credentials import read as read_credentials
from raydeck.config.tracking_uri import unwrap_tracking_uri
from raydeck.errors import ConfigError, StackError

# MLflow's own variable: the tracking URI when raydeck's settings name none; it wins over
# the stack's [tracking].uri.
MLFLOW_TRACKING_URI_ENV = "MLFLOW_TRACKING_URI"
STACK_FILE_ENV = "RAYDECK_STACK_FILE"
FILE_NAME = "stack.toml"
FILE_MODE = 0o600
HEADER = ("# Written by `raydeck up`, removed by `raydeck down`: how raydeck on this machine "
          "reaches the stack.\n# Lowest precedence: environment variables and raydeck.toml "
          "win. No secrets here.\n")


def stack_file(env: Mapping[str, str] | None = None) -> Path | None:
    """Where the connection file is, or None when ``RAYDECK_STACK_FILE`` is set empty."""
    env = os.environ if env is None else env
    if STACK_FILE_ENV in env:
        value = env[STACK_FILE_ENV].strip()
        return Path(value).expanduser() if value else None
    base = env.get("XDG_CONFIG_HOME") or str(Path(env.get("HOME") or Path.home()) / ".config")
    return Path(base) / "raydeck" / FILE_NAME


@dataclass(frozen=True)
class StackConnection:
    """What the connection file says.

    Attributes:
        state_dir: the stack's directory (``<data_dir>/stack``).
        credentials_file: its credentials (0600), source of the S3 secret.
        ray_auth_token_file: Ray's token alone (``RAY_AUTH_TOKEN_PATH``).
        ray_address: the head's GCS address (``host:port``).
        job_server: the Ray dashboard and job server URL.
        urls: service name -> URL a person opens (mlflow, ray-dashboard, prometheus, jupyter,
            grafana).
        settings: raydeck settings in ``raydeck.toml``'s shape (no secret).
    """

    state_dir: Path
    credentials_file: Path
    ray_auth_token_file: Path
    ray_address: str
    job_server: str
    urls: dict[str, str] = field(default_factory=dict)
    settings: dict[str, Any] = field(default_factory=dict)

    def render(self) -> str:
        """The file's TOML text."""
        lines = [HEADER]
        tables: dict[str, dict[str, Any]] = {}
        for key, value in self.settings.items():
            if isinstance(value, dict):
                tables[key] = value
            else:
                lines.append(f"{key} = {_toml_value(value)}\n")
        for name, table in tables.items():
            lines.append(f"\n[{name}]\n")
            lines += [f"{key} = {_toml_value(value)}\n" for key, value in table.items()]
        lines.append("\n[stack]\n")
        for key, value in (("state_dir", self.state_dir),
                           ("credentials_file", self.credentials_file),
                           ("ray_auth_token_file", self.ray_auth_token_file),
                           ("ray_address", self.ray_address), ("job_server", self.job_server)):
            lines.append(f"{key} = {_toml_value(str(value))}\n")
        lines.append("\n[stack.urls]\n")
        lines += [f"{json.dumps(name)} = {_toml_value(url)}\n" for name, url in self.urls.items()]
        return "".join(lines)

    def write(self, path: Path) -> None:
        """Write the file atomically with mode 0600 (parents created)."""
        path.parent.mkdir(parents=True, exist_ok=True)
        with atomic_write(path, file_mode=FILE_MODE) as handle:
            handle.write(self.render())

    def s3_secret(self) -> Secret:
        """The S3 secret from the credentials file (empty if this process cannot read it)."""
        try:
            return read_credentials(self.credentials_file).s3_secret_access_key
        except StackError:
            return Secret()

    def ray_auth_token(self) -> Secret | None:
        """Ray's token, or None when the token file cannot be read."""
        try:
            return Secret(self.ray_auth_token_file.read_text().strip())
        except OSError:
            return None


def _toml_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return repr(value)
    # A JSON string is a valid TOML basic string (same escapes).
    return json.dumps(str(value))


def read(env: Mapping[str, str] | None = None) -> StackConnection | None:
    """The connection file's content, or None when there is none (or it is switched off).

    Raises:
        ConfigError: the file exists but is not a connection file raydeck wrote.
    """
    path = stack_file(env)
    if path is None or not path.is_file():
        return None
    try:
        with path.open("rb") as handle:
            document = tomllib.load(handle)
        stack = document.pop("stack")
        urls = stack.get("urls", {})
        return StackConnection(
            state_dir=Path(stack["state_dir"]),
            credentials_file=Path(stack["credentials_file"]),
            ray_auth_token_file=Path(stack["ray_auth_token_file"]),
            ray_address=str(stack["ray_address"]), job_server=str(stack["job_server"]),
            urls={str(k): str(v) for k, v in urls.items()}, settings=document,
        )
    except (OSError, tomllib.TOMLDecodeError, KeyError, TypeError, AttributeError) as exc:
        reason = exc.strerror if isinstance(exc, OSError) else f"{type(exc).__name__}: {exc}"
        raise ConfigError(
            f"{STACK_FILE_ENV} {path}: not a stack connection file ({reason}); `raydeck up` "
            f"rewrites it, `raydeck down` removes it, or set {STACK_FILE_ENV}= to ignore it"
        ) from None


def settings_document(env: Mapping[str, str] | None = None) -> dict[str, Any]:
    """The connection file's settings for :func:`raydeck.config.settings.load_settings` (lowest
    precedence), with the S3 secret from the credentials file; ``{}`` without a stack.

    ``ray_address`` is left out when ``RAY_ADDRESS`` is set: a process told where its cluster
    is (a Ray job's driver, a user's shell) keeps it. ``[tracking].uri`` is left out when
    ``MLFLOW_TRACKING_URI`` names a backend, for the same reason (MLflow's own variable); a
    bare ``raydeck://`` names none (it means raydeck's configured backend: this stack's).
    """
    env = os.environ if env is None else env
    connection = read(env)
    if connection is None:
        return {}
    document = {key: (dict(value) if isinstance(value, dict) else value)
                for key, value in connection.settings.items()}
    if env.get("RAY_ADDRESS"):
        document.pop("ray_address", None)
    named = unwrap_tracking_uri(env.get(MLFLOW_TRACKING_URI_ENV, "").strip())
    if named and isinstance(document.get("tracking"), dict):
        document["tracking"].pop("uri", None)
    secret = connection.s3_secret()
    if secret and "storage" in document:
        document["storage"]["secret_access_key"] = secret.reveal()
    return document


def ray_auth_env(address: str | None, env: Mapping[str, str] | None = None) -> dict[str, str]:
    """The variables that make Ray send the stack's token when connecting to ``address``.

    Empty unless ``address`` is the stack's GCS address and this process chose nothing itself
    (``RAY_AUTH_MODE``, ``RAY_AUTH_TOKEN`` and ``RAY_AUTH_TOKEN_PATH`` unset): Ray presents a
    token on an explicit address only with ``RAY_AUTH_MODE=token``.
    """
    env = os.environ if env is None else env
    if not address or any(env.get(name) for name in
                          ("RAY_AUTH_MODE", "RAY_AUTH_TOKEN", "RAY_AUTH_TOKEN_PATH")):
        return {}
    connection = read(env)
    if connection is None or address.removeprefix("ray://") != connection.ray_address:
        return {}
    return {"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN_PATH": str(connection.ray_auth_token_file)}


def job_server(env: Mapping[str, str] | None = None) -> str | None:
    """The stack's job server URL, if a stack is up."""
    connection = read(env)
    return connection.job_server if connection else None


def token_for(address: str, env: Mapping[str, str] | None = None) -> Secret | None:
    """The stack's Ray token if ``address`` is the stack's job server, else None."""
    connection = read(env)
    if connection is None or address.rstrip("/") != connection.job_server.rstrip("/"):
        return None
    return connection.ray_auth_token()
