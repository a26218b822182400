"""Prometheus for raydeck: the scrape configuration, and a small client for its HTTP API.

Owns: the configuration ``raydeck monitoring config`` writes (scrape every Ray node, load
raydeck's alert rules) and :class:`PrometheusClient`, which ``raydeck dashboards check`` and the
tests use to run queries. Does not own: running Prometheus (the compose stack, or whoever
operates it) or the rules themselves (:mod:`raydeck.observability.alerts`).

Which targets: Ray's dashboard process writes ``prom_metrics_service_discovery.json`` into the
session directory every few seconds, listing every alive node's metrics export port plus the
autoscaler's and the dashboard's; ``<ray temp dir>/session_latest`` always points at the newest
session. The configuration hands that file to Prometheus' ``file_sd_configs``, so nodes that
join or leave are followed without reloading Prometheus. Ray writes the file only while its
dashboard runs (``ray start --head`` and ``ray.init()`` start it when ``ray[default]`` is
installed).

Local mode: on one machine the file lists the node's interface address, not loopback, and that
address may not be reachable from where Prometheus runs (a container, a sandbox); Ray's
exporters listen on every interface, so local mode scrapes ``127.0.0.1:<port>`` instead. The
node's own address stays the ``instance`` label either way, so dashboards look the same.
"""

from __future__ import annotations

import math
import os
import re
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from raydeck.errors import ConfigError, MonitoringError, QueryError

DISCOVERY_FILE_NAME = "prom_metrics_service_discovery.json"
SESSION_LATEST = "session_latest"
RAY_JOB_NAME = "ray"
CLUSTER_LABEL = "ray_io_cluster"
LOOPBACK = "127.0.0.1"
DEFAULT_SCRAPE_INTERVAL_S = 15.0
DEFAULT_EVALUATION_INTERVAL_S = 15.0
QUERY_TIMEOUT_S = 30.0
_LABEL_VALUE = re.compile(r"^[\w.\-]+$")


def ray_temp_dir() -> Path:
    """Ray's temp root on this machine (``ray start --temp-dir`` changes it; so does RAY_TMPDIR).

    Mirrors Ray's own default so a config written here finds what the local Ray writes.
    """
    try:
        from ray._common.utils import get_default_ray_temp_dir

        return Path(get_default_ray_temp_dir())
    except ImportError:  # Ray moved it: its documented default
        return Path(os.environ.get("RAY_TMPDIR", "/tmp")) / "ray"


def default_discovery_file(temp_dir: Path | None = None) -> Path:
    """The newest Ray session's service-discovery file under ``temp_dir``."""
    return (temp_dir or ray_temp_dir()) / SESSION_LATEST / DISCOVERY_FILE_NAME


def prometheus_duration(seconds: float) -> str:
    """``seconds`` as a Prometheus duration (``90s``, ``10m``, ``2h``); at least 1 ms."""
    if seconds <= 0 or not math.isfinite(seconds):
        raise ValueError(f"duration {seconds!r} s: must be a positive number of seconds")
    if seconds < 1:
        return f"{max(1, round(seconds * 1000))}ms"
    whole = round(seconds)
    for unit, size in (("h", 3600), ("m", 60)):
        if whole % size == 0:
            return f"{whole // size}{unit}"
    return f"{whole}s"


def parse_duration(text: str) -> float:
    """Seconds in a duration such as ``90s``, ``15m``, ``2h`` or ``30`` (seconds).

    Raises:
        ConfigError: not a positive duration.
    """
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*(ms|s|m|h|d)?\s*", text)
    seconds = 0.0
    if match:
        scale = {"ms": 0.001, "s": 1, "m": 60, "h": 3600, "d": 86400}[match.group(2) or "s"]
        seconds = float(match.group(1)) * scale
    if seconds <= 0:
        raise ConfigError(f"duration {text!r}: must be a positive number with an optional unit "
                          "(ms, s, m, h, d), e.g. 15m")
    return seconds


@dataclass(frozen=True)
class PrometheusConfig:
    """What Prometheus scrapes and evaluates; :meth:`render` gives its ``prometheus.yml``.

    Attributes:
        discovery_file: Ray's service-discovery file (see the module docstring).
        rule_files: alert rule files to load (absolute paths are written).
        local: scrape ``127.0.0.1:<port>`` instead of the address the file lists.
        cluster: value of the ``ray_io_cluster`` label put on every series (the dashboards'
            cluster variable); empty leaves it unset.
        scrape_interval_s: how often every target is scraped.
        evaluation_interval_s: how often alert rules are evaluated.
    """

    discovery_file: Path
    rule_files: tuple[Path, ...] = ()
    local: bool = True
    cluster: str = ""
    scrape_interval_s: float = DEFAULT_SCRAPE_INTERVAL_S
    evaluation_interval_s: float = DEFAULT_EVALUATION_INTERVAL_S

    def __post_init__(self) -> None:
        for name in ("scrape_interval_s", "evaluation_interval_s"):
            value = getattr(self, name)
            if not (isinstance(value, (int, float)) and math.isfinite(value) and value >= 1):
                raise ConfigError(f"{name}={value!r}: must be at least 1 second")
        if self.cluster and not _LABEL_VALUE.match(self.cluster):
            raise ConfigError(f"cluster={self.cluster!r}: may hold letters, digits, _ . - only")

    def render(self) -> str:
        """The configuration as YAML text, with a header saying how it was made."""
        relabel: list[dict[str, Any]] = [
            # The node's address stays the instance label, also when scraping loopback.
            {"source_labels": ["__address__"], "target_label": "instance"},
        ]
        if self.local:
            relabel.append({"source_labels": ["__address__"], "regex": r".*:(\d+)",
                            "target_label": "__address__", "replacement": f"{LOOPBACK}:$1"})
        if self.cluster:
            relabel.append({"target_label": CLUSTER_LABEL, "replacement": self.cluster})
        document: dict[str, Any] = {
            "global": {
                "scrape_interval": prometheus_duration(self.scrape_interval_s),
                "evaluation_interval": prometheus_duration(self.evaluation_interval_s),
            },
        }
        if self.rule_files:
            document["rule_files"] = [str(Path(p).resolve()) for p in self.rule_files]
        document["scrape_configs"] = [{
            "job_name": RAY_JOB_NAME,
            "file_sd_configs": [{"files": [str(self.discovery_file)]}],
            "relabel_configs": relabel,
        }]
        header = ("# Written by `raydeck monitoring config`; run it again rather than editing.\n"
                  f"# Targets: every Ray node listed in {self.discovery_file}"
                  f"{' (scraped on 127.0.0.1)' if self.local else ''}.\n")
        return header + yaml.safe_dump(document, sort_keys=False)

    def write(self, path: Path) -> Path:
        """Write :meth:`render` to ``path`` (parents created); returns ``path``."""
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(self.render())
        return path


class PrometheusClient:
    """Prometheus' HTTP API: instant and range queries, rules and alerts.

    Raises (every method):
        MonitoringError: Prometheus cannot be reached or answers with something else than its
            API (the message names the URL).
        QueryError: Prometheus rejected the expression (bad PromQL, unknown function).
    """

    def __init__(self, url: str, timeout_s: float = QUERY_TIMEOUT_S) -> None:
        if not re.match(r"^https?://[^/\s]+", url):
            raise ConfigError(f"Prometheus URL {url!r}: must look like http://host:9090")
        self.url = url.rstrip("/")
        self.timeout_s = timeout_s

    def query(self, expr: str, at_s: float | None = None) -> list[dict[str, Any]]:
        """Evaluate ``expr`` at ``at_s`` (default now); the result's list of series."""
        params = {"query": expr, **({"time": f"{at_s:.3f}"} if at_s is not None else {})}
        return self._result(self._get("/api/v1/query", params))

    def query_range(self, expr: str, start_s: float, end_s: float, step_s: float
                    ) -> list[dict[str, Any]]:
        """Evaluate ``expr`` every ``step_s`` between ``start_s`` and ``end_s``."""
        params = {"query": expr, "start": f"{start_s:.3f}", "end": f"{end_s:.3f}",
                  "step": f"{step_s:g}"}
        return self._result(self._get("/api/v1/query_range", params))

    def metric_names(self, start_s: float, end_s: float) -> set[str]:
        """Names of the metrics Prometheus holds series of between ``start_s`` and ``end_s``.

        Prometheus answers from whole storage blocks, so a name may also have been seen a
        little before ``start_s`` (hours at most); good enough to tell "nothing ever exported
        this" from "exported, but not matching".
        """
        params = {"start": f"{start_s:.3f}", "end": f"{end_s:.3f}"}
        return set(self._get("/api/v1/label/__name__/values", params)["data"])

    def rules(self) -> list[dict[str, Any]]:
        """Every loaded rule group with each rule's health and last evaluation error."""
        return list(self._get("/api/v1/rules", {})["data"]["groups"])

    def alerts(self) -> list[dict[str, Any]]:
        """Alerts that are pending or firing now."""
        return list(self._get("/api/v1/alerts", {})["data"]["alerts"])

    def targets(self) -> list[dict[str, Any]]:
        """The active scrape targets with their health."""
        return list(self._get("/api/v1/targets", {})["data"]["activeTargets"])

    def wait_ready(self, timeout_s: float) -> None:
        """Block until Prometheus answers ``/-/ready``.

        Raises:
            MonitoringError: not ready within ``timeout_s``.
        """
        import requests

        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            try:
                if requests.get(f"{self.url}/-/ready", timeout=2).status_code == 200:
                    return
            except requests.RequestException:
                pass
            time.sleep(0.2)
        raise MonitoringError(f"Prometheus at {self.url} was not ready after {timeout_s:.0f} s")

    @staticmethod
    def _result(answer: dict[str, Any]) -> list[dict[str, Any]]:
        data = answer["data"]
        if data["resultType"] in ("scalar", "string"):
            return [{"metric": {}, "value": data["result"]}]
        return list(data["result"])

    def _get(self, path: str, params: dict[str, str]) -> dict[str, Any]:
        import requests

        try:
            answer = requests.get(f"{self.url}{path}", params=params, timeout=self.timeout_s)
        except requests.RequestException as exc:
            raise MonitoringError(f"cannot reach Prometheus at {self.url} ({type(exc).__name__});"
                                  " start it or pass the right --prometheus-url") from None
        try:
            body = answer.json()
        except ValueError:
            raise MonitoringError(f"{self.url}{path} answered HTTP {answer.status_code} without "
                                  "Prometheus' JSON; is this Prometheus?") from None
        if body.get("status") != "success":
            error = f"{body.get('errorType', 'error')}: {body.get('error', answer.text[:200])}"
            if answer.status_code in (400, 422):
                raise QueryError(error)
            raise MonitoringError(f"Prometheus at {self.url} answered {error}")
        return body
