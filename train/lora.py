"""LoRA (Hu et al. 2021, "LoRA: Low-Rank Adaptation of Large Language Models") in the
built-in trainer: the target linear layers of every block become :class:`LoRALinear`,
which computes ``base(x) + dropout(x) @ A^T @ B^T * alpha / rank`` in PEFT's order
(``lora_B(lora_A(dropout(x))) * scaling`` added to the base layer's output), and every
other parameter is frozen.

The module keeps its base ``weight`` (and ``bias``) under their names, so loading a
Hugging Face checkpoint, the initial weights and the parameter names of the sharded
state are those of the plain model; A and B are parameters of the module itself
(``layers.0.attention.wq.lora_A``, ``.lora_B``). Applied on the meta model, first of the
preparation steps (train/parallelize.py), so FSDP2 shards frozen and trainable
parameters of a block in one unit (FSDP2 reduce-scatters only those with gradients)
and DDP buckets only the adapters; under DeepSpeed ZeRO-3 it is applied to the model
built partitioned, and ``deepspeed.initialize`` partitions the new matrices. The
optimizer takes the parameters that require gradients
(train.strategies.base.param_groups), i.e. the adapters only. Initial values: A
kaiming-uniform (a = sqrt 5, bound 1 / sqrt(in_features)) as PEFT, B zeros
(train/initial.py), the same on every rank and layout.
"""
from __future__ import annotations

from typing import Iterator, Tuple

import torch
import torch.nn.functional as F
from torch import nn

from spec.config import PeftConfig
from spec.peft import TARGETS, lora_enabled, target_names


class LoRALinear(nn.Linear):
    """``nn.Linear`` with a low-rank update: ``lora_A`` (rank x in), ``lora_B`` (out x rank)."""

    rank: int
    scaling: float

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        base = F.linear(x, self.weight, self.bias)
        return base + F.linear(F.linear(self.lora_dropout(x), self.lora_A), self.lora_B) * self.scaling


def to_lora(linear: nn.Linear, rank: int, alpha: float, dropout: float) -> LoRALinear:
    """Make ``linear`` a :class:`LoRALinear` in place (its weight and bias stay the same
    Parameters), with new A and B on its weight's device (meta: nothing allocated)."""
    weight = linear.weight
    linear.__class__ = LoRALinear
    linear.rank, linear.scaling = rank, alpha / rank
    linear.lora_dropout = nn.Dropout(dropout) if dropout > 0 else nn.Identity()
    factory = {"device": weight.device, "dtype": weight.dtype}
    linear.lora_A = nn.Parameter(torch.empty(rank, linear.in_features, **factory))
    linear.lora_B = nn.Parameter(torch.empty(linear.out_features, rank, **factory))
    return linear  # type: ignore[return-value]


def _modules(block: nn.Module, targets) -> Iterator[Tuple[nn.Module, str]]:
    """(parent, attribute) of each target linear layer of ``block``."""
    for peft_name in targets:
        parent_path, _, attr = TARGETS[peft_name].rpartition(".")
        yield block.get_submodule(parent_path), attr


def apply_lora(model: nn.Module, peft: PeftConfig, targets) -> int:
    """Adapters on the ``targets`` (PEFT's names, :func:`spec.peft.target_names`) of every
    block this model part holds; every other parameter frozen. Returns the adapted modules."""
    count = 0
    for p in model.parameters():
        p.requires_grad_(False)
    for block in model.layers.values():
        if block is None:
            continue
        for parent, attr in _modules(block, targets):
            module = getattr(parent, attr)
            if not isinstance(module, LoRALinear):
                to_lora(module, peft.rank, peft.alpha, peft.dropout)
            count += 1
    return count


def prepare_peft(model: nn.Module, cfg) -> None:
    """The run's ``peft.*`` on ``model`` (a no-op without ``peft.method``): the first of the
    preparation steps (before tensor parallel, checkpointing and compile)."""
    if lora_enabled(cfg):
        apply_lora(model, cfg.peft, target_names(cfg))



def _gathered(p: torch.Tensor) -> torch.Tensor:
    """The whole of parameter ``p`` (collective for a sharded one: FSDP2's DTensor,
    DeepSpeed ZeRO-3's partitioned parameter), on the CPU."""
    from torch.distributed.tensor import DTensor

    if isinstance(p, DTensor):
        return p.full_tensor().cpu()
    if hasattr(p, "ds_id"):
        import deepspeed

        with deepspeed.zero.GatheredParameters([p]):
            return p.data.detach().cpu().clone()
    return p.detach().cpu()


def changed_base(model: nn.Module, read, tied: bool, main: bool) -> Tuple[int, list]:
    """(frozen tensors compared, names of those not bit for bit the base's): ``peft.verify_base``.
    ``read(names)``: the base's tensors by our names (train.lora_io.base_source: model.hf_path's,
    or the initial weights). Collective (every rank gathers each tensor in the same order);
    rank ``main`` reads the base and compares. A tied head is its embedding."""
    from train.model import clean_name

    compared, changed = 0, []
    for name, p in model.named_parameters():
        if p.requires_grad:
            continue
        ours = clean_name(name)
        full = _gathered(p)
        if not main:
            continue
        want = read(["tok_embeddings.weight" if tied and ours == "output.weight" else ours])
        compared += 1
        if not torch.equal(full, next(iter(want.values())).to(full.dtype)):
            changed.append(ours)
    return compared, changed
