"""The training runtime: what a job's driver and its Ray Train workers call.

- :mod:`~raydeck.train.presets`: named resource shapes (presets) and their translation into
  Ray's ``ScalingConfig``; :mod:`~raydeck.train.feasibility`: whether a cluster can ever place
  one.
- :mod:`~raydeck.train.trainer`: :func:`~raydeck.train.trainer.fit`, a ``TorchTrainer`` with
  tracking, fault tolerance and the queue's preemption wired in.
- :mod:`~raydeck.train.checkpointing`: ``report_epoch`` and ``restore``, checkpoints that carry
  the run's metrics so a resumed run logs each step once.

Names load lazily: ``import raydeck.train`` does not import torch.
"""

from raydeck._internal.lazy import lazy_attributes

__getattr__, __dir__ = lazy_attributes(
    __name__, ("checkpointing", "feasibility", "presets", "trainer")
)
