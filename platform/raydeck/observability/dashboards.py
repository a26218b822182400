"""Dashboards as code: panel definitions rendered to Grafana JSON, deterministically.

Owns: the dashboard model (:class:`Dashboard`, :class:`Row`, :class:`Panel`, :class:`Target`,
:class:`Variable`), its deterministic rendering to Grafana dashboard JSON, loading the
definitions in ``dashboards/*.py`` (and the alert rules in ``dashboards/alerts/rules.py``),
and writing everything ``raydeck dashboards render`` produces. Does not own: which panels exist
(``dashboards/*.py``), the metrics they read (:mod:`raydeck.observability.metrics`), running
their queries against a Prometheus (:mod:`raydeck.observability.dashboard_check`) or talking to
Grafana (:mod:`raydeck.observability.grafana`).

Why hand-written dataclasses and not a library: raydeck emits four kinds of JSON object
(dashboard, row, panel, variable) in the stable subset of Grafana's schema that Grafana migrates
forward, and needs a model that tests and ``check`` can walk (every target's PromQL, why a panel
may be empty). Model and rendering are ~250 lines, the same choice Ray made for its own
dashboards (``ray/dashboard/modules/metrics/dashboards/*_panels.py``). grafanalib would add a
dependency whose last release (0.7.1, January 2024) predates current Grafana panel options and
whose company (Weaveworks) has closed; grafana-foundation-sdk is generated per Grafana release
(its versions are tied to a Grafana version) and its builder API is far larger than what we
use. Either way we would still wrap it to keep the walkable model.

Rendering is deterministic: ids are assigned in order, keys are sorted, nothing depends on time,
so ``raydeck dashboards render --check`` (and a test) can demand that the committed JSON equals
a fresh render.
"""

from __future__ import annotations

import importlib.util
import json
import re
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, get_args

from raydeck.errors import ConfigError
from raydeck.observability.alerts import RULES_FILE_NAME, RuleGroup, render_rules
from raydeck.observability.grafana import DATASOURCE_NAME, DATASOURCE_UID, provisioning_files
from raydeck.observability.metrics import MetricSpec
from raydeck.observability.prometheus import CLUSTER_LABEL

PanelKind = Literal["timeseries", "stat"]

GRID_WIDTH = 24
SCHEMA_VERSION = 39
DATASOURCE_REF = {"type": "prometheus", "uid": "${datasource}"}
RENDERED_DIR = "grafana"
ALERTS_DIR = "alerts"
RULES_DEFINITION = "rules.py"
# Grafana's own variables, which `dashboard_check.check` replaces with concrete values.
BUILTIN_VARIABLES = ("__rate_interval", "__interval", "__range")

_VARIABLE_REF = re.compile(r"\$\{(\w+)\}|\$(\w+)")
_UID = re.compile(r"^[a-z0-9][a-z0-9\-]{0,39}$")


@dataclass(frozen=True)
class Threshold:
    """A colour step: values at or above ``value`` are drawn in ``color``."""

    value: float
    color: str


@dataclass(frozen=True)
class Target:
    """One PromQL query of a panel; ``legend`` is Grafana's legend format (``{{run}}``)."""

    expr: str
    legend: str = ""


@dataclass(frozen=True)
class Panel:
    """One panel.

    Attributes:
        title: shown on the panel.
        targets: its queries.
        unit: Grafana unit id (``s``, ``bytes``, ``percent``, ``short``, ``reqps``, ...).
        description: the info tooltip: what the panel shows and what to do about it.
        kind: ``timeseries`` or ``stat``.
        thresholds: colour steps above the base colour (green).
        width, height: grid size (the grid is 24 wide).
        stack: stack the series (timeseries only).
        empty_ok: why the panel may legitimately show no data (``needs GPUs``); ``check``
            reports such a panel as expected-empty instead of failing.
        no_value: what Grafana shows instead of "No data" (``0`` for a count of failures
            that Ray only exports once one happened).
    """

    title: str
    targets: tuple[Target, ...]
    unit: str = "short"
    description: str = ""
    kind: PanelKind = "timeseries"
    thresholds: tuple[Threshold, ...] = ()
    width: int = 12
    height: int = 8
    stack: bool = False
    empty_ok: str = ""
    no_value: str = ""

    def __post_init__(self) -> None:
        if not self.targets:
            raise ValueError(f"panel {self.title!r}: needs at least one target")
        if self.kind not in get_args(PanelKind):
            raise ValueError(f"panel {self.title!r}: kind {self.kind!r} is not one of "
                             f"{', '.join(get_args(PanelKind))}")
        if not 1 <= self.width <= GRID_WIDTH:
            raise ValueError(f"panel {self.title!r}: width must be 1..{GRID_WIDTH}")


@dataclass(frozen=True)
class Row:
    """A titled row of panels."""

    title: str
    panels: tuple[Panel, ...]


@dataclass(frozen=True)
class Variable:
    """A query template variable (a dropdown filled by ``label_values(...)``).

    Attributes:
        name: used as ``$name`` in queries.
        label: the dropdown's label.
        query: Grafana's Prometheus variable query, e.g. ``label_values(metric, label)``.
        description: tooltip.
        all_value: regex used for "All"; ``.*`` also matches series without the label.
    """

    name: str
    label: str
    query: str
    description: str = ""
    all_value: str = ".*"


@dataclass(frozen=True)
class Dashboard:
    """One Grafana dashboard; ``uid`` is stable so links and pushes keep working.

    Raises:
        ValueError: a bad uid, duplicate panel titles, or a query that uses a variable the
            dashboard does not define.
    """

    uid: str
    title: str
    description: str
    rows: tuple[Row, ...]
    variables: tuple[Variable, ...] = ()
    tags: tuple[str, ...] = ("raydeck",)
    refresh: str = "30s"
    time_from: str = "now-1h"

    def __post_init__(self) -> None:
        if not _UID.match(self.uid):
            raise ValueError(f"dashboard uid {self.uid!r}: 1-40 of a-z 0-9 - (stable, in URLs)")
        titles = [p.title for p in self.panels()]
        duplicates = sorted({t for t in titles if titles.count(t) > 1})
        if duplicates:
            raise ValueError(f"dashboard {self.uid}: duplicate panel title(s) {duplicates}")
        defined = {v.name for v in self.variables} | {"datasource", *BUILTIN_VARIABLES}
        for panel in self.panels():
            for target in panel.targets:
                missing = variables_used(target.expr) - defined
                if missing:
                    raise ValueError(f"dashboard {self.uid}, panel {panel.title!r}: undefined "
                                     f"variable(s) {sorted(missing)}")

    def panels(self) -> list[Panel]:
        return [panel for row in self.rows for panel in row.panels]

    def render(self) -> dict[str, Any]:
        """Grafana dashboard JSON (the model Grafana's API and file provisioning accept)."""
        panels: list[dict[str, Any]] = []
        next_id = 1
        y = 0
        for row in self.rows:
            panels.append({"id": next_id, "type": "row", "title": row.title, "collapsed": False,
                           "panels": [], "gridPos": {"x": 0, "y": y, "w": GRID_WIDTH, "h": 1}})
            next_id += 1
            y += 1
            x, line_height = 0, 0
            for panel in row.panels:
                if x + panel.width > GRID_WIDTH:
                    x, y, line_height = 0, y + line_height, 0
                panels.append(_render_panel(panel, next_id, x, y))
                next_id += 1
                x += panel.width
                line_height = max(line_height, panel.height)
            y += line_height
        return {
            "id": None,
            "uid": self.uid,
            "title": self.title,
            "description": self.description,
            "tags": list(self.tags),
            "editable": True,
            "graphTooltip": 1,
            "schemaVersion": SCHEMA_VERSION,
            "version": 1,
            "refresh": self.refresh,
            "time": {"from": self.time_from, "to": "now"},
            "timezone": "browser",
            "annotations": {"list": []},
            "links": [{"type": "dashboards", "tags": ["raydeck"], "asDropdown": True,
                       "title": "raydeck", "includeVars": True, "keepTime": True}],
            "templating": {"list": [_datasource_variable(),
                                    *(_render_variable(v) for v in self.variables)]},
            "panels": panels,
        }

    def to_json(self) -> str:
        return json.dumps(self.render(), indent=2, sort_keys=True) + "\n"


def variables_used(expr: str) -> set[str]:
    """Names of the ``$var``/``${var}`` references in ``expr``."""
    return {a or b for a, b in _VARIABLE_REF.findall(expr)}


def ref_id(index: int) -> str:
    """Grafana's id of a panel's ``index``-th query: A, B, C, ..."""
    return chr(ord("A") + index)


def substitute(expr: str, values: Mapping[str, str]) -> str:
    """``expr`` with every ``$var``/``${var}`` replaced by ``values[var]``.

    Raises:
        ConfigError: ``expr`` uses a variable ``values`` lacks.
    """

    def replace(match: re.Match[str]) -> str:
        name = match.group(1) or match.group(2)
        if name not in values:
            raise ConfigError(f"query uses ${name}, which has no value: {expr}")
        return values[name]

    return _VARIABLE_REF.sub(replace, expr)



def _render_panel(panel: Panel, panel_id: int, x: int, y: int) -> dict[str, Any]:
    description = panel.description
    if panel.empty_ok:
        description = f"{description} Empty when: {panel.empty_ok}.".strip()
    steps: list[dict[str, Any]] = [{"color": "green", "value": None}]
    steps += [{"color": t.color, "value": t.value} for t in panel.thresholds]
    defaults: dict[str, Any] = {"unit": panel.unit,
                                "thresholds": {"mode": "absolute", "steps": steps}}
    if panel.no_value:
        defaults["noValue"] = panel.no_value
    rendered: dict[str, Any] = {
        "id": panel_id,
        "type": panel.kind,
        "title": panel.title,
        "description": description,
        "datasource": DATASOURCE_REF,
        "gridPos": {"x": x, "y": y, "w": panel.width, "h": panel.height},
        "targets": [
            {"refId": ref_id(i), "datasource": DATASOURCE_REF, "expr": t.expr,
             "legendFormat": t.legend, "range": True, "instant": False}
            for i, t in enumerate(panel.targets)
        ],
    }
    if panel.kind == "timeseries":
        defaults["custom"] = {"drawStyle": "line", "lineWidth": 1, "fillOpacity": 10,
                              "showPoints": "never", "spanNulls": False,
                              "stacking": {"mode": "normal" if panel.stack else "none",
                                           "group": "A"}}
        rendered["options"] = {"legend": {"displayMode": "list", "placement": "bottom",
                                          "showLegend": True},
                               "tooltip": {"mode": "multi", "sort": "desc"}}
    else:
        defaults["color"] = {"mode": "thresholds"}
        rendered["options"] = {"reduceOptions": {"calcs": ["lastNotNull"], "fields": "",
                                                 "values": False},
                               "colorMode": "value", "graphMode": "area", "justifyMode": "auto",
                               "orientation": "auto", "textMode": "auto"}
    rendered["fieldConfig"] = {"defaults": defaults, "overrides": []}
    return rendered


def _datasource_variable() -> dict[str, Any]:
    return {"name": "datasource", "label": "Data source", "type": "datasource",
            "query": "prometheus", "refresh": 1, "hide": 0, "regex": "", "options": [],
            "current": {"text": DATASOURCE_NAME, "value": DATASOURCE_UID}}


def _render_variable(variable: Variable) -> dict[str, Any]:
    return {
        "name": variable.name,
        "label": variable.label,
        "description": variable.description,
        "type": "query",
        "datasource": DATASOURCE_REF,
        "definition": variable.query,
        "query": {"query": variable.query, "refId": f"{variable.name}-values"},
        "refresh": 2,
        "includeAll": True,
        "allValue": variable.all_value,
        "multi": True,
        "sort": 1,
        "hide": 0,
        "regex": "",
        "options": [],
        "current": {"selected": True, "text": ["All"], "value": ["$__all"]},
    }


# --- what every raydeck dashboard shares ----------------------------------------------------
CLUSTER_FILTER = f'{CLUSTER_LABEL}=~"$cluster"'


def selector(metric: MetricSpec | str, *matchers: str, suffix: str = "") -> str:
    """``name{m1, m2}``: a series selector for ``metric`` (a spec or a Ray metric name).

    ``suffix`` picks a histogram's ``_bucket``/``_sum``/``_count`` series.
    """
    name = metric.prometheus_name if isinstance(metric, MetricSpec) else metric
    return f"{name}{suffix}{{{', '.join(m for m in matchers if m)}}}"


def quantile_target(metric: MetricSpec | str, quantile: float, matchers: tuple[str, ...],
                    by: str = "") -> Target:
    """``histogram_quantile`` of a histogram's rate, per ``by`` (a label; all together when
    empty), with the legend ``{{by}} pNN``."""
    buckets = selector(metric, *matchers, suffix="_bucket")
    percent = f"p{round(quantile * 100)}"
    return Target(f"histogram_quantile({quantile}, sum by ({f'{by}, le' if by else 'le'}) "
                  f"(rate({buckets}[$__rate_interval])))",
                  f"{{{{{by}}}}} {percent}" if by else percent)


CLUSTER = Variable(
    "cluster", "Cluster", f"label_values(ray_node_cpu_count, {CLUSTER_LABEL})",
    "Ray cluster: the ray_io_cluster label (`raydeck monitoring config --cluster-name`, or "
    "KubeRay's PodMonitor)")
NODE = Variable(
    "node", "Node", f'label_values(ray_node_cpu_count{{{CLUSTER_LABEL}=~"$cluster"}}, instance)',
    "Ray node (its metrics address)")
JOB = Variable(
    "job", "Ray job", f'label_values(ray_raydeck_train_step{{{CLUSTER_LABEL}=~"$cluster"}}, '
    "job_id)", "Ray job id of the training job")
RUN = Variable(
    "run", "Run", f'label_values(ray_raydeck_train_step{{{CLUSTER_LABEL}=~"$cluster", '
    'job_id=~"$job"}, run)', "Training run (MLflow run name)")
SWEEP = Variable(
    "sweep", "Sweep", f'label_values(ray_raydeck_sweep_trials{{{CLUSTER_LABEL}=~"$cluster"}}, '
    "sweep)", "Sweep name")


# --- loading the definitions ---------------------------------------------------------------
def load_dashboards(source_dir: Path) -> list[Dashboard]:
    """Every ``DASHBOARD`` defined by ``source_dir/*.py`` (files starting with ``_`` skipped).

    Raises:
        ConfigError: ``source_dir`` holds no definitions, or two share a uid.
    """
    paths = sorted(p for p in Path(source_dir).glob("*.py") if not p.name.startswith("_"))
    dashboards = [_load_attribute(path, "DASHBOARD", Dashboard) for path in paths]
    if not dashboards:
        raise ConfigError(f"no dashboard definitions (*.py defining DASHBOARD) in {source_dir}; "
                          "run from the repository root or pass --dir")
    uids = [d.uid for d in dashboards]
    duplicates = sorted({u for u in uids if uids.count(u) > 1})
    if duplicates:
        raise ConfigError(f"{source_dir}: dashboard uid(s) {duplicates} defined twice")
    return dashboards


def load_rule_groups(source_dir: Path) -> tuple[RuleGroup, ...]:
    """``RULE_GROUPS`` of ``source_dir/alerts/rules.py``.

    Raises:
        ConfigError: the file is missing or does not define ``RULE_GROUPS``.
    """
    path = Path(source_dir) / ALERTS_DIR / RULES_DEFINITION
    if not path.is_file():
        raise ConfigError(f"{path}: no alert rule definitions; run from the repository root or "
                          "pass --dir")
    return tuple(_load_attribute(path, "RULE_GROUPS", tuple))


def load_module(path: Path) -> Any:
    """Import the definition file at ``path`` (not a package: it lives next to its output)."""
    name = f"raydeck_definitions_{path.parent.name}_{path.stem}"
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None or spec.loader is None:
        raise ConfigError(f"{path}: cannot be imported as Python")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _load_attribute(path: Path, attribute: str, kind: type) -> Any:
    value = getattr(load_module(path), attribute, None)
    if not isinstance(value, kind):
        raise ConfigError(f"{path}: must define {attribute} as a {kind.__name__}")
    return value


# --- rendering -----------------------------------------------------------------------------
def rendered_files(source_dir: Path) -> dict[Path, str]:
    """Everything ``render`` writes under ``source_dir``, by path: dashboards, rules, provisioning.
    """
    source_dir = Path(source_dir)
    files = {source_dir / RENDERED_DIR / f"{d.uid}.json": d.to_json()
             for d in load_dashboards(source_dir)}
    files[source_dir / ALERTS_DIR / RULES_FILE_NAME] = render_rules(load_rule_groups(source_dir))
    files.update({source_dir / rel: text for rel, text in provisioning_files().items()})
    return files


def render(source_dir: Path, *, write: bool = True) -> list[Path]:
    """Render the definitions in ``source_dir``; return the files that were stale.

    With ``write=False`` nothing is written (CI uses that to fail on stale JSON). Rendered
    files whose dashboard no longer exists are reported stale and removed when writing.
    """
    files = rendered_files(source_dir)
    stale = [path for path, text in files.items()
             if not path.is_file() or path.read_text() != text]
    orphans = [p for p in sorted((Path(source_dir) / RENDERED_DIR).glob("*.json"))
               if p not in files]
    if write:
        for path in stale:
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(files[path])
        for path in orphans:
            path.unlink()
    return sorted(stale + orphans)
