"""Chat templates: where they are found and how they render (HF semantics)."""
from __future__ import annotations

import json

import pytest

pytest.importorskip("jinja2")
pytest.importorskip("fastapi")

from dspark_trt.commands.common import default_pair_dirs  # noqa: E402
from dspark_trt.openai_server.chat_template import ChatTemplate  # noqa: E402
from dspark_trt.openai_server.errors import APIError  # noqa: E402

MESSAGES = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"},
            {"role": "user", "content": "bye"}]
QWEN_LIKE = ("{% for m in messages %}{{ bos_token }}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
             "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def test_default_pair_ships_a_template():
    template = ChatTemplate.from_dir(default_pair_dirs()[0])
    assert template.render(MESSAGES) == "user: hi\nassistant: hello\nuser: bye\nassistant:"
    assert template.render(MESSAGES, add_generation_prompt=False) == "user: hi\nassistant: hello\nuser: bye\n"


def test_tokenizer_config_string_with_special_tokens(tmp_path):
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(
        {"chat_template": QWEN_LIKE, "bos_token": {"content": "<s>"}, "eos_token": "</s>"}))
    out = ChatTemplate.from_dir(tmp_path).render(MESSAGES[:1])
    assert out == "<s><|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"


def test_jinja_file_wins_over_tokenizer_config_and_named_list_uses_default(tmp_path):
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"chat_template": [
        {"name": "tool_use", "template": "TOOLS"}, {"name": "default", "template": "DEFAULT"}]}))
    assert ChatTemplate.from_dir(tmp_path).render(MESSAGES) == "DEFAULT"
    (tmp_path / "chat_template.jinja").write_text("FILE {{ messages | length }}")
    assert ChatTemplate.from_dir(tmp_path).render(MESSAGES) == "FILE 3"


def test_no_template_is_none_and_raise_exception_is_a_400(tmp_path):
    assert ChatTemplate.from_dir(tmp_path) is None
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"eos_token": "</s>"}))
    assert ChatTemplate.from_dir(tmp_path) is None
    strict = ChatTemplate("{% if messages[0]['role'] != 'system' %}{{ raise_exception('system first') }}{% endif %}")
    with pytest.raises(APIError, match="system first") as e:
        strict.render(MESSAGES)
    assert e.value.status == 400 and e.value.param == "messages"


def test_templates_run_sandboxed():
    evil = ChatTemplate("{{ messages.__class__.__mro__[1].__subclasses__() }}")
    with pytest.raises(APIError):
        evil.render(MESSAGES)
