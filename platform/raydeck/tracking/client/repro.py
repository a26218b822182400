"""What a run records about how it was produced, so it can be reproduced.

On creating a run, the tracker records the git commit and dirty flag of the working directory,
the entrypoint command, library versions and the Ray runtime env, using MLflow's own tag names
where they exist so the MLflow UI shows them. Everything recorded goes through
:mod:`raydeck._internal.redaction` first: a command line or a runtime env may hold credentials (a
``--password`` option, a tracking URI with user:password, a token in a pip URL).
"""

from __future__ import annotations

import getpass
import json
import platform
import subprocess
import sys
from importlib import metadata

from raydeck._internal.redaction import redact_command, redact_env, redact_text
from raydeck.cluster.connection import job_runtime_env
from raydeck.config.settings import Settings

GIT_TIMEOUT_S = 3.0


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
        "mlflow.source.name": (redact_text(sys.argv[0]) if sys.argv and sys.argv[0]
                               else "<interactive>"),
        "mlflow.source.type": "LOCAL",
        "mlflow.user": getpass.getuser(),
        "raydeck.entrypoint": redact_command(sys.argv) if sys.argv else "",
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


def runtime_env_json(settings: Settings) -> str:
    """The job's runtime env as JSON, its variables as the job's workers get them: raydeck's
    settings in ``env_vars``, where a job gets them, or, on a local Ray that raydeck started,
    from the processes' environment (:func:`raydeck.cluster.connection.starting_ray`), recorded here
    all the same, so the record reads alike however the job ran. Variables are redacted by
    :func:`~raydeck._internal.redaction.redact_env`, and the whole document (URIs of working dirs,
    pip requirements) by :func:`~raydeck._internal.redaction.redact_text`."""
    import ray

    runtime_env = dict(ray.get_runtime_context().runtime_env if ray.is_initialized() else {})
    env_vars = runtime_env.get("env_vars")
    runtime_env["env_vars"] = redact_env({**job_runtime_env(settings)["env_vars"],
                                          **(env_vars if isinstance(env_vars, dict) else {})})
    return redact_text(json.dumps(runtime_env, indent=2, sort_keys=True, default=str))
