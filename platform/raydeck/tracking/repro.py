"""What a run records about how it was produced, so it can be reproduced.

On creating a run, the tracker records the git commit and dirty flag of the working directory,
the entrypoint command, library versions and the Ray runtime env (secrets redacted), using
MLflow's own tag names where they exist so the MLflow UI shows them.
"""

from __future__ import annotations

import getpass
import json
import platform
import re
import shlex
import subprocess
import sys
from importlib import metadata
from typing import Any

GIT_TIMEOUT_S = 3.0
_SECRET_NAME = re.compile(r"SECRET|PASSWORD|TOKEN|CREDENTIAL|ACCESS_KEY|PRIVATE", re.IGNORECASE)
REDACTED = "<redacted>"


def _git(*args: str) -> str | None:
    try:
        done = subprocess.run(
            ["git", *args], capture_output=True, text=True, timeout=GIT_TIMEOUT_S, check=False
        )
    except (OSError, subprocess.TimeoutExpired):
        return None
    return done.stdout.strip() if done.returncode == 0 else None


def _version(package: str) -> str:
    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return "not installed"


def reproducibility_tags() -> dict[str, str]:
    """Tags describing code, command and environment of the calling process."""
    tags = {
        "mlflow.source.name": sys.argv[0] if sys.argv and sys.argv[0] else "<interactive>",
        "mlflow.source.type": "LOCAL",
        "mlflow.user": getpass.getuser(),
        "raydeck.entrypoint": shlex.join(sys.argv) if sys.argv else "",
        "raydeck.version.python": platform.python_version(),
    }
    for package in ("raydeck", "ray", "torch", "mlflow", "pytorch-lightning"):
        tags[f"raydeck.version.{package}"] = _version(package)
    commit = _git("rev-parse", "HEAD")
    if commit:
        tags["mlflow.source.git.commit"] = commit
        status = _git("status", "--porcelain", "--untracked-files=no")
        tags["raydeck.git.dirty"] = "true" if status else "false"
    return tags


def redact_runtime_env(runtime_env: dict[str, Any]) -> dict[str, Any]:
    """A copy of a Ray runtime env with the values of secret-looking variables replaced."""
    cleaned = dict(runtime_env)
    env_vars = cleaned.get("env_vars")
    if isinstance(env_vars, dict):
        cleaned["env_vars"] = {
            name: (REDACTED if _SECRET_NAME.search(name) else value)
            for name, value in env_vars.items()
        }
    return cleaned


def runtime_env_json() -> str:
    """The current Ray runtime env, redacted, as JSON."""
    import ray

    env = ray.get_runtime_context().runtime_env if ray.is_initialized() else {}
    return json.dumps(redact_runtime_env(dict(env or {})), indent=2, sort_keys=True, default=str)
