"""Triton request tensors -> a validated generation request (no Triton import, testable alone).

Inputs (all optional in config.pbtxt; exactly one of ``text_input`` / ``input_ids`` is required):
  text_input STRING [1]   input_ids INT32 [-1]   max_tokens INT32 [1]   temperature FP32 [1]
  top_p FP32 [1]          seed UINT64 [1]        stream BOOL [1]        stop STRING [-1] (stop strings)
  stop_ids INT32 [-1] (stop token ids)
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import numpy as np

from ..runtime.sampling_params import RequestError, SamplingParams

Getter = Callable[[str], "np.ndarray | None"]


@dataclass
class ServingRequest:
    prompt_ids: list[int]
    params: SamplingParams
    stream: bool = False
    stop: list[str] = field(default_factory=list)       # stop strings (matched on the text)
    probe: bool = False                                 # a health probe: left out of the metrics


def _text(value, name: str) -> str:
    if isinstance(value, bytes):
        try:
            return value.decode("utf-8")
        except UnicodeDecodeError:
            raise RequestError(f"input '{name}' is not valid UTF-8") from None
    if isinstance(value, str):
        return value
    raise RequestError(f"input '{name}' must be a string (TYPE_STRING), got {type(value).__name__}")


_KINDS = {"i": ("iu", "an integer"), "f": ("fiu", "a number"), "b": ("b", "a bool")}


def _scalar(get: Getter, name: str, kind: str, default):
    """One value of numpy kind ``kind`` ('i' signed/unsigned int, 'f' float, 'b' bool) or default."""
    arr = get(name)
    if arr is None:
        return default
    arr = np.asarray(arr)
    if arr.size != 1:
        raise RequestError(f"input '{name}' must hold exactly one value, got shape {list(arr.shape)}")
    accepted, what = _KINDS[kind]
    if arr.dtype.kind not in accepted:
        raise RequestError(f"input '{name}' has dtype {arr.dtype}, expected {what}")
    v = arr.reshape(-1)[0].item()
    return float(v) if kind == "f" else v


def _int_list(get: Getter, name: str) -> list[int] | None:
    arr = get(name)
    if arr is None:
        return None
    arr = np.asarray(arr)
    if arr.dtype.kind not in "iu":
        raise RequestError(f"input '{name}' has dtype {arr.dtype}, expected integer token ids")
    return [int(t) for t in arr.reshape(-1)]


def parse_request(get: Getter, encode: Callable[[str], list[int]] | None,
                  default_max_tokens: int = 64, max_seq_len: int | None = None) -> ServingRequest:
    """Build a ``ServingRequest`` from input tensors; raises ``RequestError`` naming the bad input.

    ``get(name)`` returns the input as a numpy array or None when absent; ``encode`` tokenizes text
    (None when the model has no tokenizer); ``max_seq_len``: the model's context, which the prompt
    plus ``max_tokens`` must fit.
    """
    text = get("text_input")
    ids = _int_list(get, "input_ids")
    if text is not None and ids is not None:
        raise RequestError("give either 'text_input' or 'input_ids', not both")
    if text is None and ids is None:
        raise RequestError("missing input: 'text_input' (string) or 'input_ids' (int32 token ids) is required")
    if text is not None:
        text = np.asarray(text, dtype=object).reshape(-1)
        if text.size != 1:
            raise RequestError(f"input 'text_input' must hold exactly one string, got {text.size}")
        if encode is None:
            raise RequestError("'text_input' given but this model has no tokenizer; send 'input_ids'")
        ids = list(encode(_text(text[0], "text_input")))
    stop_arr = get("stop")
    stop = [_text(s, "stop") for s in np.asarray(stop_arr, dtype=object).reshape(-1)] if stop_arr is not None else []
    if any(s == "" for s in stop):
        raise RequestError("input 'stop' contains an empty string")
    if stop and encode is None:
        raise RequestError("'stop' strings need a tokenizer; this model has none, use 'stop_ids'")
    seed = _scalar(get, "seed", "i", None)
    params = SamplingParams(
        temperature=_scalar(get, "temperature", "f", 0.0),
        top_p=_scalar(get, "top_p", "f", 1.0),
        max_new_tokens=_scalar(get, "max_tokens", "i", default_max_tokens),
        seed=seed,
        stop_token_ids=_int_list(get, "stop_ids") or [],
    )
    if params.max_new_tokens <= 0:
        raise RequestError(f"max_tokens must be a positive integer, got {params.max_new_tokens}")
    if max_seq_len is not None and len(ids) + params.max_new_tokens > max_seq_len:
        raise RequestError(f"prompt ({len(ids)} tokens) + max_tokens ({params.max_new_tokens}) = "
                           f"{len(ids) + params.max_new_tokens} exceeds max_seq_len {max_seq_len}")
    params.validate()
    return ServingRequest(ids, params, bool(_scalar(get, "stream", "b", False)), stop)
