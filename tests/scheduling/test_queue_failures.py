"""One bad job never jams the queue: the real :class:`JobQueue` in front of a job server that
fails the way Ray's does.

The fake job server raises exactly what Ray's job client raises on the head: its runtime-env
checks are Ray's own functions (the steps ``JobSubmissionClient.submit_job`` runs before its
request), its HTTP refusals carry the text of Ray's ``SubmissionClient._raise_error``, and an
unreachable dashboard is requests' ``ConnectionError``. A permanent failure fails that job with
its reason and the next job starts in the same tick; a transient one is retried with backoff
(kept in the store across a queue restart) and starts once the server recovers; ``cancel``
works on a job in any state. ``head_runtime_env`` refuses at ``raydeck submit --queue`` what
the head would refuse.
"""

from __future__ import annotations

import sqlite3
from collections.abc import Collection
from pathlib import Path
from typing import Any

import pytest
import requests

from raydeck.errors import ConfigError, JobSubmissionError
from raydeck.scheduling.policies.core import Resources
from raydeck.scheduling.queue.client import head_runtime_env
from raydeck.scheduling.queue.failures import Backoff, classify
from raydeck.scheduling.queue.identity import Identity
from raydeck.scheduling.queue.job_queue import JobQueue, JobSpec, Launcher
from raydeck.scheduling.queue.launcher import JobState
from raydeck.scheduling.queue.store import JobRow, Store

pytestmark = pytest.mark.timeout(60)

MISSING_MODULE = "/nonexistent/checkout/platform/raydeck"


def _no_upload(*_: Any, **__: Any) -> None:
    return None


def _http_error(status: int, text: str) -> RuntimeError:
    """What Ray's job client raises for an HTTP answer other than 200 (its own code)."""
    from ray.dashboard.modules.dashboard_sdk import SubmissionClient

    response = requests.Response()
    response.status_code = status
    response._content = text.encode()
    try:
        SubmissionClient._raise_error(None, response)  # type: ignore[arg-type]
    except RuntimeError as exc:
        return exc
    raise AssertionError("Ray's client raises for every non-200 answer")


def _unreachable() -> requests.ConnectionError:
    return requests.ConnectionError(
        "HTTPConnectionPool(host='127.0.0.1', port=8265): Max retries exceeded with url: "
        "/api/jobs/ (Caused by NewConnectionError('Failed to establish a new connection: "
        "[Errno 111] Connection refused'))")


class _JobServer(Launcher):
    """One 4-CPU node behind a job server that checks runtime envs as Ray's client does on the
    head and answers each submission from ``answers[job id]`` (in turn) while it has one."""

    def __init__(self) -> None:
        self.jobs: dict[str, str] = {}
        self.answers: dict[str, list[Exception]] = {}
        self.status_error: Exception | None = None
        self.stop_error: Exception | None = None
        self.stopped: list[str] = []

    def submit(self, row: JobRow, package: bytes | None) -> None:
        import json

        from ray._private.runtime_env.py_modules import upload_py_modules_if_needed
        from ray._private.runtime_env.working_dir import upload_working_dir_if_needed
        from ray.runtime_env import RuntimeEnv

        runtime_env = json.loads(row.runtime_env)
        upload_working_dir_if_needed(runtime_env, include_gitignore=True, upload_fn=_no_upload)
        upload_py_modules_if_needed(runtime_env, include_gitignore=True, upload_fn=_no_upload)
        RuntimeEnv(**runtime_env)
        pending = self.answers.get(row.id)
        if pending:
            raise pending.pop(0)
        self.jobs[row.submission_id] = "RUNNING"

    def statuses(self, submission_ids: Collection[str]) -> dict[str, JobState]:
        if self.status_error is not None:
            raise self.status_error
        return {s: JobState(self.jobs[s]) for s in submission_ids if s in self.jobs}

    def log_tail(self, submission_id: str) -> str:
        return ""

    def stop(self, submission_id: str) -> None:
        if self.stop_error is not None:
            raise self.stop_error
        if submission_id not in self.jobs:
            raise _http_error(404, f"Job {submission_id} does not exist")
        self.stopped.append(submission_id)
        self.jobs[submission_id] = "STOPPED"

    def resources(self) -> tuple[tuple[Resources, ...], tuple[Resources, ...]]:
        used = sum(1 for status in self.jobs.values() if status == "RUNNING") * 2
        return (Resources(cpus=4 - used),), (Resources(cpus=4),)

    def placed(self, submission_id: str) -> bool:
        return True


def _spec(job_id: str, runtime_env: dict[str, Any] | None = None) -> JobSpec:
    return JobSpec(job_id, "a", 0, "custom", Resources(cpus=2), job_id, "python job.py",
                   runtime_env or {})


def _queue(tmp_path: Path, server: _JobServer, clock: list[float]) -> JobQueue:
    return JobQueue(Store(f"sqlite:///{tmp_path / 'q.db'}"), server, clock=lambda: clock[0],
                    backoff=Backoff(initial_s=10.0, max_s=25.0))


def _state(queue: JobQueue, job_id: str) -> tuple[str, str]:
    (entry,) = [e for e in queue.listing() if e.job.id == job_id]
    return entry.job.state, entry.why


@pytest.mark.parametrize(("runtime_env", "ray_says"), [
    ({"py_modules": [MISSING_MODULE]}, "py_modules entry must be a .py file"),
    ({"pip": "requirements.txt"}, "requirements.txt is not a valid file"),
    ({"conda": "environment.yml"}, "Can't find conda YAML file"),
], ids=["py_modules", "pip", "conda"])
def test_a_runtime_env_the_head_rejects_fails_that_job_and_the_next_starts_in_the_same_tick(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, runtime_env: dict[str, Any],
        ray_says: str) -> None:
    monkeypatch.chdir(tmp_path)  # the head has no requirements.txt or environment.yml
    server, clock = _JobServer(), [100.0]
    queue = _queue(tmp_path, server, clock)
    queue.configure(Identity.here(), "fifo")
    queue.submit(_spec("bad", runtime_env))
    clock[0] += 1
    for job_id in ("next-1", "next-2"):  # with "bad" they need 6 of the node's 4 CPUs
        queue.submit(_spec(job_id))
    assert queue.tick() == ["next-1", "next-2"]
    state, why = _state(queue, "bad")
    assert state == "failed" and why.startswith("not started: runtime env refused on the head")
    assert ray_says in why
    clock[0] += 60
    assert queue.tick() == []  # never submitted again


@pytest.mark.parametrize("status", [400, 404, 403])
def test_a_job_the_job_server_refuses_with_a_4xx_fails_and_others_start(
        tmp_path: Path, status: int) -> None:
    server, clock = _JobServer(), [100.0]
    queue = _queue(tmp_path, server, clock)
    queue.submit(_spec("bad"))
    queue.submit(_spec("good"))
    server.answers["bad"] = [_http_error(status, "entrypoint_resources: unknown resource")]
    assert queue.tick() == ["good"]
    state, why = _state(queue, "bad")
    assert state == "failed"
    assert why == (f"not started: job server answered {status}: Request failed with status "
                   f"code {status}: entrypoint_resources: unknown resource.")


@pytest.mark.parametrize("failures", [
    [_http_error(500, "Internal Server Error"), _unreachable(), _http_error(503, "busy")],
    [_unreachable(), _http_error(429, "slow down"), _http_error(408, "timeout")],
], ids=["5xx-then-unreachable", "unreachable-then-429-408"])
def test_a_transient_failure_is_retried_with_backoff_and_starts_once_the_server_recovers(
        tmp_path: Path, failures: list[Exception]) -> None:
    server, clock = _JobServer(), [100.0]
    queue = _queue(tmp_path, server, clock)
    queue.submit(_spec("flaky"))
    clock[0] += 1
    queue.submit(_spec("other"))
    server.answers["flaky"] = list(failures)
    assert queue.tick() == ["other"]  # flaky failed first; the job behind it starts
    state, why = _state(queue, "flaky")
    assert state == "queued" and why.startswith("submission failed 1x (")
    # Backoff 10 s, 20 s, then capped at 25 s; the wait survives a queue restart.
    for failed, wait_s in ((1, 10.0), (2, 20.0), (3, 25.0)):
        clock[0] += wait_s - 1
        queue = _queue(tmp_path, server, clock)
        assert queue.tick() == [] and len(server.answers["flaky"]) == 3 - failed, "too early"
        clock[0] += 1
        assert queue.tick() == ([] if failed < 3 else ["flaky"])
    assert server.jobs["flaky"] == "RUNNING"
    queue.tick()
    state, why = _state(queue, "flaky")
    assert (state, why) == ("running", "running")


def test_statuses_that_cannot_be_read_do_not_stop_the_tick(tmp_path: Path) -> None:
    server, clock = _JobServer(), [100.0]
    queue = _queue(tmp_path, server, clock)
    queue.submit(_spec("running"))
    assert queue.tick() == ["running"]
    server.status_error = _unreachable()
    queue.submit(_spec("next"))
    assert queue.tick() == ["next"]


def test_cancel_works_in_every_state(tmp_path: Path) -> None:
    server, clock = _JobServer(), [100.0]
    queue = _queue(tmp_path, server, clock)
    for job_id in ("running", "refused", "retrying", "starting", "queued"):
        queue.submit(_spec(job_id))
        clock[0] += 1
    server.answers["refused"] = [_http_error(400, "bad request")]
    server.answers["retrying"] = [_unreachable()]
    assert queue.tick() == ["running", "starting"]
    # The queue stopped after recording "never-sent" as starting and before submitting it.
    queue.submit(_spec("never-sent"))
    Store(f"sqlite:///{tmp_path / 'q.db'}").update("never-sent", state="starting",
                                                   started_at=clock[0])
    assert [_state(queue, j)[0] for j in ("refused", "retrying", "never-sent", "queued")] == [
        "failed", "queued", "starting", "queued"]
    cancelled = {job_id: queue.cancel(job_id, Identity.here())
                 for job_id in ("running", "refused", "retrying", "never-sent", "queued")}
    assert {view.state for view in cancelled.values()} == {"cancelled"}
    assert server.stopped == ["running"]
    assert cancelled["refused"].reason == ("cancelled by raydeck cancel (it had failed: not "
                                           "started: job server answered 400: Request failed "
                                           "with status code 400: bad request.)")
    assert [e.job.id for e in queue.listing()] == ["starting"]
    with pytest.raises(ConfigError, match="already ended"):
        queue.cancel("running", Identity.here())
    # A job server that cannot be reached cannot stop a running job: it says so, and the job
    # stays running rather than being forgotten while it runs.
    server.stop_error = _unreachable()
    assert queue.tick() == []
    with pytest.raises(ConfigError, match="cannot stop job starting now: job server unreachable"):
        queue.cancel("starting", Identity.here())
    assert _state(queue, "starting")[0] == "running"


@pytest.mark.parametrize(("exc", "permanent", "status"), [
    (ValueError("py_modules entry must be a .py file, a directory, or a .whl file"), True, None),
    (TypeError("working_dir must be a string or Path"), True, None),
    (JobSubmissionError("its working dir package is gone and was not kept"), True, None),
    (_http_error(400, "bad"), True, 400),
    (_http_error(404, "no such job"), True, 404),
    (_http_error(408, "timeout"), False, 408),
    (_http_error(429, "busy"), False, 429),
    (_http_error(500, "Internal Server Error"), False, 500),
    (_http_error(503, "unavailable"), False, 503),
    (_unreachable(), False, None),
    (requests.Timeout("read timed out"), False, None),
    (requests.exceptions.InvalidURL("bad url"), False, None),  # a ValueError, but not the job's
    (RuntimeError("Failed to store package in the GCS."), False, None),
])
def test_every_submission_failure_is_classified(exc: Exception, permanent: bool,
                                                status: int | None) -> None:
    failure = classify(exc)
    assert (failure.permanent, failure.http_status) == (permanent, status)
    assert "\n" not in failure.reason and failure.reason


def test_backoff_doubles_up_to_its_cap_and_names_a_bad_field() -> None:
    backoff = Backoff(initial_s=5.0, max_s=30.0)
    assert [backoff.delay_s(n) for n in (1, 2, 3, 4, 10_000)] == [5.0, 10.0, 20.0, 30.0, 30.0]
    with pytest.raises(ConfigError, match="initial_s=0"):
        Backoff(initial_s=0)
    with pytest.raises(ConfigError, match="max_s=1"):
        Backoff(initial_s=5.0, max_s=1.0)


def test_a_queue_database_from_before_retries_gets_the_retry_columns(tmp_path: Path) -> None:
    path = tmp_path / "q.db"  # the one _queue opens
    Store(f"sqlite:///{path}")
    with sqlite3.connect(path) as db:  # as the previous raydeck left it
        db.execute("ALTER TABLE raydeck_queue_jobs DROP COLUMN retry_at")
        db.execute("ALTER TABLE raydeck_queue_jobs DROP COLUMN submit_failures")
    server, clock = _JobServer(), [100.0]
    queue = _queue(tmp_path, server, clock)
    queue.submit(_spec("flaky"))
    server.answers["flaky"] = [_unreachable()]
    assert queue.tick() == []
    row = Store(f"sqlite:///{path}").get("flaky")
    assert row is not None and (row.submit_failures, row.retry_at) == (1, 110.0)


# --- at `raydeck submit --queue` -------------------------------------------------------------
def test_submit_refuses_a_py_modules_path_the_head_cannot_have(tmp_path: Path) -> None:
    module = tmp_path / "mylib"
    module.mkdir()
    with pytest.raises(ConfigError) as refused:
        head_runtime_env({"py_modules": [str(module)]}, head_is_local=False)
    assert str(refused.value) == (
        f"runtime env py_modules path '{module}' must exist on the head, which is not this "
        "machine; use working_dir (it travels with the job) or a remote URI (s3://.../x.zip)")
    # A head on this machine reads the same path: it passes, as the head's check will.
    assert head_runtime_env({"py_modules": [str(module)]}, head_is_local=True) == {
        "py_modules": [str(module)]}
    with pytest.raises(ConfigError, match=r"^runtime env py_modules: py_modules entry must be a "
                                          r".py file.*; use working_dir"):
        head_runtime_env({"py_modules": [MISSING_MODULE]}, head_is_local=True)


def test_submit_reads_a_requirements_file_here_as_rays_client_would(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ConfigError, match=r"^runtime env pip: requirements.txt is not a valid "
                                          r"file; list the packages"):
        head_runtime_env({"pip": "requirements.txt"}, head_is_local=True)
    (tmp_path / "requirements.txt").write_text("numpy\nrequests==2.32.3\n")
    stored = head_runtime_env({"pip": "requirements.txt", "env_vars": {"A": "1"}},
                              head_is_local=False)
    assert stored["pip"]["packages"] == ["numpy", "requests==2.32.3"]
    assert stored["env_vars"] == {"A": "1"}
    # What is stored passes the head's checks from anywhere: the file is no longer needed.
    (tmp_path / "requirements.txt").unlink()
    server, clock = _JobServer(), [100.0]
    queue = _queue(tmp_path, server, clock)
    queue.submit(_spec("inlined", stored))
    assert queue.tick() == ["inlined"]

