"""MLflow's ``log_batch`` on its own SQL store, written in bulk: the direct path's values.

Why: MLflow's ``SqlAlchemyStore.log_batch`` spends about 70-140 us of CPU a metric point: it
builds an ORM object per point, flushes them one by one through the unit of work, falls back to
point-by-point lookups when one of them is already there, and keeps ``latest_metrics`` by loading
and comparing ORM rows. That, not the database, was the direct path's limit. This writes the same
rows with two SQL statements a chunk, each an ``executemany`` against MLflow's own tables
(``mlflow.store.tracking.dbmodels.models``), in a session of MLflow's own engine:

- ``metrics``: ``INSERT ... ON CONFLICT DO NOTHING`` (a point already there, the same key,
  timestamp, step, value and NaN flag, is kept once, as MLflow's primary key and its fallback
  keep it; a chunk written again after a crash lands once). NaN is stored as MLflow stores it
  (value 0, ``is_nan``), +-inf as +-the largest double.
- ``latest_metrics``: one upsert a key, replacing the row only when the chunk's latest point is
  strictly newer by (step, timestamp, value), MLflow's own rule (on a tie the older row stays;
  within a chunk the first of equal points wins). Row-level: shards writing other runs never wait
  on each other, and no shard reads the rows first.

Params and tags go through MLflow's own store (few, and their rules are MLflow's: a param never
changes, ``mlflow.runName`` renames the run). Validation is MLflow's: every value is checked as
``log_batch`` checks it (a batch it would refuse raises its own error, index and all), and the
run must exist and be active. The order is MLflow's: everything is validated, then params, then
metrics, then tags are written.

Owns: the bulk write of one chunk (:meth:`SqlBatchWriter.log_batch`, the signature of
``MlflowClient.log_batch``) and which databases it serves (:data:`BULK_DIALECTS`; others keep
MLflow's own ``log_batch``). Does not own: retries or failure classification (the writer and the
shard), the schema check (:mod:`~raydeck.tracking.proxy.direct_store`).
"""

from __future__ import annotations

import logging
import math
from collections.abc import Sequence
from typing import Any

logger = logging.getLogger(__name__)

# Databases whose SQLAlchemy dialect has ``INSERT ... ON CONFLICT`` (both tested here). MySQL
# (``INSERT IGNORE`` / ``ON DUPLICATE KEY UPDATE``, whose assignments see each other's new
# values) and SQL Server keep MLflow's own ``log_batch``.
BULK_DIALECTS = ("sqlite", "postgresql")
# MLflow's stand-in for +-inf, which SQL cannot store (``SqlAlchemyStore.sanitize_metric_value``).
_LARGEST_DOUBLE = 1.7976931348623157e308


class SqlBatchWriter:
    """Writes chunks of values into one MLflow SQL store, metrics in bulk. Thread-safe (each call
    takes its own session from MLflow's pool).

    Make it with :meth:`for_uri`, which gives None for a store this does not serve.
    """

    def __init__(self, store: Any) -> None:
        import sqlalchemy
        from mlflow.store.tracking.dbmodels.models import SqlLatestMetric, SqlMetric
        from sqlalchemy.dialects import postgresql, sqlite

        self.store = store
        dialect = store.engine.dialect.name
        if dialect not in BULK_DIALECTS:
            raise ValueError(f"dialect {dialect!r}: bulk writes serve {', '.join(BULK_DIALECTS)}; "
                             "use MLflow's own log_batch for others (SqlBatchWriter.for_uri)")
        insert: Any = sqlite.insert if dialect == "sqlite" else postgresql.insert
        metrics = SqlMetric.__table__
        latest = SqlLatestMetric.__table__
        self._insert_metrics = insert(metrics).on_conflict_do_nothing()
        upsert = insert(latest)
        new, old = upsert.excluded, latest.c
        # MLflow's _compare_metrics: (step, timestamp, value) strictly greater.
        newer = sqlalchemy.or_(
            new.step > old.step,
            sqlalchemy.and_(new.step == old.step, sqlalchemy.or_(
                new.timestamp > old.timestamp,
                sqlalchemy.and_(new.timestamp == old.timestamp, new.value > old.value))))
        self._upsert_latest = upsert.on_conflict_do_update(
            index_elements=[old.key, old.run_uuid],
            set_={"value": new.value, "timestamp": new.timestamp, "step": new.step,
                  "is_nan": new.is_nan},
            where=newer)

    @classmethod
    def for_uri(cls, uri: str) -> SqlBatchWriter | None:
        """The bulk writer for MLflow's store of ``uri`` (MLflow's own, cached per process), or
        None when the store is not a SQL one this serves. Opening the store connects (and
        migrates a new database): it fails as a write does."""
        from mlflow.store.tracking.sqlalchemy_store import SqlAlchemyStore
        from mlflow.tracking._tracking_service.utils import _get_store

        store = _get_store(uri)
        if not isinstance(store, SqlAlchemyStore):
            return None
        if store.engine.dialect.name not in BULK_DIALECTS:
            return None
        return cls(store)

    def log_batch(self, run_id: str, metrics: Sequence[Any] = (), params: Sequence[Any] = (),
                  tags: Sequence[Any] = (), synchronous: bool = True) -> None:
        """What ``MlflowClient(uri).log_batch`` writes, with MLflow's errors.

        ``metrics``: MLflow ``Metric`` entities (or anything with ``key``, ``value``,
        ``timestamp`` and ``step``; none logged to a model). ``synchronous`` is accepted for
        the client's signature: every write here is synchronous.

        Raises:
            MlflowException: MLflow's own refusal (a bad value, a changed param, an unknown or
                deleted run) or its wrapping of a database error (the writer classifies both).
        """
        from mlflow.exceptions import MlflowException
        from mlflow.protos.databricks_pb2 import INTERNAL_ERROR

        if not (metrics or params or tags):
            return
        if not metrics:
            self.store.log_batch(run_id, [], list(params), list(tags))
            return
        rows = self._validated_rows(run_id, metrics, params, tags)
        if params:
            self.store.log_batch(run_id, [], list(params), [])
        try:
            self._write_metrics(run_id, rows)
        except MlflowException:
            raise
        except Exception as exc:  # as MLflow's log_batch wraps what is not its own
            raise MlflowException(str(exc), INTERNAL_ERROR) from exc
        if tags:
            self.store.log_batch(run_id, [], [], list(tags))

    def _validated_rows(self, run_id: str, metrics: Sequence[Any], params: Sequence[Any],
                        tags: Sequence[Any]) -> list[dict[str, Any]]:
        """The chunk's ``metrics`` rows, each point once, in the chunk's order, after MLflow's
        validation of the whole batch.

        The common chunk (float values, int timestamps and steps, a few keys) is checked once per
        key with MLflow's own ``_validate_metric``, each point by type; anything else goes
        through MLflow's per-point validation, which raises its own error for a bad value.
        """
        from mlflow.tracking.metric_value_conversion_utils import (
            convert_metric_value_to_float_if_possible,
        )
        from mlflow.utils import validation

        validation._validate_run_id(run_id)
        validation._validate_batch_log_limits(metrics, params, tags)
        validation._validate_batch_log_data([], params, tags)
        validation._validate_param_keys_unique(params)
        points = [(m.key, m.value, m.timestamp, m.step) for m in metrics]
        if any(type(v) is not float for _, v, _, _ in points):  # the client's conversion
            points = [(k, convert_metric_value_to_float_if_possible(v), ts, s)
                      for k, v, ts, s in points]
        if not _plainly_valid(points):
            validation._validate_batch_log_data(metrics, [], [])  # raises MLflow's error
        rows: dict[tuple[Any, ...], dict[str, Any]] = {}
        for key, value, timestamp, step in points:
            is_nan = False
            if not math.isfinite(value):
                is_nan = math.isnan(value)
                value = 0.0 if is_nan else math.copysign(_LARGEST_DOUBLE, value)
            rows.setdefault((key, timestamp, step, value, is_nan), {
                "run_uuid": run_id, "key": key, "value": value, "timestamp": timestamp,
                "step": step, "is_nan": is_nan})
        return list(rows.values())

    def _write_metrics(self, run_id: str, rows: list[dict[str, Any]]) -> None:
        """Insert the rows (a point already there stays once) and move ``latest_metrics`` on,
        in one transaction, after MLflow's check that the run is active."""
        latest: dict[str, dict[str, Any]] = {}
        for row in rows:
            best = latest.get(row["key"])
            if best is None or ((row["step"], row["timestamp"], row["value"])
                                > (best["step"], best["timestamp"], best["value"])):
                latest[row["key"]] = row
        with self.store.ManagedSessionMaker(read_only=False) as session:
            self.store._check_run_is_active(self.store._get_run(run_uuid=run_id,
                                                                session=session))
            connection = session.connection()
            connection.execute(self._insert_metrics, rows)
            # In key order, as MLflow locks them: two writers of one run never deadlock.
            connection.execute(self._upsert_latest, [latest[k] for k in sorted(latest)])


def _plainly_valid(points: list[tuple[Any, Any, Any, Any]]) -> bool:
    """Whether every point is one MLflow's ``_validate_metric`` accepts, checked cheaply: a float
    value, a non-negative int timestamp, an int step, and a key MLflow accepts (checked once a
    key). False says only "check each point", never "refused"."""
    from mlflow.exceptions import MlflowException
    from mlflow.utils.validation import _validate_metric

    first: dict[Any, tuple[Any, Any, Any, Any]] = {}
    for point in points:
        _, value, timestamp, step = point
        if type(point[0]) is not str or type(value) is not float or type(timestamp) is not int \
                or timestamp < 0 or type(step) is not int:
            return False
        first.setdefault(point[0], point)
    try:
        for key, value, timestamp, step in first.values():
            _validate_metric(key, value, timestamp, step)
    except MlflowException:
        return False
    return True
