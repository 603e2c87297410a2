"""Every check of a composed point that needs no submission: schema, layout, support
matrix, memory (the planner), Slurm reachable, and whether the run needs starting at all.

A failed check raises :class:`~spec.config.ConfigError` (one line: field, value, fix);
the caller refuses the point. Nothing here writes files or submits.
"""
from __future__ import annotations

import sys
from pathlib import Path
from typing import Dict, Optional, Tuple

from launcher import allocation, chain, evaljobs, submit
from launcher.plan.checkpoints import SavePlan, resolve as resolve_saves
from launcher.plan.gate import check_fits
from slurm import query
from slurm.states import ended, is_job_id, succeeded
from spec.config import ConfigError, RunConfig
from spec.data import check_data
from spec.layout import Layout, build_layout
from spec.rundir import read_run_json, status_of
from spec.schedule import schedule
from spec.support import check_supported
from spec.validate import validate

# Slurm may send --signal's warning up to this much earlier than asked (periodic timer;
# sbatch(1) says 60 s).
SIGNAL_SLACK_S = 60


def check(cfg: RunConfig, probe: Optional[submit.SlurmProbe] = None
          ) -> Tuple[Layout, Optional[str], Optional[SavePlan]]:
    """Every check that needs no submission; returns the layout, the slurm.conf to use and
    the checkpoint plan (None for a user's entry point). ``probe``: what Slurm already said
    during this launch (a sweep asks once). The checkpoint section's nulls are resolved in
    ``cfg`` (launcher/plan/checkpoints.py): the interval, async, the save's hang bound."""
    validate(cfg)
    layout = build_layout(cfg)
    check_supported(cfg, layout)
    if cfg.entrypoint:
        check_user_layout(cfg, layout)
    else:  # the planner knows the built-in model only
        check_data(cfg)
        schedule(cfg, layout)  # train.epochs: the steps the data gives (refused when it cannot be read)
        check_fits(cfg, layout)  # refuse what is predicted not to fit (launcher.allow_oom=true overrides)
    saves = resolve_saves(cfg, layout)  # refuses a signal-time save that cannot fit, a quota too small
    chain.check(cfg)  # launcher.then: jobs after the training
    evaljobs.check(cfg)  # eval.on_checkpoint: a job per checkpoint
    slurm_conf = None
    if cfg.cluster.backend == "slurm" and not cfg.launcher.dry_run:
        slurm_conf = submit.resolve_slurm_conf(cfg)
        submit.check_slurm(cfg, slurm_conf, probe if probe is not None else submit.SlurmProbe())
        allocation.check_fits(cfg, slurm_conf)  # inside an allocation (cluster.allocation=auto): its nodes
    warning = signal_warning(cfg)
    if warning:
        print(f"warning: {warning}", file=sys.stderr)
    return layout, slurm_conf, saves


def check_user_layout(cfg: RunConfig, layout: Layout) -> None:
    """A user's code gets data parallelism from the strategy (the environment, and
    Accelerate's settings for DeepSpeed / FSDP); tensor and pipeline degrees are the
    built-in trainer's."""
    for key, degree in (("tensor_parallel", layout.tp), ("pipeline_parallel", layout.pp)):
        if degree > 1:
            raise ConfigError(f"strategy.{key}={degree} (strategy={cfg.strategy.name}) with entrypoint="
                              f"{cfg.entrypoint}: a user's entry point gets data parallel strategies only (ddp, "
                              "fsdp, fsdp_grad_op, hsdp, zero1-3); pick one, or shard inside your code")


def signal_warning(cfg: RunConfig) -> Optional[str]:
    """A time limit so short that the warning signal may come during start-up, or None."""
    c = cfg.cluster
    if c.backend != "slurm" or c.signal_delay_s + SIGNAL_SLACK_S < c.time_min * 60:
        return None
    return (f"cluster.signal_delay_s={c.signal_delay_s} + {SIGNAL_SLACK_S} s (Slurm may signal that much earlier) "
            f"reaches cluster.time_min={c.time_min} ({c.time_min * 60} s): the job may be signalled while it starts; "
            f"raise cluster.time_min or lower cluster.signal_delay_s")


def already_done(cfg: RunConfig, run_dir: Path, slurm_conf: Optional[str],
                 queued: Optional[Dict[str, str]] = None) -> Optional[str]:
    """A reason not to start this run again, or None. ``queued``: squeue's answer for many
    runs at once (job id -> state), asked by the caller; None asks squeue here."""
    info = read_run_json(run_dir)
    status = status_of(info)
    if succeeded(status):
        return "already completed"
    job = str(info.get("job_id", ""))
    # Any unfinished status may still be queued: "requeued" / "interrupted" ones wait in
    # the queue for their next segment under the same job id. A run that ended ("failed",
    # "stopped") is restarted even while its job is still completing in the queue. A run
    # that stopped inside an allocation the user holds has no segment waiting in it: the
    # allocation is not requeued for it (launcher/allocation.py), queued or not.
    if cfg.cluster.backend == "slurm" and not ended(status) and is_job_id(job) and info.get("allocation") != job:
        try:
            found = job in queued if queued is not None else bool(query.squeue([job], query.slurm_env(slurm_conf)))
        except query.SlurmUnavailable:
            return None
        if found:
            return f"already in the queue as job {job}"
    return None
