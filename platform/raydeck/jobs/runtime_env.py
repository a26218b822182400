"""A job's runtime env files (``runtime_envs/*.yaml``), ready to submit from this machine.

Owns: :func:`load_runtime_env` (reading a file, filling in ``${NAME}`` values from the
submitting environment, never secrets, and making paths absolute) and
:func:`check_runtime_env` (rejecting a runtime env that writes a secret's value instead of
referencing it). Ray fills in ``${NAME}`` on each node from the environment ``ray start`` ran
with; raydeck fills them from the *submitting* environment instead, except secrets, which stay
``${NAME}`` for the cluster to fill: a secret's value never travels with the job, whose runtime
env Ray's agent logs and its dashboard shows.
"""

from __future__ import annotations

import logging
import os
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from raydeck._internal.redaction import is_secret_name, redact_text
from raydeck.config.settings import TrackingSettings
from raydeck.config.stack_connection import MLFLOW_TRACKING_URI_ENV
from raydeck.config.tracking_uri import unwrap_tracking_uri
from raydeck.errors import ConfigError

logger = logging.getLogger(__name__)

PLACEHOLDER = re.compile(r"\$\{([A-Za-z_][A-Za-z0-9_]*)\}")
SETTINGS_PREFIX = "RAYDECK_"
# Read by raydeck when its own tracking URI is not set (MLflow's convention).
FORWARDED_VARIABLES = frozenset({"MLFLOW_TRACKING_URI"})
# Settings that describe the submitting process, not the job: how it reaches the cluster, its
# `raydeck up` connection file, its presets file (a local path; the job gets its preset by
# name, RAYDECK_PRESET, resolved where the cluster's nodes read their own presets), and the
# queue's id of the job it runs in and the workers it allows it, when a job submits another.
SUBMITTER_ONLY = frozenset({"RAYDECK_RAY_ADDRESS", "RAYDECK_STACK_FILE", "RAYDECK_PRESETS_FILE",
                            "RAYDECK_QUEUE_JOB", "RAYDECK_QUEUE_WORKERS"})


def _references_secret(value: str) -> bool:
    return any(is_secret_name(name) for name in PLACEHOLDER.findall(value))


def _holds_credentials(value: str) -> bool:
    """Whether ``value`` carries a credential (URL user-info, ``token=...``) in its text."""
    return redact_text(value, ()) != value


def check_runtime_env(runtime_env: Mapping[str, Any], source: str) -> None:
    """Reject a runtime env that writes a secret's value instead of referencing it.

    Secret: a secret-named variable (:func:`raydeck._internal.redaction.is_secret_name`) holding
    anything but a ``${NAME}`` reference, or any variable whose value carries credentials (a URL
    with user-info, such as a tracking URI with user:password).

    Raises:
        ConfigError: a variable holds a secret; the message names it, never the value.
    """
    for name, raw in dict(runtime_env.get("env_vars") or {}).items():
        value = str(raw)
        if PLACEHOLDER.fullmatch(value) is None and (
                is_secret_name(str(name)) or _holds_credentials(value)):
            raise ConfigError(
                f"{source}: env_vars.{name} holds a value; a secret may only be referenced as "
                f"${{{name}}} so it stays out of files and job metadata"
            )


def load_runtime_env(path: str | Path, env: Mapping[str, str] | None = None,
                     working_dir: str | Path | None = None, fill: bool = True
                     ) -> dict[str, Any]:
    """A runtime env file, ready to submit from this machine.

    ``${NAME}`` in ``env_vars`` values is filled in from ``env`` (default ``os.environ``;
    ``${RAYDECK_TRACKING_URI}`` from ``MLFLOW_TRACKING_URI`` when only that is set); a
    value that is empty once filled is left out, so the cluster's own environment (or raydeck's
    default) applies. With ``fill=False`` every value stays as written and Ray fills it in on
    each node, as plain ``ray job submit`` does (for clusters that see services under other
    names than the submitting machine does, e.g. Docker Compose). Values referencing a secret
    (``RAYDECK_S3_SECRET_ACCESS_KEY``, ...) are always kept as written: Ray fills them in on
    each node, so the secret never leaves the cluster. So are values whose filled-in text would
    carry credentials (``RAYDECK_TRACKING_URI=http://user:password@...``), with a warning: the
    cluster's nodes need that variable in the environment of ``ray start``.
    ``working_dir`` and ``py_modules`` paths are made absolute (relative to ``working_dir``,
    default the current directory), as ``ray job submit`` resolves them, and ``${PWD}`` is that
    directory.

    Raises:
        ConfigError: the file is missing, is not a YAML mapping, or writes a secret's value.
    """
    import yaml

    path = Path(path)
    env = os.environ if env is None else env
    try:
        document = yaml.safe_load(path.read_text())
    except OSError as exc:
        raise ConfigError(f"runtime env {str(path)!r}: cannot be read ({exc.strerror})") from None
    except yaml.YAMLError as exc:
        raise ConfigError(f"runtime env {path}: not valid YAML ({exc})") from None
    if not isinstance(document, dict):
        raise ConfigError(f"runtime env {path}: expected a mapping (working_dir, env_vars, ...)")
    check_runtime_env(document, str(path))
    base = Path(working_dir or ".").resolve()
    runtime_env = dict(document)
    if "working_dir" in runtime_env and "://" not in str(runtime_env["working_dir"]):
        runtime_env["working_dir"] = str((base / str(runtime_env["working_dir"])).resolve())
    if runtime_env.get("py_modules"):
        runtime_env["py_modules"] = [
            module if "://" in str(module) else str((base / str(module)).resolve())
            for module in runtime_env["py_modules"]
        ]
    # ${PWD} means the directory the submission is made from (a shell's PWD may be stale).
    values = {**env, "PWD": str(base)}
    # MLflow's own variable names the tracking server when raydeck's is not set (the settings'
    # precedence), so the job logs where the submitting shell points, which is also where
    # `raydeck submit` looks its run up, not where the head's environment happens to point.
    tracking_env = TrackingSettings.env_name("uri")
    # A raydeck+<backend> URI (the MLflow plugin's) names its backend; raydeck:// names none.
    if not values.get(tracking_env, "").strip() and values.get(MLFLOW_TRACKING_URI_ENV, "").strip():
        values[tracking_env] = unwrap_tracking_uri(values[MLFLOW_TRACKING_URI_ENV].strip())
    env_vars: dict[str, str] = {}
    for name, raw in dict(runtime_env.get("env_vars") or {}).items():
        value = str(raw)
        if not fill or _references_secret(value):
            env_vars[str(name)] = value
            continue
        filled = PLACEHOLDER.sub(lambda match: values.get(match.group(1), ""), value)
        if _holds_credentials(filled):
            logger.warning(
                "%s holds credentials, so it is left as %s for the cluster's nodes to fill in "
                "from the environment of `ray start` (Ray logs runtime envs)", name, value)
            env_vars[str(name)] = value
        elif filled:
            env_vars[str(name)] = filled
    runtime_env["env_vars"] = env_vars
    return runtime_env


def shell_settings(env: Mapping[str, str] | None = None) -> dict[str, str]:
    """raydeck's settings set where a job is submitted, for the job's ``env_vars``: every
    non-empty ``RAYDECK_*`` variable and ``MLFLOW_TRACKING_URI``, so the job logs to the
    experiment, mode and bucket the submitting shell names (and ``raydeck submit`` finds its run
    where it logged). A runtime env file's own ``env_vars`` win over these.

    Left out: secrets (secret-named variables, and values that carry credentials such as a
    tracking URI with user:password), which a job reads from the cluster's environment only
    (docs/secrets.md), and :data:`SUBMITTER_ONLY`.
    """
    env = os.environ if env is None else env
    return {name: value for name, value in env.items()
            if value and (name.startswith(SETTINGS_PREFIX) or name in FORWARDED_VARIABLES)
            and name not in SUBMITTER_ONLY and not is_secret_name(name)
            and not _holds_credentials(value)}
