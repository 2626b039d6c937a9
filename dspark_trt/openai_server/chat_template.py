"""Chat templates with Hugging Face semantics, rendered by jinja2.

The template comes from the checkpoint directory: ``chat_template.jinja`` beside the weights, or
``chat_template`` in ``tokenizer_config.json`` (a string, or HF's list of named templates, of which
"default" is used). Variables: ``messages``, ``add_generation_prompt``, and ``bos_token`` /
``eos_token`` where tokenizer_config.json names them; ``raise_exception`` as in transformers.
"""
from __future__ import annotations

import json
from pathlib import Path

from .errors import APIError


class TemplateError(Exception):
    """The template itself failed (``raise_exception`` or a jinja2 error)."""


def _special_token(value) -> str | None:
    """tokenizer_config.json stores special tokens as strings or as {"content": ...} objects."""
    if isinstance(value, dict):
        return value.get("content")
    return value if isinstance(value, str) else None


class ChatTemplate:
    def __init__(self, source: str, bos_token: str | None = None, eos_token: str | None = None):
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        def raise_exception(message):
            raise TemplateError(message)
        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
        env.globals["raise_exception"] = raise_exception
        self.template = env.from_string(source)
        self.special = {k: v for k, v in (("bos_token", bos_token), ("eos_token", eos_token)) if v}

    @classmethod
    def from_dir(cls, directory: str | Path | None) -> "ChatTemplate | None":
        """The template of a checkpoint / engine directory, or None when it has none."""
        if directory is None:
            return None
        directory = Path(directory)
        config = {}
        if (directory / "tokenizer_config.json").exists():
            config = json.loads((directory / "tokenizer_config.json").read_text())
        source = None
        if (directory / "chat_template.jinja").exists():
            source = (directory / "chat_template.jinja").read_text()
        elif isinstance(config.get("chat_template"), str):
            source = config["chat_template"]
        elif isinstance(config.get("chat_template"), list):        # [{"name", "template"}, ...]
            named = {t.get("name"): t.get("template") for t in config["chat_template"]}
            source = named.get("default")
        if not source:
            return None
        return cls(source, _special_token(config.get("bos_token")), _special_token(config.get("eos_token")))

    def render(self, messages: list[dict], add_generation_prompt: bool = True) -> str:
        """The prompt text; a template error becomes a 400 (it usually means bad messages)."""
        from jinja2 import TemplateError as JinjaError
        try:
            return self.template.render(messages=messages, add_generation_prompt=add_generation_prompt,
                                        **self.special)
        except (TemplateError, JinjaError) as e:
            raise APIError(f"the chat template rejected the messages: {e}", param="messages") from None
