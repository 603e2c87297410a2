"""Strategy builders, registered by name behind one signature.

``build(model, cfg, layout, ctx) -> Engine``: takes the model on the meta device,
materialises and wraps it, and returns an :class:`train.strategies.base.Engine`.
This module is pure (no torch import) so the launcher can refuse an unsupported
combination before submission with the same table the job uses.
"""
from __future__ import annotations

import importlib
from typing import Callable, Dict, Tuple

from train.config import ConfigError, RunConfig
from train.layout import Layout
from train.strategies import ds_config

# (engine, data_parallel) -> "module:function". Filled in as strategies land.
_BUILDERS: Dict[Tuple[str, str], str] = {
    ("torch", "ddp"): "train.strategies.ddp:build",
    ("torch", "fsdp"): "train.strategies.fsdp:build",
    ("deepspeed", "zero0"): "train.strategies.deepspeed:build",
    ("deepspeed", "zero1"): "train.strategies.deepspeed:build",
    ("deepspeed", "zero2"): "train.strategies.deepspeed:build",
    ("deepspeed", "zero3"): "train.strategies.deepspeed:build",
}


def builder_key(cfg: RunConfig) -> Tuple[str, str]:
    s = cfg.strategy
    return (s.engine, s.data_parallel if s.engine == "torch" else f"zero{s.zero_stage}")


def check_supported(cfg: RunConfig, layout: Layout) -> None:
    """Raise ConfigError for a combination this version cannot run (before submission)."""
    ds_config.check(cfg)
    key = builder_key(cfg)
    if key not in _BUILDERS:
        known = ", ".join(f"engine={e} data_parallel={d}" for e, d in _BUILDERS)
        raise ConfigError(f"strategy {cfg.strategy.name!r} (engine={key[0]}, {key[1]}) is not available in this "
                          f"version; available: {known}")
    if layout.tp_enabled or layout.pp_enabled:
        raise ConfigError(f"strategy {cfg.strategy.name!r}: tensor_parallel={layout.tp} / pipeline_parallel="
                          f"{layout.pp} are not available in this version; use degree 1")


def get_builder(cfg: RunConfig) -> Callable:
    module, func = _BUILDERS[builder_key(cfg)].split(":")
    return getattr(importlib.import_module(module), func)
