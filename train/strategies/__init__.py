"""Strategy builders, registered by name behind one signature.

``build(model, cfg, layout, ctx, mesh) -> engine``: takes the model on the meta device
(tensor parallel and activation checkpointing already applied by
:func:`train.parallelize.parallelize`, which also built ``mesh``), materialises and wraps
it, and returns an engine with ``train_step(micro_batches, lr) -> (loss, grad_norm)``
(:class:`train.strategies.base.TorchEngine` or the DeepSpeed adapter). Which
combinations exist is :mod:`spec.support`'s table.
"""
from __future__ import annotations

import importlib
from typing import Callable

from spec.config import RunConfig
from spec.support import BUILDERS, builder_key


def get_builder(cfg: RunConfig) -> Callable:
    module, func = BUILDERS[builder_key(cfg)].split(":")
    return getattr(importlib.import_module(module), func)
