"""The Ray Train worker callback that hands a worker's tracking data over before it is killed.

Ray Train v2 stops workers with ``ray.kill`` a few seconds after asking them to shut down, so no
atexit hook runs in a Train worker. raydeck registers this callback for every TorchTrainer of a
job through ``RAY_TRAIN_CALLBACKS`` (see :mod:`raydeck.tracking.client.lifecycle`); Ray imports it
by name, which is why it has a module of its own.
"""

from __future__ import annotations

from ray.train.v2._internal.execution.callback import WorkerCallback

from raydeck.tracking.client.lifecycle import (
    TRAIN_HANDOFF_TIMEOUT_S,
    active,
    finish_all,
    train_thread_status,
)


class TrainWorkerHandoff(WorkerCallback):
    """Hand each tracker's data to the proxy in ``before_worker_shutdown``, and leave the run.

    Runs inside Train's grace period before ``ray.kill``; it only needs the proxy to acknowledge
    the data (spooled), not MLflow, so it takes milliseconds. The rank leaves its run
    ``FINISHED`` when the training function returned, ``FAILED`` when it raised, ``KILLED`` when
    its worker group is torn down mid-training (Ray Train then restarts it, and the new worker
    joins the same run).
    """

    def before_worker_shutdown(self) -> None:
        if active():
            finish_all(train_thread_status(), wait=False, timeout_s=TRAIN_HANDOFF_TIMEOUT_S)
