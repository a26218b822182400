"""Writing one shard's data to MLflow: chunking to MLflow's limits, isolating bad values.

Owns: the split of a run's points/params/tags into ``log_batch`` calls within MLflow's per-call
limits, artifact uploads, and the policy that tells a passing failure (retry later) from a
permanent refusal (isolate the offending value, keep the rest). Does not own: retries and
backoff (the shard's writer loop) or durability (the spool).
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Sequence
from pathlib import Path

from mlflow.entities import Metric, Param, RunTag
from mlflow.exceptions import MlflowException
from mlflow.tracking import MlflowClient
from mlflow.utils.validation import (
    MAX_ENTITIES_PER_BATCH,
    MAX_METRICS_PER_BATCH,
    MAX_PARAMS_TAGS_PER_BATCH,
)

from raydeck.tracking.messages import Point

logger = logging.getLogger(__name__)

# MLflow's client retries a failed request for minutes by default; the shard has its own retry
# loop with a visible backlog, so each request fails fast and the loop decides.
MLFLOW_REQUEST_ENV = {"MLFLOW_HTTP_REQUEST_MAX_RETRIES": "0", "MLFLOW_HTTP_REQUEST_TIMEOUT": "20"}


class TransientWriteError(Exception):
    """MLflow or the artifact store is unreachable or overloaded; retry the same data later."""


class FailurePolicy:
    """Decides whether a failed write is worth retrying.

    4xx answers from MLflow (bad value, unknown run) are permanent: retrying cannot help, so
    the offending values are isolated and reported. Everything else (connection refused,
    timeouts, 5xx, a locked SQLite file, S3 hiccups) is transient: the data waits in the spool.
    """

    def is_transient(self, exc: BaseException) -> bool:
        if isinstance(exc, MlflowException):
            status = exc.get_http_status_code()
            return status >= 500 or status in (408, 429)
        return True


class MlflowWriter:
    """Writes to one MLflow tracking server: one per shard, written to by its writer thread only."""

    def __init__(self, tracking_uri: str, policy: FailurePolicy | None = None) -> None:
        os.environ.update(MLFLOW_REQUEST_ENV)
        self.tracking_uri = tracking_uri
        self.client = MlflowClient(tracking_uri=tracking_uri)
        self.policy = policy or FailurePolicy()

    def write(
        self,
        run_id: str,
        points: Sequence[Point],
        params: dict[str, str],
        tags: dict[str, str],
    ) -> list[str]:
        """Write everything for one run; returns a description of each value MLflow refused.

        Raises:
            TransientWriteError: MLflow is unreachable; nothing was lost, call again later.
        """
        rejected: list[str] = []
        param_items = [Param(k, v) for k, v in params.items()]
        tag_items = [RunTag(k, v) for k, v in tags.items()]
        for start in range(0, len(param_items), MAX_PARAMS_TAGS_PER_BATCH):
            self._write_chunk(run_id, [], param_items[start : start + MAX_PARAMS_TAGS_PER_BATCH],
                              [], rejected)
        for start in range(0, len(tag_items), MAX_PARAMS_TAGS_PER_BATCH):
            self._write_chunk(run_id, [], [], tag_items[start : start + MAX_PARAMS_TAGS_PER_BATCH],
                              rejected)
        per_call = min(MAX_METRICS_PER_BATCH, MAX_ENTITIES_PER_BATCH)
        for start in range(0, len(points), per_call):
            chunk = [Metric(k, v, ts, step) for k, v, ts, step in points[start : start + per_call]]
            self._write_chunk(run_id, chunk, [], [], rejected)
        return rejected

    def _write_chunk(
        self,
        run_id: str,
        metrics: list[Metric],
        params: list[Param],
        tags: list[RunTag],
        rejected: list[str],
    ) -> None:
        try:
            self.client.log_batch(run_id, metrics=metrics, params=params, tags=tags,
                                  synchronous=True)
            return
        except Exception as exc:
            if self.policy.is_transient(exc):
                raise TransientWriteError(_short(exc)) from exc
            if len(metrics) + len(params) + len(tags) == 1:
                entity = (metrics or params or tags)[0]
                kind = "metric" if metrics else "param" if params else "tag"
                rejected.append(f"{kind} {entity.key!r} in run {run_id}: {_short(exc)}")
                return
        # A permanent refusal of a multi-value chunk: bisect to isolate the bad values, so one
        # bad value never sinks the rest.
        for part in _halves(metrics, params, tags):
            self._write_chunk(run_id, *part, rejected)

    def upload(self, run_id: str, root: Path) -> None:
        """Upload the tree under ``root`` to the run's artifact root, each file once."""
        try:
            self.client.log_artifacts(run_id, str(root))
        except Exception as exc:
            raise TransientWriteError(f"artifact upload: {_short(exc)}") from exc

    def upload_file(self, run_id: str, path: Path, artifact_path: str) -> None:
        try:
            self.client.log_artifact(run_id, str(path), artifact_path)
        except Exception as exc:
            raise TransientWriteError(f"artifact upload: {_short(exc)}") from exc

    def history(self, run_id: str, key: str) -> list[tuple[float, int]]:
        """Value and step of every point of metric ``key`` that MLflow holds for a run.

        Raises:
            TransientWriteError: MLflow cannot be read now.
        """
        try:
            return [(m.value, m.step) for m in self.client.get_metric_history(run_id, key)]
        except Exception as exc:
            raise TransientWriteError(f"metric history: {_short(exc)}") from exc

    def set_terminated(self, run_id: str, status: str) -> None:
        self.client.set_terminated(run_id, status=status, end_time=int(time.time() * 1000))


def _halves(
    metrics: list[Metric], params: list[Param], tags: list[RunTag]
) -> list[tuple[list[Metric], list[Param], list[RunTag]]]:
    if len(metrics) > 1:
        mid = len(metrics) // 2
        return [(metrics[:mid], [], []), (metrics[mid:], [], [])]
    if len(params) > 1:
        mid = len(params) // 2
        return [([], params[:mid], []), ([], params[mid:], [])]
    mid = len(tags) // 2
    return [([], [], tags[:mid]), ([], [], tags[mid:])]


def _short(exc: BaseException) -> str:
    text = f"{type(exc).__name__}: {exc}"
    first = text.strip().splitlines()[0] if text.strip() else type(exc).__name__
    return first[:300]
