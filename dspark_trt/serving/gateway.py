"""The public HTTP endpoint of ``dspark-trt serve --triton``: a small proxy in front of tritonserver's HTTP.

Why it exists: tritonserver 2.51's HTTP front end (libevhtp) dies with SIGSEGV on a body of a few
MB sent as ``application/x-www-form-urlencoded`` (curl ``-d``'s default and urllib's): evhtp parses
such a body as a query string on its thread's stack (``evhtp_parse_query_wflags``; cf.
triton-inference-server/server#5840), and 2.51 has no option to limit request sizes. Its JSON
errors also come back as 500, and integers silently wrap into INT32.

The gateway (stdlib ``http.server``, one thread per connection; Triton's HTTP port stays on
loopback behind it):

* answers 413 to a body over ``max_request_bytes`` before reading it (411 without a
  Content-Length), and forwards every body as ``application/json``, so evhtp never parses a form;
* checks ``/generate`` and ``/generate_stream`` bodies (``generate_body``) and answers 400 naming
  the field;
* returns ``output_ids`` and ``acceptance_per_position`` as JSON lists even with one element
  (Triton writes a one-element tensor as a bare number);
* answers 503 while the supervisor says the model is unavailable (``health``), and turns an
  upstream failure of an in-flight request (the supervisor killed a broken server) into a 503
  error, or a final ``data: {"error": ...}`` event on a stream, instead of a hang.
"""
from __future__ import annotations

import http.client
import json
import logging
import re
import socket
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Callable
from urllib.parse import urlsplit

from .generate_body import BadRequest, check_generate_body

log = logging.getLogger(__name__)

GENERATE = re.compile(r"^/v2/models/[^/]+(?:/versions/[^/]+)?/(generate|generate_stream)$")
LIST_OUTPUTS = ("output_ids", "acceptance_per_position")
# headers that describe one connection, not the message (RFC 9110 7.6.1), or that we set ourselves
HOP_BY_HOP = {"connection", "keep-alive", "proxy-connection", "te", "trailer", "transfer-encoding",
              "upgrade", "host", "content-length", "proxy-authenticate", "proxy-authorization", "expect"}
DRAIN_LIMIT = 64 << 20          # an oversized body is read and dropped up to this, so the 413 arrives
Health = Callable[[], "tuple[bool, str]"]


class _Server(ThreadingHTTPServer):
    daemon_threads = True            # a stuck connection never holds up shutdown
    request_queue_size = 1024        # listen backlog (socketserver's 5 resets bursts of clients)

    def handle_error(self, request, client_address) -> None:
        """A connection that broke mid-request (reset, timeout): one log line, not a traceback."""
        log.info("connection from %s ended with %s", client_address[0], sys.exc_info()[1])


class HttpGateway:
    """Serve ``host:port`` and forward to Triton's HTTP at ``upstream`` (``host:port``; may be set
    after construction, before ``start``).

    ``health()`` -> (available, reason); ``client_timeout``: seconds a client socket may stall
    (reading a request, or taking a response); ``upstream_timeout``: seconds to wait on Triton
    for a response (the whole generation for /generate, the gap between chunks for a stream).
    """

    def __init__(self, upstream: str | None, *, host: str = "127.0.0.1", port: int = 0,
                 max_request_bytes: int = 1 << 20, health: Health = lambda: (True, ""),
                 client_timeout: float = 60.0, upstream_timeout: float = 600.0):
        self.upstream = upstream
        self.max_request_bytes, self.health = max_request_bytes, health
        self.upstream_timeout = upstream_timeout
        self._connections = 0
        self._idle = threading.Condition()
        handler = type("Handler", (_Handler,), {"gateway": self, "timeout": client_timeout})
        self.httpd = _Server((host, port), handler)
        self.thread = threading.Thread(target=self.httpd.serve_forever, kwargs={"poll_interval": 0.2},
                                       name="dspark-http-gateway", daemon=True)

    @property
    def url(self) -> str:
        host, port = self.httpd.server_address[:2]
        return f"http://{host}:{port}"

    def start(self) -> "HttpGateway":
        self.thread.start()
        return self

    def stop(self) -> None:
        """Stop accepting; connections in flight end when Triton stops (their threads are daemons)."""
        if self.thread.is_alive():
            self.httpd.shutdown()
            self.thread.join(5)
        self.httpd.server_close()

    def wait_idle(self, timeout: float) -> bool:
        """Wait until no connection is open (e.g. until each got its error after Triton stopped)."""
        with self._idle:
            return self._idle.wait_for(lambda: self._connections == 0, timeout)

    def _count(self, delta: int) -> None:
        with self._idle:
            self._connections += delta
            self._idle.notify_all()

    def upstream_connection(self) -> http.client.HTTPConnection:
        host, port = self.upstream.rsplit(":", 1)
        return http.client.HTTPConnection(host, int(port), timeout=self.upstream_timeout)


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    gateway: HttpGateway                                # set by HttpGateway
    server_version = "dspark-gateway"

    def handle(self) -> None:
        self.gateway._count(+1)
        try:
            super().handle()
        finally:
            self.gateway._count(-1)

    def do_GET(self) -> None:
        self._handle()

    def handle_expect_100(self) -> bool:
        """``Expect: 100-continue`` (curl, for large bodies): refuse an oversized body before it is sent."""
        length = self._declared_length()
        if length is not None and length > self.gateway.max_request_bytes:
            self.close_connection = True
            self._error(413, self._too_large(length))
            return False
        return super().handle_expect_100()

    def do_POST(self) -> None:
        self._handle()

    def log_message(self, format: str, *args) -> None:  # noqa: A002 (the base class's name)
        log.debug("%s " + format, self.address_string(), *args)

    # ---- one request ----------------------------------------------------------------------------
    def _handle(self) -> None:
        g = self.gateway
        body = self._read_body()
        if body is None:
            return
        available, reason = g.health()
        if not available:
            return self._error(503, f"the model is unavailable: {reason}")
        route = GENERATE.match(urlsplit(self.path).path)
        if route:
            if self.headers.get("Content-Encoding", "identity").lower() != "identity":
                return self._error(415, "send generate bodies uncompressed (no Content-Encoding)")
            try:
                check_generate_body(body, stream_endpoint=route.group(1) == "generate_stream")
            except BadRequest as e:
                return self._error(400, str(e))
        headers = {k: v for k, v in self.headers.items() if k.lower() not in HOP_BY_HOP}
        if route:                                       # plain JSON back, so list outputs can be fixed
            headers = {k: v for k, v in headers.items() if k.lower() != "accept-encoding"}
        if self.command == "POST" and not self._keeps_content_type():
            headers = {k: v for k, v in headers.items() if k.lower() != "content-type"}
            headers["Content-Type"] = "application/json"     # never a form: evhtp would parse it
        conn = g.upstream_connection()
        try:
            try:
                conn.request(self.command, self.path, body=body if self.command == "POST" else None,
                             headers=headers)
                resp = conn.getresponse()
            except (OSError, ValueError, http.client.HTTPException) as e:
                return self._upstream_failed(e)
            if route and route.group(1) == "generate_stream" and resp.status == 200:
                self._relay_stream(resp)
            else:
                self._relay(resp, normalize=bool(route))
        finally:
            conn.close()

    def _keeps_content_type(self) -> bool:
        """Binary-tensor /infer bodies keep their type; anything a form parser would take does not."""
        ctype = self.headers.get("Content-Type", "").split(";")[0].strip().lower()
        return ctype in ("application/json", "application/octet-stream")

    def _read_body(self) -> bytes | None:
        """The body, or None after answering 411/413/400 (the connection is then closed)."""
        if "Transfer-Encoding" in self.headers:
            self.close_connection = True
            self._error(411, "send the body with a Content-Length (chunked bodies are not accepted)")
            return None
        length = self._declared_length()
        if length is None:
            self.close_connection = True
            self._error(400, "bad Content-Length")
            return None
        if length > self.gateway.max_request_bytes:
            self.close_connection = True
            self._drain(length)
            self._error(413, self._too_large(length))
            return None
        return self.rfile.read(length) if length else b""

    def _declared_length(self) -> int | None:
        try:
            length = int(self.headers.get("Content-Length", "0"))
        except ValueError:
            return None
        return length if length >= 0 else None

    def _too_large(self, length: int) -> str:
        return (f"the request body has {length} bytes, over the limit of {self.gateway.max_request_bytes} "
                "bytes (dspark-trt serve --triton --max-request-bytes)")

    def _drain(self, length: int) -> None:
        """Read and drop an oversized body (bounded), so the client gets to read our 413."""
        left = min(length, DRAIN_LIMIT)
        try:
            while left > 0:
                chunk = self.rfile.read1(min(left, 1 << 16))
                if not chunk:
                    break
                left -= len(chunk)
        except OSError:
            pass

    # ---- responses ------------------------------------------------------------------------------
    def _relay(self, resp: http.client.HTTPResponse, normalize: bool) -> None:
        try:
            data = resp.read()
        except (OSError, ValueError, http.client.HTTPException) as e:
            return self._upstream_failed(e)
        if normalize and resp.status == 200:
            data = _lists_in_json(data)
        self.send_response(resp.status)
        for k, v in resp.getheaders():
            if k.lower() not in HOP_BY_HOP:
                self.send_header(k, v)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def _relay_stream(self, resp: http.client.HTTPResponse) -> None:
        """Server-sent events, event by event; the body ends when the connection closes."""
        self.close_connection = True
        self.send_response(resp.status)
        for k, v in resp.getheaders():
            if k.lower() not in HOP_BY_HOP:
                self.send_header(k, v)
        self.send_header("Connection", "close")
        self.end_headers()
        pending = b""
        try:
            while True:
                try:
                    chunk = resp.read1(1 << 16)
                    if not chunk and resp.length:                # fewer bytes than announced
                        raise http.client.IncompleteRead(pending, resp.length)
                except (OSError, ValueError, http.client.HTTPException) as e:
                    self.wfile.write(_sse_error(_upstream_message(e, self.gateway.health())))   # a cut event is dropped
                    return
                if not chunk:
                    if pending:
                        self.wfile.write(pending)
                    return
                pending += chunk
                *events, pending = pending.split(b"\n\n")
                if events:
                    self.wfile.write(b"".join(_lists_in_event(e) + b"\n\n" for e in events))
                    self.wfile.flush()
        except (OSError, socket.timeout):                # the client went away or stopped reading
            log.info("stream client %s gone or stalled; dropping its stream", self.address_string())

    def _upstream_failed(self, e: Exception) -> None:
        self.close_connection = True
        self._error(503, _upstream_message(e, self.gateway.health()))

    def _error(self, status: int, message: str) -> None:
        data = json.dumps({"error": message}).encode()
        try:
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            if self.close_connection:
                self.send_header("Connection", "close")
            self.end_headers()
            self.wfile.write(data)
        except OSError:
            self.close_connection = True


def _upstream_message(e: Exception, health: tuple[bool, str]) -> str:
    available, reason = health
    why = f"{type(e).__name__}: {e}" if str(e) else type(e).__name__
    if isinstance(e, (socket.timeout, TimeoutError)):
        return f"no answer from the model server in time ({why})"
    return ("the model server failed while handling this request "
            f"({why}{'' if available else '; ' + reason}); retry later")


def _sse_error(message: str) -> bytes:
    return b"data: " + json.dumps({"error": message}).encode() + b"\n\n"


def _lists_in_json(data: bytes) -> bytes:
    try:
        obj = json.loads(data)
    except ValueError:
        return data
    if isinstance(obj, dict):
        for name in LIST_OUTPUTS:
            if name in obj and not isinstance(obj[name], list):
                obj[name] = [obj[name]]
    return json.dumps(obj, ensure_ascii=False).encode()


def _lists_in_event(event: bytes) -> bytes:
    """One server-sent event; its ``data:`` line's JSON with list outputs as lists."""
    lines = event.split(b"\n")
    return b"\n".join(b"data: " + _lists_in_json(line[5:].strip()) if line.startswith(b"data:") else line
                      for line in lines)
