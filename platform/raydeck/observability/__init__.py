"""Observability: the metrics raydeck exports, the Prometheus that scrapes them, the dashboards.

- :mod:`raydeck.observability.metrics`: every metric raydeck exports through Ray's per-node
  metrics agent (the registry README's table is rendered from) and the small recording APIs
  training, sweeps and storage call.
- :mod:`raydeck.observability.prometheus`: the Prometheus configuration ``raydeck monitoring
  config`` writes, and a small client for Prometheus' HTTP query API.
- :mod:`raydeck.observability.alerts`: alert rules as data, rendered to Prometheus rule files.
- :mod:`raydeck.observability.dashboards`: dashboards as data, rendered to Grafana JSON.
- :mod:`raydeck.observability.dashboard_check`: every panel's query run against a Prometheus.
- :mod:`raydeck.observability.grafana`: Grafana provisioning, and pushing dashboards (raydeck's
  and Ray's own) with the Prometheus datasource over Grafana's API.
"""

from raydeck._internal.lazy import lazy_attributes

__getattr__, __dir__ = lazy_attributes(
    __name__, ("alerts", "dashboard_check", "dashboards", "grafana", "held_gauge", "metrics",
               "prometheus")
)
