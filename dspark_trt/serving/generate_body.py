"""Check a JSON body for Triton's ``/generate`` and ``/generate_stream`` against the model's inputs.

tritonserver 2.51 converts the JSON itself and answers 500 when it cannot (not JSON, a string for
an integer, ...), and it silently wraps integers into INT32 (``max_tokens`` 99999999999 became
1215752191). The gateway runs this check first and answers 400 with a message naming the field.
What the model checks itself (prompt length against max_seq_len, token ids against the
vocabulary, ...) is left to the model.

``INPUTS`` mirrors ``templates/config.pbtxt`` (tests/serving/test_serving_gateway.py compares them).
"""
from __future__ import annotations

import json
import math

# name -> (Triton dtype, dims) as in templates/config.pbtxt
INPUTS = {"text_input": ("TYPE_STRING", "1"), "input_ids": ("TYPE_INT32", "-1"),
          "max_tokens": ("TYPE_INT32", "1"), "temperature": ("TYPE_FP32", "1"),
          "top_p": ("TYPE_FP32", "1"), "seed": ("TYPE_UINT64", "1"), "stream": ("TYPE_BOOL", "1"),
          "stop": ("TYPE_STRING", "-1"), "stop_ids": ("TYPE_INT32", "-1")}

# Triton's own generate fields (request id, request parameters), passed on as they are
PASS_THROUGH = {"id": str, "parameters": dict}
_INT_RANGES = {"TYPE_INT32": (-2**31, 2**31 - 1), "TYPE_UINT64": (0, 2**64 - 1)}
_FP32_MAX = 3.4028234663852886e38


class BadRequest(ValueError):
    """The body cannot be a valid request; the message names the field (HTTP 400)."""


def check_generate_body(body: bytes, stream_endpoint: bool) -> dict:
    """Parse and check a generate body; returns the JSON object or raises ``BadRequest``."""
    try:
        obj = json.loads(body, parse_constant=_no_constant)
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise BadRequest(f"the request body is not valid JSON: {e}") from None
    if not isinstance(obj, dict):
        raise BadRequest(f"the request body must be a JSON object, got {type(obj).__name__}")
    unknown = [k for k in obj if k not in INPUTS and k not in PASS_THROUGH]
    if unknown:
        raise BadRequest(f"unknown field '{unknown[0]}'; known fields: {', '.join([*INPUTS, *PASS_THROUGH])}")
    for name, value in obj.items():
        if name in PASS_THROUGH:
            if not isinstance(value, PASS_THROUGH[name]):
                raise BadRequest(f"'{name}' must be {_json_type(PASS_THROUGH[name]())}, got {_json_type(value)}")
            continue
        dtype, dims = INPUTS[name]
        values = value if isinstance(value, list) else [value]
        if dims == "1" and len(values) != 1:
            raise BadRequest(f"'{name}' must be a single value, got a list of {len(values)}")
        for v in values:
            _check_value(name, dtype, v)
    if obj.get("stream") is True and not stream_endpoint:
        raise BadRequest("'stream': true needs the /generate_stream endpoint")
    return obj


def _no_constant(name: str):
    raise BadRequest(f"the request body is not valid JSON: {name} is not a JSON number")


def _check_value(name: str, dtype: str, v) -> None:
    if dtype == "TYPE_STRING":
        if not isinstance(v, str):
            raise BadRequest(f"'{name}' must be a string, got {_json_type(v)}")
    elif dtype == "TYPE_BOOL":
        if not isinstance(v, bool):
            raise BadRequest(f"'{name}' must be true or false, got {_json_type(v)}")
    elif dtype == "TYPE_FP32":
        if isinstance(v, bool) or not isinstance(v, (int, float)):
            raise BadRequest(f"'{name}' must be a number, got {_json_type(v)}")
        if not math.isfinite(v) or abs(v) > _FP32_MAX:
            raise BadRequest(f"'{name}' = {v} is out of the FP32 range")
    else:
        lo, hi = _INT_RANGES[dtype]
        if isinstance(v, bool) or not isinstance(v, int):
            raise BadRequest(f"'{name}' must be an integer, got {_json_type(v)}")
        if not lo <= v <= hi:
            raise BadRequest(f"'{name}' = {v} is out of range: it must be in [{lo}, {hi}] "
                             f"({dtype.removeprefix('TYPE_')})")


def _json_type(v) -> str:
    return {bool: "a boolean", int: "an integer", float: "a number", str: "a string",
            list: "a list", dict: "an object", type(None): "null"}.get(type(v), type(v).__name__)
