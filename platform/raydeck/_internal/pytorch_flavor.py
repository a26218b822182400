"""MLflow's pytorch flavor (``mlflow.pytorch``) without PyTorch Lightning, where nothing uses it.

Why: ``import mlflow.pytorch`` imports PyTorch Lightning whenever it is installed, only to
offer ``mlflow.pytorch.MlflowModelCheckpointCallback`` (its Lightning autologging imports
Lightning again when it is turned on). Lightning brings torchmetrics and ``torch._dynamo``:
3.6 CPU-s on the 2-core development machine, in every process that saves or loads a
pytorch-flavor model (a digits job's rank 0 saving its model, each Serve replica loading
one), on top of a training step's worth of work.

The contract of :func:`import_pytorch_flavor`:
- In a process that has not imported Lightning, ``mlflow.pytorch`` is imported with
  ``pytorch_lightning`` unimportable for that one import (Python's ``sys.modules[name] = None``
  rule), which MLflow expects when Lightning is not installed: it then leaves out
  ``MlflowModelCheckpointCallback``. Saving, loading and ``mlflow.pytorch.autolog()`` work as
  with Lightning imported; a later ``import pytorch_lightning`` works as always.
- In a process that already imported Lightning (a Lightning job), or ``mlflow.pytorch``, it is
  a plain import.
- Another thread importing Lightning during that one import gets ImportError: call it where
  nothing else imports Lightning at the same time (a job's end, a replica's model load).
"""

from __future__ import annotations

import importlib
import sys
import threading
from types import ModuleType

LIGHTNING = "pytorch_lightning"
FLAVOR = "mlflow.pytorch"
_LOCK = threading.Lock()


def import_pytorch_flavor() -> ModuleType:
    """``mlflow.pytorch``, imported without Lightning unless this process already has it."""
    with _LOCK:
        if FLAVOR in sys.modules or LIGHTNING in sys.modules:
            return importlib.import_module(FLAVOR)
        sys.modules[LIGHTNING] = None  # type: ignore[assignment]
        try:
            return importlib.import_module(FLAVOR)
        finally:
            if sys.modules.get(LIGHTNING, ...) is None:
                del sys.modules[LIGHTNING]
