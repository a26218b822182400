"""The tracker's artifacts and model logging (part of
:class:`~raydeck.tracking.client.tracker.Tracker`).

Owns: :class:`ArtifactLogging`, ``log_artifact(s)``, ``log_dict``, ``log_text``,
``log_figure``, ``log_image``, ``log_table``, ``log_input`` and ``log_model`` with MLflow's
names and arguments: files are staged now and streamed to the proxy by the tracker's delivery.
Turning rich values into files is :mod:`raydeck.tracking.client.artifacts`.
"""

from __future__ import annotations

import json
import logging
import os
import posixpath
import tempfile
import threading
from pathlib import Path
from typing import TYPE_CHECKING, Any

from raydeck.errors import TrackingValidationError
from raydeck.tracking.client import validation
from raydeck.tracking.client.delivery import Delivery
from raydeck.tracking.messages import DatasetRef

logger = logging.getLogger(__name__)


class ArtifactLogging:
    """Mixin of :class:`~raydeck.tracking.client.tracker.Tracker`: files, rich values and models."""

    _lock: threading.RLock
    _next_step: int
    _tables: dict[str, Any]

    if TYPE_CHECKING:
        @property
        def _delivery(self) -> Delivery: ...

        @property
        def run_id(self) -> str: ...

        def flush(self, timeout_s: float | None = None) -> None: ...

        def set_tags(self, tags: dict[str, Any], synchronous: bool | None = None,
                     *, strict: bool = True) -> None: ...

    def log_artifact(self, local_path: str | os.PathLike[str], artifact_path: str | None = None
                     ) -> None:
        """Log a file (or a directory, under its own name) as MLflow's ``log_artifact`` does.

        ``local_path`` is resolved first (``"."`` is the current directory, by its name). The
        bytes are copied to a staging file now, so the file may change after the call returns,
        and streamed to the proxy in chunks: an unreachable artifact store delays the upload,
        never fails it.

        Raises:
            TrackingValidationError: the path does not exist or ``artifact_path`` is illegal.
        """
        path = Path(local_path).expanduser().resolve()
        problem = validation.artifact_dir_problem(artifact_path)
        if problem is None and not path.exists():
            problem = f"no such file or directory: {path}"
        if problem is None and not path.name:
            problem = "cannot log the file system root; name a file or directory"
        if problem:
            raise TrackingValidationError({str(local_path): problem})
        base = posixpath.normpath(artifact_path).strip("/") if artifact_path else ""
        if path.is_dir():
            self._log_tree(path, posixpath.join(base, path.name) if base else path.name)
        else:
            self._delivery.add_file(path, base, path.name)

    def log_artifacts(self, local_dir: str | os.PathLike[str], artifact_path: str | None = None
                      ) -> None:
        """Log a directory's contents under ``artifact_path`` (MLflow's ``log_artifacts``).

        Raises:
            TrackingValidationError: not a directory, or ``artifact_path`` is illegal.
        """
        path = Path(local_dir).expanduser().resolve()
        problem = validation.artifact_dir_problem(artifact_path)
        if problem is None and not path.is_dir():
            problem = f"not a directory: {path}"
        if problem:
            raise TrackingValidationError({str(local_dir): problem})
        self._log_tree(path, posixpath.normpath(artifact_path).strip("/") if artifact_path
                       else "")

    def _log_tree(self, root: Path, base: str) -> None:
        for folder, _dirs, files in os.walk(root):
            relative = Path(folder).relative_to(root).as_posix()
            directory = base if relative == "." else posixpath.join(base, relative) if base \
                else relative
            for name in sorted(files):
                file = Path(folder) / name
                if file.is_file():
                    self._delivery.add_file(file, directory, name)

    def _log_file_as(self, write: Any, artifact_file: str) -> None:
        """Write a file with ``write(path)`` and log it at ``artifact_file``."""
        problem = validation.artifact_file_problem(artifact_file)
        if problem:
            raise TrackingValidationError({str(artifact_file): problem})
        directory, name = posixpath.split(posixpath.normpath(artifact_file).strip("/"))
        with tempfile.TemporaryDirectory(prefix="raydeck-artifact-") as tmp:
            path = Path(tmp) / name
            write(path)
            self._delivery.add_file(path, directory, name)

    def log_dict(self, dictionary: dict[str, Any], artifact_file: str) -> None:
        """Log a dict as a JSON (or YAML, by extension) artifact file."""
        if artifact_file.endswith((".yaml", ".yml")):
            import yaml

            text = yaml.safe_dump(dictionary, sort_keys=False)
        else:
            text = json.dumps(dictionary, indent=2, default=str)
        self.log_text(text, artifact_file)

    def log_text(self, text: str, artifact_file: str) -> None:
        """Log a string as an artifact file at ``artifact_file`` (e.g. ``notes/run.md``)."""
        self._log_file_as(lambda path: path.write_text(text, encoding="utf-8"), artifact_file)

    def log_figure(self, figure: Any, artifact_file: str, *,
                   save_kwargs: dict[str, Any] | None = None) -> None:
        """Log a matplotlib or plotly figure (as MLflow's ``log_figure``), from any rank."""
        from raydeck.tracking.client.artifacts import write_figure

        self._log_file_as(lambda path: write_figure(figure, path, save_kwargs), artifact_file)

    def log_image(self, image: Any, artifact_file: str | None = None, key: str | None = None,
                  step: int | None = None, timestamp: int | None = None,
                  synchronous: bool | None = None) -> None:
        """Log an image (numpy array, PIL image or ``mlflow.Image``) as MLflow does: at
        ``artifact_file``, or with ``key`` and ``step`` as a step-indexed image the MLflow UI
        shows in its image charts (``images/<key>+step+<step>+...``)."""
        from raydeck.tracking.client.artifacts import image_files

        with self._lock:
            if step is None and key is not None:
                step = max(0, self._next_step - 1)
        for artifact, write in image_files(image, artifact_file, key, step, timestamp):
            self._log_file_as(write, artifact)
        if key is not None:
            self.set_tags({"mlflow.loggedImages": "true"})
        if synchronous:
            self.flush()

    def log_table(self, data: Any, artifact_file: str) -> None:
        """Log a table (dict of columns or pandas DataFrame) as MLflow does, ``.json`` or
        ``.parquet``. Calls with the same ``artifact_file`` in this process append rows."""
        from raydeck.tracking.client.artifacts import logged_artifacts_tag, table_frame, write_table

        with self._lock:
            frame = table_frame(data, self._tables.get(artifact_file))
            self._tables[artifact_file] = frame
            paths = sorted(self._tables)
        self._log_file_as(lambda path: write_table(frame, path), artifact_file)
        self.set_tags({"mlflow.loggedArtifacts": logged_artifacts_tag(paths)})

    def log_input(self, dataset: Any, context: str | None = None,
                  tags: dict[str, str] | None = None) -> None:
        """Record a dataset the run used in MLflow's dataset tables (name, digest, source,
        schema), as ``mlflow.log_input`` does. ``dataset`` is an ``mlflow.data`` dataset."""
        entity = dataset._to_mlflow_entity()
        self._delivery.add_input(DatasetRef(
            name=entity.name, digest=entity.digest, source_type=entity.source_type,
            source=entity.source, schema=entity.schema or "", profile=entity.profile or "",
            context=context or "", tags=dict(tags or {})))

    def log_model(self, model: Any, name: str = "model", *, flavor: Any = None,
                  **save_kwargs: Any) -> str:
        """Log an MLflow model of ``model`` under ``name`` through the proxy.

        The model is saved locally with ``flavor.save_model`` (inferred when None: a torch
        module -> ``mlflow.pytorch``, an ``mlflow.pyfunc.PythonModel`` -> ``mlflow.pyfunc``,
        else ``mlflow.sklearn``) and its files are logged as artifacts. Returns the model's URI
        (``runs:/<run id>/<name>``) for ``mlflow.register_model``.
        """
        from raydeck.tracking.client.artifacts import save_model

        with tempfile.TemporaryDirectory(prefix="raydeck-model-") as tmp:
            directory = save_model(model, Path(tmp) / "model", flavor, save_kwargs)
            self.log_artifacts(directory, name)
        return f"runs:/{self.run_id}/{name}"
