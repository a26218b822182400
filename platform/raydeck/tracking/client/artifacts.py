"""Rich values as artifact files, in the formats MLflow itself writes.

Owns: turning a figure, an image, a table or a model into local files named as MLflow names
them, so the MLflow UI shows what a tracker logged exactly as if ``mlflow.log_*`` had logged it
(image charts, table views, model pages). The tracker then logs those files through the proxy.
Does not own: delivery (the tracker and its shard).
"""

from __future__ import annotations

import json
import re
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

from raydeck._internal.pytorch_flavor import FLAVOR, import_pytorch_flavor
from raydeck.errors import TrackingValidationError

_IMAGE_KEY = re.compile(r"^[a-zA-Z0-9_\-./ ]+$")


def write_figure(figure: Any, path: Path, save_kwargs: dict[str, Any] | None) -> None:
    """Save a matplotlib figure (any format it knows) or a plotly figure (.html or image)."""
    kwargs = dict(save_kwargs or {})
    module = type(figure).__module__
    if hasattr(figure, "savefig"):
        figure.savefig(path, **kwargs)
    elif module.startswith("plotly"):
        if path.suffix == ".html":
            kwargs.setdefault("include_plotlyjs", "cdn")
            kwargs.setdefault("auto_open", False)
            figure.write_html(str(path), **kwargs)
        else:
            figure.write_image(str(path), **kwargs)
    else:
        raise TrackingValidationError({path.name: (
            f"log_figure takes a matplotlib or plotly figure, got {type(figure).__name__}")})


def _pil(image: Any) -> Any:
    """``image`` as a PIL image, converted as MLflow converts numpy arrays."""
    import numpy as np

    if isinstance(image, np.ndarray):
        from mlflow.tracking.multimedia import convert_to_pil_image

        return convert_to_pil_image(image)
    if hasattr(image, "to_pil"):
        return image.to_pil()
    import PIL.Image

    if isinstance(image, PIL.Image.Image):
        return image
    raise TrackingValidationError({"image": (
        f"log_image takes a numpy array, a PIL image or an mlflow.Image, got "
        f"{type(image).__name__}")})


def image_files(image: Any, artifact_file: str | None, key: str | None, step: int | None,
                timestamp: int | None) -> list[tuple[str, Callable[[Path], None]]]:
    """``(artifact file, writer)`` pairs for one ``log_image`` call, named as MLflow names them.

    With ``key``: the full image and a compressed copy under ``images/``, which the MLflow UI
    shows as a step-indexed image chart.
    """
    if (artifact_file is None) == (key is None):
        raise TrackingValidationError({"image": (
            "pass exactly one of artifact_file (a static image) or key (with step: an image "
            "chart)")})
    picture = _pil(image)
    if artifact_file is not None:
        return [(artifact_file, lambda path: picture.save(path))]
    assert key is not None
    if not _IMAGE_KEY.match(key):
        raise TrackingValidationError({key: (
            "image keys may only hold letters, digits, _ - . / and spaces")})
    from mlflow.tracking.multimedia import compress_image_size

    stamp = timestamp or int(time.time() * 1000)
    stem = (f"images/{key.replace('/', '~')}+step+{step or 0}+timestamp+{stamp}+"
            f"{uuid.uuid4()}")
    small = compress_image_size(picture)
    return [(f"{stem}.png", lambda path: picture.save(path)),
            (f"{stem}+compressed.webp", lambda path: small.save(path))]


def table_frame(data: Any, previous: Any | None) -> Any:
    """``data`` (dict of columns or DataFrame) as a DataFrame, appended to ``previous``."""
    import pandas as pd

    if isinstance(data, dict):
        try:
            frame = pd.DataFrame(data)
        except ValueError:
            frame = pd.DataFrame([data])
    elif isinstance(data, pd.DataFrame):
        frame = data
    else:
        raise TrackingValidationError({"data": (
            f"log_table takes a dict of columns or a pandas DataFrame, got {type(data).__name__}")})
    return frame if previous is None else pd.concat([previous, frame], ignore_index=True)


def write_table(frame: Any, path: Path) -> None:
    if path.suffix == ".json":
        frame.to_json(path, orient="split", index=False, date_format="iso")
    elif path.suffix == ".parquet":
        frame.to_parquet(path, index=False)
    else:
        raise TrackingValidationError({path.name: "table files must end in .json or .parquet"})


def logged_artifacts_tag(paths: list[str]) -> str:
    """MLflow's ``mlflow.loggedArtifacts`` tag value listing these tables."""
    return json.dumps([{"path": p, "type": "table"} for p in paths])


def save_model(model: Any, directory: Path, flavor: Any, save_kwargs: dict[str, Any]) -> Path:
    """Save ``model`` as an MLflow model in ``directory`` with ``flavor.save_model``.

    ``flavor`` is an MLflow flavor module or its name (``"pytorch"``); None infers it: a torch
    module -> pytorch, an ``mlflow.pyfunc.PythonModel`` -> pyfunc, anything else -> sklearn.
    """
    import importlib

    if flavor is None:
        flavor = _infer_flavor(model)
    if isinstance(flavor, str):
        name = f"mlflow.{flavor}"
        flavor = import_pytorch_flavor() if name == FLAVOR else importlib.import_module(name)
    if flavor.__name__ == "mlflow.pyfunc" and "python_model" not in save_kwargs:
        save_kwargs = {**save_kwargs, "python_model": model}
        flavor.save_model(str(directory), **save_kwargs)
    else:
        flavor.save_model(model, str(directory), **save_kwargs)
    return directory


def _infer_flavor(model: Any) -> str:
    module = type(model).__module__
    if module.startswith("torch") or any(
            c.__module__.startswith("torch.nn") for c in type(model).__mro__):
        return "pytorch"
    import mlflow.pyfunc

    return "pyfunc" if isinstance(model, mlflow.pyfunc.PythonModel) else "sklearn"
