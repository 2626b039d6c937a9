"""A real OpenAI-compatible server on loopback for the serving tests: ``OpenAIServer`` over an
``LLM`` in a uvicorn thread of the test process (so tests can look at its scheduler and KV pages).
Import it after the test module's ``importorskip`` of openai / fastapi / uvicorn."""
from __future__ import annotations

from contextlib import contextmanager

from dspark_trt.commands.common import default_pair_dirs
from dspark_trt.openai_server.app import OpenAIServer, build_app
from dspark_trt.openai_server.chat_template import ChatTemplate
from dspark_trt.openai_server.launch import UvicornThread
from dspark_trt.runtime.llm import LLM


def default_pair_llm(**kw) -> LLM:
    """The built-in default pair as ``LLM.from_checkpoints`` loads it (``kw``: its options)."""
    target, draft = default_pair_dirs()
    return LLM.from_checkpoints(target, draft, **kw)


def default_pair_template() -> ChatTemplate:
    return ChatTemplate.from_dir(default_pair_dirs()[0])


@contextmanager
def serving(llm: LLM, model_name: str, chat_template: ChatTemplate | None = None, **app_kw):
    """-> (server, thread) while the server runs (``thread.url``); stopped on exit. ``app_kw``:
    ``build_app``'s options (body limit, API key)."""
    server = OpenAIServer(llm, model_name=model_name, chat_template=chat_template)
    thread = UvicornThread(build_app(server, **app_kw)).start()
    try:
        yield server, thread
    finally:
        thread.stop()
