"""Which strategy runs on which engine, with which degrees: the support matrix.

Pure (no torch): the launcher refuses an unsupported combination before submission with
the same table the job uses. ``BUILDERS`` maps (engine, data_parallel) to the builder
that :func:`train.strategies.get_builder` imports on the compute side.
"""
from __future__ import annotations

from typing import Dict, Tuple

from spec import ds_config
from spec.config import ConfigError, RunConfig
from spec.float8 import check_float8_layout
from spec.layout import Layout
from spec.packing import check_packing
from spec.peft import check_peft_layout

# (engine, data_parallel) -> "module:EngineBuilder class" (train/strategies/base.py).
BUILDERS: Dict[Tuple[str, str], str] = {
    ("torch", "ddp"): "train.strategies.ddp:DDPBuilder",
    ("torch", "fsdp"): "train.strategies.fsdp:FSDPBuilder",
    ("torch", "none"): "train.strategies.tp:TPBuilder",  # tensor parallel alone
    ("deepspeed", "zero0"): "train.strategies.deepspeed:DeepSpeedBuilder",
    ("deepspeed", "zero1"): "train.strategies.deepspeed:DeepSpeedBuilder",
    ("deepspeed", "zero2"): "train.strategies.deepspeed:DeepSpeedBuilder",
    ("deepspeed", "zero3"): "train.strategies.deepspeed:DeepSpeedBuilder",
}


def builder_key(cfg: RunConfig) -> Tuple[str, str]:
    s = cfg.strategy
    return (s.engine, s.data_parallel if s.engine == "torch" else f"zero{s.zero_stage}")


def check_supported(cfg: RunConfig, layout: Layout) -> None:
    """Raise ConfigError for a combination this version cannot run (before submission)."""
    ds_config.check(cfg)
    key = builder_key(cfg)
    if key not in BUILDERS:
        known = ", ".join(f"engine={e} data_parallel={d}" for e, d in BUILDERS)
        raise ConfigError(f"strategy {cfg.strategy.name!r} (engine={key[0]}, {key[1]}) is not available in this "
                          f"version; available: {known}")
    if layout.pp_enabled:
        _check_pp(cfg, layout, key)
    _check_tp(cfg, layout, key)
    _check_compile(cfg, key)
    check_packing(cfg, layout)
    check_peft_layout(cfg, layout)
    check_float8_layout(cfg, layout)


def _check_compile(cfg: RunConfig, key: Tuple[str, str]) -> None:
    """``strategy.compile`` compiles each block before the engine wraps the model
    (train/parallelize.py). ZeRO-3 partitions the parameters and gathers them in hooks on
    every submodule, which it marks by walking ``module.modules()``: a compiled block's
    wrapper keeps its parameters in a plain dict, and the first forward fails (DeepSpeed
    0.19: ``'dict' object has no attribute '_in_forward'``)."""
    if cfg.strategy.compile and key == ("deepspeed", "zero3"):
        raise ConfigError(f"strategy {cfg.strategy.name!r}: strategy.compile=true with DeepSpeed ZeRO-3 "
                          "(zero_stage=3): its parameter gathers hook every submodule and fail on compiled blocks; "
                          "set strategy.compile=false, or use +strategy=fsdp (sharded like ZeRO-3, compiled per "
                          "block)")


def stages_per_rank(schedule: str) -> int:
    """Pipeline stages one rank holds: 2 for the interleaved schedule (looped placement)."""
    return 2 if schedule == "interleaved_1f1b" else 1


def _check_pp(cfg: RunConfig, layout: Layout, key: Tuple[str, str]) -> None:
    s, name, pp = cfg.strategy, cfg.strategy.name, layout.pp
    if s.engine != "torch":
        raise ConfigError(f"strategy {name!r}: pipeline_parallel={pp} with engine={s.engine}: pipeline parallel "
                          "runs on the torch engine (torch.distributed.pipelining); use +strategy=pp or "
                          "+strategy=pp_fsdp_tp, or strategy.pipeline_parallel=1")
    if key == ("torch", "none") and layout.dp > 1:
        raise ConfigError(f"strategy {name!r}: data_parallel=none but pipeline_parallel={pp} leaves dp={layout.dp} "
                          f"data-parallel ranks ({layout.describe()}); use strategy.data_parallel=ddp or fsdp")
    v = stages_per_rank(s.pp_schedule)
    if pp * v > cfg.model.n_layers:
        raise ConfigError(f"strategy.pipeline_parallel={pp} x {v} stage(s) per rank ({s.pp_schedule}) = {pp * v} "
                          f"stages > model.n_layers={cfg.model.n_layers}; use fewer stages or another pp_schedule")
    if cfg.model.tie_embeddings:
        raise ConfigError(f"model.tie_embeddings=true with pipeline_parallel={pp}: the embedding and the head "
                          "live on different stages; use model.tie_embeddings=false or pipeline_parallel=1")
    m, batch = s.pp_microbatches, cfg.train.micro_batch_size * cfg.train.grad_accum
    if batch % m:
        raise ConfigError(f"strategy.pp_microbatches={m} must divide the sequences per rank and step, "
                          f"train.micro_batch_size x train.grad_accum = {batch}; pick a divisor of {batch}")
    if s.pp_schedule == "1f1b" and m < pp:
        raise ConfigError(f"strategy.pp_microbatches={m} < pipeline_parallel={pp}: 1F1B needs at least one "
                          f"micro-batch per stage; use strategy.pp_microbatches>={pp}")
    rounds = max(1, m // pp)
    if s.pp_schedule == "interleaved_1f1b" and m % rounds:
        raise ConfigError(f"strategy.pp_microbatches={m} with interleaved_1f1b and pipeline_parallel={pp} must be "
                          f"a multiple of the rounds m // pp = {rounds}; use a multiple of {pp}")


def _check_tp(cfg: RunConfig, layout: Layout, key: Tuple[str, str]) -> None:
    name = cfg.strategy.name
    if key == ("torch", "none") and layout.dp > 1:
        raise ConfigError(f"strategy {name!r}: data_parallel=none but the layout has dp={layout.dp} data-parallel "
                          f"ranks ({layout.describe()}); use +strategy=fsdp_tp or tensor_parallel={layout.world_size}")
    if not layout.tp_enabled:
        return
    if key not in (("torch", "fsdp"), ("torch", "none")):
        raise ConfigError(f"strategy {name!r} ({key[0]} {key[1]}) with tensor_parallel={layout.tp}: tensor parallel "
                          "composes with FSDP only (DDP and DeepSpeed do not take DTensor parameters); "
                          "use +strategy=tp or +strategy=fsdp_tp")
    if cfg.model.tie_embeddings:
        raise ConfigError(f"model.tie_embeddings=true with tensor_parallel={layout.tp}: the tied embedding/head is "
                          "not sharded by the TP plan; use tensor_parallel=1 or model.tie_embeddings=false")
