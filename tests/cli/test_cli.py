"""The `raydeck` command: version, and one clear line with exit code 2 for every fixable error."""

from __future__ import annotations

import fcntl
import json
import os
import pty
import re
import select
import struct
import subprocess
import sys
import termios
import time
from pathlib import Path

import pytest

from tests.fixtures.processes import free_port


def _raydeck(*args: str, cwd: Path, env: dict[str, str] | None = None, timeout: float = 120
             ) -> subprocess.CompletedProcess[str]:
    clean = {k: v for k, v in os.environ.items()
             if not k.startswith("RAYDECK_") and k != "RAY_ADDRESS"}
    return subprocess.run(
        [sys.executable, "-m", "raydeck.cli", *args], cwd=cwd, env={**clean, **(env or {})},
        capture_output=True, text=True, timeout=timeout,
    )


def _one_error_line(result: subprocess.CompletedProcess[str]) -> str:
    assert result.returncode == 2, result.stdout + result.stderr
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith("error: ")
    assert "Traceback" not in result.stderr
    return lines[0]


@pytest.mark.timeout(60)
def test_version(tmp_path: Path) -> None:
    from raydeck import __version__

    result = _raydeck("--version", cwd=tmp_path)
    assert result.returncode == 0
    assert result.stdout.strip() == f"raydeck {__version__}"


@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    ("args", "env", "expected"),
    [
        (["demo", "--preset", "gpu-lots"], {}, "unknown preset 'gpu-lots'; known presets: cpu-1"),
        (["demo"], {"RAYDECK_TRACKING_URI": "mlflow-server:5000"},
         "RAYDECK_TRACKING_URI (raydeck.toml [tracking].uri) = 'mlflow-server:5000': must be a"),
        (["demo"], {"RAYDECK_TRACKING_SHARDS": "0"}, "RAYDECK_TRACKING_SHARDS"),
        (["presets"], {"RAYDECK_PRESETS_FILE": "missing.yaml"}, "RAYDECK_PRESETS_FILE"),
    ],
)
def test_bad_configuration_is_one_line_exit_2_and_creates_nothing(
    tmp_path: Path, args: list[str], env: dict[str, str], expected: str
) -> None:
    line = _one_error_line(_raydeck(*args, cwd=tmp_path, env=env))
    assert expected in line
    assert not (tmp_path / ".raydeck").exists()


@pytest.mark.timeout(60)
def test_negative_worker_count_in_a_presets_file(tmp_path: Path) -> None:
    presets = tmp_path / "presets.yaml"
    presets.write_text("tiny:\n  num_workers: -1\n")
    line = _one_error_line(
        _raydeck("demo", "--preset", "tiny", cwd=tmp_path,
                 env={"RAYDECK_PRESETS_FILE": str(presets)})
    )
    assert "preset 'tiny': num_workers=-1 must be >= 1" in line
    assert not (tmp_path / ".raydeck").exists()


@pytest.mark.timeout(90)
def test_status_exits_2_when_the_configured_mlflow_is_unreachable(tmp_path: Path) -> None:
    uri = f"http://127.0.0.1:{free_port()}"
    # Ray pinned to "local" (nothing to inspect): with no address, status would inspect any Ray
    # running on this machine, and a token-auth head another test started adds its warnings.
    result = _raydeck("status", cwd=tmp_path,
                      env={"RAYDECK_TRACKING_URI": uri, "RAYDECK_RAY_ADDRESS": "local",
                           "COLUMNS": "200"})
    line = _one_error_line(result)
    assert f"MLflow tracking server {uri} is unreachable" in line
    assert "unreachable" in result.stdout


@pytest.mark.timeout(90)
def test_status_exits_2_when_the_configured_cluster_is_unreachable(tmp_path: Path) -> None:
    address = f"127.0.0.1:{free_port()}"
    result = _raydeck("status", cwd=tmp_path, env={"RAYDECK_RAY_ADDRESS": address},
                      timeout=90)
    line = _one_error_line(result)
    assert f"Ray cluster at '{address}' is unreachable" in line



@pytest.mark.timeout(120)
def test_a_stale_record_of_a_stopped_ray_start_cluster_is_said_at_once(tmp_path: Path) -> None:
    """``ray start`` records its cluster where ``ray.init()`` without an address looks; a cluster
    killed without ``ray stop`` leaves the record, and Ray retries the dead address for minutes:
    ``raydeck demo`` says so in one line, ``raydeck status`` finds no cluster, both in seconds."""
    recorded = f"127.0.0.1:{free_port()}"
    (tmp_path / "ray").mkdir()
    (tmp_path / "ray" / "ray_current_cluster").write_text(recorded)
    env = {"RAY_TMPDIR": str(tmp_path), "COLUMNS": "200"}
    line = _one_error_line(_raydeck("demo", cwd=tmp_path, env=env, timeout=90))
    assert f"names {recorded!r}, where nothing answers" in line, line
    assert "Run `ray stop` (it clears the record)" in line, line
    status = _raydeck("status", cwd=tmp_path, env=env, timeout=90)
    assert status.returncode == 0, status.stdout + status.stderr
    assert "no cluster running" in status.stdout, status.stdout


# A command that used Ray: an exit hook it registered (after raydeck's own, before Ray's) runs,
# and the process still ends with the command's exit code (raydeck ends it with os._exit after
# every exit hook, so C++'s static destructors never race Ray's threads).
EXIT_HOOKS_SCRIPT = """
import atexit
import typer
from raydeck.cli import main as cli

@cli.app.command("probe")
def probe() -> None:
    atexit.register(print, "exit hook ran", flush=True)
    import ray  # registers Ray's own exit hook
    print("worked", ray.is_initialized(), flush=True)
    raise typer.Exit(3)

import sys
sys.argv = ["raydeck", "probe"]
cli.main()
"""


@pytest.mark.timeout(60)
def test_a_command_that_used_ray_ends_after_every_exit_hook_with_its_exit_code(
        tmp_path: Path) -> None:
    result = subprocess.run([sys.executable, "-c", EXIT_HOOKS_SCRIPT], cwd=tmp_path,
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 3, result.stdout + result.stderr
    assert result.stdout.splitlines() == ["worked False", "exit hook ran"], result.stderr


# --- tables: what a user copies is never cut --------------------------------------------------
ANSI_ESCAPE = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]|\x1b\][^\x07]*\x07")


def _raydeck_in_a_terminal(*args: str, cwd: Path, columns: int, timeout: float = 60) -> str:
    """``raydeck ARGS`` with its output on a terminal (a pseudo-terminal ``columns`` wide), as
    a user sees it; its text without colours."""
    clean = {k: v for k, v in os.environ.items()
             if not k.startswith("RAYDECK_") and k != "RAY_ADDRESS"}
    leader, follower = pty.openpty()
    fcntl.ioctl(follower, termios.TIOCSWINSZ, struct.pack("HHHH", 50, columns, 0, 0))
    proc = subprocess.Popen([sys.executable, "-m", "raydeck.cli", *args], cwd=cwd,
                            env={**clean, "COLUMNS": str(columns), "NO_COLOR": "1"},
                            stdin=follower, stdout=follower, stderr=follower)
    os.close(follower)
    out = b""
    deadline = time.monotonic() + timeout
    try:
        while time.monotonic() < deadline:
            ready, _, _ = select.select([leader], [], [], deadline - time.monotonic())
            try:
                chunk = os.read(leader, 65536) if ready else b""
            except OSError:  # EIO: the command closed the terminal
                break
            if not chunk:
                break
            out += chunk
        assert proc.wait(timeout=max(deadline - time.monotonic(), 1)) == 0, out.decode()
    finally:
        os.close(leader)
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    return ANSI_ESCAPE.sub("", out.decode()).replace("\r\n", "\n")


@pytest.mark.timeout(120)
def test_presets_names_are_whole_in_a_pipe_in_a_terminal_of_80_or_120_columns_and_as_json(
        tmp_path: Path) -> None:
    """Issue 51: `raydeck presets` showed `gpu-s…` three times at 80 columns. A preset name is
    never cut: in a pipe each row is one line whatever COLUMNS says; a terminal too narrow for
    the table gets one block per preset, each line within its width; a wider one the table."""
    from raydeck.train.presets import load_presets

    presets = load_presets(None)
    piped = _raydeck("presets", cwd=tmp_path, env={"COLUMNS": "80"})
    assert piped.returncode == 0, piped.stderr
    for preset in presets.values():
        (row,) = [line for line in piped.stdout.splitlines() if f"│ {preset.name} " in line]
        assert preset.description in row and preset.placement_strategy in row, row

    narrow = _raydeck_in_a_terminal("presets", cwd=tmp_path, columns=80)
    assert max(len(line) for line in narrow.splitlines()) <= 80, narrow
    shown = re.findall(r"^name +(\S+)$", narrow, flags=re.MULTILINE)
    assert shown == sorted(presets), narrow

    table = _raydeck_in_a_terminal("presets", cwd=tmp_path, columns=120)
    assert max(len(line) for line in table.splitlines()) <= 120, table
    shown = [line.split("│")[1].strip() for line in table.splitlines()
             if line.startswith("│") and line.split("│")[1].strip()]
    assert shown == sorted(presets), table

    as_json = _raydeck("presets", "--json", cwd=tmp_path)
    assert as_json.returncode == 0, as_json.stderr
    rows = json.loads(as_json.stdout)
    assert [row["name"] for row in rows] == sorted(presets)
    assert {row["name"]: row["placement_strategy"] for row in rows} == {
        name: preset.placement_strategy for name, preset in presets.items()}
