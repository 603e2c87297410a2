"""The ``eval.*`` section of the run configuration: evaluation jobs for the run's
checkpoints (lm-evaluation-harness over an exported Hugging Face model). Pure;
:mod:`spec.config` re-exports it.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import List, Optional


@dataclass
class EvalConfig:
    # Evaluate committed checkpoints, each in a Slurm job of its own (docs/experiments.md).
    on_checkpoint: bool = False
    # lm-eval task names, or paths of the user's task YAML files (their directories go on
    # lm-eval's include path).
    tasks: List[str] = field(default_factory=list)
    # Only checkpoints whose step is a multiple of this, and the last step's. null: the
    # periodic saves' (checkpoint.every_steps), else every committed checkpoint; 0: every
    # committed checkpoint, a preemption's save too.
    every_steps: Optional[int] = None
    # Examples per task (null: all); lm-eval's batch size.
    limit: Optional[int] = None
    batch_size: int = 8
    # Evaluations submitted and not yet ended, at most; a later checkpoint waits its turn.
    max_pending: int = 2
    # The evaluation job's own resources: nodes, GPUs a node (null: 1 on a GPU cluster, 0 on
    # a CPU one), minutes, partition (null: the training's).
    nodes: int = 1
    gpus_per_node: Optional[int] = None
    time_min: int = 30
    partition: Optional[str] = None
