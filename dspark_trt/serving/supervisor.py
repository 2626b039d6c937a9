"""Keep ``dspark-trt serve --triton``'s tritonserver serving: notice a dead or hung model, restart the server.

Why the whole server: when a python-backend stub dies, tritonserver 2.51 either aborts (a boost
``lock_exception`` in libtriton_python) or stays up, answers every new request with "Stub process
... is not healthy" and never answers the requests that were in flight, while ``/v2/health/ready``
still says 200. Reloading the model through the repository API gives a working stub but leaves
those in-flight requests hanging (both measured). Killing the server drops their connections, so
every in-flight client gets an error at once; the server then starts again on the same ports.

Checks, every ``poll`` s: the tritonserver process (exited?) and the stub processes seen at
readiness (gone?); every ``interval`` s a real 1-token request (``probe.py``): ``failures`` failed
probes in a row, or one probe with no answer after ``probe_timeout`` s, mean broken. While broken
or restarting ``health()`` is (False, reason) and the gateway answers 503. More than
``max_restarts`` restarts within ``restart_window`` s, or a restart that fails: give up, ``failed``
is set and ``reason`` says why (``serve`` exits non-zero).
"""
from __future__ import annotations

import sys
import threading
import time
from typing import Callable

from .probe import ProbeResult, probe_model
from .server import TritonServer


def report_to_stderr(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


class Supervisor:
    def __init__(self, server: TritonServer, model: str, *, interval: float = 2.0,
                 probe_timeout: float = 60.0, failures: int = 2, poll: float = 0.5,
                 max_restarts: int = 5, restart_window: float = 600.0, ready_timeout: float = 300.0,
                 report: Callable[[str], None] = report_to_stderr):
        self.server, self.model, self.report = server, model, report
        self.interval, self.probe_timeout, self.failures, self.poll = interval, probe_timeout, failures, poll
        self.max_restarts, self.restart_window, self.ready_timeout = max_restarts, restart_window, ready_timeout
        self.restarts: list[float] = []                 # monotonic times of the restarts
        self.failed = threading.Event()
        self.reason = ""
        self._available = True
        self._stop = threading.Event()
        self._probe: threading.Thread | None = None
        self._probe_result: ProbeResult | None = None
        self._probe_started = self._last_probe = 0.0
        self._failed_probes = 0
        self._generation = 0                            # a probe of a server we killed is ignored
        self.thread = threading.Thread(target=self._loop, name="dspark-supervisor", daemon=True)

    def health(self) -> tuple[bool, str]:
        return self._available, self.reason

    def start(self) -> "Supervisor":
        self.thread.start()
        return self

    def stop(self) -> None:
        """Stop watching (a restart in progress is aborted); bounded by ``poll`` and a probe's end."""
        self._stop.set()
        if self.thread.is_alive():
            self.thread.join(self.poll + 5)

    @property
    def stopping(self) -> threading.Event:
        return self._stop

    # ---- the thread ---------------------------------------------------------------------------
    def _loop(self) -> None:
        """Watch until stopped; anything unexpected here gives up (``serve`` exits with the
        reason) rather than leaving a server nobody watches."""
        try:
            while not self._stop.wait(self.poll):
                why = self._fault()
                if why and not self._stop.is_set():
                    self._restart(why)
                if self.failed.is_set():
                    return
        except Exception as e:           # e.g. OSError starting tritonserver or removing its shm
            self._give_up(f"the supervisor failed: {type(e).__name__}: {e}")

    def _fault(self) -> str | None:
        proc = self.server.proc
        if proc is None or proc.poll() is not None:
            return f"tritonserver exited with {None if proc is None else proc.returncode}"
        dead = self.server.dead_stubs()
        if dead:
            return f"the model worker process (python-backend stub, pid {dead[0]}) died"
        return self._probe_fault()

    def _probe_fault(self) -> str | None:
        now = time.monotonic()
        if self._probe is not None:
            if self._probe.is_alive():
                if now - self._probe_started > self.probe_timeout + 5:    # urllib's own timeout failed
                    return f"the model did not answer a 1-token request within {self.probe_timeout:g} s"
                return None
            result, self._probe = self._probe_result, None
            if result is not None and result.ok:
                self._failed_probes = 0
            elif result is not None:
                if result.timed_out:
                    return f"the model did not answer a 1-token request within {self.probe_timeout:g} s"
                self._failed_probes += 1
                if self._failed_probes >= self.failures:
                    return f"the model failed {self._failed_probes} probe requests in a row: {result.detail}"
        wait = self.poll if self._failed_probes else self.interval     # confirm a failure quickly
        if now - self._last_probe >= wait:
            self._start_probe(now)
        return None

    def _start_probe(self, now: float) -> None:
        generation, url = self._generation, self.server.http_url
        self._probe_result = None

        def run():
            result = probe_model(url, self.model, self.probe_timeout)
            if generation == self._generation:
                self._probe_result = result
        self._probe_started = self._last_probe = now
        self._probe = threading.Thread(target=run, name="dspark-probe", daemon=True)
        self._probe.start()

    def _restart(self, why: str) -> None:
        self._available, self.reason = False, why
        now = time.monotonic()
        self.restarts = [t for t in self.restarts if now - t < self.restart_window] + [now]
        if len(self.restarts) > self.max_restarts:
            return self._give_up(f"{why}; not restarting again ({self.max_restarts} restarts within "
                                 f"{self.restart_window:g} s)")
        self.report(f"[dspark-trt] {why}; restarting tritonserver (in-flight requests fail)")
        self._generation += 1
        self._probe, self._probe_result, self._failed_probes = None, None, 0
        self.server.kill()
        try:
            seconds = self.server.start(timeout=self.ready_timeout, abort=self._stop)
        except (RuntimeError, OSError) as e:
            if self._stop.is_set():
                return
            return self._give_up(f"{why}; the restart failed: {e}")
        self._last_probe = time.monotonic()
        self._available, self.reason = True, ""
        self.report(f"[dspark-trt] tritonserver ready again in {seconds:.1f} s")

    def _give_up(self, reason: str) -> None:
        self._available, self.reason = False, reason
        self.report(f"[dspark-trt] error: {reason}")
        self.failed.set()
