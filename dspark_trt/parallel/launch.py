"""Start the other ranks of a tensor-parallel group from a running process (torchrun's job, for a
process that torchrun did not start: the Triton model instance is rank 0 and spawns the rest).

Each rank r > 0 is ``python <argv>`` with torchrun's environment for one node (RANK, LOCAL_RANK = r,
WORLD_SIZE = LOCAL_WORLD_SIZE, MASTER_ADDR / MASTER_PORT on loopback); on GPUs rank r uses
``cuda:r`` (select the GPUs with CUDA_VISIBLE_DEVICES). Always one node: for several, launch
with torchrun (docs/parallel.md). The caller applies the returned environment to itself (rank 0)
before joining the group.
"""
from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

PROJECT_ROOT = Path(__file__).resolve().parents[2]          # the directory holding dspark_trt/


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def spawn_ranks(world: int, argv: list[str]) -> tuple[list[subprocess.Popen], dict[str, str]]:
    """Start ranks 1..world-1; -> (their processes, the environment of rank 0)."""
    if world < 2:
        raise ValueError(f"spawn_ranks needs a world of at least 2 ranks, got {world}")
    base = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()), "WORLD_SIZE": str(world),
            "LOCAL_WORLD_SIZE": str(world), "GROUP_RANK": "0", "GROUP_WORLD_SIZE": "1"}   # one node
    path = os.pathsep.join(p for p in (str(PROJECT_ROOT), os.environ.get("PYTHONPATH", "")) if p)
    procs = [subprocess.Popen([sys.executable, *argv],
                              env={**os.environ, **base, "RANK": str(r), "LOCAL_RANK": str(r),
                                   "PYTHONPATH": path})
             for r in range(1, world)]
    return procs, {**base, "RANK": "0", "LOCAL_RANK": "0"}
