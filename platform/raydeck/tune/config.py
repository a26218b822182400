"""A sweep's settings and its job: what :func:`raydeck.tune.sweep` is asked to run.

Owns: :class:`SweepConfig` (scheduler, budget, seed, registry name; validated at construction)
and :class:`SweepJob` (the training code a sweep runs). Does not own: the search space
(:mod:`raydeck.tune.space`) or resources (scaling presets).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from raydeck.config.settings import RUN_KEY_PATTERN
from raydeck.errors import ConfigError

SCHEDULERS = ("asha", "fifo", "pbt")


@dataclass(frozen=True)
class SweepConfig:
    """How to run a sweep. Every field is validated at construction.

    Attributes:
        name: the sweep's name: its MLflow parent run and its Tune experiment directory.
        metric, mode: what to optimise (``max`` or ``min``); the job must report ``metric``.
        num_samples: trials drawn from the space (times each grid combination).
        max_t: iterations a trial may run.
        scheduler: ``asha`` (stops weak trials early at rungs), ``fifo`` (every trial runs to
            ``max_t``) or ``pbt`` (population-based training: weak trials continue from a
            strong trial's checkpoint with perturbed hyperparameters).
        grace_period: iterations before ASHA may stop a trial; ``reduction_factor``: ASHA keeps
            1/reduction_factor of trials at each rung.
        perturbation_interval: PBT compares trials every this many iterations (default
            ``max_t // 4``, at least 1).
        pbt_mutations: names of the dimensions PBT may change on exploit (dotted for nested
            ones); default every ``uniform``/``loguniform`` dimension. Dimensions that shape the
            model (layer sizes) must not be among them: a checkpoint cannot load into another
            architecture.
        preset: scaling preset for each trial's resources (fractional GPUs allowed).
        max_concurrent_trials: cap on parallel trials (default: as many as resources allow).
        seed: seed of the search algorithm (and of PBT's choices), so a sweep can be repeated;
            the caller's global ``random``/``numpy`` state is never touched.
        register_model_as: model registry name for the best trial's model (None: skip).
        experiment: MLflow experiment (default ``RAYDECK_TRACKING_EXPERIMENT``).
    """

    name: str
    metric: str = "val_accuracy"
    mode: str = "max"
    num_samples: int = 8
    max_t: int = 8
    grace_period: int = 1
    reduction_factor: float = 2.0
    scheduler: str = "asha"
    perturbation_interval: int | None = None
    pbt_mutations: tuple[str, ...] | None = None
    preset: str = "cpu-1"
    max_concurrent_trials: int | None = None
    seed: int | None = 0
    register_model_as: str | None = None
    experiment: str | None = None

    def __post_init__(self) -> None:
        if not RUN_KEY_PATTERN.match(self.name):
            raise ConfigError(f"sweep name={self.name!r}: may hold 1-128 letters, digits, _ . -")
        if self.mode not in ("max", "min"):
            raise ConfigError(f"mode={self.mode!r}: must be 'max' or 'min'")
        if self.scheduler not in SCHEDULERS:
            raise ConfigError(f"scheduler={self.scheduler!r}: must be one of "
                              f"{', '.join(SCHEDULERS)}")
        for name in ("num_samples", "max_t", "grace_period"):
            _positive_int(name, getattr(self, name))
        if self.grace_period > self.max_t:
            raise ConfigError(
                f"grace_period={self.grace_period} > max_t={self.max_t}: ASHA could never stop "
                "a trial; lower grace_period or raise max_t"
            )
        if not self.reduction_factor > 1:
            raise ConfigError(f"reduction_factor={self.reduction_factor}: must be > 1")
        if self.perturbation_interval is not None:
            _positive_int("perturbation_interval", self.perturbation_interval)
            if self.perturbation_interval >= self.max_t:
                raise ConfigError(
                    f"perturbation_interval={self.perturbation_interval} >= max_t={self.max_t}: "
                    "PBT would never exploit; lower it or raise max_t")
        if self.pbt_mutations is not None:
            if isinstance(self.pbt_mutations, str):
                raise ConfigError(f"pbt_mutations={self.pbt_mutations!r}: must be a list of "
                                  "dimension names, not one string")
            object.__setattr__(self, "pbt_mutations", tuple(self.pbt_mutations))
        if self.max_concurrent_trials is not None:
            _positive_int("max_concurrent_trials", self.max_concurrent_trials)
        if self.seed is not None and (isinstance(self.seed, bool)
                                      or not isinstance(self.seed, int)):
            raise ConfigError(f"seed={self.seed!r}: must be an integer or None")

    @property
    def key(self) -> str:
        """The parent run's key (deterministic, so ``--resume`` finds it)."""
        return f"sweep-{self.name}"

    @property
    def best_metric(self) -> str:
        """``best_<metric>``: a trial's score (its best value of ``metric`` by ``mode``), as its
        child run, the parent run and the summary name it."""
        return f"best_{self.metric}"

    def trial_key(self, trial_id: str) -> str:
        """A trial's child run key; Tune keeps trial ids across a resume."""
        return f"{self.key}.{trial_id}"

    @property
    def pbt_interval(self) -> int:
        return self.perturbation_interval or max(1, self.max_t // 4)

    def to_dict(self) -> dict[str, Any]:
        """Plain data (JSON), stored with the sweep's state so ``--resume`` runs it unchanged."""
        data = dataclasses.asdict(self)
        if self.pbt_mutations is not None:
            data["pbt_mutations"] = list(self.pbt_mutations)
        return data

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> SweepConfig:
        known = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in data.items() if k in known})


def _positive_int(name: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ConfigError(f"{name}={value!r}: must be an integer >= 1")


@dataclass(frozen=True)
class SweepJob:
    """What a sweep trains.

    Attributes:
        train_fn: ``train_fn(config, data)``. Single-process: runs in the trial, calls
            :func:`raydeck.tune.restore` once and :func:`raydeck.tune.report` once per
            iteration. Distributed: a Ray Train per-worker loop (``train_fn(config)``, the data
            in ``config["data"]``) that reports each epoch with
            :func:`raydeck.train.checkpointing.report_epoch`; epochs count from 0 and a trial's
            iteration is its epoch + 1.
        reports: metric names the job reports, checked against ``SweepConfig.metric`` before
            any trial starts.
        load_data: builds the data once on the driver; it goes to Ray's object store once.
        model_factory: ``model_factory(config)`` rebuilds the model to register the best one.
        serving_model: ``serving_model(model, config)`` gives the trained model as users call
            it (its input preprocessing inside) and an input example for its signature; without
            it the model is registered as trained, with no example.
        distributed: run each trial as a ``TorchTrainer`` with the preset's workers.
    """

    train_fn: Callable[..., None]
    reports: tuple[str, ...]
    load_data: Callable[[], Any] | None = None
    model_factory: Callable[[dict[str, Any]], Any] | None = None
    serving_model: Callable[[Any, dict[str, Any]], tuple[Any, Any]] | None = None
    distributed: bool = False
