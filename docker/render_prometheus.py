"""Render ``docker/prometheus.yml``, the compose stack's Prometheus config, with raydeck's own code.

Why a script and not ``raydeck monitoring config``: the command checks that the rule files it is
given exist on this machine, while the compose file needs paths inside the Prometheus container.
The content is the same :class:`~raydeck.observability.prometheus.PrometheusConfig` either way.

What the config says: targets come from the service-discovery file the Ray head's dashboard
writes into ``/tmp/ray/session_latest`` (the ``ray-head-tmp`` volume, mounted read-only into
Prometheus), so the head and every ``ray-worker`` replica (``--scale ray-worker=N``) are
scraped at their container addresses on the compose network, together with the Ray dashboard's
and autoscaler's own metrics ports; ``ray_io_cluster`` is :data:`CLUSTER_NAME`.

Usage, from the repository root::

    python docker/render_prometheus.py           # rewrite docker/prometheus.yml
    python docker/render_prometheus.py --check   # exit 1 if the committed file is stale
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from raydeck.observability.prometheus import PrometheusConfig, default_discovery_file

OUTPUT_FILE = Path(__file__).resolve().parent / "prometheus.yml"
# Where docker-compose.yml mounts the Ray head's temp dir and raydeck's rendered alert rules in
# the Prometheus container. Outside /etc on purpose: PrometheusConfig resolves rule paths, and
# /etc is a symlink on some hosts (macOS), which would make the rendered text host-dependent.
RAY_TEMP_DIR_IN_CONTAINER = Path("/tmp/ray")
RULES_FILE_IN_CONTAINER = Path("/opt/raydeck/rules/raydeck.rules.yml")
CLUSTER_NAME = "compose"
HEADER = "# Rendered by `python docker/render_prometheus.py` (PrometheusConfig); do not edit.\n"


def compose_prometheus_config() -> PrometheusConfig:
    """The Prometheus config of the compose stack (see the module docstring)."""
    return PrometheusConfig(
        discovery_file=default_discovery_file(RAY_TEMP_DIR_IN_CONTAINER),
        rule_files=(RULES_FILE_IN_CONTAINER,),
        local=False,
        cluster=CLUSTER_NAME,
    )


def render() -> str:
    """The text of :data:`OUTPUT_FILE`: the rendered config under a header naming this script.

    The header ``PrometheusConfig`` writes names ``raydeck monitoring config``; its first line is
    replaced so nobody regenerates this file with the wrong command.
    """
    lines = compose_prometheus_config().render().splitlines(keepends=True)
    if lines and lines[0].startswith("# Written by"):
        lines = lines[1:]
    return "".join([HEADER, *lines])


def main(argv: list[str] | None = None) -> int:
    """Write :data:`OUTPUT_FILE`, or with ``--check`` report whether it is current.

    Returns:
        0 when written or current, 1 when ``--check`` finds it stale or missing.
    """
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true",
                        help="Fail if the committed file differs from a fresh render.")
    args = parser.parse_args(argv)
    rendered = render()
    if args.check:
        current = OUTPUT_FILE.is_file() and OUTPUT_FILE.read_text() == rendered
        if not current:
            print(f"{OUTPUT_FILE} is stale: run python docker/render_prometheus.py",
                  file=sys.stderr)
        return 0 if current else 1
    OUTPUT_FILE.write_text(rendered)
    print(f"wrote {OUTPUT_FILE}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
