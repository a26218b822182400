"""How raydeck's settings reach the workers of the Ray that ``raydeck.cluster.connection.connect``
joins or starts (:func:`raydeck.cluster.connection.starting_ray`): a cluster it joins gets them in
the job's runtime env; a local Ray it starts inherits them from the environment, and its workers
start without Ray's runtime-env setup process."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from raydeck.cluster.connection import TRAIN_HANDOFF_CALLBACK, starting_ray, starts_local_ray

pytestmark = pytest.mark.timeout(120)
JOB_ENV = {"env_vars": {"RAYDECK_PROBE": "settings"}, "working_dir": "."}


@pytest.fixture
def no_cluster_here(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """No ``RAY_ADDRESS`` and no cluster recorded by ``ray start`` (Ray's temp dir is empty)."""
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    monkeypatch.delenv("RAYDECK_PROBE", raising=False)
    monkeypatch.setenv("RAY_TMPDIR", str(tmp_path))


def test_a_local_ray_inherits_the_settings_and_gets_only_the_rest_of_the_runtime_env(
        no_cluster_here: None) -> None:
    for address in (None, "local"):
        assert starts_local_ray(address)
        with starting_ray(address, JOB_ENV) as passed:
            assert passed == {"working_dir": "."}
            assert os.environ["RAYDECK_PROBE"] == "settings"
        assert "RAYDECK_PROBE" not in os.environ  # nothing this process starts later has it
    with starting_ray("local", {"env_vars": {"RAYDECK_PROBE": "settings"}}) as passed:
        assert passed is None  # no runtime env: workers start without Ray's setup process


def test_a_cluster_it_joins_gets_the_whole_runtime_env(
        no_cluster_here: None, monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    for address in ("127.0.0.1:6379", "ray://head:10001", "auto"):
        assert not starts_local_ray(address)
        with starting_ray(address, JOB_ENV) as passed:
            assert passed == JOB_ENV
            assert "RAYDECK_PROBE" not in os.environ
    monkeypatch.setenv("RAY_ADDRESS", "127.0.0.1:6379")
    assert not starts_local_ray(None)
    monkeypatch.delenv("RAY_ADDRESS")
    # `ray start` recorded a cluster on this machine: ray.init() with no address joins it.
    (tmp_path / "ray").mkdir()
    (tmp_path / "ray" / "ray_current_cluster").write_text("127.0.0.1:6379")
    assert not starts_local_ray(None)


def test_the_session_rays_workers_see_raydecks_settings_without_a_runtime_env(
        ray_cluster: None, raydeck_env: dict[str, str]) -> None:
    import ray

    @ray.remote
    def seen() -> dict[str, str]:
        return {name: os.environ.get(name, "") for name in (
            "RAYDECK_TRACKING_URI", "RAY_TRAIN_CALLBACKS", "RAY_TRAIN_HEALTH_CHECK_INTERVAL_S")}

    assert not ray.get_runtime_context().runtime_env  # started as connect() starts a local Ray
    found = ray.get(seen.remote(), timeout=60)
    assert found["RAYDECK_TRACKING_URI"] == raydeck_env["RAYDECK_TRACKING_URI"]
    assert TRAIN_HANDOFF_CALLBACK in found["RAY_TRAIN_CALLBACKS"]
    assert found["RAY_TRAIN_HEALTH_CHECK_INTERVAL_S"]
