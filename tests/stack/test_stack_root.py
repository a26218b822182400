"""`raydeck up` as root where PostgreSQL's ``postgres`` user cannot reach the stack's directory
(as under ``/root``): where its data goes, and the errors when no place works, checked without
starting anything. The end-to-end path (``up`` puts the data in ``/var/lib/raydeck/<stack
id>``, ``ps`` says where, ``down --purge`` deletes it) runs in ``tests/stack/test_stack.py``, whose
one stack lives in such a directory.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from raydeck.errors import StackError
from raydeck.stack import postgres
from raydeck.stack.state import StackPaths, StackState

pytestmark = pytest.mark.skipif(os.geteuid() != 0,
                                reason="PostgreSQL changes user only under root")


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
