"""`raydeck up` as root in a directory other users cannot pass through, as under ``/root``:
PostgreSQL (which runs as the ``postgres`` system user) keeps its data in
``/var/lib/raydeck/<stack id>``, MLflow runs on it, ``raydeck ps`` says where it is, and
``raydeck down --purge`` deletes it with the rest of the stack. Where that cannot work either,
one error names the fixes (checked without starting anything).

The end-to-end test starts one whole stack (``raydeck up`` has no subset of services): about
30 CPU-seconds.
"""

from __future__ import annotations

import os
import pwd
import re
import shutil
import stat
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from raydeck.errors import StackError
from raydeck.stack import postgres
from raydeck.stack.services import POSTGRES_DB
from raydeck.stack.state import StackPaths, StackState
from tests.fixtures.stack import StackUnderTest

UP_TIMEOUT_S = 600

pytestmark = pytest.mark.skipif(os.geteuid() != 0,
                                reason="PostgreSQL changes user only under root")


@pytest.fixture
def private_stack() -> Iterator[StackUnderTest]:
    """A stack whose directory is 0700 and root's: the ``postgres`` user cannot reach it."""
    under_test = StackUnderTest(prefix="raydeck-stack-root-", mode=0o700)
    outside = postgres.SYSTEM_DATA_ROOT / under_test.paths.stack_id
    try:
        yield under_test
    finally:
        under_test.destroy()
        shutil.rmtree(outside, ignore_errors=True)  # only if `down --purge` did not


@pytest.mark.slow
@pytest.mark.timeout(UP_TIMEOUT_S + 300)
def test_up_as_root_under_a_private_directory_keeps_postgres_data_where_postgres_can_live(
    private_stack: StackUnderTest, record_property: Any
) -> None:
    under_test = private_stack
    started = time.perf_counter()
    up = under_test.cli("up", "--free-ports", "--num-cpus", "1", timeout_s=UP_TIMEOUT_S)
    up_wall_time_s = time.perf_counter() - started
    assert up.returncode == 0, up.stdout[-3000:] + up.stderr[-3000:]
    record_property("up_wall_time_s", round(up_wall_time_s, 1))

    state = under_test.state()
    home = postgres.SYSTEM_DATA_ROOT / under_test.paths.stack_id
    pgdata = state.pgdata(under_test.paths)
    assert state.postgres_home(under_test.paths) == home and pgdata.parent == home
    assert (pgdata / "PG_VERSION").exists()
    assert not under_test.paths.postgres.exists()
    owner = pwd.getpwnam(postgres.SYSTEM_USER)
    info = home.stat()
    assert (info.st_uid, stat.S_IMODE(info.st_mode)) == (owner.pw_uid, 0o700)
    assert f"PostgreSQL data: {pgdata}" in up.stdout

    ps = under_test.cli("ps")
    assert ps.returncode == 0, ps.stdout + ps.stderr
    for name in ("postgres", "mlflow"):
        assert re.search(rf"{name}\s.*running", ps.stdout), ps.stdout
    assert f"PostgreSQL data: {pgdata}" in ps.stdout

    # MLflow's store is this PostgreSQL: an experiment made through MLflow is in its table.
    from mlflow.tracking import MlflowClient

    experiment = f"root-stack-{uuid.uuid4().hex[:8]}"
    MlflowClient(tracking_uri=f"http://127.0.0.1:{state.ports['mlflow']}").create_experiment(
        experiment)
    with postgres.connect(state.ports["postgres"], under_test.credentials().postgres_password,
                          dbname=POSTGRES_DB) as connection:
        found = connection.execute("SELECT count(*) FROM experiments WHERE name = %s",
                                   (experiment,)).fetchone()
    assert found == (1,)

    down = under_test.cli("down", "--purge", timeout_s=300)
    assert down.returncode == 0, down.stdout + down.stderr
    assert f"deleted {home}" in down.stdout
    assert not home.exists() and not under_test.paths.root.exists()
    assert not under_test.marked()
    # No empty /var/lib/raydeck is left (another stack's files may keep it).
    root = postgres.SYSTEM_DATA_ROOT
    assert not root.exists() or any(root.iterdir())
    print(f"\nraydeck up as root, PostgreSQL's data outside: {up_wall_time_s:.1f} s")


def _private_paths(tmp_path: Path) -> StackPaths:
    """A state directory under a 0700 one, created as ``up`` creates it."""
    private = tmp_path / "private"
    private.mkdir(mode=0o700)
    paths = StackPaths.for_data_dir(private / "data")
    paths.root.mkdir(parents=True)
    return paths


def test_data_already_in_the_stack_directory_stays_there(tmp_path: Path) -> None:
    paths = _private_paths(tmp_path)
    paths.pgdata.mkdir(parents=True)
    (paths.pgdata / "PG_VERSION").write_text("16\n")
    state = StackState()
    postgres.place_data(paths, state, postgres.run_as())
    assert state.postgres_dir == "" and state.pgdata(paths) == paths.pgdata


def test_no_place_the_postgres_user_can_reach_is_one_error_naming_the_fixes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """/var/lib/raydeck kept from other users too (here a directory under a 0700 one)."""
    paths = _private_paths(tmp_path)
    monkeypatch.setattr(postgres, "SYSTEM_DATA_ROOT", tmp_path / "private" / "system")
    user = postgres.run_as()
    state = StackState()
    postgres.place_data(paths, state, user)
    home = tmp_path / "private" / "system" / paths.stack_id
    assert state.postgres_home(paths) == home
    with pytest.raises(StackError) as refused:
        postgres.prepare_directory(home, user)
    message = str(refused.value)
    assert message.startswith(f"postgres: PostgreSQL refuses to run as root, so it runs as the "
                              f"system user 'postgres', which cannot reach {home}")
    assert "chmod o+x" in message and "RAYDECK_DATA_DIR" in message
    assert "non-root user" in message


def test_no_postgres_system_user_is_one_error_naming_the_fix(
    monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(postgres, "SYSTEM_USER", "raydeck-no-such-user")
    with pytest.raises(StackError) as refused:
        postgres.run_as()
    assert str(refused.value) == (
        "postgres: PostgreSQL refuses to run as root and there is no 'raydeck-no-such-user' "
        "system user to run it as; install the server (apt-get install postgresql creates the "
        "user) or run raydeck as another user")
