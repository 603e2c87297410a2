"""Validation loss every ``train.eval_every`` steps (and after the last step).

The same ``train.eval_batches`` global batches of the held-out split every time (steps
0..N-1 of a loader over the validation tokens), split over the data-parallel ranks as
training batches are; forward only. The ranks' mean losses are gathered and summed in
rank order, as the training loss is (train/loop.py ``_agree``), so the figure is the
same on every rank and bitwise reproducible."""
from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist

from spec.config import RunConfig
from spec.layout import Layout
from train.data import ShardedLoader, build_loader
from train.harness.dist import DistContext
from train.strategies.base import Engine


class Evaluator:
    def __init__(self, cfg: RunConfig, layout: Layout, ctx: DistContext) -> None:
        self.cfg, self.ctx = cfg, ctx
        self.every = cfg.train.eval_every
        self.loader: Optional[ShardedLoader] = None
        if self.every > 0:
            self.loader = build_loader(cfg, layout.dp_rank(ctx.rank), layout.dp, split="val",
                                       cp_rank=layout.cp_rank(ctx.rank))

    def due(self, step: int) -> bool:
        """Whether optimizer step ``step`` (1-based, just done) is followed by an evaluation."""
        return self.loader is not None and (step % self.every == 0 or step == self.cfg.train.steps)

    def run(self, engine: Engine) -> float:
        """Validation loss of the model as it is now (collective)."""
        assert self.loader is not None
        mine = torch.zeros((), dtype=torch.float64)
        for k in range(self.cfg.train.eval_batches):
            self.loader.load_state_dict({"step": k})
            batches = self.loader.next_step()
            mine += engine.eval_loss(batches, self.loader.loss_share).double().cpu() / self.cfg.train.eval_batches
        local = mine.reshape(1).to(self.ctx.device)
        gathered = [torch.empty_like(local) for _ in range(self.ctx.world_size)]
        dist.all_gather(gathered, local)
        return float(torch.stack(gathered).cpu().sum() / self.ctx.world_size)
