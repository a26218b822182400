"""Why a job's submission to the job server failed, and whether trying again can help.

Owns: :func:`classify` (one place that reads what Ray's job client raises) and :class:`Backoff`
(when a job whose submission failed transiently is tried again). Does not own what the queue
does with a verdict (:meth:`raydeck.scheduling.queue.job_queue.JobQueue.tick`: a permanent failure
fails that job, a transient one puts it back with a retry time; neither holds up other jobs).

What Ray's job client (``JobSubmissionClient``, run by the queue on the head) raises:

- ``ValueError`` / ``TypeError`` from its runtime-env checks before any request (a
  ``py_modules`` path or a ``pip``/``conda`` file missing on the head, a working-dir package
  over Ray's size limit): the job's own runtime env is wrong; **permanent**.
- ``RuntimeError("Request failed with status code N: ...")`` for an HTTP answer other than
  200: 4xx is the server refusing this job (**permanent**) except 408 and 429 (it was busy);
  5xx is the server failing (**transient**).
- ``requests`` connection errors and timeouts (the dashboard restarting, a slow head):
  **transient**. So is anything else: a failure that is not shown to be the job's fault is
  retried (visibly, with backoff) rather than failing a job that may be fine.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from raydeck._internal.redaction import redact_text
from raydeck.errors import ConfigError, JobSubmissionError

# Ray's job client words every HTTP failure this way (``SubmissionClient._raise_error``).
_HTTP_STATUS = re.compile(r"status code (\d{3})")
_RETRYABLE_4XX = (408, 429)  # request timeout, too many requests: the server was busy
_REASON_CHARS = 300


@dataclass(frozen=True)
class Failure:
    """A classified submission failure.

    ``permanent``: trying the same job again fails the same way. ``reason``: one line for
    ``raydeck queue`` (redacted). ``http_status``: the job server's answer, if it gave one.
    ``unanswered``: the request may have reached the job server and its answer not come back
    (a read timeout, the queue's own bound): a submission may have landed.
    """

    permanent: bool
    reason: str
    http_status: int | None = None
    unanswered: bool = False


def classify(exc: BaseException) -> Failure:
    """The verdict on ``exc``, raised by a launcher's ``submit`` or ``stop`` (see module docs)."""
    import requests

    line = _first_line(exc)
    if isinstance(exc, requests.RequestException):
        # Checked before ValueError: some of requests' errors (InvalidURL...) are ValueErrors
        # too, and they are the queue's configuration, not the job's fault.
        return Failure(False, f"job server unreachable ({type(exc).__name__}: {line})",
                       unanswered=isinstance(exc, requests.ReadTimeout))
    if isinstance(exc, (ValueError, TypeError, JobSubmissionError)):
        what = "runtime env" if not isinstance(exc, (ConfigError, JobSubmissionError)) else "job"
        return Failure(True, f"{what} refused on the head: {line}")
    status = http_status(exc)
    if status is not None:
        permanent = 400 <= status < 500 and status not in _RETRYABLE_4XX
        return Failure(permanent, f"job server answered {status}: {line}", status)
    # A TimeoutError: the queue's bound on a call (raydeck.scheduling.queue.launcher).
    return Failure(False, f"{type(exc).__name__}: {line}",
                   unanswered=isinstance(exc, TimeoutError))


def http_status(exc: BaseException) -> int | None:
    """The HTTP status in an error from Ray's job client, if it carries one."""
    if not isinstance(exc, RuntimeError):
        return None
    match = _HTTP_STATUS.search(str(exc))
    return int(match.group(1)) if match else None


def _first_line(exc: BaseException) -> str:
    text = redact_text(str(exc)).strip()
    return (text.splitlines()[0] if text else type(exc).__name__)[:_REASON_CHARS]


@dataclass(frozen=True)
class Backoff:
    """Exponential backoff for a job whose submission failed transiently: the ``n``-th
    consecutive failure waits ``min(initial_s * 2 ** (n - 1), max_s)`` before the next try.

    ``initial_s``: the wait after the first failure (> 0). ``max_s``: the cap (>= initial_s),
    so a job server that is down for hours is still tried every ``max_s``.
    """

    initial_s: float = 10.0
    max_s: float = 600.0

    def __post_init__(self) -> None:
        if not self.initial_s > 0:
            raise ConfigError(f"backoff initial_s={self.initial_s}: must be > 0 seconds")
        if not self.max_s >= self.initial_s:
            raise ConfigError(f"backoff max_s={self.max_s}: must be >= initial_s "
                              f"({self.initial_s})")

    def delay_s(self, failures: int) -> float:
        """The wait after ``failures`` (>= 1) consecutive transient failures."""
        # The exponent is capped so a job failing for weeks never overflows a float.
        return min(self.initial_s * 2.0 ** min(max(failures - 1, 0), 60), self.max_s)
