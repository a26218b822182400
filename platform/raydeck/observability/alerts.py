"""Alert rules as data, rendered to a Prometheus rule file.

Owns: the shape of a raydeck alert (every rule has a severity, a summary, and a runbook line
saying what to do) and its rendering to the YAML Prometheus and ``promtool`` read. The rules
themselves are defined in ``dashboards/alerts/rules.py`` next to the rendered file and their
``promtool test rules`` unit tests; ``raydeck dashboards render`` regenerates the file.
Loading the definitions by path lives in :mod:`raydeck.observability.dashboards`.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Literal, get_args

import yaml

from raydeck.observability.prometheus import prometheus_duration

Severity = Literal["warning", "critical"]
RULES_FILE_NAME = "raydeck.rules.yml"
_ALERT_NAME = re.compile(r"^[A-Z][A-Za-z0-9]+$")


@dataclass(frozen=True)
class AlertRule:
    """One alerting rule.

    Attributes:
        name: CamelCase alert name (``ALERTS{alertname=...}`` in Prometheus).
        expr: PromQL; every series it returns is an alert instance.
        for_s: how long ``expr`` must hold before the alert fires (0: at once).
        severity: ``warning`` or ``critical`` (a label routing can use).
        summary: one line shown in notifications; may use ``{{ $labels.x }}``/``{{ $value }}``.
        runbook: what the person on call should do, in one or two sentences.
    """

    name: str
    expr: str
    for_s: float
    severity: Severity
    summary: str
    runbook: str

    def __post_init__(self) -> None:
        if not _ALERT_NAME.match(self.name):
            raise ValueError(f"alert name {self.name!r}: must be CamelCase letters and digits")
        if self.severity not in get_args(Severity):
            raise ValueError(f"alert {self.name}: severity {self.severity!r} is not one of "
                             f"{', '.join(get_args(Severity))}")
        if self.for_s < 0:
            raise ValueError(f"alert {self.name}: for_s must be >= 0")
        for field_name in ("expr", "summary", "runbook"):
            if not getattr(self, field_name).strip():
                raise ValueError(f"alert {self.name}: {field_name} must not be empty")

    def to_dict(self) -> dict[str, Any]:
        rule: dict[str, Any] = {"alert": self.name, "expr": self.expr.strip()}
        if self.for_s:
            rule["for"] = prometheus_duration(self.for_s)
        rule["labels"] = {"severity": self.severity}
        rule["annotations"] = {"summary": self.summary, "runbook": self.runbook}
        return rule


@dataclass(frozen=True)
class RuleGroup:
    """Rules Prometheus evaluates together, at the global evaluation interval.

    Raises:
        ValueError: two rules share a name (Prometheus allows it; it makes alerts ambiguous).
    """

    name: str
    rules: tuple[AlertRule, ...]

    def __post_init__(self) -> None:
        names = [rule.name for rule in self.rules]
        duplicates = sorted({n for n in names if names.count(n) > 1})
        if duplicates:
            raise ValueError(f"rule group {self.name}: duplicate alert(s) {', '.join(duplicates)}")


class _RulesDumper(yaml.SafeDumper):
    """Writes multi-line PromQL as ``|`` blocks, so the rule file reads like the source."""


def _represent_text(dumper: yaml.SafeDumper, text: str) -> yaml.ScalarNode:
    style = "|" if "\n" in text else None
    return dumper.represent_scalar("tag:yaml.org,2002:str", text, style=style)


_RulesDumper.add_representer(str, _represent_text)


def render_rules(groups: tuple[RuleGroup, ...] | list[RuleGroup]) -> str:
    """The Prometheus rule file for ``groups``: deterministic YAML text."""
    document = {"groups": [{"name": g.name, "rules": [r.to_dict() for r in g.rules]}
                           for g in groups]}
    header = ("# Rendered by `raydeck dashboards render` from dashboards/alerts/rules.py; "
              "edit that file, not this one.\n")
    return header + yaml.dump(document, Dumper=_RulesDumper, sort_keys=False, width=100)
