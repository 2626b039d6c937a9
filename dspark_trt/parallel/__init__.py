"""Tensor parallelism over torch.distributed (NCCL on GPUs, gloo on CPU)."""
from .tp import (ColumnShardError, RowParallel, TPInfo, VocabParallelHead, init_tp, shard_qwen3_,
                 shared_seeds)

__all__ = ["ColumnShardError", "RowParallel", "TPInfo", "VocabParallelHead", "init_tp",
           "shard_qwen3_", "shared_seeds"]
