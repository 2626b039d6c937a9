"""Streaming gRPC client for the dspark model (needs tritonclient[grpc]: run it with the serving venv).

Standalone on purpose (imports neither torch nor dspark_trt):
    .venv-triton/bin/python dspark_trt/serving/client.py --url 127.0.0.1:8001 \
        --request '{"text_input": "hello", "max_tokens": 16, "stream": true}'
prints one JSON object per response ({"error": ...} for an error), in arrival order.

It never waits forever: each response must come within ``--timeout`` seconds, otherwise the
requests still open get a "timed out" error; the stream is always closed with cancellation (the
server drops those requests), and that close is bounded too. Exit status 1 when a request got no
final answer from the server (timeout, connection lost), 0 otherwise (server errors included).
"""
from __future__ import annotations

import argparse
import json
import queue
import sys
import threading

import numpy as np

# input name -> (numpy dtype, Triton dtype); scalars are sent with shape [1]
INPUTS = {"text_input": (np.object_, "BYTES"), "input_ids": (np.int32, "INT32"),
          "max_tokens": (np.int32, "INT32"), "temperature": (np.float32, "FP32"),
          "top_p": (np.float32, "FP32"), "seed": (np.uint64, "UINT64"), "stream": (np.bool_, "BOOL"),
          "stop": (np.object_, "BYTES"), "stop_ids": (np.int32, "INT32")}
OUTPUTS = ("text_output", "output_ids", "finish_reason", "tau", "acceptance_per_position", "rounds")


def make_inputs(grpcclient, request: dict) -> list:
    out = []
    for name, value in request.items():
        if name not in INPUTS:
            raise ValueError(f"unknown input '{name}'; known: {', '.join(INPUTS)}")
        dtype, triton = INPUTS[name]
        arr = np.array(value if isinstance(value, list) else [value], dtype=dtype)
        if dtype is np.object_:
            arr = np.array([v.encode() if isinstance(v, str) else v for v in arr], dtype=np.object_)
        t = grpcclient.InferInput(name, list(arr.shape), triton)
        t.set_data_from_numpy(arr)
        out.append(t)
    return out


def to_json(result) -> dict:
    d = {}
    for name in OUTPUTS:
        arr = result.as_numpy(name)
        if arr is None:
            continue
        if arr.dtype == np.object_:
            d[name] = arr.reshape(-1)[0].decode("utf-8")
        elif name in ("output_ids", "acceptance_per_position"):
            d[name] = arr.tolist()
        else:
            d[name] = arr.reshape(-1)[0].item()
    return d


def stream(url: str, model: str, requests: list[dict], cancel_after: int | None = None,
           timeout: float = 120.0) -> list[list[dict]]:
    """Send requests on one gRPC stream; returns each request's responses in arrival order.

    ``cancel_after``: close the stream with cancellation after that many responses in total.
    ``timeout``: seconds to wait for each response; then every open request gets an entry
    ``{"error": ..., "client_error": true}`` (so does each one open when the stream breaks).
    """
    import tritonclient.grpc as grpcclient
    from tritonclient.utils import InferenceServerException
    q: queue.Queue = queue.Queue()
    client = grpcclient.InferenceServerClient(url)
    out: dict[str, list[dict]] = {str(i): [] for i in range(len(requests))}
    open_ids = set(out)

    def fail_open(message: str) -> None:
        for rid in sorted(open_ids, key=int):
            out[rid].append({"error": message, "client_error": True})
        open_ids.clear()
    try:
        client.start_stream(callback=lambda result, error: q.put((result, error)))
        for i, r in enumerate(requests):
            try:
                client.async_stream_infer(model, make_inputs(grpcclient, r), request_id=str(i),
                                          outputs=[grpcclient.InferRequestedOutput(n) for n in OUTPUTS],
                                          enable_empty_final_response=True)
            except InferenceServerException as e:   # the stream broke before this request was sent
                for rid in range(i, len(requests)):
                    out[str(rid)].append({"error": f"the stream failed: {e}", "client_error": True})
                    open_ids.discard(str(rid))
                break
        received = 0
        while open_ids:
            try:
                result, error = q.get(timeout=timeout)
            except queue.Empty:
                fail_open(f"no response within {timeout:g} s (timed out; the request was cancelled)")
                break
            if error is not None:
                if error.status() is not None:      # a gRPC status: the stream itself broke
                    fail_open(f"the stream failed: {error}")
                    break
                rid = _error_request_id(error, open_ids)   # an error response for one request
                out[rid].append({"error": str(error)})
                open_ids.discard(rid)
                continue
            resp = result.get_response()
            rid = resp.id
            d = to_json(result)
            final = resp.parameters["triton_final_response"].bool_param
            if d or not final:
                out[rid].append(d)
            if final:
                open_ids.discard(rid)
            received += 1
            if cancel_after is not None and received >= cancel_after:
                break
    finally:
        close_bounded(client)
    return [out[str(i)] for i in range(len(requests))]


def close_bounded(client, timeout: float = 5.0) -> bool:
    """Cancel whatever is still in flight and close the client, waiting at most ``timeout`` s.

    ``stop_stream()`` without cancellation joins the stream thread until the server has answered
    every request, which is forever when the server stopped answering; with ``cancel_requests``
    the call is cancelled first. It runs in a daemon thread so even a stuck join cannot hold us.
    """
    def close():
        client.stop_stream(cancel_requests=True)
        client.close()
    t = threading.Thread(target=close, name="dspark-client-close", daemon=True)
    t.start()
    t.join(timeout)
    return not t.is_alive()


def _error_request_id(error, open_ids: set[str]) -> str:
    """tritonclient drops the id of an error response; it is known only when one request is open."""
    if len(open_ids) == 1:
        return next(iter(open_ids))
    raise RuntimeError(f"stream error for an unknown request (send one request per stream to tell): {error}")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--url", required=True, help="gRPC host:port")
    p.add_argument("--model", default="dspark")
    p.add_argument("--request", action="append", required=True, help="JSON object of inputs (repeatable)")
    p.add_argument("--cancel-after", type=int, help="cancel the stream after this many responses")
    p.add_argument("--timeout", type=float, default=120.0, help="seconds to wait for each response")
    args = p.parse_args(argv)
    results = stream(args.url, args.model, [json.loads(r) for r in args.request], args.cancel_after,
                     args.timeout)
    for i, responses in enumerate(results):
        for r in responses:
            print(json.dumps({"request": i, **r}), flush=True)
    return 1 if any(r.get("client_error") for responses in results for r in responses) else 0


if __name__ == "__main__":
    sys.exit(main())
