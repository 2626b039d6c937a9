"""Custom ops of namespace ``dspark``: one file per op (schema, reference, kernels, exporters).

Importing this package registers the ops with torch. Call them through these names so torch.export
keeps each as one node.
"""
import logging

from .dispatch import HAVE_TRITON

if not HAVE_TRITON:     # torch logs "Triton not available" for every triton_op; expected on such a CPU machine
    logging.getLogger("torch._library.triton").setLevel(logging.ERROR)

from . import block_attention as _block_attention  # noqa: F401  (registers dspark::block_attention)
from . import kv_cache as _kv_cache  # noqa: F401
from . import markov_sample as _markov_sample  # noqa: F401
from . import moe_experts as _moe_experts  # noqa: F401
from . import noncausal_swa_indices as _noncausal_swa_indices  # noqa: F401
from . import rejection_sample as _rejection_sample  # noqa: F401
from . import sparse_mla_attention as _sparse_mla_attention  # noqa: F401
from .rejection_sample import apply_top_p, sample_tokens

import torch

kv_cache_write = torch.ops.dspark.kv_cache_write
block_attention = torch.ops.dspark.block_attention
markov_sample = torch.ops.dspark.markov_sample
markov_sample_topk = torch.ops.dspark.markov_sample_topk     # fast mode: candidate-restricted proposal
kv_cache_update = torch.ops.dspark.kv_cache_update           # functional kv_cache_write (ONNX export)
rejection_sample = torch.ops.dspark.rejection_sample
noncausal_swa_indices = torch.ops.dspark.noncausal_swa_indices
sparse_mla_attention = torch.ops.dspark.sparse_mla_attention
moe_experts = torch.ops.dspark.moe_experts

__all__ = ["kv_cache_write", "kv_cache_update", "block_attention", "markov_sample", "markov_sample_topk",
           "rejection_sample",
           "noncausal_swa_indices", "sparse_mla_attention", "moe_experts",
           "apply_top_p", "sample_tokens"]
