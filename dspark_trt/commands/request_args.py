"""``generate``'s request options checked before any model loads (``RequestError``, exit code 2)."""
from __future__ import annotations

from ..runtime.prompts import check_text
from ..runtime.sampling_params import RequestError, SamplingParams
from ..config import ConfigError
from ..config.source import ModelSource, source_context


def parse_prompt_ids(text: str) -> list[int]:
    """``"1, 2,3"`` -> [1, 2, 3]; empty entries, non-integers and negative ids are errors."""
    parts = [p.strip() for p in text.split(",")]
    if not any(parts):
        raise RequestError(f"--prompt-ids {text!r}: no token ids (expected e.g. 1,2,3)")
    ids = []
    for p in parts:
        try:
            ids.append(int(p))
        except ValueError:
            raise RequestError(f"--prompt-ids {text!r}: {p!r} is not an integer token id") from None
        if ids[-1] < 0:
            raise RequestError(f"--prompt-ids {text!r}: token id {ids[-1]} is negative")
    return ids


def check_generate_args(args, params: SamplingParams) -> list[int] | str | None:
    """Validate ``params`` and the prompt options; -> the prompt (ids, text, or None for the
    default). Also refuses a request that cannot fit --max-seq-len (when it is known here)."""
    params.validate()
    if args.prompt is not None and args.prompt_ids is not None:
        raise RequestError("give --prompt or --prompt-ids, not both")
    prompt = check_text(args.prompt) if args.prompt is not None else None
    if args.prompt_ids is not None:
        prompt = parse_prompt_ids(args.prompt_ids)
    max_seq_len = args.max_seq_len                          # None: an engine's own, else at most
    if max_seq_len is None:                                 # the model's context (the KV cache can
        try:                                                # cap it: checked again after loading)
            max_seq_len = source_context(ModelSource.from_args(args))
        except ConfigError:
            max_seq_len = None                              # an unknown preset: said at load
    if max_seq_len is not None:
        n = len(prompt) if isinstance(prompt, list) else 1          # text: at least one token
        if n + params.max_new_tokens > max_seq_len:
            what = f"prompt ({n} tokens)" if isinstance(prompt, list) else "a prompt of >= 1 token"
            raise RequestError(f"{what} + max_new_tokens ({params.max_new_tokens}) exceeds "
                               f"max_seq_len {int(max_seq_len)} (--max-seq-len; default: the model's "
                               "context)")
    return prompt
