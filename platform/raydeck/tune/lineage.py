"""Population-based training's lineage, as a trial's MLflow child run records it.

When PBT exploits, a weak trial continues from a strong trial's checkpoint with perturbed
hyperparameters. MLflow params are immutable ("changing param values is not allowed", the
long-standing failure of Ray's MLflow callback under PBT, ray-project/ray #20473 and #30649), so
a trial's params keep the values it started with, and each exploit is recorded beside them:

- tags (the latest exploit): ``raydeck.pbt.source_trial``, ``raydeck.pbt.source_checkpoint``,
  ``raydeck.pbt.source_iteration``, ``raydeck.pbt.from_step`` (the first step of this run
  trained with the new values) and ``raydeck.pbt.changed`` (``{name: [old, new]}`` as JSON);
- an artifact per exploit, ``pbt/exploit-<id>.json``: all of the above, the scores, and the
  trial's config before and after;
- ``raydeck.trial_config``: the trial's current config (JSON), updated at every start.

The exploit is decided on the driver (:mod:`raydeck.tune.scheduling` puts it in the trial's
config) and written by the trial through its tracker, so it reaches MLflow like every other
value (spooled by the proxy). Recording an exploit again (a resumed sweep restarts the trial
with the same config) rewrites the same artifact and tags.
"""

from __future__ import annotations

import json
from typing import Any

from raydeck.tune.space import as_text, flatten

PBT_TAG_PREFIX = "raydeck.pbt."
LINEAGE_ARTIFACT_DIR = "pbt"
CHANGED_TAG_MAX_CHARS = 5000


def changed_values(before: dict[str, Any], after: dict[str, Any]) -> dict[str, list[Any]]:
    """``{dotted name: [old, new]}`` for every value that differs between two configs."""
    old, new = flatten(before), flatten(after)
    return {name: [old.get(name), new.get(name)] for name in sorted(set(old) | set(new))
            if old.get(name) != new.get(name)}


def record_exploit(tracker: Any, exploit: dict[str, Any], config: dict[str, Any],
                   first_step: int) -> dict[str, Any]:
    """Record one exploit on the trial's run; returns the lineage entry written.

    Args:
        tracker: the trial's tracker.
        exploit: what the driver handed over (source trial, checkpoint, scores, old config).
        config: the trial's new config.
        first_step: the first step of the run trained with ``config``.
    """
    changed = changed_values(exploit.get("previous_config") or {}, config)
    entry = {**exploit, "from_step": first_step, "config": config, "changed": changed}
    changed_text = json.dumps(changed, sort_keys=True, default=str)
    tags = {
        f"{PBT_TAG_PREFIX}source_trial": str(exploit.get("source_trial", "")),
        f"{PBT_TAG_PREFIX}source_checkpoint": str(exploit.get("source_checkpoint") or ""),
        f"{PBT_TAG_PREFIX}source_iteration": as_text(exploit.get("source_iteration", 0)),
        f"{PBT_TAG_PREFIX}from_step": str(first_step),
        f"{PBT_TAG_PREFIX}changed": (changed_text if len(changed_text) <= CHANGED_TAG_MAX_CHARS
                                     else f"{len(changed)} values; see the pbt/ artifacts"),
    }
    tracker.set_tags(tags)
    tracker.log_dict(entry, f"{LINEAGE_ARTIFACT_DIR}/exploit-{exploit['id']}.json")
    return entry
