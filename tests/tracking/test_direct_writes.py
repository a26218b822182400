"""The direct write path: a shard writing through MLflow's own SQL store (issue 55).

Each test drives a real shard (:class:`ShardCore`, in this process) against a real database:
PostgreSQL stopped and started again under the shard's writers, a SQLite file locked by another
writer for longer than MLflow's busy timeout, a database at another MLflow schema revision, and
an http(s) server's own database named by ``[tracking].write_db``. Every one lands exact counts
(each step once) with nothing set aside, or, for the schema, writes nothing until it matches.
The bulk write (:mod:`~raydeck.tracking.proxy.sql_batch`) leaves the rows MLflow's own
``SqlAlchemyStore.log_batch`` leaves, on SQLite and PostgreSQL.
"""

from __future__ import annotations

import contextlib
import dataclasses
import sqlite3
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from raydeck.config.settings import load_settings
from raydeck.tracking.messages import Batch, OpenRun, ShardConfig
from raydeck.tracking.proxy.direct_store import (
    describe_write_path,
    pool_env,
    transient_db_failure,
)
from raydeck.tracking.proxy.shard import ShardCore
from raydeck.tracking.proxy.writer import FailurePolicy
from tests.fixtures.mlflow_server import MlflowServer
from tests.fixtures.processes import wait_until

# An MLflow schema revision older than any installed MLflow's head (MLflow 1.x's first).
OLD_REVISION = "451aebb31d03"


def _config(uri: str, spool_dir: Path, writers: int, write_uri: str = "") -> ShardConfig:
    tracking = load_settings().tracking
    return ShardConfig(index=0, tracking_uri=uri, spool_dir=str(spool_dir), fsync=False,
                       writers=writers, mlflow_timeout_s=tracking.mlflow_timeout_s,
                       retry_max_s=1.0, env={}, write_uri=write_uri)


def _open(core: ShardCore, key: str) -> None:
    core.control(key, "open", OpenRun(key=key, name=key, experiment="direct-writes",
                                      artifact_location="", mode="rank_zero"))


def _ingest(core: ShardCore, key: str, seq: int, steps: range) -> None:
    core.ingest(Batch(client_id=f"client-{key}", seq=seq, run_key=key, params_run_key=key,
                      points=[("x", float(s), 1_000 + s, s) for s in steps]))


def _assert_exact(uri: str, core: ShardCore, key: str, steps: range) -> None:
    from mlflow.tracking import MlflowClient

    report = core.wait_landed([key], 120)
    assert report.landed and not report.dead_letters, report
    resolution = core.resolve(key, 1)
    assert resolution is not None
    history = MlflowClient(uri).get_metric_history(resolution.run_id, "x")
    assert sorted(m.step for m in history) == list(steps)  # each step once, none lost
    assert all(m.value == float(m.step) for m in history)


@pytest.fixture(scope="module")
def postgres() -> Iterator[Any]:
    """One server for the module's tests (each uses runs of its own; the restart test leaves it
    started)."""
    from raydeck.errors import StackError
    from tests.fixtures.postgres import postgres_server

    with contextlib.ExitStack() as stack:
        try:
            server = stack.enter_context(postgres_server("raydeck-direct-pg-"))
        except StackError as exc:  # no PostgreSQL here (README's first command installs it)
            pytest.skip(f"PostgreSQL cannot start here: {exc}")
        yield server


@pytest.mark.timeout(300)
def test_postgres_restarted_under_parallel_writers_lands_exact_counts(
    tmp_path: Path, postgres: Any
) -> None:
    uri = postgres.uri_with_password
    core = ShardCore(_config(uri, tmp_path / "spool", writers=4))
    try:
        assert describe_write_path(uri, "").startswith("direct to postgresql://")
        keys = [f"pg-{i}-{uuid.uuid4().hex[:6]}" for i in range(4)]
        for key in keys:
            _open(core, key)
            _ingest(core, key, 0, range(0, 2_000))
        assert core.wait_landed(keys, 120).landed
        postgres.stop()
        for key in keys:
            _ingest(core, key, 1, range(2_000, 5_000))  # accepted and spooled while it is down
        wait_until(lambda: core.stats()["write_errors"] > 0, 120, "a failed write")
        postgres.start()
        for key in keys:
            _ingest(core, key, 2, range(5_000, 6_000))
            _assert_exact(uri, core, key, range(6_000))
        assert core.stats()["dead_letters"] == 0
    finally:
        core.stop()


@pytest.mark.timeout(180)
def test_a_sqlite_file_locked_by_another_writer_lands_exact_counts(tmp_path: Path) -> None:
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    core = ShardCore(_config(uri, tmp_path / "spool", writers=1))
    key = f"locked-{uuid.uuid4().hex[:6]}"
    try:
        _open(core, key)
        _ingest(core, key, 0, range(0, 1_000))
        assert core.wait_landed([key], 120).landed
        other = sqlite3.connect(tmp_path / "mlflow.db", isolation_level=None)
        other.execute("BEGIN EXCLUSIVE")  # longer than MLflow's 20 s busy timeout
        try:
            _ingest(core, key, 1, range(1_000, 3_000))
            wait_until(lambda: "locked" in core.stats()["last_error"], 120,
                       "a write refused by the lock")
        finally:
            other.execute("COMMIT")
            other.close()
        _ingest(core, key, 2, range(3_000, 4_000))
        _assert_exact(uri, core, key, range(4_000))
    finally:
        core.stop()


@pytest.mark.timeout(120)
def test_a_database_at_another_schema_revision_is_refused_and_never_written(
    tmp_path: Path
) -> None:
    from mlflow.tracking import MlflowClient

    path = tmp_path / "old.db"
    uri = f"sqlite:///{path}"
    MlflowClient(uri).search_experiments()  # MLflow makes its tables at today's revision
    with sqlite3.connect(path) as db:
        [(current,)] = db.execute("SELECT version_num FROM alembic_version").fetchall()
        db.execute("UPDATE alembic_version SET version_num = ?", (OLD_REVISION,))
    core = ShardCore(_config(uri, tmp_path / "spool", writers=1))
    key = f"schema-{uuid.uuid4().hex[:6]}"
    try:
        _open(core, key)
        _ingest(core, key, 0, range(500))
        wait_until(lambda: "mlflow db upgrade" in core.stats()["last_error"], 60,
                   "the schema refusal")
        error = core.stats()["last_error"]
        assert OLD_REVISION in error and current in error, error
        with sqlite3.connect(path) as db:
            assert db.execute("SELECT COUNT(*) FROM runs").fetchone() == (0,)
            assert db.execute("SELECT COUNT(*) FROM metrics").fetchone() == (0,)
        assert core.stats()["queued_points"] == 500 and core.stats()["dead_letters"] == 0
        with sqlite3.connect(path) as db:  # the fix, as `mlflow db upgrade` would leave it
            db.execute("UPDATE alembic_version SET version_num = ?", (current,))
        _assert_exact(uri, core, key, range(500))
    finally:
        core.stop()


@pytest.mark.timeout(120)
def test_write_db_writes_to_the_servers_database_and_files_through_the_server(
    tmp_path: Path, mlflow_server: MlflowServer, mlflow_client: Any
) -> None:
    db = mlflow_server.backend_store_uri
    core = ShardCore(_config(mlflow_server.uri, tmp_path / "spool", writers=1, write_uri=db))
    key = f"write-db-{uuid.uuid4().hex[:6]}"
    try:
        assert core.stats()["write_path"] == describe_write_path(mlflow_server.uri, db)
        assert core.stats()["write_path"].startswith("direct to sqlite:")
        _open(core, key)
        core.ingest(Batch(client_id=f"client-{key}", seq=0, run_key=key, params_run_key=key,
                          points=[("x", float(s), 1_000 + s, s) for s in range(1_500)],
                          params={"lr": "0.1"}, logs=[("rank_0.txt", "epoch 0\n")]))
        core.control(key, "end", "FINISHED")
        _assert_exact(mlflow_server.uri, core, key, range(1_500))
        resolution = core.resolve(key, 1)
        assert resolution is not None
        run = mlflow_client.get_run(resolution.run_id)
        assert run.info.status == "FINISHED" and run.data.params == {"lr": "0.1"}
        # The experiment (and so the run's artifact root) is the server's.
        experiment = mlflow_client.get_experiment(run.info.experiment_id)
        assert run.info.artifact_uri.startswith(experiment.artifact_location)
        [part] = mlflow_client.list_artifacts(run.info.run_id, "logs/rank_0")
        assert Path(mlflow_client.download_artifacts(run.info.run_id, part.path)
                    ).read_text() == "epoch 0\n"
    finally:
        core.stop()


def test_the_databases_own_error_decides_not_mlflows_wrapping(tmp_path: Path) -> None:
    """MLflow wraps every SQLAlchemy error but OperationalError as 400; a connection that a
    restart closed must still be retried, a refused statement never."""
    import sqlalchemy
    from mlflow.exceptions import MlflowException
    from mlflow.protos.databricks_pb2 import BAD_REQUEST

    def wrapped(inner: Exception) -> MlflowException:
        try:
            try:
                raise inner
            except Exception as exc:
                raise MlflowException(str(exc), error_code=BAD_REQUEST) from exc
        except MlflowException as outer:
            return outer

    engine = sqlalchemy.create_engine(f"sqlite:///{tmp_path / 'missing' / 'x.db'}")
    with pytest.raises(sqlalchemy.exc.OperationalError) as unreachable:
        engine.connect()
    closed = sqlalchemy.exc.InterfaceError("SELECT 1", {}, Exception("connection closed"))
    duplicate = sqlalchemy.exc.IntegrityError("INSERT", {}, Exception("duplicate key"))
    policy = FailurePolicy()
    assert policy.classify(wrapped(unreachable.value)).transient
    assert policy.classify(wrapped(closed)).transient
    assert policy.classify(unreachable.value).transient  # raw, as engine creation raises it
    assert not policy.classify(wrapped(duplicate)).transient
    assert transient_db_failure([ValueError("x")]) is None


def test_the_pool_holds_two_connections_per_writer() -> None:
    """MLflow's ``log_batch`` holds a session while its inner writes open their own."""
    assert pool_env("postgresql://u:pw@db/mlflow", 4) == {
        "MLFLOW_SQLALCHEMYSTORE_POOL_SIZE": "9", "MLFLOW_SQLALCHEMYSTORE_MAX_OVERFLOW": "4"}
    assert pool_env("sqlite:////tmp/x.db", 1) == {} == pool_env("http://mlflow:5000", 4)


def test_the_write_db_credential_stays_with_the_proxy(tmp_path: Path) -> None:
    """``write_db``'s password is in no worker setting, runtime env, repr, error or status line;
    only the proxy's shard config (a constructor argument on the head) carries it."""
    from raydeck.jobs.runtime_env import shell_settings
    from raydeck.tracking.proxy.actors import proxy_config

    password = f"pw-{uuid.uuid4().hex}"
    db = f"postgresql://mlflow:{password}@db.internal:5432/mlflow"
    env = {"RAYDECK_TRACKING_URI": "http://mlflow.internal:5000",
           "RAYDECK_TRACKING_WRITE_DB": db, "RAYDECK_DATA_DIR": str(tmp_path)}
    settings = load_settings(env)
    config = proxy_config(settings)
    assert config.write_uri == db  # the proxy's, given to the actors as an argument
    shard = ShardConfig(index=0, tracking_uri=config.tracking_uri, spool_dir="", fsync=False,
                        writers=config.writers, mlflow_timeout_s=1, retry_max_s=1.0,
                        env=config.env, write_uri=config.write_uri)
    shown = [repr(settings), repr(config), repr(shard), str(settings.to_env()),
             str(shell_settings(env)), str(config.env),
             describe_write_path(settings.tracking.uri, settings.tracking.write_db.reveal())]
    assert not [text for text in shown if password in text]
    assert "RAYDECK_TRACKING_WRITE_DB" not in shell_settings(env)
    assert "db.internal:5432/mlflow" in shown[-1]  # status names the database, not its password
    with pytest.raises(Exception) as refused:  # a database uri already writes directly
        load_settings({**env, "RAYDECK_TRACKING_URI": "sqlite:////tmp/x.db"})
    assert password not in str(refused.value) and "write_db" in str(refused.value)
    assert dataclasses.replace(settings.tracking).write_db.reveal() == db


@pytest.mark.timeout(300)
def test_the_proxys_actors_write_directly_and_status_says_so(
    tmp_path: Path, ray_cluster: None, mlflow_server: MlflowServer, mlflow_client: Any
) -> None:
    """The whole path as Ray actors: ``write_db`` reaches the shards (as a constructor
    argument), a tracker's data lands exactly, and ``raydeck tracking status`` names the path."""
    import ray

    import raydeck
    from raydeck.config.secrets import Secret
    from raydeck.tracking.proxy.actors import find_router, stop_proxy
    from tests.fixtures.tracking import isolated_settings

    settings = isolated_settings(tmp_path, mlflow_server.uri, shards=1,
                                 write_db=Secret(mlflow_server.backend_store_uri))
    try:
        tracker = raydeck.get_tracker(run_name="direct-actors", settings=settings)
        for step in range(3_000):
            tracker.log_metric("x", float(step), step=step)
        assert tracker.finish().landed
        history = mlflow_client.get_metric_history(tracker.run_id, "x")
        assert sorted(m.step for m in history) == list(range(3_000))
        router = find_router(settings.ray_namespace)
        assert router is not None
        shards = ray.get(router.status.remote(), timeout=60)["shards"]
        assert [s["write_path"] for s in shards] == [describe_write_path(
            mlflow_server.uri, mlflow_server.backend_store_uri)]
    finally:
        stop_proxy(settings.ray_namespace, 60)


def _tricky_chunks() -> list[list[Any]]:
    """Two chunks with what MLflow treats specially: NaN (twice at one point), +-inf, a point
    repeated, steps out of order, ties on (step, timestamp) and on (step, timestamp, value)
    between NaN and 0.0, in both orders, and a later chunk that moves some latest values and not
    others."""
    from mlflow.entities import Metric

    nan, inf = float("nan"), float("inf")
    first = [("loss", 1.0, 100, 2), ("loss", 0.5, 100, 1), ("loss", nan, 200, 3),
             ("loss", nan, 200, 3), ("loss", 2.0, 200, 3), ("loss", 1.0, 100, 2),
             ("acc", inf, 50, 5), ("acc", -inf, 50, 5), ("acc", 0.9, 60, 5),
             ("acc", 0.0, 70, 7), ("acc", nan, 70, 7), ("g", nan, 10, 1), ("g", 0.0, 10, 1),
             ("g", -inf, 10, 1)]
    second = [("loss", 0.1, 50, 0), ("acc", inf, 80, 9), ("g", -1.0, 5, 1), ("new", 3.0, 1, 1),
              ("g", 0.0, 10, 1)]
    return [[Metric(k, v, ts, step) for k, v, ts, step in chunk] for chunk in (first, second)]


def _stored(uri: str, run_id: str) -> tuple[list[tuple[Any, ...]], list[tuple[Any, ...]]]:
    """The run's ``metrics`` and ``latest_metrics`` rows, as MLflow's own tables read them."""
    import sqlalchemy
    from mlflow.store.tracking.dbmodels.models import SqlLatestMetric, SqlMetric
    from sqlalchemy.pool import NullPool

    engine = sqlalchemy.create_engine(uri, poolclass=NullPool)
    try:
        with engine.connect() as connection:
            metrics, latest = (sorted(
                tuple(row) for row in connection.execute(sqlalchemy.select(
                    table.c.key, table.c.value, table.c.timestamp, table.c.step,
                    table.c.is_nan).where(table.c.run_uuid == run_id)))
                for table in (SqlMetric.__table__, SqlLatestMetric.__table__))
            return metrics, latest
    finally:
        engine.dispose()


@pytest.mark.timeout(120)
@pytest.mark.parametrize("database", ["sqlite", "postgresql"])
def test_the_bulk_write_leaves_the_rows_mlflows_own_log_batch_leaves(
    database: str, request: pytest.FixtureRequest
) -> None:
    """Each chunk written twice (a writer's replay after a crash): the bulk run and the run that
    MLflow's ``SqlAlchemyStore.log_batch`` wrote hold the same metrics and latest_metrics rows,
    the same params and tags, and a refused batch gets MLflow's own error."""
    from mlflow.entities import Metric, Param, RunTag
    from mlflow.exceptions import MlflowException
    from mlflow.tracking import MlflowClient

    from raydeck.tracking.proxy.sql_batch import SqlBatchWriter

    # The session's server's database (SQLite, migrated once) or the module's PostgreSQL.
    uri = (request.getfixturevalue("mlflow_server").backend_store_uri if database == "sqlite"
           else request.getfixturevalue("postgres").uri_with_password)
    client = MlflowClient(uri)
    experiment = client.create_experiment(f"bulk-{uuid.uuid4().hex[:8]}")
    bulk_run, mlflow_run = (client.create_run(experiment).info.run_id for _ in range(2))
    bulk = SqlBatchWriter.for_uri(uri)
    assert bulk is not None
    params, tags = [Param("lr", "0.1")], [RunTag("stage", "a"), RunTag("stage", "b")]
    for chunk in _tricky_chunks() * 2:
        bulk.log_batch(bulk_run, chunk, params, tags)
        bulk.store.log_batch(mlflow_run, chunk, params, tags)
    metrics, latest = _stored(uri, bulk_run)
    assert (metrics, latest) == _stored(uri, mlflow_run)
    assert len(metrics) == 16 and len(latest) == 4  # each point once; one latest a key
    assert ("g", 0.0, 10, 1, True) in latest  # the NaN came first: a tie keeps it
    runs = [client.get_run(run_id).data for run_id in (bulk_run, mlflow_run)]
    assert runs[0].params == runs[1].params == {"lr": "0.1"}
    assert runs[0].tags["stage"] == runs[1].tags["stage"] == "b"
    refused = [Metric("ok", 1.0, 1, 1), Metric("bad", 1.0, -1, 1)]
    errors = []
    for write in (bulk.log_batch, bulk.store.log_batch):
        with pytest.raises(MlflowException) as error:
            write(bulk_run, refused, [], [])
        errors.append(str(error.value))
    assert errors[0] == errors[1] and "metrics[1].timestamp" in errors[0]
    with pytest.raises(MlflowException, match="Changing param values is not allowed"):
        bulk.log_batch(bulk_run, refused[:1], [Param("lr", "0.2")], [])
