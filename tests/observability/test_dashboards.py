"""Dashboards and alert rules as code: committed files equal a fresh render, the JSON has the
structure Grafana requires, and the Prometheus files pass promtool (no Grafana server exists
here; the end-to-end queries run in test_observability_e2e.py against a real Prometheus).
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import textwrap
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from raydeck.observability.alerts import RULES_FILE_NAME
from raydeck.observability.dashboard_check import (
    EXPECTED_EMPTY,
    NO_RAY_METRICS,
    check,
    explain_empty,
    metric_names,
)
from raydeck.observability.dashboards import (
    ALERTS_DIR,
    BUILTIN_VARIABLES,
    GRID_WIDTH,
    RENDERED_DIR,
    load_dashboards,
    load_rule_groups,
    render,
    rendered_files,
    variables_used,
)
from raydeck.observability.grafana import DATASOURCE_UID, provisioning_files
from raydeck.observability.metrics import METRICS, metrics_markdown
from raydeck.observability.prometheus import PrometheusConfig
from tests.cli.test_cli import _one_error_line, _raydeck
from tests.fixtures.prometheus import DASHBOARDS_DIR, PrometheusServer, scraping_itself

pytestmark = pytest.mark.timeout(120)

RULES = DASHBOARDS_DIR / ALERTS_DIR / RULES_FILE_NAME
PROMTOOL_TESTS = sorted((DASHBOARDS_DIR / ALERTS_DIR / "tests").glob("*.test.yml"))
REQUIRED_DASHBOARD_KEYS = {"uid", "title", "panels", "schemaVersion", "templating", "time",
                           "version", "editable", "tags"}
REQUIRED_PANEL_KEYS = {"id", "type", "title", "gridPos", "datasource", "targets", "fieldConfig"}


def _committed_dashboards() -> list[dict[str, Any]]:
    paths = sorted((DASHBOARDS_DIR / RENDERED_DIR).glob("*.json"))
    return [json.loads(p.read_text()) for p in paths]


def _promtool(*args: str) -> subprocess.CompletedProcess[str]:
    promtool = shutil.which("promtool")
    assert promtool, "promtool is not installed (apt-get install prometheus)"
    return subprocess.run([promtool, *args], capture_output=True, text=True, timeout=60,
                          check=False)


def test_committed_files_equal_a_fresh_render() -> None:
    stale = render(DASHBOARDS_DIR, write=False)
    assert not stale, f"run `raydeck dashboards render` and commit: {stale}"


def test_render_is_deterministic(tmp_path: Path) -> None:
    copy = tmp_path / "dashboards"
    shutil.copytree(DASHBOARDS_DIR, copy)
    for path in copy.joinpath(RENDERED_DIR).glob("*.json"):
        path.unlink()
    first = {p.relative_to(copy): t for p, t in rendered_files(copy).items()}
    assert render(copy) and not render(copy)
    assert first == {p.relative_to(copy): t for p, t in rendered_files(copy).items()}


def test_the_six_dashboards_exist_with_unique_uids_and_panel_ids() -> None:
    dashboards = _committed_dashboards()
    assert {d["uid"] for d in dashboards} == {
        "raydeck-cluster-health", "raydeck-training", "raydeck-tracking-proxy", "raydeck-sweeps",
        "raydeck-serving", "raydeck-queue"}
    for dashboard in dashboards:
        assert set(dashboard) >= REQUIRED_DASHBOARD_KEYS, dashboard["uid"]
        ids = [p["id"] for p in dashboard["panels"]]
        assert len(ids) == len(set(ids)), f"{dashboard['uid']}: duplicate panel ids"


def test_every_panel_has_grafanas_required_fields_and_fits_the_grid() -> None:
    for dashboard in _committed_dashboards():
        for panel in dashboard["panels"]:
            grid = panel["gridPos"]
            assert grid["x"] >= 0 and grid["w"] >= 1 and grid["x"] + grid["w"] <= GRID_WIDTH
            if panel["type"] == "row":
                assert panel["panels"] == [] and not panel["collapsed"]
                continue
            assert set(panel) >= REQUIRED_PANEL_KEYS, (dashboard["uid"], panel["title"])
            refs = [t["refId"] for t in panel["targets"]]
            assert refs and len(refs) == len(set(refs))
            assert all(t["expr"].strip() for t in panel["targets"])


def test_every_datasource_reference_resolves_to_the_provisioned_prometheus() -> None:
    provisioned = yaml.safe_load(provisioning_files()["provisioning/datasources/raydeck.yml"])
    assert [d["uid"] for d in provisioned["datasources"]] == [DATASOURCE_UID]
    for dashboard in _committed_dashboards():
        variables = {v["name"]: v for v in dashboard["templating"]["list"]}
        assert variables["datasource"]["type"] == "datasource"
        assert variables["datasource"]["query"] == "prometheus"
        assert variables["datasource"]["current"]["value"] == DATASOURCE_UID
        refs = [p["datasource"] for p in dashboard["panels"] if p["type"] != "row"]
        refs += [t["datasource"] for p in dashboard["panels"] for t in p.get("targets", [])]
        refs += [v["datasource"] for v in variables.values() if v["type"] == "query"]
        assert all(r == {"type": "prometheus", "uid": "${datasource}"} for r in refs)


def test_every_variable_a_query_uses_is_defined() -> None:
    for dashboard in _committed_dashboards():
        defined = {v["name"] for v in dashboard["templating"]["list"]} | set(BUILTIN_VARIABLES)
        queries = [t["expr"] for p in dashboard["panels"] for t in p.get("targets", [])]
        queries += [v["query"]["query"] for v in dashboard["templating"]["list"]
                    if v["type"] == "query"]
        for query in queries:
            assert variables_used(query) <= defined, (dashboard["uid"], query)


def test_every_raydeck_metric_is_on_a_dashboard_and_in_the_metrics_table() -> None:
    exprs = " ".join(t.expr for d in load_dashboards(DASHBOARDS_DIR) for p in d.panels()
                     for t in p.targets)
    table = metrics_markdown()
    for spec in METRICS:
        on_panel = any(re.search(rf"\b{name}\b", exprs) for name in spec.series_names)
        assert on_panel, f"{spec.name}: on no panel"
        assert f"`{spec.prometheus_name}`" in table


def test_alert_rules_pass_promtool_check_rules() -> None:
    checked = _promtool("check", "rules", str(RULES))
    assert checked.returncode == 0, checked.stdout + checked.stderr
    assert f"SUCCESS: {sum(len(g.rules) for g in load_rule_groups(DASHBOARDS_DIR))} rules" \
        in checked.stdout


def test_every_alert_has_a_runbook_and_a_unit_test_that_fires_and_stays_quiet() -> None:
    rules = [rule for group in load_rule_groups(DASHBOARDS_DIR) for rule in group.rules]
    fired: set[str] = set()
    quiet: set[str] = set()
    for path in PROMTOOL_TESTS:
        for case in yaml.safe_load(path.read_text())["tests"]:
            for expectation in case["alert_rule_test"]:
                (fired if expectation.get("exp_alerts") else quiet).add(expectation["alertname"])
    for rule in rules:
        assert len(rule.runbook.split()) >= 8, f"{rule.name}: the runbook must say what to do"
        assert rule.name in fired, f"{rule.name}: no promtool test makes it fire"
        assert rule.name in quiet, f"{rule.name}: no promtool test keeps it quiet"


def test_alert_unit_tests_pass_promtool_test_rules() -> None:
    assert PROMTOOL_TESTS
    tested = _promtool("test", "rules", *map(str, PROMTOOL_TESTS))
    assert tested.returncode == 0, tested.stdout + tested.stderr


def test_monitoring_config_cli_writes_a_config_promtool_accepts(tmp_path: Path) -> None:
    from typer.testing import CliRunner

    from raydeck.cli.main import app

    discovery = tmp_path / "prom_metrics_service_discovery.json"
    discovery.write_text(json.dumps([{"labels": {"job": "ray"},
                                      "targets": ["10.0.0.5:45123", "10.0.0.6:45123"]}]))
    output = tmp_path / "prometheus.yml"
    answer = CliRunner().invoke(app, [
        "monitoring", "config", "-o", str(output), "--discovery-file", str(discovery),
        "--rules", str(RULES), "--cluster-name", "prod", "--cluster"])
    assert answer.exit_code == 0, answer.output
    checked = _promtool("check", "config", str(output))
    assert checked.returncode == 0, checked.stdout + checked.stderr
    config = yaml.safe_load(output.read_text())
    assert config["rule_files"] == [str(RULES.resolve())]
    relabel = config["scrape_configs"][0]["relabel_configs"]
    assert {"target_label": "ray_io_cluster", "replacement": "prod"} in relabel
    assert not any(r.get("target_label") == "__address__" for r in relabel), "--cluster keeps IPs"


def test_local_mode_scrapes_loopback_but_keeps_the_node_address_as_instance() -> None:
    config = yaml.safe_load(PrometheusConfig(discovery_file=Path("sd.json")).render())
    relabel = config["scrape_configs"][0]["relabel_configs"]
    assert relabel[0] == {"source_labels": ["__address__"], "target_label": "instance"}
    assert relabel[1]["target_label"] == "__address__"
    assert relabel[1]["replacement"] == "127.0.0.1:$1"


def test_monitoring_config_rejects_missing_rules_with_one_line(tmp_path: Path) -> None:
    line = _one_error_line(_raydeck("monitoring", "config", "-o", str(tmp_path / "p.yml"),
                                    "--rules", str(tmp_path / "nope.yml"), cwd=tmp_path))
    assert "nope.yml" in line
    assert not (tmp_path / "p.yml").exists()


def test_render_check_cli_fails_on_a_stale_file(tmp_path: Path) -> None:
    from typer.testing import CliRunner

    from raydeck.cli.main import app

    copy = tmp_path / "dashboards"
    shutil.copytree(DASHBOARDS_DIR, copy)
    stale = copy / RENDERED_DIR / "raydeck-training.json"
    stale.write_text(stale.read_text().replace("Last step", "Latest step"))
    answer = CliRunner().invoke(app, ["dashboards", "render", "--check", "--dir", str(copy)])
    assert answer.exit_code == 1
    assert "raydeck-training.json" in answer.output
    assert CliRunner().invoke(app, ["dashboards", "render", "--dir", str(copy)]).exit_code == 0
    assert not render(copy, write=False)


# --- `raydeck dashboards check` against a real Prometheus that scrapes only itself ------------
# Two dashboards written the way dashboards/*.py are: one whose queries are all valid (one has
# data, the others cannot yet), one whose queries Prometheus rejects, each a different way.
CHECK_DEFINITIONS = {
    "waiting.py": """
        from raydeck.observability.dashboards import Dashboard, Panel, Row, Target
        DASHBOARD = Dashboard(uid="check-waiting", title="Check / Waiting", description="",
                              rows=(Row("r", (
            Panel("Prometheus itself", (Target("max by (job) (prometheus_build_info)"),)),
            Panel("Queued jobs", (Target(
                'sum by (team) (ray_raydeck_queue_jobs{state="queued"})'),)),
            Panel("No such job", (Target('sum(rate(up{job="nobody-scrapes-this"}[1m]))'),)),
            Panel("GPUs", (Target("avg(ray_node_gpus_utilization)"),), empty_ok="no GPU"),
        )),))
    """,
    "broken.py": """
        from raydeck.observability.dashboards import Dashboard, Panel, Row, Target
        DASHBOARD = Dashboard(uid="check-broken", title="Check / Broken", description="",
                              rows=(Row("r", (
            Panel("Unclosed", (Target("sum(rate(up[1m])"),)),
            Panel("Unknown function", (Target("no_such_function(up)"),)),
            Panel("Bad matcher", (Target('up{job=~"("}'),)),
            Panel("Many to many", (Target("prometheus_http_requests_total + on() up"),)),
            Panel("Fine", (Target("sum(up)"),)),
        )),))
    """,
}
BROKEN = {
    "Unclosed": "parse error: unclosed left parenthesis",
    "Unknown function": 'unknown function with name "no_such_function"',
    "Bad matcher": "error parsing regexp",
    "Many to many": "many-to-one matching must be explicit",
}
WIDE_CONSOLE = {"COLUMNS": "400"}  # rich wraps table cells to the terminal's width


@pytest.fixture(scope="module")
def bare_prometheus(tmp_path_factory: pytest.TempPathFactory) -> Iterator[PrometheusServer]:
    """A real Prometheus with no Ray, once it holds its own metrics, two request handlers'
    counters among them (the "Many to many" panel needs two)."""
    server = scraping_itself(tmp_path_factory.mktemp("bare-prometheus"))
    try:
        server.wait_for("count(prometheus_http_requests_total) > 1", timeout_s=60)
        yield server
    finally:
        server.stop()


@pytest.fixture(scope="module")
def check_definitions(tmp_path_factory: pytest.TempPathFactory) -> Path:
    directory = tmp_path_factory.mktemp("check-dashboards")
    for name, text in CHECK_DEFINITIONS.items():
        (directory / name).write_text(textwrap.dedent(text))
    return directory


def test_check_tells_broken_queries_from_valid_ones_without_data(
        bare_prometheus: PrometheusServer, check_definitions: Path) -> None:
    results = {r.panel: r for r in check(load_dashboards(check_definitions),
                                         bare_prometheus.client, range_s=300)}
    assert {p: r.status for p, r in results.items()} == {
        "Prometheus itself": "data", "Queued jobs": "no data yet", "No such job": "no data yet",
        "GPUs": EXPECTED_EMPTY, **dict.fromkeys(BROKEN, "error"), "Fine": "data"}
    assert {p for p, r in results.items() if r.failed} == set(BROKEN)
    for panel, error in BROKEN.items():
        assert error in results[panel].error, results[panel].error
    # Nothing exports the queue's metric here, nor any Ray metric at all: both are said.
    assert results["Queued jobs"].why_empty == (
        f"no series: nothing has exported ray_raydeck_queue_jobs yet \N{EM DASH} {NO_RAY_METRICS}")
    # `up` is there (Prometheus scrapes itself), just not for that job.
    assert results["No such job"].why_empty.startswith("no series: Prometheus has up, but none")
    assert "too few samples for rate()" in results["No such job"].why_empty


def test_check_cli_exits_1_naming_each_panel_prometheus_rejects_and_its_error(
        bare_prometheus: PrometheusServer, check_definitions: Path, tmp_path: Path) -> None:
    answer = _raydeck("dashboards", "check", "--prometheus-url", bare_prometheus.url,
                      "--dir", str(check_definitions), "--range", "5m", cwd=tmp_path,
                      env=WIDE_CONSOLE)
    assert answer.returncode == 1, answer.stdout + answer.stderr
    lines = answer.stdout.splitlines()
    for panel, error in BROKEN.items():
        said = [line for line in lines if line.startswith(f"broken: Check / Broken / {panel} A: ")]
        assert len(said) == 1 and error in said[0], answer.stdout
    assert "2 data, 1 expected empty, 2 no data yet, 4 error" in answer.stdout
    assert "4 panel queries rejected by Prometheus" in answer.stdout
    assert "Traceback" not in answer.stderr


def test_check_cli_exits_0_when_every_query_is_valid_and_says_why_a_panel_is_empty(
        bare_prometheus: PrometheusServer, check_definitions: Path, tmp_path: Path) -> None:
    answer = _raydeck("dashboards", "check", "--prometheus-url", bare_prometheus.url,
                      "--dir", str(check_definitions), "--dashboard", "check-waiting",
                      cwd=tmp_path, env=WIDE_CONSOLE)
    assert answer.returncode == 0, answer.stdout + answer.stderr
    row = next(line for line in answer.stdout.splitlines() if "Queued jobs" in line)
    assert "no data yet" in row
    assert "nothing has exported ray_raydeck_queue_jobs yet" in row
    assert "1 data, 1 expected empty, 2 no data yet, 0 error" in answer.stdout
    assert "every query is valid; 2 return no data yet" in answer.stdout


def test_an_empty_panel_names_what_has_not_run_when_prometheus_scrapes_ray() -> None:
    scraped = {"ray_node_cpu_count", "ray_raydeck_train_step"}
    queue = explain_empty('sum by (team) (ray_raydeck_queue_jobs{state="queued"})', scraped, 900)
    assert queue == ("no series: nothing has exported ray_raydeck_queue_jobs yet \N{EM DASH} "
                     "the job queue has not run (it starts with the first "
                     "`raydeck submit --queue`)")
    serving = explain_empty("rate(ray_serve_num_http_requests_total[1m]) / "
                            "ray_raydeck_serving_bad_requests_total", scraped, 900)
    assert "ray_serve_num_http_requests_total, ray_raydeck_serving_bad_requests_total" in serving
    assert "no Ray Serve application has served a request" in serving
    assert "no `raydeck serve` replica has run" in serving
    assert explain_empty("max(ray_raydeck_train_step)", scraped, 900) == (
        "no series: Prometheus has ray_raydeck_train_step, but none of their series matches "
        "this query in the last 15m (its label filters)")


def test_metric_names_finds_what_every_committed_panel_reads() -> None:
    assert metric_names('sum by (a) (rate(x_total{b="c{d}", e=~"f|g"}[5m] offset 1h)) * on (a) '
                        'group_left(h) y + 2e3 - {__name__="z"} and sum(w) without (i)'
                        ) == ("z", "x_total", "y", "w")
    known = {name for spec in METRICS for name in spec.series_names}
    for dashboard in load_dashboards(DASHBOARDS_DIR):
        for panel in dashboard.panels():
            for target in panel.targets:
                names = metric_names(target.expr)
                assert names and all(n.startswith("ray_") for n in names), target.expr
                raydeck = set(re.findall(r"ray_raydeck_\w+", target.expr))
                assert raydeck == {n for n in names if n in known}, target.expr
