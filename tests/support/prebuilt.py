"""Background jobs of a test session: the AOTI engine builds (and the Triton-interpreter cases) that
tests share, each in a process of its own, started when the session starts so that they run beside
the CPU-light tests instead of one after another with them.

A test module declares a job at import and waits for it in a fixture::

    ENGINE = prebuilt.job("qwen3-tiny-engine", build, fixture="engine", timeout=1200)

    @pytest.fixture(scope="module")
    def engine():
        return ENGINE.wait() / MODEL

``build(out: Path, *args)`` (a module-level function) runs in ``python -m tests.support.prebuilt``
and writes under ``out``. After collection, conftest starts the jobs that the selected tests use
(a test uses a job when it is in the module that declared the job and needs its fixture) and moves
the modules that use jobs to the end of the run, in the order their jobs start. Jobs run
``cpu_count - 1`` at a time (one on 2 cores; the test process has the other core), one more while
the test process waits for a job. ``wait()`` starts a job that was not started (a test selected
some other way, an xdist worker), and fails the test with the end of the job's log when the job
exits with an error or runs past its timeout (the job is killed): never a hang.
"""
from __future__ import annotations

import importlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


class JobFailed(Exception):
    pass


class Job:
    def __init__(self, name, fn, args, fixture, timeout, procs, env, declared_in):
        self.name, self.fn, self.args, self.fixture = name, fn, args, fixture
        self.timeout, self.procs, self.env, self.declared_in = timeout, procs, env, declared_in
        self.proc: subprocess.Popen | None = None
        self.queued = False
        self.started = self.ended = None
        self.rc: int | None = None
        self.error: str | None = None       # why it failed, with the end of its log

    @property
    def out(self) -> Path:
        return _SCHED.dir() / self.name

    @property
    def log(self) -> Path:
        return _SCHED.dir() / f"{self.name}.log"

    @property
    def running(self) -> bool:
        return self.proc is not None and self.rc is None

    def used_by(self, item) -> bool:
        return _module(item) == self.declared_in and self.fixture in getattr(item, "fixturenames", ())

    def wait(self) -> Path:
        """-> the job's output directory, once the job has exited 0; fails the test otherwise."""
        import pytest
        _SCHED.waiting(self, +1)
        try:
            while self.rc is None:
                _SCHED.pump()
                time.sleep(0.2)
        finally:
            _SCHED.waiting(self, -1)
        if self.error:
            pytest.fail(self.error, pytrace=False)
        return self.out

    # --- scheduler side (under _SCHED.lock) ---
    def _start(self) -> None:
        self.out.mkdir(parents=True, exist_ok=True)
        env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep),
               "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1"), **self.env}
        with open(self.log, "wb") as log:
            self.proc = subprocess.Popen([sys.executable, "-m", "tests.support.prebuilt", self.fn.__module__,
                                          self.fn.__qualname__, str(self.out), json.dumps(list(self.args))],
                                         cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT,
                                         stdin=subprocess.DEVNULL, start_new_session=True)
        self.started = time.monotonic()

    def _poll(self) -> None:
        rc = self.proc.poll()
        if rc is None and time.monotonic() - self.started > self.timeout:
            self._kill()
            self._end(-1, f"ran past its timeout of {self.timeout} s and was killed")
        elif rc is not None:
            self._end(rc, None if rc == 0 else f"exited with status {rc}")

    def _end(self, rc: int, why: str | None) -> None:
        self.rc, self.ended = rc, time.monotonic()
        if why:
            try:
                tail = self.log.read_text(errors="replace")[-6000:]
            except OSError:
                tail = "(no log)"
            self.error = (f"background job '{self.name}' (tests/support/prebuilt.py) {why} after "
                          f"{self.ended - self.started:.0f} s; the end of its log:\n{tail}")

    def _kill(self) -> None:
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)       # its own session: the job and its children
        except (ProcessLookupError, PermissionError):
            pass
        self.proc.wait()


class _Scheduler:
    def __init__(self):
        self.jobs: dict[str, Job] = {}
        self.queue: list[Job] = []
        self.lock = threading.RLock()
        self.slots = max(1, (os.cpu_count() or 2) - 1)
        self.waiters = 0
        self._dir: Path | None = None
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()

    def dir(self) -> Path:
        with self.lock:
            if self._dir is None:
                self._dir = Path(tempfile.mkdtemp(prefix="dspark-prebuilt-"))
            return self._dir

    def enqueue(self, jobs, front=False) -> None:
        with self.lock:
            new = [j for j in jobs if not j.queued]
            for j in new:
                j.queued = True
            self.queue = new + self.queue if front else self.queue + new
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="dspark-prebuilt", daemon=True)
                self._thread.start()
        self.pump()

    def waiting(self, job: Job, delta: int) -> None:
        if delta > 0:
            self.enqueue([job], front=True)
        with self.lock:
            self.waiters += delta
            if delta > 0 and not job.running and job.rc is None and job in self.queue:
                self.queue.remove(job)                   # the test process waits for it: start it now
                job._start()

    def pump(self) -> None:
        with self.lock:
            for j in self.jobs.values():
                if j.running:
                    j._poll()
            busy = sum(j.procs for j in self.jobs.values() if j.running)
            while self.queue and (busy == 0 or busy + self.queue[0].procs <= self.slots + self.waiters):
                j = self.queue.pop(0)
                j._start()
                busy += j.procs

    def _run(self) -> None:
        while not self._stop.wait(0.5):
            self.pump()

    def shutdown(self) -> None:
        self._stop.set()
        with self.lock:
            self.queue.clear()
            for j in self.jobs.values():
                if j.running:
                    j._kill()
                    j._end(-1, "was stopped at the end of the session")
            if self._dir is not None:
                shutil.rmtree(self._dir, ignore_errors=True)
                self._dir = None


_SCHED = _Scheduler()


def job(name: str, fn, *, fixture: str, args: tuple = (), timeout: float = 1200, procs: int = 1,
        env: dict | None = None) -> Job:
    """Declare a background job (at a test module's import). ``procs``: processes it keeps busy."""
    declared_in = sys._getframe(1).f_globals["__name__"]
    with _SCHED.lock:
        if name in _SCHED.jobs:                          # a module imported twice: one job
            return _SCHED.jobs[name]
        j = _SCHED.jobs[name] = Job(name, fn, tuple(args), fixture, timeout, procs, env or {}, declared_in)
    return j


def start_for(items) -> list:
    """Start the jobs ``items`` use (in the order of their first use); -> ``items`` with the
    modules that use a job moved to the end, ordered as their jobs start."""
    jobs = list(_SCHED.jobs.values())
    used = []
    for item in items:
        for j in jobs:
            if j not in used and j.used_by(item):
                used.append(j)
    if not used:
        return items
    rank = {j.declared_in: i for i, j in reversed(list(enumerate(used)))}
    items = sorted(items, key=lambda it: rank.get(_module(it), -1))
    _SCHED.enqueue(used)
    return items


def _module(item) -> str | None:
    return getattr(getattr(item, "module", None), "__name__", None)


def shutdown() -> None:
    _SCHED.shutdown()


if __name__ == "__main__":             # python -m tests.support.prebuilt MODULE FUNCTION OUT ARGS_JSON
    mod, fn, out, args = sys.argv[1:5]
    t0 = time.time()
    getattr(importlib.import_module(mod), fn)(Path(out), *json.loads(args))
    print(f"[prebuilt] {mod}.{fn} done in {time.time() - t0:.1f} s", flush=True)
