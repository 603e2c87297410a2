"""What a task's end means for the run: run.json status, failure class, requeue.

Called by :func:`train.harness.run.run_task` for any workload: a raised error is
``failed`` (this rank's own error with its rank and node; after a communication error,
the dead ranks and nodes; or this node's hardware fault named in the error or the task's
stderr); the job then starts its ranks again inside the allocation while restarts are
left (:mod:`train.harness.restart`), or is requeued without the blamed nodes while
requeues are left (:mod:`train.harness.badnodes`); "completed" is
``completed``, "interrupted" (a checkpoint committed after a signal) is counted as a
preemption or a timeout and requeued unless the cap is reached. Requeues and cancels are
asked of the batch script (:mod:`slurm.request`): the task calls no Slurm client. A task that cannot take
its device (:mod:`spec.device`: no usable CUDA, GPUs shown otherwise than the binding
says) or whose rank is not in block order is refused at start (:func:`refuse_start`):
``failed`` with ``no_cuda`` / ``gpu_binding`` / ``rank_order``, the job ended, no requeue.
"""
from __future__ import annotations

import logging
import socket
import time
from pathlib import Path
from typing import Any, Dict, NoReturn, Optional

from slurm import query
from slurm.states import final
from spec.config import RunConfig
from spec.device import DeviceError
from spec.identity import RANK_ORDER
from spec.rundir import RENDEZVOUS, START_REFUSALS, Status, read_run_json, status_of, update_run_json
from train.harness import preempt
from train.harness.preempt import PreemptionFlag
from train.harness import health
from train.harness.badnodes import ELSEWHERE, REQUEUED, requeue_without_suspects
from train.harness.restart import Restart
from train.harness.classify import classify_failure

# This task's stderr and its size when the harness started: faults are looked for in this
# segment's lines only (submitit appends every segment to one file).
_STDERR_START: Dict[Optional[str], int] = {}


def mark_stderr(run_dir: Path) -> None:
    """Remember where this segment's stderr starts (called when the task starts)."""
    path = health.stderr_path(str(run_dir))
    _STDERR_START[path] = health.log_offset(path)


def is_comm_error(exc: BaseException) -> bool:
    text = str(exc)
    return isinstance(exc, RuntimeError) and any(k in text for k in (
        "Connection closed by peer", "Connection reset", "gloo", "NCCL", "Broken pipe", "timed out"))


# Which recorded failure stands when several ranks record one: a more specific cause is
# not replaced by a rank's echo of it (its peers' communication errors).
# "error": a rank's own error (run.json failed_rank; failure stays null): it outranks its
# peers' guesses from their broken connections and heartbeats (a rank that raised and
# exited looks like a dead node when it was its node's only rank); an own error that
# names its node's hardware outranks it in turn.
FAILURE_RANK = {None: 0, "communication": 1, RENDEZVOUS: 1.5, "rank_failure": 2, "node_failure": 3, "error": 3.2,
                "hardware_fault": 3.5, "straggler": 3.5, "preflight_outlier": 4, "hang": 5, **{refusal: 6 for refusal in (*START_REFUSALS, RANK_ORDER)}}


class RankOrderError(DeviceError):
    """A task whose rank is not in block order (:meth:`spec.identity.TaskIdentity.order_error`):
    refused at start, before any collective, as one that cannot take its device."""

    def __init__(self, line: str) -> None:
        super().__init__(line, RANK_ORDER)


class StragglerError(RuntimeError):
    """Raised on every rank (they agree: the same table) when ``train.straggler_action=
    restart_without`` and a rank is flagged: the run records ``failure: straggler`` with
    the rank's node as suspect, so a hot spare takes it or the job is requeued without it
    (record_failure below, restart.py, badnodes.py; the detector: train/steptimes.py)."""

    def __init__(self, rank: int, host: str, score: float, steps: int) -> None:
        super().__init__(f"straggler: rank {rank} on {host} ran at {score:.2f} of its peers' speed for {steps} steps "
                         "(train.straggler_action=restart_without): restarting without its node")
        self.rank, self.host = rank, host


def outranks(current: Any, new: Any) -> bool:
    """Does the recorded ``current`` failure class stand against ``new``? The first rank's
    own error stands against another's. Pure."""
    return FAILURE_RANK.get(current, 3) > FAILURE_RANK.get(new, 3) or current == new == "error"


def failure_class(info: Dict[str, Any]) -> Any:
    """run.json's (or a record's) failure class for :func:`outranks`: ``failure``, else
    "error" for a rank's own error."""
    return info.get("failure") or ("error" if info.get("failed_rank") is not None else None)


def record_failure(exc: BaseException, run_dir: Path, rank: int, world_size: int, log: logging.Logger,
                   heartbeat_s: float = 1.0, restart: Optional[Restart] = None) -> None:
    """The workload raised ``exc`` on this rank: say so in run.json (the caller re-raises),
    then have the job restart its ranks (``restart``: :mod:`train.harness.restart`), or
    requeue it without the nodes the failure blames, or end it
    (:mod:`train.harness.badnodes`). ``heartbeat_s``: the ranks' heartbeat interval
    (0: none, no classification)."""
    import traceback

    fields: Dict[str, Any] = {"status": Status.FAILED, "error": f"{type(exc).__name__}: {str(exc)[:500]}",
                              "ended_at": time.time()}
    job = preempt.current_job_id()
    if isinstance(exc, DeviceError):  # a refusal at start, before any collective: its line says it all
        log.error("%s", exc)
        fields["failure"] = exc.failure
    elif isinstance(exc, StragglerError):  # every rank agreed on it: the slow rank's node goes
        log.error("%s", exc)
        fields.update(failure="straggler", suspect_nodes=[exc.host], failed_rank=exc.rank, failed_node=exc.host)
    else:
        log.error("training failed: %s\n%s", exc, traceback.format_exc())
        echo = is_comm_error(exc) and read_run_json(run_dir).get("failed_rank") is not None  # of a peer's error
        if not is_comm_error(exc):  # this rank's own error: the cause, not an echo of a peer's
            fields.update(failed_rank=rank, failed_node=socket.gethostname())
        elif not echo:  # a peer died or the network broke: find out which
            # one rank of the segment reads the heartbeats, the others take its verdict
            segment = restart.segment if restart is not None else None
            fields.update(classify_failure(run_dir, world_size, heartbeat_s, segment))
            fields.update(slurmd_down(fields) if job else {})
            log.error("failure classified: %s", fields)
        if not echo:
            fields.update(hardware_fields(f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}", run_dir, fields))
    if rank == 0 or failure_class(fields) is not None:  # rank 0 may be the one that died
        # A hang or a node's fault already recorded is the cause: a rank's error after it
        # (its peers' broken connections) must not replace it, nor undo a requeue for it.
        update_run_json(run_dir, unless=lambda info: outranks(failure_class(info), failure_class(fields)) or (
            info.get("status") == Status.REQUEUED and info.get("failure") is not None), **fields)
    if restart is not None and restart.ask(log.error):
        return
    if job is None:
        return
    if requeue_without_suspects(run_dir, log.error, job) in (REQUEUED, ELSEWHERE):
        return
    standing = read_run_json(run_dir).get("failure")  # what stands, not this rank's guess
    if standing == "node_failure":
        # Slurm notices a dead node only after SlurmdTimeout; until then the job would
        # hold the surviving nodes. End it now: the run is resumable elsewhere.
        preempt.cancel(run_dir, "a dead node, not requeued")
    elif standing in (*START_REFUSALS, RANK_ORDER):
        # Tasks that could take their device wait in the rendezvous for this one until
        # train.dist_timeout_s: end the job now (the same refusal awaits it on a requeue).
        preempt.cancel(run_dir, f"a task refused to start ({standing})")


def refuse_start(exc: DeviceError, run_dir: Path, rank: int, world_size: int, log: logging.Logger) -> NoReturn:
    """A task that cannot take its device (before any collective): run.json ``failed``
    with the refusal's failure class (the job is ended under Slurm), and the task exits 1
    with the line in its log (rank 0's also on stdout), not a traceback. A finished run
    (completed, stopped) started again stays as it was."""
    status = status_of(read_run_json(run_dir))
    if final(status):
        log.error("%s", exc)
    else:
        record_failure(exc, run_dir, rank, world_size, log, heartbeat_s=0)
    raise SystemExit(1)


def is_rendezvous_error(exc: BaseException) -> bool:
    """An error of joining the job's process group (torch's ``DistError`` family: rank 0's
    TCPStore could not bind its port, a peer could not reach it in time), or a broken
    connection while gloo connects its pairs."""
    import torch.distributed as dist

    return isinstance(exc, getattr(dist, "DistError", ())) or is_comm_error(exc)


def rendezvous_failed(exc: BaseException, run_dir: Path, identity: Any, segment: int, budget: int,
                      log: logging.Logger) -> None:
    """This task could not join the job's process group: run.json ``failed`` with
    ``failure: rendezvous`` (unless a finished status or a stronger failure stands). Inside
    a step loop the job starts its ranks again (``budget``: ``cluster.in_job_restarts``):
    the next step's port differs (slurm.env.rendezvous_port). Else a job whose srun step
    this is is ended: its other tasks would wait for this one in the rendezvous until
    ``train.dist_timeout_s``.
    ``identity``: this task's (:func:`slurm.env.task_identity` before the rendezvous, which
    leaves torchrun's variables behind); ``segment``: run.json's ``segments`` (the segment
    this start would have been)."""
    from train.harness.restart import request

    rank = identity.rank
    log.error("could not join the job's process group: %s: %s", type(exc).__name__, exc)
    host = socket.gethostname()
    fields = {"status": Status.FAILED, "error": f"{type(exc).__name__}: {str(exc)[:500]}", "failure": RENDEZVOUS,
              "failed_rank": rank, "failed_node": host, "ended_at": time.time()}
    # A failure still in run.json while it says ``restarting`` is the one the job restarted
    # for (this start's peers record none before joining): this one replaces it.
    update_run_json(run_dir, unless=lambda info: final(status_of(info)) or (
        status_of(info) is not Status.RESTARTING and outranks(failure_class(info), RENDEZVOUS)), **fields)
    if request(run_dir, budget, identity, segment, 0, None, log.error, rank, host, spares=0):
        return
    # Our own srun step only: under torchrun its agent restarts the workers itself.
    if identity.launcher == "srun" and preempt.current_job_id() is not None and \
            status_of(read_run_json(run_dir)) is Status.FAILED:
        preempt.cancel(run_dir, f"rank {rank} could not join the process group")


def slurmd_down(fields: Dict[str, Any]) -> Dict[str, Any]:
    """Dead ranks whose node's slurmd Slurm already sees down (not responding, failing,
    drained) make a node failure even when some of its ranks still beat."""
    if fields.get("failure") != "rank_failure" or not fields.get("dead_hosts"):
        return {}
    down = query.unresponsive_nodes(fields["dead_hosts"])
    return {"failure": "node_failure", "suspect_nodes": down, "slurmd_down": down} if down else {}


def hardware_fields(text: str, run_dir: Path, fields: Dict[str, Any]) -> Dict[str, Any]:
    """A hardware fault of this node named in the error or in this segment's stderr:
    ``failure: hardware_fault`` with this node as suspect (``fault`` holds the line).
    Not looked for when peers died: this rank's errors are then their echo."""
    if fields.get("dead_ranks") or fields.get("failure") == "node_failure":
        return {}
    path = health.stderr_path(str(run_dir))
    fault = health.hardware_fault(text + "\n" + health.read_tail(path, _STDERR_START.get(path, 0)))
    if fault is None:
        return {}
    if not fault["local"]:
        return {"fault": fault}
    host = socket.gethostname()
    return {"failure": "hardware_fault", "suspect_nodes": [host], "fault": dict(fault, host=host)}


def record_hang(run_dir: Path, report: Dict[str, Any]) -> None:
    """The watchdog's ``on_hang``: the run failed of a hang (hang.json has the details)."""
    what = ("a checkpoint's save did not end (checkpoint.save_timeout_s)" if report.get("in_save")
            else "no step completed")
    update_run_json(run_dir, status=Status.FAILED, failure="hang", ended_at=time.time(),
                    error=f"hang: {what} in {report['timeout_s']} s; stuck ranks "
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
    job = preempt.current_job_id()
    if not flag.agreed_requeue:  # SIGTERM only: scancel, or a requeue Slurm does itself
        update_run_json(run_dir, status=Status.INTERRUPTED, last_interruption="terminated", ended_at=time.time())
        log.info("SIGTERM: checkpoint committed; not requeued (cancelled, or Slurm requeues it itself)")
        return
    kind = preempt.classify(run_dir, cfg.cluster.signal_delay_s) if job else "preemption"
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
        # run.json first: the batch script requeues the job within a second, ending this
        # process; a requeue that fails there is written back (interrupted, requeue_error).
        update_run_json(run_dir, status=Status.REQUEUED, last_interruption=kind, **fields)
        preempt.ask_requeue(run_dir, kind)
        log.info(f"{kind}: checkpoint committed; requeue of job {job}: asked of the batch script")
