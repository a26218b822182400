"""How one model is served: :class:`ServeOptions`, validated at construction.

Shared by :mod:`~raydeck.serving.app` (deploys an application built from them) and
:mod:`~raydeck.serving.server` (each replica is constructed with them); neither imports the
other's module for them.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from raydeck.errors import ConfigError
from raydeck.serving.protocol import DEFAULT_MAX_REQUEST_BYTES

if TYPE_CHECKING:
    from raydeck.config.settings import Settings

DEFAULT_PRESET = "cpu-1"
# Ray sets CUDA_VISIBLE_DEVICES (and each other accelerator's variable) only for an actor it
# gives some of that accelerator: a replica given no GPU on a GPU node sees every GPU, and
# MLflow's pytorch flavor loads a model onto CUDA whenever the process sees one, so a CPU
# replica would predict on a GPU that Ray counts as free (and that GPU replicas were given).
# Ray's own switch, set in each replica's environment, makes Ray hide what it did not assign.
HIDE_UNASSIGNED_ACCELERATORS = {"RAY_ACCEL_ENV_VAR_OVERRIDE_ON_ZERO": "1"}
_APP_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.\-]{0,63}$")


@dataclass(frozen=True)
class ServeOptions:
    """How one model is served.

    Attributes:
        model_uri: ``models:/name@alias`` (followed: replicas switch when the alias moves),
            ``models:/name/3`` or ``runs:/<run id>/model``.
        name: Serve application name (default: the model's name, or ``model`` for a run).
        preset: scaling preset: replicas = its workers, each with its CPUs/GPUs (fractional
            GPUs pack replicas onto one GPU, e.g. ``gpu-quarter``). A replica sees exactly the
            GPUs Ray gave it, none for a preset without GPUs.
        min_replicas, max_replicas: Serve autoscaling between these (both set), starting at the
            preset's count; unset: a fixed number of replicas.
        target_ongoing_requests: autoscaling's target of in-flight requests per replica.
        max_batch_size: requests predicted together (1 turns batching off).
        batch_wait_timeout_s: how long a batch waits to fill. The default, 0, batches
            adaptively: a request that finds its replica idle is predicted at once, and the
            requests that queue behind a running prediction form the next batch.
        max_ongoing_requests: requests one replica holds at once (at least max_batch_size).
        poll_interval_s: how often replicas check the alias.
        max_request_bytes: larger request bodies get a 400.
        route_prefix: HTTP path of the application.
        host, port: where Serve's HTTP proxy listens (set once per cluster).
    """

    model_uri: str
    name: str = ""
    preset: str = DEFAULT_PRESET
    min_replicas: int | None = None
    max_replicas: int | None = None
    target_ongoing_requests: float = 8.0
    max_batch_size: int = 32
    batch_wait_timeout_s: float = 0.0
    max_ongoing_requests: int = 64
    poll_interval_s: float = 10.0
    max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES
    route_prefix: str = "/"
    host: str = "127.0.0.1"
    port: int = 8000

    def __post_init__(self) -> None:
        if not self.name:
            object.__setattr__(self, "name", _default_name(self.model_uri))
        if not _APP_NAME.match(self.name):
            raise ConfigError(f"--name {self.name!r}: use 1-64 letters, digits, _ . -")
        if not 1 <= self.max_batch_size <= 4096:
            raise ConfigError(f"--max-batch-size={self.max_batch_size}: must be 1-4096 "
                              "(1 turns batching off)")
        if not 0 <= self.batch_wait_timeout_s <= 10:
            raise ConfigError(f"--batch-wait-ms={self.batch_wait_timeout_s * 1000:g}: must be "
                              "0-10000")
        if self.max_ongoing_requests < self.max_batch_size:
            raise ConfigError(f"--max-ongoing-requests={self.max_ongoing_requests}: must be at "
                              f"least --max-batch-size ({self.max_batch_size}), or batches "
                              "never fill")
        if (self.min_replicas is None) != (self.max_replicas is None):
            raise ConfigError("--autoscale: give both bounds, as MIN:MAX (e.g. 1:4)")
        if self.min_replicas is not None and self.max_replicas is not None and not (
                0 <= self.min_replicas <= self.max_replicas and self.max_replicas >= 1):
            raise ConfigError(f"--autoscale {self.min_replicas}:{self.max_replicas}: need "
                              "0 <= MIN <= MAX and MAX >= 1")
        if self.target_ongoing_requests <= 0:
            raise ConfigError("--target-ongoing-requests: must be > 0")
        if not 0.1 <= self.poll_interval_s <= 3600:
            raise ConfigError(f"--poll-interval={self.poll_interval_s}: must be 0.1-3600 s")
        if self.max_request_bytes < 1024:
            raise ConfigError(f"--max-request-bytes={self.max_request_bytes}: must be >= 1024")
        if not self.route_prefix.startswith("/"):
            raise ConfigError(f"--route-prefix {self.route_prefix!r}: must start with /")
        if not 1 <= self.port <= 65535:
            raise ConfigError(f"--port={self.port}: must be 1-65535")

    @property
    def follows_alias(self) -> bool:
        return "@" in self.model_uri

    @property
    def url(self) -> str:
        host = "127.0.0.1" if self.host in ("0.0.0.0", "::") else self.host
        return f"http://{host}:{self.port}{self.route_prefix.rstrip('/')}"

    def user_config(self) -> dict[str, Any]:
        """What replicas change in place (Serve's ``reconfigure``), without a restart."""
        return {"max_batch_size": self.max_batch_size,
                "batch_wait_timeout_s": self.batch_wait_timeout_s}

    def deployment_options(self, settings: Settings) -> dict[str, Any]:
        """Replicas, their resources and autoscaling, from the preset and the bounds."""
        from raydeck.train.presets import get_preset

        preset = get_preset(self.preset, settings.presets_file)
        actor_options: dict[str, Any] = {
            "num_cpus": preset.cpus_per_worker,
            # Merged by Serve with the application's runtime env (env_vars are combined).
            "runtime_env": {"env_vars": dict(HIDE_UNASSIGNED_ACCELERATORS)},
        }
        if preset.gpus_per_worker:
            actor_options["num_gpus"] = preset.gpus_per_worker
        if preset.memory_per_worker_gb:
            actor_options["memory"] = int(preset.memory_per_worker_gb * 1024**3)
        options: dict[str, Any] = {
            "ray_actor_options": actor_options,
            "max_ongoing_requests": self.max_ongoing_requests,
            "user_config": self.user_config(),
        }
        if self.min_replicas is None:
            options["num_replicas"] = preset.max_workers
        else:
            assert self.max_replicas is not None
            options["autoscaling_config"] = {
                "min_replicas": self.min_replicas, "max_replicas": self.max_replicas,
                "initial_replicas": min(max(preset.max_workers, self.min_replicas),
                                        self.max_replicas),
                "target_ongoing_requests": self.target_ongoing_requests,
            }
        return options


def _default_name(model_uri: str) -> str:
    match = re.match(r"^models:/([^/@]+)", model_uri)
    name = re.sub(r"[^A-Za-z0-9_.\-]", "-", match.group(1)) if match else "model"
    return name[:64]
