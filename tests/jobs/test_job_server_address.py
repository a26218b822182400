"""The job commands find the job server from Ray's addresses in each of their forms.

What a user sets for Ray (``RAY_API_SERVER_ADDRESS``, ``RAY_ADDRESS`` as ``http://``,
``ray://`` or ``host:port``, ``RAYDECK_RAY_ADDRESS``) leads ``submit``, ``jobs``, ``queue`` and
``cancel`` to the job server, or to one error naming ``RAY_API_SERVER_ADDRESS``; never silently
to ``http://127.0.0.1:8265``. No Ray cluster here: the GCS read is given as a function where a
test needs a head's answer, and is run for real only against addresses where no GCS answers.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from raydeck.config.secrets import Secret
from raydeck.config.stack_connection import StackConnection
from raydeck.errors import ClusterUnavailableError, ConfigError
from raydeck.jobs.address import (
    ClusterAddress,
    choose_address,
    find_job_server,
    job_server_from_gcs_record,
    read_registered_dashboard,
    resolve_job_server,
)

# Names under .invalid never resolve (RFC 6761): nothing answers there, quickly.
NOWHERE = "head.invalid"
NO_STACK = {"RAYDECK_STACK_FILE": "", "HOME": "/nonexistent"}


@pytest.mark.parametrize(
    ("flag", "env", "ray_address", "expected"),
    [
        # --address and RAY_API_SERVER_ADDRESS name the job server: host:port is its URL.
        ("h:8265", {"RAY_API_SERVER_ADDRESS": "http://a:1"}, "", ("http://h:8265", "--address")),
        (None, {"RAY_API_SERVER_ADDRESS": "a:1", "RAY_ADDRESS": "http://b:2"}, "g:6379",
         ("http://a:1", "RAY_API_SERVER_ADDRESS")),
        # RAY_ADDRESS as a URL is the job server, as `ray job submit` reads it ...
        (None, {"RAY_ADDRESS": "http://b:2"}, "g:6379", ("http://b:2", "RAY_ADDRESS")),
        # ... raydeck's own cluster setting comes before RAY_ADDRESS's other forms ...
        (None, {"RAY_ADDRESS": "ray://c:10001"}, "g:6379", ("g:6379", "RAYDECK_RAY_ADDRESS")),
        (None, {"RAY_ADDRESS": "c:6379"}, "", ("c:6379", "RAY_ADDRESS")),
        (None, {"RAY_ADDRESS": "ray://c:10001"}, "auto", ("ray://c:10001", "RAY_ADDRESS")),
        # ... and auto/local name no particular head.
        (None, {"RAY_ADDRESS": "auto"}, "local", None),
        (None, {}, "", None),
    ],
)
def test_the_job_server_comes_from_the_first_address_set(
    flag: str | None, env: dict[str, str], ray_address: str,
    expected: tuple[str, str] | None
) -> None:
    chosen = choose_address(flag, env, ray_address)
    assert (chosen.value, chosen.source) == expected if chosen else expected is None


@pytest.mark.parametrize(("value", "form"), [
    ("http://h:8265", "url"), ("https://ray.example.com/dashboard", "url"),
    ("ray://h:10001", "client"), ("h:6379", "gcs"), ("10.0.0.1:6379", "gcs"),
    ("[::1]:6379", "gcs"),
])
def test_each_of_rays_address_forms_is_recognised(value: str, form: str) -> None:
    assert ClusterAddress(value, "RAY_ADDRESS").form == form


def test_an_address_in_no_form_is_refused_naming_where_it_was_set() -> None:
    with pytest.raises(ConfigError, match=r"^RAY_ADDRESS = 'head': not a Ray address"):
        choose_address(None, {"RAY_ADDRESS": "head"}, "")


def test_a_url_is_the_job_server_as_is() -> None:
    def never(*_: object) -> str:
        raise AssertionError("a URL needs no GCS")

    chosen = ClusterAddress("https://ray.example.com/dashboard/", "RAY_ADDRESS")
    assert resolve_job_server(chosen, read_gcs=never) == "https://ray.example.com/dashboard"


def test_a_gcs_address_leads_to_the_dashboard_its_head_registered() -> None:
    asked: list[tuple[str, Secret | None]] = []

    def head(gcs: ClusterAddress, token: Secret | None) -> str:
        asked.append((gcs.host_port, token))
        return "127.0.0.1:18265"  # what Ray's dashboard writes: host:port

    chosen = ClusterAddress("127.0.0.1:16379", "RAY_ADDRESS")
    found = resolve_job_server(chosen, read_gcs=head, token_for=lambda _gcs: Secret("t"))
    assert found == "http://127.0.0.1:18265"
    assert asked == [("127.0.0.1:16379", Secret("t"))]


def test_the_running_stacks_gcs_leads_to_its_job_server_without_asking(tmp_path: Path) -> None:
    stack = StackConnection(state_dir=tmp_path, credentials_file=tmp_path / "c",
                            ray_auth_token_file=tmp_path / "t", ray_address="127.0.0.1:16379",
                            job_server="http://127.0.0.1:18265")

    def never(*_: object) -> str:
        raise AssertionError("the stack's job server is known")

    for value in ("127.0.0.1:16379", "ray://127.0.0.1:16379"):
        found = resolve_job_server(ClusterAddress(value, "RAYDECK_RAY_ADDRESS"), stack=stack,
                                   read_gcs=never)
        assert found == "http://127.0.0.1:18265"


def test_a_dashboard_on_a_remote_heads_loopback_is_one_clear_error() -> None:
    # Ray's default --dashboard-host is 127.0.0.1: the head registers 127.0.0.1:8265, which
    # is the head's own loopback, not this machine's.
    gcs = ClusterAddress("203.0.113.7:6379", "RAY_ADDRESS")
    with pytest.raises(ClusterUnavailableError) as raised:
        job_server_from_gcs_record(gcs, "127.0.0.1:8265", gcs_is_local=False)
    assert "--dashboard-host 0.0.0.0" in str(raised.value)
    assert "RAY_API_SERVER_ADDRESS" in str(raised.value)
    assert job_server_from_gcs_record(gcs, "10.0.0.5:8265", False) == "http://10.0.0.5:8265"
    local = ClusterAddress("127.0.0.1:6379", "RAY_ADDRESS")
    assert job_server_from_gcs_record(local, "127.0.0.1:8265", True) == "http://127.0.0.1:8265"


@pytest.mark.parametrize("value", ["ray://h.example:10001", "h.example:6379"])
def test_the_dashboards_default_port_is_used_only_when_the_gcs_cannot_tell(value: str) -> None:
    def unreadable(_gcs: ClusterAddress, _token: Secret | None) -> str:
        raise ClusterUnavailableError("it refused the request")

    def no_session(_client: ClusterAddress) -> str:
        raise ClusterUnavailableError("its Ray Client session failed")

    chosen = ClusterAddress(value, "RAY_ADDRESS")
    tried: list[str] = []

    def answers(url: str) -> bool:
        tried.append(url)
        return True

    assert resolve_job_server(chosen, read_gcs=unreadable, read_client=no_session,
                              answers=answers) == "http://h.example:8265"
    assert tried == ["http://h.example:8265"]
    with pytest.raises(ClusterUnavailableError) as raised:
        resolve_job_server(chosen, read_gcs=unreadable, read_client=no_session,
                           answers=lambda _url: False)
    message = str(raised.value)
    assert message.startswith(f"no Ray job server found for RAY_ADDRESS={value}: ")
    assert "set RAY_API_SERVER_ADDRESS to the cluster's job server" in message
    assert "nothing answers at http://h.example:8265" in message


def test_a_ray_client_address_leads_to_the_dashboard_its_session_reports() -> None:
    asked: list[str] = []

    def session(client: ClusterAddress) -> str:
        asked.append(client.value)
        return "10.0.0.5:8300"

    chosen = ClusterAddress("ray://h.example:10001", "RAY_ADDRESS")
    assert resolve_job_server(chosen, read_client=session) == "http://10.0.0.5:8300"
    assert asked == ["ray://h.example:10001"]


def test_credentials_in_an_address_stay_out_of_the_error() -> None:
    with pytest.raises(ConfigError) as raised:
        choose_address(None, {"RAY_ADDRESS": "ray://bob:pw-1234@h.example:10001"}, "")
    assert "pw-1234" not in str(raised.value)


# --- the GCS read, for real, where no GCS answers ----------------------------------------------
@pytest.fixture
def not_a_gcs() -> Iterator[str]:
    """A TCP server that accepts connections and never answers: a port that is no GCS."""
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(8)
    try:
        yield f"127.0.0.1:{server.getsockname()[1]}"
    finally:
        server.close()


@pytest.mark.timeout(60)
def test_reading_a_gcs_that_is_not_there_fails_within_seconds(not_a_gcs: str) -> None:
    started = time.monotonic()
    with pytest.raises(ClusterUnavailableError, match=r"^cannot reach it"):
        read_registered_dashboard(ClusterAddress(f"{NOWHERE}:6379", "RAY_ADDRESS"), None)
    with pytest.raises(ClusterUnavailableError, match=r"^it does not answer as a GCS"):
        read_registered_dashboard(ClusterAddress(not_a_gcs, "RAY_ADDRESS"), None, timeout_s=1.0)
    assert time.monotonic() - started < 30


@pytest.mark.timeout(60)
@pytest.mark.parametrize("variable", ["RAY_ADDRESS", "RAYDECK_RAY_ADDRESS"])
@pytest.mark.parametrize("value", [f"ray://{NOWHERE}:10001", f"{NOWHERE}:6379"])
def test_an_address_that_leads_nowhere_is_an_error_not_the_local_default(
    variable: str, value: str
) -> None:
    with pytest.raises(ClusterUnavailableError) as raised:
        find_job_server(None, {**NO_STACK, variable: value})
    assert f"for {variable}={value}: " in str(raised.value)
    assert "RAY_API_SERVER_ADDRESS" in str(raised.value)


def test_with_nothing_set_the_job_server_is_the_local_default() -> None:
    assert find_job_server(None, NO_STACK) == "http://127.0.0.1:8265"
    assert find_job_server(None, {**NO_STACK, "RAY_ADDRESS": "auto"}) == "http://127.0.0.1:8265"
    assert find_job_server(None, {**NO_STACK, "RAY_API_SERVER_ADDRESS": "http://a:1/",
                                  "RAY_ADDRESS": f"ray://{NOWHERE}:1"}) == "http://a:1"


@pytest.mark.timeout(120)
def test_the_job_commands_say_which_variable_to_set(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("RAYDECK_", "RAY_"))}
    result = subprocess.run(
        [sys.executable, "-m", "raydeck.cli", "jobs"], cwd=tmp_path, capture_output=True,
        text=True, timeout=100,
        env={**env, **NO_STACK, "RAY_ADDRESS": f"ray://{NOWHERE}:10001", "COLUMNS": "250"})
    assert result.returncode == 2, result.stdout + result.stderr
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and "Traceback" not in result.stderr, result.stderr
    assert lines[0].startswith(f"error: no Ray job server found for RAY_ADDRESS=ray://{NOWHERE}")
    assert "set RAY_API_SERVER_ADDRESS" in lines[0]
