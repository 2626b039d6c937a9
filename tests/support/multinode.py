"""Two torchrun agents ("nodes") on this machine, started together, one c10d rendezvous:
``python -m torch.distributed.run --nnodes 2 --node-rank R --nproc-per-node 2 --rdzv-backend c10d
--rdzv-endpoint 127.0.0.1:PORT --rdzv-id ID`` for R = 0, 1, each rank running
``tests/support/rank_probe.py`` (which records its torchrun variables) and then ``dspark_trt.cli``.

``Nodes`` is a context manager: on exit every agent still running gets SIGTERM, then SIGKILL,
and any recorded rank still alive is killed by its pid, so a failing or hung test leaves nothing
running. Output of each agent (and its ranks) goes to a file, not a pipe.
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

from tests.support.ports import free_port

ROOT = Path(__file__).resolve().parents[2]
PROBE = Path(__file__).with_name("rank_probe.py")
NODES, PROCS = 2, 2


class Nodes:
    def __init__(self, argv: list[str], work: Path, nodes: int = NODES, procs: int = PROCS):
        self.work, self.nodes, self.procs = Path(work), nodes, procs
        self.ranks_dir = self.work / "ranks"
        self.ranks_dir.mkdir(parents=True, exist_ok=True)
        endpoint, run_id = f"127.0.0.1:{free_port()}", f"dspark-test-{uuid.uuid4().hex[:8]}"
        self.cmds = [[sys.executable, "-m", "torch.distributed.run", "--nnodes", str(nodes),
                      "--node-rank", str(n), "--nproc-per-node", str(procs), "--rdzv-backend", "c10d",
                      "--rdzv-endpoint", endpoint, "--rdzv-id", run_id,
                      "--rdzv-conf", "join_timeout=120", "--max-restarts", "0",
                      str(PROBE), str(self.ranks_dir), *argv] for n in range(nodes)]
        self.logs = [self.work / f"node{n}.log" for n in range(nodes)]
        self.agents: list[subprocess.Popen] = []

    def __enter__(self) -> "Nodes":
        env = {**os.environ, "OMP_NUM_THREADS": "1"}
        for cmd, log in zip(self.cmds, self.logs):
            with open(log, "w") as f:
                self.agents.append(subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=f,
                                                    stderr=subprocess.STDOUT, start_new_session=True))
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def wait(self, timeout: float) -> list[int]:
        """Every agent's exit code; AssertionError (with the logs) past ``timeout`` seconds."""
        deadline = time.monotonic() + timeout
        for a in self.agents:
            try:
                a.wait(max(deadline - time.monotonic(), 0.1))
            except subprocess.TimeoutExpired:
                raise AssertionError(f"torchrun agents still running after {timeout:.0f} s\n"
                                     + self.tails()) from None
        return [a.returncode for a in self.agents]

    def alive(self) -> bool:
        return all(a.poll() is None for a in self.agents)

    def ranks(self) -> list[dict]:
        """The probe records, by RANK."""
        recs = [json.loads(p.read_text()) for p in self.ranks_dir.glob("rank*.json")]
        return sorted(recs, key=lambda r: int(r["RANK"]))

    def output(self, node: int) -> str:
        return self.logs[node].read_text(errors="replace")

    def tails(self, chars: int = 3000) -> str:
        return "\n".join(f"--- node {n} (agent {' '.join(self.cmds[n][3:7])}):\n{self.output(n)[-chars:]}"
                         for n in range(self.nodes))

    def stop(self, grace_s: float = 15.0) -> None:
        for a in self.agents:
            if a.poll() is None:
                a.send_signal(signal.SIGTERM)          # the agent stops its ranks
        deadline = time.monotonic() + grace_s
        for a in self.agents:
            try:
                a.wait(max(deadline - time.monotonic(), 0.1))
            except subprocess.TimeoutExpired:
                os.killpg(a.pid, signal.SIGKILL)       # the agent's own session (start_new_session)
                a.wait()
        for r in self.ranks():                         # ranks run in sessions of their own
            _kill_if_probe(r["pid"])


def _kill_if_probe(pid: int) -> None:
    """SIGKILL ``pid`` if it is still one of this test's ranks (the pid not reused)."""
    try:
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return                                         # gone (or no /proc)
    if str(PROBE).encode() in cmdline:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
