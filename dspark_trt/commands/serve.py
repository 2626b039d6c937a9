"""``dspark-trt serve``: write a model repository and run tritonserver on it until interrupted."""
from __future__ import annotations

import signal
import tempfile
import threading
from pathlib import Path

from .triton_repo import add_repo_args, write_from_args


def add_parser(sub) -> None:
    p = sub.add_parser("serve", help="serve the model with a real Triton Inference Server")
    add_repo_args(p)
    g = p.add_argument_group("server")
    g.add_argument("--output", help="repository directory (default: a temporary one)")
    g.add_argument("--force", action="store_true", help="replace an existing model directory")
    g.add_argument("--triton-env", help="serving venv (default: $DSPARK_TRITON_ENV or <repo>/.venv-triton, "
                   "made by scripts/setup_triton_env.sh)")
    g.add_argument("--host", default="127.0.0.1", help="listen address (default: loopback only)")
    g.add_argument("--http-port", type=int, default=0, help="0 = a free port")
    g.add_argument("--grpc-port", type=int, default=0, help="0 = a free port")
    g.add_argument("--metrics-port", type=int, default=0, help="0 = a free port")
    g.add_argument("--ready-timeout", type=float, default=300.0, help="seconds to wait for readiness")
    p.set_defaults(func=run)


def run(args) -> int:
    from ..serving.server import ServingEnvError, TritonInstall, TritonServer
    try:
        install = TritonInstall.find(args.triton_env)
    except ServingEnvError as e:
        raise SystemExit(f"error: {e}") from None
    tmp = None
    if args.output is None:
        tmp = tempfile.TemporaryDirectory(prefix="dspark-triton-")
        output = Path(tmp.name) / "model_repository"
    else:
        output = Path(args.output)
    model_dir = write_from_args(args, output)
    server = TritonServer(output, install, host=args.host, http_port=args.http_port,
                          grpc_port=args.grpc_port, metrics_port=args.metrics_port,
                          log_path=output.parent / "tritonserver.log")
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    try:
        print(f"[dspark-trt] repository {model_dir.parent}; starting tritonserver (log {server.log_path})")
        try:
            ready = server.start(timeout=args.ready_timeout)
        except RuntimeError as e:
            raise SystemExit(f"error: {e}") from None
        name = args.model_name
        print(f"[dspark-trt] ready in {ready:.1f} s")
        print(f"  HTTP     {server.http_url}   (POST /v2/models/{name}/generate, /generate_stream)")
        print(f"  gRPC     {server.grpc_url}")
        print(f"  metrics  {server.metrics_url}")
        while not stop.wait(0.5):
            if server.proc.poll() is not None:
                print(f"error: tritonserver exited with {server.proc.returncode}; log {server.log_path}:\n"
                      f"{server.log_tail()}")
                return 1
        print("[dspark-trt] stopping tritonserver")
        return 0 if server.stop() == 0 else 1
    finally:
        server.stop()
        if tmp is not None:
            tmp.cleanup()
