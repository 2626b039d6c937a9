"""Start and stop a real ``tritonserver`` (the nvidia-pytriton wheel's) on a model repository.

The serving venv (``scripts/setup_triton_env.sh``) holds tritonserver 2.51, the python-backend
stub and numpy<2 / torch for the stub. Its ``bin`` goes first on PATH so the stub's embedded
Python uses the venv's site-packages. Addresses default to loopback and ports to free ones.
"""
from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path

DEFAULT_ENV = Path(__file__).resolve().parents[2] / ".venv-triton"
SHM_PREFIX = "triton_python_backend_shm_region"


class ServingEnvError(RuntimeError):
    """The serving environment is missing or incomplete (the message says how to create it)."""


@dataclass
class TritonInstall:
    env: Path            # the venv
    python: Path         # its python (tritonclient lives there too)
    server: Path         # .../pytriton/tritonserver/bin/tritonserver
    backends: Path       # .../pytriton/tritonserver/backends

    @classmethod
    def find(cls, env: str | Path | None = None) -> "TritonInstall":
        env = Path(env or os.environ.get("DSPARK_TRITON_ENV") or DEFAULT_ENV).resolve()
        py = env / "bin" / "python"
        hint = f"create it with: scripts/setup_triton_env.sh {env}"
        if not py.exists():
            raise ServingEnvError(f"no serving venv at {env}; {hint}")
        ver = "python%d.%d" % sys.version_info[:2]
        sites = sorted((env / "lib").glob("python3*/site-packages/pytriton/tritonserver"))
        if not sites:
            raise ServingEnvError(f"{env} has no nvidia-pytriton install (pytriton/tritonserver); {hint}")
        ts = next((s for s in sites if ver in str(s)), sites[0])
        inst = cls(env, py, ts / "bin" / "tritonserver", ts / "backends")
        if not (inst.backends / "python" / "triton_python_backend_stub").exists():
            raise ServingEnvError(f"the python-backend stub is not in {inst.backends / 'python'}; {hint}")
        return inst

    def environment(self) -> dict[str, str]:
        env = dict(os.environ)
        env["PATH"] = f"{self.env / 'bin'}{os.pathsep}{env.get('PATH', '')}"
        env["VIRTUAL_ENV"] = str(self.env)
        env.pop("PYTHONHOME", None)
        libdir = subprocess.run([str(self.python), "-c", "import sysconfig; print(sysconfig.get_config_var('LIBDIR'))"],
                                capture_output=True, text=True).stdout.strip()
        if libdir and Path(libdir).is_dir():    # the stub then embeds this interpreter's libpython
            env["LD_LIBRARY_PATH"] = os.pathsep.join(filter(None, [libdir, env.get("LD_LIBRARY_PATH")]))
        return env


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def _children(pid: int) -> list[int]:
    kids = []
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                stat = (d / "stat").read_text()
            except OSError:
                continue
            if int(stat.rsplit(")", 1)[1].split()[1]) == pid:
                kids.append(int(d.name))
    return kids + [g for k in kids for g in _children(k)]


def _shm_regions(pids: list[int]) -> set[str]:
    """The python backend's /dev/shm regions that these processes have mapped."""
    found = set()
    for pid in pids:
        try:
            maps = Path(f"/proc/{pid}/maps").read_text()
        except OSError:
            continue
        found.update(line.split()[-1] for line in maps.splitlines() if f"/dev/shm/{SHM_PREFIX}" in line)
    return {p.removesuffix(" (deleted)") for p in found}


class TritonServer:
    """One tritonserver process; ``start`` waits for readiness with a deadline."""

    def __init__(self, repository: str | Path, install: TritonInstall, *, host: str = "127.0.0.1",
                 http_port: int = 0, grpc_port: int = 0, metrics_port: int = 0,
                 log_path: str | Path | None = None, extra_args: tuple[str, ...] = ()):
        self.repository, self.install, self.host = Path(repository).resolve(), install, host
        self.ports = {"http": http_port, "grpc": grpc_port, "metrics": metrics_port}
        self.log_path = Path(log_path) if log_path else self.repository.parent / "tritonserver.log"
        self.extra_args = tuple(extra_args)
        self.proc: subprocess.Popen | None = None
        self._shm: set[str] = set()
        self.leaked: list[str] = []                     # shm regions stop() had to remove

    @property
    def http_url(self) -> str:
        return f"http://{self.host}:{self.ports['http']}"

    @property
    def grpc_url(self) -> str:
        return f"{self.host}:{self.ports['grpc']}"

    @property
    def metrics_url(self) -> str:
        return f"http://{self.host}:{self.ports['metrics']}/metrics"

    def command(self) -> list[str]:
        p = self.ports
        return [str(self.install.server), f"--model-repository={self.repository}",
                f"--backend-directory={self.install.backends}", "--disable-auto-complete-config",
                f"--http-address={self.host}", f"--http-port={p['http']}",
                f"--grpc-address={self.host}", f"--grpc-port={p['grpc']}",
                "--allow-metrics=true", "--allow-gpu-metrics=false", "--allow-cpu-metrics=false",
                f"--metrics-address={self.host}", f"--metrics-port={p['metrics']}",
                "--pinned-memory-pool-byte-size=0", *self.extra_args]

    def start(self, timeout: float = 120.0, attempts: int = 3) -> float:
        """Launch and wait until ready; returns seconds to ready. Retries on a port taken meanwhile."""
        fixed = {k: v for k, v in self.ports.items() if v}
        for attempt in range(attempts):
            self.ports = {k: fixed.get(k) or free_port(self.host) for k in self.ports}
            t0 = time.monotonic()
            with open(self.log_path, "w") as log:
                self.proc = subprocess.Popen(self.command(), stdout=log, stderr=subprocess.STDOUT,
                                             env=self.install.environment(), stdin=subprocess.DEVNULL)
            try:
                self._wait_ready(t0 + timeout)
                return time.monotonic() - t0
            except RuntimeError:
                busy = "already in use" in self.log_tail()
                self.stop()
                if not busy or fixed or attempt == attempts - 1:
                    raise
        raise AssertionError("unreachable")

    def _wait_ready(self, deadline: float) -> None:
        url = f"{self.http_url}/v2/health/ready"
        while True:
            self._shm |= _shm_regions([self.proc.pid, *_children(self.proc.pid)])
            if self.proc.poll() is not None:
                raise RuntimeError(f"tritonserver exited with {self.proc.returncode} before it was ready; "
                                   f"log {self.log_path}:\n{self.log_tail()}")
            try:
                with urllib.request.urlopen(url, timeout=1) as r:
                    if r.status == 200:
                        self._shm |= _shm_regions([self.proc.pid, *_children(self.proc.pid)])
                        return
            except (urllib.error.URLError, ConnectionError, TimeoutError, OSError):
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"tritonserver not ready before the deadline; log {self.log_path}:\n"
                                   f"{self.log_tail()}")
            time.sleep(0.1)

    def log_tail(self, n: int = 40) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-n:])
        except OSError:
            return ""

    def stop(self, timeout: float = 30.0) -> int | None:
        """SIGTERM to our pid only (SIGKILL after ``timeout``); remove shm regions it leaked."""
        if self.proc is None:
            return None
        if self.proc.poll() is None:
            self._shm |= _shm_regions([self.proc.pid, *_children(self.proc.pid)])
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.leaked = sorted(r for r in self._shm if Path(r).exists())
        for region in self.leaked:                      # only regions our processes had mapped
            Path(region).unlink(missing_ok=True)
        rc, self.proc = self.proc.returncode, None
        return rc

    def __enter__(self) -> "TritonServer":
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop()
