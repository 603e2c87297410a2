"""Slurm's job states and job ids, as squeue and sacct print them: one place for the sets
the launcher's trackers and waiters decide with."""
from __future__ import annotations

import re

#: Waiting to run (a requeued job waits in these too, under the same id).
PENDING = frozenset({"PENDING", "REQUEUE_HOLD", "REQUEUE_FED", "SPECIAL_EXIT", "RESV_DEL_HOLD"})
#: Still Slurm's business: pending, running, or on its way between the two.
ACTIVE = PENDING | {"RUNNING", "REQUEUED", "CONFIGURING", "COMPLETING", "SUSPENDED", "RESIZING", "STAGE_OUT",
                    "SIGNALING", "STOPPED"}
#: Over for good. PREEMPTED is not among them: with requeue the job comes back.
TERMINAL = frozenset({"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "BOOT_FAIL",
                      "DEADLINE"})

#: A job id Slurm's commands take: ``123`` or a job array's element ``123_4``.
_JOB_ID = re.compile(r"^\d+(_\d+)?$")


def is_job_id(text: object) -> bool:
    """True for a Slurm job id (run.json holds "local" for a run without Slurm)."""
    return isinstance(text, str) and bool(_JOB_ID.match(text))
