"""Apply parallelism in one fixed order (as torchtitan does):

1. tensor parallel (needs the plain module tree, before any wrapper),
2. activation checkpointing (wraps each block; must see TP's modules, not FSDP's),
3. torch.compile per block (compiles the checkpointed, TP-sharded block),
4. data parallel: DDP / FSDP / DeepSpeed, which also materialises the meta model.

With pipeline parallel the model is first split into stages and every stage goes
through the same order (train/strategies/pp.py).
"""
from __future__ import annotations

import torch
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

from spec.config import RunConfig
from train.harness.dist import DistContext
from spec.layout import Layout
from train.mesh import build_mesh
from train.model import Transformer
from spec.support import check_supported
from train.strategies import get_builder
from train.strategies.tp import apply_tp


def apply_activation_checkpointing(model: Transformer, mode: str) -> None:
    """``full``: recompute every block in backward. ``selective``: every other block."""
    if mode == "none":
        return
    for i, (name, block) in enumerate(list(model.layers.items())):
        if mode == "full" or (mode == "selective" and i % 2 == 0):
            model.layers[name] = checkpoint_wrapper(block, preserve_rng_state=False)


def apply_compile(model: Transformer) -> None:
    for name, block in list(model.layers.items()):
        model.layers[name] = torch.compile(block, fullgraph=True)


def parallelize(model: Transformer, cfg: RunConfig, layout: Layout, ctx: DistContext):
    """Meta model -> engine. Builds the job's one DeviceMesh and hands it to the builder."""
    check_supported(cfg, layout)
    mesh = build_mesh(layout, ctx.device.type)

    def prepare(part: Transformer) -> None:
        """Steps 1-3 on the whole model, or on one pipeline stage."""
        if layout.tp_enabled:
            apply_tp(part, mesh["tp"])
        apply_activation_checkpointing(part, cfg.strategy.activation_checkpointing)
        if cfg.strategy.compile:
            apply_compile(part)

    if layout.pp_enabled:
        from train.strategies.pp import build_pipeline

        return build_pipeline(model, cfg, layout, ctx, mesh, prepare)
    prepare(model)
    return get_builder(cfg)(model, cfg, layout, ctx, mesh)
