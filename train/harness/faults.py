"""Harness-level fault injection (``fault.*``), for tests and benchmarks.

:func:`at_step_end` is called by a workload at the end of every step, before the ranks'
step collective: a raised error there is a failing run, a sleeping rank a hang that the
watchdog must name. Faults inside a checkpoint save (``fault.kill_in_save_at_step``,
``fault.slow_async_save_s``) belong to the trainer's checkpoints.
"""
from __future__ import annotations

import os
import time

from spec.config import FaultConfig
from train.harness.watchdog import Watchdog


def in_this_run(restart: int) -> bool:
    """Whether a fault meant for the job's run with SLURM_RESTART_COUNT ``restart`` (-1: any) fires here."""
    return restart in (-1, int(os.environ.get("SLURM_RESTART_COUNT") or 0))


def preflight_delay(fault: FaultConfig, rank: int) -> float:
    """Seconds this rank adds to its timed preflight matmuls (``fault.preflight_slow_*``)."""
    slow = rank == fault.preflight_slow_rank and in_this_run(fault.preflight_slow_restart)
    return fault.preflight_slow_s if slow else 0.0


def at_step_end(fault: FaultConfig, rank: int, step: int, watchdog: Watchdog) -> None:
    """``step``: the index of the step that just ran (0-based); the config counts from 1."""
    if step + 1 == fault.raise_at_step:
        raise RuntimeError(f"fault.raise_at_step={step + 1}: injected failure")
    if rank == fault.hardware_fault_rank and step + 1 == fault.hardware_fault_at_step and \
            in_this_run(fault.hardware_fault_restart):
        raise RuntimeError(f"CUDA error: uncorrectable ECC error encountered (fault.hardware_fault_at_step="
                           f"{step + 1}: injected)")
    if rank == fault.hang_rank and step + 1 == fault.hang_at_step:
        watchdog.phase("fault: sleeping before the collective", step)
        time.sleep(fault.hang_s)


def after_step(fault: FaultConfig) -> None:
    """``fault.step_delay_s``: a slow step, so a run lasts long enough to be interrupted."""
    if fault.step_delay_s:
        time.sleep(fault.step_delay_s)
