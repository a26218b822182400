"""Observability end to end: what a tracked job exports is what Prometheus, the dashboards and the
alerts see.

The session's Ray is scraped by a real Prometheus configured like `raydeck monitoring config`
(Ray's own service-discovery file, loopback, raydeck's rules). One module fixture produces the
data once: a tracked digits training job (2 ranks, 3 epochs) whose workers then stop
progressing while staying alive until TrainingStalled fires, and a probe actor that reports a
sweep through SweepMetrics and does real object-storage calls (some failing) through
storage_operation, as the sweep driver and storage code do.
"""

from __future__ import annotations

import contextlib
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import ray

from raydeck.observability.dashboard_check import NO_DATA_YET, check, metric_names
from raydeck.observability.dashboards import load_dashboards, load_rule_groups
from raydeck.observability.grafana import RAY_FOLDER_UID, provisioning_files, ray_dashboards
from raydeck.observability.held_gauge import export_interval_s
from raydeck.observability.metrics import METRICS
from tests.fixtures.processes import wait_until
from tests.fixtures.prometheus import DASHBOARDS_DIR, SHORT_RULES_GROUP, PrometheusServer

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

RUN_NAME = "obs-digits"
SWEEP = "obs-sweep"
EPOCHS = 3
STALL_LIMIT_S = 240.0
ALERT_TIMEOUT_S = 200.0
TRAIN_JOIN_TIMEOUT_S = 180.0
LAST_STEP_TIMEOUT_S = 60.0
STORAGE_OP_INTERVAL_S = 0.5
CHECK_STEP_S = 2.0
CHECK_RATE_INTERVAL_S = 10.0
PLAIN_GAUGE = "raydeck_test_plain_gauge"
PLAIN_AGES_OUT_SLACK_S = 60.0  # a busy 2-core machine delays exports and scrapes
RAY_DASHBOARDS_SUBDIR = Path("metrics/grafana/dashboards")
# Exported only by a Serve replica or the queue actor, which this module does not run: checked
# live by tests/serving/test_serving.py and tests/scheduling/test_queue.py.
LIVE_ELSEWHERE = ("raydeck-serving", "raydeck-queue")
LIVE_ELSEWHERE_METRICS = ("raydeck_serving_", "raydeck_queue_")


def train_then_stall(config: dict[str, Any]) -> None:
    """The digits reference loop, then no progress while the worker lives until the gate opens."""
    from raydeck.examples.digits import train_loop_per_worker

    train_loop_per_worker(config)
    gate = Path(config["gate"])
    deadline = time.monotonic() + config["stall_limit_s"]
    while not gate.exists() and time.monotonic() < deadline:
        time.sleep(0.2)


@ray.remote(num_cpus=0)
class MetricsProbe:
    """Reports a sweep and does object-storage calls through raydeck's APIs, from a Ray actor."""

    def __init__(self, endpoint: str, access_key: str, secret_key: str) -> None:
        self._s3 = (endpoint, access_key, secret_key)
        self._stop = threading.Event()

    def start(self) -> float:
        """Set every sweep gauge once, a plain Ray gauge once, start storage calls; returns when."""
        from ray.util.metrics import Gauge

        from raydeck.observability.metrics import SweepMetrics

        sweep = SweepMetrics(SWEEP, "val_accuracy", "max")
        sweep.trial_states({"pending": 1, "running": 2, "stopped_early": 3, "completed": 4,
                            "errored": 1})
        sweep.best_score(0.97)
        Gauge(PLAIN_GAUGE, "a plain Ray gauge, set once").set(1.0)
        threading.Thread(target=self._storage_calls, daemon=True).start()
        return time.time()

    def _storage_calls(self) -> None:
        import io
        from urllib.parse import urlparse

        from minio import Minio
        from minio.error import S3Error

        from raydeck.observability.metrics import storage_operation

        endpoint, access_key, secret_key = self._s3
        client = Minio(urlparse(endpoint).netloc, access_key=access_key, secret_key=secret_key,
                       secure=False)
        with storage_operation("make_bucket"):
            client.make_bucket("obs-probe")
        round_ = 0
        while not self._stop.wait(STORAGE_OP_INTERVAL_S):
            with storage_operation("put"):
                client.put_object("obs-probe", f"obj-{round_}", io.BytesIO(b"x" * 1024), 1024)
            with storage_operation("get"):
                client.get_object("obs-probe", f"obj-{round_}").read()
            if round_ % 3 == 2:
                try:
                    with storage_operation("get"):
                        client.get_object("obs-probe", "missing").read()
                except S3Error:
                    pass
            round_ += 1

    def stop(self) -> None:
        self._stop.set()


def _last_steps(prometheus: PrometheusServer) -> dict[str, float]:
    """The training step Prometheus holds now for each rank of the module's run."""
    answer = prometheus.client.query(
        f'max by (rank) (ray_raydeck_train_step{{run="{RUN_NAME}"}})')
    return {s["metric"]["rank"]: float(s["value"][1]) for s in answer}


@dataclass
class Observed:
    """What the module fixture saw happen."""

    started_s: float
    probe_started_s: float
    run_id: str
    stalled_alert: dict[str, str] | None
    ranks_while_stalled: int
    ray_session: Path

    def range_s(self) -> float:
        return time.time() - self.started_s + 5


@pytest.fixture(scope="module")
def observed(prometheus: PrometheusServer, ray_cluster: None, raydeck_env: dict[str, str],
             s3_server: Any, tmp_path_factory: pytest.TempPathFactory) -> Any:
    from raydeck.config.settings import load_settings
    from raydeck.tracking import get_tracker
    from raydeck.train.presets import get_preset
    from raydeck.train.trainer import fit

    started_s = time.time()
    probe = MetricsProbe.remote(s3_server.endpoint, s3_server.access_key_id,
                                s3_server.secret_access_key)
    probe_started_s = ray.get(probe.start.remote(), timeout=60)
    settings = load_settings()
    gate = tmp_path_factory.mktemp("stall") / "release"
    outcome: dict[str, Any] = {}
    with get_tracker(run_name=RUN_NAME, settings=settings) as tracker:
        def train() -> None:
            try:
                fit(train_then_stall, tracker=tracker, settings=settings,
                    train_loop_config={"epochs": EPOCHS, "gate": str(gate),
                                       "stall_limit_s": STALL_LIMIT_S},
                    scaling_config=get_preset("cpu-2").scaling_config(), max_failures=0)
            except BaseException as exc:
                outcome["error"] = exc

        thread = threading.Thread(target=train, name="observed-training", daemon=True)
        thread.start()
        stalled_alert, ranks = None, 0
        deadline = time.monotonic() + ALERT_TIMEOUT_S
        while time.monotonic() < deadline and thread.is_alive():
            firing = prometheus.client.query(
                f'ALERTS{{alertname="TrainingStalled", alertstate="firing", run="{RUN_NAME}"}}')
            if firing:
                stalled_alert = firing[0]["metric"]
                ranks_now = prometheus.client.query(
                    f'count(ray_raydeck_train_step_timestamp_s{{run="{RUN_NAME}"}})')
                ranks = int(float(ranks_now[0]["value"][1])) if ranks_now else 0
                break
            time.sleep(0.5)
        # The alert can fire on a rank whose last step its process has not exported yet (Ray
        # exports every 10 s; the rule's floor is 8 s): the ranks stay stalled, alive, until
        # Prometheus has both at their last step, as a real stalled job's would.
        with contextlib.suppress(TimeoutError):
            wait_until(lambda: _last_steps(prometheus) == {"0": EPOCHS - 1, "1": EPOCHS - 1},
                       LAST_STEP_TIMEOUT_S, "both ranks' last step in Prometheus",
                       interval_s=0.5)
        gate.touch()
        thread.join(TRAIN_JOIN_TIMEOUT_S)
        run_id = tracker.run_id
    ray.get(probe.stop.remote(), timeout=30)
    if "error" in outcome:
        raise outcome["error"]
    yield Observed(started_s, probe_started_s, run_id, stalled_alert, ranks,
                   Path(ray._private.worker._global_node.get_session_dir_path()))
    ray.kill(probe)


def test_prometheus_scrapes_the_ray_node_listed_in_rays_discovery_file(
        observed: Observed, prometheus: PrometheusServer) -> None:
    node = next(n for n in ray.nodes() if n["Alive"])
    address = f"{node['NodeManagerAddress']}:{node['MetricsExportPort']}"
    targets = {t["labels"]["instance"]: t for t in prometheus.client.targets()}
    assert address in targets, f"{address} not among {sorted(targets)}"
    target = targets[address]
    assert target["health"] == "up", target.get("lastError")
    assert target["scrapeUrl"].startswith(f"http://127.0.0.1:{node['MetricsExportPort']}/")


def test_training_stalled_fires_live_when_a_running_job_stops_progressing(
        observed: Observed) -> None:
    assert observed.stalled_alert is not None, "TrainingStalled never fired for the stalled run"
    assert observed.stalled_alert["run"] == RUN_NAME
    assert observed.stalled_alert["run_id"] == observed.run_id
    assert observed.stalled_alert["severity"] == "critical"
    assert observed.ranks_while_stalled == 2, "both ranks should export while stalled"


def test_every_declared_metric_reaches_prometheus_with_its_labels(
        observed: Observed, prometheus: PrometheusServer) -> None:
    # Serving's and the queue's metrics come from processes this module does not run.
    here = [spec for spec in METRICS if not spec.name.startswith(LIVE_ELSEWHERE_METRICS)]
    assert not prometheus.unexported(here, observed.range_s())


def test_training_metrics_carry_the_run_and_both_ranks(
        observed: Observed, prometheus: PrometheusServer) -> None:
    window = f"{int(observed.range_s())}s"
    steps = prometheus.client.query(
        f'max by (run, run_id, rank) (max_over_time(ray_raydeck_train_step{{run="{RUN_NAME}"}}'
        f"[{window}]))")
    assert {s["metric"]["rank"] for s in steps} == {"0", "1"}
    assert {s["metric"]["run_id"] for s in steps} == {observed.run_id}
    assert {float(s["value"][1]) for s in steps} == {EPOCHS - 1}
    losses = prometheus.client.query(
        f'last_over_time(ray_raydeck_train_loss{{run="{RUN_NAME}", rank="0"}}[{window}])')
    assert {s["metric"]["name"] for s in losses} == {"train_loss", "val_loss"}


def test_a_gauge_set_once_stays_exported_while_a_plain_ray_gauge_ages_out(
        observed: Observed, prometheus: PrometheusServer) -> None:
    # Both were set once, at the same moment, by the probe actor that is still alive. The agent
    # drops the plain one after two export intervals and Prometheus marks it stale at its next
    # scrape; on a loaded machine both can run late, so wait for it to go, generously.
    window = f"{int(observed.range_s())}s"
    assert prometheus.client.query(f"last_over_time(ray_{PLAIN_GAUGE}[{window}])"), \
        "the plain gauge was exported once"
    ages_out_by_s = observed.probe_started_s + 3 * export_interval_s() + PLAIN_AGES_OUT_SLACK_S
    # One query, so both answers come from the same scrape: the held gauge, while the plain one
    # is gone. A scrape that fails (it times out after the 1 s interval on a loaded machine)
    # makes every series of the node stale at once, which is not an age-out: it answers nothing
    # here, and a later scrape decides. A hold that did not work would leave the two gauges
    # going together, and this would wait in vain.
    held: list[Any] = []

    def held_while_plain_gone() -> bool:
        held[:] = prometheus.client.query(
            f'ray_raydeck_sweep_best_score{{sweep="{SWEEP}"}} unless on() ray_{PLAIN_GAUGE}')
        return bool(held)

    wait_until(held_while_plain_gone, timeout_s=max(1.0, ages_out_by_s - time.time()),
               what="the plain Ray gauge, set once, to age out of Prometheus while the held "
                    "one stays")
    assert float(held[0]["value"][1]) == 0.97, held


def test_every_raydeck_panel_returns_series_with_the_expected_labels(
        observed: Observed, prometheus: PrometheusServer) -> None:
    results = check(_observed_dashboards(), prometheus.client,
                    range_s=observed.range_s(), step_s=CHECK_STEP_S,
                    rate_interval_s=CHECK_RATE_INTERVAL_S)
    errors = [f"{r.panel} {r.ref}: {r.error}" for r in results if r.error]
    assert not errors, errors
    raydeck = [r for r in results if "ray_raydeck_" in r.expr]
    empty = [f"{r.dashboard} / {r.panel} {r.ref}" for r in raydeck if not r.series]
    assert not empty, f"raydeck panels without data: {empty}"
    for r in raydeck:
        wanted = _grouping_labels(r.expr)
        for series in r.series:
            assert wanted <= {k for k, v in series.items() if v}, (r.panel, series)
        if "run" in wanted:
            assert RUN_NAME in {s["run"] for s in r.series}, r.panel
        if "sweep" in wanted:
            assert {s["sweep"] for s in r.series} == {SWEEP}, r.panel
    ray_panels = [r for r in results if "ray_raydeck_" not in r.expr]
    assert not [r.panel for r in ray_panels if r.status == NO_DATA_YET], "Ray panels without data"


def test_every_alert_rule_evaluates_in_prometheus(
        observed: Observed, prometheus: PrometheusServer) -> None:
    loaded = {rule["name"]: rule for group in prometheus.client.rules()
              for rule in group["rules"] if group["name"] != SHORT_RULES_GROUP}
    defined = [rule for group in load_rule_groups(DASHBOARDS_DIR) for rule in group.rules]
    assert {rule.name for rule in defined} == set(loaded)
    for rule in defined:
        assert loaded[rule.name]["health"] == "ok", (rule.name, loaded[rule.name]["lastError"])
        prometheus.client.query(rule.expr)  # raises QueryError on bad PromQL


def test_dashboards_check_cli_shows_every_panel(
        observed: Observed, prometheus: PrometheusServer) -> None:
    from typer.testing import CliRunner

    from raydeck.cli.main import app

    only = [arg for d in _observed_dashboards() for arg in ("--dashboard", d.uid)]
    answer = CliRunner().invoke(app, [
        "dashboards", "check", "--prometheus-url", prometheus.url,
        "--range", f"{int(observed.range_s())}s", "--dir", str(DASHBOARDS_DIR), *only])
    assert answer.exit_code == 0, answer.output
    assert "expected empty" in answer.output  # the GPU panels on this CPU-only machine
    assert " 0 no data yet, 0 error" in answer.output.replace("\n", " ")


def test_dashboards_check_passes_while_the_queue_and_serving_have_not_run(
        observed: Observed, prometheus: PrometheusServer) -> None:
    """Every dashboard, the two whose processes this module does not run included: exit 0, and
    each empty panel names the metrics it waits for (and, when nothing exported them, what has
    not run). Serve may have run earlier in the session: its panels may then have data."""
    from typer.testing import CliRunner

    from raydeck.cli.main import app

    elsewhere = {d.title: d.uid for d in load_dashboards(DASHBOARDS_DIR)
                 if d.uid in LIVE_ELSEWHERE}
    results = check(load_dashboards(DASHBOARDS_DIR), prometheus.client,
                    range_s=observed.range_s(), step_s=CHECK_STEP_S,
                    rate_interval_s=CHECK_RATE_INTERVAL_S)
    assert not [f"{r.panel} {r.ref}: {r.error}" for r in results if r.failed]
    # Which panels wait depends on what ran before in the session's Ray; none of this module's.
    for r in (r for r in results if r.status == NO_DATA_YET):
        assert r.dashboard in elsewhere, (r.panel, r.why_empty)
        assert any(name in r.why_empty for name in metric_names(r.expr)), r.why_empty
        if "nothing has exported" in r.why_empty:
            not_run = {"raydeck-queue": ("the job queue has not run",),
                       "raydeck-serving": ("no Ray Serve application has served a request",
                                           "no `raydeck serve` replica has run")}
            assert any(why in r.why_empty for why in not_run[elsewhere[r.dashboard]]), \
                r.why_empty
    answer = CliRunner().invoke(app, [
        "dashboards", "check", "--prometheus-url", prometheus.url,
        "--range", f"{int(observed.range_s())}s", "--dir", str(DASHBOARDS_DIR)])
    assert answer.exit_code == 0, answer.output
    assert " no data yet, 0 error" in answer.output.replace("\n", " ")


def test_rays_own_dashboards_are_written_by_ray_and_generated_at_deploy_time(
        observed: Observed) -> None:
    written = {p.stem for p in (observed.ray_session / RAY_DASHBOARDS_SUBDIR).glob("*.json")}
    generated = ray_dashboards()
    assert len(generated) == len(written) >= 8
    provider = next(p for p in _providers() if p["folderUid"] == RAY_FOLDER_UID)
    assert provider["options"]["path"].endswith(f"session_latest/{RAY_DASHBOARDS_SUBDIR}")


def _observed_dashboards() -> list[Any]:
    """Every dashboard whose metrics this module's processes export."""
    return [d for d in load_dashboards(DASHBOARDS_DIR) if d.uid not in LIVE_ELSEWHERE]


def _providers() -> list[dict[str, Any]]:
    import yaml

    text = provisioning_files()["provisioning/dashboards/raydeck.yml"]
    return list(yaml.safe_load(text)["providers"])


def _grouping_labels(expr: str) -> set[str]:
    """Labels the outermost ``by (...)`` of ``expr`` keeps (``le`` is consumed by quantiles)."""
    import re

    match = re.search(r"\bby \(([^)]*)\)", expr)
    if not match:
        return set()
    return {label.strip() for label in match.group(1).split(",")} - {"le"}
