"""Submitting training jobs to a Ray cluster through its job server (as `ray job submit` does).

Owns: reaching the job server with its authentication token, submission with a run id known
before the job starts, log streaming, and the job list. Does not own the preflight probe that
checks the cluster's Python can import raydeck (:mod:`raydeck.jobs.probe`), what a job does
(``jobs/*.py``), the cluster itself, which job server an address leads to
(:mod:`raydeck.jobs.address`), or reading the runtime env files of ``runtime_envs/``
(:mod:`raydeck.jobs.runtime_env`).

Three facts of Ray 2.60 shape this module:

- Token authentication is on by default for clusters started with ``ray start --head`` (when
  ``RAY_AUTH_MODE=token`` or a token exists), and the job server then answers 401 without one.
  The token is sent explicitly as an ``Authorization`` header built here (:class:`JobServer`),
  so nothing depends on which Ray process state came before; it is never printed. Unlike
  ``ray job submit``, the token file found implicitly (``~/.ray/auth_token``) goes only to a job
  server on this machine (:func:`auth_token`): it belongs to the head started here, and
  sending it to any ``--address`` would hand it to whoever answers there.
- A job's entrypoint ``python`` is the first ``python`` on the PATH of the process that ran
  ``ray start``. :func:`raydeck.jobs.probe.probe` runs a tiny job first and says exactly which
  Python could not import raydeck and how to fix it, instead of a ``No module named 'ray'``
  deep in a job log.
- Ray fills in ``${NAME}`` in a runtime env's ``env_vars`` on each node from the environment
  ``ray start`` ran with. :func:`~raydeck.jobs.runtime_env.load_runtime_env` fills them from the
  *submitting* environment instead, except secrets (secret-named variables, and values that
  carry credentials such as a tracking URI with user:password), which stay ``${NAME}`` for the
  cluster to fill: a secret's value never travels with the job, whose runtime env Ray's agent
  logs and its dashboard shows.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import os
import re
import shlex
import time
import uuid
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from raydeck._internal.contract import COMMAND_DRIVER_KIND, JOB_DIGEST_ENV, JOB_KIND_METADATA
from raydeck._internal.redaction import redact_text, redact_url
from raydeck.cluster.connection import unreachable_reason
from raydeck.config.secrets import Secret
from raydeck.config.stack_connection import token_for
from raydeck.config.tracking_uri import run_url
from raydeck.errors import ClusterUnavailableError, ConfigError, JobSubmissionError
from raydeck.jobs.address import API_SERVER_ADDRESS_ENV, find_job_server, is_local_address
from raydeck.jobs.job_client import bounded_job_client

if TYPE_CHECKING:
    from ray.job_submission import JobSubmissionClient


logger = logging.getLogger(__name__)

AUTH_MODE_ENV = "RAY_AUTH_MODE"
AUTH_TOKEN_ENV = "RAY_AUTH_TOKEN"
AUTH_TOKEN_PATH_ENV = "RAY_AUTH_TOKEN_PATH"
# A Kubernetes token's file (a pod's projected ServiceAccount token, or `kubectl create token`'s
# output), for a RayCluster with Kubernetes token auth: read again for every request, since the
# kubelet rotates such tokens and they expire.
K8S_TOKEN_FILE_ENV = "RAYDECK_K8S_TOKEN_FILE"
DEFAULT_TOKEN_PATH = Path(".ray/auth_token")  # in the home directory
RUN_ID_ENV = "RAYDECK_RUN_ID"
# The job contract (``raydeck submit --help``): a job is ``python JOB ARGS...`` with ARGS exactly
# as given after ``--``; the preset and run name reach it in these variables, so any script runs.
PRESET_ENV = "RAYDECK_PRESET"
RUN_NAME_ENV = "RAYDECK_RUN_NAME"
# Options a job reads from PRESET_ENV / RUN_NAME_ENV when it also takes them on its command line
# (the repository's jobs do): given to `raydeck submit` and again after `--` they would disagree.
CONTRACT_OPTIONS = {"--preset": "preset", "--run-name": "run_name"}
METADATA_RUN_ID = "raydeck_run_id"
METADATA_PRESET = "raydeck_preset"
STATUS_POLL_INTERVAL_S = 1.0
# A head that just started answers "No available agent to submit job" until its dashboard agent
# registers (seconds); submissions retry that long.
AGENT_WAIT_S = 120.0
TERMINAL_STATUSES = ("SUCCEEDED", "FAILED", "STOPPED")
# Each request a command sends to the job server (connect, and each wait for an answer): a
# package upload is answered once the head has stored it, seconds for Ray's largest.
CLIENT_TIMEOUT_S = 60.0

_AUTH_HINT = (
    "the job server requires a token: set RAY_AUTH_MODE=token and RAY_AUTH_TOKEN_PATH (or "
    "RAY_AUTH_TOKEN) to the cluster's token, which `ray start --head` keeps in "
    "~/.ray/auth_token on the head's machine"
)


# --- the job server -------------------------------------------------------------------------
def job_server_address(address: str | None = None, env: Mapping[str, str] | None = None) -> str:
    """The job server's URL for a command's ``--address`` and ``env`` (default ``os.environ``):
    :func:`raydeck.jobs.address.find_job_server`, which reads Ray's variables in each of
    their forms; a GCS it asks for its dashboard gets the token :func:`auth_token` allows.

    Raises:
        ConfigError: a setting or the chosen address is malformed.
        ClusterUnavailableError: a cluster address leads to no job server.
    """
    env = os.environ if env is None else env
    return find_job_server(address, env, token_for=lambda gcs: auth_token(env, job_server=gcs))


def auth_token(env: Mapping[str, str] | None = None, job_server: str | None = None
               ) -> Secret | None:
    """The token to send to ``job_server`` (default: :func:`job_server_address` of ``env``),
    read from ``env`` (default ``os.environ``).

    The rule: ``RAY_AUTH_MODE=disabled`` sends none. A token named explicitly (the Kubernetes
    token in ``RAYDECK_K8S_TOKEN_FILE``, else ``RAY_AUTH_TOKEN``, else the file in
    ``RAY_AUTH_TOKEN_PATH``) is the user's choice and goes
    to whatever job server is given. The token file found implicitly, ``~/.ray/auth_token``, is
    the one ``ray start --head`` wrote for the head on this machine, so it goes only to a job
    server on this machine (:func:`is_local_address`); to send it elsewhere, name it with
    ``RAY_AUTH_TOKEN_PATH``. Before that file, the running stack's token (``raydeck up``) goes
    to the stack's own job server, never anywhere else.

    Raises:
        ConfigError: ``RAY_AUTH_MODE=token`` but no token may be sent (none found, or only
            ``~/.ray/auth_token`` for a remote address), or the token file named by
            ``RAYDECK_K8S_TOKEN_FILE`` or ``RAY_AUTH_TOKEN_PATH`` cannot be read.
    """
    env = os.environ if env is None else env
    address = job_server or job_server_address(None, env)
    mode = env.get(AUTH_MODE_ENV, "").strip().lower()
    if mode == "disabled":
        return None
    if env.get(K8S_TOKEN_FILE_ENV):
        return _k8s_token(Path(env[K8S_TOKEN_FILE_ENV]).expanduser())
    if env.get(AUTH_TOKEN_ENV, "").strip():
        return Secret(env[AUTH_TOKEN_ENV].strip())
    if env.get(AUTH_TOKEN_PATH_ENV):
        path = Path(env[AUTH_TOKEN_PATH_ENV]).expanduser()
        try:
            return Secret(path.read_text().strip())
        except OSError as exc:
            raise ConfigError(
                f"{AUTH_TOKEN_PATH_ENV}={str(path)!r}: cannot read the token ({exc.strerror})"
            ) from None
    stack_token = token_for(address, env)
    if stack_token is not None:
        return stack_token
    default = _default_token_path(env)
    if default.is_file():
        if is_local_address(address):
            return Secret(default.read_text().strip())
        if mode == "token":
            raise ConfigError(_withheld_message(address, default))
        return None
    if mode == "token":
        raise ConfigError(
            f"{AUTH_MODE_ENV}=token but no token found: set {AUTH_TOKEN_ENV} or "
            f"{AUTH_TOKEN_PATH_ENV} (the head keeps it in ~/.ray/auth_token)"
        )
    return None


def _default_token_path(env: Mapping[str, str]) -> Path:
    return Path(env.get("HOME") or Path.home()) / DEFAULT_TOKEN_PATH


def _k8s_token(path: Path) -> Secret:
    try:
        return Secret(path.read_text().strip())
    except OSError as exc:
        raise ConfigError(f"{K8S_TOKEN_FILE_ENV}={str(path)!r}: cannot read the Kubernetes "
                          f"token ({exc.strerror})") from None


def _withheld_message(address: str, path: Path) -> str:
    return (f"{path} holds the token of the Ray head on this machine and is not sent to "
            f"{redact_url(address)}; set {AUTH_TOKEN_PATH_ENV} (or {AUTH_TOKEN_ENV}) to that "
            "cluster's token")


@dataclass(frozen=True)
class JobServer:
    """A Ray job server and the token to reach it. Build with :meth:`from_env`."""

    address: str
    token: Secret | None = None
    # Why no token is sent although one exists here (see auth_token); shown on a refusal.
    withheld: str = ""
    # RAYDECK_K8S_TOKEN_FILE's file, read again for every request's headers (it rotates).
    token_file: Path | None = None

    @classmethod
    def from_env(cls, address: str | None = None, env: Mapping[str, str] | None = None
                 ) -> JobServer:
        env = os.environ if env is None else env
        resolved = job_server_address(address, env)
        token = auth_token(env, job_server=resolved)
        default = _default_token_path(env)
        withheld = (_withheld_message(resolved, default)
                    if token is None and env.get(AUTH_MODE_ENV, "").lower() != "disabled"
                    and default.is_file() else "")
        token_file = (Path(env[K8S_TOKEN_FILE_ENV]).expanduser()
                      if token is not None and env.get(K8S_TOKEN_FILE_ENV) else None)
        return cls(resolved, token, withheld, token_file)

    def headers(self) -> dict[str, str]:
        """The HTTP headers every request to this server (jobs, state API) carries; a
        Kubernetes token file is read again each time."""
        token = _k8s_token(self.token_file) if self.token_file else self.token
        return {"Authorization": f"Bearer {token.reveal()}"} if token else {}

    def client(self, timeout_s: float = CLIENT_TIMEOUT_S) -> JobSubmissionClient:
        """A connected ``JobSubmissionClient`` that has shown the token is accepted, and sends
        every request with ``timeout_s`` (connect, and each wait for an answer).

        Ray's own client would wait forever on a dashboard that accepts connections and never
        answers, and would add its process's token to a request that carries none; this one
        (:func:`raydeck.jobs.job_client.bounded_job_client`) sends exactly :meth:`headers`, so
        a token goes only where :meth:`from_env` (or the queue, for its own head) chose.

        Raises:
            ClusterUnavailableError: nothing answers at the address, an answer did not come
                within ``timeout_s``, or the server refuses the token.
        """
        import requests
        from ray.exceptions import AuthenticationError

        reason = unreachable_reason(self.address)
        if reason:
            raise ClusterUnavailableError(
                f"cannot reach the Ray job server at {self.address} ({reason}); start the "
                "cluster (`ray start --head` serves it on port 8265) or pass --address / set "
                f"{API_SERVER_ADDRESS_ENV} to its http:// URL"
            )
        try:
            client = bounded_job_client(self.address, self.headers, timeout_s)
            client.list_jobs()
        except AuthenticationError:
            raise ClusterUnavailableError(
                f"the Ray job server at {self.address} refused the request: "
                + ("it rejected the token that was sent; check RAY_AUTH_TOKEN / "
                   "RAY_AUTH_TOKEN_PATH" if self.token else self.withheld or _AUTH_HINT)
            ) from None
        except requests.Timeout:
            raise ClusterUnavailableError(
                f"the Ray job server at {redact_url(self.address)} accepted the connection but "
                f"did not answer within {timeout_s:g} s; is the dashboard (or a port-forward "
                "to it) stuck?"
            ) from None
        except (ConnectionError, RuntimeError, requests.RequestException) as exc:
            raise ClusterUnavailableError(
                f"the Ray job server at {self.address} did not answer as one "
                f"({str(exc).splitlines()[0][:200]}); is it the dashboard port (8265)?"
            ) from None
        return client


# --- submission -----------------------------------------------------------------------------
@dataclass(frozen=True)
class JobRequest:
    """A job file to run on the cluster, and how.

    The job contract: the entrypoint is ``python JOB_FILE ARGS...`` with ``args`` exactly as
    given (``job_file`` is relative to the working dir); the preset, run name and run id reach
    the job as ``RAYDECK_PRESET``, ``RAYDECK_RUN_NAME`` and ``RAYDECK_RUN_ID`` in its runtime
    env (:func:`submitted_runtime_env`), so a script needs no particular options. ``run_id`` is
    the MLflow run the job writes to: a new id for a new run, or the id of a run to resume.
    """

    job_file: str
    preset: str
    run_name: str
    run_id: str
    runtime_env: dict[str, Any]
    args: tuple[str, ...] = ()

    @property
    def entrypoint(self) -> str:
        return shlex.join(["python", self.job_file, *self.args])

    @property
    def submission_id(self) -> str:
        return f"raydeck-{self.run_id}"

    @property
    def digest(self) -> str:
        """Names "the same job" across submissions: its job file, preset and arguments (not
        its run name or id). Runs carry it as the MLflow tag ``raydeck.job_digest``."""
        same = json.dumps([self.job_file, self.preset, list(self.args)])
        return hashlib.sha256(same.encode()).hexdigest()[:32]


def default_run_name(job_file: str) -> str:
    """The run name of a job submitted without one: its file's name (``digits-torch``)."""
    return Path(job_file).stem.replace("_", "-")


def new_run_id(run_name: str) -> str:
    """A fresh run id for ``run_name``: readable, unique, and legal as ``RAYDECK_RUN_ID``."""
    stem = re.sub(r"[^\w.\-]+", "-", run_name).strip("-")[:40] or "run"
    return f"{stem}-{uuid.uuid4().hex[:8]}"


def check_job_file(job_file: str, runtime_env: Mapping[str, Any]) -> None:
    """The job file must be inside the working dir that travels with the job.

    Raises:
        ConfigError: no working dir, or the file is not in it.
    """
    working_dir = runtime_env.get("working_dir")
    if not working_dir:
        raise ConfigError("the runtime env has no working_dir, so the job file would not reach "
                          "the cluster; add `working_dir: .` (runtime_envs/*.yaml have it)")
    if "://" in str(working_dir):
        return
    if Path(job_file).is_absolute() or not (Path(working_dir) / job_file).is_file():
        raise ConfigError(f"job file {job_file!r} is not a file inside the working dir "
                          f"{working_dir}; pass it relative to that directory")


def contract_conflicts(args: tuple[str, ...] | list[str], **given: str | None) -> list[str]:
    """The job's ``args`` that repeat an option of the job contract given to ``raydeck submit``.

    ``given`` maps ``preset`` / ``run_name`` to the value submit was given explicitly (``None``:
    not given). Returns one message per repeated option, naming both values; empty when none.
    """
    conflicts = []
    for index, arg in enumerate(args):
        option, sep, value = arg.partition("=")
        field = CONTRACT_OPTIONS.get(option)
        if field is None or given.get(field) is None:
            continue
        if not sep:
            value = args[index + 1] if index + 1 < len(args) else ""
        conflicts.append(f"{option} given twice: {option} {given[field]} to raydeck submit and "
                         f"{option} {value} after `--` for the job")
    return conflicts


def submitted_runtime_env(request: JobRequest) -> dict[str, Any]:
    """The runtime env a job is submitted with: the request's, plus the job contract's
    variables (preset, run name, run id) and its job key."""
    runtime_env = dict(request.runtime_env)
    runtime_env["env_vars"] = {**runtime_env.get("env_vars", {}), PRESET_ENV: request.preset,
                               RUN_NAME_ENV: request.run_name, RUN_ID_ENV: request.run_id,
                               JOB_DIGEST_ENV: request.digest}
    return runtime_env


def submitted_metadata(request: JobRequest) -> dict[str, str]:
    """The job server metadata ``raydeck jobs`` reads back (kind, run id, preset)."""
    return {JOB_KIND_METADATA: "job", METADATA_RUN_ID: request.run_id,
            METADATA_PRESET: request.preset}


def submit_job(client: JobSubmissionClient, request: JobRequest) -> str:
    """Submit the job; returns its submission id (``raydeck-<run id>``)."""
    return submit_waiting_for_agent(
        client, entrypoint=request.entrypoint, submission_id=request.submission_id,
        runtime_env=submitted_runtime_env(request), metadata=submitted_metadata(request),
    )


def submit_waiting_for_agent(client: JobSubmissionClient, **job: Any) -> str:
    """``client.submit_job``, waiting out a head whose job agent is not up yet."""
    deadline = time.monotonic() + AGENT_WAIT_S
    while True:
        try:
            return str(client.submit_job(**job))
        except RuntimeError as exc:
            if "No available agent" not in str(exc) or time.monotonic() > deadline:
                raise JobSubmissionError(
                    f"the job server refused job {job['submission_id']}: "
                    f"{str(exc).splitlines()[0][:300]}"
                ) from None
            time.sleep(STATUS_POLL_INTERVAL_S)


def wait_for(client: JobSubmissionClient, submission_id: str, timeout_s: float) -> str:
    """Poll until the job ends or ``timeout_s`` passes; returns its last status."""
    deadline = time.monotonic() + timeout_s
    status = str(client.get_job_status(submission_id).value)
    while status not in TERMINAL_STATUSES and time.monotonic() < deadline:
        time.sleep(STATUS_POLL_INTERVAL_S)
        status = str(client.get_job_status(submission_id).value)
    return status


def stream_logs(client: JobSubmissionClient, submission_id: str,
                write: Callable[[str], None]) -> str:
    """Pass the job's log to ``write`` as it grows, until the job ends; returns its status."""

    async def tail() -> None:
        async for chunk in client.tail_job_logs(submission_id):
            write(chunk)

    asyncio.run(tail())
    return wait_for(client, submission_id, timeout_s=60.0)


# --- listing --------------------------------------------------------------------------------
# Ray's JobType: a job its job server started (it has a submission id, logs, `ray job stop`),
# or any other process that connected with ray.init.
SUBMISSION = "SUBMISSION"
DRIVER = "DRIVER"
# Ray jobs raydeck starts for itself, never listed: the preflight probe and commands' drivers.
_UNLISTED_KINDS = ("probe", COMMAND_DRIVER_KIND)


@dataclass(frozen=True)
class JobView:
    """One job as ``raydeck jobs`` shows it. ``type``: Ray's ``SUBMISSION`` (``raydeck submit``,
    ``ray job submit``, the queue) or ``DRIVER`` (a script that called ``ray.init`` itself; its
    ``submission_id`` is empty and ``id`` is Ray's job id)."""

    submission_id: str
    status: str
    entrypoint: str
    started_s: float | None
    duration_s: float | None
    run_id: str
    message: str
    job_id: str = ""
    type: str = SUBMISSION
    exit_code: int | None = None  # the driver's, once it exited

    @property
    def id(self) -> str:
        """What names the job: its submission id, else (a driver) Ray's job id."""
        return self.submission_id or self.job_id


def list_jobs(client: JobSubmissionClient, limit: int = 20, drivers: bool = False
              ) -> list[JobView]:
    """The most recent jobs first: submissions, and with ``drivers`` also the drivers of
    scripts that connected with ``ray.init`` (as ``ray job list`` shows them).

    Never raydeck's own: its preflight probes, and the drivers of its commands (``raydeck
    status``, ``queue``, ``jobs``...), which Ray lists as drivers like any other but which
    carry ``raydeck_kind=command`` (:func:`raydeck.cluster.connection.connect_existing`).
    """
    views = []
    for job in client.list_jobs():
        metadata = job.metadata or {}
        kind = str(getattr(job.type, "value", job.type))
        if metadata.get(JOB_KIND_METADATA) in _UNLISTED_KINDS or (kind != SUBMISSION
                                                              and not drivers):
            continue
        started = job.start_time / 1000 if job.start_time else None
        ended = job.end_time / 1000 if job.end_time else None
        duration = (ended or time.time()) - started if started else None
        views.append(JobView(
            submission_id=str(job.submission_id or ""), status=str(job.status.value),
            entrypoint=job.entrypoint, started_s=started, duration_s=duration,
            run_id=metadata.get(METADATA_RUN_ID, ""), message=job.message or "",
            job_id=str(job.job_id or ""), type=kind,
            exit_code=getattr(job, "driver_exit_code", None),
        ))
    views.sort(key=lambda view: view.started_s or 0.0, reverse=True)
    return views[:limit]


@dataclass(frozen=True)
class RunLink:
    """Where a job's MLflow run is, as far as this machine's MLflow can tell."""

    run_id: str
    mlflow_run_id: str = ""
    url: str = ""
    status: str = ""


def find_run(tracking_uri: str, experiment: str, run_id: str) -> RunLink:
    """The MLflow run of raydeck run id ``run_id`` (tag ``raydeck.run_key``), if it exists here.

    Returns a link with only ``run_id`` set when MLflow is unreachable or has no such run (the
    job may write to an MLflow this machine does not see). Its ``url`` has no credentials.
    """
    from mlflow.tracking import MlflowClient

    try:
        client = MlflowClient(tracking_uri)
        exp = client.get_experiment_by_name(experiment)
        runs = client.search_runs(
            [exp.experiment_id], filter_string=f"tags.`raydeck.run_key` = '{run_id}'",
            max_results=1) if exp is not None else []
    except Exception as exc:
        logger.debug("MLflow lookup of %s failed: %s", run_id, redact_text(str(exc)))
        return RunLink(run_id)
    if not runs:
        return RunLink(run_id)
    info = runs[0].info
    url = run_url(tracking_uri, info.experiment_id, info.run_id)
    return RunLink(run_id, info.run_id, url, info.status)
