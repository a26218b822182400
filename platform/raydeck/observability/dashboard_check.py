"""Checking dashboards against a Prometheus: is every panel's query valid, and does it have data.

Owns: :func:`check` (every panel query of the dashboards, run over a time range as Grafana would
send it for the default view), :class:`PanelCheck` (what one query returned, and whether that is
a failure) and :func:`metric_names` (which metrics a query reads, to say why a panel is empty).
``raydeck dashboards check`` and the end-to-end tests call it. Does not own: the dashboard model
and its variables (:mod:`raydeck.observability.dashboards`) or talking to Prometheus
(:mod:`raydeck.observability.prometheus`).

Why an empty panel is not a failure: on a healthy stack most panels are empty until something
runs (the queue's until the first queued job, Serve's until the first request). Only a query
Prometheus rejects is broken; an empty one is "no data yet", with the metrics it reads that
Prometheus has never seen and what has not run to export them.
"""

from __future__ import annotations

import re
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

DATA = "data"
EXPECTED_EMPTY = "expected empty"
NO_DATA_YET = "no data yet"
ERROR = "error"

# What has not run when Prometheus has never seen a metric of a family: the first prefix that
# matches wins, so a family goes before a broader one that contains it.
NOT_RUN_YET = (
    ("ray_raydeck_queue_", "the job queue has not run (it starts with the first "
                           "`raydeck submit --queue`)"),
    ("ray_raydeck_serving_", "no `raydeck serve` replica has run"),
    ("ray_serve_", "no Ray Serve application has served a request"),
    ("ray_raydeck_train_", "no tracked training job has reported an epoch"),
    ("ray_train_", "no Ray Train job has run"),
    ("ray_raydeck_sweep_", "no sweep has run (`raydeck sweep`)"),
    ("ray_raydeck_tracking_", "the tracking proxy has not run (it starts with the first "
                              "tracked run)"),
    ("ray_raydeck_storage_", "nothing has called object storage through raydeck"),
    ("ray_", "Ray exports it only once what it measures exists or has happened"),
)
RAY_METRIC_PREFIX = "ray_"
NO_RAY_METRICS = ("Prometheus has no Ray metric at all: does it scrape the cluster? "
                  "(`raydeck monitoring config`)")

_STRING = re.compile(r'"(?:[^"\\]|\\.)*"|\'(?:[^\'\\]|\\.)*\'|`[^`]*`')
_NAME_MATCHER = re.compile(r'__name__\s*=\s*"([a-zA-Z_:][\w:]*)"')
_LABEL_LIST = re.compile(r"\b(?:by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)")
_BRACED = re.compile(r"\{[^}]*\}|\[[^\]]*\]")
# An identifier that is not part of a number (1e3, 0x1f, 5m) and not a function's name.
_IDENTIFIER = re.compile(r"(?<![\w:.])([a-zA-Z_:][\w:]*)(?![\w:])(?!\s*\()")
_KEYWORDS = frozenset({"by", "without", "on", "ignoring", "group_left", "group_right", "bool",
                       "and", "or", "unless", "offset", "inf", "nan"})


@dataclass(frozen=True)
class PanelCheck:
    """What one panel query returned over the checked time range.

    Attributes:
        error: Prometheus' reason for rejecting the query (the panel is broken).
        empty_ok: the panel's own reason it may be empty (``needs GPUs``).
        why_empty: for a valid query without series, what it reads that Prometheus lacks.
    """

    dashboard: str
    panel: str
    ref: str
    expr: str
    series: tuple[dict[str, str], ...]
    error: str = ""
    empty_ok: str = ""
    why_empty: str = ""

    @property
    def status(self) -> str:
        """``data``, ``expected empty``, ``no data yet`` (valid, empty) or ``error``."""
        if self.error:
            return ERROR
        if self.series:
            return DATA
        return EXPECTED_EMPTY if self.empty_ok else NO_DATA_YET

    @property
    def failed(self) -> bool:
        """Whether the query is broken; an empty panel is not (it waits for its metrics)."""
        return self.status == ERROR


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
    data when it returns a series with a drawable (not NaN) sample in the range; one without
    is explained in :attr:`PanelCheck.why_empty`, from the metric names Prometheus holds.

    Raises:
        MonitoringError: Prometheus cannot be reached (query errors are reported per panel).
    """
    end_s = time.time()
    start_s = end_s - range_s
    step_s = step_s or max(MIN_CHECK_STEP_S, range_s / CHECK_POINTS)
    known: set[str] | None = None  # asked once, when the first panel is empty
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
                    answer = client.query_range(expr, start_s, end_s, step_s)
                    error = ""
                except QueryError as exc:
                    answer, error = [], str(exc)
                series = tuple(dict(s.get("metric", {})) for s in answer if _drawn(s))
                why_empty = ""
                if not error and not series:
                    if known is None:
                        known = client.metric_names(start_s, end_s)
                    why_empty = explain_empty(expr, known, range_s)
                results.append(PanelCheck(
                    dashboard=dashboard.title, panel=panel.title, ref=ref_id(index),
                    expr=expr, series=series, error=error, empty_ok=panel.empty_ok,
                    why_empty=why_empty))
    return results


def metric_names(expr: str) -> tuple[str, ...]:
    """The metric names the PromQL ``expr`` reads, each once.

    Enough PromQL for dashboards, not a parser: selectors (``name{...}``, bare ``name``,
    ``{__name__="name"}``) outside strings, label lists and brackets, that are not a function
    or a keyword. A query Prometheus would reject may give a wrong answer.
    """
    names = _NAME_MATCHER.findall(expr)
    bare = _BRACED.sub(" ", _LABEL_LIST.sub(" ", _STRING.sub('""', expr)))
    names += [n for n in _IDENTIFIER.findall(bare) if n.lower() not in _KEYWORDS]
    return tuple(dict.fromkeys(names))


def explain_empty(expr: str, known: set[str], range_s: float) -> str:
    """Why the valid query ``expr`` returned no series, given the metric names Prometheus holds.

    Names the metrics it reads that Prometheus has never seen and what has not run to export
    them (:data:`NOT_RUN_YET`); when it has them all, says the query's filters or range match
    none of their series.
    """
    names = metric_names(expr)
    absent = [n for n in names if n not in known]
    if absent:
        hints = dict.fromkeys(_not_run_yet(n, known) for n in absent)
        because = "; ".join(h for h in hints if h)
        return (f"no series: nothing has exported {', '.join(absent)} yet"
                + (f" \N{EM DASH} {because}" if because else ""))
    if not names:
        return "no series"
    few_samples = ", or too few samples for rate()" if re.search(
        r"\b(?:rate|increase|irate|delta|deriv)\s*\(", expr) else ""
    return (f"no series: Prometheus has {', '.join(names)}, but none of their series matches "
            f"this query in the last {prometheus_duration(range_s)} (its label filters"
            f"{few_samples})")


def _not_run_yet(name: str, known: set[str]) -> str:
    if name.startswith(RAY_METRIC_PREFIX) and not any(
            n.startswith(RAY_METRIC_PREFIX) for n in known):
        return NO_RAY_METRICS
    return next((hint for prefix, hint in NOT_RUN_YET if name.startswith(prefix)), "")


def _drawn(series: Mapping[str, Any]) -> bool:
    """Whether Grafana would draw anything of ``series``: some sample that is a number."""
    return any(value not in ("NaN", "+Inf", "-Inf") for _, value in series.get("values", []))
