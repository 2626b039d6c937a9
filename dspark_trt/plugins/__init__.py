"""Custom ops of namespace ``dspark``: one package per op (schema, reference, kernel launch, its
``OpSpec``, AOT entry kernel, TensorRT descriptors), collected in ``registry.py``, which every
exporter reads.

Importing this package registers the ops with torch. Call them through these names so torch.export
keeps each as one node.
"""
import logging

from .dispatch import HAVE_TRITON

if not HAVE_TRITON:     # torch logs "Triton not available" for every triton_op; expected on such a CPU machine
    logging.getLogger("torch._library.triton").setLevel(logging.ERROR)

from . import registry  # noqa: E402  (imports every op module: registers the ops with torch)
from .finite import rows_finite  # noqa: E402
from .rejection_sample import apply_top_p, sample_tokens  # noqa: E402

import torch  # noqa: E402

# torch.ops.dspark.<name> for every registered op (kv_cache_write, kv_cache_update: its functional
# twin for ONNX export, block_attention, markov_sample, markov_sample_topk: the fast mode's
# candidate-restricted proposal, rejection_sample, noncausal_swa_indices, sparse_mla_attention,
# moe_experts, moe_experts_mxfp4: its routed experts in MXFP4, fp8_linear)
globals().update({name: getattr(torch.ops.dspark, name) for name in registry.OPS})

__all__ = [*registry.OPS, "apply_top_p", "rows_finite", "sample_tokens"]
