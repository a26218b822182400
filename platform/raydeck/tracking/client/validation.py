"""Rules for what a tracker accepts, checked at the call site, and how lenient paths repair.

MLflow checks the same rules on the server, but by then the value is far from the line that
logged it, and one bad value would fail the whole ``log_batch``. So each rule runs here, in the
caller's thread, returns the broken rule as text, and the caller keeps every good value.
Limits are MLflow's own, checked against the installed version by a test.

Two ways to apply them. A direct ``tracker.log_*`` call is *strict*: a bad key or value raises
:class:`~raydeck.errors.TrackingValidationError` naming the key and the fix (a programmer error,
best seen at once). raydeck's own paths (``report_epoch``, ``restore``, the Lightning logger,
Tune reports) are *lenient* (``strict=False``): they repair what MLflow would refuse as Lightning's
``MLFlowLogger`` does (:func:`legal_key`, :func:`truncated_param`, :func:`sanitize_metrics`),
drop what cannot be repaired, warn once per key and count it, because training must never die
for tracking.

NaN and infinity: by default (``RAYDECK_TRACKING_NONFINITE=keep``) they are stored as MLflow
stores them (NaN as NaN, +-inf as the largest double); with ``error`` a strict call rejects them.
"""

from __future__ import annotations

import functools
import math
import numbers
import posixpath
import re
import zlib
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

# MLflow's own limits (``mlflow.utils.validation``), written out rather than imported: importing
# any part of mlflow costs every training process about 2 CPU-s, and only the proxy's shards
# talk to MLflow. tests/tracking/test_tracking_validation.py checks them against the installed
# MLflow.
MAX_ENTITY_KEY_LENGTH = 250
MAX_PARAM_VAL_LENGTH = 6000
MAX_TAG_VAL_LENGTH = 8000

_KEY_CHARS = re.compile(r"^[/\w.\- :]+$")
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
        return f"{KEY_RULE} (e.g. {_legalized(key)[0]!r})"
    normalized = posixpath.normpath(key)
    if normalized != key or normalized.startswith(("..", "/")):
        return "keys must be normalized paths: no leading '/', no '..', '//' or trailing '/'"
    return None


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
    if type(step) is int:  # the common case, without the ABC check below (every log call)
        return None if step >= 0 else f"step must be >= 0, got {step}"
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


# --- Sanitizing: what raydeck's own integrations do instead of raising ------------------------
# A key or value MLflow would refuse must not abort a training job that raydeck's integrations
# (the Lightning logger, report_epoch, Tune reports) log for the user. They make it legal the
# way Lightning's own MLFlowLogger does (remove the characters MLflow refuses, cut long params),
# warn once per key and count what they changed or dropped on the run under these tags.

SANITIZED_VALUES_TAG = "raydeck.sanitized_values"
DROPPED_VALUES_TAG = "raydeck.dropped_values"

_ILLEGAL_KEY_CHARS = re.compile(r"[^/\w.\- :]+")
# A key cut to MLflow's length limit ends with "-" and this many hex digits of a CRC of the
# whole key, so two long keys that share a prefix stay two keys.
KEY_DIGEST_CHARS = 8


@dataclass(frozen=True)
class Sanitized:
    """One value a lenient path changed or dropped: ``key`` as given, ``logged_as`` the key it
    was logged under (None: dropped), ``reason`` the rule it broke and what was done."""

    key: str
    logged_as: str | None
    reason: str

    @property
    def dropped(self) -> bool:
        return self.logged_as is None


def _normalized_key_path(key: str) -> str:
    path = "/".join(part for part in key.split("/") if part not in ("", ".", ".."))
    # MLflow refuses any key starting with "..", also "..x" (it could climb out of a directory).
    return path.lstrip(".") if path.startswith("..") else path


def legal_key(key: Any) -> tuple[str | None, str | None]:
    """``key`` as a metric, param or tag name MLflow accepts, and why it had to change.

    The rules, in order: a key that is not a str becomes its ``str()``; characters MLflow
    refuses are removed, as Lightning's ``MLFlowLogger`` does (``recall@5`` -> ``recall5``;
    MLflow's ``:`` and non-ASCII letters stay); the path is normalized (empty, ``.`` and ``..``
    segments dropped, so no leading or trailing ``/``); a key longer than MLflow's limit is cut
    and ends with ``-`` and :data:`KEY_DIGEST_CHARS` hex digits of the whole key's CRC32.

    Returns:
        ``(key, None)`` when ``key`` is legal as it is; ``(new_key, reason)`` when it changed;
        ``(None, reason)`` when nothing legal is left (``"@@"``): the value is to be dropped.
    """
    if isinstance(key, str):
        return _legal_str_key(key)
    return _legalized(key)


# Integrations log the same few keys every step: remember the answer (strings only, bounded).
LEGAL_KEY_CACHE_SIZE = 4096


@functools.lru_cache(maxsize=LEGAL_KEY_CACHE_SIZE)
def _legal_str_key(key: str) -> tuple[str | None, str | None]:
    return (key, None) if key_problem(key) is None else _legalized(key)


def _legalized(key: Any) -> tuple[str | None, str | None]:
    reasons: list[str] = []
    text = key if isinstance(key, str) else str(key)
    if not isinstance(key, str):
        reasons.append(f"keys must be str, got {type(key).__name__}")
    removed = "".join(sorted(set("".join(_ILLEGAL_KEY_CHARS.findall(text)))))
    if removed:
        text = _ILLEGAL_KEY_CHARS.sub("", text)
        reasons.append(f"removed {removed!r} ({KEY_RULE})")
    normalized = _normalized_key_path(text)
    if normalized != text:
        text = normalized
        reasons.append("normalized the path (no leading '/' or '..', no '//', '/./', '/../' or "
                       "trailing '/')")
    if len(text) > MAX_ENTITY_KEY_LENGTH:
        digest = f"{zlib.crc32(text.encode()):0{KEY_DIGEST_CHARS}x}"
        head = _normalized_key_path(text[:MAX_ENTITY_KEY_LENGTH - KEY_DIGEST_CHARS - 1])
        reasons.append(f"cut to {MAX_ENTITY_KEY_LENGTH} characters (was {len(text)})")
        text = f"{head}-{digest}"
    if not text:
        return None, "; ".join([*reasons, "nothing legal is left"])
    return text, "; ".join(reasons)


def truncated_param(value: Any) -> tuple[str, str | None]:
    """``value`` as param text MLflow accepts: its ``str()``, cut to MLflow's length limit.

    Returns:
        ``(text, None)`` when it fits; ``(first MAX_PARAM_VAL_LENGTH characters, reason)``
        when it was cut (Lightning's ``MLFlowLogger`` cuts every param to 250 characters).
    """
    text = value if isinstance(value, str) else str(value)
    if len(text) <= MAX_PARAM_VAL_LENGTH:
        return text, None
    return text[:MAX_PARAM_VAL_LENGTH], (
        f"param values may be at most {MAX_PARAM_VAL_LENGTH} characters; cut from {len(text)}"
    )


def _clash(reason: str | None, name: str | None) -> str:
    """Why a value was dropped: nothing legal left (``name`` None), or its key clashes."""
    if name is None:
        return reason or ""
    clash = f"another key of the same call is logged as {name!r}"
    return f"{reason}; {clash}" if reason else clash


def sanitize_metrics(metrics: Mapping[Any, Any]) -> tuple[dict[str, float], list[Sanitized]]:
    """The metric values of ``metrics`` that MLflow accepts, and what was changed or dropped.

    Keys go through :func:`legal_key`; a key renamed onto one that is already in the result
    is dropped (the first value wins). Values must be numbers (:func:`metric_value`; ``bool``
    counts as 0.0/1.0 as in MLflow); strings, None and multi-element tensors are dropped.
    Non-finite values are kept: whether they are stored is the tracker's NaN policy.
    """
    clean: dict[str, float] = {}
    changes: list[Sanitized] = []
    for key, value in metrics.items():
        name, reason = legal_key(key)
        if name is None or name in clean:
            changes.append(Sanitized(str(key), None, _clash(reason, name)))
            continue
        number, problem = metric_value(float(value) if isinstance(value, bool) else value, True)
        if problem:
            changes.append(Sanitized(str(key), None, problem))
            continue
        clean[name] = number
        if reason:
            changes.append(Sanitized(str(key), name, reason))
    return clean, changes


def sanitize_params(params: Mapping[Any, Any]) -> tuple[dict[str, str], list[Sanitized]]:
    """The params of ``params`` as MLflow accepts them (text; see :func:`legal_key` and
    :func:`truncated_param`), and what was changed or dropped. A key renamed onto one already
    in the result is dropped."""
    clean: dict[str, str] = {}
    changes: list[Sanitized] = []
    for key, value in params.items():
        name, key_reason = legal_key(key)
        if name is None or name in clean:
            changes.append(Sanitized(str(key), None, _clash(key_reason, name)))
            continue
        clean[name], value_reason = truncated_param(value)
        reason = "; ".join(r for r in (key_reason, value_reason) if r)
        if reason:
            changes.append(Sanitized(str(key), name, reason))
    return clean, changes
