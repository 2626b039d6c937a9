"""Validation of completion / chat-completion request bodies into a ``ParsedRequest``.

Every problem raises ``APIError`` (400, or 404 for an unknown model) naming the field. Fields the
runtime does not implement yet (``echo``, ``best_of``, ``logit_bias``, ...) are refused with a
400 unless they carry their neutral value, so a client never silently gets different sampling
than it asked for. ``logprobs`` (completions: an integer k; chat: a boolean with ``top_logprobs``
k) asks for the raw target logprobs of each token and its top k (k <= ``MAX_LOGPROBS``,
``runtime/logprobs.py``); ``n`` (<= ``MAX_N``) independent samples per prompt, and a list of
prompts on /v1/completions (<= ``MAX_PROMPTS``; choices prompt-major). ``top_k``, ``min_p`` and the presence / frequency / repetition penalties are
vLLM's (``SamplingParams``; lossless under speculative decoding, ``runtime/sampling_modifiers.py``).
"""
from __future__ import annotations

import json
import numbers
from dataclasses import dataclass, field

from ..runtime.sampling_params import MAX_LOGPROBS, VERIFY_MODES, SamplingParams
from .errors import APIError

# field -> its neutral value (accepted, ignored); any other value is refused as unsupported
NEUTRAL_UNSUPPORTED = {"echo": (None, False), "best_of": (None, 1),
                       "logit_bias": (None, {}), "suffix": (None, ""), "tools": (None, []),
                       "tool_choice": (None, "none"), "response_format": (None, {"type": "text"}),
                       "min_tokens": (None, 0)}
IGNORED = {"user", "metadata", "store", "service_tier", "parallel_tool_calls"}
COMMON = {"model", "max_tokens", "max_new_tokens", "temperature", "top_p", "seed", "stop",
          "stop_token_ids", "ignore_eos", "n", "stream", "stream_options", "return_token_ids",
          "verify_mode", "confidence_threshold",      # these two: dspark_trt's extension
          "top_k", "min_p", "presence_penalty", "frequency_penalty", "repetition_penalty", "logprobs"}
COMPLETION_FIELDS = COMMON | {"prompt"}
CHAT_FIELDS = COMMON | {"messages", "max_completion_tokens", "add_generation_prompt", "top_logprobs"}
MAX_STOP_STRINGS = 16
MAX_N = 16                    # samples per prompt
MAX_PROMPTS = 64              # prompts in one /v1/completions request
MAX_CHOICES = 64              # prompts x n


@dataclass
class ParsedRequest:
    """A validated request: the prompt (text or ids), sampling settings and response options."""

    prompt: str | list[int] | None = None            # completions: the first prompt
    prompts: list = field(default_factory=list)      # completions: every prompt (str or ids)
    messages: list[dict] | None = None               # chat
    add_generation_prompt: bool = True
    max_tokens: int | None = None                    # None: the server's default
    params: SamplingParams = field(default_factory=SamplingParams)
    stop: list[str] = field(default_factory=list)
    stream: bool = False
    include_usage: bool = False
    return_token_ids: bool = False
    n: int = 1                                       # samples per prompt


def parse_json(raw: bytes) -> dict:
    try:
        body = json.loads(raw)
    except (ValueError, UnicodeDecodeError) as e:
        raise APIError(f"the request body is not valid JSON: {e}") from None
    if not isinstance(body, dict):
        raise APIError(f"the request body must be a JSON object, got {type(body).__name__}")
    return body


def _is_int(x) -> bool:
    return isinstance(x, numbers.Integral) and not isinstance(x, bool)


def _is_number(x) -> bool:
    return isinstance(x, numbers.Real) and not isinstance(x, bool)


def _expect(body: dict, name: str, check, what: str):
    value = body.get(name)
    if value is not None and not check(value):
        raise APIError(f"'{name}' must be {what}, got {json.dumps(value)[:80]}", param=name)
    return value


def _check_fields(body: dict, allowed: set[str]) -> None:
    for name, value in body.items():
        if name in NEUTRAL_UNSUPPORTED:
            if value not in NEUTRAL_UNSUPPORTED[name]:
                raise APIError(f"'{name}' is not supported by this server yet (the runtime does not "
                               f"implement it); leave it out", param=name, code="unsupported_parameter")
        elif name not in allowed and name not in IGNORED:
            raise APIError(f"Unrecognized request argument supplied: {name}", param=name,
                           code="unrecognized_argument")


def check_model(body: dict, served_name: str) -> None:
    model = _expect(body, "model", lambda v: isinstance(v, str), "a string")
    if model is None:
        raise APIError("'model' is required", param="model")
    if model != served_name:
        raise APIError(f"The model '{model}' does not exist; this server serves '{served_name}'",
                       status=404, param="model", code="model_not_found")


def _logprobs(body: dict, chat: bool) -> int | None:
    """The top-k of logprobs asked for (None: no logprobs): completions ``logprobs`` = k; chat
    ``logprobs`` true with ``top_logprobs`` = k (default 0)."""
    if not chat:
        k = _expect(body, "logprobs", lambda v: _is_int(v) and v >= 0, "a non-negative integer")
        if k is not None and k > MAX_LOGPROBS:
            raise APIError(f"'logprobs' = {k}: at most {MAX_LOGPROBS} are allowed", param="logprobs")
        return k
    want = _expect(body, "logprobs", lambda v: isinstance(v, bool), "a boolean")
    k = _expect(body, "top_logprobs", lambda v: _is_int(v) and v >= 0, "a non-negative integer")
    if k is not None and k > MAX_LOGPROBS:
        raise APIError(f"'top_logprobs' = {k}: at most {MAX_LOGPROBS} are allowed", param="top_logprobs")
    if k and not want:
        raise APIError("'top_logprobs' needs 'logprobs': true", param="top_logprobs")
    return (k or 0) if want else None


def _common(body: dict, req: ParsedRequest) -> None:
    n = _expect(body, "n", lambda v: _is_int(v) and v >= 1, "a positive integer")
    if n is not None and n > MAX_N:
        raise APIError(f"'n' = {n}: at most {MAX_N} samples per prompt are allowed", param="n")
    req.n = n or 1
    if len(req.prompts or [None]) * req.n > MAX_CHOICES:
        raise APIError(f"{len(req.prompts)} prompts x n = {req.n} choices: at most {MAX_CHOICES} per "
                       "request", param="n")
    max_tokens = None
    for name in ("max_tokens", "max_new_tokens", "max_completion_tokens"):
        value = _expect(body, name, lambda v: _is_int(v) and v > 0, "a positive integer")
        if value is not None:
            max_tokens = value
    req.max_tokens = max_tokens
    temperature = _expect(body, "temperature", lambda v: _is_number(v) and 0 <= v <= 2, "a number in [0, 2]")
    top_p = _expect(body, "top_p", lambda v: _is_number(v) and 0 < v <= 1, "a number in (0, 1]")
    seed = _expect(body, "seed", lambda v: _is_int(v) and 0 <= v < 2**63, "an integer in [0, 2**63)")
    stop = _expect(body, "stop", lambda v: isinstance(v, str) or (
        isinstance(v, list) and all(isinstance(s, str) for s in v)), "a string or a list of strings")
    stop = [stop] if isinstance(stop, str) else list(stop or [])
    if len(stop) > MAX_STOP_STRINGS:
        raise APIError(f"'stop' has {len(stop)} strings, at most {MAX_STOP_STRINGS} are allowed", param="stop")
    stop_ids = _expect(body, "stop_token_ids", lambda v: isinstance(v, list) and all(
        _is_int(t) and t >= 0 for t in v), "a list of non-negative integers")
    ignore_eos = _expect(body, "ignore_eos", lambda v: isinstance(v, bool), "a boolean")
    req.stream = bool(_expect(body, "stream", lambda v: isinstance(v, bool), "a boolean"))
    options = _expect(body, "stream_options", lambda v: isinstance(v, dict), "an object")
    if options:
        if not req.stream:
            raise APIError("'stream_options' is only allowed when 'stream' is true", param="stream_options")
        include = options.get("include_usage")
        if include is not None and not isinstance(include, bool):
            raise APIError("'stream_options.include_usage' must be a boolean", param="stream_options")
        req.include_usage = bool(include)
    req.return_token_ids = bool(_expect(body, "return_token_ids", lambda v: isinstance(v, bool), "a boolean"))
    verify_mode = _expect(body, "verify_mode", lambda v: v in VERIFY_MODES,
                          f"one of {', '.join(VERIFY_MODES)}")
    threshold = _expect(body, "confidence_threshold", lambda v: _is_number(v) and 0 <= v <= 1,
                        "a number in [0, 1]")
    top_k = _expect(body, "top_k", lambda v: _is_int(v) and v >= -1, "an integer >= -1 (-1 or 0: off)")
    min_p = _expect(body, "min_p", lambda v: _is_number(v) and 0 <= v <= 1, "a number in [0, 1]")
    penalties = {name: _expect(body, name, lambda v: _is_number(v) and -2 <= v <= 2, "a number in [-2, 2]")
                 for name in ("presence_penalty", "frequency_penalty")}
    repetition = _expect(body, "repetition_penalty", lambda v: _is_number(v) and 0 < v < float("inf"),
                         "a number > 0 (1: off)")
    req.stop = stop
    req.params = SamplingParams(temperature=float(0.0 if temperature is None else temperature),
                                top_p=float(1.0 if top_p is None else top_p), seed=seed,
                                stop_token_ids=list(stop_ids or []), ignore_eos=bool(ignore_eos),
                                verify_mode=verify_mode or "fixed",
                                confidence_threshold=float(0.5 if threshold is None else threshold),
                                top_k=int(-1 if top_k is None else top_k),
                                min_p=float(min_p or 0.0),
                                **{k: float(v or 0.0) for k, v in penalties.items()},
                                repetition_penalty=float(1.0 if repetition is None else repetition),
                                logprobs=_logprobs(body, req.messages is not None))


def _one_prompt(prompt, where: str):
    if isinstance(prompt, str):
        if not prompt:
            raise APIError(f"{where} is empty", param="prompt")
        return prompt
    if isinstance(prompt, list) and prompt and all(_is_int(t) for t in prompt):
        return [int(t) for t in prompt]
    raise APIError(f"{where} must be a non-empty string or a list of token ids", param="prompt")


def parse_completion(body: dict, served_name: str) -> ParsedRequest:
    """``POST /v1/completions``: ``prompt`` is a string, a list of token ids, or a list of those
    (several prompts: their choices are prompt-major, index = prompt * n + sample)."""
    _check_fields(body, COMPLETION_FIELDS)
    check_model(body, served_name)
    req = ParsedRequest()
    prompt = body.get("prompt")
    if isinstance(prompt, list) and prompt and all(isinstance(p, (str, list)) for p in prompt):
        if len(prompt) > MAX_PROMPTS:
            raise APIError(f"'prompt' has {len(prompt)} prompts, at most {MAX_PROMPTS} are allowed",
                           param="prompt")
        req.prompts = [_one_prompt(p, f"prompt[{i}]") for i, p in enumerate(prompt)]
    else:
        req.prompts = [_one_prompt(prompt, "'prompt'")]
    req.prompt = req.prompts[0]
    _common(body, req)
    return req


def _message_text(content, index: int) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):                            # [{"type": "text", "text": ...}, ...]
        parts = []
        for part in content:
            if not (isinstance(part, dict) and part.get("type") == "text" and isinstance(part.get("text"), str)):
                raise APIError(f"messages[{index}].content: only text parts are supported",
                               param="messages")
            parts.append(part["text"])
        return "".join(parts)
    raise APIError(f"messages[{index}].content must be a string or a list of text parts", param="messages")


def parse_chat(body: dict, served_name: str) -> ParsedRequest:
    """``POST /v1/chat/completions``: ``messages`` is a non-empty list of {role, content}."""
    _check_fields(body, CHAT_FIELDS)
    check_model(body, served_name)
    messages = body.get("messages")
    if not isinstance(messages, list):
        raise APIError("'messages' must be a list of {role, content} objects", param="messages")
    if not messages:
        raise APIError("'messages' is empty: give at least one message", param="messages")
    clean = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise APIError(f"messages[{i}] must be an object with a string 'role'", param="messages")
        clean.append({**m, "content": _message_text(m.get("content"), i)})
    req = ParsedRequest(messages=clean)
    agp = _expect(body, "add_generation_prompt", lambda v: isinstance(v, bool), "a boolean")
    req.add_generation_prompt = True if agp is None else agp
    _common(body, req)
    return req
