"""DistributedDataParallel: full replicas, gradients all-reduced in buckets.

``gradient_as_bucket_view=True`` makes gradients views into the communication buckets,
so a rank holds one gradient copy (4 B/param in fp32) instead of two.
"""
from __future__ import annotations

import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.nn.parallel import DistributedDataParallel as DDP

from spec.config import RunConfig
from train.harness.dist import DistContext
from spec.layout import Layout
from train.mesh import data_parallel_mesh
from train.model import Transformer
from train.strategies.base import TorchEngine, build_adamw


def settle_buckets(wrapped: DDP, cfg: RunConfig, ctx: DistContext) -> None:
    """One throw-away forward/backward so DDP rebuilds its buckets before training.

    DDP first buckets gradients in reverse parameter order and rebuilds the buckets in
    gradient-arrival order after the first backward. The bucket layout decides how gloo
    and NCCL chunk each all-reduce, hence the summation order of every gradient element:
    without this, the first step of a resumed process (old layout) differs in the last
    bits from the same step of an uninterrupted run (rebuilt layout), and resume is not
    bitwise exact. Gradients are discarded; parameters do not change.
    """
    tokens = torch.zeros(1, min(8, cfg.model.max_seq_len), dtype=torch.long, device=ctx.device)
    wrapped(tokens).float().sum().backward()
    wrapped.zero_grad(set_to_none=True)


def build(model: Transformer, cfg: RunConfig, layout: Layout, ctx: DistContext, mesh: DeviceMesh) -> TorchEngine:
    model.to_empty(device=ctx.device)
    model.init_weights(cfg.train.seed, ctx.device)
    device_ids = [ctx.device.index] if ctx.device.type == "cuda" else None
    # All-reduce over the data-parallel ranks only (the world, until PP/TP ranks exist).
    wrapped = DDP(model, device_ids=device_ids, gradient_as_bucket_view=True,
                  process_group=data_parallel_mesh(mesh).get_group())
    settle_buckets(wrapped, cfg, ctx)
    optimizer = build_adamw(wrapped, cfg.optim, ctx.device)
    return TorchEngine(wrapped, optimizer, cfg, ctx.device, no_sync=wrapped.no_sync)
