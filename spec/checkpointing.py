"""What both sides decide the same way about a run's checkpoints (pure, no torch).

The launcher resolves ``checkpoint.*`` nulls at launch (launcher/plan/checkpoints.py) and
writes the result into the run's config; the task side reads the same answers here, so a
run started without the launcher (torchrun, a test) behaves as the launch would have made it.
"""
from __future__ import annotations

import math
from typing import Optional

from spec.config import RunConfig


def saves_async(cfg: RunConfig) -> bool:
    """Whether periodic saves write in the background: never with DeepSpeed (it writes its
    own files, blocking); else ``checkpoint.async_save``, or with null, on GPU clusters."""
    if cfg.strategy.engine != "torch":
        return False
    c = cfg.checkpoint.async_save
    if c is not None:
        return bool(c)
    return cfg.cluster.accelerator == "gpu"


#: Seconds the collective timeout stays above the save's bound: the watchdog names a
#: writer that never returns (stacks, hang.json) before gloo / NCCL abort the job.
SAVE_TIMEOUT_MARGIN_S = 30


def default_save_timeout_s(hang_timeout_s: float, predicted_save_s: Optional[float] = None) -> float:
    """``checkpoint.save_timeout_s`` when null: three times the predicted blocking save and
    a minute, at least ``hang_timeout_s``; twice the hang timeout where the save cannot be
    predicted (no filesystem figures, or a run the launcher did not resolve). 0 with the
    hang check off."""
    if hang_timeout_s <= 0:
        return 0.0
    if predicted_save_s is None:
        return float(2 * hang_timeout_s)
    return float(math.ceil(max(hang_timeout_s, 3 * predicted_save_s + 60)))


def save_timeout_s(cfg: RunConfig) -> float:
    """The hang bound while a checkpoint is written or read (the watchdog's, in place of
    cluster.hang_timeout_s): ``checkpoint.save_timeout_s``, or with null
    :func:`default_save_timeout_s`; 0: the hang timeout applies."""
    bound = cfg.checkpoint.save_timeout_s
    return default_save_timeout_s(cfg.cluster.hang_timeout_s) if bound is None else float(bound)


def collective_timeout_s(cfg: RunConfig) -> int:
    """The process group's timeout: ``train.dist_timeout_s``, raised to cover the save's
    bound (a save's barriers wait for its slowest writer) with a margin for the watchdog."""
    bound = save_timeout_s(cfg)
    return int(max(cfg.train.dist_timeout_s, bound + SAVE_TIMEOUT_MARGIN_S if bound else 0))
