"""The one preemption path.

1. Slurm sends the user signal (``--signal=USR2@N``: N seconds before the time limit, or
   at once on preemption with ``preempt_send_user_signal``); an explicit
   ``scancel --signal=USR2`` does the same. SIGTERM (``scancel``, ``scontrol requeue``,
   the end of a preemption grace time) is caught too. The handler only sets a flag.
2. At the next step boundary the ranks agree: the flag rides in the per-step all-gather
   of the loss, so no extra collective is needed and every rank sees the same decision.
3. All ranks save one checkpoint together and commit it atomically (train.checkpoint).
4. Rank 0 decides: a signal with little time left is a *timeout*, otherwise a
   *preemption* (counted separately in run.json; the time left comes from the batch
   script: :func:`slurm.request.seconds_left`). Unless the cap ``cluster.max_requeues``
   is reached, rank 0 asks the batch script to requeue the job (``RUN_DIR/SLURM_REQUEST``,
   :func:`slurm.request.ask`), which runs ``scontrol requeue`` outside the task (a
   container need not have Slurm's client): the job keeps its id and run directory, and
   the restarted tasks resume from the checkpoint. Then every rank exits cleanly. A
   SIGTERM alone (no USR2 before it) is a cancellation or an administrator's requeue:
   the checkpoint is saved but the job is not requeued by us (a cancelled job must stay
   cancelled; Slurm requeues it itself when that was asked).

submitit installs its own USR2 handler in each task; ours replaces it, so there is one
path (submitit's Checkpointable is not used).
"""
from __future__ import annotations

import os
import signal
import time
from pathlib import Path
from typing import Callable, Mapping, Optional

from slurm import request
from slurm.env import slurm_job_id

# Set by slurm/task_wrapper.sh: a file that exists when USR2 came before the handler.
USR2_MARK_ENV = "STO_USR2_MARK"

# A signal that arrives when less than signal_delay + this margin remains is a timeout.
TIMEOUT_MARGIN_S = 60


class Preempted(BaseException):
    """Raised in a user's task whose code does not handle signals, when one comes
    (train/harness/user.py); and by the Trainer's callback once its checkpoint of the agreed
    signal's step is written (train/harness/hf_trainer.py). A BaseException: ``except
    Exception`` in the code does not swallow it."""


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


def classify(run_dir: str | Path, signal_delay_s: int) -> str:
    """"timeout" when the signal came because the time limit is near, else "preemption"."""
    left = request.seconds_left(run_dir)
    if left is not None and left <= signal_delay_s + TIMEOUT_MARGIN_S:
        return "timeout"
    return "preemption"


def ask_requeue(run_dir: str | Path, reason: str) -> None:
    """Have the batch script requeue this job (slurm/request.py)."""
    request.ask(run_dir, "requeue", reason)


def cancel(run_dir: str | Path, reason: str) -> None:
    """Have the batch script cancel this job (the job is ending anyway)."""
    request.ask(run_dir, "cancel", reason)


def current_job_id(env: Mapping[str, str] | None = None) -> Optional[str]:
    """The id to requeue, cancel or query this job by; None outside a Slurm job. In an
    element of a job array that is "ARRAYID_TASKID" (:func:`slurm.env.slurm_job_id`, as in
    the task's :class:`~spec.identity.TaskIdentity`): the element's own SLURM_JOB_ID equals
    the array's id for one element, and `scontrol requeue`/`scancel` of that id act on
    every element (seen on Slurm 22.05); the batch script computes the same id."""
    return slurm_job_id(env)


def in_slurm_job(env: Mapping[str, str] | None = None) -> bool:
    """Whether this process runs inside a Slurm job (one it can requeue or cancel)."""
    return current_job_id(env) is not None
