"""Settings: defaults that work with nothing set, env over TOML, errors that name the variable."""

from __future__ import annotations

from pathlib import Path

import pytest

from raydeck.config import Secret, load_settings
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
        ({"RAYDECK_RAY_ADDRESS": "http//nope"}, "RAYDECK_RAY_ADDRESS"),
        ({"RAYDECK_RUN_ID": "has spaces"}, "RAYDECK_RUN_ID"),
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
