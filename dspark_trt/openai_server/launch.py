"""Run the OpenAI front end with uvicorn: from CLI arguments (``serve_from_args``) or in a thread
of the current process (``UvicornThread``, for tests and embedding)."""
from __future__ import annotations

import socket
import sys
import threading
import time
from pathlib import Path

from .app import DEFAULT_MAX_REQUEST_BYTES, OpenAIServer, build_app
from .chat_template import ChatTemplate


def template_dir_from_args(args) -> Path | None:
    """Where the chat template lives: the engine or target checkpoint directory, or the default
    pair's target (what ``LLM.from_source`` loads when no model is named)."""
    from ..config.source import default_pair_dirs
    if getattr(args, "engine", None):
        return Path(args.engine)
    if getattr(args, "checkpoint", None):
        return Path(args.checkpoint)
    if getattr(args, "model", None) is None and default_pair_dirs() is not None:
        return default_pair_dirs()[0]
    return None


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


class UvicornThread:
    """A uvicorn server for ``app`` in a daemon thread; ``start`` waits until it accepts requests."""

    def __init__(self, app, host: str = "127.0.0.1", port: int | None = None):
        import uvicorn
        self.host, self.port = host, port or free_port(host)
        config = uvicorn.Config(app, host=self.host, port=self.port, log_level="warning",
                                timeout_graceful_shutdown=5)
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, name="uvicorn", daemon=True)

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def start(self, timeout: float = 30.0) -> "UvicornThread":
        self.thread.start()
        deadline = time.monotonic() + timeout
        while not self.server.started:
            if not self.thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError(f"uvicorn did not start on {self.url}")
            time.sleep(0.02)
        return self

    def stop(self, timeout: float = 10.0) -> None:
        self.server.should_exit = True
        self.thread.join(timeout)


def _note(line: str) -> None:
    """Load notes (which model, which dtype on a CPU) on stderr, as ``generate``'s."""
    print(line, file=sys.stderr, flush=True)


def serve_from_args(args) -> int:
    """``dspark-trt serve``: load the model as ``generate`` does and serve until interrupted;
    under torchrun (``--tp-size N``, one node or several) RANK 0 serves HTTP on its node and the
    other ranks follow its scheduler (commands over gloo, no other port)."""
    import uvicorn  # noqa: F401  (a missing [openai] extra fails before the model loads)

    from ..config.source import ModelSource
    from ..runtime.llm import LLM
    if args.host not in ("127.0.0.1", "localhost", "::1") and not args.api_key:
        print(f"[dspark-trt] warning: listening on {args.host} without --api-key", flush=True)
    max_bytes = args.max_request_bytes or DEFAULT_MAX_REQUEST_BYTES
    if max_bytes < 1:
        raise SystemExit(f"error: --max-request-bytes must be positive, got {max_bytes}")
    util = getattr(args, "gpu_memory_utilization", None)
    src = ModelSource.from_args(args)
    llm = LLM.from_source(src, say=_note, **({} if util is None else {"gpu_memory_utilization": util}))
    if src.tp_size == 1:
        return _serve(args, llm, max_bytes)
    # torchrun, one process per rank: rank 0 serves HTTP and leads, the others replay its scheduler
    import torch.distributed as dist

    from ..parallel.replica import LeaderLLM, follow
    from ..parallel.topology import Launch
    try:
        if dist.get_rank() != 0:
            follow(llm)
            return 0
        leader = LeaderLLM(llm)
        print(f"[dspark-trt] tensor parallel: {Launch.from_env().describe()} serves HTTP on host "
              f"{socket.gethostname()}; the other ranks follow its scheduler", flush=True)
        try:
            return _serve(args, leader, max_bytes)
        finally:
            leader.stop()                                   # the followers return from follow()
    finally:
        dist.destroy_process_group()


def _serve(args, llm, max_bytes: int) -> int:
    """Serve ``llm`` (an ``LLM``, or rank 0's ``LeaderLLM`` under tensor parallelism) until
    interrupted."""
    import uvicorn
    template = ChatTemplate.from_dir(template_dir_from_args(args))
    server = OpenAIServer(llm, model_name=args.model_name, chat_template=template,
                          speculative=not getattr(args, "no_speculative", False))
    app = build_app(server, max_request_bytes=max_bytes, api_key=args.api_key)
    print(f"[dspark-trt] OpenAI-compatible server for '{args.model_name}' on http://{args.host}:{args.port}/v1 "
          f"(chat template: {'yes' if template else 'none'}; bodies up to {max_bytes} bytes; "
          f"metrics at /metrics)", flush=True)
    uvicorn.run(app, host=args.host, port=args.port, log_level="info")
    return 0
