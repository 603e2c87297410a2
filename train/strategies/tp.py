"""Tensor parallel (Megatron-style, on DTensor) with sequence parallel, as torchtitan does.

The plan is data: module FQN -> ParallelStyle, one for the root and one for every block.

- Attention and MLP: the first matmuls (wq/wk/wv, w1/w3) are column-parallel, each
  rank computing its slice of the heads / hidden units with no communication; the last
  (wo, w2) is row-parallel, its partial sums reduce-scattered along the sequence.
- Between blocks activations stay sharded along the sequence (dim 1), so the norms
  (SequenceParallel) and the residual adds run on 1/tp of the tokens; each attention /
  MLP input is all-gathered along the sequence first (PrepareModuleInput).
- Embedding: row-parallel over the vocabulary (each rank looks up its rows, the partial
  results are reduce-scattered to sequence shards). Head: column-parallel over the
  vocabulary; its logits stay sharded over the vocabulary and the cross-entropy runs
  vocab-parallel (train/vocab_parallel.py, as torchtitan's ``loss_parallel``
  and Megatron-LM), so no rank holds the full vocabulary's logits; on a pipeline's last
  stage too, where the schedule hands the sharded logits to the same loss function.

Every parameter ends up a DTensor on the TP mesh (norms replicated), so FSDP on top
gives uniform 2D (dp, tp) parameters and the gradient norm is one DTensor reduction.
The model's Attention views with -1 heads, so it runs unchanged on its local heads.
"""
from __future__ import annotations

from typing import Dict, List

from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import (ColwiseParallel, ParallelStyle, PrepareModuleInput, RowwiseParallel,
                                               SequenceParallel, parallelize_module)

from train.model import Transformer
from train.strategies.base import EngineBuilder, TorchEngine
from train.strategies.fsdp import dtensor_engine


def root_plan(vocab_parallel: bool = False) -> Dict[str, ParallelStyle]:
    """``vocab_parallel``: the head's logits stay sharded over the vocabulary (a DTensor)
    and ``loss_fn`` computes the loss in parallel (train/vocab_parallel.py); else
    they are gathered, every TP rank holding the full vocabulary's logits."""
    head = (ColwiseParallel(input_layouts=Shard(1), output_layouts=Shard(-1), use_local_output=False)
            if vocab_parallel else ColwiseParallel(input_layouts=Shard(1), output_layouts=Replicate()))
    return {
        "tok_embeddings": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1)),
        "norm": SequenceParallel(),
        "output": head,
    }


def block_plan(qk_norm: bool = False) -> Dict[str, ParallelStyle]:
    """``qk_norm`` (Qwen3): the q/k norms act per head on the column-parallel wq/wk's local
    heads (batch, seq, heads, head_dim): their input is taken as sharded over the heads
    (dim 2), their weight replicated (its gradient summed over the ranks' heads), their
    output this rank's heads again. Qwen2's q/k/v biases shard with their ColwiseParallel
    weights (the style shards a Linear's bias too)."""
    heads = {f"attention.{n}": SequenceParallel(sequence_dim=2, use_local_output=True) for n in ("q_norm", "k_norm")}
    return {**(heads if qk_norm else {}),
        "attention_norm": SequenceParallel(),
        # (x, rope): gather x along the sequence; rope is a plain tensor, left alone.
        "attention": PrepareModuleInput(input_layouts=(Shard(1), None), desired_input_layouts=(Replicate(), None)),
        "attention.wq": ColwiseParallel(),
        "attention.wk": ColwiseParallel(),
        "attention.wv": ColwiseParallel(),
        "attention.wo": RowwiseParallel(output_layouts=Shard(1)),
        "ffn_norm": SequenceParallel(),
        "feed_forward": PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)),
        "feed_forward.w1": ColwiseParallel(),
        "feed_forward.w3": ColwiseParallel(),
        "feed_forward.w2": RowwiseParallel(output_layouts=Shard(1)),
    }


def apply_tp(model: Transformer, tp_mesh: DeviceMesh, vocab_parallel: bool = False) -> None:
    """Shard the (meta) model in place; must run before activation checkpointing wraps blocks.

    A pipeline stage holds only some of the root's modules: the plan keeps those it has.
    """
    plan = {fqn: style for fqn, style in root_plan(vocab_parallel).items() if getattr(model, fqn) is not None}
    parallelize_module(model, tp_mesh, plan)
    for block in model.layers.values():
        parallelize_module(block, tp_mesh, block_plan(model.cfg.qk_norm))


class TPBuilder(EngineBuilder):
    """Tensor parallel only (no data parallel): the preparation applied the plan already."""

    def finish(self, parts: List[nn.Module]) -> TorchEngine:
        return dtensor_engine(parts[0], self.cfg, self.ctx.device)
