"""The one preemption path.

1. Slurm sends the user signal (``--signal=USR2@N``: N seconds before the time limit, or
   at once on preemption with ``preempt_send_user_signal``); an explicit
   ``scancel --signal=USR2`` does the same. SIGTERM (``scancel``, ``scontrol requeue``,
   the end of a preemption grace time) is caught too. The handler only sets a flag.
2. At the next step boundary the ranks agree: the flag rides in the per-step all-gather
   of the loss, so no extra collective is needed and every rank sees the same decision.
3. All ranks save one checkpoint together and commit it atomically (train.checkpoint).
4. Rank 0 decides: a signal with little time left is a *timeout*, otherwise a
   *preemption* (counted separately in run.json). Unless the cap ``cluster.max_requeues``
   is reached, rank 0 runs ``scontrol requeue $SLURM_JOB_ID`` (``ARRAYID_TASKID`` in a job
   array: see :func:`current_job_id`): the job keeps its id and run directory, and the
   restarted tasks resume from the checkpoint. Then every rank
   exits cleanly. A SIGTERM alone (no USR2 before it) is a cancellation or an
   administrator's requeue: the checkpoint is saved but the job is not requeued by us
   (a cancelled job must stay cancelled; Slurm requeues it itself when that was asked).

submitit installs its own USR2 handler in each task; ours replaces it, so there is one
path (submitit's Checkpointable is not used).
"""
from __future__ import annotations

import os
import signal
import time
from typing import Callable, Mapping, Optional

from slurm import query
from slurm.env import slurm_job_id

# Set by slurm/task_wrapper.sh: a file that exists when USR2 came before the handler.
USR2_MARK_ENV = "STO_USR2_MARK"

# A signal that arrives when less than signal_delay + this margin remains is a timeout.
TIMEOUT_MARGIN_S = 60


class PreemptionFlag:
    def __init__(self) -> None:
        self.signum: Optional[int] = None
        self.received_at: Optional[float] = None
        # Set by the loop from every rank's flag: did any rank get the user signal?
        self.agreed_requeue = False
        # Called with the signal number after the flag is set (a user's task acts on it at
        # once unless its code checks the flag itself: train.harness.user).
        self.hook: Optional[Callable[[int], None]] = None

    def install(self) -> "PreemptionFlag":
        for sig in (signal.SIGUSR2, signal.SIGTERM):
            signal.signal(sig, self._handler)
        self.take_early_signal()
        return self

    def take_early_signal(self) -> None:
        """A USR2 that came while Python was starting, before any handler: the task
        wrapper (slurm/task_wrapper.sh) started Python with USR2 ignored and left a mark."""
        mark = os.environ.get(USR2_MARK_ENV)
        if mark and os.path.exists(mark):
            try:
                os.unlink(mark)
            except OSError:
                pass
            self._handler(signal.SIGUSR2, None)

    def _handler(self, signum, frame) -> None:
        if self.signum is None:
            self.signum, self.received_at = signum, time.time()
        if self.hook is not None:
            self.hook(signum)

    @property
    def is_set(self) -> bool:
        return self.signum is not None

    @property
    def code(self) -> float:
        """What this rank contributes to the step's agreement: 0 none, 1 SIGTERM, 2 USR2."""
        return 0.0 if self.signum is None else (2.0 if self.signum == signal.SIGUSR2 else 1.0)


def seconds_left(job_id: str) -> Optional[float]:
    """Time left before the job's limit per Slurm, or None when unknown."""
    out = query.time_left(job_id)
    return None if out is None else parse_slurm_duration(out)


def parse_slurm_duration(text: str) -> Optional[float]:
    """``[days-]hours:minutes:seconds`` / ``minutes:seconds`` -> seconds; None if not a duration."""
    text = text.strip()
    if not text or text in ("UNLIMITED", "NOT_SET", "INVALID"):
        return None
    days = 0
    if "-" in text:
        d, text = text.split("-", 1)
        days = int(d)
    parts = [int(p) for p in text.split(":")]
    while len(parts) < 3:
        parts.insert(0, 0)
    h, m, s = parts[-3:]
    return float(((days * 24 + h) * 60 + m) * 60 + s)


def classify(job_id: str, signal_delay_s: int) -> str:
    """"timeout" when the signal came because the time limit is near, else "preemption"."""
    left = seconds_left(job_id)
    if left is not None and left <= signal_delay_s + TIMEOUT_MARGIN_S:
        return "timeout"
    return "preemption"


requeue = query.requeue  # None on success, else Slurm's error text
cancel = query.cancel


def current_job_id(env: Mapping[str, str] | None = None) -> Optional[str]:
    """The id to requeue, cancel or query this job by; None outside a Slurm job. In an
    element of a job array that is "ARRAYID_TASKID" (:func:`slurm.env.slurm_job_id`, as in
    the task's :class:`~spec.identity.TaskIdentity`): the element's own SLURM_JOB_ID equals
    the array's id for one element, and `scontrol requeue`/`scancel` of that id act on
    every element (seen on Slurm 22.05)."""
    return slurm_job_id(env)


def in_slurm_job(env: Mapping[str, str] | None = None) -> bool:
    """Whether this process runs inside a Slurm job (one it can requeue or cancel)."""
    return current_job_id(env) is not None
