"""What a task's end means for the run: run.json status, failure class, requeue.

Called by :func:`train.harness.run.run_task` for any workload: a raised error is
``failed`` (with the dead ranks and nodes after a communication error), "completed" is
``completed``, "interrupted" (a checkpoint committed after a signal) is counted as a
preemption or a timeout and requeued unless the cap is reached.
"""
from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import Any, Dict

from spec.config import RunConfig
from spec.rundir import Status, update_run_json
from train.harness import preempt
from train.harness.preempt import PreemptionFlag
from train.harness.watchdog import classify_failure


def is_comm_error(exc: BaseException) -> bool:
    text = str(exc)
    return isinstance(exc, RuntimeError) and any(k in text for k in (
        "Connection closed by peer", "Connection reset", "gloo", "NCCL", "Broken pipe", "timed out"))


def record_failure(exc: BaseException, run_dir: Path, rank: int, world_size: int, log: logging.Logger,
                   heartbeat_s: float = 1.0) -> None:
    """The workload raised ``exc`` on this rank: say so in run.json (the caller re-raises).
    ``heartbeat_s``: the ranks' heartbeat interval (0: none, no classification)."""
    import traceback

    log.error("training failed: %s\n%s", exc, traceback.format_exc())
    fields: Dict[str, Any] = {"status": Status.FAILED, "error": f"{type(exc).__name__}: {str(exc)[:500]}",
                              "ended_at": time.time()}
    if is_comm_error(exc):  # a peer died or the network broke: find out which
        fields.update(classify_failure(run_dir, world_size, heartbeat_s))
        log.error("failure classified: %s", fields)
    if rank == 0 or "failure" in fields:  # rank 0 may be the one that died
        # A hang already recorded is the cause: a rank's error after it (its peers exited
        # with the watchdog's status) must not replace it.
        update_run_json(run_dir, unless=lambda info: info.get("failure") == "hang", **fields)
    if fields.get("failure") == "node_failure" and preempt.in_slurm_job():
        # Slurm notices a dead node only after SlurmdTimeout; until then the job would
        # hold the surviving nodes. End it now: the run is resumable elsewhere.
        preempt.cancel(preempt.in_slurm_job())


def record_hang(run_dir: Path, report: Dict[str, Any]) -> None:
    """The watchdog's ``on_hang``: the run failed of a hang (hang.json has the details)."""
    update_run_json(run_dir, status=Status.FAILED, failure="hang", ended_at=time.time(),
                    error=f"hang: no step completed in {report['timeout_s']} s; stuck ranks "
                          f"{report['stuck_ranks']} on {', '.join(report['stuck_hosts'])} (hang.json)")


def record_outcome(outcome: str, cfg: RunConfig, run_dir: Path, info: dict, log: logging.Logger,
                   flag: PreemptionFlag) -> None:
    """Rank 0, the workload returned ``outcome`` ("completed" or "interrupted")."""
    if outcome == Status.COMPLETED:
        update_run_json(run_dir, status=Status.COMPLETED, ended_at=time.time())
    else:
        after_interruption(cfg, run_dir, info, log, flag)


def after_interruption(cfg: RunConfig, run_dir: Path, info: dict, log: logging.Logger, flag: PreemptionFlag) -> None:
    """Rank 0, checkpoint committed: count the interruption, requeue unless capped."""
    job = preempt.in_slurm_job()
    if not flag.agreed_requeue:  # SIGTERM only: scancel, or a requeue Slurm does itself
        update_run_json(run_dir, status=Status.INTERRUPTED, last_interruption="terminated", ended_at=time.time())
        log.info("SIGTERM: checkpoint committed; not requeued (cancelled, or Slurm requeues it itself)")
        return
    kind = preempt.classify(job, cfg.cluster.signal_delay_s) if job else "preemption"
    counter = "timeouts" if kind == "timeout" else "preemptions"
    requeues = int(info.get("requeues_since_submit", 0)) + 1
    fields = {counter: int(info.get(counter, 0)) + 1, "requeues_since_submit": requeues, "ended_at": time.time()}
    if job is None:
        update_run_json(run_dir, status=Status.INTERRUPTED, **fields)
        log.info(f"{kind}: checkpoint committed; run the same command again to resume")
    elif requeues > cfg.cluster.max_requeues:
        update_run_json(run_dir, status=Status.STOPPED, stop_reason=f"requeue cap cluster.max_requeues="
                        f"{cfg.cluster.max_requeues} reached after {kind}", **fields)
        log.info(f"{kind}: checkpoint committed; not requeued (cap {cfg.cluster.max_requeues} reached)")
    else:
        # run.json first: the requeue may kill this process before it returns.
        update_run_json(run_dir, status=Status.REQUEUED, last_interruption=kind, **fields)
        error = preempt.requeue(job)
        log.info(f"{kind}: checkpoint committed; requeue of job {job}: {error or 'ok'}")
        if error:  # e.g. the job was cancelled: it will not come back by itself
            update_run_json(run_dir, status=Status.INTERRUPTED, requeue_error=error)
