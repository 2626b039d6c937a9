"""``dspark-trt serve``: the OpenAI-compatible HTTP server (default), or with ``--triton`` a real
Triton Inference Server on a model repository, until interrupted.

Default: ``openai_server.launch.serve_from_args`` (FastAPI + uvicorn, ``docs/serving.md``; ``--openai``
is accepted and means the same). ``--triton`` runs ``serving.stack.ServingStack``: tritonserver, an HTTP gateway in front of Triton's HTTP
(request size limit, 400s for bad JSON) and a supervisor that probes the model and restarts a
broken server. Exit status: 0 after SIGINT/SIGTERM (everything stopped, within
``--shutdown-timeout`` plus a few seconds), 1 when serving could not go on (the reason is printed).
"""
from __future__ import annotations

import signal
import sys
import tempfile
import threading
from pathlib import Path

from ..config.source import DEFAULT_MAX_SEQ_LEN
from .triton_repo import add_repo_args, write_from_args


def add_parser(sub) -> None:
    p = sub.add_parser("serve", help="serve the model over an OpenAI-compatible HTTP API (default), "
                       "or with --triton on a real Triton Inference Server")
    add_repo_args(p)
    o = p.add_argument_group("OpenAI-compatible server (the default)")
    front = o.add_mutually_exclusive_group()
    front.add_argument("--triton", action="store_true",
                       help="serve with a real tritonserver (KServe v2 /v2/models/NAME/generate) instead "
                            "of the OpenAI-compatible server (docs/serving.md)")
    front.add_argument("--openai", action="store_true",
                       help="the OpenAI-compatible server (the default; accepted for compatibility)")
    o.add_argument("--port", type=int, default=8000, help="listen port (default: 8000; with --triton "
                   "see --http-port)")
    o.add_argument("--api-key", default=None,
                   help="require 'Authorization: Bearer KEY' on /v1/ endpoints (not with --triton)")
    o.add_argument("--gpu-memory-utilization", type=float, default=None,
                   help="size the KV cache so the process uses this fraction of the GPU's memory "
                        "(vLLM's option; CUDA only; default: a full batch at --max-seq-len, or at "
                        "min(context, 2048) without it). Pages "
                        "are reserved as sequences grow; when short, sequences are preempted")
    g = p.add_argument_group("server (--host for both; the others with --triton)")
    g.add_argument("--output", help="repository directory (default: a temporary one)")
    g.add_argument("--force", action="store_true", help="replace an existing model directory")
    g.add_argument("--triton-env", help="serving venv (default: $DSPARK_TRITON_ENV or <repo>/.venv-triton, "
                   "made by scripts/setup_triton_env.sh)")
    g.add_argument("--host", default="127.0.0.1", help="listen address (default: loopback only)")
    g.add_argument("--http-port", type=int, default=0, help="0 = a free port")
    g.add_argument("--grpc-port", type=int, default=0, help="0 = a free port")
    g.add_argument("--metrics-port", type=int, default=0, help="0 = a free port")
    g.add_argument("--ready-timeout", type=float, default=300.0, help="seconds to wait for readiness")
    g.add_argument("--max-request-bytes", type=int, default=None,
                   help="largest HTTP request body; larger ones get 413 (default: 64 bytes per "
                        "token of --max-seq-len, at least 1 MiB with --triton; 1 MiB otherwise)")
    g.add_argument("--probe-interval", type=float, default=2.0,
                   help="seconds between the supervisor's 1-token probe requests")
    g.add_argument("--probe-timeout", type=float, default=60.0,
                   help="a probe unanswered this long means the model hangs: restart (it waits for a "
                        "batch slot like any request, so keep it above the longest wait under load)")
    g.add_argument("--max-restarts", type=int, default=5,
                   help="restarts allowed within 10 minutes before serve gives up and exits 1")
    g.add_argument("--shutdown-timeout", type=float, default=8.0,
                   help="seconds tritonserver gets after SIGTERM before SIGKILL")
    p.set_defaults(func=run)


def run(args) -> int:
    if not args.triton:
        from ..openai_server.launch import serve_from_args
        return serve_from_args(args)
    for flag, value in (("--api-key", args.api_key), ("--gpu-memory-utilization", args.gpu_memory_utilization)):
        if value is not None:
            raise SystemExit(f"error: {flag} is for the OpenAI-compatible server, not --triton")
    from ..serving.server import ServingEnvError, TritonInstall
    from ..serving.stack import ServingStack, default_max_request_bytes
    try:
        install = TritonInstall.find(args.triton_env)
    except ServingEnvError as e:
        raise SystemExit(f"error: {e}") from None
    max_bytes = args.max_request_bytes or default_max_request_bytes(args.max_seq_len or DEFAULT_MAX_SEQ_LEN)
    if max_bytes < 1:
        raise SystemExit(f"error: --max-request-bytes must be positive, got {max_bytes}")
    tmp = None
    if args.output is None:
        tmp = tempfile.TemporaryDirectory(prefix="dspark-triton-")
        output = Path(tmp.name) / "model_repository"
    else:
        output = Path(args.output)
    model_dir = write_from_args(args, output)
    name = args.model_name
    try:
        stack = ServingStack(output, install, name, host=args.host, http_port=args.http_port,
                             grpc_port=args.grpc_port, metrics_port=args.metrics_port,
                             max_request_bytes=max_bytes, log_path=output.parent / "tritonserver.log",
                             probe_interval=args.probe_interval, probe_timeout=args.probe_timeout,
                             max_restarts=args.max_restarts, ready_timeout=args.ready_timeout)
    except OSError as e:                                 # the HTTP port is taken
        raise SystemExit(f"error: cannot listen on {args.host}:{args.http_port}: {e}") from None
    stop = threading.Event()

    def on_signal(signum, _frame):
        stop.set()
        stack.supervisor.stopping.set()                  # also ends a start or restart in progress
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, on_signal)
    try:
        print(f"[dspark-trt] repository {model_dir.parent}; starting tritonserver (log {stack.log_path})",
              flush=True)
        try:
            ready = stack.start()
        except RuntimeError as e:
            if stop.is_set():
                print("[dspark-trt] interrupted before tritonserver was ready", flush=True)
                return 0
            raise SystemExit(f"error: {e}") from None
        print(f"[dspark-trt] ready in {ready:.1f} s", flush=True)
        print(f"  HTTP     {stack.http_url}   (POST /v2/models/{name}/generate, /generate_stream; "
              f"bodies up to {max_bytes} bytes)")
        print(f"  gRPC     {stack.grpc_url}")
        print(f"  metrics  {stack.metrics_url}", flush=True)
        while not stop.wait(0.5):
            if stack.supervisor.failed.is_set():
                print(f"error: {stack.supervisor.reason}; log {stack.log_path}:\n{stack.triton.log_tail()}",
                      file=sys.stderr, flush=True)
                return 1
        print("[dspark-trt] stopping", flush=True)
        rc = stack.stop(args.shutdown_timeout)
        if rc != 0:       # e.g. requests still in flight after Triton's exit timeout: it exits non-zero
            print(f"[dspark-trt] tritonserver exited with {rc} (requests still in flight were dropped)",
                  flush=True)
        return 0
    finally:
        stack.stop(args.shutdown_timeout)
        if tmp is not None:
            tmp.cleanup()
