"""Bad input is refused at the call site, naming the key and the rule; good values still land."""

from __future__ import annotations

import math
import subprocess
import sys
from typing import Any

import pytest

from raydeck.errors import ConfigError, TrackingValidationError


@pytest.fixture
def tracker(ray_cluster: None):  # type: ignore[no-untyped-def]
    import raydeck

    tracker = raydeck.get_tracker(run_name="validation")
    yield tracker
    tracker.finish()


@pytest.mark.timeout(120)
def test_one_bad_value_never_sinks_the_call(tracker: Any, mlflow_client: Any) -> None:
    with pytest.raises(TrackingValidationError) as excinfo:
        tracker.log_metrics({
            "good": 1.5,
            "also/good": 2,
            "bad key!": 3.0,
            "nan_loss": float("nan"),
            "inf_loss": float("inf"),
            "text": "0.5",
            "none": None,
            "../escape": 1.0,
        }, step=3)
    problems = excinfo.value.problems
    assert set(problems) == {"bad key!", "text", "none", "../escape"}
    assert "letters, digits" in problems["bad key!"] and "'bad key'" in problems["bad key!"]
    assert "must be numbers, got str" in problems["text"]
    assert "normalized paths" in problems["../escape"]

    for step, error in ((-1, "must be >= 0"), (1.5, "non-negative int")):
        with pytest.raises(TrackingValidationError, match=error):
            tracker.log_metrics({"good": 9.0}, step=step)

    with pytest.raises(TrackingValidationError) as excinfo:
        tracker.log_params({"lr": 0.1, "notes": "x" * 7000, "bad name?": 1})
    assert set(excinfo.value.problems) == {"notes", "bad name?"}
    assert "at most 6000 characters" in excinfo.value.problems["notes"]
    with pytest.raises(TrackingValidationError, match=r"already logged as '0\.1'"):
        tracker.log_params({"lr": 0.2})
    tracker.log_params({"lr": 0.1})  # the same value again is fine

    with pytest.raises(TrackingValidationError) as excinfo:
        tracker.set_tags({"team": "vision", "config": {"nested": True}, "big": "y" * 9000})
    assert set(excinfo.value.problems) == {"config", "big"}
    assert "log structured values with log_dict" in excinfo.value.problems["config"]

    with pytest.raises(TrackingValidationError, match="no such file"):
        tracker.log_artifact("/nonexistent/file.txt")

    tracker.finish()
    run = mlflow_client.get_run(tracker.run_id)
    assert run.data.metrics["good"] == 1.5
    assert run.data.metrics["also/good"] == 2.0
    # NaN and inf are stored as MLflow stores them (NaN as NaN, inf as the largest double).
    assert math.isnan(run.data.metrics["nan_loss"])
    assert run.data.metrics["inf_loss"] == sys.float_info.max
    assert [m.step for m in mlflow_client.get_metric_history(tracker.run_id, "good")] == [3]
    assert run.data.params["lr"] == "0.1"
    assert "notes" not in run.data.params
    assert run.data.tags["team"] == "vision"
    assert "config" not in run.data.tags


@pytest.mark.timeout(120)
def test_one_value_at_a_time_follows_the_same_rules_as_a_dict(tracker: Any,
                                                              mlflow_client: Any) -> None:
    """``log_metric`` (what ``mlflow.log_metric`` through the plugin calls) has a path of its
    own for a known key, a finite float and a step: the step counter, the checks and what lands
    are those of ``log_metrics``."""
    tracker.log_metric("loss", 1.0, step=0)  # a new key: log_metrics' path
    tracker.log_metric("loss", 2.0, step=5)  # the single-value path
    with pytest.raises(TrackingValidationError, match="must be >= 0"):
        tracker.log_metric("loss", 9.0, step=-1)
    with pytest.raises(TrackingValidationError, match="must be numbers, got str"):
        tracker.log_metric("loss", "9.0", step=6)  # type: ignore[arg-type]
    tracker.log_metric("loss", float("nan"), step=7)  # stored as MLflow stores NaN
    tracker.log_metric("loss", 3.0)  # no step: the counter, past every step logged
    tracker.log_metric("loss", 4, step=9)  # an int: log_metrics' path, stored as a float
    tracker.log_metric("loss", 5.0, step=2)  # an earlier step: logged, the counter kept
    tracker.log_metric("loss", 6.0)
    tracker.finish()
    history = sorted((m.step, m.value) for m in
                     mlflow_client.get_metric_history(tracker.run_id, "loss"))
    assert [step for step, _ in history] == [0, 2, 5, 7, 8, 9, 10]
    assert [value for _, value in history if not math.isnan(value)] == [
        1.0, 5.0, 2.0, 3.0, 4.0, 6.0]


@pytest.mark.timeout(120)
def test_numpy_and_torch_scalars_are_metric_values(tracker: Any, mlflow_client: Any) -> None:
    import numpy as np
    import torch

    tracker.log_metrics({"np": np.float32(0.25), "np_int": np.int64(4),
                         "torch": torch.tensor(0.75)})
    tracker.finish()
    metrics = mlflow_client.get_run(tracker.run_id).data.metrics
    assert metrics == {"np": 0.25, "np_int": 4.0, "torch": 0.75} | {
        k: v for k, v in metrics.items() if k.startswith("system/")
    }


@pytest.mark.timeout(120)
def test_unknown_mlflow_run_id_is_one_clear_error(ray_cluster: None) -> None:
    import raydeck

    with pytest.raises(ConfigError, match="looks like an MLflow run id, but MLflow at"):
        raydeck.get_tracker("0123456789abcdef0123456789abcdef")


@pytest.mark.timeout(60)
def test_limits_are_mlflows_own() -> None:
    """The limits are written out (importing MLflow costs every training process ~2 CPU-s);
    they must still be the installed MLflow's."""
    from mlflow.utils import validation as mlflow_validation

    from raydeck.tracking.client import validation

    for name in ("MAX_ENTITY_KEY_LENGTH", "MAX_PARAM_VAL_LENGTH", "MAX_TAG_VAL_LENGTH"):
        assert getattr(validation, name) == getattr(mlflow_validation, name), name


@pytest.mark.timeout(60)
def test_training_processes_do_not_import_mlflow() -> None:
    """A Train worker or job driver imports the tracker and the training runtime; only the
    proxy's shards write to MLflow, so neither MLflow nor pandas may be loaded by that import."""
    code = ("import sys, raydeck, raydeck.train.trainer, raydeck.tracking; "
            "print(sorted(m for m in ('mlflow', 'pandas') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True, timeout=50)
    assert out.stdout.strip() == "[]", out.stdout + out.stderr
