"""Meta model -> engine, in one fixed order (as torchtitan does):

1. tensor parallel (needs the plain module tree, before any wrapper), then float8's
   Linears (``strategy.float8``: train/float8.py),
2. activation checkpointing (wraps each block; must see TP's modules, not FSDP's),
3. torch.compile per block (compiles the checkpointed, TP-sharded block) and the loss,
4. the builder's ``wrap``: FSDP shards the meta model (DDP and DeepSpeed wait),
5. materialise and initialise every model part once, or load a Hugging Face checkpoint
   into it (the builder's ``materialise``: :func:`train.model.materialise`; DeepSpeed's
   ZeRO-3 builds its model partitioned and each rank fills its own partitions),
6. the builder's ``finish``: DDP / ``deepspeed.initialize``, optimizers, the engine.

With pipeline parallel the model is first split into stages and every stage goes
through the same order (train/strategies/pp.py).
"""
from __future__ import annotations

import torch

from spec.ac_modes import ac_mode
from spec.config import RunConfig
from spec.layout import Layout
from spec.support import check_supported
from train import float8
from train.context_parallel import apply_cp
from train.harness.dist import DistContext
from train.lora import prepare_peft
from train.mesh import build_mesh
from train.model import Transformer
from train.strategies import get_builder
from train.strategies.base import Engine, EngineBuilder
from train.strategies.tp import apply_tp
from train.torch_compat import checkpoint_wrapper  # torch's private wrapper: fenced there
from train.torch_compat import refuse_compiled_tp_checkpointing


def apply_activation_checkpointing(model: Transformer, mode: str) -> None:
    """Wrap the blocks that ``mode`` recomputes in backward (spec/ac_modes.py: ``full``
    every block, ``every_other`` (alias ``selective``) blocks 0, 2, ...; ``none`` none)."""
    ac = ac_mode(mode)
    for i, (name, block) in enumerate(list(model.layers.items())):
        if ac.recomputes(i):
            model.layers[name] = checkpoint_wrapper(block, preserve_rng_state=False)


def apply_compile(model: Transformer) -> None:
    """Each block compiled on its own (fullgraph), and the loss (torchtitan's ``model`` and
    ``loss`` components): the head's matmul stays eager between them."""
    for name, block in list(model.layers.items()):
        model.layers[name] = torch.compile(block, fullgraph=True)
    model.compile_loss = True


def refuse_unsupported_compile(cfg: RunConfig, layout: Layout) -> None:
    """Raise UnsupportedTorch for a ``strategy.compile`` this torch cannot run with the run's
    layout and checkpointing (train/torch_compat.py: TP + activation checkpointing from 2.13)."""
    ac = ac_mode(cfg.strategy.activation_checkpointing)
    refuse_compiled_tp_checkpointing(cfg.strategy.compile, layout.tp_enabled,
                                     any(ac.recomputes(i) for i in range(cfg.model.n_layers)))


def make_builder(cfg: RunConfig, layout: Layout, ctx: DistContext) -> EngineBuilder:
    """The job's one DeviceMesh and the builder of its strategy (collective: the mesh)."""
    check_supported(cfg, layout)
    mesh = build_mesh(layout, ctx.device.type)
    if layout.pp_enabled:
        from train.strategies.pp import PipelineBuilder

        return PipelineBuilder(cfg, layout, ctx, mesh)
    return get_builder(cfg)(cfg, layout, ctx, mesh)


def keeps_logits_sharded(layout: Layout) -> bool:
    """Whether the head's logits stay sharded over the vocabulary (the loss vocab-parallel):
    under any tensor parallel, a pipeline's last stage too."""
    return layout.tp_enabled


def parallelize(model: Transformer, cfg: RunConfig, layout: Layout, ctx: DistContext) -> Engine:
    """Steps 1-6 above on ``model`` (on the meta device)."""
    builder = make_builder(cfg, layout, ctx)
    vocab_parallel = keeps_logits_sharded(layout)
    refuse_unsupported_compile(cfg, layout)
    converted = []  # float8's report (one part: float8 refuses pipeline parallel)

    def prepare(part: Transformer) -> None:
        """Steps 1-3 on the whole model, or on one pipeline stage (LoRA's adapters first)."""
        prepare_peft(part, cfg)
        if layout.tp_enabled:
            apply_tp(part, builder.mesh["tp"], vocab_parallel=vocab_parallel)
        apply_cp(part, builder.mesh["cp"])  # context parallel's all-to-alls around attention
        if cfg.strategy.float8:
            converted.append(float8.convert(part, cfg))
        apply_activation_checkpointing(part, cfg.strategy.activation_checkpointing)
        if cfg.strategy.compile:
            apply_compile(part)

    parts = builder.wrap(model, prepare)
    builder.materialise(parts, cfg.model.hf_path)
    engine = builder.finish(parts)  # the loss sees the logits sharded: train.strategies.base.loss_fn
    if converted:
        float8.attach(engine, converted[0])
    return engine
