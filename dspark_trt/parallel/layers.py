"""Sharded layers and the two collectives they use (Megatron-style, over torch.distributed).

The collectives are custom ops (``dspark_tp::all_reduce_sum``, ``dspark_tp::all_gather_last``):
functional (a new output tensor), run eagerly on NCCL or gloo, and opaque to ``torch.export`` and
AOTInductor, which call them through the dispatcher inside per-rank engines (builder/build.py,
``--tp-size``). (``torch.distributed._functional_collectives`` were tried first: AOTInductor
lowers them to in-place ``all_reduce_`` and, in torch 2.13, can fuse a consumer of the reduced
value into a kernel scheduled before the collective, which gives wrong logits.)

Slicing helpers return fresh contiguous modules, so the full weights can be freed after sharding.
An ``Fp8Linear`` is sliced with its 128 x 128 block scales: a shard must start on a block boundary
or lie inside one block (each of its rows / columns then keeps its block's scale). An
``Mxfp4Linear`` (routed experts) is sliced with its E8M0 scales: any rows, and input columns in
whole 32-column scale groups.
"""
from __future__ import annotations

import torch
import torch.distributed as dist
from torch import Tensor, nn

from ..models.fp8_linear import Fp8Linear
from ..models.mxfp4_linear import Mxfp4Linear
from ..plugins.fp8_linear import FP8_BLOCK
from ..plugins.moe_experts_mxfp4 import MXFP4_GROUP


class ColumnShardError(ValueError):
    """A dimension that must be split across ranks is not divisible by the world size."""


@torch.library.custom_op("dspark_tp::all_reduce_sum", mutates_args=())
def all_reduce_sum(x: Tensor) -> Tensor:
    """Sum of ``x`` over the ranks of the default group (a new tensor)."""
    y = x.clone()
    dist.all_reduce(y)
    return y


@all_reduce_sum.register_fake
def _(x: Tensor) -> Tensor:
    return torch.empty_like(x)


@torch.library.custom_op("dspark_tp::all_gather_last", mutates_args=())
def all_gather_last(x: Tensor, world: int) -> Tensor:
    """[.., n] on every rank -> [.., world * n], rank r's part at columns [r n, (r + 1) n)."""
    n = x.shape[-1]
    local = x.reshape(-1, n).contiguous()                                       # [M, n]
    parts = local.new_empty(world * local.shape[0], n)
    dist.all_gather_into_tensor(parts, local)
    return parts.view(world, -1, n).permute(1, 0, 2).reshape(*x.shape[:-1], world * n)


@all_gather_last.register_fake
def _(x: Tensor, world: int) -> Tensor:
    return x.new_empty(*x.shape[:-1], world * x.shape[-1])


def check_rank(rank: int, world: int) -> None:
    if not 0 <= rank < world:
        raise ValueError(f"rank {rank} is outside the tensor-parallel group of size {world}")


def split(n: int, world: int, what: str) -> int:
    """``n / world``, or ``ColumnShardError`` naming the dimension."""
    if n % world:
        raise ColumnShardError(f"{what} = {n} is not divisible by the tensor-parallel size {world}")
    return n // world


def _linear(w: Tensor) -> nn.Linear:
    out = nn.Linear(w.shape[1], w.shape[0], bias=False, device=w.device, dtype=w.dtype)
    out.weight = nn.Parameter(w.contiguous(), requires_grad=False)
    return out


def fp8_blocks(lo: int, hi: int, what: str) -> slice:
    """The fp8 scale blocks of features ``lo..hi``; ``ColumnShardError`` when the shard starts
    inside a block and reaches into the next one (its first block would need two scales)."""
    if lo % FP8_BLOCK and lo // FP8_BLOCK != (hi - 1) // FP8_BLOCK:
        raise ColumnShardError(f"{what} {lo}..{hi}: an fp8 shard must start on a multiple of "
                               f"{FP8_BLOCK} (the scale block) or lie inside one block")
    return slice(lo // FP8_BLOCK, (hi - 1) // FP8_BLOCK + 1)


def check_fp8_shards(name: str, linear: nn.Module, size: int, world: int) -> None:
    """Every rank's ``size``-wide slice of ``linear`` fits its scale blocks when it is an
    ``Fp8Linear`` (``fp8_blocks``; nothing to check for other linears)."""
    if isinstance(linear, Fp8Linear):
        for r in range(world):
            fp8_blocks(r * size, (r + 1) * size, f"{name} (fp8) rank {r} of {world}:")


def mxfp4_groups(lo: int, hi: int, what: str) -> slice:
    """The E8M0 scale groups of input features ``lo..hi``; ``ColumnShardError`` unless both ends
    are multiples of 32 (a group's 32 columns share one scale and 16 packed bytes)."""
    if lo % MXFP4_GROUP or hi % MXFP4_GROUP:
        raise ColumnShardError(f"{what} input features {lo}..{hi}: an MXFP4 shard must start and end on a "
                               f"multiple of {MXFP4_GROUP} (one E8M0 scale per {MXFP4_GROUP} columns)")
    return slice(lo // MXFP4_GROUP, hi // MXFP4_GROUP)


def check_mxfp4_cols(name: str, linear: nn.Module, size: int, world: int) -> None:
    """Every rank's ``size``-wide input slice of ``linear`` keeps whole scale groups when it is an
    ``Mxfp4Linear`` (nothing to check for other linears)."""
    if isinstance(linear, Mxfp4Linear):
        shape = [linear.out_features, linear.in_features]
        for r in range(world):
            mxfp4_groups(r * size, (r + 1) * size, f"{name} (MXFP4, weight {shape}) rank {r} of {world}:")


def _fp8(w: Tensor, scale: Tensor, act_quant: bool) -> Fp8Linear:
    out = Fp8Linear(w.shape[1], w.shape[0], device="meta", act_quant=act_quant)
    out.weight = nn.Parameter(w.contiguous(), requires_grad=False)
    out.weight_scale_inv = nn.Parameter(scale.contiguous(), requires_grad=False)
    return out


def rows(linear: nn.Linear | Fp8Linear | Mxfp4Linear, lo: int, hi: int) -> nn.Module:
    """Column-parallel slice: output features ``lo..hi`` of ``linear``."""
    if isinstance(linear, Mxfp4Linear):
        return Mxfp4Linear.from_parts(linear.weight[lo:hi].clone(), linear.weight_scale[lo:hi].clone())
    if isinstance(linear, Fp8Linear):
        blocks = fp8_blocks(lo, hi, "output features")
        return _fp8(linear.weight.data[lo:hi].clone(), linear.weight_scale_inv.data[blocks].clone(), linear.act_quant)
    return _linear(linear.weight.data[lo:hi].clone())


def cols(linear: nn.Linear | Fp8Linear | Mxfp4Linear, lo: int, hi: int) -> nn.Module:
    """Row-parallel slice: input features ``lo..hi`` of ``linear``."""
    if isinstance(linear, Mxfp4Linear):
        groups = mxfp4_groups(lo, hi, "")
        return Mxfp4Linear.from_parts(linear.weight[:, lo // 2:hi // 2].clone(), linear.weight_scale[:, groups].clone())
    if isinstance(linear, Fp8Linear):
        blocks = fp8_blocks(lo, hi, "input features")
        return _fp8(linear.weight.data[:, lo:hi].clone(), linear.weight_scale_inv.data[:, blocks].clone(),
                    linear.act_quant)
    return _linear(linear.weight.data[:, lo:hi].clone())


class SumOverRanks(nn.Module):
    """Wraps a module whose output on each rank is a partial sum (a row-parallel linear, sharded
    or distributed experts); ``forward`` returns the full sum, identical on every rank."""

    def __init__(self, inner: nn.Module):
        super().__init__()
        self.inner = inner

    def forward(self, *args) -> Tensor:
        return all_reduce_sum(self.inner(*args))


class RowParallel(SumOverRanks):
    """A row-parallel ``nn.Linear`` (its input features are this rank's slice):
    [.., in/world] -> [.., out], summed with one all_reduce."""

    @property
    def linear(self) -> nn.Linear:
        return self.inner


def vocab_shard(vocab_size: int, world: int, rank: int) -> tuple[int, int]:
    """Rank ``rank``'s vocabulary rows ``[lo, hi)``: ``ceil(V / world)`` each, the last short."""
    shard = -(-vocab_size // world)
    lo, hi = rank * shard, min(vocab_size, (rank + 1) * shard)
    if hi <= lo:
        raise ColumnShardError(f"vocab_size = {vocab_size} leaves rank {rank} of {world} no "
                               "vocabulary rows")
    return lo, hi


class VocabParallelHead(nn.Module):
    """The LM head with this rank's ``ceil(V / world)`` vocabulary rows; the logits of all ranks
    are all-gathered: [.., d] -> [.., V] (the last shard may be short; its padding is dropped)."""

    def __init__(self, linear: nn.Linear, vocab_size: int, world: int):
        super().__init__()
        self.linear, self.vocab_size, self.world = linear, vocab_size, world
        self.shard = -(-vocab_size // world)

    @property
    def weight(self) -> Tensor:
        """This rank's rows [shard or fewer, d] (dtype/device probes of the draft use it)."""
        return self.linear.weight

    def forward(self, x: Tensor) -> Tensor:
        local = self.linear(x)                                                   # [.., <= shard]
        if local.shape[-1] < self.shard:
            local = nn.functional.pad(local, (0, self.shard - local.shape[-1]))
        return all_gather_last(local, self.world)[..., :self.vocab_size]         # [.., V]


class VocabParallelEmbedding(nn.Module):
    """This rank's rows ``[lo, hi)`` of the embedding table; ids outside them read zeros, and the
    sum over ranks (one all_reduce) is the full lookup, exactly: [..] -> [.., d]."""

    def __init__(self, embedding: nn.Embedding, lo: int, hi: int):
        super().__init__()
        self.lo, self.hi = lo, hi
        self.weight = nn.Parameter(embedding.weight.data[lo:hi].clone(), requires_grad=False)

    def forward(self, ids: Tensor) -> Tensor:
        local = ids - self.lo
        inside = (local >= 0) & (local < self.hi - self.lo)
        x = nn.functional.embedding(local.clamp(0, self.hi - self.lo - 1), self.weight)
        return all_reduce_sum(torch.where(inside[..., None], x, 0))
