"""MLflow's pytorch flavor without Lightning's import (raydeck._internal.pytorch_flavor): a job's
rank 0 saves its model and a Serve replica loads one without paying for Lightning, and nothing
a user of MLflow or Lightning relies on changes. Each case runs in a fresh interpreter, since
what is imported is the point."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

SAVE_AND_LOAD = """
    import sys, tempfile
    from pathlib import Path

    import numpy as np
    import torch

    from raydeck.models import Standardized, save_torch_model

    model = Standardized(torch.nn.Linear(4, 3), np.zeros(4), np.ones(4))
    with tempfile.TemporaryDirectory() as tmp:
        saved = save_torch_model(model, Path(tmp), np.ones((2, 4)))
        assert "pytorch_lightning" not in sys.modules, "saving imported Lightning"
        import mlflow.pyfunc

        answer = mlflow.pyfunc.load_model(str(saved)).predict(np.ones((2, 4)))
        assert np.asarray(answer).shape == (2, 3), answer
    assert "pytorch_lightning" not in sys.modules, "loading imported Lightning"

    import mlflow.pytorch
    import pytorch_lightning  # still importable afterwards, for whoever needs it

    assert pytorch_lightning.LightningModule
    mlflow.pytorch.autolog(disable=True)  # its Lightning autologging imports Lightning itself
    print("ok")
"""

WITH_LIGHTNING_LOADED = """
    import pytorch_lightning

    from raydeck._internal.pytorch_flavor import import_pytorch_flavor

    flavor = import_pytorch_flavor()
    assert hasattr(flavor, "MlflowModelCheckpointCallback")  # as a plain import gives it
    print("ok")
"""


def _run(code: str) -> str:
    done = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True,
                          text=True, timeout=240)
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout


@pytest.mark.timeout(300)
def test_a_model_is_saved_and_loaded_without_importing_lightning() -> None:
    assert _run(SAVE_AND_LOAD).strip().endswith("ok")


@pytest.mark.timeout(300)
def test_a_process_that_uses_lightning_gets_mlflows_whole_flavor() -> None:
    assert _run(WITH_LIGHTNING_LOADED).strip().endswith("ok")
