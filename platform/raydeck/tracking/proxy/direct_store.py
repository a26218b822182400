"""The direct write path: the shards write through MLflow's own SQL store, not its server.

MLflow's ``SqlAlchemyStore`` is the code ``mlflow server`` runs behind its HTTP and JSON layer;
MLflow's client takes a database URI as its tracking URI, so writing through it is a supported
path. Without the server in the way, and with a chunk's metrics written in bulk, the shards
landed 9-17x the server's concurrent ``log_batch`` ceiling (``benchmarks/tracking_ingest.py``,
docs/scale.md). The price: the server's auth and request plugins never see
these writes (docs/tracking-contract.md).

Owns: which URI the shards write to (:func:`write_target`: the tracking URI when it is a
database, else ``[tracking].write_db`` for an http(s) server, else the server), how that is shown
(:func:`describe_write_path`, redacted), the connection pool sized to a shard's writers
(:func:`pool_env`), the schema check before the first write (:func:`check_schema`: a database
whose MLflow schema revision is not the installed MLflow's is refused, never written into), and
which database errors are passing ones (:func:`transient_db_failure`: a restart, a lock, a lost
connection). Does not own the writes themselves
(:class:`~raydeck.tracking.proxy.writer.MlflowWriter`; a chunk's metrics in bulk,
:mod:`~raydeck.tracking.proxy.sql_batch`) nor retries (the shard).
"""

from __future__ import annotations

import logging
from typing import Any

from raydeck._internal.redaction import redact_url

logger = logging.getLogger(__name__)

DATABASE_SCHEMES = ("sqlite", "postgresql", "mysql", "mssql")
SERVER_SCHEMES = ("http", "https")
# Seconds a schema check waits for a PostgreSQL or MySQL connection (a down database refuses at
# once; an unreachable host would otherwise hold a writer for the OS's TCP timeout).
CONNECT_TIMEOUT_S = 10


def scheme(uri: str) -> str:
    """``uri``'s scheme without a driver (``postgresql+psycopg2://`` -> ``postgresql``)."""
    return uri.split(":", 1)[0].split("+", 1)[0].lower() if ":" in uri else ""


def is_database_uri(uri: str) -> bool:
    return scheme(uri) in DATABASE_SCHEMES


def write_target(tracking_uri: str, write_db: str) -> str:
    """The URI the proxy's shards write runs, values and ends to.

    ``tracking_uri`` itself when it is a database (direct) or when no ``write_db`` is set (through
    the server); ``write_db`` (the server's own database) when ``tracking_uri`` is an http(s)
    server. Artifacts, the UI, the registry and the router's reads stay on ``tracking_uri``.
    """
    if write_db and scheme(tracking_uri) in SERVER_SCHEMES:
        return write_db
    return tracking_uri


def describe_write_path(tracking_uri: str, write_db: str) -> str:
    """Which path writes, for ``raydeck status`` and ``raydeck tracking status`` (no
    credentials)."""
    target = write_target(tracking_uri, write_db)
    if not is_database_uri(target):
        return f"through the MLflow server {redact_url(tracking_uri)}"
    store = f"direct to {redact_url(target)} (MLflow's SQL store"
    if target != tracking_uri:
        return f"{store}; the server {redact_url(tracking_uri)} keeps reads and artifacts)"
    return f"{store})"


def pool_env(uri: str, writers: int) -> dict[str, str]:
    """MLflow's pool settings for a shard writing to ``uri`` with ``writers`` threads.

    Two connections per writer, plus one for the shard's lookups: MLflow's ``log_batch`` holds
    a session (its run check) while the metric, param and tag writes inside it open their own,
    so a pool smaller than two per writer deadlocks the writers until the pool's timeout (seen:
    4 writers on a pool of 4). Overflow as many again as there are writers, for a restart's
    invalidated connections. MLflow makes one engine per process and URI, so the first writer
    of a process sets its pool; a shard is one process with one writer. SQLite takes one writer
    and MLflow's own pool.
    """
    if not is_database_uri(uri) or scheme(uri) == "sqlite":
        return {}
    return {"MLFLOW_SQLALCHEMYSTORE_POOL_SIZE": str(2 * writers + 1),
            "MLFLOW_SQLALCHEMYSTORE_MAX_OVERFLOW": str(writers)}


class SchemaMismatchError(Exception):
    """The database's MLflow schema is not the installed MLflow's: nothing is written into it
    (the data stays in the spool) until someone upgrades one of the two."""


def check_schema(uri: str) -> None:
    """Refuse a database whose MLflow schema revision is not the installed MLflow's.

    A new, empty database passes (MLflow creates its tables on first use, as ``mlflow server``
    does). Connecting may fail like any write (SQLAlchemy's error comes out, the caller classifies
    it).

    Raises:
        SchemaMismatchError: the revisions differ; the message names both and the fix.
    """
    import sqlalchemy
    from mlflow.store.db import utils as db_utils
    from sqlalchemy.pool import NullPool

    connect_args: dict[str, Any] = (
        {"connect_timeout": CONNECT_TIMEOUT_S} if scheme(uri) in ("postgresql", "mysql") else {})
    engine = sqlalchemy.create_engine(uri, poolclass=NullPool, connect_args=connect_args)
    try:
        found = db_utils._get_schema_version(engine)
        fresh = found is None and not db_utils._all_tables_exist(engine)
    finally:
        engine.dispose()
    expected = db_utils._get_latest_schema_revision()
    if fresh or found == expected:
        return
    import mlflow

    # The fix first: a writer's error shows in one line of at most 300 characters.
    raise SchemaMismatchError(
        f"MLflow schema revision {found}, not the installed MLflow {mlflow.__version__}'s "
        f"{expected}: nothing is written until they match; fix: back up, run `mlflow db upgrade "
        f"<database uri>` (or install the MLflow that made it); database {redact_url(uri)}")


# SQLAlchemy errors that say the database was not there (down, restarting, locked, the
# connection lost or the pool exhausted), as opposed to one that refused this statement.
_PASSING_SQLALCHEMY = ("OperationalError", "InterfaceError", "DisconnectionError",
                       "TimeoutError", "InvalidatePoolError")


def transient_db_failure(chain: list[BaseException]) -> bool | None:
    """Whether a failure of the SQL store is a passing one, from the error and its causes.

    MLflow's store wraps a database error in an ``MlflowException``: an ``OperationalError`` as
    503 (transient), every other SQLAlchemy error as 400, which would be a refusal for good, even
    a connection that a restart closed (psycopg's ``InterfaceError``). So the database's own error,
    deeper in the chain, decides. None: no SQLAlchemy error in the chain (the caller decides).
    """
    for exc in chain:
        cls = type(exc)
        if not cls.__module__.startswith("sqlalchemy"):
            continue
        if getattr(exc, "connection_invalidated", False):
            return True
        names = {base.__name__ for base in cls.__mro__}
        return bool(names.intersection(_PASSING_SQLALCHEMY))
    return None
