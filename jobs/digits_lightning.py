"""Train the digits classifier with PyTorch Lightning on Ray Train, tracked in MLflow.

Locally:          python jobs/digits_lightning.py --epochs 5
On a cluster:     ray job submit --runtime-env runtime_envs/cpu.yaml --working-dir . -- \
                      python jobs/digits_lightning.py --preset cpu-2 --run-name nightly
             or:  raydeck submit jobs/digits_lightning.py --runtime-env runtime_envs/cpu.yaml

The training loop is ``raydeck.examples.digits_lightning.train_loop_per_worker``: Ray Train's
Lightning utilities (RayDDPStrategy, RayLightningEnvironment, prepare_trainer) with raydeck's
``RaydeckLogger``, ``RaydeckReportCallback`` and ``resume``, so a worker that dies costs at
most one epoch and every step appears once in MLflow. To resume a run whose driver died, run
the job again with ``--run-id`` set to that run's id.

On an elastic preset (``--preset cpu-1-4``) each worker keeps ``--batch-size`` and ``--lr`` at
every size, as ``jobs/digits_torch.py`` does: the global batch grows with the workers.
"""

from __future__ import annotations

from typing import Any

from raydeck.examples.digits import run_job


def train_loop_per_worker(config: dict[str, Any]) -> None:
    """The example's loop, imported where it runs: importing PyTorch Lightning costs a process
    seconds of start-up (about 6 CPU-s on 2 cores), which the driver does not need."""
    from raydeck.examples import digits_lightning

    digits_lightning.train_loop_per_worker(config)


if __name__ == "__main__":
    run_job(train_loop_per_worker, description=__doc__.splitlines()[0], run_name="digits-lightning")
