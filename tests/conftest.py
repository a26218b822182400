"""Session-scoped real components: an MLflow server, raydeck settings pointing at it, and Ray.

The order matters: raydeck's settings go into the environment *before* Ray starts, because the
local Ray cluster's workers inherit the environment of the process that started it, exactly as
a job's workers inherit the runtime env in production.
"""

from __future__ import annotations

import compileall
import os
import signal
from collections.abc import Iterator
from pathlib import Path

import pytest
from pytest_timeout import Settings as TimeoutSettings
from xdist.remote import Producer

from tests.fixtures.mlflow_server import MlflowServer
from tests.fixtures.prometheus import PrometheusServer, for_ray_session
from tests.fixtures.s3_server import S3Server
from tests.fixtures.streams import StreamScheduling, lower_priority_if_background

# Settings every test process (and every Ray worker it starts) shares. Short intervals keep the
# suite fast; they are the same code paths as the defaults.
REPO = Path(__file__).resolve().parents[1]
TEST_ENV = {
    "RAYDECK_TRACKING_FLUSH_INTERVAL_S": "0.1",
    # Every tracked process samples and logs system metrics (default every 10 s), a stream of
    # writes through the proxy to MLflow; the tests that check them set their own interval.
    "RAYDECK_TRACKING_SYSTEM_METRICS_INTERVAL_S": "30",
    "RAYDECK_TRACKING_LOST_AFTER_S": "15",
    # Waits the fault tests sit through: a SIGKILLed worker is suspected after 2.5 missed
    # beats (Ray is then asked), and a write that failed while MLflow or S3 was down is tried
    # again at most this long after it came back (defaults: 5 s each).
    "RAYDECK_TRACKING_HEARTBEAT_INTERVAL_S": "1",
    "RAYDECK_TRACKING_RETRY_MAX_S": "1",
    "RAYDECK_TRACKING_FINISH_TIMEOUT_S": "60",
    "RAYDECK_LOG_LEVEL": "INFO",
    # The queue looks at its jobs every 2 s by default; every start, end and preemption waits
    # for its next look. Each look lists the head's jobs through its job server: at 0.5 s the
    # queue's head used 12.6 % of a core idle, against 6.5 % for a head without the queue.
    "RAYDECK_QUEUE_TICK_S": "1",
    # Ray Train polls its workers every 2 s by default; 0.5 s saves seconds per job.
    "RAY_TRAIN_HEALTH_CHECK_INTERVAL_S": "0.5",
    # Under HAProxy (Serve's ingress on the session's Ray) a replica being stopped keeps
    # answering for 30 s so that HAProxy stops sending to it first; every `serve --stop`, deleted
    # application and the module's `serve.shutdown()` waited it out. HAProxy drops a removed
    # replica on the controller's next broadcast, well within 2 s here.
    "RAY_SERVE_DIRECT_INGRESS_MIN_DRAINING_PERIOD_S": "2",
    "RAY_USAGE_STATS_ENABLED": "0",
    # One compute thread per process. Ray sets a worker's OMP_NUM_THREADS to the CPUs it holds
    # (when unset), and the suite's clusters declare more CPUs than the machine's 2 cores so that
    # the jobs' gangs fit (8 on the queue's head): a 3- or 8-CPU digits worker ran torch on as
    # many threads, which spin-wait for each other on a loaded machine (5 epochs of the digits
    # MLP, load 10: 3.9 CPU-s and 14 s with 8, 0.3 CPU-s and 0.9 s with 1).
    "OMP_NUM_THREADS": "1",
    # A raylet starts idle Python workers ahead of demand (for the first driver, and for queued
    # leases); in a run of many short-lived clusters and jobs many were never used, each 1-3
    # CPU-s (141 `ray::IDLE` processes ended in one run, 477 CPU-s; 119 and 365 CPU-s without
    # prestarting). Workers start on demand.
    "RAY_prestart_worker_first_driver": "0",
    "RAY_enable_worker_prestart": "0",
    # On SIGTERM `ray start --block` drains its node for up to 30 s before it stops Ray's
    # processes; a test stopping its head signals the GCS at the same moment, so the drain
    # request hangs and every stop waited out its grace (the stack's `down`: 20 s for the head).
    "RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S": "0",
    # Ray's log monitor (one per node) looks for new worker log files every 0.1 s until its
    # node has 1,000 of them, then every 0.5 s; log monitors took 192 CPU-s of a 45-minute run
    # (2026-12-03). Every 0.5 s from the start: a new worker's first line reaches its driver up
    # to 0.4 s later.
    "RAY_LOG_MONITOR_MANY_FILES_THRESHOLD": "0",
    # The in-process cluster runs without token auth, pinned so no earlier run decides it;
    # tests of `ray job submit` start their own head with RAY_AUTH_MODE=token.
    "RAY_AUTH_MODE": "disabled",
    "MLFLOW_SUPPRESS_PRINTING_URL_TO_STDOUT": "true",
}
RAY_NUM_CPUS = 4
# The session's own teardown (the shared Ray cluster, MLflow, S3 and Prometheus servers): its
# bound, in place of the timeout of whichever test happens to run last.
SESSION_TEARDOWN_TIMEOUT_S = 300
# A test's setup, which starts the shared fixtures it is the first to use: its bound, in place
# of the test's own timeout (which then covers the test's call and teardown).
SHARED_SETUP_TIMEOUT_S = 600
RAY_START_ATTEMPTS = 3

# Fixtures that start a Ray cluster or run a training job: a test using one (directly or
# through another fixture) is ``slow``, so ``pytest -m "not slow"`` (the inner loop) skips it.
# Tests that start a cluster in a subprocess (``raydeck demo``, ``ray start``) say so with
# ``@pytest.mark.slow`` themselves.
CLUSTER_FIXTURES = frozenset({"ray_cluster"})

# Modules that hold a pytest-xdist worker longest, heaviest first (docs/testing.md has the
# measured table). Under xdist (``-n N --dist loadfile --no-loadscope-reorder``) whole modules
# are handed out in collection order, so these start first and the light modules fill in
# around them; in one process the order stays pytest's own.
HEAVIEST_MODULES = (
    "test_queue.py",
    "test_sweeps.py",
    "test_secrets_e2e.py",
    "test_scaling_gpu_packing.py",
    "test_storage_runs.py",
    "test_stack.py",
    "test_fault_tolerance.py",
    "test_jobs.py",
    "test_serving.py",
    "test_observability_e2e.py",
    "test_demo.py",
)

# A stack someone started on this machine (`raydeck up`) must not become the suite's MLflow, S3
# or Ray: its connection file is read by every raydeck process (tests/stack/test_stack.py points
# its own processes at its own file).
os.environ["RAYDECK_STACK_FILE"] = ""
# Likewise a tracking server the developer's shell names (raydeck uses MLflow's variable when
# RAYDECK_TRACKING_URI is not set); tests that need it set it themselves.
os.environ.pop("MLFLOW_TRACKING_URI", None)
# A pytest-xdist worker starts with COLUMNS=80, which Rich reads once, when the CLI's console is
# made: every table a test renders in this process would be pinned at 80 columns. Tests that need
# a width set COLUMNS themselves, as in one process.
if os.environ.get("PYTEST_XDIST_WORKER"):
    os.environ.pop("COLUMNS", None)


def pytest_configure(config: pytest.Config) -> None:
    """Write the bytecode of raydeck's and the tests' modules once, before anything starts.

    The development and CI machines set ``PYTHONDONTWRITEBYTECODE=1``, so on a fresh clone every
    process the suite starts that imports them (each CLI call, Ray worker, tracking actor and
    job: hundreds) would compile them from source again, 0.1-0.3 CPU-s each
    (``import raydeck.train.trainer``: 1.06 CPU-s from source, 0.87 from bytecode). Installed
    packages have theirs from pip.
    """
    for tree in ("platform", "tests"):
        compileall.compile_dir(REPO / tree, quiet=1)
    lower_priority_if_background()


def pytest_xdist_make_scheduler(config: pytest.Config, log: Producer) -> StreamScheduling | None:
    """``-n 2 --dist loadfile``: two streams of whole modules, the second at a lower CPU
    priority (tests/fixtures/streams.py); any other xdist run schedules as xdist does."""
    if config.getvalue("dist") == "loadfile" and len(config.getvalue("tx") or ()) == 2:
        return StreamScheduling(config, log)
    return None


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Mark cluster tests ``slow``; under xdist, order the heaviest modules first (stable
    otherwise)."""
    for item in items:
        if CLUSTER_FIXTURES & set(getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.slow)
    if os.environ.get("PYTEST_XDIST_WORKER"):
        rank = {name: index for index, name in enumerate(HEAVIEST_MODULES)}
        items.sort(key=lambda item: rank.get(item.path.name, len(rank)))


def _swap_timer(item: pytest.Item, timeout_s: float) -> None:
    """Replace ``item``'s running pytest-timeout timer with one of ``timeout_s``."""
    hook = item.config.pluginmanager.hook
    hook.pytest_timeout_cancel_timer(item=item)
    hook.pytest_timeout_set_timer(item=item, settings=TimeoutSettings(
        timeout=timeout_s, method=item.config.getini("timeout_method") or "signal",
        func_only=False, disable_debugger_detection=False))


def _own_timeout_s(item: pytest.Item) -> float:
    """The test's own timeout: its ``timeout`` marker, else the ini's."""
    marker = item.get_closest_marker("timeout")
    if marker is not None and (marker.args or "timeout" in marker.kwargs):
        return float(marker.args[0] if marker.args else marker.kwargs["timeout"])
    return float(item.config.getini("timeout"))


@pytest.hookimpl(hookwrapper=True, tryfirst=True)
def pytest_runtest_setup(item: pytest.Item) -> Iterator[None]:
    """A test's setup starts the session's and its module's shared fixtures when it is the first
    to use them (the Ray cluster alone takes 40 s on an idle machine), inside the test's own
    pytest-timeout: a 120 s test that came first on a loaded machine ran out of time in its
    setup. So setup runs under a timer of its own (:data:`SHARED_SETUP_TIMEOUT_S`), and the
    test's own timeout starts afresh for its call and teardown."""
    _swap_timer(item, SHARED_SETUP_TIMEOUT_S)
    yield
    _swap_timer(item, _own_timeout_s(item))


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_teardown(item: pytest.Item, nextitem: pytest.Item | None) -> None:
    """The last test of a process also tears the session's fixtures down, inside its own
    pytest-timeout: a 10 s unit test that came last ran out of time while the session's MLflow
    server stopped (``ERROR at teardown``, seen once on a loaded machine). So before that
    teardown the test's timer is swapped for one of the session teardown's own."""
    if nextitem is None:
        _swap_timer(item, SESSION_TEARDOWN_TIMEOUT_S)


# The SIGINT handler of the test process before anything ran (Python's: KeyboardInterrupt).
_SIGINT_HANDLER = signal.getsignal(signal.SIGINT)


@pytest.fixture(autouse=True)
def _sigint_handler_restored() -> Iterator[None]:
    """Put the session's SIGINT handler back after each test. A ``TorchTrainer.fit()`` in the
    test process installs Ray Train's handler, whose closure holds the run's controller: that
    actor (and the dataset manager it made) lived on, idle, until the next in-process fit. The
    handler restored is the one from before the session, not the one at the test's start: a
    fit in a module fixture (the serving module's model) runs before this fixture's start."""
    yield
    if signal.getsignal(signal.SIGINT) is not _SIGINT_HANDLER:
        signal.signal(signal.SIGINT, _SIGINT_HANDLER)


@pytest.fixture(scope="session")
def session_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("raydeck-session")


@pytest.fixture(scope="session")
def mlflow_server(session_dir: Path) -> Iterator[MlflowServer]:
    """A real MLflow tracking server for the whole session."""
    server = MlflowServer(session_dir / "mlflow").start()
    yield server
    server.stop()


@pytest.fixture(scope="module")
def killable_mlflow(tmp_path_factory: pytest.TempPathFactory) -> Iterator[MlflowServer]:
    """An MLflow server of the module's own, which its tests may kill, freeze and restart (never
    the session's, which every other test shares)."""
    from tests.fixtures.tracking import start_isolated_server  # raydeck's settings: at use

    server = start_isolated_server(tmp_path_factory.mktemp("killable"))
    yield server
    server.stop()


@pytest.fixture(scope="session")
def raydeck_env(session_dir: Path, mlflow_server: MlflowServer) -> Iterator[dict[str, str]]:
    """raydeck's settings for the session, in os.environ (so Ray workers inherit them)."""
    env = {
        **TEST_ENV,
        "RAYDECK_TRACKING_URI": mlflow_server.uri,
        "RAYDECK_DATA_DIR": str(session_dir / "data"),
    }
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    yield env
    for key, value in saved.items():
        if value is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = value


@pytest.fixture(scope="session")
def ray_cluster(raydeck_env: dict[str, str]) -> Iterator[None]:
    """A local Ray instance for the session, started like `raydeck.cluster.connection.connect`
    does."""
    import ray

    from raydeck.cluster.connection import job_runtime_env, starting_ray
    from raydeck.config.settings import load_settings

    # Ray's dashboard writes the Prometheus service-discovery file and Ray's Grafana dashboards
    # (the observability tests read both); metrics export itself works without it.
    # address="local": a cluster of its own, even if `ray start` runs on this machine.
    for attempt in range(RAY_START_ATTEMPTS):
        try:
            # As raydeck's own local Ray starts: its settings and Serve's ingress (HAProxy here)
            # in the processes' environment, no runtime env.
            with starting_ray("local", job_runtime_env(load_settings())) as runtime_env:
                ray.init(address="local", num_cpus=RAY_NUM_CPUS, runtime_env=runtime_env,
                         include_dashboard=True, dashboard_host="127.0.0.1", log_to_driver=True)
            break
        except Exception as exc:
            # Ray gives its raylet 30 s to register, hard-coded; on a machine loaded by other
            # work that is sometimes too short. Nothing of ours has run yet: start again.
            if "timed out during startup" not in str(exc) or attempt == RAY_START_ATTEMPTS - 1:
                raise
            ray.shutdown()
    yield
    ray.shutdown()


@pytest.fixture(scope="session")
def mlflow_client(mlflow_server: MlflowServer):  # type: ignore[no-untyped-def]
    from mlflow.tracking import MlflowClient

    return MlflowClient(tracking_uri=mlflow_server.uri)


@pytest.fixture(scope="session")
def s3_server(session_dir: Path) -> Iterator[S3Server]:
    """A real S3 server (SeaweedFS) for the session; each test uses its own bucket names."""
    server = S3Server(session_dir / "s3").start()
    yield server
    server.stop()


def _prometheus_for_session_ray(root: Path) -> PrometheusServer:
    import ray

    ray_session = Path(ray._private.worker._global_node.get_session_dir_path())
    return for_ray_session(root, ray_session)


@pytest.fixture(scope="module")
def prometheus(ray_cluster: None, tmp_path_factory: pytest.TempPathFactory
               ) -> Iterator[PrometheusServer]:
    """A real Prometheus scraping the session's Ray, configured as `raydeck monitoring config`.

    Loads the committed alert rules, plus TrainingStalled with an 8 s floor instead of 15 min.
    One per module that asks, stopped after it: each 1 s scrape makes Ray's agent render every
    series the session's jobs left (about 15 % of a core, measured), which the rest of the suite
    should not pay for.
    """
    server = _prometheus_for_session_ray(tmp_path_factory.mktemp("prometheus"))
    yield server
    server.stop()


@pytest.fixture
def prometheus_for_one_test(ray_cluster: None, tmp_path: Path) -> Iterator[PrometheusServer]:
    """:func:`prometheus` for one test, for a test that reads only what is exported while it
    runs (Ray's agent keeps every series, so the first scrape has them all): a module-long one
    scraped for minutes that no test read (test_serving: about 40 CPU-s a run)."""
    server = _prometheus_for_session_ray(tmp_path / "prometheus")
    yield server
    server.stop()
