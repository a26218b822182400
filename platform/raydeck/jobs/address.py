"""Which Ray job server (the dashboard's HTTP API) the job commands talk to.

Owns: the precedence of the places a user names a cluster (``--address``,
``RAY_API_SERVER_ADDRESS``, ``RAY_ADDRESS``, raydeck's ``ray_address``, the running stack),
turning each of Ray's address forms into the job server's URL, and reading a head's dashboard
address from its GCS. Does not own the token sent to the job server
(:func:`raydeck.jobs.submission.auth_token`) nor talking to it
(:class:`raydeck.jobs.submission.JobServer`).

The job server is the first of these that is set:

1. ``--address``;
2. ``RAY_API_SERVER_ADDRESS``, Ray's variable for the job server (these two name the job
   server: a bare ``host:port`` there means ``http://host:port``);
3. ``RAY_ADDRESS`` when it is an ``http(s)://`` URL (as ``ray job submit`` reads it);
4. raydeck's ``ray_address`` (``RAYDECK_RAY_ADDRESS``, raydeck.toml, the running stack's);
5. ``RAY_ADDRESS`` in its other forms;
6. the running stack's job server (``raydeck up``);
7. ``http://127.0.0.1:8265``, a head started on this machine.

``auto`` and ``local`` name no particular head and are skipped. Each form leads to a URL:

- ``http(s)://host:port``: the job server itself, as is.
- ``host:port``, a GCS address: the dashboard address the head registered in its GCS (what
  ``ray job submit`` does with such an address). The running stack's GCS address leads to
  its job server without asking.
- ``ray://host:port``, a Ray Client address: the dashboard address a Ray Client session there
  reports (what ``ray.init("ray://...")`` returns as ``dashboard_url``), read in a short-lived
  subprocess, so this process's Ray state stays untouched.

A GCS or Ray Client server that cannot be asked (unreachable from here, refusing the token)
falls back to the dashboard's default port on its host when something answers there. Otherwise one
:class:`~raydeck.errors.ClusterUnavailableError` says why and names ``RAY_API_SERVER_ADDRESS``
and the URL to set it to.
"""

from __future__ import annotations

import ipaddress
import logging
import os
import re
import socket
import subprocess
import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Literal
from urllib.parse import urlsplit

import psutil

from raydeck._internal.redaction import redact_url
from raydeck.cluster import node_env
from raydeck.cluster.connection import unreachable_reason
from raydeck.config import stack_connection
from raydeck.config.secrets import Secret
from raydeck.config.settings import ORIGIN_ENVIRONMENT, Settings, load_settings_with_origins
from raydeck.errors import ClusterUnavailableError, ConfigError

logger = logging.getLogger(__name__)

API_SERVER_ADDRESS_ENV = "RAY_API_SERVER_ADDRESS"
RAY_ADDRESS_ENV = "RAY_ADDRESS"
RAYDECK_RAY_ADDRESS_ENV = Settings.env_name("ray_address")
DASHBOARD_PORT = 8265
DEFAULT_JOB_SERVER = f"http://127.0.0.1:{DASHBOARD_PORT}"
# How long the head's GCS may take to answer one read; a GCS that answers at all does so in
# milliseconds, and the job commands should fail within seconds, not Ray's minute of retries.
GCS_READ_TIMEOUT_S = 5.0
# Where the head's dashboard registers its "host:port" (ray._private.ray_constants
# KV_NAMESPACE_DASHBOARD and DASHBOARD_ADDRESS; ray.dashboard.head writes it at start-up).
GCS_DASHBOARD_NAMESPACE = b"dashboard"
GCS_DASHBOARD_KEY = b"dashboard"
# How long a Ray Client session may take to report its dashboard: a few seconds on an idle
# head (the client server starts a server process for the session).
CLIENT_SESSION_TIMEOUT_S = 60.0
_CLIENT_DASHBOARD = ("import sys, ray\n"
                     "context = ray.init(sys.argv[1], logging_level='ERROR')\n"
                     "print('dashboard=' + (context.dashboard_url or ''))\n"
                     "ray.shutdown()\n")
# A GCS (host:port) or Ray Client (ray://host:port) address; IPv6 hosts in brackets.
_CLUSTER_ADDRESS = re.compile(r"^(?:ray://)?(?P<host>[\w.\-]+|\[[0-9a-fA-F:.]+\]):(?P<port>\d+)/?$")
_URL_SCHEMES = ("http://", "https://")
_NO_PARTICULAR_HEAD = ("auto", "local")

AddressForm = Literal["url", "client", "gcs"]


@dataclass(frozen=True)
class ClusterAddress:
    """An address a user gave for their cluster, and where it was given.

    Attributes:
        value: the address: an ``http(s)://`` URL (the job server itself, taken as is),
            ``ray://host:port`` (a Ray Client server) or ``host:port`` (the head's GCS).
        source: where it was read: ``--address``, a variable's name, or raydeck's
            ``ray_address`` and its origin; error messages name it.
    """

    value: str
    source: str

    def __post_init__(self) -> None:
        if self.form != "url" and not _CLUSTER_ADDRESS.match(self.value.strip()):
            raise ConfigError(
                f"{self.source} = {redact_url(self.value)!r}: not a Ray address; use "
                "http(s)://host:port (the job server), ray://host:port or host:port (the GCS)"
            )

    @property
    def form(self) -> AddressForm:
        """``url`` (the job server itself), ``client`` (``ray://``) or ``gcs``."""
        value = self.value.strip()
        if value.startswith(_URL_SCHEMES):
            return "url"
        return "client" if value.startswith("ray://") else "gcs"

    @property
    def host_port(self) -> str:
        """``host:port`` without a scheme (a GCS's, or a Ray Client server's)."""
        match = self._match()
        return f"{match['host']}:{match['port']}"

    @property
    def default_dashboard(self) -> str:
        """The dashboard's default port on this address's host: the guess of last resort."""
        return f"http://{self._match()['host']}:{DASHBOARD_PORT}"

    def _match(self) -> re.Match[str]:
        match = _CLUSTER_ADDRESS.match(self.value.strip())
        if match is None:
            raise ValueError(f"{self.value!r} is a URL, not a cluster address")
        return match


def choose_address(address: str | None, env: Mapping[str, str], ray_address: str,
                   ray_address_source: str = RAYDECK_RAY_ADDRESS_ENV) -> ClusterAddress | None:
    """The address that names the job server, by the precedence of this module's docstring
    (steps 1 to 5); None when none is set (the stack's job server or the default applies).

    Args:
        address: the command's ``--address`` (None or empty: not given).
        env: the environment (``RAY_API_SERVER_ADDRESS``, ``RAY_ADDRESS``).
        ray_address: raydeck's ``ray_address`` setting, already resolved.
        ray_address_source: where that setting came from, for error messages.

    Raises:
        ConfigError: the chosen value is not one of Ray's address forms.
    """
    ray_env = env.get(RAY_ADDRESS_ENV, "").strip()
    candidates = [
        ("--address", _as_url((address or "").strip())),
        (API_SERVER_ADDRESS_ENV, _as_url(env.get(API_SERVER_ADDRESS_ENV, "").strip())),
        (RAY_ADDRESS_ENV, ray_env if ray_env.startswith(_URL_SCHEMES) else ""),
        (ray_address_source, ray_address.strip()),
        (RAY_ADDRESS_ENV, ray_env),
    ]
    for source, value in candidates:
        if value and value not in _NO_PARTICULAR_HEAD:
            return ClusterAddress(value, source)
    return None


def _as_url(job_server: str) -> str:
    """A value that names the job server, with ``http://`` when it has no scheme."""
    if not job_server or "://" in job_server:
        return job_server
    return f"http://{job_server}"


def job_server_from_gcs_record(gcs: ClusterAddress, registered: str, gcs_is_local: bool) -> str:
    """The job server URL from the ``host:port`` a head's dashboard registered in its GCS.

    Args:
        gcs: the GCS address it was read from.
        registered: the registered value (``host:port``, as Ray writes it).
        gcs_is_local: whether the GCS's host is this machine.

    Raises:
        ClusterUnavailableError: the dashboard listens on the head's loopback only (Ray's
            default ``--dashboard-host``) and the head is another machine, so nothing here can
            reach it.
    """
    url = f"http://{registered.strip()}"
    host = urlsplit(url).hostname or ""
    if _is_loopback(host) and not gcs_is_local:
        raise ClusterUnavailableError(
            f"the Ray head at {gcs.host_port} ({gcs.source}) serves its job server on its "
            f"loopback only ({registered.strip()}), which this machine cannot reach: start the "
            "head with `--dashboard-host 0.0.0.0`, or forward its dashboard port and set "
            f"{API_SERVER_ADDRESS_ENV} to the forwarded http://host:port"
        )
    return url


def read_registered_dashboard(gcs: ClusterAddress, token: Secret | None,
                              timeout_s: float = GCS_READ_TIMEOUT_S) -> str:
    """The ``host:port`` the head's dashboard registered in the GCS at ``gcs``.

    Reads one key of the GCS's internal KV over gRPC (what Ray's ``ray job`` commands read for
    a GCS address), sending ``token`` as Ray's token authentication does. Ray's own
    ``GcsClient`` is not used: it retries an absent or foreign server for about 40 s and logs
    each attempt to stderr.

    Raises:
        ClusterUnavailableError: the GCS did not answer, refused the token, or holds no
            dashboard address (a head started with ``--include-dashboard=false``, or one whose
            dashboard has not started yet).
    """
    # Imported on use, for start-up time: only a GCS address needs gRPC and Ray's protocol.
    import grpc
    from ray.core.generated import gcs_service_pb2, gcs_service_pb2_grpc

    unreachable = unreachable_reason(gcs.host_port)
    if unreachable:
        raise ClusterUnavailableError(f"cannot reach it ({unreachable})")
    metadata = (("authorization", f"Bearer {token.reveal()}"),) if token else ()
    # Generated by protoc without type stubs.
    request = gcs_service_pb2.InternalKVGetRequest(  # type: ignore[attr-defined]
        key=GCS_DASHBOARD_KEY, namespace=GCS_DASHBOARD_NAMESPACE)
    with grpc.insecure_channel(gcs.host_port) as channel:
        stub = gcs_service_pb2_grpc.InternalKVGcsServiceStub(channel)
        try:
            reply = stub.InternalKVGet(request, timeout=timeout_s, metadata=metadata)
        except grpc.RpcError as exc:
            code = exc.code() if isinstance(exc, grpc.Call) else None
            reason = ("it refused the request: set RAY_AUTH_TOKEN or RAY_AUTH_TOKEN_PATH to the "
                      "cluster's token" if code == grpc.StatusCode.UNAUTHENTICATED
                      else f"it does not answer as a GCS ({code.name if code else exc}); is it "
                      "the port of the head's `ray start --head --port` (6379 by default)?")
            raise ClusterUnavailableError(reason) from None
    if reply.status.code != 0 or not reply.value:
        raise ClusterUnavailableError(
            "its GCS holds no dashboard address: the head runs no dashboard (started with "
            "--include-dashboard=false?) or it has not started yet")
    return bytes(reply.value).decode()


def read_client_dashboard(client: ClusterAddress,
                          timeout_s: float = CLIENT_SESSION_TIMEOUT_S) -> str:
    """The ``host:port`` of the dashboard of the cluster behind Ray Client address ``client``.

    Opens a Ray Client session in a subprocess (Ray's own client, with this process's
    environment: ``RAY_AUTH_MODE`` and the token variables apply as for any Ray client) and
    reads the ``dashboard_url`` it reports. A subprocess because a Ray Client session is
    process-wide state, and because Ray retries an absent server for longer than a command
    should wait.

    Raises:
        ClusterUnavailableError: the client server did not answer in ``timeout_s``, refused
            the session, or reported no dashboard.
    """
    unreachable = unreachable_reason(client.host_port)
    if unreachable:
        raise ClusterUnavailableError(f"cannot reach it ({unreachable})")
    try:
        done = subprocess.run(
            [sys.executable, "-c", _CLIENT_DASHBOARD, client.value.strip()],
            capture_output=True, text=True, timeout=timeout_s, check=False)
    except subprocess.TimeoutExpired:
        raise ClusterUnavailableError(
            f"no Ray Client session started in {timeout_s:.0f} s") from None
    found = [line.removeprefix("dashboard=") for line in done.stdout.splitlines()
             if line.startswith("dashboard=")]
    if done.returncode == 0 and found and found[0]:
        return found[0]
    failure = redact_url((done.stderr.strip().splitlines() or ["no dashboard reported"])[-1])
    raise ClusterUnavailableError(
        f"its Ray Client session failed: {node_env.explain_client_failure(failure)}")


def resolve_job_server(
    chosen: ClusterAddress,
    *,
    stack: stack_connection.StackConnection | None = None,
    token_for: Callable[[str], Secret | None] = lambda _address: None,
    read_gcs: Callable[[ClusterAddress, Secret | None], str] = read_registered_dashboard,
    read_client: Callable[[ClusterAddress], str] = read_client_dashboard,
    answers: Callable[[str], bool] = lambda url: unreachable_reason(url) is None,
) -> str:
    """The job server URL that ``chosen`` leads to (see this module's docstring).

    Args:
        chosen: the address (:func:`choose_address`).
        stack: the running stack's connection, whose GCS address maps to its job server.
        token_for: the token to present to a GCS address (``host:port``), if any.
        read_gcs: reads the dashboard a GCS registered (:func:`read_registered_dashboard`).
        read_client: reads the dashboard a Ray Client session reports
            (:func:`read_client_dashboard`).
        answers: whether something accepts connections at a URL (the fallback's check).

    Raises:
        ClusterUnavailableError: no job server can be found from ``chosen``; the message says
            why and names ``RAY_API_SERVER_ADDRESS`` and the URL to set it to.
    """
    if chosen.form == "url":
        return chosen.value.strip().rstrip("/")
    if stack is not None and chosen.host_port == stack.ray_address:
        return stack.job_server.rstrip("/")
    where = "the GCS" if chosen.form == "gcs" else "a Ray Client session"
    try:
        registered = (read_gcs(chosen, token_for(chosen.host_port)) if chosen.form == "gcs"
                      else read_client(chosen))
    except ClusterUnavailableError as exc:
        reason = f"its dashboard address could not be read from {where}: {exc}"
    else:
        return job_server_from_gcs_record(chosen, registered, is_local_address(chosen.host_port))
    fallback = chosen.default_dashboard
    if answers(fallback):
        logger.info("job server for %s=%s: %s, the dashboard's default port (%s)",
                    chosen.source, redact_url(chosen.value), fallback, reason)
        return fallback
    raise ClusterUnavailableError(
        f"no Ray job server found for {chosen.source}={redact_url(chosen.value)}: {reason}, "
        f"and nothing answers at {fallback} (the dashboard's default port); set "
        f"{API_SERVER_ADDRESS_ENV} to the cluster's job server, the dashboard's URL "
        "http://<head>:<port> (8265 unless the head was started with --dashboard-port)"
    )


def find_job_server(address: str | None = None, env: Mapping[str, str] | None = None,
                    token_for: Callable[[str], Secret | None] = lambda _address: None) -> str:
    """The job server's URL for ``address`` (a command's ``--address``) and ``env`` (default
    ``os.environ``), by this module's rules.

    Args:
        token_for: the token to present to a GCS address when asking it for its dashboard.

    Raises:
        ConfigError: a setting is malformed, or the chosen address is not a Ray address.
        ClusterUnavailableError: a cluster address leads to no job server (see
            :func:`resolve_job_server`).
    """
    env = os.environ if env is None else env
    settings, origins = load_settings_with_origins(env)
    origin = origins[RAYDECK_RAY_ADDRESS_ENV]
    chosen = choose_address(address, env, settings.ray_address,
                            RAYDECK_RAY_ADDRESS_ENV if origin == ORIGIN_ENVIRONMENT
                            else f"ray_address ({origin})")
    stack = stack_connection.read(env)
    if chosen is None:
        return (stack.job_server if stack else DEFAULT_JOB_SERVER).rstrip("/")
    return resolve_job_server(chosen, stack=stack, token_for=token_for)


def is_local_address(address: str) -> bool:
    """Whether the host of ``address`` (a URL or ``host:port``) is this machine.

    True for loopback names and addresses and for the addresses of this machine's interfaces
    (a head started here may serve on the machine's LAN address). A name that does not resolve
    is not local.
    """
    host = urlsplit(address if "://" in address else f"//{address}").hostname
    if not host:
        return False
    try:
        resolved = {str(info[4][0]) for info in socket.getaddrinfo(host, None)}
    except OSError:
        return False
    own = {entry.address.split("%")[0] for entries in psutil.net_if_addrs().values()
           for entry in entries if entry.family in (socket.AF_INET, socket.AF_INET6)}
    return all(_is_loopback(ip) or ip in own for ip in resolved)


def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.split("%")[0]).is_loopback
    except ValueError:
        return False
