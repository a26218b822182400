"""`raydeck up` refuses bad input before starting anything: one line naming the service and the
fix, exit code 2, no process left. (A service that dies *during* ``up`` is in test_stack.py,
which has a stack whose first services start quickly.)"""

from __future__ import annotations

import json
import os
import socket
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.fixtures.stack import StackUnderTest

pytestmark = pytest.mark.timeout(180)


@pytest.fixture
def stack() -> Iterator[StackUnderTest]:
    under_test = StackUnderTest(prefix="raydeck-stack-fault-")
    yield under_test
    under_test.destroy()


def _refused(stack: StackUnderTest, *args: str, env: dict[str, str] | None = None) -> str:
    """Run ``raydeck up ARGS``; assert exit 2, one error line, nothing started; the line."""
    answer = stack.cli("up", "--free-ports", *args, timeout_s=120, env=env)
    assert answer.returncode == 2, answer.stdout[-2000:] + answer.stderr[-2000:]
    lines = answer.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), answer.stderr
    assert "Traceback" not in answer.stdout + answer.stderr
    assert "starting" not in answer.stdout
    assert not stack.marked()
    assert not stack.stack_file.exists()
    return lines[0].removeprefix("error: ")


def test_port_in_use_names_the_service_the_holder_and_the_option(stack: StackUnderTest) -> None:
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        port = held.getsockname()[1]
        line = _refused(stack, "--port", f"mlflow={port}")
    assert line.startswith(f"mlflow: port {port} on 127.0.0.1 is in use by pid {os.getpid()}")
    assert "--port mlflow=PORT" in line and "--free-ports" in line


def test_missing_postgresql_says_how_to_install_it(stack: StackUnderTest, tmp_path: Path
                                                   ) -> None:
    line = _refused(stack, "--postgres-bin", str(tmp_path))
    assert line.startswith(f"postgres: no PostgreSQL server (postgres, initdb) in {tmp_path}")
    assert "apt-get install postgresql" in line and "--postgres-bin" in line


def test_missing_prometheus_says_how_to_install_it(stack: StackUnderTest) -> None:
    # The venv's scripts only: PostgreSQL is still found in /usr/lib/postgresql.
    line = _refused(stack, env={"PATH": str(Path(sys.executable).parent)})
    assert line.startswith("prometheus: prometheus not found")
    assert "apt-get install prometheus" in line


def test_data_directory_of_another_postgresql_version(stack: StackUnderTest) -> None:
    stack.paths.pgdata.mkdir(parents=True)
    (stack.paths.pgdata / "PG_VERSION").write_text("9.6\n")
    line = _refused(stack)
    assert line.startswith(f"postgres: the data directory {stack.paths.pgdata} was created by "
                           "PostgreSQL 9.6, but the installed server is ")
    assert "apt-get install postgresql-9.6" in line and "pg_upgrade" in line
    assert "raydeck down --purge" in line


def test_state_written_by_another_raydeck(stack: StackUnderTest) -> None:
    stack.paths.root.mkdir(parents=True)
    stack.paths.state_file.write_text(json.dumps({"layout": 99}))
    line = _refused(stack)
    assert line.startswith(f"stack: {stack.paths.root} was written by a raydeck with state "
                           "layout 99")
    assert "raydeck down --purge" in line


@pytest.mark.parametrize(("option", "message"), [
    ("--port=nginx=80", "no such port; the ports are postgres, s3, mlflow, ray, "),
    ("--port=mlflow", "expected NAME=PORT"),
    ("--port=mlflow=70000", "must be 1-65535"),
])
def test_bad_port_option(stack: StackUnderTest, option: str, message: str) -> None:
    assert message in _refused(stack, option)
