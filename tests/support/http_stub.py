"""A stand-in HTTP server on loopback for the serving tests (gateway upstream, probe endpoint)."""
from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


def serve_in_thread(handler: type[BaseHTTPRequestHandler]) -> ThreadingHTTPServer:
    """``handler`` served on 127.0.0.1 at a free port from a daemon thread (shut it down after)."""
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    httpd.daemon_threads = True
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    return httpd


def send_json(handler: BaseHTTPRequestHandler, status: int, body, content_type: str | None = None) -> None:
    """One complete JSON response (``Content-Type`` only when given)."""
    data = json.dumps(body).encode()
    handler.send_response(status)
    if content_type:
        handler.send_header("Content-Type", content_type)
    handler.send_header("Content-Length", str(len(data)))
    handler.end_headers()
    handler.wfile.write(data)
