"""raydeck installed from its wheel works from any directory: the runtime env, sweep space,
dashboards and alert rules its commands default to come with the package (raydeck/_data).

The wheel is built from a copy of the repository's inputs (the build writes build/ and
*.egg-info next to its sources) and installed into a fresh virtual environment whose
dependencies come from the test's own environment through a .pth file, so nothing is downloaded
and the editable raydeck of the test's environment cannot shadow the wheel.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]
BUILD_INPUTS = ("pyproject.toml", "setup.py", "MANIFEST.in", "README.md", "platform",
                "runtime_envs", "jobs", "dashboards")


def _run(*command: str | Path, cwd: Path, env: dict[str, str] | None = None
         ) -> subprocess.CompletedProcess[str]:
    done = subprocess.run([str(part) for part in command], cwd=cwd, env=env, capture_output=True,
                          text=True, timeout=150)
    assert done.returncode == 0, f"{command}: {done.stdout[-2000:]}{done.stderr[-3000:]}"
    return done


@pytest.fixture(scope="module")
def installed(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A fresh venv with raydeck's wheel installed; returns its bin directory."""
    base = tmp_path_factory.mktemp("wheel")
    source = base / "source"
    source.mkdir()
    ignore = shutil.ignore_patterns("__pycache__", "*.egg-info", "*.pyc")
    for name in BUILD_INPUTS:
        if (ROOT / name).is_dir():
            shutil.copytree(ROOT / name, source / name, ignore=ignore)
        else:
            shutil.copy2(ROOT / name, source / name)
    _run(sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation",
         "--no-index", "--quiet", "-w", base / "dist", "./source", cwd=base)
    (wheel,) = (base / "dist").glob("raydeck-*.whl")
    venv = base / "venv"
    _run(sys.executable, "-m", "venv", "--without-pip", venv, cwd=base)
    python = venv / "bin" / "python"
    purelib = Path(_run(python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])",
                        cwd=base).stdout.strip())
    # The dependencies: the test environment's site-packages, after the venv's own.
    (purelib / "raydeck_test_dependencies.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    _run(sys.executable, "-m", "pip", "--python", python, "install", "--no-deps", "--no-index",
         "--quiet", wheel, cwd=base)
    return venv / "bin"


def _env() -> dict[str, str]:
    return {k: v for k, v in os.environ.items()
            if k != "PYTHONPATH" and not k.startswith(("RAYDECK_", "RAY_"))}


@pytest.mark.slow  # about 30 s on 2 busy cores: a wheel build, a venv, five CLI runs
@pytest.mark.timeout(300)
def test_the_installed_cli_finds_its_defaults_from_an_empty_directory(
    installed: Path, tmp_path: Path,
) -> None:
    venv = installed.parent
    empty = tmp_path / "empty"
    empty.mkdir()
    raydeck = installed / "raydeck"

    # The wheel's raydeck, not the checkout's; the sweep space it defaults to.
    probe = _run(installed / "python", "-c",
                 "import json, raydeck\n"
                 "from raydeck.config.package_data import default_path\n"
                 "from raydeck.tune import SearchSpace\n"
                 "space = default_path('jobs/sweep_digits.yaml')\n"
                 "SearchSpace.from_yaml(space)\n"
                 "print(json.dumps([raydeck.__file__, str(space)]))",
                 cwd=empty, env=_env())
    package, space = json.loads(probe.stdout)
    assert Path(package).is_relative_to(venv), package
    assert Path(space).is_relative_to(venv) and "raydeck/_data/jobs" in space

    # The default alert rules go into the Prometheus config.
    prometheus = yaml.safe_load(_run(raydeck, "monitoring", "config", "-o", "-", cwd=empty,
                                     env=_env()).stdout)
    (rules,) = prometheus["rule_files"]
    assert Path(rules).is_relative_to(venv) and rules.endswith(
        "raydeck/_data/dashboards/alerts/raydeck.rules.yml")

    # The default dashboards: their definitions load and match the rendered files shipped.
    checked = _run(raydeck, "dashboards", "render", "--check", cwd=empty, env=_env())
    assert "rendered files are up to date" in checked.stdout
    refused = subprocess.run([raydeck, "dashboards", "render"], cwd=empty, env=_env(),
                             capture_output=True, text=True, timeout=150)
    assert refused.returncode == 2 and "pass --dir" in refused.stderr, refused.stderr

    # The default runtime env, for a job file in a directory that has no runtime_envs/.
    (tmp_path / "project").mkdir()
    (tmp_path / "project" / "train.py").write_text("print('hello')\n")
    shown = _run(raydeck, "submit", "train.py", "--dry-run", "--", "--lr", "1",
                 cwd=tmp_path / "project", env=_env()).stdout
    assert shown.splitlines()[0] == "entrypoint: python train.py --lr 1"
    assert "raydeck/_data/runtime_envs/local.yaml" in shown.splitlines()[1]
    runtime_env = json.loads(shown.split("\n", 2)[2])
    assert runtime_env["working_dir"] == str((tmp_path / "project").resolve())


@pytest.mark.timeout(60)
def test_a_default_in_the_current_directory_wins_and_an_explicit_path_is_used_as_given(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
) -> None:
    from raydeck.config.package_data import checkout_path, default_path
    from raydeck.errors import ConfigError

    monkeypatch.chdir(tmp_path)
    # Elsewhere, this checkout's copy (an editable install has no packaged copy).
    assert default_path("runtime_envs/local.yaml") == ROOT / "runtime_envs" / "local.yaml"
    assert checkout_path("runtime_envs/nope.yaml") is None
    with pytest.raises(ConfigError, match=r"nope\.yaml"):
        default_path("runtime_envs/nope.yaml")
    (tmp_path / "runtime_envs").mkdir()
    (tmp_path / "runtime_envs" / "local.yaml").write_text("working_dir: .\n")
    assert default_path("runtime_envs/local.yaml") == Path("runtime_envs/local.yaml")
