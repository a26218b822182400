"""raydeck's metric registry and recording APIs refuse bad input early and keep gauges held.

What reaches Prometheus is tested end to end in test_observability_e2e.py; these are the rules
a caller meets before any number leaves the process.
"""

from __future__ import annotations

import pytest

from raydeck.observability.held_gauge import held_series
from raydeck.observability.metrics import (
    METRICS,
    TRIAL_STATES,
    MetricSpec,
    SweepMetrics,
    TrainingMetrics,
)

pytestmark = pytest.mark.timeout(60)


def test_prometheus_names_follow_rays_prefix_and_counter_suffix() -> None:
    names = {spec.name: spec.series_names for spec in METRICS}
    assert names["raydeck_storage_op_errors"] == ("ray_raydeck_storage_op_errors_total",)
    assert names["raydeck_train_step"] == ("ray_raydeck_train_step",)
    assert names["raydeck_tracking_write_latency_s"] == (
        "ray_raydeck_tracking_write_latency_s_bucket", "ray_raydeck_tracking_write_latency_s_sum",
        "ray_raydeck_tracking_write_latency_s_count")
    assert len(names) == len(METRICS), "a metric is declared twice"


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"name": "tracking_points", "kind": "counter"}, "must match"),
    ({"name": "raydeck_x", "kind": "summary"}, "kind 'summary'"),
    ({"name": "raydeck_x", "kind": "gauge", "labels": ("RunName",)}, "snake_case"),
    ({"name": "raydeck_x", "kind": "histogram"}, "need boundaries"),
])
def test_a_bad_metric_declaration_names_the_problem(kwargs: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        MetricSpec(description="d", **kwargs)


def test_sweep_states_outside_the_known_ones_are_refused() -> None:
    sweep = SweepMetrics("s", "val_accuracy", "max")
    with pytest.raises(ValueError, match=r"unknown trial state.*finished; known: pending"):
        sweep.trial_states({"finished": 2})
    with pytest.raises(ValueError, match="mode='maximize'"):
        SweepMetrics("s", "val_accuracy", "maximize")


def test_gauges_stay_held_until_their_owner_lets_go() -> None:
    before = held_series()
    sweep = SweepMetrics("held-test", "loss", "min")
    sweep.trial_states({"running": 1})
    sweep.best_score(0.5)
    sweep.best_score(float("nan"))  # ignored: a dashboard cannot draw it
    progress = TrainingMetrics("held-run", "", 0, "")
    progress.step_reported(0, {"samples_per_s": 10.0, "train_loss": 1.0, "note": "text"})
    # every trial state, the best score, and step/timestamp/throughput/loss
    assert held_series() == before + len(TRIAL_STATES) + 1 + 4
    sweep.close()
    progress.close()
    assert held_series() == before
