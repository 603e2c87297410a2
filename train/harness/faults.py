"""Fault injection (``fault.*``), for tests and benchmarks: one seam.

A :class:`Faults` is made for each task from the config, the rank and the run's segment,
and every place a fault can be injected asks it: the harness's preflight
(:meth:`Faults.preflight_delay`), the trainer's steps (:meth:`Faults.at_step_end`,
:meth:`Faults.after_step`) and its checkpoints (:meth:`Faults.in_save`, :meth:`Faults.save_written`,
:meth:`Faults.checkpoint_thread`: :class:`train.checkpoint.Checkpointer` is handed the
task's). No other test hook is in production signatures; ``Faults()`` injects nothing.

A fault meant for one start of the run (``fault.*_restart``) is keyed on the run's
segment: how many times the run started before this one (run.json ``segments`` as the
task starts; :attr:`train.harness.run.Task.segment`). A requeue is a new segment, as is a
restart inside the job or a ``launcher.resume`` (a new job, whose SLURM_RESTART_COUNT
starts at 0 again), so such a fault does not fire again there.

The step faults (``fault.raise_at_step``, ``oom_at_step``, ``kill_at_step``, ``hang_at_step``, ``kill_in_save_at_step``, and
each step of ``raise_every_steps``) fire once per run: the segment that first reaches the
step fires them (on every rank they name) and records it in ``RUN_DIR/faults/NAME.json``
(``raise_every_steps_STEP.json``); a later segment (a restart inside the job, a requeue, a
resume) passes the step. ``fault.repeat=true`` fires them every time (a crash loop). A
seam without a run directory fires them every time.

:meth:`Faults.at_step_end` is called by a workload at the end of every step, before the
ranks' step collective: a raised error there is a failing run, a sleeping rank a hang that
the watchdog must name.
"""
from __future__ import annotations

import json
import os
import signal
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

from spec.config import FaultConfig
from spec.rundir import FAULTS
from train.harness.watchdog import Watchdog


@dataclass(frozen=True)
class Faults:
    """What ``fault.*`` injects into this rank's task; nothing by default."""

    cfg: FaultConfig = field(default_factory=FaultConfig)
    rank: int = 0
    segment: int = 0  # how many times the run started before this one
    run_dir: Optional[Path] = None  # where step faults record that they fired (None: no record)

    def in_this_segment(self, segment: int) -> bool:
        """Whether a fault meant for the run's segment ``segment`` (-1: every one) fires here."""
        return segment in (-1, self.segment)

    def once(self, name: str, step: int) -> bool:
        """Whether the step fault ``name`` fires in this segment: not when an earlier segment
        fired it (unless ``fault.repeat``); when it fires, it is recorded first (a kill or
        a hang follows)."""
        if self.run_dir is None or self.cfg.repeat:
            return True
        path = Path(self.run_dir) / FAULTS / f"{name}.json"
        try:
            return json.loads(path.read_text()).get("segment") == self.segment
        except (OSError, ValueError):
            pass
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{name}.{os.getpid()}.tmp")
        tmp.write_text(json.dumps({"segment": self.segment, "rank": self.rank, "step": step, "time": time.time()}))
        os.replace(tmp, path)
        return True

    def preflight_delay(self) -> float:
        """Seconds this rank adds to its timed preflight matmuls (``fault.preflight_slow_*``)."""
        slow = self.rank == self.cfg.preflight_slow_rank and self.in_this_segment(self.cfg.preflight_slow_restart)
        return self.cfg.preflight_slow_s if slow else 0.0

    def after_build(self) -> None:
        """``fault.oom_in_build``: rank ``raise_rank`` runs out of memory once its model is built."""
        if self.cfg.oom_in_build and self.cfg.raise_rank in (-1, self.rank) and self.once("oom_in_build", 0):
            import torch  # the trainer's, already imported

            raise torch.OutOfMemoryError("CUDA out of memory (fault.oom_in_build: injected)")

    def at_step_end(self, step: int, watchdog: Watchdog) -> None:
        """``step``: the index of the step that just ran (0-based); the config counts from 1."""
        fault = self.cfg
        if step + 1 == fault.raise_at_step and fault.raise_rank in (-1, self.rank) and \
                self.once("raise_at_step", step + 1):
            raise RuntimeError(f"fault.raise_at_step={step + 1}: injected failure")
        every = fault.raise_every_steps
        if every and (step + 1) % every == 0 and fault.raise_rank in (-1, self.rank) and \
                self.once(f"raise_every_steps_{step + 1}", step + 1):
            raise RuntimeError(f"fault.raise_every_steps={every}: injected failure at step {step + 1}")
        if step + 1 == fault.oom_at_step and fault.raise_rank in (-1, self.rank) and \
                self.once("oom_at_step", step + 1):
            import torch  # the trainer's, already imported

            raise torch.OutOfMemoryError(f"CUDA out of memory (fault.oom_at_step={step + 1}: injected)")
        if step + 1 == fault.kill_at_step and fault.raise_rank in (-1, self.rank) and \
                self.once("kill_at_step", step + 1):
            os.kill(os.getpid(), signal.SIGKILL)
        if self.rank == fault.hardware_fault_rank and step + 1 == fault.hardware_fault_at_step and \
                self.in_this_segment(fault.hardware_fault_restart):
            raise RuntimeError(f"CUDA error: uncorrectable ECC error encountered (fault.hardware_fault_at_step="
                               f"{step + 1}: injected)")
        if fault.hang_in == "step" and self.rank == fault.hang_rank and step + 1 == fault.hang_at_step and \
                self.once("hang_at_step", step + 1):
            watchdog.phase("fault: sleeping before the collective", step)
            time.sleep(fault.hang_s)

    def after_step(self) -> None:
        """``fault.step_delay_s``: a slow step, so a run lasts long enough to be interrupted
        (on ``fault.step_delay_rank`` alone: a straggler)."""
        if self.cfg.step_delay_s and self.cfg.step_delay_rank in (-1, self.rank):
            time.sleep(self.cfg.step_delay_s)

    def in_save(self, step: int) -> None:
        """A blocking save of checkpoint ``step``: this rank's files are written, the save's
        barrier is next. ``fault.slow_save_s`` sleeps here (a save slower than the hang
        timeout: not a hang); ``fault.hang_in=save`` with ``hang_rank`` / ``hang_at_step``
        sleeps ``hang_s`` (a writer that never returns: the watchdog names it)."""
        f = self.cfg
        if f.slow_save_s and f.slow_save_rank in (-1, self.rank) and \
                (not f.slow_save_at_step or (step == f.slow_save_at_step and self.once("slow_save_at_step", step))):
            time.sleep(f.slow_save_s)
        if f.hang_in == "save" and self.rank == f.hang_rank and step == f.hang_at_step and \
                self.once("hang_at_step", step):
            time.sleep(f.hang_s)

    def save_written(self, step: int) -> None:
        """A blocking save of checkpoint ``step`` has every rank's files written and nothing
        committed: ``fault.kill_in_save_at_step`` dies here at once, as a node lost in the
        middle of a save would (SIGKILL, no clean-up)."""
        if self.cfg.kill_in_save_at_step and step == self.cfg.kill_in_save_at_step and \
                self.once("kill_in_save_at_step", step):
            os.kill(os.getpid(), signal.SIGKILL)

    def checkpoint_thread(self) -> None:
        """The checkpoint thread of an async save, before its snapshot and again before its
        write: ``fault.slow_async_save_s`` makes it lag, so the training thread runs ahead."""
        if self.cfg.slow_async_save_s:
            time.sleep(self.cfg.slow_async_save_s)


_TAKEN: list = []  # fault.port_taken_in_srun's socket: held until the process exits


def take_rendezvous_port(cfg: FaultConfig, rank: int, srun: Optional[int], port: int) -> bool:
    """``fault.port_taken_in_srun``: rank 0 of that start of the job's step listens on the
    job's rendezvous ``port`` itself before joining, so its TCPStore cannot bind it
    (EADDRINUSE) and its peers connect to a socket that never answers. True when taken."""
    import socket

    if rank != 0 or cfg.port_taken_in_srun < 0 or srun is None or srun != cfg.port_taken_in_srun:
        return False
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("", port))
    sock.listen(8)
    _TAKEN.append(sock)
    return True
