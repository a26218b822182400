"""Submitting a job to a Ray cluster's job server, as ``ray job submit`` does, with raydeck's
contract (run id, preset, run name) on top.

- :mod:`~raydeck.jobs.submission`: :class:`JobRequest`, :class:`JobServer` (a token-authenticated
  ``JobSubmissionClient``), submitting, waiting, logs, listing, and the MLflow run a job wrote.
- :mod:`~raydeck.jobs.job_client`: Ray's job client with a timeout on every request and only
  the headers raydeck chose.
- :mod:`~raydeck.jobs.address`: which job server a command talks to (``--address``,
  ``RAY_API_SERVER_ADDRESS``, ``RAY_ADDRESS``, the running stack, the GCS's record).
- :mod:`~raydeck.jobs.probe`: a short job that asks the cluster, before the real one, whether
  raydeck imports there and the preset fits.
- :mod:`~raydeck.jobs.runtime_env`: runtime env files (``runtime_envs/``), their ``${NAME}``
  values and the check that no secret is written in one.
"""

from raydeck.jobs.submission import JobRequest, JobServer, RunLink, find_run, new_run_id

__all__ = ["JobRequest", "JobServer", "RunLink", "find_run", "new_run_id"]
