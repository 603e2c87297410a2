"""Batch and learning-rate facts of a run, printed at launch and used by the trainer.

Global batch = micro batch x gradient accumulation x data-parallel degree (TP ranks and
the stages of one pipeline share their batch). ``optim.lr_scaling`` adapts the peak
learning rate to it, against ``optim.base_global_batch`` (the batch ``optim.lr`` was
tuned for): ``linear`` (Goyal et al., SGD) multiplies by global/base, ``sqrt`` (the rule
usually taken for Adam) by its square root; ``none`` keeps ``optim.lr``.
"""
from __future__ import annotations

import math
from typing import Tuple

from spec.config import RunConfig
from spec.layout import Layout

RULES = ("none", "linear", "sqrt")


def global_batch(cfg: RunConfig, layout: Layout) -> Tuple[int, int]:
    """(sequences, tokens) per optimizer step."""
    seqs = cfg.train.micro_batch_size * cfg.train.grad_accum * layout.dp
    return seqs, seqs * cfg.train.seq_len


def lr_factor(cfg: RunConfig, layout: Layout) -> float:
    rule, base = cfg.optim.lr_scaling, cfg.optim.base_global_batch
    if rule == "none" or not base:
        return 1.0
    ratio = global_batch(cfg, layout)[0] / base
    return ratio if rule == "linear" else math.sqrt(ratio)


def peak_lr(cfg: RunConfig, layout: Layout) -> float:
    """The learning rate the schedule warms up to."""
    return cfg.optim.lr * lr_factor(cfg, layout)


def batch_line(cfg: RunConfig, layout: Layout) -> str:
    seqs, tokens = global_batch(cfg, layout)
    t = cfg.train
    line = (f"global batch: {seqs} sequences = {tokens:,} tokens per step (micro {t.micro_batch_size} x accum "
            f"{t.grad_accum} x dp {layout.dp}, seq_len {t.seq_len}); peak lr {peak_lr(cfg, layout):.3g}")
    if cfg.optim.lr_scaling != "none":
        line += (f" (optim.lr {cfg.optim.lr:.3g} x {lr_factor(cfg, layout):.3f}: {cfg.optim.lr_scaling} scaling from "
                 f"base_global_batch={cfg.optim.base_global_batch})")
    return line
