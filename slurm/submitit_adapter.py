"""The one module that touches submitit beyond its documented API (``SlurmExecutor``).

It uses three private pieces, pinned by ``tests/test_submitit_adapter.py`` so that a
submitit upgrade fails that test, not a job:

- ``submitit.slurm.slurm._make_sbatch_string``: the batch script submitit submits, for the
  dry run and for job arrays whose folder submitit's executor refuses (``%a`` in it);
- ``submitit.slurm.slurm._convert_mem``: its ``mem`` spelling (:func:`mem_option`);
- ``submitit.core.utils.DelayedSubmission``: the pickle the job side loads, written here for
  job-array elements (``dump``) with submitit's requeue budget (``set_timeout``).

The step loop of restarts inside the job (:func:`in_job_restart_loop`) also relies on the
srun line's last word being the job's folder, as submitit's executor writes it
(``_submitit_command_str``; the dry run's :func:`submitit_command` is tested equal to it).

What a task runs is a :class:`TaskCall`: a function named by ``"module:function"`` and its
arguments, imported when the task calls it, so the login side never imports the compute side.
"""
from __future__ import annotations

import importlib
import shlex
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Dict, Optional, Tuple

from spec.rundir import RESTART


# Targets that moved, as jobs queued before the move pickled them: a job requeued (or
# started late) after the checkout is updated still finds its entry point.
MOVED = {"train.harness.job:main": "train.job:main"}


@dataclass
class TaskCall:
    """What submitit pickles and every srun task calls: ``module:function(*args)``."""

    target: str
    args: Tuple[Any, ...] = ()

    def function(self):
        module, name = MOVED.get(self.target, self.target).split(":")
        return getattr(importlib.import_module(module), name)

    def __call__(self) -> Any:
        return self.function()(*self.args)

    def checkpoint(self, *args: Any, **kwargs: Any):
        """submitit calls this when the warning signal (USR2) arrives after its own handler
        is installed and before the task's is (the target installs its own first thing):
        requeue the same call; the workload resumes from its own last checkpoint. Without
        it, submitit ends a job whose signal it takes for a time-out ("not checkpointable")."""
        from submitit.core.utils import DelayedSubmission

        return DelayedSubmission(self)


# Lines after srun in the batch script: a step whose tasks died of the warning signal
# (srun exits 128 + 12 = 140) before any handler existed, as Python started, is requeued
# while requeues are left, rather than ending FAILED (Slurm may send --signal's warning up
# to 60 s early, so it can come during start-up).
_REQUEUE_IF_SIGNALLED = """\
code=$?
job_id=${{SLURM_ARRAY_JOB_ID:+${{SLURM_ARRAY_JOB_ID}}_${{SLURM_ARRAY_TASK_ID}}}}
job_id=${{job_id:-$SLURM_JOB_ID}}
if [ "$code" -eq 140 ] && [ "${{SLURM_RESTART_COUNT:-0}}" -lt {max_requeues} ]; then
  echo "a step died of the warning signal (USR2) before its handler: requeueing job $job_id" >&2
  scontrol requeue "$job_id" && exit 0
fi
exit $code"""


def requeue_if_signalled(max_requeues: int) -> list[str]:
    """The batch script's teardown lines (submitit's ``teardown`` parameter)."""
    return _REQUEUE_IF_SIGNALLED.format(max_requeues=int(max_requeues)).splitlines()


# The step loop of restarts inside the job (cluster.in_job_restarts; the tasks' side:
# train/harness/restart.py). The last setup lines define `srun` as a function, so the srun
# line submitit writes after them (its last argument: the job's submitit folder,
# RUN_DIR/slurm, or SWEEP/.arrays/UID/%a for an element of a job array) runs the step again
# while the step that ended left RUN_DIR/RESTART (a task's request: its failure is one to
# restart) and restarts are left. srun returns once every task of the step has ended, so
# the old step's processes are gone when the next starts; STO_IN_JOB_RESTART numbers the
# starts (slurm.env.in_job_restart: the rendezvous port follows it). The teardown sees the
# last step's exit status.
_IN_JOB_RESTART_LOOP = """srun() {{
  local folder="${{@: -1}}" code i=0
  local mark="${{folder//%a/$SLURM_ARRAY_TASK_ID}}/../{mark}"
  while :; do
    rm -f "$mark"
    STO_IN_JOB_RESTART=$i command srun "$@"
    code=$?
    [ "$code" -ne 0 ] && [ -e "$mark" ] && [ "$i" -lt {restarts} ] || return "$code"
    i=$((i + 1))
    echo "the step failed (exit $code; $(cat "$mark")): restart $i of {restarts} inside job $SLURM_JOB_ID" >&2
  done
}}"""


def in_job_restart_loop(restarts: int) -> list[str]:
    """The batch script's last setup lines for ``cluster.in_job_restarts=restarts``: the
    training step in a loop (none for 0: the step runs once)."""
    if int(restarts) <= 0:
        return []
    return ["# restarts inside the job (cluster.in_job_restarts): the srun line below runs the step "
            "again while it leaves RUN_DIR/RESTART",
            *_IN_JOB_RESTART_LOOP.format(restarts=int(restarts), mark=RESTART).splitlines()]


TASK_WRAPPER = Path(__file__).resolve().with_name("task_wrapper.sh")


def task_python(python: Optional[str] = None, wrapper: Optional[str] = None) -> str:
    """What starts Python in every task (submitit's ``python`` parameter, "command to
    launch python"): :data:`TASK_WRAPPER`, which starts it with the warning signal
    recorded rather than fatal until the harness's handler exists."""
    python = shlex.quote(sys.executable) if python is None else python
    return f"/bin/bash {shlex.quote(str(wrapper or TASK_WRAPPER))} {python}"


def submitit_command(folder: str | Path, python: Optional[str] = None, wrapper: Optional[str] = None) -> str:
    """The command submitit's SlurmExecutor puts after ``srun`` (with :func:`task_python`)."""
    return " ".join([task_python(python, wrapper), "-u -m submitit.core._submit", shlex.quote(str(folder))])


def mem_option(mem_gb: Optional[float]) -> Optional[str]:
    """sbatch's ``--mem`` value for a number of GB in submitit's spelling ("64GB",
    "512MB"); 0 stays "0", sbatch(1)'s "special case [that] grants the job access to all of
    the memory on each node"; None: no option (the site's default). Given as the string
    to both the dry run and ``SlurmExecutor.update_parameters``, which passes ``mem``
    through unconverted (a number there would be megabytes to sbatch)."""
    from submitit.slurm.slurm import _convert_mem

    if mem_gb is None:
        return None
    return "0" if mem_gb == 0 else _convert_mem(mem_gb)


# submitit's _make_sbatch_string writes "#SBATCH --wckey=submitit" unless wckey is None;
# a site that tracks wckeys (TrackWCKey) refuses a key it does not know.
NO_WCKEY = {"wckey": None}


def render(params: Dict[str, Any], folder: str | Path, python: Optional[str] = None,
           wrapper: Optional[str] = None) -> str:
    """The sbatch script for ``params`` (submitit parameter names, ``mem`` already spelt
    by :func:`mem_option`) and a submitit folder."""
    from submitit.slurm.slurm import _make_sbatch_string

    return _make_sbatch_string(command=submitit_command(folder, python, wrapper), folder=folder, **params)


def submit(call: TaskCall, folder: Path, params: Dict[str, Any], max_requeues: int, python: Optional[str] = None,
           wrapper: Optional[str] = None):
    """Submit one job through submitit's executor; the submitit Job (as soon as sbatch answers).
    ``python``, ``wrapper``: as for :func:`task_python` (a run's frozen code: launcher/snapshot.py)."""
    import submitit

    executor = submitit.SlurmExecutor(folder=folder, max_num_timeout=max_requeues, python=task_python(python, wrapper))
    executor.update_parameters(**params)
    return executor.submit(call)


def dump_delayed(call: TaskCall, path: Path, time_min: int, max_requeues: int) -> None:
    """Write the pickle submitit's job side loads for one element of a job array."""
    from submitit.core.utils import DelayedSubmission

    job = DelayedSubmission(call)
    job.set_timeout(time_min, max_requeues)
    job.dump(path)
