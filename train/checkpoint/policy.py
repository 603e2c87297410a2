"""When the trainer saves: one place, owned by the :class:`~train.checkpoint.Checkpointer`.

A step boundary saves when the ranks agreed on a signal (preemption, time limit), when
``checkpoint.every_steps`` divides the step, when rank 0 found ``checkpoint.every_minutes``
elapsed since the last save or ``RUN_DIR/SAVE_NOW`` (its answer travels in the step's
all-gather, so every rank takes the same branch), and after the last step as
``checkpoint.save_final`` says. The launch resolves the section's nulls
(launcher/plan/checkpoints.py: the interval from the filesystem and the failure rate);
a null left here (a run started without the launcher) means "not by steps / minutes".
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

from spec.config import CheckpointConfig, RunConfig
from spec.checkpointing import saves_async

# A checkpoint on demand: `touch RUN_DIR/SAVE_NOW`; the next step boundary saves it.
SAVE_REQUEST = "SAVE_NOW"


def saves_last_step(c: CheckpointConfig) -> bool:
    """Whether the step that ends the run is saved: ``checkpoint.save_final``, or, when it
    is null, whenever periodic checkpoints are on (else ``launcher.export`` of a finished
    run would export the last periodic save and silently drop the steps after it)."""
    if c.save_final is not None:
        return c.save_final
    return bool(c.every_steps) or bool(c.every_minutes)


@dataclass
class SavePolicy:
    """The run's answers to "save now?" and "in the background?"."""

    every_steps: int = 0
    every_minutes: float = 0.0
    save_final: bool = False
    background: bool = False     # periodic saves async (a signal's save never is)
    run_dir: Optional[Path] = None  # rank 0's: it votes (the interval, SAVE_NOW); None: never votes
    last_save: float = field(default_factory=time.monotonic)

    @classmethod
    def of(cls, cfg: RunConfig, run_dir: Optional[Path] = None) -> "SavePolicy":
        """The run's policy; ``run_dir`` given on rank 0 only (the rank that votes)."""
        c = cfg.checkpoint
        return cls(every_steps=c.every_steps or 0, every_minutes=c.every_minutes or 0.0,
                   save_final=saves_last_step(c), background=saves_async(cfg), run_dir=run_dir)

    def asked(self) -> bool:
        """Rank 0's vote for the step's all-gather: the interval elapsed, or SAVE_NOW exists
        (one stat a step, rank 0 only); the other ranks never vote, so one clock decides."""
        if self.run_dir is None:
            return False
        if self.every_minutes > 0 and time.monotonic() - self.last_save >= self.every_minutes * 60:
            return True
        return (self.run_dir / SAVE_REQUEST).exists()

    def due(self, done: int, total: int, asked: bool, preempted: bool) -> bool:
        """Whether the boundary after step ``done`` (1-based) of ``total`` saves, given the
        agreed signal (``preempted``) and rank 0's agreed vote (``asked``)."""
        last = done == total
        if preempted or asked:
            return True
        if last:
            return self.save_final
        return bool(self.every_steps) and done % self.every_steps == 0

    def saved(self) -> None:
        """A save of this run just ended: the interval starts again; SAVE_NOW is answered."""
        self.last_save = time.monotonic()
        if self.run_dir is not None:
            (self.run_dir / SAVE_REQUEST).unlink(missing_ok=True)
