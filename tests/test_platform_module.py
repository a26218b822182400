"""raydeck lives in platform/raydeck and must never shadow the standard library's `platform`."""

from __future__ import annotations

import platform as stdlib_platform

import pytest


def test_stdlib_platform_still_works_in_the_test_process() -> None:
    assert stdlib_platform.system() in ("Linux", "Darwin", "Windows")
    assert stdlib_platform.__file__ and "site-packages" not in stdlib_platform.__file__
    assert not stdlib_platform.__file__.endswith("__init__.py")


@pytest.mark.timeout(120)
def test_stdlib_platform_still_works_inside_a_ray_worker(ray_cluster: None) -> None:
    import ray

    @ray.remote
    def probe() -> tuple[str, str, str]:
        import platform

        import raydeck

        return platform.system(), platform.__file__, raydeck.__file__

    system, platform_file, raydeck_file = ray.get(probe.remote(), timeout=60)
    assert system == stdlib_platform.system()
    assert platform_file == stdlib_platform.__file__
    assert raydeck_file.endswith("platform/raydeck/__init__.py")
