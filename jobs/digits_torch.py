"""Train the digits classifier with plain PyTorch on Ray Train, tracked in MLflow.

Locally:          python jobs/digits_torch.py --epochs 5
On a cluster:     ray job submit --runtime-env runtime_envs/cpu.yaml --working-dir . -- \
                      python jobs/digits_torch.py --preset cpu-2 --run-name nightly
             or:  raydeck submit jobs/digits_torch.py --runtime-env runtime_envs/cpu.yaml

The training loop itself is ``raydeck.examples.digits.train_loop_per_worker``: it gets its
tracker with ``raydeck.get_tracker()`` (no run id passed around), restores the latest checkpoint
after a failure, and reports every epoch with ``raydeck.train.checkpointing.report_epoch`` so each
epoch appears once in MLflow. Copy it as the starting point of your own job. To resume a run
whose driver died, run the job again with ``--run-id`` set to that run's id.

On an elastic preset (``--preset cpu-1-4``: Ray Train, or the queue, picks the size and may
restart the job at another from its latest checkpoint) each worker keeps ``--batch-size`` and
``--lr`` at every size, so the global batch is the batch size times the workers. To keep the
global batch instead, divide it by ``ray.train.get_context().get_world_size()`` in the loop,
which sees the size it was (re)started at.
"""

from __future__ import annotations

from raydeck.examples.digits import run_job, train_loop_per_worker

if __name__ == "__main__":
    run_job(train_loop_per_worker, description=__doc__.splitlines()[0], run_name="digits-torch")
