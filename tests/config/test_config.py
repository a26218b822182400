"""Settings: defaults that work with nothing set, env over TOML, errors that name the variable."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from raydeck.config.secrets import Secret
from raydeck.config.settings import load_settings, load_settings_with_origins
from raydeck.errors import ConfigError


def test_defaults_make_the_embedded_mode_work(tmp_path: Path, monkeypatch: pytest.MonkeyPatch
                                              ) -> None:
    monkeypatch.chdir(tmp_path)
    settings = load_settings(env={})
    assert settings.data_dir == tmp_path / ".raydeck"
    assert settings.tracking.uri == f"sqlite:///{tmp_path / '.raydeck' / 'mlflow.db'}"
    assert settings.tracking.artifact_location == (tmp_path / ".raydeck" / "mlartifacts").as_uri()
    assert settings.ray_namespace == "raydeck"
    assert not settings.storage.configured


def test_env_overrides_toml_and_toml_overrides_defaults(tmp_path: Path) -> None:
    config = tmp_path / "raydeck.toml"
    config.write_text('ray_namespace = "from-toml"\n[tracking]\nshards = 3\nmode = "per_rank"\n')
    settings = load_settings(env={"RAYDECK_TRACKING_SHARDS": "5"}, config_file=config)
    assert settings.ray_namespace == "from-toml"
    assert settings.tracking.shards == 5
    assert settings.tracking.mode == "per_rank"


@pytest.mark.parametrize(
    ("env", "named"),
    [
        ({"RAYDECK_TRACKING_URI": "not a uri"}, "RAYDECK_TRACKING_URI"),
        ({"RAYDECK_TRACKING_SHARDS": "-1"}, "RAYDECK_TRACKING_SHARDS"),
        ({"RAYDECK_TRACKING_SHARDS": "two"}, "RAYDECK_TRACKING_SHARDS"),
        ({"RAYDECK_TRACKING_MODE": "everyone"}, "RAYDECK_TRACKING_MODE"),
        ({"RAYDECK_TRACKING_CAPTURE_LOGS": "maybe"}, "RAYDECK_TRACKING_CAPTURE_LOGS"),
        ({"RAYDECK_TRACKING_SYSTEM_METRICS": "sometimes"}, "RAYDECK_TRACKING_SYSTEM_METRICS"),
        # MLflow reads its request timeout as whole seconds.
        ({"RAYDECK_TRACKING_MLFLOW_TIMEOUT_S": "0.5"}, "RAYDECK_TRACKING_MLFLOW_TIMEOUT_S"),
        ({"RAYDECK_TRACKING_MLFLOW_TIMEOUT_S": "0"}, "RAYDECK_TRACKING_MLFLOW_TIMEOUT_S"),
        ({"RAYDECK_TRACKING_RETRY_MAX_S": "0"}, "RAYDECK_TRACKING_RETRY_MAX_S"),
        ({"RAYDECK_TRACKING_HEARTBEAT_INTERVAL_S": "-1"}, "RAYDECK_TRACKING_HEARTBEAT_INTERVAL_S"),
        ({"RAYDECK_RAY_ADDRESS": "http//nope"}, "RAYDECK_RAY_ADDRESS"),
        ({"RAYDECK_RUN_ID": "has spaces"}, "RAYDECK_RUN_ID"),
        ({"RAYDECK_QUEUE_TICK_S": "0"}, "RAYDECK_QUEUE_TICK_S"),
        ({"RAYDECK_S3_ENDPOINT": "http://s3:9000"}, "RAYDECK_S3_ENDPOINT"),
    ],
)
def test_bad_values_fail_at_load_naming_the_variable_and_key(env: dict[str, str], named: str
                                                             ) -> None:
    with pytest.raises(ConfigError) as excinfo:
        load_settings(env=env)
    message = str(excinfo.value)
    assert message.startswith(named)
    assert "raydeck.toml" in message


def test_a_file_tracking_uri_is_refused_naming_the_sql_alternative() -> None:
    # MLflow's file store cannot tell a refused value from a failure (INTERNAL_ERROR for
    # both) and keeps repeated points, so raydeck cannot deliver to it exactly once.
    with pytest.raises(ConfigError, match=r"sqlite:////path/to/mlflow\.db"):
        load_settings(env={"RAYDECK_TRACKING_URI": "file:///tmp/mlruns"})


def test_unknown_toml_key_is_named(tmp_path: Path) -> None:
    config = tmp_path / "raydeck.toml"
    config.write_text("[tracking]\nshard = 2\n")
    with pytest.raises(ConfigError, match=r"unknown key\(s\) shard in \[tracking\]"):
        load_settings(env={}, config_file=config)


def test_secrets_never_show_in_repr_or_runtime_env() -> None:
    settings = load_settings(env={
        "RAYDECK_S3_ENDPOINT": "http://127.0.0.1:9000",
        "RAYDECK_S3_ACCESS_KEY_ID": "admin",
        "RAYDECK_S3_SECRET_ACCESS_KEY": "s3cr3t-value",
    })
    assert settings.storage.secret_access_key == Secret("s3cr3t-value")
    assert "s3cr3t-value" not in repr(settings)
    assert "s3cr3t-value" not in str(settings.storage.secret_access_key)
    assert "s3cr3t-value" not in str(settings.to_env())


# --- MLflow's own variable ------------------------------------------------------------------
MLFLOW_URI = "http://mlflow.example:5000"


def test_mlflow_tracking_uri_is_the_tracking_uri_when_raydeck_names_none() -> None:
    from raydeck.cluster.connection import job_runtime_env

    settings, origins = load_settings_with_origins(env={"MLFLOW_TRACKING_URI": MLFLOW_URI})
    assert settings.tracking.uri == MLFLOW_URI
    assert origins["RAYDECK_TRACKING_URI"] == "MLFLOW_TRACKING_URI"
    # An MLflow server keeps its own artifact root, as for RAYDECK_TRACKING_URI.
    assert settings.tracking.artifact_location == ""
    # Jobs and workers get the resolved URI under raydeck's name.
    assert settings.to_env()["RAYDECK_TRACKING_URI"] == MLFLOW_URI
    assert job_runtime_env(settings)["env_vars"]["RAYDECK_TRACKING_URI"] == MLFLOW_URI


def test_raydeck_settings_win_over_mlflow_tracking_uri(tmp_path: Path) -> None:
    ours = "http://raydeck.example:5000"
    settings, origins = load_settings_with_origins(
        env={"MLFLOW_TRACKING_URI": MLFLOW_URI, "RAYDECK_TRACKING_URI": ours})
    assert settings.tracking.uri == ours and origins["RAYDECK_TRACKING_URI"] == "environment"
    config = tmp_path / "raydeck.toml"
    config.write_text(f'[tracking]\nuri = "{ours}"\n')
    settings, origins = load_settings_with_origins(env={"MLFLOW_TRACKING_URI": MLFLOW_URI},
                                                   config_file=config)
    assert settings.tracking.uri == ours and origins["RAYDECK_TRACKING_URI"] == str(config)


def test_an_empty_value_counts_as_unset(tmp_path: Path, monkeypatch: pytest.MonkeyPatch
                                        ) -> None:
    monkeypatch.chdir(tmp_path)
    # A runtime env's ${RAYDECK_TRACKING_URI} filled in as empty defers to MLflow's variable ...
    settings, origins = load_settings_with_origins(
        env={"RAYDECK_TRACKING_URI": "", "MLFLOW_TRACKING_URI": MLFLOW_URI})
    assert settings.tracking.uri == MLFLOW_URI and origins["RAYDECK_TRACKING_URI"] == (
        "MLFLOW_TRACKING_URI")
    # ... and an empty MLFLOW_TRACKING_URI to the embedded default.
    settings, origins = load_settings_with_origins(env={"MLFLOW_TRACKING_URI": " "})
    assert settings.tracking.uri == f"sqlite:///{tmp_path / '.raydeck' / 'mlflow.db'}"
    assert origins["RAYDECK_TRACKING_URI"] == "default"


@pytest.mark.parametrize("uri", ["./mlruns", "file:///tmp/mlruns"])
def test_an_mlflow_tracking_uri_raydeck_cannot_use_is_named_with_the_way_out(uri: str) -> None:
    with pytest.raises(ConfigError) as excinfo:
        load_settings(env={"MLFLOW_TRACKING_URI": uri})
    message = str(excinfo.value)
    assert message.startswith(f"MLFLOW_TRACKING_URI = {uri!r}")
    assert "set RAYDECK_TRACKING_URI" in message
    # Not used, not checked: raydeck's own setting wins.
    assert load_settings(env={"MLFLOW_TRACKING_URI": uri,
                              "RAYDECK_TRACKING_URI": MLFLOW_URI}).tracking.uri == MLFLOW_URI


def test_credentials_in_mlflow_tracking_uri_stay_out_of_errors_and_runtime_envs() -> None:
    password = "mlflow-pw-1234"
    settings = load_settings(env={"MLFLOW_TRACKING_URI": f"http://bob:{password}@m:5000"})
    assert settings.tracking.uri == f"http://bob:{password}@m:5000"  # the proxy needs it
    assert settings.to_env()["RAYDECK_TRACKING_URI"] == "http://m:5000"
    with pytest.raises(ConfigError) as excinfo:
        load_settings(env={"MLFLOW_TRACKING_URI": f"file://bob:{password}@h/x"})
    assert password not in str(excinfo.value)


def test_a_runs_mlflow_link_names_its_server_without_credentials() -> None:
    from raydeck.config.tracking_uri import run_page, run_url, ui_command

    assert run_url("http://bob:pw@m:5000/", "3", "abc") == (
        "http://m:5000/#/experiments/3/runs/abc")
    assert run_url("raydeck+https://m", "3", "abc") == "https://m/#/experiments/3/runs/abc"
    # A database store has a UI only once `mlflow ui` serves it; a link inside the UI works on
    # whichever address the UI has.
    assert run_url("sqlite:////tmp/m.db", "3", "abc") == ""
    assert run_page("3", "abc") == "#/experiments/3/runs/abc"
    assert ui_command("raydeck+postgresql://bob:pw@db/mlflow") == (
        "mlflow ui --backend-store-uri postgresql://db/mlflow --port 5000")


def test_raydeck_config_says_where_the_tracking_uri_came_from(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("RAYDECK_", "MLFLOW_"))}
    shown = subprocess.run(
        [sys.executable, "-m", "raydeck.cli", "config"], cwd=tmp_path, capture_output=True,
        text=True, timeout=60,
        env={**env, "RAYDECK_STACK_FILE": "", "MLFLOW_TRACKING_URI": MLFLOW_URI,
             "COLUMNS": "200"})
    assert shown.returncode == 0, shown.stderr
    row = next(line for line in shown.stdout.splitlines() if "RAYDECK_TRACKING_URI" in line)
    assert MLFLOW_URI in row and "MLFLOW_TRACKING_URI" in row
