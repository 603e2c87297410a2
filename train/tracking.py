"""TensorBoard and Weights & Biases: the metrics rows of rank 0, beside metrics.jsonl.

A requeued or resumed run continues the same logs: TensorBoard's writer opens the run's
``tensorboard/`` directory with ``purge_step`` = the first step this segment runs, so
steps a killed segment logged past its last checkpoint (and now runs again) are hidden
rather than duplicated; W&B resumes the run whose id is the run's own (a hash of its
directory), in the sweep's group when the run is a sweep point. W&B gets the resolved
config and the Slurm facts of the job.
"""
from __future__ import annotations

import dataclasses
import hashlib
import os
from pathlib import Path
from typing import Any, Dict, List, Optional

from spec.config import RunConfig
from spec.rundir import REGISTRY, TENSORBOARD, WANDB, MetricsRow

# Metrics rows' fields that are scalars worth a chart (the rest are bookkeeping).
SCALARS = ("loss", "val_loss", "val_ppl", "lr", "grad_norm", "tokens_per_s", "samples_per_s", "mfu",
           "peak_mem_bytes", "step_time_s", "compute_time_s", "comm_time_s", "epoch")
# Fields of where a step's time went (train/steptimes.py): their median and max over ranks,
# charted as time/<field>/median and time/<field>/max.
BREAKDOWN = ("data_s", "fwd_bwd_s", "optim_s", "busy_s", "wait_s")
SLURM_FACTS = ("SLURM_JOB_ID", "SLURM_JOB_NAME", "SLURM_JOB_NODELIST", "SLURM_JOB_NUM_NODES", "SLURM_JOB_PARTITION",
               "SLURM_RESTART_COUNT", "SLURM_CLUSTER_NAME", "SLURM_JOB_ACCOUNT")


def run_id(run_dir: Path) -> str:
    """The run's id for W&B: the same for every segment of the run, other for another run."""
    return hashlib.sha256(str(Path(run_dir).resolve()).encode()).hexdigest()[:16]


def sweep_group(run_dir: Path) -> Optional[str]:
    parent = Path(run_dir).resolve().parent
    return str(parent) if (parent / REGISTRY).is_file() else None


class Tracking:
    """Rank 0's writers; a no-op elsewhere and when nothing is configured."""

    def __init__(self, cfg: RunConfig, run_dir: Path, first_step: int, segment: int, main: bool) -> None:
        self.tb = self.wandb = None
        if not main:
            return
        if cfg.tracking.tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            self.tb = SummaryWriter(log_dir=str(run_dir / TENSORBOARD), purge_step=first_step + 1)
        w = cfg.tracking.wandb
        if w.project and w.mode != "disabled":
            self.wandb = _wandb_run(cfg, run_dir, segment)

    def log(self, row: MetricsRow) -> None:
        values = {k: float(row[k]) for k in SCALARS if row.get(k) is not None}
        values.update({f"time/{k}/{stat}": float(row[k][stat]) for k in BREAKDOWN if row.get(k) is not None
                       for stat in ("median", "max")})
        if self.tb is not None:
            for key, value in values.items():
                name = key if key.startswith("time/") else f"val/{key[4:]}" if key.startswith("val_") else f"train/{key}"
                self.tb.add_scalar(name, value, global_step=row["step"])
        if self.wandb is not None:
            self.wandb.log(values, step=row["step"])

    def close(self) -> None:
        if self.tb is not None:
            self.tb.close()
        if self.wandb is not None:
            self.wandb.finish()


def _wandb_run(cfg: RunConfig, run_dir: Path, segment: int) -> Any:
    import wandb

    w = cfg.tracking.wandb
    os.environ.setdefault("WANDB_SILENT", "true")
    (run_dir / WANDB).mkdir(exist_ok=True)
    facts: Dict[str, Any] = {k: os.environ[k] for k in SLURM_FACTS if k in os.environ}
    facts["segment"] = segment
    tags: List[str] = list(w.tags)
    return wandb.init(project=w.project, entity=w.entity, mode=w.mode, id=run_id(run_dir), resume="allow",
                      dir=str(run_dir), group=sweep_group(run_dir), tags=tags or None, name=run_dir.name,
                      config={**dataclasses.asdict(cfg), "slurm": facts})
