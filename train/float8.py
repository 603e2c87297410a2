"""Float8 training (``strategy.float8``) with torchao, as torchtitan applies it.

torchao (the ``float8`` extra) is imported here only, and only when a run converts: the
login side never sees it. In the trainer's order (train/parallelize.py) the Linears are
converted after tensor and context parallel and before activation checkpointing, compile
and FSDP: :func:`convert` swaps each ``nn.Linear`` that :func:`spec.float8.skip_reason`
passes for torchao's ``Float8Linear`` (``convert_to_float8_training`` with
``Float8LinearConfig.from_recipe_name``), on the meta model. Under FSDP with tensorwise
scaling the converted weights are all-gathered in float8 (``enable_fsdp_float8_all_gather``)
and their scales computed for all of them in one all-reduce after each optimizer step
(``precompute_float8_dynamic_scale_for_fsdp``, :func:`attach`). The parameters keep their
names and fp32 master values, so a checkpoint of a float8 run loads into a bf16 one and
back. :func:`require_device` refuses, at the trainer's start, a device without float8
matmuls (the CPU, compute capability below 8.9).
"""
from __future__ import annotations

import dataclasses
import socket
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional

import torch
from torch import nn

from spec.config import RunConfig
from spec.device import DeviceError
from spec.float8 import all_gather_float8, device_line, skip_reason
from spec.rundir import FLOAT8_DEVICE


class Float8DeviceError(DeviceError):
    """strategy.float8 on a device that has no float8 matmuls: one line, the task exits 1
    and run.json says ``failed`` with ``failure: float8_device`` (the job ends)."""

    def __init__(self, line: str) -> None:
        super().__init__(line, FLOAT8_DEVICE)


def require_device(cfg: RunConfig, device: torch.device, host: Optional[str] = None) -> None:
    """Raise :class:`Float8DeviceError` when ``cfg`` trains in float8 and ``device`` cannot
    (the CPU; CUDA below compute capability 8.9). Nothing else is done before it."""
    if not cfg.strategy.float8:
        return
    host = host or socket.gethostname()
    if device.type == "cuda":
        line = device_line("cuda", torch.cuda.get_device_capability(device), torch.cuda.get_device_name(device), host)
    else:
        line = device_line(device.type, None, device.type, host)
    if line:
        raise Float8DeviceError(line)


@dataclass
class Float8Report:
    """What :func:`convert` did, as run.json records it (``float8``)."""

    recipe: str
    all_gather: bool
    converted: List[str] = field(default_factory=list)
    skipped: Dict[str, str] = field(default_factory=dict)  # name -> why it stayed in bf16

    def as_json(self) -> Dict[str, Any]:
        return {"recipe": self.recipe, "all_gather": self.all_gather, "converted": len(self.converted),
                "skipped": dict(self.skipped)}

    def line(self) -> str:
        why = "; ".join(f"{name}: {reason}" for name, reason in list(self.skipped.items())[:4])
        more = f" (+{len(self.skipped) - 4} more)" if len(self.skipped) > 4 else ""
        return (f"float8 ({self.recipe}{', float8 all-gather' if self.all_gather else ''}): {len(self.converted)} "
                f"Linears converted, {len(self.skipped)} left in bf16" + (f" ({why}{more})" if why else ""))


def torchao_config(cfg: RunConfig):
    """torchao's ``Float8LinearConfig`` of the run: the recipe's, with FSDP's float8
    all-gather where :func:`spec.float8.all_gather_float8` says."""
    from torchao.float8 import Float8LinearConfig

    config = Float8LinearConfig.from_recipe_name(cfg.strategy.float8_recipe)
    return dataclasses.replace(config, enable_fsdp_float8_all_gather=all_gather_float8(cfg))


def convert(model: nn.Module, cfg: RunConfig) -> Float8Report:
    """Swap ``model``'s Linears for torchao's Float8Linear, in place, all but those
    :func:`spec.float8.skip_reason` leaves in bf16; the report names both."""
    from torchao.float8 import convert_to_float8_training

    s = cfg.strategy
    report = Float8Report(s.float8_recipe, all_gather_float8(cfg))
    tied = cfg.model.tie_embeddings

    def keep(module: nn.Module, name: str) -> bool:
        if not isinstance(module, nn.Linear):
            return False
        why = skip_reason(name, module.in_features, module.out_features, s.float8_skip, tied and name == "output")
        if why is None:
            report.converted.append(name)
        else:
            report.skipped[name] = why
        return why is None

    convert_to_float8_training(model, module_filter_fn=keep, config=torchao_config(cfg))
    return report


def precompute_scales(parts: List[nn.Module]) -> None:
    """The float8 scales of every converted weight of ``parts``, for FSDP's next all-gather."""
    from torchao.float8 import precompute_float8_dynamic_scale_for_fsdp

    for part in parts:
        precompute_float8_dynamic_scale_for_fsdp(part)


def attach(engine: Any, report: Float8Report) -> None:
    """Give ``engine`` its report (``engine.float8``) and, with FSDP's float8 all-gather,
    the scales' precomputation after each optimizer step (a post-hook on each optimizer)."""
    engine.float8 = report
    if not report.all_gather:
        return
    parts = list(engine.model_parts)
    for optimizer in engine.optimizers:
        optimizer.register_step_post_hook(lambda *_args, **_kwargs: precompute_scales(parts))
