"""The tracker that logs nothing: what ``get_tracker`` returns where nothing should be logged
(tracking disabled, a rank that does not log in ``rank_zero`` mode) and a stand-in in tests.
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from typing import Any

from raydeck.tracking.client.modes import ModePolicy
from raydeck.tracking.client.tracker import Tracker
from raydeck.tracking.messages import LandedReport, Pending, ProcessInfo, RunBinding


class NoOpTracker(Tracker):
    """A tracker whose calls do nothing: tracking disabled, or a rank that must stay silent.

    Jobs never branch on rank or mode: they call the same methods on whatever
    :func:`get_tracker` returns.
    """

    def __init__(self, binding: RunBinding | None = None, process: ProcessInfo | None = None
                 ) -> None:
        self._noop_binding = binding or RunBinding(
            run_key="", params_run_key="", run_id="", experiment="", run_name="",
            mode="rank_zero", shard_index=0, is_primary=False, created=False, resumed=False,
            sample_system=False, active=False,
        )
        self._process = process or ProcessInfo(
            role="disabled", role_key="disabled", job_id=None, node_ip="", hostname="", pid=0
        )
        self._policy = ModePolicy(self._noop_binding.mode, self._process)

    def _binding(self) -> RunBinding:
        return self._noop_binding

    @property
    def run_key(self) -> str:
        return self._noop_binding.run_key

    @property
    def parent_run_key(self) -> str:
        return self._noop_binding.params_run_key

    @property
    def run_id(self) -> str:
        return self._noop_binding.run_id

    @property
    def parent_run_id(self) -> str:
        return self._noop_binding.run_id

    @property
    def experiment_id(self) -> str:
        return ""

    def known_run_id(self) -> str:
        return self._noop_binding.run_id

    @property
    def run_name(self) -> str:
        return self._noop_binding.run_name

    @property
    def active(self) -> bool:
        return False

    def log_metric(self, key: str, value: float, step: int | None = None,
                   synchronous: bool | None = None, timestamp: int | None = None,
                   *, strict: bool = True) -> None:
        return None

    def log_metrics(self, metrics: dict[str, Any], step: int | None = None,
                    synchronous: bool | None = None, timestamp: int | None = None,
                    *, strict: bool = True) -> None:
        return None

    def log_params(self, params: dict[str, Any], synchronous: bool | None = None,
                   *, strict: bool = True) -> None:
        return None

    def set_tags(self, tags: dict[str, Any], synchronous: bool | None = None,
                 *, strict: bool = True) -> None:
        return None

    def log_artifact(self, local_path: str | os.PathLike[str], artifact_path: str | None = None
                     ) -> None:
        return None

    def log_artifacts(self, local_dir: str | os.PathLike[str], artifact_path: str | None = None
                      ) -> None:
        return None

    def _log_file_as(self, write: Any, artifact_file: str) -> None:
        return None

    def log_table(self, data: Any, artifact_file: str) -> None:
        return None

    def log_input(self, dataset: Any, context: str | None = None,
                  tags: dict[str, str] | None = None) -> None:
        return None

    def log_model(self, model: Any, name: str = "model", *, flavor: Any = None,
                  **save_kwargs: Any) -> str:
        return ""

    def latest(self, timeout_s: float = 5.0) -> dict[str, tuple[float, int]]:
        return {}

    def last_steps(self, keys: Iterable[str], timeout_s: float = 60.0) -> dict[str, int]:
        return dict.fromkeys(keys, -1)

    def skip_logged_steps(self, keys: Iterable[str], timeout_s: float = 60.0) -> None:
        return None

    def flush(self, timeout_s: float | None = None) -> None:
        return None

    def finish(self, status: str = "FINISHED", timeout_s: float | None = None,
               wait: bool = True) -> LandedReport:
        return LandedReport(True, Pending())

    def abandon(self) -> None:
        return None

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        return None

    def __repr__(self) -> str:
        return f"NoOpTracker(run_key={self.run_key!r}, rank={self.rank})"
