"""DistributedDataParallel: full replicas, gradients all-reduced in buckets.

``gradient_as_bucket_view=True`` makes gradients views into the communication buckets,
so a rank holds one gradient copy (4 B/param in fp32) instead of two.
"""
from __future__ import annotations

from torch.nn.parallel import DistributedDataParallel as DDP

from train.config import RunConfig
from train.dist import DistContext
from train.layout import Layout
from train.model import Transformer
from train.strategies.base import TorchEngine, build_adamw


def build(model: Transformer, cfg: RunConfig, layout: Layout, ctx: DistContext) -> TorchEngine:
    model.to_empty(device=ctx.device)
    model.init_weights(cfg.train.seed, ctx.device)
    device_ids = [ctx.device.index] if ctx.device.type == "cuda" else None
    wrapped = DDP(model, device_ids=device_ids, gradient_as_bucket_view=True)
    optimizer = build_adamw(wrapped, cfg.optim, ctx.device)
    return TorchEngine(wrapped, optimizer, cfg, ctx.device, no_sync=wrapped.no_sync)
