"""Existing MLflow code with only its tracking URI changed: plain, MLflow's async, raydeck+,
against MLflow's own floor.

One process runs the same ``mlflow.log_metric`` loop (10 metrics per step, one call per value,
``step=`` given) against a local ``mlflow server`` (SQLite, 1 worker, as the embedded default)
started here, with the tracking URI set to:
  (a) the plain server URI (one REST request per call);
  (b) the plain server URI with MLflow's async logging on (``MLFLOW_ENABLE_ASYNC_LOGGING``);
  (c) ``raydeck+<server URI>``: the raydeck plugin (tracker, proxy, spool), as it comes: it sets
      MLflow's registry URI (the tracking URI), which skips MLflow's per-call probe for a Spark
      session (a failed ``import pyspark`` on every ``MlflowClient()`` the fluent API builds);
  (d) the same with the user's own ``MLFLOW_REGISTRY_URI`` (the server URI), which wins;
  (e) MLflow's floor: a tracking store that does nothing (scheme ``null``, registered in this
      process), registry URI set: what MLflow's fluent API itself costs per call;
  (f) the same store without a registry URI: MLflow's own default, the probe on every call.
Each loop starts with no registry URI set in the process, as a fresh process would; (c) to (f)
run ``--repeats`` times, interleaved, and the cheapest of each is shown.
The loop has a core of its own: MLflow's server, Ray and the proxy's actors (and the Ray threads
of this process, started with them) run on the machine's other cores, as on a cluster, where
they run on other machines; the loop's thread, and the tracker's flusher thread it starts, on
the first. On a 2-core machine the server's ingest (it takes a core for seconds after a fast
loop) otherwise lands on the loop's core now and then, an error larger than the plugin's cost.
``--shared-cores`` lets everything share every core.
For each: the caller's cost per call (us, loop time / calls) and the end-to-end rate (points/s,
from the loop's start until ``mlflow.end_run()`` returned, when every point is in MLflow; the
count is checked through the server's REST API; none for the floor, which keeps nothing). Prints
a table, the ratios to (a), and the plugin's cost against the floor (e) (goal: 1.2x or less).

Run: ``.venv/bin/python benchmarks/mlflow_dropin.py`` (raydeck installed, so MLflow finds the
plugin's entry point).
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import tempfile
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from tests.fixtures.mlflow_server import MlflowServer  # noqa: E402
from tests.fixtures.tracking import measured_tracking_env  # noqa: E402

from raydeck._internal.environ import environment  # noqa: E402

METRICS_PER_STEP = 10
NULL_SCHEME = "null"
FLOOR_GOAL = 1.2


@dataclass(frozen=True)
class Result:
    name: str
    calls: int
    caller_us: float
    points_per_s: float | None


def register_null_store() -> None:
    """Register, in this process, a tracking store that keeps nothing under ``null://``: the
    loop against it is MLflow's own cost per call (validation, entities, ``MlflowClient``)."""
    from mlflow.entities import Experiment, Run, RunData, RunInfo
    from mlflow.store.tracking.abstract_store import AbstractStore
    from mlflow.tracking._tracking_service import utils as tracking_utils

    class NullStore(AbstractStore):
        """Runs in a dict, every write dropped: the least a store can do for the loop."""

        def __init__(self, store_uri: str | None = None, artifact_uri: str | None = None) -> None:
            super().__init__()
            self.runs: dict[str, Run] = {}

        def create_run(self, experiment_id: str, user_id: str | None, start_time: int | None,
                       tags: list[Any], run_name: str | None) -> Run:
            info = RunInfo(uuid.uuid4().hex, experiment_id, user_id or "", "RUNNING",
                           start_time or 0, None, "active", run_name=run_name)
            self.runs[info.run_id] = Run(info, RunData())
            return self.runs[info.run_id]

        def get_run(self, run_id: str) -> Run:
            return self.runs[run_id]

        def get_experiment(self, experiment_id: str) -> Experiment:
            return Experiment(experiment_id, "Default", "", "active")

        def update_run_info(self, run_id: str, run_status: int | None, end_time: int | None,
                            run_name: str | None) -> RunInfo:
            return self.runs[run_id].info

        def log_batch(self, run_id: str, metrics: list[Any], params: list[Any],
                      tags: list[Any]) -> None:
            pass

        def log_metric(self, run_id: str, metric: Any) -> None:
            pass  # as the plugin, without AbstractStore's detour through log_batch

    tracking_utils._tracking_store_registry.register(NULL_SCHEME, NullStore)


def no_registry_uri() -> None:
    """No registry URI in this process, as at a fresh start: a loop before may have set one
    (the plugin's default is ``mlflow.set_registry_uri``: MLflow's global and the environment
    variable)."""
    from mlflow.tracking._model_registry import utils as registry_utils

    registry_utils._registry_uri = None
    os.environ.pop("MLFLOW_REGISTRY_URI", None)


def run_loop(name: str, tracking_uri: str, server_uri: str | None, steps: int,
             env: dict[str, str]) -> Result:
    """One ``start_run`` / loop / ``end_run`` with ``env`` set and no registry URI otherwise;
    checks every point landed on ``server_uri`` (none: the floor, nothing to check)."""
    import mlflow
    from mlflow.tracking import MlflowClient

    no_registry_uri()
    with environment(env):
        mlflow.set_tracking_uri(tracking_uri)
        keys = [f"metric_{k}" for k in range(METRICS_PER_STEP)]
        run = mlflow.start_run(run_name=f"dropin-{name}-{uuid.uuid4().hex[:4]}")
        started = time.perf_counter()
        for step in range(steps):
            for key in keys:
                mlflow.log_metric(key, step * 0.5, step=step)
        looped = time.perf_counter() - started
        mlflow.end_run()
        landed = time.perf_counter() - started
    no_registry_uri()
    calls = steps * METRICS_PER_STEP
    if server_uri is None:
        return Result(name, calls, looped / calls * 1e6, None)
    history = MlflowClient(server_uri).get_metric_history(run.info.run_id, keys[-1])
    if sorted(m.step for m in history) != list(range(steps)):
        raise AssertionError(f"{name}: {len(history)} of {steps} points of {keys[-1]} landed")
    return Result(name, calls, looped / calls * 1e6, calls / landed)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--plain-steps", type=int, default=40,
                        help="steps of (a) and (b): one REST request per value is slow")
    parser.add_argument("--raydeck-steps", type=int, default=1500,
                        help="steps of (c) to (f)")
    parser.add_argument("--repeats", type=int, default=3,
                        help="interleaved runs of (c) to (f), the cheapest of each shown")
    parser.add_argument("--shared-cores", action="store_true",
                        help="no core of its own for the loop (see the module docstring)")
    args = parser.parse_args()
    cores = sorted(os.sched_getaffinity(0))
    own_core = len(cores) >= 2 and not args.shared_cores
    if own_core:  # what starts next (server, Ray's processes and threads) inherits this
        os.sched_setaffinity(0, cores[1:])

    logging.basicConfig(level=logging.WARNING)
    with tempfile.TemporaryDirectory(prefix="raydeck-bench-") as tmp:
        root = Path(tmp)
        os.environ.update(measured_tracking_env(root / "data"))
        import ray

        from raydeck.cluster.connection import job_runtime_env
        from raydeck.config.settings import load_settings

        server = MlflowServer(root / "mlflow").start()
        try:
            os.environ["RAYDECK_TRACKING_URI"] = server.uri
            ray.init(address="local", num_cpus=4, include_dashboard=False, log_to_driver=False,
                     runtime_env=job_runtime_env(load_settings()))
            register_null_store()
            if own_core:  # this thread, and the threads it starts from here on
                os.sched_setaffinity(0, cores[:1])
            plugin = f"raydeck+{server.uri}"
            null = f"{NULL_SCHEME}://"
            # Warm-up: the proxy's actors start once, as in any job after its first run.
            run_loop("warm-up", plugin, server.uri, 10, {})
            results = [
                run_loop("(a) plain URI", server.uri, server.uri, args.plain_steps, {}),
                run_loop("(b) plain URI, MLflow async", server.uri, server.uri,
                         args.plain_steps, {"MLFLOW_ENABLE_ASYNC_LOGGING": "true"}),
            ]
            cheap: tuple[tuple[str, str, str | None, dict[str, str]], ...] = (
                ("(c) raydeck+ URI", plugin, server.uri, {}),
                ("(d) raydeck+ URI, user's MLFLOW_REGISTRY_URI", plugin, server.uri,
                 {"MLFLOW_REGISTRY_URI": server.uri}),
                ("(e) floor: null store, registry URI set", null, None,
                 {"MLFLOW_REGISTRY_URI": null}),
                ("(f) null store, no registry URI", null, None, {}),
            )
            # Interleaved repeats, the cheapest of each kept: other work on the machine only
            # ever adds to a loop's time, and it should not land on one loop alone.
            repeats = [[run_loop(name, uri, landed_on, args.raydeck_steps, env)
                        for name, uri, landed_on, env in cheap] for _ in range(args.repeats)]
            results += [min(tries, key=lambda r: r.caller_us)
                        for tries in zip(*repeats, strict=True)]
        finally:
            ray.shutdown()
            server.stop()

    plain = results[0]
    width = max(len(r.name) for r in results)
    print(f"\n{'loop (10 metrics/step)':<{width}}  {'calls':>6}  {'caller us/call':>14}  "
          f"{'end-to-end points/s':>19}  ratios to (a)")
    for r in results:
        rate = "-" if r.points_per_s is None else f"{r.points_per_s:,.0f}"
        ratio = ("" if r.points_per_s is None or plain.points_per_s is None
                 else f", {r.points_per_s / plain.points_per_s:.1f}x the rate")
        print(f"{r.name:<{width}}  {r.calls:>6}  {r.caller_us:>14.1f}  {rate:>19}"
              f"  {plain.caller_us / r.caller_us:.1f}x cheaper per call{ratio}")
    floor = results[4]
    print(f"\nthe loop on core {cores[0]}, alone" if own_core
          else "\nthe loop sharing every core with MLflow's server and Ray (--shared-cores)")
    print(f"per call against MLflow's floor (e), {floor.caller_us:.1f} us "
          f"(goal: {FLOOR_GOAL}x or less by default):")
    for r in (results[2], results[3], results[5]):
        print(f"  {r.name:<{width}}  {r.caller_us / floor.caller_us:.2f}x")


if __name__ == "__main__":
    main()
