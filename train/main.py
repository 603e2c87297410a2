"""Run one task of a training job from its run directory (every launcher ends here)."""
from __future__ import annotations

import logging
import os
import sys
import time
import traceback
from pathlib import Path

from train.harness import preempt
from spec.config import to_run_config
from spec.validate import WATCHDOG_GRACE_S, validate
from spec.layout import build_layout
from train.checkpoint import Checkpointer
from train.harness.preempt import PreemptionFlag
from train.harness.watchdog import Watchdog, classify_failure
from spec.rundir import CONFIG, read_run_json, update_run_json

# Statuses after which a (re)started job does nothing: resubmission resets them.
FINAL = ("completed", "stopped")


def _logger(run_dir: Path, rank: int) -> logging.Logger:
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


def run(run_dir: str | Path, flag: PreemptionFlag | None = None) -> int:
    """Join the job's process group, train, record the outcome in run.json. Returns 0."""
    # First: a signal during the slow imports and rendezvous must set the flag, not kill.
    # The entry points (train.job, python -m train) install it before importing this module.
    if flag is None:
        flag = PreemptionFlag().install()  # replaces submitit's USR2 handler: one path

    import torch
    import torch.distributed as dist

    from train.harness.dist import all_hostnames, init_distributed, shutdown
    from train.loop import train

    run_dir = Path(run_dir).resolve()
    cfg = to_run_config(run_dir / CONFIG)
    validate(cfg)
    # One intra-op thread pool per task sized to its CPUs, as torchrun does: srun tasks
    # otherwise each start one thread per core of the node and oversubscribe it.
    threads = os.environ.get("OMP_NUM_THREADS") or os.environ.get("SLURM_CPUS_PER_TASK") or cfg.cluster.cpus_per_task
    torch.set_num_threads(max(1, int(threads)))
    layout = build_layout(cfg)
    ctx = init_distributed(cfg.train.dist_timeout_s, trace_dir=run_dir / "logs")
    log = _logger(run_dir, ctx.rank)
    if ctx.world_size != layout.world_size:
        raise RuntimeError(f"the job has {ctx.world_size} ranks but the layout needs {layout.world_size} "
                           f"({layout.describe()})")
    hostnames = all_hostnames(ctx)
    info = [read_run_json(run_dir) if ctx.is_main else None]
    dist.broadcast_object_list(info, src=0)
    status = info[0].get("status")
    if status in FINAL:  # never retrain a finished or capped run, even if Slurm restarts it
        log.info(f"run is {status}; nothing to do (resubmit with `python -m launcher.resume {run_dir}`)")
        shutdown()
        return 0
    segment = int(info[0].get("segments", 0))
    if ctx.is_main:
        update_run_json(run_dir, status="running", job_id=ctx.job_id, hostnames=hostnames,
                        world_size=ctx.world_size, nodes=len(hostnames), segments=segment + 1,
                        strategy=cfg.strategy.name, launcher=ctx.launcher, backend=ctx.backend,
                        started_at=time.time(), restart_count=ctx.restart_count, error=None, failure=None)
    if cfg.train.preflight:  # on outlier nodes with preflight_exclude: records them, raises PreflightError
        from train.harness.preflight import run_preflight
        run_preflight(ctx, run_dir, cfg.train.preflight_outlier, cfg.train.preflight_exclude, log.info)
    ckpt = Checkpointer(run_dir / "checkpoints", ctx.rank, keep=cfg.checkpoint.keep,
                        slow_async_s=cfg.fault.slow_async_save_s)

    def on_hang(report: dict) -> None:
        update_run_json(run_dir, status="failed", failure="hang", ended_at=time.time(),
                        error=f"hang: no step completed in {report['timeout_s']} s; stuck ranks "
                              f"{report['stuck_ranks']} on {', '.join(report['stuck_hosts'])} (hang.json)")

    # Until the first step completes (build, restore, lazy init) a hang may take 3x as
    # long, but never past the collective timeout, which would abort without a report.
    hang = cfg.cluster.hang_timeout_s
    startup = min(3 * hang, cfg.train.dist_timeout_s - WATCHDOG_GRACE_S)
    watchdog = Watchdog(run_dir, ctx.rank, ctx.node_rank, ctx.hostname, ctx.world_size, hang, on_hang=on_hang,
                        startup_timeout_s=startup).start()
    try:
        outcome = train(cfg, layout, ctx, run_dir, segment, log.info, flag, ckpt, watchdog)
    except BaseException as exc:
        log.error("training failed: %s\n%s", exc, traceback.format_exc())
        fields = {"status": "failed", "error": f"{type(exc).__name__}: {str(exc)[:500]}", "ended_at": time.time()}
        if _is_comm_error(exc):  # a peer died or the network broke: find out which
            fields.update(classify_failure(run_dir, ctx.world_size))
            log.error("failure classified: %s", fields)
        if ctx.is_main or "failure" in fields:  # rank 0 may be the one that died
            update_run_json(run_dir, **fields)
        if fields.get("failure") == "node_failure" and preempt.in_slurm_job():
            # Slurm notices a dead node only after SlurmdTimeout; until then the job would
            # hold the surviving nodes. End it now: the run is resumable elsewhere.
            preempt.cancel(preempt.in_slurm_job())
        raise
    watchdog.stop()
    if ctx.is_main:
        if outcome == "completed":
            update_run_json(run_dir, status="completed", ended_at=time.time())
        else:
            after_interruption(cfg, run_dir, info[0], log, flag)
    shutdown()
    return 0


def _is_comm_error(exc: BaseException) -> bool:
    text = str(exc)
    return isinstance(exc, RuntimeError) and any(k in text for k in (
        "Connection closed by peer", "Connection reset", "gloo", "NCCL", "Broken pipe", "timed out"))


def after_interruption(cfg, run_dir: Path, info: dict, log, flag: PreemptionFlag) -> None:
    """Rank 0, checkpoint committed: count the interruption, requeue unless capped."""
    job = preempt.in_slurm_job()
    if not flag.agreed_requeue:  # SIGTERM only: scancel, or a requeue Slurm does itself
        update_run_json(run_dir, status="interrupted", last_interruption="terminated", ended_at=time.time())
        log.info("SIGTERM: checkpoint committed; not requeued (cancelled, or Slurm requeues it itself)")
        return
    kind = preempt.classify(job, cfg.cluster.signal_delay_s) if job else "preemption"
    counter = "timeouts" if kind == "timeout" else "preemptions"
    requeues = int(info.get("requeues_since_submit", 0)) + 1
    fields = {counter: int(info.get(counter, 0)) + 1, "requeues_since_submit": requeues, "ended_at": time.time()}
    if job is None:
        update_run_json(run_dir, status="interrupted", **fields)
        log.info(f"{kind}: checkpoint committed; run the same command again to resume")
    elif requeues > cfg.cluster.max_requeues:
        update_run_json(run_dir, status="stopped", stop_reason=f"requeue cap cluster.max_requeues="
                        f"{cfg.cluster.max_requeues} reached after {kind}", **fields)
        log.info(f"{kind}: checkpoint committed; not requeued (cap {cfg.cluster.max_requeues} reached)")
    else:
        # run.json first: the requeue may kill this process before it returns.
        update_run_json(run_dir, status="requeued", last_interruption=kind, **fields)
        error = preempt.requeue(job)
        log.info(f"{kind}: checkpoint committed; requeue of job {job}: {error or 'ok'}")
        if error:  # e.g. the job was cancelled: it will not come back by itself
            update_run_json(run_dir, status="interrupted", requeue_error=error)


def main(argv: list[str] | None = None, flag: PreemptionFlag | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 1 or argv[0] in ("-h", "--help"):
        print("usage: python -m train RUN_DIR   (RUN_DIR holds config.yaml, written by the launcher)\n"
              "       torchrun --nproc-per-node N -m train RUN_DIR", file=sys.stderr)
        return 2
    if not (Path(argv[0]) / CONFIG).is_file():
        print(f"error: {argv[0]}/{CONFIG} not found; create the run with `python -m launcher ... "
              f"launcher.dry_run=true` or pass a run directory", file=sys.stderr)
        return 2
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    return run(argv[0], flag)
