"""A model raydeck logs takes the rows users have: raw pixels as float64, float32 or integers,
as arrays or DataFrames, through MLflow's own loaders, and answers what its network answers.

The model is saved with :func:`raydeck.models.save_torch_model` in a temporary directory (what
every job logs as its run's ``model`` artifact), so no tracking server or cluster is needed.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from raydeck.models import Standardized, save_torch_model

PIXELS = np.array([[0, 3, 16, 7], [16, 0, 1, 12]])


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, np.ndarray]:
    """A saved 4-pixel model and what its network answers for :data:`PIXELS`."""
    torch.manual_seed(0)
    model = Standardized(torch.nn.Linear(4, 3), mean=[8.0] * 4, std=[4.0] * 4)
    expected = model(torch.as_tensor(PIXELS, dtype=torch.float32)).detach().numpy()
    return save_torch_model(model, tmp_path_factory.mktemp("model"),
                            PIXELS.astype(np.float64)), expected


@pytest.mark.timeout(120)
def test_the_signature_says_rows_of_raw_pixels_as_float64(saved: tuple[Path, np.ndarray]) -> None:
    import mlflow.pyfunc

    schema = mlflow.pyfunc.load_model(str(saved[0])).metadata.get_input_schema()
    assert str(schema) == "[Tensor('float64', (-1, 4))]"


@pytest.mark.timeout(120)
def test_mlflow_pyfunc_predicts_float64_rows_and_dataframes(
        saved: tuple[Path, np.ndarray]) -> None:
    import mlflow.pyfunc
    import pandas as pd

    model = mlflow.pyfunc.load_model(str(saved[0]))
    for rows in (PIXELS.astype(np.float64), pd.DataFrame(PIXELS.astype(np.float64))):
        np.testing.assert_allclose(np.asarray(model.predict(rows)), saved[1], rtol=1e-6)


@pytest.mark.timeout(120)
def test_mlflow_pyfunc_refuses_other_dtypes_by_the_signature_and_pytorch_takes_them(
        saved: tuple[Path, np.ndarray]) -> None:
    """MLflow 3.17's schema enforcement takes exactly a tensor signature's dtype (its
    ``_enforce_tensor_spec``; no signature type takes int64 and float64 both), so
    ``mlflow.pyfunc`` refuses integer and float32 rows with its own message; MLflow's pytorch
    loader hands the module itself, which casts any integer or float input."""
    import mlflow.pyfunc
    import mlflow.pytorch
    import pandas as pd
    from mlflow.exceptions import MlflowException

    model = mlflow.pyfunc.load_model(str(saved[0]))
    for rows in (PIXELS, PIXELS.astype(np.float32), pd.DataFrame(PIXELS)):
        with pytest.raises(MlflowException, match="does not match expected dtype float64"):
            model.predict(rows)
    module = mlflow.pytorch.load_model(str(saved[0]))
    for dtype in (np.int64, np.uint8, np.float32, np.float64):
        answer = module(torch.as_tensor(PIXELS.astype(dtype))).detach().numpy()
        np.testing.assert_allclose(answer, saved[1], rtol=1e-6)


@pytest.mark.timeout(120)
def test_integers_the_network_cannot_hold_exactly_are_refused(
        saved: tuple[Path, np.ndarray]) -> None:
    import mlflow.pytorch

    module = mlflow.pytorch.load_model(str(saved[0]))
    with pytest.raises(ValueError, match="16777217"):
        module(torch.tensor([[0, 0, 0, 2**24 + 1]]))
    with pytest.raises(TypeError, match=r"torch\.bool"):
        module(torch.tensor([[True, False, True, False]]))
