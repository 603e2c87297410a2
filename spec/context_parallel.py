"""Context parallel (``strategy.cp``): what a split of each sequence over ranks can run with.

The method is DeepSpeed-Ulysses' sequence parallel over attention heads
(train/context_parallel.py): the ``cp`` ranks of one group hold the same batch, each a
contiguous slice of every sequence for the projections, the MLP, the norms and the loss;
around attention two all-to-alls trade the slices of the sequence for slices of the
heads, so each rank attends over whole sequences with ``n_heads / cp`` of the heads.
What that takes, checked here before anything is submitted (pure: no torch):

- the heads split evenly: ``cp`` divides ``model.n_heads``, and divides the K/V heads
  or is a multiple of them (then each K/V head is repeated ``cp / n_kv_heads`` times
  before the all-to-all, so every rank gets one);
- the sequence splits evenly: ``cp`` divides ``train.seq_len``;
- the torch engine with a data-parallel wrapper (DDP or FSDP), which reduces the
  gradients over the cp ranks too; not DeepSpeed (its engine reduces over its own
  data-parallel group only), not pipeline parallel (its stages pass hidden states of
  whole sequences), not ``strategy.compile`` (the all-to-all's autograd function is not
  traced into a fullgraph block).

With tensor parallel the heads are split by TP first (each TP rank's column-parallel
q/k/v hold n_heads/tp heads of the cp slice), then by cp over those: the conditions
above apply to n_heads/tp and n_kv_heads/tp.
"""
from __future__ import annotations

from spec.config import ConfigError, RunConfig


def kv_repeats(n_kv_heads: int, cp: int) -> int:
    """Times each K/V head is repeated before the all-to-all: 1 when cp divides them."""
    return 1 if n_kv_heads % cp == 0 else cp // n_kv_heads


def check_context_parallel(cfg: RunConfig, layout) -> None:
    """Raise ConfigError (field, value, fix) for a ``strategy.cp`` the run cannot take."""
    cp, s, m = layout.cp, cfg.strategy, cfg.model
    if cp == 1:
        return
    kv = m.n_kv_heads or m.n_heads
    name = f"strategy.cp={cp}"
    if s.engine != "torch":
        raise ConfigError(f"{name} with strategy.engine={s.engine}: context parallel runs on the torch engine "
                          "(DDP or FSDP); use +strategy=fsdp or +strategy=ddp, or strategy.cp=1")
    if layout.pp > 1:
        raise ConfigError(f"{name} with pipeline_parallel={layout.pp}: pipeline stages pass whole sequences; "
                          "use strategy.pipeline_parallel=1 or strategy.cp=1")
    if s.data_parallel not in ("ddp", "fsdp"):
        raise ConfigError(f"{name} with strategy.data_parallel={s.data_parallel}: the gradients must be reduced over "
                          "the cp ranks; use strategy.data_parallel=ddp or fsdp")
    if s.compile:
        raise ConfigError(f"{name} with strategy.compile=true: the all-to-all around attention is not compiled; "
                          "use strategy.compile=false")
    heads, kv_heads, tp = m.n_heads // layout.tp, kv // layout.tp, layout.tp  # TP split them first
    if heads % cp or (kv_heads % cp and cp % kv_heads):
        fits = [d for d in range(2, heads + 1) if heads % d == 0 and (kv_heads % d == 0 or d % kv_heads == 0)]
        per_tp = f" / tensor_parallel={tp}" if tp > 1 else ""
        raise ConfigError(f"{name} must divide model.n_heads={m.n_heads}{per_tp} and divide (or be a multiple of) "
                          f"model.n_kv_heads={kv}{per_tp}: each rank attends with n_heads/{'tp/' if tp > 1 else ''}cp "
                          f"heads; use strategy.cp in {fits or [1]}")
    if cfg.train.seq_len % cp:
        raise ConfigError(f"{name} must divide train.seq_len={cfg.train.seq_len} (each rank holds seq_len/cp "
                          f"tokens); use a train.seq_len that is a multiple of {cp}")
