"""Trained models in MLflow's format, self-contained, and their versions in MLflow's registry.

Owns: saving a torch module as an MLflow model that carries its own input preprocessing
(:class:`Standardized`), a signature and an input example, so
``mlflow.pyfunc.load_model(uri).predict(raw_rows)`` gives the run's accuracy on raw data with no
knowledge of the training job; registering a run's model with tags that point back to the run
(:func:`register_run_model`); and reading or moving the registry's aliases
(:func:`resolve_model_uri`, :func:`promote`). Does not own: serving (:mod:`raydeck.serving`).
"""

from __future__ import annotations

import json
import logging
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from raydeck._internal.pytorch_flavor import import_pytorch_flavor
from raydeck.errors import ConfigError, StorageError

MODEL_ARTIFACT_PATH = "model"
RUN_TAG = "raydeck.run_id"
COMMIT_TAG = "raydeck.git_commit"
METRIC_TAG_PREFIX = "raydeck.metric."
# `models:/name@alias`, `models:/name/3`, `runs:/<run id>/<path>`: the URIs MLflow loads.
_MODELS_URI = re.compile(r"^models:/(?P<name>[^/@]+)(?:@(?P<alias>[^/]+)|/(?P<version>\d+))$")
_RUNS_URI = re.compile(r"^runs:/(?P<run_id>[0-9a-zA-Z]+)/(?P<path>.+)$")
URI_FORMS = "models:/NAME@ALIAS, models:/NAME/VERSION or runs:/RUN_ID/model"
_MODEL_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.\-]{0,127}$")


def check_model_name(name: str) -> str:
    """``name`` if it can be a registered model name that every model URI form can carry.

    Raises:
        ConfigError: naming the option and the characters allowed; before anything runs.
    """
    if not _MODEL_NAME.match(name):
        raise ConfigError(f"--register-as {name!r}: use 1-128 letters, digits, _ . - "
                          "(it becomes models:/NAME/VERSION)")
    return name


class Standardized(nn.Module):
    """A model that takes raw inputs: ``model((x - mean) / std)``, the training job's own scaling.

    Why inside the model: a logged model without its preprocessing silently scores worse on the
    data users have (the digits job's model scored 0.87 on raw rows against 0.96 in its run).
    ``mean`` and ``std`` are buffers, so they travel in the state dict and move with ``.to()``;
    inputs of any float or int dtype are cast to the buffers' dtype (float32), integers only when
    it holds them exactly (a digit decoded from an image is integers; a cast that changed one
    would score a different image).
    """

    def __init__(self, model: nn.Module, mean: Any, std: Any) -> None:
        super().__init__()
        self.model = model
        self.register_buffer("mean", torch.as_tensor(mean, dtype=torch.float32))
        self.register_buffer("std", torch.as_tensor(std, dtype=torch.float32))

    mean: torch.Tensor
    std: torch.Tensor

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """The network's answer for raw rows ``x``.

        Raises:
            TypeError: ``x`` is boolean or complex: not pixel values.
            ValueError: an integer of ``x`` that the network's float dtype cannot hold exactly.
        """
        dtype = self.mean.dtype
        if x.dtype == torch.bool or x.is_complex():
            raise TypeError(f"inputs of dtype {x.dtype} are not pixel values; send integers or "
                            "floats")
        cast = x.to(dtype)
        if not x.is_floating_point():
            changed = cast.to(x.dtype) != x
            if bool(changed.any()):
                value = x[changed][0].item()
                raise ValueError(f"input value {value} cannot be held exactly by {dtype}, the "
                                 "network's dtype")
        return self.model((cast - self.mean) / self.std)


def save_torch_model(model: Any, directory: Path, input_example: Any | None = None) -> Path:
    """Save a torch module in MLflow's pytorch flavor under ``directory/model``.

    The module should take the raw inputs users have (wrap it in :class:`Standardized` when
    training scales them); ``input_example`` (a few raw rows) gives the model its signature,
    which :mod:`raydeck.serving` validates requests against, and the example Serve replicas
    health-check a new version with. The pickle format keeps saving fast (the module's class must
    be importable where it is loaded). Pinning the requirements skips MLflow's requirement
    inference, which imports the world.

    Returns:
        The model directory, ready for ``tracker.log_artifact`` or ``log_artifacts``.
    """
    mlflow_pytorch = import_pytorch_flavor()  # without Lightning's import, when unused
    target = directory / MODEL_ARTIFACT_PATH
    # MLflow warns on every pickle save; the choice is deliberate (see above), so say it once
    # here instead of in every job log.
    mlflow_logger = logging.getLogger("mlflow.pytorch")
    level = mlflow_logger.level
    mlflow_logger.setLevel(logging.ERROR)
    try:
        mlflow_pytorch.save_model(
            model.eval(), str(target), serialization_format="pickle",
            input_example=input_example,
            pip_requirements=[f"torch=={torch.__version__.split('+')[0]}"],
        )
    finally:
        mlflow_logger.setLevel(level)
    return target


@dataclass(frozen=True)
class ModelRef:
    """A model URI resolved against the registry: what a server loads and reports."""

    uri: str
    name: str | None
    version: str | None
    alias: str | None
    run_id: str | None

    @property
    def pinned_uri(self) -> str:
        """The URI of exactly this version (an alias may move on)."""
        if self.name and self.version:
            return f"models:/{self.name}/{self.version}"
        return self.uri


def resolve_model_uri(uri: str, tracking_uri: str) -> ModelRef:
    """Check that ``uri`` names a model that exists, and say which version it is now.

    Raises:
        ConfigError: a malformed URI, or a model, version, alias or run that does not exist
            (one line naming it and the forms accepted).
        StorageError: a ``runs:/`` URI whose run's artifacts this process cannot read.
    """
    from mlflow.exceptions import MlflowException
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri)
    models, runs = _MODELS_URI.match(uri), _RUNS_URI.match(uri)
    try:
        if models:
            name, alias = models.group("name"), models.group("alias")
            version = (client.get_model_version_by_alias(name, alias) if alias
                       else client.get_model_version(name, models.group("version")))
            return ModelRef(uri, name, str(version.version), alias, version.run_id)
        if runs:
            run_id, path = runs.group("run_id"), runs.group("path").strip("/")
            run = client.get_run(run_id)
            files = {Path(a.path).name for a in _list_artifacts(client, run, path)}
            if "MLmodel" not in files:
                raise ConfigError(f"model URI {uri!r}: run {run_id} has no MLflow model at "
                                  f"{path!r}; use {URI_FORMS}")
            return ModelRef(uri, None, None, None, run_id)
    except MlflowException as exc:
        first = str(exc.message).splitlines()[0] if exc.message else type(exc).__name__
        raise ConfigError(f"model URI {uri!r} does not exist ({first}); "
                          "`raydeck models list` shows the registered models") from None
    raise ConfigError(f"model URI {uri!r} is not one of {URI_FORMS}")


def _list_artifacts(client: Any, run: Any, path: str) -> list[Any]:
    """The run's artifacts under ``path``.

    Raises:
        StorageError: the run's artifact store cannot be read from this process (no or wrong
            S3 credentials, an unreachable endpoint): one line with the store and the fix,
            instead of the storage library's traceback.
    """
    from mlflow.exceptions import MlflowException

    try:
        return list(client.list_artifacts(run.info.run_id, path))
    except MlflowException:
        raise
    except Exception as exc:
        first = (str(exc).splitlines() or [""])[0]
        raise StorageError(
            f"cannot read the artifacts of run {run.info.run_id} at {run.info.artifact_uri} "
            f"({type(exc).__name__}: {first}); this process needs the artifact store's "
            "credentials: set [storage] in raydeck.toml or RAYDECK_S3_* (the machine that ran "
            "`raydeck up` has them), or serve artifacts through the MLflow server "
            "(`mlflow server --serve-artifacts`)") from None


def register_run_model(tracking_uri: str, run_id: str, name: str,
                       metric: str | None = None) -> ModelRef:
    """Register the ``model`` artifact of run ``run_id`` as a new version of ``name``.

    The version's tags point back to where it came from: the run, its git commit (the run's
    ``mlflow.source.git.commit``) and, with ``metric``, the run's final value of it (rank 0's
    in ``all_ranks`` mode), so ``raydeck models show`` answers "which run, which code, how
    good" without opening the run.

    Raises:
        ConfigError: the run logged no model, or ``name`` is not a valid model name.
    """
    import mlflow
    from mlflow.exceptions import MlflowException
    from mlflow.tracking import MlflowClient

    check_model_name(name)
    client = MlflowClient(tracking_uri)
    source = f"runs:/{run_id}/{MODEL_ARTIFACT_PATH}"
    resolve_model_uri(source, tracking_uri)
    run = client.get_run(run_id)
    tags = {RUN_TAG: run_id}
    commit = run.data.tags.get("mlflow.source.git.commit")
    if commit:
        tags[COMMIT_TAG] = commit
    # A run tracked in all_ranks mode holds each rank's value as `<metric>/rank_<n>`: rank 0's.
    value = run.data.metrics.get(metric, run.data.metrics.get(f"{metric}/rank_0")) \
        if metric else None
    if metric and value is not None:
        tags[METRIC_TAG_PREFIX + metric] = json.dumps(value)
    previous = mlflow.get_tracking_uri()
    mlflow.set_tracking_uri(tracking_uri)
    try:
        version = mlflow.register_model(source, name, tags=tags)
    except MlflowException as exc:
        raise ConfigError(f"--register-as {name!r}: {str(exc.message).splitlines()[0]}") from None
    finally:
        mlflow.set_tracking_uri(previous)
    return ModelRef(f"models:/{name}/{version.version}", name, str(version.version), None,
                    run_id)


def promote(tracking_uri: str, name: str, version: str, alias: str) -> None:
    """Point ``alias`` of model ``name`` at ``version`` (MLflow's aliases, not the deprecated
    stages); servers that follow the alias switch to it.

    Raises:
        ConfigError: the model or version does not exist.
    """
    from mlflow.exceptions import MlflowException
    from mlflow.tracking import MlflowClient

    if not version.isdigit():
        raise ConfigError(f"version {version!r}: give a version number (`raydeck models show "
                          f"{name}` lists them)")
    resolve_model_uri(f"models:/{name}/{version}", tracking_uri)
    try:
        MlflowClient(tracking_uri).set_registered_model_alias(name, alias, version)
    except MlflowException as exc:
        raise ConfigError(f"--alias {alias!r}: {str(exc.message).splitlines()[0]}") from None
