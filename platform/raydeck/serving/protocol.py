"""MLflow's scoring protocol: request bodies in, validated arrays out, predictions as JSON.

Owns: reading the ``Content-Type`` of ``POST /invocations`` as MLflow's scoring server does
(:func:`media_type`: JSON, CSV or Parquet, UTF-8 only, no parameters but ``charset``), parsing
the four JSON forms ``mlflow models serve`` accepts (``dataframe_split``, ``dataframe_records``,
``instances``, ``inputs``; other keys such as ``params`` are ignored, as MLflow ignores params
for a model without a params schema) and CSV or Parquet tables into one 2-D array checked
against the model's tensor signature, and writing predictions the way MLflow's scoring server
does for such a model (nested lists, whatever the form), so its clients work unchanged. Values
are cast to the signature's dtype only when the cast is exact (an integer a float holds
exactly, a float of integral value for an integer signature). Every problem with a request is an
:class:`InputError` whose message names what was wrong and what the model expects: the server
answers it with HTTP 400, never 500; a content type MLflow refuses is an
:class:`UnsupportedMediaType` (HTTP 415, MLflow's text).
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
# Two of the media types MLflow's scoring server takes (``scoring_server.CONTENT_TYPES``: JSON,
# CSV and Parquet).
JSON_TYPE = "application/json"
CSV_TYPE = "text/csv"
# Beyond this magnitude float64 no longer holds every integer.
_FLOAT64_EXACT_INTEGERS = 2.0**53


class InputError(ValueError):
    """A request the model cannot score; the message is the HTTP 400 answer."""


class UnsupportedMediaType(ValueError):
    """A ``Content-Type`` MLflow's scoring server refuses; the message is its HTTP 415 answer
    (``text/plain``), word for word."""


def media_type(content_type: str | None) -> str:
    """The media type of a ``POST /invocations`` body, read as MLflow's scoring server reads it.

    A request without a ``Content-Type`` is JSON (MLflow's server answers it with a 500).

    Raises:
        UnsupportedMediaType: a charset other than UTF-8, any other parameter (MLflow 1.x's
            ``format=pandas-split``, which MLflow 2 and 3 refuse), or a type other than JSON,
            CSV or Parquet.
    """
    if not content_type or content_type == JSON_TYPE:  # nearly every request: no parsing
        return JSON_TYPE
    from mlflow.pyfunc.scoring_server import CONTENT_TYPES, SCORING_PROTOCOL_CHANGE_INFO

    mime, *pairs = (part.strip() for part in content_type.split(";"))
    parameters = {key: value for key, _, value in (pair.partition("=") for pair in pairs)}
    if parameters.get("charset", "utf-8").lower() != "utf-8":
        raise UnsupportedMediaType("The scoring server only supports UTF-8")
    if unexpected := set(parameters).difference({"charset"}):
        raise UnsupportedMediaType(f"Unrecognized content type parameters: "
                                   f"{', '.join(unexpected)}. {SCORING_PROTOCOL_CHANGE_INFO}")
    if mime not in CONTENT_TYPES:
        raise UnsupportedMediaType("This predictor only supports the following content types:"
                                   f" Types: {CONTENT_TYPES}. Got '{content_type}'.")
    return mime


@dataclass(frozen=True)
class TensorInput:
    """What a model with a 2-D tensor signature takes: ``(-1, width)`` values of ``dtype``."""

    width: int
    dtype: str

    @classmethod
    def from_schema(cls, schema: Any) -> TensorInput | None:
        """The expected input of an MLflow input schema, or None when it is not one 2-D tensor
        of numbers (such models get MLflow's own schema enforcement instead)."""
        if schema is None or not getattr(schema, "is_tensor_spec", lambda: False)():
            return None
        inputs = schema.inputs
        if (len(inputs) != 1 or len(inputs[0].shape) != 2 or inputs[0].shape[1] < 1
                or np.dtype(inputs[0].type).kind not in "iuf"):
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


def parse_request(body: bytes, expected: TensorInput, max_bytes: int,
                  content_type: str | None = None) -> Parsed:
    """Parse and validate one ``/invocations`` body of ``content_type``.

    Raises:
        UnsupportedMediaType: see :func:`media_type`.
        InputError: too large, empty, not JSON (or CSV, Parquet), no known form, or rows that
            are not ``expected.width`` numbers each, or that the signature's dtype cannot hold
            exactly.
    """
    if len(body) > max_bytes:
        raise too_large(len(body), max_bytes)
    mime = media_type(content_type)
    if mime != JSON_TYPE:
        form = "csv" if mime == CSV_TYPE else "parquet"
        return Parsed(_validate(_table_rows(body, mime), expected, form), form)
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
    # numpy reads a JSON boolean among numbers as 0 or 1: such a body is checked value by value.
    booleans = b"true" in body or b"false" in body
    return Parsed(_validate(rows, expected, form, booleans), form)


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


def _table_rows(body: bytes, mime: str) -> list[Any]:
    """The rows of a CSV (with a header line, as ``DataFrame.to_csv`` writes) or Parquet body,
    read by MLflow's own parsers.

    Why without the schema: MLflow's CSV parser fails on every tensor signature
    (``TensorSpec only supports numpy types``), so ``mlflow models serve`` answers any CSV body
    for such a model with a 400; the rows are checked against the signature here instead.
    """
    from io import BytesIO, StringIO

    from mlflow.exceptions import MlflowException
    from mlflow.pyfunc.scoring_server import parse_csv_input, parse_parquet_input

    try:
        if mime == CSV_TYPE:
            frame = parse_csv_input(StringIO(body.decode("utf-8")))
        else:
            frame = parse_parquet_input(BytesIO(body))
    except UnicodeDecodeError as exc:
        raise InputError(f"CSV body is not UTF-8 ({exc})") from None
    except MlflowException as exc:
        raise InputError(exc.message.splitlines()[0]) from None
    rows: list[Any] = frame.to_numpy().tolist()
    if not rows:
        raise InputError(f"{mime} body has no rows")
    return rows


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


def _validate(rows: list[Any], expected: TensorInput, form: str,
              booleans: bool = False) -> np.ndarray:
    """Rows as a ``(n, width)`` array of the signature's dtype, or the first thing wrong
    (``booleans``: the rows may hold booleans, which numpy would read as numbers)."""
    dtype = np.dtype(expected.dtype)
    # Fast path: numpy parses well-formed numeric rows in C; only a request it would
    # misread (strings, booleans, ragged or nested rows, integers beyond int64, or floats so
    # large that they may be integers numpy rounded: it makes float64 of int64 and uint64
    # values mixed) is walked value by value.
    try:
        array = np.asarray(rows)
    except ValueError:
        array = np.asarray([], dtype=object)
    if (not booleans and array.dtype.kind in "iuf" and array.ndim == 2
            and array.shape[1] == expected.width and np.isfinite(array).all()
            and (array.dtype.kind != "f" or np.abs(array).max() < _FLOAT64_EXACT_INTEGERS)):
        return _cast_exactly(array, dtype, f"{form}: ", expected.describe())
    for index, row in enumerate(rows):
        if not isinstance(row, list):
            raise InputError(f"{form}: row {index} is {type(row).__name__}; expected "
                             f"{expected.describe()}")
        if len(row) != expected.width:
            raise InputError(f"{form}: row {index} has {len(row)} values; expected "
                             f"{expected.describe()}")
        for column, value in enumerate(row):
            where = f"{form}: row {index}, column {column} is"
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                raise InputError(f"{where} {value!r} ({type(value).__name__}); expected "
                                 f"{expected.describe()}")
            if isinstance(value, float) and not math.isfinite(value):
                raise InputError(f"{where} {value}; expected finite numbers")
            if not _holds(dtype, value):
                raise InputError(f"{where} {value}, which {dtype} cannot hold exactly; "
                                 f"expected {expected.describe()}")
    # Every integer is exact in ``dtype`` now; floats go through float64, so that one beyond a
    # narrower float's range is refused.
    wide = np.asarray(rows, dtype=np.float64 if dtype.kind == "f" else dtype)
    return _cast_exactly(wide, dtype, f"{form}: ", expected.describe())


def _cast_exactly(array: np.ndarray, dtype: np.dtype, where: str, expected: str) -> np.ndarray:
    """``array`` (finite integers or floats) as ``dtype`` (the same) when no value changes
    beyond a float's rounding.

    Accepted: any integer the dtype holds exactly (pixels 0-16 as int64 rows for a float32 or
    float64 network), floats of integral value in range for an integer dtype, and floats
    rounded to a narrower float (float64 rows for a float32 network: the network's own
    precision). ``where`` and ``expected`` prefix and end the message.

    Raises:
        InputError: not finite, an integer a float dtype cannot hold exactly (over 2**24 for
            float32, 2**53 for float64), a fraction or an out-of-range value for an integer
            dtype, or a float beyond a narrower float's range.
    """
    if array.dtype == dtype:  # the callers checked that every value is finite
        return array
    with np.errstate(over="ignore", invalid="ignore"):
        cast = array.astype(dtype)
        if array.dtype.kind == "f" and dtype.kind == "f":
            changed = ~np.isfinite(cast)
        else:
            changed = (cast.astype(array.dtype) != array) | ~np.isfinite(array)
    if changed.any():
        position = tuple(int(i) for i in np.argwhere(changed)[0])
        value = array[position].item()
        raise InputError(f"{where}value {value} at index {list(position)} would change as "
                         f"{dtype}; expected {expected}")
    return cast


def _holds(dtype: np.dtype, value: int | float) -> bool:
    """Whether ``dtype`` holds the JSON number ``value`` (finite) without changing it beyond a
    float's rounding of a float."""
    if dtype.kind == "f":
        if isinstance(value, float):
            return True  # rounded, or beyond a narrower float's range: checked once cast
        try:
            with np.errstate(over="ignore"):
                return float(dtype.type(value)) == value  # int == float compares exactly
        except OverflowError:  # beyond float64
            return False
    if isinstance(value, float) and not value.is_integer():
        return False
    info = np.iinfo(dtype)
    return info.min <= value <= info.max


def predictions_json(predictions: np.ndarray) -> bytes:
    """Predictions as MLflow's scoring server writes them for a tensor-signature model: MLflow
    hands such a model every form as an array (schema enforcement converts a DataFrame), so
    the answer is nested lists for all four forms."""
    return json.dumps({"predictions": np.asarray(predictions).tolist()}).encode()
