"""What every strategy builder returns: an engine that runs one optimizer step.

:class:`Engine` is the protocol the trainer and the checkpoints speak; no caller asks an
engine what it is (``hasattr``), it asks the engine. Torch engines checkpoint through
torch.distributed.checkpoint (``state_dict`` / ``load_state_dict``); an engine with
``native_checkpoint`` (DeepSpeed) writes and reads its own files (``save_native`` /
``load_native``).
"""
from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Any, Callable, Dict, Iterable, List, Optional, Protocol, Tuple

import torch
import torch.nn.functional as F
from torch import nn

from spec.config import OptimConfig, RunConfig


def loss_fn(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten(0, 1))


def param_groups(model: nn.Module, weight_decay: float) -> List[dict]:
    """Weight decay on matrices only (not norms or biases)."""
    decay = [p for p in model.parameters() if p.requires_grad and p.dim() >= 2]
    other = [p for p in model.parameters() if p.requires_grad and p.dim() < 2]
    return [{"params": decay, "weight_decay": weight_decay}, {"params": other, "weight_decay": 0.0}]


def build_adamw(model: nn.Module, cfg: OptimConfig, device: torch.device) -> torch.optim.Optimizer:
    return torch.optim.AdamW(param_groups(model, cfg.weight_decay), lr=cfg.lr, betas=(cfg.beta1, cfg.beta2),
                             eps=cfg.eps, fused=device.type == "cuda" or None)


def compute_dtype(cfg: RunConfig, device: torch.device) -> torch.dtype:
    mode = cfg.strategy.mixed_precision
    if mode == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return torch.bfloat16 if mode == "bf16" else torch.float32


class Engine(Protocol):
    module: nn.Module
    optimizer: Any
    device: torch.device
    #: True when the engine writes its own checkpoint files (DeepSpeed); False: DCP.
    native_checkpoint: bool

    def train_step(self, micro_batches: Iterable[Tuple[torch.Tensor, torch.Tensor]], lr: float
                   ) -> Tuple[torch.Tensor, torch.Tensor]:
        """One optimizer step: (mean loss over this rank's micro-batches, grad norm before clipping)."""

    def state_dict(self) -> Dict[str, Any]:
        """DCP state: {"model": ..., "optim": ...} (engines without native_checkpoint)."""

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        """Inverse of :meth:`state_dict` (collective)."""

    def save_native(self, path: Path) -> None:
        """Write the engine's own checkpoint files under ``path`` (native_checkpoint only)."""

    def load_native(self, path: Path) -> None:
        """Read what :meth:`save_native` wrote (native_checkpoint only)."""


class DCPState:
    """Model + optimizer through torch's get/set_state_dict (DDP, FSDP2, TP alike)."""

    native_checkpoint = False
    module: nn.Module
    optimizer: Any

    def state_dict(self) -> Dict[str, Any]:
        from torch.distributed.checkpoint.state_dict import get_state_dict

        model, optim = get_state_dict(self.module, self.optimizer)
        return {"model": model, "optim": optim}

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        from torch.distributed.checkpoint.state_dict import set_state_dict

        set_state_dict(self.module, self.optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])

    def save_native(self, path: Path) -> None:
        raise NotImplementedError(f"{type(self).__name__} checkpoints through DCP (native_checkpoint=False)")

    load_native = save_native


class TorchEngine(DCPState):
    """Forward/backward over the micro-batches of one step, clip, optimizer step.

    ``no_sync`` (DDP) skips the gradient all-reduce for all but the last micro-batch.
    """

    def __init__(self, module: nn.Module, optimizer: torch.optim.Optimizer, cfg: RunConfig,
                 device: torch.device, no_sync: Optional[Callable[[], contextlib.AbstractContextManager]] = None):
        self.module = module
        self.optimizer = optimizer
        self.device = device
        self.grad_clip = cfg.optim.grad_clip
        self.dtype = compute_dtype(cfg, device)
        self._no_sync = no_sync

    def _autocast(self) -> contextlib.AbstractContextManager:
        if self.dtype == torch.float32:
            return contextlib.nullcontext()
        return torch.autocast(self.device.type, dtype=self.dtype)

    def train_step(self, micro_batches: Iterable[Tuple[torch.Tensor, torch.Tensor]], lr: float
                   ) -> Tuple[torch.Tensor, torch.Tensor]:
        """Returns (mean loss over this rank's micro-batches, global grad norm before clipping)."""
        batches = list(micro_batches)
        self.optimizer.zero_grad(set_to_none=True)
        total = torch.zeros((), device=self.device)
        for i, (inputs, targets) in enumerate(batches):
            last = i == len(batches) - 1
            sync = contextlib.nullcontext() if (last or self._no_sync is None) else self._no_sync()
            with sync:
                with self._autocast():
                    logits = self.module(inputs.to(self.device, non_blocking=True))
                loss = loss_fn(logits, targets.to(self.device, non_blocking=True)) / len(batches)
                loss.backward()
            total += loss.detach()
        params = [p for p in self.module.parameters() if p.grad is not None]
        max_norm = self.grad_clip if self.grad_clip > 0 else float("inf")
        grad_norm = torch.nn.utils.clip_grad_norm_(params, max_norm)
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        self.optimizer.step()
        return total, grad_norm
