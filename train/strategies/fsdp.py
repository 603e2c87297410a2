"""FSDP2 (``fully_shard``): parameters, gradients and optimizer states sharded over dp.

Three strategies share this builder, differing only in config:

- ``fsdp``: full shard (ZeRO-3-like); gathered parameters are freed after forward and
  gathered again in backward (``reshard_after_forward=True``).
- ``fsdp_grad_op``: parameters stay gathered from forward to backward
  (``reshard_after_forward=False``, ZeRO-2-like): one all-gather per step instead of two,
  at the cost of holding each block's full parameters until its backward.
- ``hsdp``: a 2D (dp_replicate, dp_shard) mesh: shard inside a node (fast links),
  replicate across nodes; gradients are reduce-scattered in the node, then all-reduced
  across nodes.

Each transformer block is its own FSDP unit (one all-gather per block, overlapped with
the previous block's compute), then the root takes the rest (embeddings, final norm,
head). Sharding happens on the meta device (:meth:`FSDPBuilder.shard`); the trainer
then materialises only this rank's shards and fills them with the same weights as an
unsharded model (:meth:`train.model.Transformer.init_weights` handles DTensors).
"""
from __future__ import annotations

from typing import List

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

from spec.config import RunConfig
from spec.layout import Layout
from train.mesh import dp_mesh
from train.model import Transformer
from train.strategies.base import EngineBuilder, TorchEngine, build_adamw, compute_dtype


def apply_fsdp(model: Transformer, cfg: RunConfig, layout: Layout, mesh: DeviceMesh, device: torch.device) -> None:
    """Shard ``model`` (still on the meta device) over the dp dims of ``mesh``: each block
    its own unit, then the root. Parameters already on the TP mesh become 2D (dp, tp).
    Also used per pipeline stage (train/strategies/pp.py)."""
    shard_mesh = dp_mesh(mesh, layout)
    dtype = compute_dtype(cfg, device)
    # Compute in `dtype`, but reduce gradients in fp32: a bf16 reduce-scatter over many
    # ranks loses precision in the sum. Where `dtype` is the parameters' own (fp32), no
    # param_dtype: FSDP would otherwise walk every unit's forward inputs to cast them to
    # the dtype they have (the same maths, Python work on every call).
    held = next(model.parameters()).dtype
    mp = MixedPrecisionPolicy(param_dtype=None if dtype == held else dtype, reduce_dtype=torch.float32)
    reshard = cfg.strategy.reshard_after_forward
    for block in model.layers.values():
        fully_shard(block, mesh=shard_mesh, reshard_after_forward=reshard, mp_policy=mp)
    fully_shard(model, mesh=shard_mesh, reshard_after_forward=reshard, mp_policy=mp)


def dtensor_engine(part: nn.Module, cfg: RunConfig, device: torch.device) -> TorchEngine:
    """AdamW over one materialised part whose parameters are DTensors (FSDP, TP)."""
    return TorchEngine(part, build_adamw(part, cfg.optim, device), cfg, device)


class FSDPBuilder(EngineBuilder):
    def shard(self, model: nn.Module) -> None:
        apply_fsdp(model, self.cfg, self.layout, self.mesh, self.ctx.device)

    def finish(self, parts: List[nn.Module]) -> TorchEngine:
        engine = dtensor_engine(parts[0], self.cfg, self.ctx.device)
        # The mixed-precision policy already casts parameters for compute; autocast on top
        # would only add casts. Gradient accumulation needs no no_sync: each micro-batch's
        # reduce-scatter adds into the sharded gradient, which keeps memory at 1/N.
        engine.dtype = torch.float32
        if self.layout.dp_replicate_enabled:  # HSDP: the replicas all-reduce once a step, at its last
            # micro-batch (FSDP keeps the earlier ones' reduce-scattered sums until then)
            engine.accumulating = parts[0].set_requires_all_reduce
        return engine
