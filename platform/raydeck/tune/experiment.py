"""Where a sweep's state lives: its Tune experiment directory, local or in the checkpoint bucket.

Owns: the location of a sweep's Tune experiment (Tune's state for ``--resume``, every trial's
checkpoints and results), whether one exists, and the sweep's own settings stored beside it so
``--resume`` runs the sweep as it was started. With object storage configured the experiment
lives in the checkpoint bucket (``s3://<bucket>/<prefix>/sweeps/<name>``), reached with the same
credentialed filesystem as training jobs' checkpoints: trials run on any node, and a sweep can
be resumed from any machine that reaches the bucket. Without it, ``<data_dir>/sweeps/<name>`` on
the driver's machine (one-machine clusters).

Tune writes its experiment state with pickle; raydeck's S3 filesystem pickles without the
secret there (:class:`raydeck.storage.RetryingS3FileSystem`), so no credential lands in the
bucket.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass, field
from typing import Any

import pyarrow.fs

from raydeck.config.settings import Settings
from raydeck.tune.config import SweepConfig

logger = logging.getLogger(__name__)

SWEEPS_DIR = "sweeps"
SWEEP_CONFIG_FILE = "raydeck_sweep.json"
_TUNER_FILE = "tuner.pkl"


@dataclass(frozen=True)
class SweepStorage:
    """The directory holding every sweep's Tune experiment.

    ``storage_path`` is relative to ``filesystem`` when one is set (pyarrow's convention, what
    Tune's ``RunConfig`` takes); ``uri`` is the same place as a user reads it.
    """

    storage_path: str
    uri: str
    filesystem: pyarrow.fs.FileSystem | None = field(default=None, repr=False, compare=False)

    @property
    def _fs(self) -> pyarrow.fs.FileSystem:
        return self.filesystem or pyarrow.fs.LocalFileSystem()

    def experiment_path(self, name: str) -> str:
        """The sweep's experiment directory, as Tune's ``Tuner.restore`` takes it."""
        return f"{self.storage_path.rstrip('/')}/{name}"

    def experiment_uri(self, name: str) -> str:
        return f"{self.uri.rstrip('/')}/{name}"

    def exists(self, name: str) -> bool:
        """Whether a sweep called ``name`` was started here (Tune wrote its tuner file)."""
        info = self._fs.get_file_info(f"{self.experiment_path(name)}/{_TUNER_FILE}")
        return bool(info.type != pyarrow.fs.FileType.NotFound)

    def save_config(self, config: SweepConfig) -> None:
        path = self.experiment_path(config.name)
        self._fs.create_dir(path, recursive=True)
        with self._fs.open_output_stream(f"{path}/{SWEEP_CONFIG_FILE}") as stream:
            stream.write(json.dumps(config.to_dict(), indent=2).encode())

    def load_config(self, name: str) -> SweepConfig | None:
        """The settings the sweep was started with (None if it stored none)."""
        try:
            with self._fs.open_input_stream(f"{self.experiment_path(name)}/{SWEEP_CONFIG_FILE}"
                                            ) as stream:
                return SweepConfig.from_dict(json.loads(stream.read()))
        except FileNotFoundError:
            return None

    def run_config_kwargs(self) -> dict[str, Any]:
        """``storage_path`` and ``storage_filesystem`` for Tune's ``RunConfig``."""
        return {"storage_path": self.storage_path, "storage_filesystem": self.filesystem}


def sweep_storage(settings: Settings) -> SweepStorage:
    """The checkpoint bucket's ``sweeps/`` folder when storage is configured, else
    ``<data_dir>/sweeps``.

    Raises:
        StorageError: storage is configured but this process lacks the secret.
    """
    from raydeck.storage import checkpoint_storage

    if not settings.storage.configured:
        local = str(settings.data_dir / SWEEPS_DIR)
        return SweepStorage(storage_path=local, uri=local)
    checkpoints = checkpoint_storage(settings)
    return SweepStorage(
        storage_path=f"{checkpoints.storage_path.rstrip('/')}/{SWEEPS_DIR}",
        uri=f"{checkpoints.uri.rstrip('/')}/{SWEEPS_DIR}",
        filesystem=checkpoints.filesystem,
    )


def sweep_storage_path(settings: Settings) -> str:
    """Where sweeps keep their state, as a URI a user reads (``s3://...`` or a directory)."""
    return sweep_storage(settings).uri
