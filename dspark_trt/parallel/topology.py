"""The torchrun launch as one process sees it, checked before any process group is joined.

torchrun (one agent per node, ``--nnodes N --nproc-per-node M``) gives every process RANK (0 ..
WORLD_SIZE-1, global), LOCAL_RANK (0 .. LOCAL_WORLD_SIZE-1 on its node), GROUP_RANK (the node's
index in the rendezvous, 0 .. GROUP_WORLD_SIZE-1) and MASTER_ADDR / MASTER_PORT. A rank uses
the GPU of its LOCAL_RANK on its own node; a tensor-parallel group is the whole launch
(WORLD_SIZE = --tp-size), on one node or several. An inconsistent launch fails here with the
variables named, on every rank alike, instead of in a collective.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Mapping

from ..config import ConfigError


@dataclass(frozen=True)
class Launch:
    rank: int = 0                       # RANK
    world: int = 1                      # WORLD_SIZE
    local_rank: int = 0                 # LOCAL_RANK
    local_world: int | None = None      # LOCAL_WORLD_SIZE (None: not set, ranks started by hand)
    node: int | None = None             # GROUP_RANK (None: not set)
    nodes: int | None = None            # GROUP_WORLD_SIZE

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> "Launch":
        """Read and check the variables (``env``: default ``os.environ``)."""
        env = os.environ if env is None else env
        world = _int(env, "WORLD_SIZE", 1)
        la = cls(_int(env, "RANK", 0), world, _int(env, "LOCAL_RANK", 0),
                 _int(env, "LOCAL_WORLD_SIZE", None), _int(env, "GROUP_RANK", None),
                 _int(env, "GROUP_WORLD_SIZE", None))
        la.check()
        return la

    def check(self) -> None:
        if self.world < 1:
            raise ConfigError(f"WORLD_SIZE={self.world}: must be >= 1")
        if not 0 <= self.rank < self.world:
            raise ConfigError(f"RANK={self.rank} is outside WORLD_SIZE={self.world} (ranks 0..{self.world - 1})")
        if self.local_rank < 0:
            raise ConfigError(f"LOCAL_RANK={self.local_rank}: must be >= 0")
        if self.local_world is not None:
            if not 1 <= self.local_world <= self.world:
                raise ConfigError(f"LOCAL_WORLD_SIZE={self.local_world} (processes on this node) must be "
                                  f"between 1 and WORLD_SIZE={self.world}")
            if self.local_rank >= self.local_world:
                raise ConfigError(f"LOCAL_RANK={self.local_rank} is outside LOCAL_WORLD_SIZE="
                                  f"{self.local_world} (local ranks 0..{self.local_world - 1})")
        if self.nodes is not None and self.node is not None and not 0 <= self.node < self.nodes:
            raise ConfigError(f"GROUP_RANK={self.node} is outside GROUP_WORLD_SIZE={self.nodes} (nodes)")
        if self.nodes is not None and self.nodes > self.world:
            raise ConfigError(f"GROUP_WORLD_SIZE={self.nodes} nodes for WORLD_SIZE={self.world} ranks")

    def describe(self) -> str:
        """``rank 5 of 16 (node 1 of 2, local rank 1 of 8)`` (what is known)."""
        where = []
        if self.node is not None:
            where.append(f"node {self.node}" + (f" of {self.nodes}" if self.nodes is not None else ""))
        where.append(f"local rank {self.local_rank}"
                     + (f" of {self.local_world}" if self.local_world is not None else ""))
        return f"rank {self.rank} of {self.world} ({', '.join(where)})"


def _int(env: Mapping[str, str], name: str, default):
    raw = env.get(name)
    if raw is None or raw == "":
        return default
    try:
        return int(raw)
    except ValueError:
        raise ConfigError(f"{name}={raw!r} is not an integer (torchrun sets RANK, WORLD_SIZE, "
                          "LOCAL_RANK, LOCAL_WORLD_SIZE, GROUP_RANK)") from None


def launch_hint(world: int) -> str:
    """How to launch ``world`` ranks: on one node, or on several."""
    one = f"`torchrun --nproc-per-node {world} -m dspark_trt.cli ... --tp-size {world}`"
    return (f"launch with {one} on one node, or with `torchrun --nnodes N --node-rank R "
            f"--nproc-per-node M --rdzv-endpoint HOST:PORT ...` on N nodes, N x M = {world}")


def check_tp_size(tp_size: int, launch: Launch, what: str) -> None:
    """Tensor parallelism spans the whole launch: WORLD_SIZE must be ``tp_size`` (``what``: the
    option as the caller names it, e.g. ``--tp-size 4``)."""
    if tp_size < 1:
        raise ConfigError(f"{what}: must be >= 1")
    if launch.world == tp_size:
        return
    if launch.world == 1:
        got = "WORLD_SIZE is 1 (or not set: not under torchrun)"
    else:
        shape = (f" ({launch.nodes} node(s) x {launch.local_world} process(es))"
                 if launch.nodes is not None and launch.local_world is not None else "")
        got = f"this launch has WORLD_SIZE={launch.world}{shape}"
        if launch.world % tp_size == 0:
            got += ("; one tensor-parallel group spans the whole launch (no data-parallel replicas "
                    "of a smaller group)")
    raise ConfigError(f"{what} but {got}: {launch_hint(tp_size)}")


def check_gpus(launch: Launch, visible: int) -> None:
    """Every rank of this node needs its own GPU, ``cuda:LOCAL_RANK`` of the ``visible`` ones."""
    devices = os.environ.get("CUDA_VISIBLE_DEVICES")
    seen = f"{visible} GPU(s) visible" + (f" (CUDA_VISIBLE_DEVICES={devices})" if devices is not None else "")
    if launch.local_world is not None and launch.local_world > visible:
        raise ConfigError(f"LOCAL_WORLD_SIZE={launch.local_world} processes on this node but {seen}: "
                          "--nproc-per-node must be at most the GPUs of each node")
    if launch.local_rank >= visible:
        raise ConfigError(f"LOCAL_RANK={launch.local_rank} but {seen} on this node: each rank uses "
                          "cuda:LOCAL_RANK, so a node runs at most as many ranks as it has GPUs")
