"""What ``dspark-trt serve --triton`` runs: tritonserver, the HTTP gateway in front of it, the supervisor.

    client --HTTP--> gateway (host:http_port) --HTTP--> tritonserver (127.0.0.1, a free port)
    client --gRPC----------------------------------->   tritonserver (host:grpc_port)
                                                         ^ supervisor: probes, restarts

Triton's own HTTP port stays on loopback; clients use the gateway's (``http_url``). gRPC and
metrics are Triton's. A restarted tritonserver keeps its gRPC and metrics ports.
"""
from __future__ import annotations

from pathlib import Path
from typing import Callable

from .gateway import HttpGateway
from .server import TritonInstall, TritonServer
from .supervisor import Supervisor, report_to_stderr

MIB = 1 << 20


def default_max_request_bytes(max_seq_len: int) -> int:
    """Room for a prompt of ``max_seq_len`` tokens as JSON (ids take up to 12 bytes each, text
    rarely over 16 bytes a token, 6 per escaped character): 64 bytes a token, at least 1 MiB."""
    return max(MIB, 64 * max_seq_len)


class ServingStack:
    def __init__(self, repository: str | Path, install: TritonInstall, model_name: str, *,
                 host: str = "127.0.0.1", http_port: int = 0, grpc_port: int = 0, metrics_port: int = 0,
                 max_request_bytes: int = MIB, log_path: str | Path | None = None,
                 probe_interval: float = 2.0, probe_timeout: float = 60.0, max_restarts: int = 5,
                 ready_timeout: float = 300.0, report: Callable[[str], None] = report_to_stderr):
        self.triton = TritonServer(repository, install, host=host, http_host="127.0.0.1",
                                   grpc_port=grpc_port, metrics_port=metrics_port, log_path=log_path)
        self.supervisor = Supervisor(self.triton, model_name, interval=probe_interval,
                                     probe_timeout=probe_timeout, max_restarts=max_restarts,
                                     ready_timeout=ready_timeout, report=report)
        self.gateway = HttpGateway(None, host=host, port=http_port,           # upstream: see start()
                                   max_request_bytes=max_request_bytes, health=self.supervisor.health)
        self.ready_timeout = ready_timeout
        self.ready_seconds: float | None = None

    @property
    def http_url(self) -> str:
        return self.gateway.url

    @property
    def grpc_url(self) -> str:
        return self.triton.grpc_url

    @property
    def metrics_url(self) -> str:
        return self.triton.metrics_url

    @property
    def log_path(self) -> Path:
        return self.triton.log_path

    def start(self) -> float:
        """Start tritonserver (wait for ready), the gateway, the supervisor; seconds to ready."""
        self.ready_seconds = self.triton.start(timeout=self.ready_timeout, abort=self.supervisor.stopping)
        self.gateway.upstream = f"127.0.0.1:{self.triton.ports['http']}"      # kept across restarts
        self.gateway.start()
        self.supervisor.start()
        return self.ready_seconds

    def stop(self, timeout: float = 8.0) -> int | None:
        """Stop all three, each bounded; tritonserver gets SIGTERM, SIGKILL after ``timeout`` s.
        HTTP requests still open then get their error from the gateway (up to 2 s more)."""
        self.supervisor.stop()
        self.gateway.stop()
        rc = self.triton.stop(timeout)
        self.gateway.wait_idle(2.0)
        return rc
