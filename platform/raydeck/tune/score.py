"""A trial's score: the best value of the sweep's metric it reported, by the sweep's mode.

Owns: what "best" means for ``mode`` (:func:`best_of`) and :class:`RunningBest`, a trial's best
so far. The score ranks the trials. MLflow's ``metrics.<metric>`` is a run's *latest* value,
which would rank them otherwise, so each child run shows the score as ``best_<metric>``
(``SweepConfig.best_metric``): the trial logs it as it improves (:mod:`raydeck.tune.trial`) and
the summary, which ranks by it, makes it certain (:mod:`raydeck.tune.summary`).
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any


def best_of(values: Iterable[Any], mode: str) -> float | None:
    """The highest (``mode="max"``) or lowest (``"min"``) of ``values``; anything that is not a
    real number (NumPy's count), and NaN, is left out. None if nothing is left."""
    scores = [float(value) for value in values
              if isinstance(value, numbers.Real) and not isinstance(value, bool)
              and not math.isnan(value)]
    if not scores:
        return None
    return max(scores) if mode == "max" else min(scores)


@dataclass
class RunningBest:
    """A trial's best value so far (one per trial process; not thread-safe)."""

    mode: str
    value: float | None = None

    def update(self, value: Any) -> float | None:
        """Take ``value`` in (ignored unless it is a number other than NaN); returns the best so
        far (None while there is none)."""
        self.value = best_of((self.value, value), self.mode)
        return self.value
