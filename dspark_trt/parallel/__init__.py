"""Tensor and expert parallelism over torch.distributed (NCCL on GPUs, gloo on CPU)."""
from .layers import (ColumnShardError, RowParallel, SumOverRanks, VocabParallelEmbedding,
                     VocabParallelHead)
from .tp import TPInfo, init_tp, shard_pair_, shard_qwen3_, shared_seeds

__all__ = ["ColumnShardError", "RowParallel", "SumOverRanks", "TPInfo", "VocabParallelEmbedding",
           "VocabParallelHead", "init_tp", "shard_pair_", "shard_qwen3_", "shared_seeds"]
