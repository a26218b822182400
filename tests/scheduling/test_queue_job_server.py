"""Which job server the queue talks to, and that every request to it ends (issue 52, items 1
and 4).

The queue talks to its own cluster's job server, found from the cluster it is connected to; a
caller's address is at most a hint, used only while the queue has found none of its own, only
for that caller's call, and only once it answered as this cluster's (the session name of
``GET /api/version``). Every request has a timeout, building Ray's job client included: against
a real socket that accepts connections and never answers, each call fails within one timeout
and holds no thread, the queue's listing (what ``raydeck queue`` asks) still answers, and once
the job server answers again the jobs start.

The servers are real sockets: a black hole (accepts, never answers); a front that black-holes
until told to forward; a small HTTP server answering as a Ray dashboard answers a job client
(its version and session name, its job list, a submission), for this cluster or another one;
and, for finding the queue's own job server, the session's Ray and its dashboard. The session's
Ray takes no job here: its dashboard agent may be missing (another Ray on the machine holding
its default port), which no test of the queue's requests should depend on.
"""

from __future__ import annotations

import contextlib
import json
import socket
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import pytest
import requests

from raydeck.config.secrets import Secret
from raydeck.errors import ClusterUnavailableError
from raydeck.jobs.submission import JobServer
from raydeck.scheduling.policies.core import Resources
from raydeck.scheduling.queue.failures import Backoff
from raydeck.scheduling.queue.job_queue import JobQueue, JobSpec
from raydeck.scheduling.queue.job_server import QueueServer, own_job_server, own_session
from raydeck.scheduling.queue.launcher import TimedLauncher
from raydeck.scheduling.queue.ray_jobs import RayJobs
from raydeck.scheduling.queue.serve_apps import RayServe
from raydeck.scheduling.queue.store import Store
from tests.fixtures.processes import wait_until

pytestmark = pytest.mark.timeout(60)

HOST = "127.0.0.1"
# Small, so a request to a server that never answers ends soon; a parameter, as on the head.
TIMEOUT_S = 0.5
OURS = "session_ours"


class _Front:
    """A real listening socket that accepts every connection and, while it hangs, never
    answers (a port-forward whose far end is gone, a dashboard stuck); once told to
    :meth:`answer`, it forwards new connections to ``target_port``."""

    def __init__(self, target_port: int | None = None) -> None:
        self._target_port = target_port
        self._listener = socket.create_server((HOST, 0))
        self.url = f"http://{HOST}:{self._listener.getsockname()[1]}"
        self.accepted = 0
        self._hanging = True
        self._open: list[socket.socket] = []
        self._lock = threading.Lock()
        threading.Thread(target=self._accept, daemon=True).start()

    def answer(self) -> None:
        assert self._target_port is not None, "a black hole has nothing to forward to"
        self._hanging = False

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self._listener.accept()
            except OSError:  # closed
                return
            with self._lock:
                self.accepted += 1
                self._open.append(client)
                if self._hanging:
                    continue  # held open, never read, never answered
                assert self._target_port is not None
                upstream = socket.create_connection((HOST, self._target_port))
                self._open.append(upstream)
            for source, sink in ((client, upstream), (upstream, client)):
                threading.Thread(target=_pump, args=(source, sink), daemon=True).start()

    def close(self) -> None:
        with self._lock:
            for sock in (self._listener, *self._open):
                with contextlib.suppress(OSError):
                    sock.shutdown(socket.SHUT_RDWR)
                sock.close()


def _pump(source: socket.socket, sink: socket.socket) -> None:
    with contextlib.suppress(OSError):
        while data := source.recv(65536):
            sink.sendall(data)
    with contextlib.suppress(OSError):
        sink.shutdown(socket.SHUT_WR)


class _Dashboard:
    """An HTTP server answering as a Ray dashboard of session ``session`` answers a job client:
    its version, its job list, a submission (a job it has never had: 200, else 400, as Ray's);
    records each request's method, path and Authorization header."""

    def __init__(self, session: str) -> None:
        seen: list[tuple[str, str]] = []
        jobs: dict[str, dict[str, Any]] = {}
        self.seen, self.jobs = seen, jobs
        version = {"version": "4", "ray_version": "2.60.0", "ray_commit": "",
                   "session_name": session}

        class Handler(BaseHTTPRequestHandler):
            def _answer(self, status: int, body: Any) -> None:
                data = json.dumps(body).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def do_GET(self) -> None:  # http.server calls it by this name
                seen.append((self.path, self.headers.get("Authorization", "")))
                body = {"/api/version": version, "/api/jobs/": list(jobs.values())}.get(self.path)
                self._answer(404 if body is None else 200, body)

            def do_POST(self) -> None:  # http.server calls it by this name
                seen.append((self.path, self.headers.get("Authorization", "")))
                if self.path != "/api/jobs/":
                    self._answer(404, None)
                    return
                job = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                sid = job["submission_id"]
                if sid in jobs:
                    self._answer(400, f"Job with submission_id {sid} already exists.")
                    return
                jobs[sid] = {"type": "SUBMISSION", "submission_id": sid, "status": "RUNNING",
                             "entrypoint": job["entrypoint"], "runtime_env": job["runtime_env"],
                             "metadata": job.get("metadata") or {}}
                self._answer(200, {"job_id": sid, "submission_id": sid})

            def log_message(self, *args: Any) -> None:
                return

        self._server = ThreadingHTTPServer((HOST, 0), Handler)
        self.url = f"http://{HOST}:{self._server.server_address[1]}"
        self.port = self._server.server_address[1]
        threading.Thread(target=self._server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()


class _OneNode(RayJobs):
    """Ray's launcher as it is, on one 4-CPU node (the cluster's resources come from Ray's
    state, which no request of these tests is about)."""

    def resources(self) -> tuple[tuple[Resources, ...], tuple[Resources, ...]]:
        return (Resources(cpus=4),), (Resources(cpus=4),)


@pytest.fixture
def black_hole() -> Iterator[_Front]:
    front = _Front()
    yield front
    front.close()


@contextlib.contextmanager
def _dashboard(session: str) -> Iterator[_Dashboard]:
    server = _Dashboard(session)
    try:
        yield server
    finally:
        server.close()


def _none_of_its_own() -> JobServer:
    raise ClusterUnavailableError("the head registered no job server")


def _homeless() -> QueueServer:
    """The queue's servers on a head whose own job server cannot be found."""
    return QueueServer(find=_none_of_its_own, session=lambda: OURS, timeout_s=TIMEOUT_S)


def _spec(job_id: str) -> JobSpec:
    return JobSpec(job_id, "a", 0, "custom", Resources(cpus=0.01), job_id,
                   f"echo {job_id}", {})


# --- every request has a timeout (item 4) ---------------------------------------------------
def test_building_a_job_client_against_a_server_that_never_answers_fails_within_its_timeout(
        black_hole: _Front) -> None:
    # Ray's client asks the server's version when it is made: that request had no timeout.
    with pytest.raises(ClusterUnavailableError, match=r"did not answer within 0\.5 s"):
        JobServer(black_hole.url).client(timeout_s=TIMEOUT_S)
    assert black_hole.accepted >= 1


def test_every_launcher_and_serve_call_to_a_server_that_never_answers_ends(
        black_hole: _Front) -> None:
    servers = QueueServer.fixed(JobServer(black_hole.url), timeout_s=TIMEOUT_S)
    jobs = RayJobs(servers)
    with pytest.raises(ClusterUnavailableError, match="did not answer within"):
        jobs.statuses(["a"])
    with pytest.raises(ClusterUnavailableError, match="did not answer within"):
        jobs.stop("a")
    assert jobs.log_tail("a") == ""  # its contract: "" when it cannot be read
    assert jobs.placed("a") is False
    serve = RayServe(servers)
    with pytest.raises(requests.Timeout):
        serve.applications()
    assert serve.read() == []  # the queue goes on without Serve's replicas for this tick


def test_a_job_server_that_never_answers_holds_no_thread_and_jobs_start_once_it_answers(
        tmp_path: Path) -> None:
    with _dashboard(OURS) as dashboard:
        front = _Front(dashboard.port)  # hangs until told to answer
        servers = QueueServer.fixed(JobServer(front.url), timeout_s=TIMEOUT_S)
        queue = JobQueue(Store(f"sqlite:///{tmp_path / 'q.db'}"),
                         TimedLauncher(_OneNode(servers), 10.0), serve=RayServe(servers),
                         backoff=Backoff(0.1, 0.1))
        # Each job is asked after twice (whether the job server has it, then its submission):
        # more calls than the launcher has threads. Unbounded, each would hold its thread for
        # good, and no later call could run.
        ids = [f"hang-{n}" for n in range(3)]
        try:
            for job_id in ids:
                queue.submit(_spec(job_id))
            assert queue.tick() == []
            # The listing (what raydeck queue asks) answers while the job server does not.
            reasons = {entry.job.id: entry.why for entry in queue.listing()}
            assert set(reasons) == set(ids)
            for why in reasons.values():
                assert why.startswith("submission failed 1x (ClusterUnavailableError"), why
                assert "did not answer within 0.5 s" in why, why
            assert dashboard.seen == []
            front.answer()
            started: set[str] = set()

            def all_started() -> bool:
                started.update(queue.tick())
                return started == set(ids)

            wait_until(all_started, 30, "the queued jobs to start once the job server answers")
            assert set(dashboard.jobs) == {e.job.submission_id for e in queue.listing()}
        finally:
            front.close()


# --- a caller's job server is at most a hint (item 1) ---------------------------------------
def test_a_callers_job_server_is_never_asked_while_the_queue_has_its_own(
        black_hole: _Front) -> None:
    with _dashboard(OURS) as own:
        servers = QueueServer(find=lambda: JobServer(own.url), session=lambda: OURS,
                              timeout_s=TIMEOUT_S)
        with servers.hinted(JobServer(black_hole.url)):
            assert servers.current() == JobServer(own.url)
            assert RayJobs(servers).statuses(["a"]) == {}
    assert black_hole.accepted == 0


def test_a_hint_that_never_answers_or_serves_another_cluster_is_not_used(
        black_hole: _Front) -> None:
    servers = _homeless()
    with _dashboard("session_another_cluster") as another:
        for hint in (JobServer(black_hole.url), JobServer(another.url)):
            with servers.hinted(hint), pytest.raises(ClusterUnavailableError,
                                                      match="no job server of its own"):
                servers.current()
        # Asked who it is, and nothing else: no job list read from another cluster.
        assert [path for path, _ in another.seen] == ["/api/version"]
    assert black_hole.accepted == 1


def test_a_hint_of_this_cluster_serves_its_callers_call_only() -> None:
    servers = _homeless()
    launcher = TimedLauncher(RayJobs(servers), timeout_s=10.0)
    with _dashboard(OURS) as ours:
        hint = JobServer(ours.url, Secret("callers-token"))
        other_calls: list[BaseException] = []
        with servers.hinted(hint):
            # The caller's own requests go there, in the launcher's threads too...
            assert launcher.statuses(["a"]) == {}

            # ...and no other call's (the tick's, in its own thread).
            def tick() -> None:
                try:
                    launcher.statuses(["a"])
                except BaseException as exc:
                    other_calls.append(exc)

            ticking = threading.Thread(target=tick)
            ticking.start()
            ticking.join(10)
        assert len(other_calls) == 1 and isinstance(other_calls[0], ClusterUnavailableError)
        # Not stored: after the call, the queue has no job server again.
        with pytest.raises(ClusterUnavailableError, match="no job server of its own"):
            launcher.statuses(["a"])
        # It carried the caller's token, never another.
        assert {auth for _, auth in ours.seen} == {"Bearer callers-token"}
        assert ("/api/jobs/", "Bearer callers-token") in ours.seen


# --- with the session's Ray: its own job server, found from the cluster ---------------------
def _own_when_registered() -> JobServer:
    found: list[JobServer] = []

    def registered() -> bool:
        with contextlib.suppress(ClusterUnavailableError):
            found.append(own_job_server())
        return bool(found)

    wait_until(registered, 60, "the session's dashboard to register in the GCS")
    return found[0]


@pytest.mark.timeout(300)
def test_the_queue_finds_its_clusters_job_server_and_checks_a_hint_by_its_session(
        ray_cluster: None, black_hole: _Front) -> None:
    import ray

    own = _own_when_registered()
    node = ray._private.worker.global_worker.node
    assert node is not None
    assert own.address == f"http://{node.address_info['webui_url']}"
    servers = QueueServer(timeout_s=TIMEOUT_S)
    assert servers.current() == own
    # The same dashboard through another address (a port-forward) is this cluster's...
    forward = _Front(urlsplit(own.address).port)
    forward.answer()
    try:
        assert servers.same_cluster(JobServer(forward.url, own.token))
    finally:
        forward.close()
    # ...another cluster's dashboard and a dead port-forward are not.
    with _dashboard("session_another_cluster") as another:
        assert own_session() != "session_another_cluster"
        assert not servers.same_cluster(JobServer(another.url))
    assert not servers.same_cluster(JobServer(black_hole.url))
