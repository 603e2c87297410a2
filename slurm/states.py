"""Where a run stands: the one place that decides it, from Slurm's job states (as squeue
and sacct print them: the only sets of them) and the run's ``run.json`` status.

Every decision about a run's state asks here: the sweep tracker (``launcher.status``,
``launcher.report``), a single run's status and ``--follow`` (launcher.track.single),
the launcher's re-run check, its wait and its local runs (launcher.checks,
launcher.submit, launcher.launch) and the task harness (may this segment start).
Pure: no Slurm call, nothing but the states and statuses it is given.
"""
from __future__ import annotations

import re
from enum import Enum
from typing import Any, Mapping, NamedTuple, Optional, Sequence

from spec.rundir import Status, status_of

#: Waiting to run (a requeued job waits in these too, under the same id).
PENDING = frozenset({"PENDING", "REQUEUE_HOLD", "REQUEUE_FED", "SPECIAL_EXIT", "RESV_DEL_HOLD"})
#: Still Slurm's business: pending, running, or on its way between the two.
ACTIVE = PENDING | {"RUNNING", "REQUEUED", "CONFIGURING", "COMPLETING", "SUSPENDED", "RESIZING", "STAGE_OUT",
                    "SIGNALING", "STOPPED"}
#: Over for good. PREEMPTED is not among them: with requeue the job comes back.
TERMINAL = frozenset({"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "BOOT_FAIL",
                      "DEADLINE"})

#: The failure class a final state names by itself (``launcher.report``); the logs decide
#: for plain FAILED and CANCELLED.
FAILURE_OF_STATE = {"OUT_OF_MEMORY": "out of memory", "TIMEOUT": "time limit", "DEADLINE": "time limit",
                    "PREEMPTED": "preempted", "NODE_FAIL": "node failure", "BOOT_FAIL": "node failure"}

#: A job id Slurm's commands take: ``123`` or a job array's element ``123_4``.
_JOB_ID = re.compile(r"^\d+(_\d+)?$")


def is_job_id(text: object) -> bool:
    """True for a Slurm job id (run.json holds "local" for a run without Slurm)."""
    return isinstance(text, str) and bool(_JOB_ID.match(text))


def job_state(text: Optional[str]) -> str:
    """Slurm's state word: sacct prints ``CANCELLED by 1000``; "" for none."""
    return (text or "").split()[0] if (text or "").strip() else ""


class Outcome(str, Enum):
    """Where a point of a sweep stands, the word ``launcher.status``, ``launcher.report``
    (its ``outcome`` column) and a sweep's wait print."""

    PENDING = "pending"
    RUNNING = "running"
    COMPLETED = "completed"
    FAILED = "failed"
    SKIPPED = "skipped"  # never submitted (the launcher's refusal or the planner's)
    UNKNOWN = "unknown"  # nothing says: no Slurm record and run.json names no end

    def __str__(self) -> str:
        return self.value

    @property
    def finished(self) -> bool:
        """Nothing more will happen to it (a sweep's wait ends when every point is)."""
        return self in (Outcome.COMPLETED, Outcome.FAILED, Outcome.SKIPPED)


class Decision(NamedTuple):
    outcome: Outcome
    state: str  # the state shown: Slurm's word while it has the job or its record, else run.json's
    lost: bool = False  # a Slurm job in neither squeue nor sacct (run.json decided)


def decide(info: Mapping[str, Any], *, skipped: bool = False, queued: Optional[str] = None,
           accounted: Optional[str] = None, slurm_job: bool = False, slurm_ok: bool = True,
           trust_slurm: bool = True, alive: bool = False) -> Decision:
    """A run's outcome from its run.json (``info``) and Slurm's view of its job: ``queued``
    is squeue's state (None: not in the queue), ``accounted`` sacct's newest state of our
    job (None or "": no record). ``slurm_job``: run.json names a Slurm job id;
    ``slurm_ok``: Slurm answered; ``trust_slurm`` is False when the id's record is not
    ours (a reused id), and run.json decides. ``alive``: a local run's ranks wrote lately
    (heartbeats, metrics): one that run.json calls starting or running is running."""
    raw = str(info.get("status") or "")
    status = status_of(info)
    if skipped:
        return Decision(Outcome.SKIPPED, "SKIPPED")
    live = job_state(queued) or (job_state(accounted) if job_state(accounted) in ACTIVE else "")
    if live:  # in the queue, or sacct (which lags the controller by a moment) says so
        return Decision(Outcome.PENDING if live in PENDING else Outcome.RUNNING, live)
    last = job_state(accounted)
    if last:  # Slurm's record of how the job ended; the run completed only if both say so
        return Decision(Outcome.COMPLETED if succeeded(status, last) else Outcome.FAILED, last)
    shown = raw.upper() or "UNKNOWN"
    if not slurm_job and alive and status in (Status.STARTING, Status.RUNNING):
        return Decision(Outcome.RUNNING, shown)
    if not slurm_job or not slurm_ok or not trust_slurm:  # a local run, Slurm unreachable, a reused id
        by_status = {Status.COMPLETED: Outcome.COMPLETED, Status.FAILED: Outcome.FAILED,
                     Status.STOPPED: Outcome.FAILED, Status.INTERRUPTED: Outcome.FAILED}
        return Decision(by_status.get(status, Outcome.UNKNOWN if trust_slurm else Outcome.FAILED), shown)
    return Decision(Outcome.COMPLETED if status is Status.COMPLETED else Outcome.FAILED, shown, lost=True)


def job_over(state: Optional[str]) -> bool:
    """Slurm is done with the job for good (a PREEMPTED one is requeued: not over)."""
    return job_state(state) in TERMINAL


def succeeded(status: Optional[Status], slurm_state: Optional[str] = None, exit_code: int = 0) -> bool:
    """The run did all its steps: run.json says completed, and its Slurm job (when it had
    one: ``slurm_state``) completed, or its local ranks exited 0 (``exit_code``)."""
    return (status is Status.COMPLETED and exit_code == 0
            and (slurm_state is None or job_state(slurm_state) == "COMPLETED"))


def failed(status: Optional[Status]) -> bool:
    """run.json records a failure (an error, a hang, a dead node): resume continues it."""
    return status is Status.FAILED


def ended(status: Optional[Status]) -> bool:
    """No segment will follow by itself: no requeue is pending, and a queued job of the
    run is on its way out (logs stop growing, a re-run may start it again)."""
    return status is not None and status.ended


def final(status: Optional[Status]) -> bool:
    """Never started again by the same command or a segment of its job (completed, or
    stopped by the requeue cap): ``launcher.resume`` says so instead."""
    return status is not None and status.final


def requeued(status: Optional[Status]) -> bool:
    """Checkpointed after a signal and handed back to Slurm: the same job runs again."""
    return status is Status.REQUEUED


def after_local_exit(status: Optional[Status], exit_code: int) -> Optional[Status]:
    """What run.json must say once a local run's ranks have exited with ``exit_code``:
    FAILED when a rank failed without the harness recording why (a crash before its
    handlers, a kill), else None (run.json already says it)."""
    if exit_code and status not in (Status.FAILED, Status.INTERRUPTED):
        return Status.FAILED
    return None


#: run.json ``failure`` classes a restart inside the job takes on (None: a rank's own
#: error): not a blamed node (the requeue without it, train.harness.badnodes) nor a task
#: that refused its device (the same refusal awaits every start).
RESTARTABLE_FAILURES = frozenset({None, "communication", "rank_failure", "hang", "rendezvous"})
#: Errors of the code's or the data's start (an import, a path): every start fails alike.
START_ERRORS = ("ImportError", "ModuleNotFoundError", "SyntaxError", "FileNotFoundError", "NotADirectoryError",
                "IsADirectoryError", "PermissionError", "ConfigError", "DeviceError")


def _numbers_aside(error: Any) -> str:
    """An error's text with its numbers left out: the same failure again, though a port,
    an address or a size in its message differs (a rendezvous on the next start's port)."""
    return re.sub(r"\d+", "#", str(error or ""))


def restart_refusal(entries: Sequence[Mapping[str, Any]], failure: Optional[str], error: str, step: int,
                    job_id: str, budget: int, started: Optional[bool], spare: bool = False) -> Optional[str]:
    """Whether a failed segment of job ``job_id`` is started again inside the job: None
    when it is, else why not (run.json ``in_job_restart``). ``entries``: run.json's
    ``in_job_restarts`` (the restarts so far, every job's); ``failure`` and ``error``:
    the failure recorded (class, ``Type: message``); ``step``: the step it failed in
    (1-based); ``budget``: ``cluster.in_job_restarts``; ``started``: the run had done a
    step when it failed (None: unknown, a user's code that reports no steps; the error
    classes and the crash-loop guard still apply); ``spare``: the failure blames nodes and
    the job's spare nodes can take their place (cluster.spare_nodes). Pure."""
    if budget <= 0:
        return "cluster.in_job_restarts=0"
    if failure not in RESTARTABLE_FAILURES and not spare:
        return f"failure {failure} is not restarted inside the job"
    kind = error.split(":", 1)[0].strip()
    if kind in START_ERRORS:
        return f"{kind} is an error of the start: a restart would fail alike"
    if started is False:
        return "failed before the run's first step"
    used = [e for e in entries if str(e.get("job_id")) == str(job_id)]
    if len(used) >= budget:
        return f"restart budget spent: cluster.in_job_restarts={budget}"
    if used and _numbers_aside(used[-1].get("error")) == _numbers_aside(error) and used[-1].get("step") == step:
        return f"crash loop: the same error at step {step} as before the last restart"
    return None
