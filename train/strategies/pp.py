"""Pipeline parallel (torch.distributed.pipelining), alone or with DDP, FSDP and TP.

The model's layers are split into ``pp x v`` contiguous stages (``v = 2`` for the
interleaved schedule, else 1). Rank ``r`` of a pipeline group holds stages ``r, r + pp,
...`` (the looped placement of Interleaved 1F1B), so the first stage (with the
embedding) and the last (with the final norm and the head) sit on the group's first and
last rank. Each stage is a pruned copy of the meta model: the layers it does not hold
are deleted and the root modules it does not hold are ``None``, so every parameter
keeps its name in the full model (checkpoints, weight init and the planner agree).

Per stage, in the order of :mod:`train.parallelize`: tensor parallel, activation
checkpointing, compile and, with ``data_parallel=fsdp``, sharding as
:func:`train.strategies.fsdp.apply_fsdp` (:meth:`PipelineBuilder.wrap`, on the meta
device); the trainer materialises and initialises the stages; then
(:meth:`PipelineBuilder.finish`) ``data_parallel=ddp`` wraps each stage in DDP over the
ranks of the same stage (its gradient all-reduce runs only with the last micro-batch's
backward), and the optimizers, ``PipelineStage`` objects and schedule are built.

A step: the rank's micro-batches of the step (``train.grad_accum`` of
``train.micro_batch_size`` sequences) are concatenated and the schedule splits them into
``strategy.pp_microbatches`` pipeline micro-batches. Forward and backward of one
micro-batch travel the stages with point-to-point sends over the ``pp`` mesh dim:

- ``gpipe``: all forwards, then all backwards; activations of all m micro-batches live
  at once; idle fraction (p - 1) / (m + p - 1).
- ``1f1b``: after p - 1 warm-up forwards each rank alternates one forward, one
  backward; same idle fraction, but at most p micro-batches in flight (needs m >= p).
- ``interleaved_1f1b``: v = 2 stages per rank; the bubble shrinks to
  (p - 1) / (v m + p - 1) for v times the point-to-point traffic (Narayanan et al.,
  2021, "Efficient Large-Scale Language Model Training on GPU Clusters").

Each pipeline micro-batch's loss is the sum over its counted targets divided by the
step's count per data-parallel rank (:class:`ShareLoss`, train/loss.py), the schedule
sums the micro-batches' gradients (``scale_grads=False``), so a step equals one step on
the whole batch whatever the micro-batches' counts. The last stage keeps whole logits
(one pipeline micro-batch's: ``model.loss_chunk_tokens`` does not apply there). The
last stage's loss (the sum of its micro-batches') is broadcast over the pipeline group and the global
gradient norm sums the squared norms of every stage (all-reduce over ``pp``) before
clipping, so every engine reports and clips the same numbers.
"""
from __future__ import annotations

import contextlib
import copy
from typing import Any, Dict, Iterable, List, Optional, Tuple

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe, ScheduleInterleaved1F1B

from spec.config import RunConfig
from spec.layout import Layout
from spec.support import stages_per_rank
from train.harness.dist import DistContext
from train.model import Transformer
from train import steptimes
from train.loss import loss_sum
from train.strategies.base import (Batch, DCPState, EngineBuilder, Prepare, build_adamw, compute_dtype, divisor, set_lr,
                                  state_dict_options, total_grad_norm, with_own_hyperparameters)
from train.strategies.ddp import wrap_ddp
from train.strategies.fsdp import apply_fsdp

SCHEDULES = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B, "interleaved_1f1b": ScheduleInterleaved1F1B}


def split_layers(n_layers: int, n_stages: int) -> List[List[int]]:
    """Contiguous layer indices per stage, as even as possible (later stages take the extra
    layers: the first stage also runs the embedding, the last the head)."""
    base, extra = divmod(n_layers, n_stages)
    sizes = [base + (1 if i >= n_stages - extra else 0) for i in range(n_stages)]
    out, start = [], 0
    for size in sizes:
        out.append(list(range(start, start + size)))
        start += size
    return out


def stage_module(model: Transformer, layer_ids: List[int], first: bool, last: bool) -> Transformer:
    """A pruned copy of the (meta) model holding these layers; names are the full model's."""
    part = copy.deepcopy(model)
    for key in list(part.layers.keys()):
        if int(key) not in layer_ids:
            del part.layers[key]
    if not first:
        part.tok_embeddings = None
    if not last:
        part.norm = None
        part.output = None
    return part


class ShareLoss:
    """The schedule's loss_fn: a pipeline micro-batch's loss sum / ``share`` (set per step)."""

    share = 1.0

    def __init__(self, compiled: bool = False) -> None:
        self.compiled = compiled  # strategy.compile: the loss through torch.compile (train/loss.py)

    def __call__(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return loss_sum(logits, targets, self.compiled) / self.share


class PipelineEngine(DCPState):
    """Runs one optimizer step through a pipeline schedule; ``parts`` are this rank's stages."""

    def __init__(self, parts: List[nn.Module], optimizers: List[torch.optim.Optimizer], schedule, cfg: RunConfig,
                 device: torch.device, pp_group, first: bool, last: bool,
                 autocast: Optional[torch.dtype] = None) -> None:
        self.parts = self.model_parts = parts
        self.share_loss = ShareLoss()  # the schedule's loss_fn (finish hands its own)
        self.optimizers = optimizers
        self.schedule = schedule
        self.device = device
        self.grad_clip = cfg.optim.grad_clip
        self.pp_group = pp_group
        self.first, self.last = first, last
        self.autocast = autocast
        self._last_rank = dist.get_global_rank(pp_group, dist.get_world_size(pp_group) - 1)

    def _joined(self, batches: List[Batch]) -> Tuple[torch.Tensor, torch.Tensor]:
        """The step's inputs and targets on the device, every micro-batch in one tensor (the
        schedule splits them again): each copied as the loader gave it (page-locked on CUDA,
        so the copy does not hold the host), joined there."""
        return (torch.cat([x.to(self.device, non_blocking=True) for x, _ in batches]),
                torch.cat([y.to(self.device, non_blocking=True) for _, y in batches]))

    def train_step(self, micro_batches: Iterable[Batch], lr: float,
                   share: Optional[float] = None) -> Tuple[torch.Tensor, torch.Tensor]:
        """Returns (this dp rank's part of the loss, global grad norm before clipping) on every rank."""
        batches = list(micro_batches)
        self.share_loss.share = divisor(batches, share)
        inputs, targets = self._joined(batches)
        for opt in self.optimizers:
            opt.zero_grad(set_to_none=True)
        losses: List[torch.Tensor] = []
        args = (inputs,) if self.first else ()
        amp = (torch.autocast(self.device.type, dtype=self.autocast) if self.autocast is not None
               else contextlib.nullcontext())
        with amp:  # return_outputs=False: the loss comes from losses; each micro-batch's logits are not kept
            self.schedule.step(*args, target=targets if self.last else None, losses=losses if self.last else None,
                               return_outputs=False)
        if self.last:
            loss = torch.stack([x.detach().float() for x in losses]).sum()
        else:
            loss = torch.zeros((), device=self.device)
        dist.broadcast(loss, src=self._last_rank, group=self.pp_group)
        steptimes.mark_optimizer()
        grad_norm = self._clip()
        set_lr(self.optimizers, lr)
        for opt in self.optimizers:
            opt.step()
        return loss, grad_norm

    def eval_loss(self, micro_batches: Iterable[Batch], share: Optional[float] = None) -> torch.Tensor:
        """The schedule's forward-only pass; the last stage's loss, sent to every stage."""
        batches = list(micro_batches)
        self.share_loss.share = divisor(batches, share)
        inputs, targets = self._joined(batches)
        losses: List[torch.Tensor] = []
        amp = (torch.autocast(self.device.type, dtype=self.autocast) if self.autocast is not None
               else contextlib.nullcontext())
        with torch.no_grad(), amp:
            self.schedule.eval(*((inputs,) if self.first else ()), target=targets if self.last else None,
                               losses=losses if self.last else None)
        loss = (torch.stack([x.detach().float() for x in losses]).sum() if self.last
                else torch.zeros((), device=self.device))
        dist.broadcast(loss, src=self._last_rank, group=self.pp_group)
        return loss

    def _clip(self) -> torch.Tensor:
        """Global gradient norm over every stage, then clip (torchtitan's PP clipping)."""
        params = [p for part in self.parts for p in part.parameters() if p.grad is not None]
        squared = total_grad_norm(params).float() ** 2  # FSDP / TP: the shards' partial norms reduced
        dist.all_reduce(squared, group=self.pp_group)
        total = squared.sqrt()
        if self.grad_clip > 0:
            torch.nn.utils.clip_grads_with_norm_(params, self.grad_clip, total)
        return total

    def state_dict(self) -> Dict[str, Any]:
        """Model and optimizer state of every stage held here, keyed by full-model names."""
        from torch.distributed.checkpoint.state_dict import get_state_dict

        model: Dict[str, Any] = {}
        optim: Dict[str, Any] = {}
        for part, opt in zip(self.parts, self.optimizers):
            m, o = get_state_dict(part, opt, options=state_dict_options())
            model.update(m)
            optim.update(o)
        return {"model": model, "optim": optim}

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

        for part, opt in zip(self.parts, self.optimizers):
            mine_m, mine_o = get_state_dict(part, opt, options=state_dict_options())  # this stage's keys
            set_state_dict(part, opt, model_state_dict={k: state["model"][k] for k in mine_m},
                           optim_state_dict=with_own_hyperparameters(state["optim"], mine_o),
                           options=state_dict_options())


class PipelineBuilder(EngineBuilder):
    """This rank's stages: split and prepared on the meta device, finished after init."""

    def __init__(self, cfg: RunConfig, layout: Layout, ctx: DistContext, mesh: DeviceMesh) -> None:
        super().__init__(cfg, layout, ctx, mesh)
        self.v = stages_per_rank(cfg.strategy.pp_schedule)
        self.n_stages = layout.pp * self.v
        self.pp_rank = mesh["pp"].get_local_rank()
        self.stage_ids = [self.pp_rank + i * layout.pp for i in range(self.v)]

    def wrap(self, model: nn.Module, prepare: Prepare) -> List[nn.Module]:
        """One pruned copy of the meta model per stage held here, prepared (TP, activation
        checkpointing, compile) and, with ``data_parallel=fsdp``, sharded."""
        layers = split_layers(self.cfg.model.n_layers, self.n_stages)
        parts = []
        for sid in self.stage_ids:
            part = stage_module(model, layers[sid], first=sid == 0, last=sid == self.n_stages - 1)
            prepare(part)
            if self.cfg.strategy.data_parallel == "fsdp":
                apply_fsdp(part, self.cfg, self.layout, self.mesh, self.ctx.device)
            parts.append(part)
        return parts

    def finish(self, parts: List[nn.Module]) -> PipelineEngine:
        """DDP per stage (``data_parallel=ddp``), one optimizer per stage, the schedule."""
        s, ctx, pp_group = self.cfg.strategy, self.ctx, self.mesh["pp"].get_group()
        if s.data_parallel == "ddp" and self.layout.dp > 1:
            # find_unused_parameters: no bucket rebuild after the first step. Its record of the
            # order gradients became ready took every microbatch's backward (GPipe, or m <= pp:
            # "rebuilt parameter indices size ... 10 versus 20", torch 2.13); PipelineStage runs
            # all but the last under no_sync and prepares the reducer for the last itself.
            parts = [wrap_ddp(part, ctx, self.mesh, find_unused_parameters=True) for part in parts]
        optimizers = [build_adamw(part, self.cfg.optim, ctx.device) for part in parts]
        stages = [PipelineStage(part, sid, self.n_stages, ctx.device, group=pp_group)
                  for part, sid in zip(parts, self.stage_ids)]
        share_loss = ShareLoss(compiled=s.compile)
        schedule = SCHEDULES[s.pp_schedule](stages if self.v > 1 else stages[0], n_microbatches=s.pp_microbatches,
                                            loss_fn=share_loss, scale_grads=False)
        # FSDP casts through its mixed-precision policy; otherwise autocast around the schedule.
        dtype = compute_dtype(self.cfg, ctx.device)
        autocast = dtype if s.data_parallel != "fsdp" and dtype != torch.float32 else None
        engine = PipelineEngine(parts, optimizers, schedule, self.cfg, ctx.device, pp_group,
                                first=self.pp_rank == 0, last=self.pp_rank == self.layout.pp - 1, autocast=autocast)
        engine.share_loss = share_loss
        return engine
