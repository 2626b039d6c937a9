"""Prompts as users pass them to ``LLM``: text, token ids (list, tuple, 1-D integer numpy array or
torch tensor), or a list of those. Anything else is a ``RequestError`` naming the type."""
from __future__ import annotations

import numbers

import numpy as np
import torch

from .sampling_params import RequestError

ARRAYS = (np.ndarray, torch.Tensor)


def _is_token(x) -> bool:
    return isinstance(x, numbers.Integral) and not isinstance(x, bool)


def _describe(x) -> str:
    if isinstance(x, ARRAYS):
        return f"{type(x).__module__.split('.')[0]}.{type(x).__name__} of dtype {x.dtype} and shape {tuple(x.shape)}"
    return type(x).__name__


def is_single_prompt(prompts) -> bool:
    """True for one prompt (text, ids, 1-D array), False for a list / tuple of prompts."""
    if isinstance(prompts, (str, *ARRAYS)):
        return True
    if isinstance(prompts, (list, tuple)):                # ids (checked by token_ids) or prompts
        return bool(prompts) and not any(isinstance(p, (str, list, tuple, *ARRAYS)) for p in prompts)
    raise RequestError(f"prompts must be a string, a list of token ids, a 1-D integer array or a "
                       f"list of those; got {_describe(prompts)}")


def check_text(text: str) -> str:
    """``text`` if it can be encoded as UTF-8 (no lone surrogates, e.g. from undecodable argv)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise RequestError(f"prompt is not valid UTF-8 text (character {e.start}: "
                           f"{text[e.start]!r}; undecodable bytes?)") from None
    return text


def token_ids(prompt) -> list[int]:
    """A token-id prompt as a list of ints: integers only, arrays 1-D with an integer dtype."""
    if isinstance(prompt, ARRAYS):
        if isinstance(prompt, torch.Tensor):
            integer = not (prompt.is_floating_point() or prompt.is_complex() or prompt.dtype == torch.bool)
        else:
            integer = np.issubdtype(prompt.dtype, np.integer)
        if prompt.ndim != 1 or not integer:
            raise RequestError(f"a prompt array must be 1-D with an integer dtype (token ids); got "
                               f"{_describe(prompt)}")
        return [int(t) for t in prompt.tolist()]
    if not isinstance(prompt, (list, tuple)):
        raise RequestError(f"a prompt must be text or token ids; got {_describe(prompt)}")
    bad = next((t for t in prompt if not _is_token(t)), None)
    if bad is not None:
        raise RequestError(f"token ids must be integers; got {_describe(bad)} {bad!r}")
    return [int(t) for t in prompt]
