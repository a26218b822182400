"""Rules for what a tracker accepts, checked at the call site, and how lenient paths repair.

MLflow checks the same rules on the server, but by then the value is far from the line that
logged it, and one bad value would fail the whole ``log_batch``. So each rule runs here, in the
caller's thread, returns the broken rule as text, and the caller keeps every good value.
Limits come from MLflow itself so they track the installed version.

Two ways to apply them. A direct ``tracker.log_*`` call is *strict*: a bad key or value raises
:class:`~raydeck.errors.TrackingValidationError` naming the key and the fix (a programmer error,
best seen at once). raydeck's own paths (``report_epoch``, ``restore``, the Lightning logger,
Tune reports) are *lenient* (``strict=False``): they repair what MLflow would refuse with
:func:`sanitize_key` and :func:`truncate_param`, drop what cannot be repaired, warn once per key
and count it, because training must never die for tracking.

NaN and infinity: by default (``RAYDECK_TRACKING_NONFINITE=keep``) they are stored as MLflow
stores them (NaN as NaN, +-inf as the largest double); with ``error`` a strict call rejects them.
"""

from __future__ import annotations

import math
import numbers
import posixpath
import re
from typing import Any

from mlflow.utils.validation import (
    MAX_ENTITY_KEY_LENGTH,
    MAX_PARAM_VAL_LENGTH,
    MAX_TAG_VAL_LENGTH,
)

_KEY_CHARS = re.compile(r"^[/\w.\- :]+$")
_BAD_KEY_CHAR = re.compile(r"[^/\w.\- :]")
KEY_RULE = "keys may only hold letters, digits, _ - . : / and spaces"


def key_problem(key: Any) -> str | None:
    """The rule ``key`` breaks as a metric, param or tag name, or None if it is fine."""
    if not isinstance(key, str):
        return f"keys must be str, got {type(key).__name__}"
    if not key:
        return "keys must not be empty"
    if len(key) > MAX_ENTITY_KEY_LENGTH:
        return f"keys may be at most {MAX_ENTITY_KEY_LENGTH} characters (got {len(key)})"
    if not _KEY_CHARS.match(key):
        return f"{KEY_RULE} (e.g. {sanitize_key(key)!r})"
    normalized = posixpath.normpath(key)
    if normalized != key or normalized.startswith(("..", "/")):
        return "keys must be normalized paths: no leading '/', no '..', '//' or trailing '/'"
    return None


def sanitize_key(key: Any) -> str:
    """An MLflow-legal key close to ``key``: other characters become ``_``, the path is
    normalized (no empty, ``.`` or ``..`` parts) and cut to MLflow's length limit."""
    text = _BAD_KEY_CHAR.sub("_", str(key))
    parts = [part for part in text.split("/") if part not in ("", ".", "..")]
    return ("/".join(parts) or "_")[:MAX_ENTITY_KEY_LENGTH]


def metric_value(value: Any, keep_nonfinite: bool) -> tuple[float, str | None]:
    """``value`` as a float, or the rule it breaks. The fast path is plain float and int."""
    kind = type(value)
    if kind is float:
        number = value
    elif kind is int:
        number = float(value)
    elif isinstance(value, (str, bytes)) or value is None or isinstance(value, bool):
        return 0.0, f"metric values must be numbers, got {kind.__name__}"
    elif isinstance(value, numbers.Real) or hasattr(value, "__float__"):
        # numpy scalars, 0-d arrays and one-element torch tensors convert through __float__.
        try:
            number = float(value)
        except (TypeError, ValueError, RuntimeError):
            return 0.0, f"metric values must be single numbers, got {kind.__name__}"
    else:
        return 0.0, f"metric values must be numbers, got {kind.__name__}"
    if not keep_nonfinite and not math.isfinite(number):
        return 0.0, (
            f"metric value is {number} (non-finite) and RAYDECK_TRACKING_NONFINITE=error; fix "
            "the computation, or unset it to store NaN/inf as MLflow does"
        )
    return number, None


def step_problem(step: Any) -> str | None:
    """The rule ``step`` breaks, or None. Steps are non-negative integers."""
    if isinstance(step, bool) or not isinstance(step, numbers.Integral):
        return f"step must be a non-negative int, got {type(step).__name__}"
    if step < 0:
        return f"step must be >= 0, got {step}"
    return None


def param_value(value: Any) -> tuple[str, str | None]:
    """``value`` as MLflow stores params (text), or the rule it breaks."""
    text = value if isinstance(value, str) else str(value)
    if len(text) > MAX_PARAM_VAL_LENGTH:
        return "", (
            f"param values may be at most {MAX_PARAM_VAL_LENGTH} characters (got {len(text)}); "
            "log large values with log_dict or log_text instead"
        )
    return text, None


def truncate_param(value: Any) -> str:
    """``value`` as param text cut to MLflow's limit (what lenient paths store)."""
    text = value if isinstance(value, str) else str(value)
    return text[:MAX_PARAM_VAL_LENGTH]


def tag_value(value: Any) -> tuple[str, str | None]:
    """``value`` as a tag string, or the rule it breaks. Only scalars are tags."""
    if isinstance(value, str):
        text = value
    elif isinstance(value, (bool, int, float)):
        text = str(value)
    else:
        return "", (
            f"tag values must be str, int, float or bool, got {type(value).__name__}; "
            "log structured values with log_dict"
        )
    if len(text) > MAX_TAG_VAL_LENGTH:
        return "", f"tag values may be at most {MAX_TAG_VAL_LENGTH} characters (got {len(text)})"
    return text, None


def artifact_dir_problem(path: str | None) -> str | None:
    """The rule an artifact directory (relative to the run's artifact root) breaks, or None."""
    if path is None or path == "":
        return None
    if not isinstance(path, str):
        return f"artifact_path must be str, got {type(path).__name__}"
    if "\\" in path or "\0" in path:
        return "artifact_path must use '/' and hold no NUL or backslash"
    normalized = posixpath.normpath(path)
    if path.startswith("/") or normalized == ".." or normalized.startswith("../"):
        return f"artifact_path {path!r} must be relative to the run's artifact root, without '..'"
    return None


def artifact_file_problem(artifact_file: str) -> str | None:
    """The rule a run-relative artifact file path (``dir/name.ext``) breaks, or None."""
    if not isinstance(artifact_file, str) or not artifact_file.strip("/"):
        return "artifact_file must be a non-empty relative path like 'dir/name.json'"
    directory, name = posixpath.split(posixpath.normpath(artifact_file))
    if name in ("", ".", ".."):
        return f"artifact_file {artifact_file!r} must end with a file name"
    return artifact_dir_problem(artifact_file) or artifact_dir_problem(directory)
