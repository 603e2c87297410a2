"""A user's entry point under the task harness: a script run as ``__main__`` or a function.

What ``RUN_DIR/entrypoint.json`` names (written by the launcher, :mod:`launcher.entrypoint`)
runs in every task, as ``torchrun script.py ARGS`` would run it: the torchrun variables,
``STO_RUN_DIR``, ``STO_DEVICE`` and Accelerate's variables for the strategy
(:mod:`spec.user_env`) are in ``os.environ``; on a GPU profile that device is already the
current CUDA device, or the task was refused at start (``no_cuda`` / ``gpu_binding``,
:mod:`spec.device`); the code makes its own process group. Around it the harness does what it
does for the built-in trainer, minus what only a trainer can: run.json (``running``, then
``completed`` / ``failed`` by the exit status or exception, or a counted requeue), the
heartbeats (no hang check: the harness cannot see the code's steps), ``logs/rank{R}.log``,
metrics.jsonl rows from a Hugging Face Trainer's logs (:mod:`train.harness.hf_trainer`),
and preemption:

- code that calls :func:`train.session.should_stop` handles the signal itself: the flag
  is set, the code saves and returns, and rank 0 requeues the job;
- code that never asks is requeued at once when the warning signal (USR2) comes: rank 0
  records the preemption (or timeout) and asks the batch script to requeue the job
  (:mod:`slurm.request`: ``scontrol requeue`` outside the task, within a second), whose
  SIGTERM then ends every rank (elsewhere every rank leaves the code with
  :class:`Preempted`, a BaseException: ``except Exception`` does not swallow it). The requeued job restarts the script, which resumes from its own
  checkpoints. A SIGTERM alone (``scancel``) ends it as ``interrupted``, not requeued.

A requeued segment whose script (or module) file changed since submission says so in its
log and in run.json (``code_changed``): entrypoint.json keeps the sha256 and git state.
"""
from __future__ import annotations

import hashlib
import importlib
import json
import os
import runpy
import signal
import socket
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Dict, Optional

from slurm.env import LOCAL_LAUNCH_ENV, expand_hostlist, task_identity
from slurm.states import final, requeued
from spec.cluster import heartbeat_interval
from spec.config import RunConfig, to_run_config
from spec.device import DeviceError
from spec.layout import build_layout
from spec.rundir import CONFIG, ENTRYPOINT, SEGMENT_FAILURE, Status, read_run_json, status_of, update_run_json
from spec.user_env import task_environment
from train import session
from train.harness.groups import keep_destroyed_groups
from train.harness.outcome import RankOrderError, after_interruption, record_failure, refuse_start
from train.harness import hf_trainer, restart
from train.harness.preempt import Preempted, PreemptionFlag, in_slurm_job
from train.harness.restart import Restart
from train.harness.run import rank_logger
from train.harness.watchdog import Watchdog


class ExitStatus(RuntimeError):
    """The user's script exited with a non-zero status."""


def _hostnames(launcher: str) -> list:
    # the step's nodes: with cluster.spare_nodes the job's list holds the spares too
    nodelist = None
    if launcher == "srun":
        nodelist = os.environ.get("SLURM_STEP_NODELIST") or os.environ.get("SLURM_JOB_NODELIST")
    return expand_hostlist(nodelist) if nodelist else [socket.gethostname()]


def _code_changed(entry: Dict[str, Any]) -> bool:
    try:
        return hashlib.sha256(Path(entry["path"]).read_bytes()).hexdigest() != entry.get("sha256")
    except OSError:
        return True


def _call(entry: Dict[str, Any], cfg: RunConfig, run_dir: Path) -> int:
    """Run the code; its exit status (0 when a function returns)."""
    hf_trainer.install()  # a transformers/TRL Trainer's logs become metrics.jsonl rows
    if entry["sys_path"] not in sys.path:
        sys.path.insert(0, entry["sys_path"])
    try:
        if entry["kind"] == "script":
            sys.argv = [entry["path"], *cfg.entrypoint_args]
            runpy.run_path(entry["path"], run_name="__main__")
        else:
            from omegaconf import OmegaConf

            function = getattr(importlib.import_module(entry["module"]), entry["function"])
            function(OmegaConf.load(run_dir / CONFIG))
    except SystemExit as exc:
        if exc.code is None or exc.code == 0:
            return 0
        if isinstance(exc.code, int):
            return exc.code
        print(exc.code, file=sys.stderr)
        return 1
    return 0


@dataclass
class _Task:
    """This task of a user's run, ready to call the code."""

    cfg: RunConfig
    run_dir: Path
    entry: Dict[str, Any]
    te: Any  # spec.identity.TaskIdentity
    info: Dict[str, Any]  # run.json as the segment started
    log: Any  # logging.Logger

    def restart(self, watchdog: Watchdog) -> Restart:
        """What a failure asks of the job's step loop: a restart inside the job runs the code
        again, which resumes from its own checkpoints (its steps are known only through
        ``train.session.log``)."""
        return Restart(self.run_dir, self.cfg.cluster.in_job_restarts, self.te, self.info["segments"] - 1, watchdog,
                       steps_known=False, spares=self.cfg.cluster.spare_nodes)


def _prepare(run_dir: Path) -> Optional[_Task]:
    """Environment, logger and run.json (``running``) of this task; None when the run is
    finished and must not run again."""
    cfg = to_run_config(run_dir / CONFIG)
    layout = build_layout(cfg)
    entry = json.loads((run_dir / ENTRYPOINT).read_text())
    te = task_identity()
    if te.world_size != layout.world_size:
        raise RuntimeError(f"the job has {te.world_size} tasks but the layout needs {layout.world_size}")
    if te.order_error():  # RANK is srun's task number: node by node, as LOCAL_RANK and GROUP_RANK assume
        refuse_start(RankOrderError(te.order_error()), run_dir, te.rank, te.world_size, rank_logger(run_dir, te.rank))
    os.environ.update(task_environment(cfg, layout, run_dir, task=te))
    # One intra-op thread pool per task sized to its CPUs, as torchrun does (OMP_NUM_THREADS):
    # srun tasks otherwise each start one thread per core of the node (steps 30x slower here).
    os.environ.setdefault("OMP_NUM_THREADS", os.environ.get("SLURM_CPUS_PER_TASK") or str(max(1, cfg.cluster.task_cpus())))
    log = rank_logger(run_dir, te.rank)
    info = read_run_json(run_dir)
    status = status_of(info)
    if final(status) and not _ended_by_this_job(info, te):
        log.info(f"run is {status}; nothing to do (resubmit with `python -m launcher.resume {run_dir}`)")
        return None
    _take_device(cfg, te, run_dir, log)
    changed = _code_changed(entry)
    # rank 0 counts the segment; a rank that reads run.json after it did takes its count
    segment = int(info.get("segments", 0)) + (0 if _ended_by_this_job(info, te, started=True) else 1)
    if te.rank == 0:
        update_run_json(run_dir, status=Status.RUNNING, job_id=te.job_id, hostnames=_hostnames(te.launcher),
                        world_size=te.world_size, nodes=cfg.cluster.nodes, segments=segment,
                        strategy=cfg.strategy.name, launcher=te.launcher, entrypoint=cfg.entrypoint,
                        started_at=time.time(), restart_count=te.restart_count, **SEGMENT_FAILURE,
                        code_changed=changed, local_launch=os.environ.get(LOCAL_LAUNCH_ENV))
        restart.note_start(run_dir, te)
    log.info(f"segment {segment}: {entry['kind']} {cfg.entrypoint}, rank {te.rank} of {te.world_size} ({te.launcher})")
    if changed:
        log.warning(f"{entry['path']} changed since submission (sha256 differs from {ENTRYPOINT})")
    return _Task(cfg, run_dir, entry, te, dict(info, segments=segment), log)


def _ended_by_this_job(info: Dict[str, Any], te, started: bool = False) -> bool:
    """A rank other than 0 that finds the run already ended by this very job (the same Slurm
    job and restart, torchrun run, or local launch: the token rank 0 recorded): rank 0
    finished first (a script without collectives can, while this rank was still starting)
    and this rank still runs its share. Rank 0, or a job id that names no single job
    ("local" without the local launcher's token, "single"), goes by the status alone.
    ``started``: rank 0 of this job has marked it running (or ended it) already."""
    launch = os.environ.get(LOCAL_LAUNCH_ENV)
    if te.job_id == "local" and launch:
        same = te.rank != 0 and info.get("local_launch") == launch
    else:
        same = te.rank != 0 and te.job_id not in ("local", "single") and info.get("job_id") == te.job_id \
            and int(info.get("restart_count") or 0) == te.restart_count
    if not started:
        return same
    status = status_of(info)
    return same and (status == Status.RUNNING or final(status))


def _take_device(cfg: RunConfig, te, run_dir: Path, log) -> None:
    """A GPU profile: the task's GPU (``STO_DEVICE``, by ``cluster.gpu_binding``) becomes
    the current CUDA device before the code runs, so its ``"cuda"`` tensors and
    ``torch.cuda.current_device()`` are its own under either binding; a task that cannot
    take it is refused as the built-in trainer's are. A CPU profile imports nothing here."""
    if cfg.cluster.accelerator != "gpu":
        return
    from train.harness.dist import pick_device

    try:
        pick_device("gpu", cfg.cluster.gpu_binding, te.local_rank, te.local_world_size)
    except DeviceError as exc:
        refuse_start(exc, run_dir, te.rank, te.world_size, log)


def run_user(run_dir: str | Path, flag: Optional[PreemptionFlag] = None) -> int:
    """One task of a user's entry point; records the outcome in run.json. Returns the
    code's exit status (0 after a requeue or an interruption)."""
    task = _prepare(Path(run_dir).resolve())
    if task is None:
        return 0
    cfg, run_dir, te, log = task.cfg, task.run_dir, task.te, task.log
    watchdog = Watchdog(run_dir, te.rank, te.node_rank, socket.gethostname(), te.world_size, 0,
                        interval_s=heartbeat_interval(cfg.cluster.hang_timeout_s)).start()
    flag = flag if flag is not None else PreemptionFlag().install()
    state = session._State(run_dir, te.rank, te.world_size, task.info["segments"], flag, watchdog,
                           first_row=lambda row: restart.note_first_row(run_dir, te, row))
    session._bind(state)

    def on_signal(signum: int) -> None:
        """Unless the code checks the flag itself: rank 0 records the interruption and
        requeues the job. Under Slurm a requeued job's tasks are then ended by Slurm's
        SIGTERM (its default action again), so every rank keeps running until then: a rank
        that left its code early would break its peers' collectives. Otherwise (no
        Slurm, or no requeue: cancelled, the cap reached) every rank leaves its code."""
        if state.asked:
            return  # the code saves and returns at its next should_stop()
        flag.hook = None  # once
        flag.agreed_requeue = signum == signal.SIGUSR2
        if te.rank == 0:
            after_interruption(cfg, run_dir, task.info, log, flag)
        if in_slurm_job():
            signal.signal(signal.SIGTERM, signal.SIG_DFL)
            if requeued(status_of(read_run_json(run_dir))) or (te.rank != 0 and signum == signal.SIGUSR2):
                log.info("warning signal: the job is requeued; running on until Slurm ends this task")
                return
        raise Preempted(signum)

    flag.hook = on_signal
    try:
        if flag.signum is not None:  # it came during start-up, before the hook
            on_signal(flag.signum)
        keep_destroyed_groups()  # no deadlock in torch's teardown as the code returns
        code = _call(task.entry, cfg, run_dir)
        if code:
            raise ExitStatus(f"{task.entry['path']} exited with status {code}")
    except BaseException as exc:
        flag.hook = None
        if _ended_by_signal(exc, task, state, flag):
            return 0
        record_failure(exc, run_dir, te.rank, te.world_size, log, watchdog.interval_s, task.restart(watchdog))
        if isinstance(exc, ExitStatus):
            return code
        raise
    finally:
        watchdog.stop()
        session._bind(None)
    flag.hook = None
    if te.rank == 0:
        _record_end(task, state.stop or state.requeue, flag)
    return 0


def _ended_by_signal(exc: BaseException, task: _Task, state: Any, flag: PreemptionFlag) -> bool:
    """Whether the code's exception ``exc`` is the interruption, not a failure: the code
    saved at the agreed signal and ended (a Trainer's callback raises Preempted after its
    checkpoint: rank 0 records it as a returning code's would be), or the signal came and
    the code did not ask (Preempted from the hook, or a peer that left breaks this rank's
    collectives)."""
    if isinstance(exc, Preempted) and state.stop:
        task.log.info(f"interrupted by a signal: {exc}")
        if task.te.rank == 0:
            _record_end(task, True, flag)
        return True
    if isinstance(exc, Preempted) or (flag.is_set and not state.asked):
        task.log.info(f"interrupted by a signal ({type(exc).__name__}); the code did not ask "
                      "(train.session.should_stop)")
        return True
    return False


def _record_end(task: _Task, interrupted: bool, flag: PreemptionFlag) -> None:
    """Rank 0, the code returned: completed, or (it stopped at a signal / asked for a
    requeue) a counted interruption and its requeue."""
    if interrupted:
        after_interruption(task.cfg, task.run_dir, task.info, task.log, flag)
    else:
        update_run_json(task.run_dir, status=Status.COMPLETED, ended_at=time.time())
