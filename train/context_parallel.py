"""Context parallel over attention heads (DeepSpeed-Ulysses), ``strategy.cp=N``.

The ``N`` ranks of a cp group hold the same sequences, each a contiguous slice of
``seq/N`` tokens (the loader slices them: train/data/loader.py). Everything but attention
works token by token, so the embedding, the norms, the projections, the MLP, the head and
the loss run on the slice unchanged. Attention needs every token: around it two
all-to-alls (Jacobs et al. 2023, "DeepSpeed Ulysses", arXiv:2309.14509; DeepSpeed's
``deepspeed/sequence/layer.py``) trade the split:

- before: q, k, v of (batch, seq/N, heads, head_dim) -> (batch, seq, heads/N, head_dim):
  rank r sends head group j of its slice to rank j and receives its own head group r of
  every slice, in sequence order;
- after: the attention output goes back, (batch, seq, heads/N, d) -> (batch, seq/N, heads, d).

Each is an autograd function whose backward is the other all-to-all. Attention itself
then sees whole sequences: RoPE at the sequence's own positions, causal SDPA or packing's
document mask over the whole sequence (train/packed_attention.py) exactly as without the
split, so the losses and gradients are cp=1's up to the order of fp32 sums. Grouped K/V
heads split with their query heads (rank r takes query heads r*H/N.. and K/V heads
r*KV/N..); when N is a multiple of the K/V heads instead, each K/V head is repeated
N/KV times first (spec/context_parallel.py), one per rank.

Why Ulysses and not a ring (torch's ``context_parallel``, Megatron's CP): torch's ring
dispatches only CUDA SDPA kernels (flash, memory-efficient, cuDNN), so it cannot run on
the CPU ranks of the tests, where this all-to-all runs the same code on gloo as on NCCL
(``all_to_all_single``); and an all-to-all moves 4 activations of seq/N x dim a rank per
layer forward (q, k, v, output; K/V fewer with GQA) whatever N, where a ring passes K/V
N-1 times. Its limit is the head count: N at most the query heads and dividing them.
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist

from spec.context_parallel import kv_repeats


def _all_to_all(x: torch.Tensor, group, split_dim: int, gather_dim: int) -> torch.Tensor:
    """Split ``x`` in N chunks along ``split_dim``, send chunk j to rank j of ``group``, and
    concatenate what every rank sent along ``gather_dim`` (rank order)."""
    n = dist.get_world_size(group)
    chunks = x.movedim(split_dim, 0).unflatten(0, (n, -1)).movedim(1, split_dim + 1).contiguous()
    out = torch.empty_like(chunks)
    dist.all_to_all_single(out, chunks, group=group)
    # out[i]: rank i's chunk; put it before gather_dim and merge the two.
    return out.movedim(0, gather_dim).flatten(gather_dim, gather_dim + 1)


class _AllToAll(torch.autograd.Function):
    """:func:`_all_to_all` forward; backward the inverse one (split and gather dims swapped)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group, split_dim: int, gather_dim: int) -> torch.Tensor:
        ctx.group, ctx.dims = group, (split_dim, gather_dim)
        return _all_to_all(x, group, split_dim, gather_dim)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        split_dim, gather_dim = ctx.dims
        return _all_to_all(grad, ctx.group, gather_dim, split_dim), None, None, None


class HeadSplit:
    """One cp group's two all-to-alls, held by every attention module of the model."""

    def __init__(self, group, size: int) -> None:
        self.group, self.size = group, size

    def to_heads(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor):
        """q, k, v of this rank's slice, (b, s/N, heads, d) -> whole sequences of its heads."""
        repeat = kv_repeats(k.shape[2], self.size)
        if repeat > 1:
            k, v = k.repeat_interleave(repeat, dim=2), v.repeat_interleave(repeat, dim=2)
        # heads (dim 2) scattered, the sequence (dim 1) gathered
        return tuple(_AllToAll.apply(t, self.group, 2, 1) for t in (q, k, v))

    def to_sequence(self, out: torch.Tensor) -> torch.Tensor:
        """Attention's output (b, s, heads/N, d) -> this rank's slice (b, s/N, heads, d)."""
        return _AllToAll.apply(out, self.group, 1, 2)


def apply_cp(model: torch.nn.Module, cp_mesh) -> Optional[HeadSplit]:
    """Give every attention module of ``model`` (meta, before any wrapper) the all-to-alls
    over ``cp_mesh`` (1-D); a size-1 mesh leaves the model as it is."""
    if cp_mesh.size() == 1:
        return None
    split = HeadSplit(cp_mesh.get_group(), cp_mesh.size())
    for block in model.layers.values():
        block.attention.head_split = split
    return split


def sequence_slice(seq_len: int, cp_rank: int, cp: int) -> slice:
    """The contiguous positions of a sequence of ``seq_len`` that cp rank ``cp_rank`` holds."""
    part = seq_len // cp
    return slice(cp_rank * part, (cp_rank + 1) * part)
