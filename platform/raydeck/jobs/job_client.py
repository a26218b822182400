"""Ray's job client with a timeout on every request and exactly the headers its caller chose.

Owns: :func:`bounded_job_client`. Why it exists: Ray's ``JobSubmissionClient`` sends its HTTP
requests without a timeout, the version checks its constructor makes included, so a dashboard
that accepts connections and never answers (a port-forward whose far end is gone, a stuck
dashboard) holds the caller forever; and it merges the token of its own process's Ray into
every request that carries none, whichever address that is. Does not own which server or
token (:class:`raydeck.jobs.submission.JobServer`).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from ray.job_submission import JobSubmissionClient

Headers = Callable[[], Mapping[str, str]]


def bounded_job_client(address: str, headers: Headers, timeout_s: float
                       ) -> JobSubmissionClient:
    """A ``JobSubmissionClient`` for the job server at ``address`` whose every request
    (connect, and each wait for an answer) ends within ``timeout_s`` and carries ``headers()``,
    asked again for each request (a token file that rotates is read anew), and nothing else.

    Raises:
        requests.Timeout: the server did not answer its version check in time (a
            ``ConnectionError`` when nothing answers, as Ray's own client raises).
    """
    return _client_class()(address, headers, timeout_s)


@functools.cache
def _client_class() -> Callable[[str, Headers, float], JobSubmissionClient]:
    """Made on first use: importing Ray's client costs start-up time every command would pay."""
    from ray.job_submission import JobSubmissionClient

    class BoundedJobClient(JobSubmissionClient):
        def __init__(self, address: str, headers: Headers, timeout_s: float) -> None:
            # Set before Ray's constructor runs: its version checks are requests too.
            self._timeout_s = timeout_s
            self._chosen_headers = headers
            super().__init__(address, headers=dict(headers()))

        def _do_request(self, method: str, endpoint: str, **kwargs: Any) -> Any:
            # Every request of Ray's client goes through here; its other keywords reach
            # requests.request. Ray's constructor merged its own process's token in.
            self._headers = dict(self._chosen_headers())
            kwargs.setdefault("timeout", self._timeout_s)
            return super()._do_request(method, endpoint, **kwargs)

    return BoundedJobClient
