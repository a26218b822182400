"""Which trials run, stop or change: the scheduler and the seeded search algorithm.

Owns: building Tune's scheduler for ``SweepConfig.scheduler`` (ASHA, FIFO or population-based
training), reporting each scheduler STOP to the sweep's monitor (so a trial's status says it was
stopped early, at which rung), recording each PBT exploit in the exploited trial's config (so
its child run can record the lineage), and the search algorithm, seeded through
``BasicVariantGenerator(random_state=...)``.

Randomness: the search algorithm draws from its own generator. PBT's choices (which trial to
clone, how to perturb) use Python's and NumPy's global generators inside Ray, and so does Tune's
control loop; :class:`PrivateRandom` swaps a seeded state in around them (the whole sweep, and
each PBT decision) and the caller's back after, so a sweep never changes the caller's
``random``/``np.random`` state and PBT's choices repeat with the seed.
"""

from __future__ import annotations

import contextlib
import copy
import random
import time
from collections.abc import Iterator
from typing import Any

import numpy as np

from raydeck.errors import ConfigError
from raydeck.tune.config import SweepConfig
from raydeck.tune.monitor import live_monitor
from raydeck.tune.space import SearchSpace

# Key of a trial's config under which PBT's exploit is handed to the trial (see lineage.py);
# the trial removes it before the job sees its config.
LINEAGE_KEY = "__raydeck_pbt_exploit"


class PrivateRandom:
    """A seeded state of Python's and NumPy's global generators, used only inside ``active()``.

    Picklable (Tune pickles the scheduler with the sweep's state).
    """

    def __init__(self, seed: int | None) -> None:
        python = random.Random(seed)
        self._python_state = python.getstate()
        self._numpy_state = np.random.RandomState(python.getrandbits(32)).get_state()

    @contextlib.contextmanager
    def active(self) -> Iterator[None]:
        saved_python, saved_numpy = random.getstate(), np.random.get_state()
        random.setstate(self._python_state)
        np.random.set_state(self._numpy_state)
        try:
            yield
        finally:
            self._python_state, self._numpy_state = random.getstate(), np.random.get_state()
            random.setstate(saved_python)
            np.random.set_state(saved_numpy)


def search_algorithm(config: SweepConfig, max_concurrent: int | None) -> Any:
    """Tune's search algorithm: random/grid variants drawn from a generator seeded by the
    sweep's seed (not from the process's global state), at most ``max_concurrent`` trials
    at once (None: as resources allow). Tune ignores ``TuneConfig.max_concurrent_trials`` when
    it is given a search algorithm, so the limit is the algorithm's."""
    from ray.tune.search.basic_variant import BasicVariantGenerator

    return BasicVariantGenerator(random_state=config.seed, max_concurrent=max_concurrent or 0)


def make_scheduler(config: SweepConfig, space: SearchSpace) -> Any:
    """Tune's scheduler for ``config.scheduler``, reporting its decisions to the sweep monitor.

    Raises:
        ConfigError: PBT with a mutation that names no continuous or choice dimension.
    """
    from ray.tune.schedulers import ASHAScheduler, FIFOScheduler, PopulationBasedTraining
    from ray.tune.schedulers.trial_scheduler import TrialScheduler

    key = config.key

    class RecordingASHA(ASHAScheduler):
        """ASHA whose STOP decisions reach the sweep's monitor."""

        def on_trial_result(self, tune_controller: Any, trial: Any, result: dict[str, Any]
                            ) -> str:
            decision = super().on_trial_result(tune_controller, trial, result)
            monitor = live_monitor(key)
            if decision == TrialScheduler.STOP and monitor is not None:
                monitor.scheduler_stopped(trial.trial_id,
                                          int(result.get("training_iteration", 0) or 0))
            return str(decision)

    class LineagePBT(PopulationBasedTraining):
        """PBT with private randomness that hands each exploit to the exploited trial."""

        def __init__(self, *args: Any, rng: PrivateRandom, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            self._rng = rng

        def on_trial_add(self, tune_controller: Any, trial: Any) -> None:
            with self._rng.active():
                super().on_trial_add(tune_controller, trial)

        def on_trial_result(self, tune_controller: Any, trial: Any, result: dict[str, Any]
                            ) -> str:
            with self._rng.active():
                return str(super().on_trial_result(tune_controller, trial, result))

        def _exploit(self, tune_controller: Any, trial: Any, trial_to_clone: Any) -> None:
            previous = {k: v for k, v in trial.config.items() if k != LINEAGE_KEY}
            source = self._trial_state[trial_to_clone]
            checkpoint = source.last_checkpoint
            super()._exploit(tune_controller, trial, trial_to_clone)
            config = {k: v for k, v in trial.config.items() if k != LINEAGE_KEY}
            config[LINEAGE_KEY] = {
                "id": f"{time.time_ns()}-{trial_to_clone.trial_id}",
                "source_trial": trial_to_clone.trial_id,
                "source_checkpoint": getattr(checkpoint, "path", None),
                "source_iteration": _iteration(source.last_result),
                "source_score": _plain_score(source.last_result, self._metric),
                "score_before": _plain_score(self._trial_state[trial].last_result, self._metric),
                "previous_config": copy.deepcopy(previous),
            }
            trial.set_config(config)

    if config.scheduler == "fifo":
        return FIFOScheduler()
    if config.scheduler == "asha":
        return RecordingASHA(max_t=config.max_t, grace_period=config.grace_period,
                             reduction_factor=config.reduction_factor)
    return LineagePBT(
        time_attr="training_iteration",
        perturbation_interval=config.pbt_interval,
        hyperparam_mutations=pbt_mutations(config, space),
        rng=PrivateRandom(config.seed),
        log_config=False,
    )


def pbt_mutations(config: SweepConfig, space: SearchSpace) -> dict[str, Any]:
    """PBT's ``hyperparam_mutations``: the named dimensions (default every continuous one),
    nested like the trial's config.

    Raises:
        ConfigError: a name that is no dimension, one PBT cannot perturb (a grid), or nothing
            to perturb at all.
    """
    names = config.pbt_mutations
    if names is None:
        names = tuple(d.name for d in space.dimensions if d.continuous)
        if not names:
            raise ConfigError(
                "scheduler='pbt' needs a dimension to perturb: the space has no uniform or "
                "loguniform dimension; name the ones to perturb with pbt_mutations")
    mutations: dict[str, Any] = {}
    for name in names:
        dimension = space.dimension(name)
        if dimension.kind == "grid":
            raise ConfigError(f"pbt_mutations: {name!r} is a grid; PBT can perturb uniform, "
                              "loguniform, randint and choice dimensions")
        group = mutations
        for part in dimension.path[:-1]:
            group = group.setdefault(part, {})
        group[dimension.path[-1]] = (list(dimension.values) if dimension.kind == "choice"
                                     else dimension.to_tune())
    return mutations


def _iteration(result: dict[str, Any] | None) -> int:
    value = (result or {}).get("training_iteration", 0)
    return int(value) if isinstance(value, (int, float)) else 0


def _plain_score(result: dict[str, Any] | None, metric: str | None) -> float | None:
    value = (result or {}).get(metric or "")
    return float(value) if isinstance(value, (int, float)) else None
