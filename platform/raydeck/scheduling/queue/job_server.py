"""Which job server the queue talks to: its own cluster's, found from the head it runs on.

Owns: :func:`own_job_server` (the dashboard address the head registered in its GCS, as Ray's
own clients read it, and the token this process's Ray uses when token authentication is on)
and :class:`QueueServer`, which gives every request of the queue (its jobs,
:mod:`~raydeck.scheduling.queue.ray_jobs`, and Serve's API,
:mod:`~raydeck.scheduling.queue.serve_apps`) its server and its timeout.

Why not a caller's: the queue serves every user of the cluster, and a caller's ``--address``
(or ``RAY_API_SERVER_ADDRESS``) says where *that caller* reaches a job server: a laptop's
port-forward the head cannot reach, or another cluster's head named by mistake. Adopted for
everyone, the first stalled every status read of the queue and the second made every running
job look forgotten (requeued, and started again while it ran on). So a caller's job server is
at most a hint, used only while the queue has not found its own (its head runs no dashboard
yet), only for that caller's call (:meth:`QueueServer.hinted`), and only once it answered as
this cluster's job server: the session name its ``GET /api/version`` reports (Ray's dashboard
reports the session of the cluster it serves) is the one this process is connected to. It is
never stored.

Every request has a timeout (``REQUEST_TIMEOUT_S``, connect and each wait for an answer),
building Ray's job client included (:meth:`raydeck.jobs.submission.JobServer.client`): a
dashboard that accepts connections and never answers costs one timeout per request, and holds
no thread of the queue's.
"""

from __future__ import annotations

import contextlib
import logging
import threading
from collections.abc import Callable, Iterator
from contextvars import ContextVar

import requests

from raydeck._internal.redaction import redact_text, redact_url
from raydeck.config.secrets import Secret
from raydeck.errors import ClusterUnavailableError, ConfigError
from raydeck.jobs.address import GCS_DASHBOARD_KEY, GCS_DASHBOARD_NAMESPACE
from raydeck.jobs.submission import JobServer
from raydeck.scheduling.queue.launcher import LAUNCHER_TIMEOUT_S

logger = logging.getLogger(__name__)

# Each HTTP request to the job server and to Serve's API (connect, and each wait for an
# answer); the queue also bounds whole launcher calls by LAUNCHER_TIMEOUT_S
# (raydeck.scheduling.queue.launcher.TimedLauncher).
REQUEST_TIMEOUT_S = LAUNCHER_TIMEOUT_S
# Ray's dashboard answers here with its version and the session of the cluster it serves.
VERSION_PATH = "/api/version"

# The caller's job server for the call running in this context, once checked (see hinted);
# TimedLauncher runs each launcher call in a copy of its caller's context.
_CALLERS_SERVER: ContextVar[JobServer | None] = ContextVar("raydeck_queue_callers_server",
                                                            default=None)


def own_job_server() -> JobServer:
    """The job server of the cluster this process is connected to (the queue's actor runs on
    its head): the ``host:port`` the head's dashboard registered in the GCS, which is
    reachable from the head (the loopback, or the head's IP when it listens on every address),
    and the token this process's Ray sends when token authentication is on.

    Raises:
        ClusterUnavailableError: the head registered no dashboard (started with
            ``--include-dashboard=false``, or it has not started yet).
    """
    from ray._raylet import AuthenticationTokenLoader  # type: ignore[attr-defined]  # no stub
    from ray.experimental.internal_kv import _internal_kv_get

    registered = _internal_kv_get(GCS_DASHBOARD_KEY, namespace=GCS_DASHBOARD_NAMESPACE)
    if not registered:
        raise ClusterUnavailableError(
            "the head registered no job server (Ray's dashboard) in its GCS: start the head "
            "with its dashboard (`ray start --head` does unless --include-dashboard=false)")
    # Empty unless token authentication is on (RAY_AUTH_MODE=token, as the head's processes).
    token = AuthenticationTokenLoader.instance().get_raw_token()
    return JobServer(f"http://{registered.decode()}", Secret(token) if token else None)


def own_session() -> str:
    """The session name of the cluster this process is connected to (Ray's id of one start
    of a cluster, which its dashboard reports too)."""
    import ray

    return str(ray.get_runtime_context().get_session_name())


def session_of(server: JobServer, timeout_s: float) -> str:
    """The session name the job server at ``server`` reports ("" when it reports none).

    Raises:
        requests.RequestException: it did not answer within ``timeout_s``, or not with 200.
        ValueError: its answer is not JSON.
    """
    response = requests.get(server.address.rstrip("/") + VERSION_PATH,
                            headers=server.headers(), timeout=timeout_s)
    response.raise_for_status()
    return str(response.json().get("session_name") or "")


class QueueServer:
    """The job server each request of the queue goes to: the queue's own (``find``, once
    found), else a caller's hint for that caller's call (see the module docstring).

    ``find``: returns the queue's own job server or raises ClusterUnavailableError (asked
    again at each request until it answers); ``session``: the session name of the queue's
    cluster; ``timeout_s``: each request's timeout (> 0).
    """

    def __init__(self, find: Callable[[], JobServer] = own_job_server,
                 session: Callable[[], str] = own_session,
                 timeout_s: float = REQUEST_TIMEOUT_S) -> None:
        if not timeout_s > 0:
            raise ConfigError(f"job server request timeout_s={timeout_s}: must be > 0 seconds")
        self.timeout_s = timeout_s
        self._find = find
        self._session = session
        self._own: JobServer | None = None
        self._missing = ""  # why the own server was last not found (logged once each)
        self._lock = threading.Lock()

    @classmethod
    def fixed(cls, server: JobServer, timeout_s: float = REQUEST_TIMEOUT_S) -> QueueServer:
        """Always ``server``: a process that is not the queue's actor (a tool, a test)."""
        return cls(find=lambda: server, session=lambda: "", timeout_s=timeout_s)

    def own(self) -> JobServer | None:
        """The queue's own job server; None while it cannot be found (logged)."""
        with self._lock:
            if self._own is not None:
                return self._own
            try:
                found = self._find()
            except ClusterUnavailableError as exc:
                if str(exc) != self._missing:
                    logger.warning("the queue has no job server of its own now: %s", exc)
                    self._missing = str(exc)
                return None
            logger.info("the queue talks to its cluster's job server at %s",
                        redact_url(found.address))
            self._own = found
            return found

    def current(self) -> JobServer:
        """The job server for a request made now.

        Raises:
            ClusterUnavailableError: the queue has not found its own, and the call this
                request serves brought no hint that answered as this cluster's.
        """
        own = self.own()
        if own is not None:
            return own
        hint = _CALLERS_SERVER.get()
        if hint is not None:
            return hint
        raise ClusterUnavailableError(
            f"the queue has no job server of its own cluster ({self._missing}); it tries "
            "again at each request")

    @contextlib.contextmanager
    def hinted(self, hint: JobServer | None) -> Iterator[None]:
        """Around one caller's call: while the queue has no job server of its own, ``hint``
        (the caller's) serves this call's requests, once it answered as this cluster's; no
        other call's, and not after this one."""
        if hint is None or self.own() is not None:
            yield
            return
        token = _CALLERS_SERVER.set(hint if self.same_cluster(hint) else None)
        try:
            yield
        finally:
            _CALLERS_SERVER.reset(token)

    def same_cluster(self, server: JobServer) -> bool:
        """Whether ``server`` answers, within the timeout, as this cluster's job server (the
        same session name); False, logged, when it does not answer or serves another."""
        where = redact_url(server.address)
        try:
            theirs = session_of(server, self.timeout_s)
        except (requests.RequestException, ValueError) as exc:
            logger.warning("not using the caller's job server %s: it did not answer as one "
                           "(%s)", where, redact_text(str(exc))[:200])
            return False
        ours = self._session()
        if theirs != ours:
            logger.warning("not using the caller's job server %s: it serves another cluster "
                           "(session %r, this one is %r)", where, theirs, ours)
            return False
        return True
