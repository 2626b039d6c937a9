"""Rank r > 0 of a tensor-parallel Triton model: ``python -m dspark_trt.serving.tp_follower
'<config parameters as JSON>'``, started by ``triton_model.DSparkModel`` (rank 0).

It builds the same model shard as rank 0 would for its rank and replays rank 0's scheduler
(``parallel.replica.follow``) until the model is unloaded.
"""
from __future__ import annotations

import json
import sys

import torch
import torch.distributed as dist

from ..parallel.replica import follow
from .source import ServedModel


def main(argv: list[str]) -> int:
    params = json.loads(argv[0])
    threads = int(params.get("cpu_threads", "0") or 0)
    if threads > 0:
        torch.set_num_threads(threads)
    llm = ServedModel.from_parameters(params).load()
    try:
        follow(llm)
    finally:
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
