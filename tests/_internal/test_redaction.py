"""One redaction helper: what it hides, and that the outputs outside the proxy go through it.

The end-to-end promise (no secret in any output of a real deployment) is
``tests/test_secrets_e2e.py``; these tests pin the rules and each output path cheaply.
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest

from raydeck._internal.redaction import (
    MASK,
    RedactingFilter,
    is_secret_name,
    redact_command,
    redact_env,
    redact_text,
    redact_url,
    redact_value,
    secret_values,
)

PASSWORD = "s3cretpw-redaction-test"


@pytest.mark.parametrize("name", [
    "AWS_SECRET_ACCESS_KEY", "RAYDECK_S3_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "RAY_AUTH_TOKEN",
    "GRAFANA_TOKEN", "MLFLOW_TRACKING_PASSWORD", "POSTGRES_PASSWORD", "DB_PASSWD", "SMTP_PASS",
    "DB_PWD", "OPENAI_API_KEY", "B2_APPLICATION_KEY", "SIGNING_PRIVATE_KEY", "SENTRY_DSN",
    "GOOGLE_APPLICATION_CREDENTIALS_JSON", "BASIC_AUTH", "client_secret", "--api-key",
    "secretAccessKey", "X-Amz-Security-Token",
])
def test_secret_names(name: str) -> None:
    assert is_secret_name(name)


@pytest.mark.parametrize("name", [
    "AWS_ACCESS_KEY_ID", "RAYDECK_S3_ACCESS_KEY_ID", "B2_APPLICATION_KEY_ID", "RAY_AUTH_MODE",
    "RAY_AUTH_TOKEN_PATH", "AWS_SECRET_ACCESS_KEY_FILE", "TOKENIZERS_PARALLELISM", "PWD",
    "OLDPWD", "RAYDECK_TRACKING_URI", "MLFLOW_TRACKING_USERNAME", "OAUTH_TOKEN_URL", "PATH",
    "key", "Key", "signature", "NoCredentialsError", "PartialCredentialsError",
    "InvalidTokenException", "TokenExpiredWarning",
])
def test_names_that_are_not_secret(name: str) -> None:
    assert not is_secret_name(name)


@pytest.mark.parametrize(("uri", "shown"), [
    ("http://bob:s3cretpw@127.0.0.1:5000", "http://127.0.0.1:5000"),
    ("https://bob:s3cretpw@mlflow.example.com/path", "https://mlflow.example.com/path"),
    ("postgresql://user:pw@db:5432/mlflow", "postgresql://db:5432/mlflow"),
    ("postgresql+psycopg2://user:p@ss@db/mlflow", "postgresql+psycopg2://db/mlflow"),
    ("https://ghp_token123@github.com/org/repo.git", "https://github.com/org/repo.git"),
    ("bob:s3cretpw@127.0.0.1:5000", "127.0.0.1:5000"),
    ("https://s3.example.com/b/k?X-Amz-Signature=abc123&x=1",
     f"https://s3.example.com/b/k?X-Amz-Signature={MASK}&x=1"),
    ("sqlite:////tmp/raydeck/mlflow.db", "sqlite:////tmp/raydeck/mlflow.db"),
    ("http://127.0.0.1:5000", "http://127.0.0.1:5000"),
    ("s3://mlflow/raydeck/mlflow", "s3://mlflow/raydeck/mlflow"),
])
def test_urls_lose_their_user_info(uri: str, shown: str) -> None:
    assert redact_url(uri) == shown


def test_text_loses_user_info_secret_assignments_and_known_values() -> None:
    text = (f"API request to http://bob:{PASSWORD}@127.0.0.1:5000/api/2.0/mlflow/runs/create "
            f"failed; db postgresql://u:{PASSWORD}@db/x; PASSWORD={PASSWORD} "
            "RAY_AUTH_MODE=token RAYDECK_S3_SECRET_ACCESS_KEY=${RAYDECK_S3_SECRET_ACCESS_KEY}; "
            f"the server said: bad password {PASSWORD}")
    shown = redact_text(text, secrets=[PASSWORD])
    assert PASSWORD not in shown and "bob" not in shown
    assert "http://127.0.0.1:5000/api/2.0/mlflow/runs/create" in shown
    assert "postgresql://db/x" in shown and f"PASSWORD={MASK}" in shown
    # Settings that merely mention a secret's name, and references, stay readable.
    assert "RAY_AUTH_MODE=token" in shown
    assert "RAYDECK_S3_SECRET_ACCESS_KEY=${RAYDECK_S3_SECRET_ACCESS_KEY}" in shown


@pytest.mark.parametrize(("text", "shown"), [
    # Options with their value apart, inside text (an entrypoint raydeck submit echoes).
    ("python train.py --db-password hunter22 --epochs 3",
     f"python train.py --db-password {MASK} --epochs 3"),
    ("train.py --api-key sk-live-abc123 -v", f"train.py --api-key {MASK} -v"),
    ("--token ${RAY_AUTH_TOKEN}", "--token ${RAY_AUTH_TOKEN}"),
    ("--password --next", "--password --next"),  # no value: the next option is not one
    # JSON, Python reprs and YAML keys.
    ('{"AWS_SECRET_ACCESS_KEY": "wJalrXUtnFEMI/K7MDENG", "region": "us-east-1"}',
     f'{{"AWS_SECRET_ACCESS_KEY": "{MASK}", "region": "us-east-1"}}'),
    ("{'password': 'hunter22', 'user': 'bob'}", f"{{'password': '{MASK}', 'user': 'bob'}}"),
    ('{"token": 12345678}', f'{{"token": {MASK}}}'),
    ("storage:\n  secret_access_key: wJalrXUtnFEMI\n  region: eu",
     f"storage:\n  secret_access_key: {MASK}\n  region: eu"),
    ("{password: hunter22, user: bob}", f"{{password: {MASK}, user: bob}}"),
    # HTTP headers.
    ("Authorization: Bearer eyJhbGciOiJIUzI1NiJ9.e30.sig\nAccept: */*",
     f"Authorization: {MASK}\nAccept: */*"),
    ("X-Api-Key: abcdef123", f"X-Api-Key: {MASK}"),
    # URI passwords with any character, written unescaped.
    ("postgresql://user:pa/ss@db:5432/mlflow", "postgresql://db:5432/mlflow"),
    ("see http://bob:a/b@c@host:5000/x now", "see http://host:5000/x now"),
    # Not credentials: ports, @ in paths, times, plain prose.
    ("http://host:5000/users/@me", "http://host:5000/users/@me"),
    ("at 12:30 the run ended: status FINISHED", "at 12:30 the run ended: status FINISHED"),
    ("error: token expired", "error: token expired"),
    # An exception as Python prints it: its message is shown, whatever its class is called.
    ("NoCredentialsError: Unable to locate credentials",
     "NoCredentialsError: Unable to locate credentials"),
    ("botocore.exceptions.PartialCredentialsError: Partial credentials found in env",
     "botocore.exceptions.PartialCredentialsError: Partial credentials found in env"),
])
def test_every_secret_form_is_masked(text: str, shown: str) -> None:
    assert redact_text(text, secrets=()) == shown


def test_known_secret_values_come_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RAYDECK_S3_SECRET_ACCESS_KEY", "the-s3-secret-value")
    monkeypatch.setenv("RAYDECK_TRACKING_URI", f"http://bob:{PASSWORD}@127.0.0.1:5000")
    monkeypatch.setenv("DATABASE_URL", "postgresql://u:p%40ssword@db/x")
    monkeypatch.setenv("TOKENIZERS_PARALLELISM", "false")
    monkeypatch.setenv("SHORT_SECRET", "abc")
    monkeypatch.setenv("HF_HUB_DISABLE_IMPLICIT_TOKEN", "true")
    monkeypatch.setenv("MY_TOKEN_TTL", "3600")
    known = secret_values()
    assert {"the-s3-secret-value", PASSWORD, "p%40ssword", "p@ssword"} <= known
    assert not {"false", "abc", "true", "3600"} & known
    # A DSN without a scheme, echoed by some library, is caught by value.
    assert redact_text(f"cannot connect to bob:{PASSWORD}@db:5432") == \
        f"cannot connect to bob:{MASK}@db:5432"


def test_env_mappings_mask_secrets_and_strip_credentials() -> None:
    shown = redact_env({
        "RAYDECK_TRACKING_URI": f"http://bob:{PASSWORD}@127.0.0.1:5000",
        "RAYDECK_S3_SECRET_ACCESS_KEY": "the-s3-secret-value",
        "RAYDECK_S3_ACCESS_KEY_ID": "raydeck",
        "AWS_SESSION_TOKEN": "${AWS_SESSION_TOKEN}",
        "GRAFANA_TOKEN": "",
        "PIP_INDEX": f"https://user:{PASSWORD}@pypi.internal/simple",
    })
    assert shown == {
        "RAYDECK_TRACKING_URI": "http://127.0.0.1:5000",
        "RAYDECK_S3_SECRET_ACCESS_KEY": MASK,
        "RAYDECK_S3_ACCESS_KEY_ID": "raydeck",
        "AWS_SESSION_TOKEN": "${AWS_SESSION_TOKEN}",
        "GRAFANA_TOKEN": "",
        "PIP_INDEX": "https://pypi.internal/simple",
    }
    assert redact_value("RAYDECK_TRACKING_URI", f"bob:{PASSWORD}@127.0.0.1:5000") == \
        "127.0.0.1:5000"


def test_command_lines_mask_secret_options() -> None:
    argv = ["python", "jobs/train.py", "--password", PASSWORD, f"--api-key={PASSWORD}",
            "--tracking-uri", f"http://bob:{PASSWORD}@mlflow:5000", "--epochs", "3"]
    shown = redact_command(argv)
    assert PASSWORD not in shown
    assert shown == (f"python jobs/train.py --password '{MASK}' '--api-key={MASK}' "
                     "--tracking-uri http://mlflow:5000 --epochs 3")


def test_log_records_are_redacted_by_the_filter(caplog: pytest.LogCaptureFixture) -> None:
    logger = logging.getLogger("raydeck.test_redaction")
    caplog.handler.addFilter(RedactingFilter())
    with caplog.at_level(logging.INFO, logger=logger.name):
        logger.info("connecting to %s", f"http://bob:{PASSWORD}@127.0.0.1:5000")
        try:
            raise ConnectionError(f"http://bob:{PASSWORD}@127.0.0.1:5000 refused")
        except ConnectionError:
            logger.exception("write failed")
    assert PASSWORD not in caplog.text
    assert "connecting to http://127.0.0.1:5000" in caplog.text
    assert "ConnectionError: http://127.0.0.1:5000 refused" in caplog.text


# --- the output paths outside the tracking proxy ---------------------------------------------
def test_raydeck_errors_never_carry_a_secret(monkeypatch: pytest.MonkeyPatch) -> None:
    from raydeck.config.settings import load_settings
    from raydeck.errors import ConfigError, StorageError

    monkeypatch.setenv("GRAFANA_TOKEN", "glsa_the-grafana-token")
    error = StorageError("Grafana said glsa_the-grafana-token is wrong for http://a:b1234@h:1")
    assert str(error) == f"Grafana said {MASK} is wrong for http://h:1"
    assert "glsa_the-grafana-token" not in repr(error.args)
    for uri in (f"bob:{PASSWORD}@127.0.0.1:5000", f"mlflow://bob:{PASSWORD}@127.0.0.1:5000"):
        with pytest.raises(ConfigError) as raised:
            load_settings(env={"RAYDECK_TRACKING_URI": uri})
        assert PASSWORD not in str(raised.value)
        assert "RAYDECK_TRACKING_URI" in str(raised.value)


def test_runtime_envs_get_the_tracking_uri_without_credentials() -> None:
    from raydeck.cluster.connection import job_runtime_env
    from raydeck.config.settings import load_settings

    settings = load_settings(env={
        "RAYDECK_TRACKING_URI": f"http://bob:{PASSWORD}@127.0.0.1:5000",
        "RAYDECK_S3_ENDPOINT": "http://127.0.0.1:9000", "RAYDECK_S3_ACCESS_KEY_ID": "raydeck",
        "RAYDECK_S3_SECRET_ACCESS_KEY": "the-s3-secret-value",
    })
    # The process itself keeps the full URI: it may create the tracking proxy.
    assert PASSWORD in settings.tracking.uri
    env_vars = job_runtime_env(settings)["env_vars"]
    assert env_vars["RAYDECK_TRACKING_URI"] == "http://127.0.0.1:5000"
    shown = json.dumps(env_vars)
    assert PASSWORD not in shown and "the-s3-secret-value" not in shown


def test_runtime_env_files_keep_credentials_for_the_cluster_to_fill(tmp_path: Path) -> None:
    from raydeck.errors import ConfigError
    from raydeck.jobs.runtime_env import load_runtime_env

    spec = tmp_path / "env.yaml"
    spec.write_text("working_dir: .\nenv_vars:\n  RAYDECK_TRACKING_URI: ${RAYDECK_TRACKING_URI}\n"
                    "  RAYDECK_DATA_DIR: ${RAYDECK_DATA_DIR}\n")
    submitting = {"RAYDECK_TRACKING_URI": f"http://bob:{PASSWORD}@mlflow:5000",
                  "RAYDECK_DATA_DIR": "/data"}
    env_vars = load_runtime_env(spec, env=submitting, working_dir=tmp_path)["env_vars"]
    assert env_vars == {"RAYDECK_TRACKING_URI": "${RAYDECK_TRACKING_URI}",
                        "RAYDECK_DATA_DIR": "/data"}
    leaky = tmp_path / "leaky.yaml"
    leaky.write_text(f"working_dir: .\nenv_vars:\n  MLFLOW_TRACKING_URI: http://bob:{PASSWORD}@m:1\n")
    with pytest.raises(ConfigError) as raised:
        load_runtime_env(leaky)
    assert "env_vars.MLFLOW_TRACKING_URI holds a value" in str(raised.value)
    assert PASSWORD not in str(raised.value)


def test_the_reproducibility_record_is_redacted(monkeypatch: pytest.MonkeyPatch) -> None:
    from raydeck.tracking.client.repro import reproducibility_tags

    monkeypatch.setattr(sys, "argv", ["train.py", "--password", PASSWORD,
                                      f"--tracking-uri=http://bob:{PASSWORD}@mlflow:5000"])
    tags = reproducibility_tags()
    assert PASSWORD not in json.dumps(tags)
    assert tags["raydeck.entrypoint"] == ("train.py --password '********' "
                                          "--tracking-uri=http://mlflow:5000")


def _raydeck(*args: str, env: dict[str, str], cwd: Path) -> subprocess.CompletedProcess[str]:
    clean = {k: v for k, v in os.environ.items() if not k.startswith(("RAYDECK_", "RAY_"))}
    return subprocess.run([sys.executable, "-m", "raydeck.cli", *args], cwd=cwd,
                          env={**clean, "COLUMNS": "200", **env}, capture_output=True,
                          text=True, timeout=120)


def _table_values(shown: str) -> dict[str, str]:
    """``raydeck config``'s table: variable -> value shown."""
    return {line.split("│")[1].strip(): line.split("│")[2].strip()
            for line in shown.splitlines() if line.count("│") >= 4}


@pytest.mark.timeout(120)
def test_raydeck_config_shows_no_credentials(tmp_path: Path) -> None:
    env = {"RAYDECK_TRACKING_URI": f"http://bob:{PASSWORD}@127.0.0.1:5000",
           "RAYDECK_S3_ENDPOINT": "http://127.0.0.1:9000", "RAYDECK_S3_ACCESS_KEY_ID": "raydeck",
           "RAYDECK_S3_SECRET_ACCESS_KEY": "the-s3-secret-value"}
    shown = _raydeck("config", env=env, cwd=tmp_path)
    assert shown.returncode == 0, shown.stderr
    assert "http://127.0.0.1:5000" in shown.stdout and "******** (set)" in shown.stdout
    assert PASSWORD not in shown.stdout + shown.stderr
    assert "the-s3-secret-value" not in shown.stdout + shown.stderr
    # Each secret says whether it is set, whichever others are: the S3 secret alone (before,
    # any secret showed the S3 secret's state), then only the database credential.
    rows = _table_values(shown.stdout)
    assert rows["RAYDECK_S3_SECRET_ACCESS_KEY"] == "******** (set)"
    assert rows["RAYDECK_TRACKING_WRITE_DB"] == ""
    direct = _raydeck("config", env={
        "RAYDECK_TRACKING_URI": "http://127.0.0.1:5000",
        "RAYDECK_TRACKING_WRITE_DB": f"postgresql://mlflow:{PASSWORD}@db:5432/mlflow"},
        cwd=tmp_path)
    assert direct.returncode == 0, direct.stderr
    rows = _table_values(direct.stdout)
    assert rows["RAYDECK_TRACKING_WRITE_DB"] == "******** (set)"
    assert rows["RAYDECK_S3_SECRET_ACCESS_KEY"] == ""
    assert PASSWORD not in direct.stdout + direct.stderr
    bad = _raydeck("config", env={**env, "RAYDECK_TRACKING_URI": f"bob:{PASSWORD}@h:5000"},
                   cwd=tmp_path)
    assert bad.returncode == 2 and "RAYDECK_TRACKING_URI" in bad.stderr
    assert PASSWORD not in bad.stdout + bad.stderr
