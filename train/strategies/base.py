"""The engine protocol: what a strategy builds and what the trainer and the checkpoints speak.

Building an engine has three steps, as torchtitan does it (:func:`train.parallelize.parallelize`
runs them in order):

1. :meth:`EngineBuilder.wrap`, on the meta device: the builder applies the model
   preparation it is handed (tensor parallel, activation checkpointing, compile), then
   shards (FSDP) or splits (pipeline stages); it returns the *model parts* (one module,
   or one per pipeline stage held by this rank). Nothing is allocated yet.
2. The trainer materialises and initialises every part once
   (:func:`train.model.materialise`: ``to_empty`` + ``init_weights``).
3. :meth:`EngineBuilder.finish`: whatever needs real weights: DDP (it broadcasts the
   parameters when constructed), ``deepspeed.initialize`` (it takes the optimizer), the
   optimizers, pipeline stages and schedule. It returns the :class:`Engine`.

:class:`Engine` is all the trainer may ask: no caller asks an engine what it is
(``hasattr``). How it is saved is a capability of its own, named by the engine's
``checkpoint_format`` (the subdirectory of a checkpoint its state goes to) and spoken by
that format's backend: torch engines are :class:`DCPEngine` (``state_dict`` /
``load_state_dict``, saved through torch.distributed.checkpoint by
:class:`train.checkpoint.backend.DCPBackend`), DeepSpeed's is :class:`NativeEngine`
(``save_native`` / ``load_native``: it writes and reads its own files,
:class:`train.checkpoint.deepspeed_io.DeepSpeedBackend`). No engine has a method it must
refuse. The backend is chosen once, before the engine is built, by the run's shape
(:func:`train.checkpoint.backend.backend_for`: ``engine`` of :func:`spec.rundir.run_shape`,
which each checkpoint's manifest records too); tests/test_checkpoint_backend.py checks
that every engine's ``checkpoint_format`` is its backend's.
"""
from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Any, Callable, ClassVar, Dict, Iterable, List, Optional, Protocol, Tuple

import torch
from torch import nn

from spec.config import OptimConfig, RunConfig
from spec.layout import Layout
from train.harness.dist import DistContext
from train.metrics import peak_memory_bytes, peak_reserved_bytes
from train import steptimes
from train.loss import IGNORE, counted, loss_sum

#: (inputs, targets), or (inputs, targets, positions) for packed sequences (data.packing).
Batch = Tuple[torch.Tensor, ...]
#: Steps 1-3 of parallelisation on one module (the whole model or a pipeline stage).
Prepare = Callable[[nn.Module], None]


def loss_fn(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean cross-entropy over the targets not -100; logits sharded over the vocabulary
    (tensor parallel's head) are reduced in parallel, never gathered."""
    return loss_sum(logits, targets) / (targets != IGNORE).sum()


def divisor(batches: List[Batch], share: Optional[float]) -> float:
    """What a micro-batch's loss sum is divided by: ``share``, or this rank's count."""
    return float(share) if share is not None else float(max(counted(batches), 1))


def param_groups(model: nn.Module, weight_decay: float) -> List[dict]:
    """Weight decay on matrices only (not norms or biases). A parameter partitioned by
    ``deepspeed.zero.Init`` is an empty tensor whose real shape is ``ds_shape``."""
    def matrix(p: nn.Parameter) -> bool:
        return len(getattr(p, "ds_shape", p.shape)) >= 2

    decay = [p for p in model.parameters() if p.requires_grad and matrix(p)]
    other = [p for p in model.parameters() if p.requires_grad and not matrix(p)]
    groups = [{"params": decay, "weight_decay": weight_decay}, {"params": other, "weight_decay": 0.0}]
    # No empty group (LoRA's adapters are all matrices): torch's flattened optimizer state
    # cannot be loaded back into an optimizer with one (set_state_dict: IndexError).
    return [g for g in groups if g["params"]]


def build_adamw(model: nn.Module, cfg: OptimConfig, device: torch.device) -> torch.optim.Optimizer:
    return torch.optim.AdamW(param_groups(model, cfg.weight_decay), lr=cfg.lr, betas=(cfg.beta1, cfg.beta2),
                             eps=cfg.eps, fused=device.type == "cuda" or None)


def compute_dtype(cfg: RunConfig, device: torch.device) -> torch.dtype:
    mode = cfg.strategy.mixed_precision
    if mode == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return torch.bfloat16 if mode == "bf16" else torch.float32


def matmul_precision(cfg: RunConfig, device: torch.device) -> str:
    """Set the precision of fp32 matmuls on CUDA (``strategy.tf32``) and name what runs:
    "tf32" or "fp32" (IEEE; always on CPU, whose setting is left alone)."""
    if device.type != "cuda":
        return "fp32"
    torch.set_float32_matmul_precision("high" if cfg.strategy.tf32 else "highest")
    return "tf32" if cfg.strategy.tf32 else "fp32"


class Engine(Protocol):
    """What the trainer asks of every engine: a step, an evaluation, the memory report."""

    #: This rank's model parts (one module; with pipeline parallel, one per stage held).
    model_parts: List[nn.Module]
    #: One optimizer per part (DeepSpeed: its own wrapper of the client optimizer).
    optimizers: List[Any]
    device: torch.device
    #: The checkpoint format, i.e. backend, that saves this engine: "dcp" (a :class:`DCPEngine`)
    #: or "deepspeed" (a :class:`NativeEngine`); the checkpoint's subdirectory of the same name.
    checkpoint_format: ClassVar[str]

    def train_step(self, micro_batches: Iterable[Batch], lr: float,
                   share: Optional[float] = None) -> Tuple[torch.Tensor, torch.Tensor]:
        """One optimizer step: (this rank's part of the step's loss, grad norm before clipping).
        ``share``: the step's counted targets / dp (``ShardedLoader.step_targets`` over the
        data-parallel size); each micro-batch's loss is its sum over counted targets /
        ``share`` (train/loss.py). None: this rank's own count."""

    def eval_loss(self, micro_batches: Iterable[Batch], share: Optional[float] = None) -> torch.Tensor:
        """This rank's part of the loss (as train_step's), forward only (no gradient, no update)."""

    def peak_memory_bytes(self) -> int:
        """This rank's peak memory (on CUDA since the step began), the metrics' ``peak_mem_bytes``."""

    def peak_reserved_bytes(self) -> Optional[int]:
        """The caching allocator's peak since the step began (None off CUDA), ``peak_reserved_bytes``."""


class DCPEngine(Engine, Protocol):
    """A torch engine (``checkpoint_format`` "dcp"): its state in torch's own dicts, which
    :class:`train.checkpoint.backend.DCPBackend` saves and loads through DCP."""

    def state_dict(self) -> Dict[str, Any]:
        """DCP state: {"model": ..., "optim": ...}, both keyed by the full model's parameter
        names, the optimizer's flattened (``state.NAME.exp_avg``, ``param_groups.NAME.lr``):
        the same keys whatever the layout."""

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        """Inverse of :meth:`state_dict` (collective); ``optim`` may lack the ``param_groups.``
        keys (:data:`train.checkpoint.state.HYPERPARAMETERS`): the engine keeps its own then."""


class NativeEngine(Engine, Protocol):
    """An engine that writes and reads its own checkpoint files (``checkpoint_format``
    "deepspeed"), for :class:`train.checkpoint.deepspeed_io.DeepSpeedBackend`."""

    def save_native(self, path: Path) -> Optional[Dict[str, List[int]]]:
        """Write the engine's own checkpoint files under ``path`` (collective); the [size,
        CRC32] of those this rank summed as it wrote them (and fsynced), by path relative to
        ``path`` (the manifest's entries). Files it leaves out (all: None) are read back and
        summed at the commit."""

    def load_native(self, path: Path) -> None:
        """Read what :meth:`save_native` wrote (collective)."""


class EngineBuilder:
    """Base of the strategy builders: wrap on the meta device, then finish after init.

    Subclasses override :meth:`shard` (phase 1, optional) and :meth:`finish` (phase 3);
    the pipeline builder overrides :meth:`wrap` itself (one part per stage).
    """

    def __init__(self, cfg: RunConfig, layout: Layout, ctx: DistContext, mesh) -> None:
        self.cfg, self.layout, self.ctx, self.mesh = cfg, layout, ctx, mesh

    def wrap(self, model: nn.Module, prepare: Prepare) -> List[nn.Module]:
        """Phase 1 (meta device): prepare, shard; returns the model parts to materialise."""
        prepare(model)
        self.shard(model)
        return [model]

    def shard(self, model: nn.Module) -> None:
        """Sharding that must happen on the meta model (FSDP); none by default."""

    def materialise(self, parts: List[nn.Module], hf_path: Optional[str]) -> None:
        """Phase 2: allocate the parts and fill them (initial weights or a Hugging Face
        checkpoint): :func:`train.model.materialise`, unless the builder built them itself."""
        from train.model import materialise

        materialise(parts, self.cfg.train.seed, self.ctx.device, hf_path)

    def finish(self, parts: List[nn.Module]) -> Engine:
        """Phase 3 (parts materialised and initialised): wrap, build optimizers, return the engine."""
        raise NotImplementedError


class DeviceMemory:
    """The memory report of an engine that runs on one device: see :func:`train.metrics.peak_memory_bytes`."""

    device: torch.device

    def peak_memory_bytes(self) -> int:
        return peak_memory_bytes(self.device)

    def peak_reserved_bytes(self) -> Optional[int]:
        return peak_reserved_bytes(self.device)


def state_dict_options(module: Optional[nn.Module] = None):
    """Optimizer state flattened: keyed by parameter name, so a pipeline stage, a whole
    model and any sharding of it ask for the same keys (a resume may change the layout).
    Frozen parameters (LoRA's base) left out where ``module`` has any: a checkpoint holds
    the adapters and their optimizer state, the base is reloaded (not strict then)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    frozen = module is not None and any(not p.requires_grad for p in module.parameters())
    return StateDictOptions(flatten_optimizer_state_dict=True, ignore_frozen_params=frozen, strict=not frozen)


def with_own_hyperparameters(loaded: Dict[str, Any], own: Dict[str, Any]) -> Dict[str, Any]:
    """The optimizer state to set: ``own``'s keys (this engine's), the loaded value where
    there is one (the hyperparameters are the run config's when a load left them out)."""
    return {key: loaded.get(key, value) for key, value in own.items()}


class DCPState(DeviceMemory):
    """The :class:`DCPEngine` side of a torch engine: model + optimizer through torch's
    get/set_state_dict (DDP, FSDP2, TP alike)."""

    checkpoint_format: ClassVar[str] = "dcp"
    module: nn.Module
    optimizer: Any

    def state_dict(self) -> Dict[str, Any]:
        from torch.distributed.checkpoint.state_dict import get_state_dict

        model, optim = get_state_dict(self.module, self.optimizer, options=state_dict_options(self.module))
        return {"model": model, "optim": optim}

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

        options = state_dict_options(self.module)
        _, own = get_state_dict(self.module, self.optimizer, options=options)
        set_state_dict(self.module, self.optimizer, model_state_dict=state["model"],
                       optim_state_dict=with_own_hyperparameters(state["optim"], own), options=options)


class TorchEngine(DCPState):
    """Forward/backward over the micro-batches of one step, clip, optimizer step.

    ``no_sync`` (DDP) skips the gradient all-reduce for all but the last micro-batch;
    ``accumulating`` (HSDP) is told before each micro-batch whether it is the step's last.
    """

    def __init__(self, module: nn.Module, optimizer: torch.optim.Optimizer, cfg: RunConfig,
                 device: torch.device, no_sync: Optional[Callable[[], contextlib.AbstractContextManager]] = None):
        self.module = module
        self.optimizer = optimizer
        self.model_parts, self.optimizers = [module], [optimizer]
        self.device = device
        self.grad_clip = cfg.optim.grad_clip
        self.dtype = compute_dtype(cfg, device)
        self._no_sync = no_sync
        self.accumulating: Optional[Callable[[bool], None]] = None

    def _autocast(self) -> contextlib.AbstractContextManager:
        if self.dtype == torch.float32:
            return contextlib.nullcontext()
        return torch.autocast(self.device.type, dtype=self.dtype)

    def train_step(self, micro_batches: Iterable[Batch], lr: float,
                   share: Optional[float] = None) -> Tuple[torch.Tensor, torch.Tensor]:
        """Returns (this rank's part of the loss, global grad norm before clipping)."""
        batches = list(micro_batches)
        norm = divisor(batches, share)
        self.optimizer.zero_grad(set_to_none=True)
        total = torch.zeros((), device=self.device)
        for i, batch in enumerate(batches):
            last = i == len(batches) - 1
            sync = contextlib.nullcontext() if (last or self._no_sync is None) else self._no_sync()
            if self.accumulating is not None:
                self.accumulating(last)
            with sync:
                with self._autocast():  # the module computes the loss (chunked head: train/loss.py)
                    loss = self.module(*on_device(batch, self.device)) / norm
                loss.backward()
            total += loss.detach()
        steptimes.mark_optimizer()
        grad_norm = self.clip([p for p in self.module.parameters() if p.grad is not None])
        set_lr(self.optimizers, lr)
        self.optimizer.step()
        return total, grad_norm

    def clip(self, params: List[nn.Parameter]) -> torch.Tensor:
        """Clip the gradients of ``params`` to ``optim.grad_clip`` (0: no clipping); the
        global norm before clipping, a plain tensor. ``clip_grad_norm_``'s own two steps,
        with one reduction of DTensor shards' norms (FSDP2, TP: :func:`total_grad_norm`)."""
        norm = total_grad_norm(params)
        if self.grad_clip > 0:
            torch.nn.utils.clip_grads_with_norm_(params, self.grad_clip, norm)
        return norm

    def eval_loss(self, micro_batches: Iterable[Batch], share: Optional[float] = None) -> torch.Tensor:
        return forward_loss(self.module, micro_batches, self.device, self._autocast, share)


def total_grad_norm(params: List[nn.Parameter]) -> torch.Tensor:
    """The 2-norm of the gradients of ``params``, a plain tensor. Over DTensor gradients
    (FSDP, TP) the shards' partial norms are reduced once here (``full_tensor``), and a
    clip given this norm (``clip_grads_with_norm_``) needs no second reduction, where
    ``clip_grad_norm_`` reduces inside and its returned norm would need another."""
    from torch.distributed.tensor import DTensor

    norm = torch.nn.utils.get_total_norm([p.grad for p in params], norm_type=2.0)
    return norm.full_tensor() if isinstance(norm, DTensor) else norm


def forward_loss(forward: Callable[..., torch.Tensor], micro_batches: Iterable[Batch], device: torch.device,
                 autocast: Callable[[], contextlib.AbstractContextManager], share: Optional[float]) -> torch.Tensor:
    """The loss of ``forward(inputs, targets)`` (a sum) over the micro-batches / the
    divisor, without gradients (evaluation); with dropout (LoRA's ``peft.dropout``) in eval
    mode, which draws nothing (elsewhere the mode is left alone: a compiled block would be
    compiled again for it)."""
    batches = list(micro_batches)
    norm = divisor(batches, share)
    total = torch.zeros((), device=device)
    drops = [m for m in forward.modules() if isinstance(m, nn.Dropout) and m.p > 0 and m.training] \
        if isinstance(forward, nn.Module) else []
    for m in drops:
        m.eval()
    try:
        with torch.no_grad():
            for batch in batches:
                with autocast():
                    total += forward(*on_device(batch, device)) / norm
    finally:
        for m in drops:
            m.train()
    return total


def on_device(batch: Batch, device: torch.device) -> List[torch.Tensor]:
    """A micro-batch's tensors on ``device``: the model's arguments (inputs, targets[, positions])."""
    return [t.to(device, non_blocking=True) for t in batch]


def set_lr(optimizers: Iterable[Any], lr: float) -> None:
    """The loop owns the schedule: every engine sets the step's learning rate here."""
    for opt in optimizers:
        for group in opt.param_groups:
            group["lr"] = lr
