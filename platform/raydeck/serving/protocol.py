"""MLflow's scoring protocol: request bodies in, validated arrays out, predictions as JSON.

Owns: parsing the four JSON forms ``mlflow models serve`` accepts on ``POST /invocations``
(``dataframe_split``, ``dataframe_records``, ``instances``, ``inputs``) into one 2-D array checked
against the model's tensor signature, and writing predictions the way MLflow's scoring server
does for such a model (nested lists, whatever the form), so its clients work unchanged. Every
problem with a request is an :class:`InputError` whose message names what was wrong and what the
model expects: the server answers it with HTTP 400, never 500.
Does not own: HTTP or batching (:mod:`raydeck.serving.server`).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from typing import Any

import numpy as np

FORMATS = ("dataframe_split", "dataframe_records", "instances", "inputs")
DATAFRAME_FORMATS = FORMATS[:2]
DEFAULT_MAX_REQUEST_BYTES = 8 * 1024 * 1024


class InputError(ValueError):
    """A request the model cannot score; the message is the HTTP 400 answer."""


@dataclass(frozen=True)
class TensorInput:
    """What a model with a 2-D tensor signature takes: ``(-1, width)`` values of ``dtype``."""

    width: int
    dtype: str

    @classmethod
    def from_schema(cls, schema: Any) -> TensorInput | None:
        """The expected input of an MLflow input schema, or None when it is not one 2-D tensor
        (such models get MLflow's own schema enforcement instead)."""
        if schema is None or not getattr(schema, "is_tensor_spec", lambda: False)():
            return None
        inputs = schema.inputs
        if len(inputs) != 1 or len(inputs[0].shape) != 2 or inputs[0].shape[1] < 1:
            return None
        return cls(width=int(inputs[0].shape[1]), dtype=str(inputs[0].type))

    def describe(self) -> str:
        return (f"rows of {self.width} numbers "
                f"(signature: Tensor('{self.dtype}', (-1, {self.width})))")


@dataclass(frozen=True)
class Parsed:
    """One request's rows, and which form it came in (the answer uses the same form)."""

    rows: np.ndarray
    form: str


def parse_request(body: bytes, expected: TensorInput, max_bytes: int) -> Parsed:
    """Parse and validate one ``/invocations`` body.

    Raises:
        InputError: too large, empty, not JSON, no known form, or rows that are not
            ``expected.width`` numbers each.
    """
    if len(body) > max_bytes:
        raise too_large(len(body), max_bytes)
    if not body.strip():
        raise InputError(f"empty request body; send JSON with one of {', '.join(FORMATS)}, "
                         f"e.g. {{\"inputs\": [[...{expected.width} numbers...]]}}")
    payload = parse_json_object(body)
    present = [key for key in FORMATS if key in payload]
    if len(present) != 1:
        found = ", ".join(sorted(map(str, payload))) or "no keys"
        raise InputError(f"request JSON needs exactly one of {', '.join(FORMATS)}; "
                         f"it has {found}")
    form = present[0]
    rows = _rows(form, payload[form])
    return Parsed(_validate(rows, expected, form), form)


def too_large(size: int, max_bytes: int) -> InputError:
    """The answer to a body of ``size`` bytes over the ``max_request_bytes`` limit."""
    return InputError(f"request body is {size:,} bytes; the limit is {max_bytes:,} bytes "
                      "(max_request_bytes): send fewer rows per request")


def parse_json_object(body: bytes) -> dict[str, Any]:
    """The body's JSON object.

    Raises:
        InputError: not UTF-8 JSON, nested deeper than Python's recursion limit, an integer of
            more digits than Python converts, or JSON that is not an object.
    """
    try:
        payload = json.loads(body)
    except (ValueError, RecursionError) as exc:  # JSONDecodeError, UnicodeDecodeError, digits
        detail = "nested too deeply" if isinstance(exc, RecursionError) else str(exc)
        raise InputError(f"request body is not valid JSON ({detail}); send an object with "
                         f"one of {', '.join(FORMATS)}") from None
    if not isinstance(payload, dict):
        raise InputError(f"request JSON must be an object with one of {', '.join(FORMATS)}, "
                         f"not {type(payload).__name__}")
    return payload


def _rows(form: str, value: Any) -> list[Any]:
    """The list of rows of one form, before any value is checked."""
    if form == "dataframe_split":
        if not isinstance(value, dict) or "data" not in value:
            raise InputError('dataframe_split must be {"columns": [...], "data": [[...], ...]}')
        value = value["data"]
    elif form == "dataframe_records":
        if not isinstance(value, list) or not all(isinstance(r, dict) for r in value):
            raise InputError('dataframe_records must be a list of {"column": value} objects')
        columns = list(value[0]) if value else []
        if any(list(record) != columns for record in value):
            raise InputError("dataframe_records: every record must have the same columns in "
                             "the same order")
        value = [list(record.values()) for record in value]
    elif isinstance(value, dict):
        raise InputError(f"{form}: named tensors are not supported by this model; send a list "
                         "of rows")
    if not isinstance(value, list):
        raise InputError(f"{form} must be a list of rows, not {type(value).__name__}")
    if not value:
        raise InputError(f"{form} has no rows")
    return value


def _validate(rows: list[Any], expected: TensorInput, form: str) -> np.ndarray:
    """Rows as a ``(n, width)`` array of the signature's dtype, or the first thing wrong."""
    # Fast path: numpy parses well-formed numeric rows in C; only a request it would
    # misread (strings, booleans, ragged or nested rows) is walked value by value.
    try:
        array = np.asarray(rows)
    except ValueError:
        array = np.asarray([], dtype=object)
    if (array.dtype.kind in "iuf" and array.ndim == 2 and array.shape[1] == expected.width
            and np.isfinite(array).all()):
        return array.astype(expected.dtype, copy=False)
    for index, row in enumerate(rows):
        if not isinstance(row, list):
            raise InputError(f"{form}: row {index} is {type(row).__name__}; expected "
                             f"{expected.describe()}")
        if len(row) != expected.width:
            raise InputError(f"{form}: row {index} has {len(row)} values; expected "
                             f"{expected.describe()}")
        for column, value in enumerate(row):
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                raise InputError(f"{form}: row {index}, column {column} is {value!r} "
                                 f"({type(value).__name__}); expected {expected.describe()}")
            if isinstance(value, float) and not math.isfinite(value):
                raise InputError(f"{form}: row {index}, column {column} is {value}; expected "
                                 "finite numbers")
    try:
        return np.asarray(rows, dtype=expected.dtype)
    except (OverflowError, ValueError) as exc:
        raise InputError(f"{form}: values do not fit {expected.dtype} ({exc})") from None


def predictions_json(predictions: np.ndarray) -> bytes:
    """Predictions as MLflow's scoring server writes them for a tensor-signature model: MLflow
    hands such a model every form as an array (schema enforcement converts a DataFrame), so
    the answer is nested lists for all four forms."""
    return json.dumps({"predictions": np.asarray(predictions).tolist()}).encode()
