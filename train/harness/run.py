"""The task harness: one Slurm task (or torchrun worker, or plain process) of any workload.

``run_task(run_dir, workload, flag)`` does what every workload needs and nothing that is
about training: read the run's config, join the job's process group (rendezvous from
SLURM_* or a torchrun environment, :mod:`train.harness.dist`), refuse to run a finished
run again, mark the run ``running``, run the preflight, start the heartbeat and hang
watchdog, call ``workload(task)``, then record the outcome in run.json: ``completed``,
a counted interruption with its requeue, or ``failed`` with the failure's class
(:mod:`train.harness.outcome`) and, where the job may, a restart of its ranks inside the
allocation (:mod:`train.harness.restart`). The built-in trainer (:func:`train.main.trainer`) is one
workload; a user's script or function will be another.

Torch is imported inside :func:`run_task`, after the caller installed the preemption
flag: a signal during the slow imports and rendezvous must set the flag, not kill.
"""
from __future__ import annotations

import logging
import os
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Dict, Mapping, Optional

from slurm.env import task_identity
from slurm.states import final
from spec.cluster import heartbeat_interval
from spec.config import RunConfig, to_run_config
from spec.device import DeviceError
from spec.checkpointing import collective_timeout_s, save_timeout_s
from spec.validate import WATCHDOG_GRACE_S, validate
from spec.layout import Layout, build_layout
from spec.rundir import (CONFIG, SEGMENT_FAILURE, MetricsRow, Status, append_metrics, read_run_json, status_of,
                         update_run_json)
from train.harness import restart
from train.harness.affinity import bind_rank
from train.harness.faults import Faults, take_rendezvous_port
from train.harness.node_facts import write_node_facts
from train.harness.outcome import (RankOrderError, is_rendezvous_error, mark_stderr, record_failure, record_hang,
                                   record_outcome, refuse_start, rendezvous_failed)
from train.harness.preempt import PreemptionFlag
from train.harness.restart import Restart
from train.harness.watchdog import Watchdog

# Statuses after which a (re)started job does nothing: resubmission resets them.


@dataclass
class Task:
    """What the harness hands a workload: this rank of the job, joined and watched."""

    cfg: RunConfig
    layout: Layout
    run_dir: Path
    ctx: Any  # train.harness.dist.DistContext (a torch type: not imported at module level)
    segment: int  # how many times the run started before this one
    log: Callable[[str], None]  # this rank's log (rank 0 also to stdout)
    flag: PreemptionFlag  # set by USR2 / SIGTERM; the workload agrees on it at a step boundary
    watchdog: Watchdog  # phase() / progress() from the workload's steps
    _rows_written: bool = field(default=False, init=False, repr=False, compare=False)
    _writer: Optional["RowWriter"] = field(default=None, init=False, repr=False, compare=False)

    @property
    def faults(self) -> Faults:
        """The fault seam of this task: ``fault.*`` for this rank and segment."""
        return Faults(self.cfg.fault, self.ctx.rank, self.segment, self.run_dir)

    @property
    def restart(self) -> Restart:
        """What a failure of this task asks of the job's step loop (:mod:`train.harness.restart`)."""
        return Restart(self.run_dir, self.cfg.cluster.in_job_restarts, self.ctx, self.segment, self.watchdog,
                       spares=self.cfg.cluster.spare_nodes)  # not read from config.yaml while run.json says failed

    def write_metrics(self, row: MetricsRow | Mapping[str, Any]) -> None:
        """Append one metrics.jsonl row (the caller decides which rank writes); a restarted
        segment's first one also gives its restart's ``seconds_lost``. The first row is
        written at once, the later ones by a thread of their own (:class:`RowWriter`):
        :meth:`flush_metrics` waits for them."""
        if not self._rows_written:
            append_metrics(self.run_dir, row)
            self._rows_written = True
            restart.note_first_row(self.run_dir, self.ctx, row)
            return
        if self._writer is None:
            self._writer = RowWriter(self.run_dir)
        self._writer.put(row)

    def flush_metrics(self, quiet: bool = False) -> None:
        """Every row handed to :meth:`write_metrics` is in metrics.jsonl (a write that failed
        raises here, or at the next row; not with ``quiet``)."""
        if self._writer is not None:
            self._writer.flush(quiet)


class RowWriter:
    """metrics.jsonl appends on a thread of their own. On a shared filesystem each
    open/append/close is a round trip to its server (NFS flushes at close), which rank 0
    would otherwise make between one step's end and the next one's start while every rank
    waits for it at the next collective. Rows keep their order; :meth:`flush` waits for
    them (the trainer flushes before each checkpoint and at its end)."""

    def __init__(self, run_dir: Path) -> None:
        import queue
        import threading

        self.run_dir, self.rows, self.error = run_dir, queue.Queue(), None
        threading.Thread(target=self._write, name="sto-metrics-rows", daemon=True).start()

    def put(self, row: MetricsRow | Mapping[str, Any]) -> None:
        self._raise()
        self.rows.put(row)

    def flush(self, quiet: bool = False) -> None:
        self.rows.join()
        if not quiet:
            self._raise()

    def _raise(self) -> None:
        if self.error is not None:
            error, self.error = self.error, None
            raise error

    def _write(self) -> None:
        while True:
            row = self.rows.get()
            try:
                append_metrics(self.run_dir, row)
            except BaseException as exc:  # noqa: BLE001 - handed to the training thread at its next row or flush
                self.error = exc
            finally:
                self.rows.task_done()


Workload = Callable[[Task], Status]  # COMPLETED, or INTERRUPTED (a checkpoint committed after a signal)


def rank_logger(run_dir: Path, rank: int) -> logging.Logger:
    logs = run_dir / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    log = logging.getLogger(f"train.rank{rank}")
    log.setLevel(logging.INFO)
    log.propagate = False
    if not log.handlers:
        fmt = logging.Formatter("%(asctime)s rank%(rank)s %(message)s".replace("%(rank)s", str(rank)))
        handler = logging.FileHandler(logs / f"rank{rank}.log")  # append: segments accumulate
        handler.setFormatter(fmt)
        log.addHandler(handler)
        if rank == 0:
            console = logging.StreamHandler(sys.stdout)
            console.setFormatter(fmt)
            log.addHandler(console)
    return log


def run_task(run_dir: str | Path, workload: Workload, flag: Optional[PreemptionFlag] = None) -> int:
    """Join the job's process group, run ``workload``, record the outcome in run.json. Returns 0
    (a workload's error is recorded, then raised)."""
    if flag is None:  # the entry points install it before importing torch: see train.job
        flag = PreemptionFlag().install()  # replaces submitit's USR2 handler: one path
    from train.harness.dist import shutdown

    run_dir = Path(run_dir).resolve()
    cfg, layout, ctx = _join(run_dir)
    log = rank_logger(run_dir, ctx.rank)
    info = _claim(cfg, layout, ctx, run_dir, log)
    if info is None:
        shutdown()
        return 0
    segment = int(info.get("segments", 0))
    task = Task(cfg, layout, run_dir, ctx, segment, log.info, flag, _watchdog(cfg, ctx, run_dir, segment, log.info))
    try:
        outcome = workload(task)
    except BaseException as exc:
        record_failure(exc, run_dir, ctx.rank, ctx.world_size, log, task.watchdog.interval_s, task.restart)
        raise
    task.watchdog.stop()
    if ctx.is_main:
        record_outcome(outcome, cfg, run_dir, info, log, flag)
    shutdown()
    return 0


def _join(run_dir: Path):
    """Config, layout and this rank's place in the job's process group (collective)."""
    import torch

    from train.harness.dist import init_distributed

    cfg = to_run_config(run_dir / CONFIG)
    validate(cfg)
    # One intra-op thread pool per task sized to its CPUs, as torchrun does: srun tasks
    # otherwise each start one thread per core of the node and oversubscribe it.
    # (task_cpus: cpus_per_task=0 derives it from the node's CPUs)
    threads = (os.environ.get("OMP_NUM_THREADS") or os.environ.get("SLURM_CPUS_PER_TASK")
               or max(1, cfg.cluster.task_cpus()))
    torch.set_num_threads(max(1, int(threads)))
    layout = build_layout(cfg)
    te = task_identity()
    if te.order_error():  # before any collective: a rank out of block order would join the wrong groups
        refuse_start(RankOrderError(te.order_error()), run_dir, te.rank, te.world_size, rank_logger(run_dir, te.rank))
    if take_rendezvous_port(cfg.fault, te.rank, te.in_job_restart, te.master_port):
        rank_logger(run_dir, te.rank).info(f"fault.port_taken_in_srun: port {te.master_port} taken before the rendezvous")
    try:  # the device first: a GPU profile without its GPU stops here, before any collective
        ctx = init_distributed(collective_timeout_s(cfg), trace_dir=run_dir / "logs",
                               accelerator=cfg.cluster.accelerator, gpu_binding=cfg.cluster.gpu_binding)
    except DeviceError as exc:
        refuse_start(exc, run_dir, te.rank, te.world_size, rank_logger(run_dir, te.rank))
    except Exception as exc:
        if not is_rendezvous_error(exc):
            raise
        rendezvous_failed(exc, run_dir, te, int(read_run_json(run_dir).get("segments", 0)),
                          cfg.cluster.in_job_restarts, rank_logger(run_dir, te.rank))
        raise
    # This rank's CPUs (cluster.cpu_bind), unless its forked start placed it already
    bind_rank(cfg.cluster, ctx.local_rank, ctx.local_world_size, ctx.device, rank_logger(run_dir, ctx.rank).info,
              rank=ctx.rank)
    if ctx.world_size != layout.world_size:
        raise RuntimeError(f"the job has {ctx.world_size} ranks but the layout needs {layout.world_size} "
                           f"({layout.describe()})")
    return cfg, layout, ctx


def _claim(cfg: RunConfig, layout: Layout, ctx, run_dir: Path, log: logging.Logger) -> Optional[dict]:
    """Mark the run ``running`` (rank 0) and run the preflight; None when the run is
    finished or capped and must not run again, even if Slurm restarts it (collective)."""
    import torch.distributed as dist

    from train.harness.dist import all_hostnames
    from train.strategies.base import matmul_precision

    hostnames = all_hostnames(ctx)
    matmul = matmul_precision(cfg, ctx.device)  # before the preflight's matmul and the model's
    info = [read_run_json(run_dir) if ctx.is_main else None]
    dist.broadcast_object_list(info, src=0)
    status = status_of(info[0])
    if final(status):
        log.info(f"run is {status}; nothing to do (resubmit with `python -m launcher.resume {run_dir}`)")
        return None
    if ctx.is_main:
        update_run_json(run_dir, status=Status.RUNNING, job_id=ctx.job_id, hostnames=hostnames,
                        world_size=ctx.world_size, nodes=len(hostnames), segments=int(info[0].get("segments", 0)) + 1,
                        strategy=cfg.strategy.name, launcher=ctx.launcher, backend=ctx.backend, matmul=matmul,
                        started_at=time.time(), restart_count=ctx.restart_count, **SEGMENT_FAILURE)
        restart.note_start(run_dir, ctx)
    mark_stderr(run_dir)  # a hardware fault is looked for in this segment's stderr only
    if ctx.local_rank == 0:  # each node's torch, CUDA, driver, NCCL, GPUs: RUN_DIR/nodes/<host>.json
        try:
            write_node_facts(run_dir, ctx.hostname)
        except Exception as exc:  # noqa: BLE001 - a record, never a reason to fail
            log.info(f"node facts not written: {exc}")
    if cfg.train.preflight:  # on outlier nodes with preflight_exclude: records them, raises PreflightError
        from train.harness.preflight import run_preflight
        run_preflight(ctx, run_dir, cfg.train.preflight_outlier, cfg.train.preflight_exclude, log.info,
                      delay_s=Faults(cfg.fault, ctx.rank, int(info[0].get("segments", 0))).preflight_delay())
    return info[0]


def _watchdog(cfg: RunConfig, ctx, run_dir: Path, segment: int, log: Callable[[str], None]) -> Watchdog:
    """Heartbeats, and the hang check when ``cluster.hang_timeout_s`` > 0: a hang is
    recorded, then restarted inside the job when the step loop may."""
    # Until the first step completes (build, restore, lazy init) a hang may take 3x as
    # long, but never past the collective timeout, which would abort without a report.
    hang = cfg.cluster.hang_timeout_s
    startup = min(3 * hang, cfg.train.dist_timeout_s - WATCHDOG_GRACE_S)
    saves = save_timeout_s(cfg)  # checkpoint I/O: its own bound (the collective timeout covers it)

    def on_hang(report: Dict[str, Any]) -> None:
        record_hang(run_dir, report)
        stuck, hosts = report.get("stuck_ranks") or [None], report.get("stuck_hosts") or [None]
        Restart(run_dir, cfg.cluster.in_job_restarts, ctx, segment, watchdog, spares=cfg.cluster.spare_nodes).ask(
            log, stuck[0], hosts[0])

    watchdog = Watchdog(run_dir, ctx.rank, ctx.node_rank, ctx.hostname, ctx.world_size, hang,
                        interval_s=heartbeat_interval(hang), on_hang=on_hang, startup_timeout_s=startup,
                        segment=segment, save_timeout_s=saves)
    return watchdog.start()
