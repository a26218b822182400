"""The Ray Tune callback that tells the tracking proxy how each plain trial ended.

A plain ``Tuner`` trial that logs through raydeck (``setup_mlflow`` with a ``raydeck://`` URI,
``mlflow.start_run()`` or ``get_tracker()`` in the trial) owns a run that nothing in the trial
function ends. Tune stops the trial's process with a ``stop`` task whose cleanup does not wait
for the training thread, then drops the actor. The process's exit hooks do run (MLflow's
``end_run`` at exit, raydeck's own), but they cannot tell a trial whose function raised (Tune's
thread runner caught the exception) from one that returned, and the run still ended ``KILLED``
(the trial's end at exit never got as far as leaving the run before Ray reported the process
gone). Tune's driver knows: this callback passes ``on_trial_complete`` (``FINISHED``: the
function returned, or a scheduler such as ASHA or a stopper stopped it) and ``on_trial_error``
(``FAILED``) to the router
(:meth:`~raydeck.tracking.proxy.router.RouterCore.set_trial_outcome`), which ends the run with that
status once the trial's process has left or is gone.

Ray builds the callbacks named in ``RAY_TUNE_CALLBACKS`` for every ``Tuner.fit()``
(``ray.tune.utils.callback``); raydeck adds this one where it sets up Ray
(:func:`raydeck.cluster.connection.connect`, a job's runtime env), and a driver that never imports
raydeck sets the variable itself. Ray imports it by name, which is why it has a module of its own.
"""

from __future__ import annotations

import logging
from typing import Any

from ray.tune import Callback

from raydeck._internal.redaction import redact_text
from raydeck.config.settings import load_settings
from raydeck.tracking.proxy.actors import find_router

logger = logging.getLogger(__name__)


class TrialOutcome(Callback):
    """Reports each finished trial's status to the tracking proxy; never waits, never raises
    into Tune's loop (a trial's run then ends ``KILLED``, as without this callback)."""

    def on_trial_complete(self, iteration: int, trials: list[Any], trial: Any,
                          **info: Any) -> None:
        self._tell(trial.trial_id, "FINISHED")

    def on_trial_error(self, iteration: int, trials: list[Any], trial: Any, **info: Any) -> None:
        self._tell(trial.trial_id, "FAILED")

    @staticmethod
    def _tell(trial_id: str, status: str) -> None:
        try:
            router = find_router(load_settings().ray_namespace)
            if router is not None:  # no proxy: no trial logged through raydeck
                router.set_trial_outcome.remote(trial_id, status)
        except Exception as exc:
            logger.warning("could not report trial %s as %s to the tracking proxy: %s",
                           trial_id, status, redact_text(str(exc)))
