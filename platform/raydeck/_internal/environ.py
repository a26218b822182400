"""Variables set in this process's environment for the length of a block, then put back.

For the calls that read their settings from the environment only (``ray.init`` starting a
local Ray, MLflow's S3 artifact store): what the block sets is visible to them and to the
processes they start, and to nothing after it.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator, Mapping


@contextlib.contextmanager
def environment(values: Mapping[str, str]) -> Iterator[None]:
    """Set ``values`` in ``os.environ`` for the block; afterwards each variable is as it was
    (unset again if it was unset), also when the block raised."""
    saved = {name: os.environ.get(name) for name in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
