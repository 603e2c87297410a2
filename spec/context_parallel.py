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
  whole sequences), not tensor parallel (its sequence-parallel regions would need the
  cp slice split again; heads split by TP then by cp is left for later), not
  ``strategy.compile`` (the all-to-all's autograd function is not traced into a
  fullgraph block).
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
    if layout.tp > 1:
        raise ConfigError(f"{name} with tensor_parallel={layout.tp}: context parallel does not compose with "
                          "tensor parallel yet; use strategy.tensor_parallel=1 (FSDP over dp x cp) or strategy.cp=1")
    if s.data_parallel not in ("ddp", "fsdp"):
        raise ConfigError(f"{name} with strategy.data_parallel={s.data_parallel}: the gradients must be reduced over "
                          "the cp ranks; use strategy.data_parallel=ddp or fsdp")
    if s.compile:
        raise ConfigError(f"{name} with strategy.compile=true: the all-to-all around attention is not compiled; "
                          "use strategy.compile=false")
    if m.n_heads % cp or (kv % cp and cp % kv):
        fits = [d for d in range(2, m.n_heads + 1) if m.n_heads % d == 0 and (kv % d == 0 or d % kv == 0)]
        raise ConfigError(f"{name} must divide model.n_heads={m.n_heads} and divide (or be a multiple of) "
                          f"model.n_kv_heads={kv}: each rank attends with n_heads/cp heads; use strategy.cp in "
                          f"{fits or [1]}")
    if cfg.train.seq_len % cp:
        raise ConfigError(f"{name} must divide train.seq_len={cfg.train.seq_len} (each rank holds seq_len/cp "
                          f"tokens); use a train.seq_len that is a multiple of {cp}")
