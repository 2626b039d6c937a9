"""One real inference request through tritonserver: is the model able to generate right now?

The probe asks the model for one token (``input_ids`` [0], ``max_tokens`` 1) on Triton's HTTP
``/generate``. It goes the whole way a client request goes (HTTP front end, python backend, stub,
the generation thread, the response sender), which a process check cannot see. The request
carries the parameter ``dspark_probe`` so the model leaves it out of its dspark_* metrics.
"""
from __future__ import annotations

import json
import socket
import urllib.error
import urllib.request
from dataclasses import dataclass

PROBE_PARAMETER = "dspark_probe"


@dataclass
class ProbeResult:
    ok: bool
    detail: str = ""             # why not, for the log and for clients
    timed_out: bool = False      # no answer in time (a busy model may just be slow)


def probe_model(http_url: str, model: str, timeout: float) -> ProbeResult:
    """Send the 1-token request to ``http_url`` (Triton's own HTTP, not the gateway)."""
    body = json.dumps({"input_ids": [0], "max_tokens": 1, PROBE_PARAMETER: True}).encode()
    req = urllib.request.Request(f"{http_url}/v2/models/{model}/generate", data=body, method="POST",
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            answer = json.loads(r.read())
    except urllib.error.HTTPError as e:
        return ProbeResult(False, f"HTTP {e.code}: {_error_text(e)}")
    except (socket.timeout, TimeoutError):
        return ProbeResult(False, f"no answer within {timeout:g} s", timed_out=True)
    except urllib.error.URLError as e:
        if isinstance(e.reason, (socket.timeout, TimeoutError)):
            return ProbeResult(False, f"no answer within {timeout:g} s", timed_out=True)
        return ProbeResult(False, f"cannot reach tritonserver: {e.reason}")
    except (OSError, ValueError) as e:
        return ProbeResult(False, f"{type(e).__name__}: {e}")
    if "error" in answer:
        return ProbeResult(False, str(answer["error"]))
    if "output_ids" not in answer:
        return ProbeResult(False, f"answer without output_ids: {str(answer)[:200]}")
    return ProbeResult(True)


def _error_text(e: urllib.error.HTTPError) -> str:
    try:
        return str(json.loads(e.read()).get("error", ""))[:500]
    except (OSError, ValueError, AttributeError):
        return e.reason or ""
