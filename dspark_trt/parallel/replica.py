"""A served model under tensor parallelism: rank 0 leads, the other ranks replay its scheduler.

Requests reach only rank 0 (the Triton model instance). Every rank holds the same ``Scheduler``
(the scheduler is deterministic), so it is enough to send the followers what changes it: each
``add_request`` (with its seed fixed on rank 0), ``abort`` and ``step`` of rank 0, in order. They
travel as one ``broadcast_object_list`` per step over a separate gloo group (CPU, long timeout:
an idle server waits there without an NCCL kernel spinning), before rank 0's own step; then all
ranks run the step's collectives together.

    rank 0:    LeaderLLM(llm).scheduler() -> add_request / abort / step  (broadcasts)
    rank r>0:  follow(llm)                 -> replays them until ``stop``
"""
from __future__ import annotations

import dataclasses
import random
import warnings
from datetime import timedelta

import torch.distributed as dist

CONTROL_TIMEOUT = timedelta(days=30)        # how long a follower waits for the next command


def control_group():
    """The gloo group for commands; collective: every rank calls it once, in the same order."""
    return dist.new_group(backend="gloo", timeout=CONTROL_TIMEOUT)


class LeaderLLM:
    """Rank 0's ``LLM`` as the serving worker sees it: ``scheduler()`` returns schedulers whose
    changes are broadcast; every other attribute is the LLM's."""

    def __init__(self, llm):
        self.llm, self.group = llm, control_group()
        self._pending: list[tuple] = []
        self._next_id = 0

    def __getattr__(self, name):
        return getattr(self.llm, name)

    def scheduler(self, speculative: bool = True) -> "LeaderScheduler":
        gid, self._next_id = self._next_id, self._next_id + 1
        self._pending.append(("new", gid, speculative))
        return LeaderScheduler(self, self.llm.scheduler(speculative), gid)

    def generator(self, speculative: bool = True) -> "LeaderScheduler":
        """Deprecated alias of ``scheduler()`` (as ``LLM.generator``)."""
        warnings.warn("LeaderLLM.generator() is deprecated; use scheduler()", DeprecationWarning,
                      stacklevel=2)
        return self.scheduler(speculative)

    def flush(self, *tail: tuple) -> None:
        """Broadcast the queued commands (+ ``tail``) to the followers."""
        cmds, self._pending = self._pending + list(tail), []
        dist.broadcast_object_list([cmds], src=0, group=self.group)

    def stop(self) -> None:
        """Release the followers (they return from ``follow``)."""
        self.flush(("stop",))


class LeaderScheduler:
    def __init__(self, leader: LeaderLLM, gen, gid: int):
        self.leader, self.gen, self.gid = leader, gen, gid

    def __getattr__(self, name):
        return getattr(self.gen, name)

    def add_request(self, prompt_ids, params, on_tokens=None):
        if params.seed is None:          # followers must sample with the same seed
            params = dataclasses.replace(params, seed=random.getrandbits(62))
        seq = self.gen.add_request(prompt_ids, params, on_tokens)   # raises before queueing
        self.leader._pending.append(("add", self.gid, seq.prompt_ids, params))
        return seq

    def abort(self, request_id: int, reason: str = "abort"):
        self.leader._pending.append(("abort", self.gid, request_id, reason))
        return self.gen.abort(request_id, reason)

    def step(self):
        self.leader.flush(("step", self.gid))
        return self.gen.step()


def follow(llm) -> int:
    """Replay rank 0's scheduler on this rank until it says stop; returns the steps run."""
    group, gens, steps = control_group(), {}, 0
    while True:
        box = [None]
        dist.broadcast_object_list(box, src=0, group=group)
        for op, *a in box[0]:
            if op == "new":
                gens[a[0]] = llm.scheduler(a[1])
            elif op == "add":
                gens[a[0]].add_request(a[1], a[2])
            elif op == "abort":
                gens[a[0]].abort(a[1], a[2])
            elif op == "step":
                gens[a[0]].step()
                steps += 1
            elif op == "stop":
                return steps
            else:
                raise ValueError(f"unknown command {op!r} from rank 0")
