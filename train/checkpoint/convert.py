"""DeepSpeed's universal conversion of a run's newest checkpoint, before the job that loads it.

A ZeRO checkpoint resumed at another data-parallel size or stage loads through DeepSpeed's
universal format (:mod:`train.checkpoint.deepspeed_io`). The conversion reads and writes
every optimizer state (12 bytes a parameter: 840 GB for 70B), so at scale it takes far
longer than a collective may wait (``train.dist_timeout_s``) and would hold the training
job's GPUs idle. ``python -m launcher.resume`` therefore converts first, with every CPU
of one node, and the training job starts after it:

- on Slurm, a CPU job of its own (one task, the node's CPUs), which the training job
  follows (``--dependency=afterany``: it starts whatever the conversion's outcome; a
  failed conversion is tried again inside the job, which then reports why);
- locally, ``python -m train.checkpoint.convert RUN_DIR STAGE`` before the ranks start.

The job then finds the conversion made (``checkpoints/universal/step_N``) and loads it.
The checkpoint is verified in full first: a corrupt one is left to the job, which falls
back to an older one.
"""
from __future__ import annotations

import os
import sys
import time
from pathlib import Path
from typing import List, Optional

from spec.rundir import latest_checkpoint_dir
from train.checkpoint import deepspeed_io
from train.checkpoint.manifest import verify


def convert(run_dir: str, stage: int, workers: Optional[int] = None) -> Optional[str]:
    """Convert the run's newest committed checkpoint for a ZeRO ``stage`` load; why not, or None."""
    ckpt = latest_checkpoint_dir(run_dir)
    if ckpt is None:
        return f"{run_dir}: no committed checkpoint"
    reason = verify(ckpt)
    if reason is not None:
        return f"{ckpt.name}: {reason} (the job falls back to an older checkpoint)"
    return deepspeed_io.to_universal(ckpt, stage, workers or len(os.sched_getaffinity(0)))


def run(run_dir: str, stage: int) -> None:
    """The conversion job's task (:mod:`slurm.submitit_adapter` ``TaskCall``); raises on failure."""
    t0 = time.time()
    reason = convert(run_dir, stage)
    if reason is not None:
        raise RuntimeError(f"universal conversion not made: {reason}")
    print(f"universal conversion of {run_dir} for ZeRO stage {stage} made in {time.time() - t0:.1f} s", flush=True)


def main(argv: Optional[List[str]] = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 2 or not args[1].isdigit():
        print("usage: python -m train.checkpoint.convert RUN_DIR ZERO_STAGE", file=sys.stderr)
        return 2
    try:
        run(str(Path(args[0]).resolve()), int(args[1]))
    except RuntimeError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
