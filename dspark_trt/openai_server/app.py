"""The FastAPI app: OpenAI's completions / chat completions / models, plus health and metrics.

``OpenAIServer`` holds the model, the engine thread, the chat template and the metrics;
``build_app`` returns the ASGI app (body size limit and API key middleware around FastAPI).
Streaming responses are server-sent events ending in ``data: [DONE]``; every response's
``usage`` counts prompt and completion tokens and ``dspark`` gives the request's speculative
statistics (tau, acceptance per draft position, accepted / proposed / committed tokens).
"""
from __future__ import annotations

import asyncio
import dataclasses
import json
import time
import uuid
from contextlib import asynccontextmanager

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.exceptions import HTTPException as StarletteHTTPException

from ..runtime.sampling_params import RequestError
from .chat_template import ChatTemplate
from .engine import EngineThread
from .errors import APIError, error_body
from .generation import Delta, RequestRun, merge_runs, sample_seed, spec_summary, total_usage
from .metrics import ServerMetrics
from .middleware import BearerAuth, BodySizeLimit
from .protocol import ParsedRequest, parse_chat, parse_completion, parse_json

DEFAULT_COMPLETION_MAX_TOKENS = 16          # OpenAI's default for /v1/completions
DEFAULT_MAX_REQUEST_BYTES = 1 << 20
DISCONNECT_POLL_SECONDS = 0.5


class OpenAIServer:
    """What the endpoints share: ``llm``, its engine thread, the chat template, the metrics."""

    def __init__(self, llm, model_name: str = "dspark", chat_template: ChatTemplate | None = None,
                 speculative: bool = True):
        self.llm, self.model_name, self.chat_template = llm, model_name, chat_template
        self.created = int(time.time())
        num_spec = llm.networks.num_spec_tokens if speculative else 0
        self.metrics = ServerMetrics(model_name, num_spec)
        self.engine = EngineThread(llm, self.metrics, speculative)

    # ---- prompts -----------------------------------------------------------------------------
    def encode(self, prompt) -> list[int]:
        try:
            return self.llm.encode(prompt)
        except RequestError as e:
            raise APIError(str(e), param="prompt") from None

    def chat_prompt(self, req: ParsedRequest) -> str:
        if self.chat_template is None:
            raise APIError(f"model '{self.model_name}' has no chat template (no chat_template in "
                           "tokenizer_config.json and no chat_template.jinja): use /v1/completions",
                           param="messages", code="no_chat_template")
        return self.chat_template.render(req.messages, req.add_generation_prompt)

    def resolve_max_tokens(self, req: ParsedRequest, prompt_len: int, default: int | None) -> int:
        """``max_tokens`` as asked (400 if prompt + it exceeds the context) or the default: ``default``
        capped by the context, or the rest of the context."""
        context = self.llm.max_seq_len
        room = context - prompt_len
        if room <= 0:
            raise APIError(f"the prompt has {prompt_len} tokens; this model's maximum context length "
                           f"is {context} tokens", param="prompt" if req.messages is None else "messages")
        if req.max_tokens is None:
            return room if default is None else min(default, room)
        if req.max_tokens > room:
            raise APIError(f"This model's maximum context length is {context} tokens. However, you "
                           f"requested {prompt_len + req.max_tokens} tokens ({prompt_len} in the prompt, "
                           f"{req.max_tokens} in the completion)", param="max_tokens")
        return req.max_tokens

    # ---- responses ---------------------------------------------------------------------------
    async def respond(self, request: Request, req: ParsedRequest, prompts: list[list[int]], chat: bool):
        """Start ``n`` runs per prompt (choice index = prompt * n + sample), then answer with JSON
        or server-sent events."""
        runs = []
        for ids in prompts:
            max_tokens = self.resolve_max_tokens(req, len(ids), None if chat else DEFAULT_COMPLETION_MAX_TOKENS)
            for i in range(req.n):
                params = dataclasses.replace(req.params, max_new_tokens=max_tokens, max_tokens=max_tokens,
                                             seed=sample_seed(req.params.seed, i))
                runs.append(RequestRun(self.engine, self.metrics, self.llm.tokenizer, ids, params, req.stop))
        try:
            for run in runs:
                await run.start()
        except BaseException:
            for run in runs:                              # free what was admitted before
                self.engine.abort(run.handle, "abort")
            raise
        response_id = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex
        if req.stream:
            return StreamingResponse(self._sse(runs, prompts, req, response_id, chat),
                                     media_type="text/event-stream")
        deltas = await self._collect(request, runs)
        if deltas is None:                                # the client went away
            return Response(status_code=499)
        failed = next((r for r in runs if r.finish_reason == "error"), None)
        if failed is not None:
            raise APIError(failed.error or "generation failed", status=500, code="generation_error")
        choices = []
        for index, (run, ds) in enumerate(zip(runs, deltas)):
            text = "".join(d.text for d in ds)
            lp = self._logprobs(ds, chat) if req.params.logprobs is not None else None
            choice = ({"index": index, "message": {"role": "assistant", "content": text},
                       "finish_reason": run.finish_reason, "logprobs": lp} if chat else
                      {"index": index, "text": text, "finish_reason": run.finish_reason, "logprobs": lp})
            if req.return_token_ids:
                choice["token_ids"] = list(run.token_ids)
            choices.append(choice)
        return JSONResponse({"id": response_id, "object": "chat.completion" if chat else "text_completion",
                             "created": int(time.time()), "model": self.model_name, "choices": choices,
                             "usage": total_usage(runs, prompts), "dspark": self._spec(runs)})

    @staticmethod
    def _spec(runs: list[RequestRun]) -> dict:
        """The ``dspark`` field: the statistics of all the response's choices together."""
        stats = runs[0].stats
        for r in runs[1:]:
            stats = stats.merge(r.stats)
        return spec_summary(stats)

    # ---- logprobs (the raw target distribution, runtime/logprobs.py) ---------------------------
    def _token_text(self, token_id: int) -> str:
        tok = self.llm.tokenizer
        return tok.decode([token_id], skip_special_tokens=False) if tok is not None else str(token_id)

    def _logprobs(self, deltas: list[Delta], chat: bool, text_base: int = 0) -> dict:
        """OpenAI's logprobs object for the tokens of ``deltas``: chat ``{"content": [...]}``,
        completions ``{"tokens", "token_logprobs", "top_logprobs", "text_offset"}``."""
        entries = [(e, off) for d in deltas for e, off in zip(d.logprobs, d.offsets)]
        if chat:
            def item(token_id: int, logprob: float) -> dict:
                text = self._token_text(token_id)
                return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8"))}
            return {"content": [{**item(e.token_id, e.logprob),
                                 "top_logprobs": [item(i, v) for i, v in e.top]} for e, _ in entries],
                    "refusal": None}
        return {"tokens": [self._token_text(e.token_id) for e, _ in entries],
                "token_logprobs": [e.logprob for e, _ in entries],
                "top_logprobs": [{self._token_text(i): v for i, v in e.top} for e, _ in entries],
                "text_offset": [text_base + off for _, off in entries]}

    @staticmethod
    async def _collect(request: Request, runs: list[RequestRun]) -> list[list[Delta]] | None:
        """Every run's deltas; None if the client disconnected first (the sequences are aborted)."""
        deltas: list[list[Delta]] = [[] for _ in runs]

        async def consume():
            async for i, delta in merge_runs(runs):
                if delta is not None:
                    deltas[i].append(delta)
        task = asyncio.create_task(consume())
        while not task.done():
            await asyncio.wait({task}, timeout=DISCONNECT_POLL_SECONDS)
            if not task.done() and await request.is_disconnected():
                task.cancel()                             # the runs' finally aborts the sequences
                try:
                    await task
                except asyncio.CancelledError:
                    pass
                return None
        task.result()
        return deltas

    async def _sse(self, runs: list[RequestRun], prompts: list[list[int]], req: ParsedRequest,
                   response_id: str, chat: bool):
        """Server-sent events, the choices interleaved as their rounds arrive; a cancelled stream
        (client gone) aborts every sequence."""
        created = int(time.time())
        kind = "chat.completion.chunk" if chat else "text_completion"
        want_lp = req.params.logprobs is not None
        no_text = self.llm.tokenizer is None          # token ids only: one chunk per round anyway

        def event(choices: list, **extra) -> str:
            payload = {"id": response_id, "object": kind, "created": created, "model": self.model_name,
                       "choices": choices, **extra}
            return f"data: {json.dumps(payload)}\n\n"

        def choice(index: int, text: str | None, finish_reason=None, logprobs=None, **extra) -> dict:
            if chat:
                delta = {} if text is None else {"content": text}
                return {"index": index, "delta": delta, "finish_reason": finish_reason,
                        "logprobs": logprobs, **extra}
            return {"index": index, "text": text or "", "finish_reason": finish_reason,
                    "logprobs": logprobs, **extra}

        if chat:
            yield event([{"index": i, "delta": {"role": "assistant", "content": ""},
                          "finish_reason": None, "logprobs": None} for i in range(len(runs))])
        async for index, delta in merge_runs(runs):
            run = runs[index]
            if delta is not None:
                if delta.text or (want_lp and delta.logprobs) or (no_text and delta.token_ids):
                    lp = self._logprobs([delta], chat) if want_lp else None
                    extra = ({"token_ids": delta.token_ids} if no_text and req.return_token_ids else {})
                    yield event([choice(index, delta.text, logprobs=lp, **extra)])
            elif run.finish_reason == "error":
                yield f"data: {json.dumps(error_body(run.error or 'generation failed', 500))}\n\n"
                yield "data: [DONE]\n\n"
                return
            else:
                extra = {"token_ids": list(run.token_ids)} if req.return_token_ids else {}
                yield event([choice(index, None, run.finish_reason, **extra)],
                            dspark=spec_summary(run.stats))
        if req.include_usage:
            yield event([], usage=total_usage(runs, prompts), dspark=self._spec(runs))
        yield "data: [DONE]\n\n"


def build_app(server: OpenAIServer, max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES,
              api_key: str | None = None):
    """The ASGI app; the engine thread starts and stops with the app's lifespan."""

    @asynccontextmanager
    async def lifespan(_app):
        server.engine.start()
        try:
            yield
        finally:
            server.engine.stop()

    app = FastAPI(title="dspark-trt OpenAI-compatible server", lifespan=lifespan)
    app.state.server = server

    @app.exception_handler(APIError)
    async def api_error(_request, exc: APIError):
        return exc.response()

    @app.exception_handler(StarletteHTTPException)
    async def http_error(_request, exc: StarletteHTTPException):
        return JSONResponse(error_body(str(exc.detail), exc.status_code), status_code=exc.status_code)

    @app.exception_handler(RequestValidationError)
    async def validation_error(_request, exc: RequestValidationError):
        return JSONResponse(error_body(str(exc), 400), status_code=400)

    @app.exception_handler(Exception)
    async def internal_error(_request, exc: Exception):
        return JSONResponse(error_body(f"internal error: {exc}", 500), status_code=500)

    @app.get("/health")
    async def health():
        if not server.engine.is_alive():
            return JSONResponse(error_body("the engine thread is not running", 503), status_code=503)
        return {"status": "ok"}

    @app.get("/metrics")
    async def metrics():
        return Response(server.metrics.exposition(), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": server.model_name, "object": "model",
                                            "created": server.created, "owned_by": "dspark-trt",
                                            "max_model_len": server.llm.max_seq_len}]}

    @app.post("/v1/completions")
    async def completions(request: Request):
        req = parse_completion(parse_json(await request.body()), server.model_name)
        return await server.respond(request, req, [server.encode(p) for p in req.prompts], chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        req = parse_chat(parse_json(await request.body()), server.model_name)
        prompt_ids = server.encode(server.chat_prompt(req))
        return await server.respond(request, req, [prompt_ids], chat=True)

    wrapped = BodySizeLimit(app, max_request_bytes)
    if api_key:
        wrapped = BearerAuth(wrapped, api_key)
    return wrapped
