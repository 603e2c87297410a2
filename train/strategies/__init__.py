"""Strategy builders, registered by name (:mod:`spec.support`'s table says which exist).

Each is an :class:`train.strategies.base.EngineBuilder` made with ``(cfg, layout, ctx,
mesh)``: ``wrap(model, prepare)`` on the meta device returns the model parts, the
trainer materialises and initialises them once, ``finish(parts)`` returns the
:class:`train.strategies.base.Engine`. Pipeline parallel has its own builder
(:class:`train.strategies.pp.PipelineBuilder`) over any of the data-parallel choices.
"""
from __future__ import annotations

import importlib
from typing import Type

from spec.config import RunConfig
from spec.support import BUILDERS, builder_key


def get_builder(cfg: RunConfig) -> Type:
    """The builder class of ``cfg``'s (engine, data_parallel) without pipeline parallel."""
    module, name = BUILDERS[builder_key(cfg)].split(":")
    return getattr(importlib.import_module(module), name)
