"""Hyperparameter sweeps: Ray Tune over a raydeck job, tracked as one parent run in MLflow.

A sweep draws trials from a search space (:mod:`~raydeck.tune.space`), runs each as a Tune
function trainable, single-process or as a ``TorchTrainer`` (:mod:`~raydeck.tune.trial`,
:mod:`~raydeck.tune.distributed`), schedules them with ASHA, FIFO or population-based training
(:mod:`~raydeck.tune.scheduling`), records each trial as a child run with a truthful status
(:mod:`~raydeck.tune.status`, :mod:`~raydeck.tune.monitor`) and its score, ``best_<metric>``
(:mod:`~raydeck.tune.score`), keeps its state where training keeps checkpoints
(:mod:`~raydeck.tune.experiment`), and ends with a summary on the parent run
(:mod:`~raydeck.tune.summary`) and the best model registered (:mod:`~raydeck.tune.registry`).
:func:`sweep` (:mod:`~raydeck.tune.driver`) runs it all; see ``docs/sweeps.md``.
"""

from raydeck.tune.config import SCHEDULERS, SweepConfig, SweepJob
from raydeck.tune.driver import sweep
from raydeck.tune.experiment import sweep_storage_path
from raydeck.tune.monitor import SlotUsage
from raydeck.tune.space import DISTRIBUTIONS, Dimension, SearchSpace
from raydeck.tune.status import (
    COMPLETED,
    ERRORED,
    PREEMPTED,
    RESUMED_TAG,
    STOP_ITERATION_TAG,
    STOPPED_AT_RUNG_TAG,
    STOPPED_EARLY,
    TRIAL_ERROR_TAG,
    TRIAL_STATUS_TAG,
    TRIAL_STATUSES,
)
from raydeck.tune.summary import SweepResult, TrialSummary
from raydeck.tune.trial import report, restore

__all__ = [
    "COMPLETED",
    "DISTRIBUTIONS",
    "ERRORED",
    "PREEMPTED",
    "RESUMED_TAG",
    "SCHEDULERS",
    "STOPPED_AT_RUNG_TAG",
    "STOPPED_EARLY",
    "STOP_ITERATION_TAG",
    "TRIAL_ERROR_TAG",
    "TRIAL_STATUSES",
    "TRIAL_STATUS_TAG",
    "Dimension",
    "SearchSpace",
    "SlotUsage",
    "SweepConfig",
    "SweepJob",
    "SweepResult",
    "TrialSummary",
    "report",
    "restore",
    "sweep",
    "sweep_storage_path",
]
