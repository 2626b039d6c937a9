"""Start and stop a real ``tritonserver`` (the nvidia-pytriton wheel's) on a model repository.

The serving venv (``scripts/setup_triton_env.sh``) holds tritonserver 2.51, the python-backend
stub and numpy<2 / torch for the stub. Its ``bin`` goes first on PATH so the stub's embedded
Python uses the venv's site-packages. Addresses default to loopback and ports to free ones.
Every wait has a deadline: ``start`` (readiness), ``stop`` (SIGTERM, then SIGKILL), ``kill``.
"""
from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
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


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


def descendants(pid: int) -> list[int]:
    """Children of ``pid``, their children, and so on (from /proc)."""
    kids = []
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                stat = (d / "stat").read_text()
            except OSError:
                continue
            if int(stat.rsplit(")", 1)[1].split()[1]) == pid:
                kids.append(int(d.name))
    return kids + [g for k in kids for g in descendants(k)]


def _is_gone(pid: int) -> bool:
    """True when the process no longer runs (exited, or a zombie nobody has reaped yet)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return True
    return stat.rsplit(")", 1)[1].split()[0] in ("Z", "X")


def _kill(pids: list[int]) -> None:
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass


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


STUB_NAME = "triton_python_backend_stub"


class TritonServer:
    """One tritonserver process; ``start`` waits for readiness with a deadline.

    ``http_host``: where Triton's own HTTP port listens (default ``host``; ``dspark-trt serve --triton``
    keeps it on loopback behind its gateway). ``exit_timeout``: Triton's --exit-timeout-secs, how
    long a SIGTERM waits for in-flight requests before the model is unloaded (which fails them).
    A restarted server keeps its ports and appends to its log.
    """

    def __init__(self, repository: str | Path, install: TritonInstall, *, host: str = "127.0.0.1",
                 http_port: int = 0, grpc_port: int = 0, metrics_port: int = 0,
                 log_path: str | Path | None = None, extra_args: tuple[str, ...] = (),
                 http_host: str | None = None, exit_timeout: int = 2):
        self.repository, self.install, self.host = Path(repository).resolve(), install, host
        self.http_host = http_host or host
        self.exit_timeout = exit_timeout
        self.ports = {"http": http_port, "grpc": grpc_port, "metrics": metrics_port}
        self.log_path = Path(log_path) if log_path else self.repository.parent / "tritonserver.log"
        self.extra_args = tuple(extra_args)
        self.proc: subprocess.Popen | None = None
        self.stubs: dict[int, str] = {}                 # python-backend stub pid -> cmdline, at readiness
        self._shm: set[str] = set()
        self._started = 0
        self.leaked: list[str] = []                     # shm regions stop() had to remove

    @property
    def http_url(self) -> str:
        return f"http://{self.http_host}:{self.ports['http']}"

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
                f"--http-address={self.http_host}", f"--http-port={p['http']}",
                f"--grpc-address={self.host}", f"--grpc-port={p['grpc']}",
                "--allow-metrics=true", "--allow-gpu-metrics=false", "--allow-cpu-metrics=false",
                f"--metrics-address={self.host}", f"--metrics-port={p['metrics']}",
                "--pinned-memory-pool-byte-size=0", f"--exit-timeout-secs={self.exit_timeout}",
                *self.extra_args]

    def start(self, timeout: float = 120.0, attempts: int = 3,
              abort: threading.Event | None = None) -> float:
        """Launch and wait until ready; returns seconds to ready. Retries on a port taken meanwhile.

        ``abort`` (e.g. set by a SIGTERM handler) stops the wait early: RuntimeError, server stopped.
        """
        fixed = {k: v for k, v in self.ports.items() if v}
        for attempt in range(attempts):
            self.ports = {k: fixed.get(k) or free_port(self.host) for k in self.ports}
            t0 = time.monotonic()
            with open(self.log_path, "a" if self._started else "w") as log:
                self.proc = subprocess.Popen(self.command(), stdout=log, stderr=subprocess.STDOUT,
                                             env=self.install.environment(), stdin=subprocess.DEVNULL)
            self._started += 1
            try:
                self._wait_ready(t0 + timeout, abort)
                return time.monotonic() - t0
            except RuntimeError:
                busy = "already in use" in self.log_tail()
                self.kill()
                if not busy or fixed or attempt == attempts - 1:
                    raise
        raise AssertionError("unreachable")

    def _wait_ready(self, deadline: float, abort: threading.Event | None) -> None:
        url = f"{self.http_url}/v2/health/ready"
        while True:
            self._shm |= _shm_regions([self.proc.pid, *descendants(self.proc.pid)])
            if self.proc.poll() is not None:
                raise RuntimeError(f"tritonserver exited with {self.proc.returncode} before it was ready; "
                                   f"log {self.log_path}:\n{self.log_tail()}")
            try:
                with urllib.request.urlopen(url, timeout=1) as r:
                    if r.status == 200:
                        kids = descendants(self.proc.pid)
                        self._shm |= _shm_regions([self.proc.pid, *kids])
                        self.stubs = {k: c for k in kids if STUB_NAME in (c := _cmdline(k))}
                        return
            except (urllib.error.URLError, ConnectionError, TimeoutError, OSError):
                pass
            if abort is not None and abort.is_set():
                raise RuntimeError("start aborted (shutting down)")
            if time.monotonic() > deadline:
                raise RuntimeError(f"tritonserver not ready before the deadline; log {self.log_path}:\n"
                                   f"{self.log_tail()}")
            time.sleep(0.1)

    def dead_stubs(self) -> list[int]:
        """Stub pids seen at readiness that no longer run (a model instance's worker died)."""
        return [pid for pid in self.stubs if _is_gone(pid) or _cmdline(pid) != self.stubs[pid]]

    def log_tail(self, n: int = 40) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-n:])
        except OSError:
            return ""

    def stop(self, timeout: float = 8.0) -> int | None:
        """SIGTERM to our pid only, SIGKILL after ``timeout`` s; then clean up (see ``_reap``).

        Triton waits ``exit_timeout`` s for in-flight requests, then unloads the model, which
        fails what is left; ``timeout`` only matters when that hangs (e.g. a dead stub).
        """
        return self._end(signal.SIGTERM, timeout, grace=3.0)

    def kill(self) -> int | None:
        """SIGKILL at once: every open connection drops, so in-flight requests fail instead of
        waiting on a worker that will never answer. Then clean up (see ``_reap``); no grace for
        the stubs: a stopped (SIGSTOP) one would never exit itself."""
        return self._end(signal.SIGKILL, None, grace=0.0)

    def _end(self, sig: int, timeout: float | None, grace: float) -> int | None:
        if self.proc is None:
            return None
        kids = {}
        if self.proc.poll() is None:
            kids = {k: _cmdline(k) for k in descendants(self.proc.pid)}
            self._shm |= _shm_regions([self.proc.pid, *kids])
            self.proc.send_signal(sig)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        return self._reap(kids, grace=grace)

    def _reap(self, kids: dict[int, str], grace: float = 3.0) -> int | None:
        """Kill what is left of our own children after ``grace`` s (stubs exit by themselves when
        the server dies, within a second or so) and remove the shm regions our processes mapped."""
        kids = {**self.stubs, **kids}                   # stubs outlive a server that crashed
        def running() -> list[int]:                     # the same processes (no reused pids)
            return [k for k, cmd in kids.items() if not _is_gone(k) and _cmdline(k) == cmd]
        deadline = time.monotonic() + grace
        while running() and time.monotonic() < deadline:
            time.sleep(0.05)
        _kill(running())
        self.leaked = sorted(r for r in self._shm if Path(r).exists())
        for region in self.leaked:                      # only regions our processes had mapped
            Path(region).unlink(missing_ok=True)
        self._shm, self.stubs = set(), {}
        rc, self.proc = self.proc.returncode, None
        return rc

    def __enter__(self) -> "TritonServer":
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop()
