"""Checking dashboards against a Prometheus: does every panel's query return something to draw.

Owns: :func:`check` (every panel query of the dashboards, run over a time range as Grafana would
send it for the default view) and :class:`PanelCheck` (what one query returned, and whether
that is a failure). ``raydeck dashboards check`` and the end-to-end tests call it. Does not own:
the dashboard model and its variables (:mod:`raydeck.observability.dashboards`) or talking to
Prometheus (:mod:`raydeck.observability.prometheus`).
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from raydeck.errors import QueryError
from raydeck.observability.dashboards import Dashboard, ref_id, substitute
from raydeck.observability.grafana import DATASOURCE_UID
from raydeck.observability.prometheus import PrometheusClient, prometheus_duration

DEFAULT_CHECK_RANGE_S = 900.0
# `check` evaluates this many points over its range (at least one per second), so a series
# that lived only seconds, like a short run's gauges, is still seen, as Grafana would draw it.
CHECK_POINTS = 300
MIN_CHECK_STEP_S = 1.0
DEFAULT_RATE_INTERVAL_S = 60.0


@dataclass(frozen=True)
class PanelCheck:
    """What one panel query returned over the checked time range."""

    dashboard: str
    panel: str
    ref: str
    expr: str
    series: tuple[dict[str, str], ...]
    error: str = ""
    empty_ok: str = ""

    @property
    def status(self) -> str:
        if self.error:
            return "error"
        if self.series:
            return "data"
        return "expected empty" if self.empty_ok else "no data"

    @property
    def failed(self) -> bool:
        return self.status in ("error", "no data")


def check(
    dashboards: list[Dashboard],
    client: PrometheusClient,
    *,
    range_s: float = DEFAULT_CHECK_RANGE_S,
    step_s: float | None = None,
    rate_interval_s: float = DEFAULT_RATE_INTERVAL_S,
    values: Mapping[str, str] | None = None,
) -> list[PanelCheck]:
    """Run every panel query of ``dashboards`` against ``client`` over the last ``range_s``.

    Variables take ``values[name]`` or their "All" value, Grafana's built-ins concrete
    durations, so each query is what Grafana would send for the default view. A query has
    data when it returns a series with a drawable (not NaN) sample in the range.

    Raises:
        MonitoringError: Prometheus cannot be reached (query errors are reported per panel).
    """
    end_s = time.time()
    step_s = step_s or max(MIN_CHECK_STEP_S, range_s / CHECK_POINTS)
    results = []
    for dashboard in dashboards:
        bound = {v.name: (values or {}).get(v.name, v.all_value) for v in dashboard.variables}
        bound.update({"__rate_interval": prometheus_duration(rate_interval_s),
                      "__interval": prometheus_duration(step_s),
                      "__range": prometheus_duration(range_s),
                      "datasource": DATASOURCE_UID})
        for panel in dashboard.panels():
            for index, target in enumerate(panel.targets):
                expr = substitute(target.expr, bound)
                try:
                    series = client.query_range(expr, end_s - range_s, end_s, step_s)
                    error = ""
                except QueryError as exc:
                    series, error = [], str(exc)
                results.append(PanelCheck(
                    dashboard=dashboard.title, panel=panel.title, ref=ref_id(index),
                    expr=expr,
                    series=tuple(dict(s.get("metric", {})) for s in series if _drawn(s)),
                    error=error, empty_ok=panel.empty_ok))
    return results


def _drawn(series: Mapping[str, Any]) -> bool:
    """Whether Grafana would draw anything of ``series``: some sample that is a number."""
    return any(value not in ("NaN", "+Inf", "-Inf") for _, value in series.get("values", []))
