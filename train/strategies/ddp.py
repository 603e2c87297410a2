"""DistributedDataParallel: full replicas, gradients all-reduced in buckets.

``gradient_as_bucket_view=True`` makes gradients views into the communication buckets,
so a rank holds one gradient copy (4 B/param in fp32) instead of two. Nothing happens on
the meta model: DDP wraps in :meth:`DDPBuilder.finish`, after the trainer initialised
the weights, because it broadcasts rank 0's parameters when constructed.
"""
from __future__ import annotations

import inspect
from typing import List

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from spec.config import RunConfig
from train.harness.dist import DistContext
from train.mesh import data_parallel_mesh
from train.strategies.base import EngineBuilder, TorchEngine, build_adamw


def settle_buckets(wrapped: DDP, cfg: RunConfig, ctx: DistContext) -> None:
    """One throw-away forward/backward so DDP rebuilds its buckets before training.

    DDP first buckets gradients in reverse parameter order and rebuilds the buckets in
    gradient-arrival order after the first backward. The bucket layout decides how gloo
    and NCCL chunk each all-reduce, hence the summation order of every gradient element:
    without this, the first step of a resumed process (old layout) differs in the last
    bits from the same step of an uninterrupted run (rebuilt layout), and resume is not
    bitwise exact. Gradients are discarded; parameters do not change.

    Eager (``strategy.compile``'s blocks not compiled for it): compiled for this small shape
    first, they would be compiled again at the training shape, then with dynamic sizes
    (torch.compile's automatic dynamic shapes) and kernels made for any size.
    """
    tokens = torch.zeros(1, min(8, cfg.model.max_seq_len), dtype=torch.long, device=ctx.device)
    with torch.compiler.set_stance("force_eager"):
        wrapped(tokens).float().sum().backward()
    wrapped.zero_grad(set_to_none=True)


def wrap_ddp(module: nn.Module, ctx: DistContext, mesh, **options) -> DDP:
    """DDP over the data-parallel ranks of ``mesh`` (also a pipeline stage's wrapper)."""
    device_ids = [ctx.device.index] if ctx.device.type == "cuda" else None
    return DDP(module, device_ids=device_ids, gradient_as_bucket_view=True, **no_buffer_sync(),
               process_group=data_parallel_mesh(mesh).get_group(), **options)


def no_buffer_sync() -> dict:
    """DDP's option that stops it broadcasting the buffers from rank 0 before every forward:
    the only buffer, the RoPE table, is computed alike on every rank. torch 2.13 renamed it
    (``forward_sync_buffers``; ``broadcast_buffers`` warns there), 2.11 knows the old name."""
    if "forward_sync_buffers" in inspect.signature(DDP.__init__).parameters:
        return {"forward_sync_buffers": False}
    return {"broadcast_buffers": False}


class DDPBuilder(EngineBuilder):
    def finish(self, parts: List[nn.Module]) -> TorchEngine:
        # With pp = tp = 1 (the only layouts plain DDP takes) the dp group is the world.
        wrapped = wrap_ddp(parts[0], self.ctx, self.mesh)
        settle_buckets(wrapped, self.cfg, self.ctx)
        optimizer = build_adamw(wrapped, self.cfg.optim, self.ctx.device)
        return TorchEngine(wrapped, optimizer, self.cfg, self.ctx.device, no_sync=wrapped.no_sync)
