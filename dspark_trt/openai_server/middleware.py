"""ASGI middleware: request body size limit (413) and the optional API key (401).

Both answer with OpenAI-style error bodies before the app sees the request. The body limit
checks Content-Length and also counts the bytes of bodies sent without one (chunked); the body
read is replayed to the app, after which ``receive`` passes through (so disconnects still show).
"""
from __future__ import annotations

import hmac
import json

from .errors import error_body


async def _send_error(send, status: int, message: str, code: str | None = None,
                      headers: list | None = None) -> None:
    payload = json.dumps(error_body(message, status, code=code)).encode()
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"),
                            (b"content-length", str(len(payload)).encode()), *(headers or [])]})
    await send({"type": "http.response.body", "body": payload})


class BodySizeLimit:
    def __init__(self, app, max_bytes: int):
        self.app, self.max_bytes = app, max_bytes

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = dict(scope.get("headers") or [])
        length = headers.get(b"content-length")
        too_large = f"request body larger than {self.max_bytes} bytes"
        if length is not None and length.isdigit() and int(length) > self.max_bytes:
            return await _send_error(send, 413, too_large, "request_too_large")
        chunks, total = [], 0
        while True:
            message = await receive()
            if message["type"] != "http.request":        # disconnected while sending the body
                return
            chunks.append(message.get("body", b""))
            total += len(chunks[-1])
            if total > self.max_bytes:
                return await _send_error(send, 413, too_large, "request_too_large")
            if not message.get("more_body", False):
                break
        replayed = False

        async def replay():
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": b"".join(chunks), "more_body": False}
            return await receive()
        return await self.app(scope, replay, send)


class BearerAuth:
    """Paths under ``/v1/`` need ``Authorization: Bearer <api_key>`` (constant-time compare)."""

    def __init__(self, app, api_key: str):
        self.app, self.expected = app, f"Bearer {api_key}".encode()

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http" and scope["path"].startswith("/v1/"):
            given = dict(scope.get("headers") or []).get(b"authorization", b"")
            if not hmac.compare_digest(given, self.expected):
                return await _send_error(send, 401, "missing or wrong API key (Authorization: Bearer ...)",
                                         "invalid_api_key", [(b"www-authenticate", b"Bearer")])
        return await self.app(scope, receive, send)
