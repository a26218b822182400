"""Where this process sits in Ray: driver, Ray Train worker (with its ranks), Tune trial or task.

Read from Ray's own contexts so users never pass ranks or run names by hand.
"""

from __future__ import annotations

import os
import socket

from raydeck.tracking.messages import ProcessInfo


def _train_context() -> object | None:
    """Ray Train v2's context when this process runs a training function, else None."""
    try:
        from ray.train.v2._internal.util import _in_ray_train_worker
    except ImportError:
        return None
    if not _in_ray_train_worker():
        return None
    import ray.train

    return ray.train.get_context()


def _tune_trial_id() -> str | None:
    try:
        from ray.tune.trainable.trainable_fn_utils import _in_tune_session
    except ImportError:
        return None
    if not _in_tune_session():
        return None
    import ray.tune

    return str(ray.tune.get_context().get_trial_id())


def detect_process() -> ProcessInfo:
    """Describe the calling process. Call after Ray is initialized."""
    import ray

    runtime = ray.get_runtime_context()
    job_id = runtime.get_job_id()
    node_ip = ray.util.get_node_ip_address()
    pid = os.getpid()
    actor_id = runtime.get_actor_id() if runtime.worker.mode == ray.WORKER_MODE else None
    common = {"job_id": job_id, "node_ip": node_ip, "hostname": socket.gethostname(), "pid": pid,
              "actor_id": actor_id}

    train = _train_context()
    if train is not None:
        name = train.get_experiment_name()  # type: ignore[attr-defined]
        rank = int(train.get_world_rank())  # type: ignore[attr-defined]
        return ProcessInfo(
            role="train_worker",
            role_key=f"train:{job_id}:{name}:{rank}",
            world_rank=rank,
            local_rank=int(train.get_local_rank()),  # type: ignore[attr-defined]
            node_rank=int(train.get_node_rank()),  # type: ignore[attr-defined]
            world_size=int(train.get_world_size()),  # type: ignore[attr-defined]
            train_run_name=name,
            **common,
        )
    trial_id = _tune_trial_id()
    if trial_id is not None:
        return ProcessInfo(role="trial", role_key=f"trial:{trial_id}", trial_id=trial_id, **common)
    if runtime.worker.mode == ray.WORKER_MODE:
        return ProcessInfo(role="task", role_key=f"task:{job_id}:{pid}", **common)
    return ProcessInfo(role="driver", role_key=f"driver:{job_id}:{node_ip}:{pid}", **common)
