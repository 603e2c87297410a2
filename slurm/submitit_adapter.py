"""The one module that touches submitit beyond its documented API (``SlurmExecutor``).

It uses three private pieces, pinned by ``tests/test_submitit_adapter.py`` so that a
submitit upgrade fails that test, not a job:

- ``submitit.slurm.slurm._make_sbatch_string``: the batch script submitit submits, for the
  dry run and for job arrays whose folder submitit's executor refuses (``%a`` in it);
- ``submitit.slurm.slurm._convert_mem``: its ``mem`` spelling (:func:`mem_option`);
- ``submitit.core.utils.DelayedSubmission``: the pickle the job side loads, written here for
  job-array elements (``dump``) with submitit's requeue budget (``set_timeout``).

The step function of the batch script (slurm/step_loop.sh, sourced by :func:`step_loop`'s
lines) also relies on the srun line's last word being the job's folder, as submitit's
executor writes it (``_submitit_command_str``; the dry run's :func:`submitit_command` is
tested equal to it).

What a task runs is a :class:`TaskCall`: a function named by ``"module:function"`` and its
arguments, imported when the task calls it, so the login side never imports the compute side.
"""
from __future__ import annotations

import importlib
import math
import shlex
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Dict, Optional, Tuple

from spec.rundir import RESTART, SLURM_JOB, SLURM_REQUEST


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


# The batch script's first lines after the site's setup (cluster.setup), before cluster.env
# (which may set the tasks' PATH to one without Slurm's client, as a container's is):
# `sto_slurm CMD ARGS` runs Slurm's CMD as found on the PATH of that moment (every job).
_SLURM_CLIENT = """\
sto_slurm_path=$PATH  # Slurm's client as found before cluster.env: the tasks need none (slurm/request.py)
sto_slurm() { local cmd; cmd=$(PATH=$sto_slurm_path; type -P "$1") || cmd=$1; shift; command "$cmd" "$@"; }"""


def slurm_client_lines() -> list[str]:
    """Setup lines that keep Slurm's client at hand for the batch script itself."""
    return _SLURM_CLIENT.splitlines()


# Lines after srun in the batch script: a step whose tasks died of the warning signal
# (srun exits 128 + 12 = 140) before any handler existed, as Python started, is requeued
# while requeues are left, rather than ending FAILED (Slurm may send --signal's warning up
# to 60 s early, so it can come during start-up).
_REQUEUE_IF_SIGNALLED = """\
code=$?
if [ "$code" -eq 140 ] && [ "${{SLURM_RESTART_COUNT:-0}}" -lt {max_requeues} ]; then
  echo "a step died of the warning signal (USR2) before its handler: requeueing job $sto_job" >&2
  sto_slurm scontrol requeue "$sto_job" && exit 0
fi
exit $code"""


def requeue_if_signalled(max_requeues: int) -> list[str]:
    """The batch script's teardown lines (submitit's ``teardown`` parameter; after
    :func:`step_loop`'s lines, whose ``sto_job`` they use)."""
    return _REQUEUE_IF_SIGNALLED.format(max_requeues=int(max_requeues)).splitlines()


# The training step's loop: slurm/step_loop.sh (what it does, and why, is written there),
# sourced by the batch script after the lines that set its parameters.
STEP_LOOP = Path(__file__).resolve().with_name("step_loop.sh")


def restart_grace_s(heartbeat_s: float) -> int:
    """Seconds the step loop lets a step's tasks end by themselves once a restart was
    asked: a peer of the failing rank classifies the failure first (three heartbeats,
    ``train.harness.watchdog.classify_failure``), then records it; 30 s beyond that."""
    return 30 + 3 * math.ceil(max(0.0, heartbeat_s))


def step_loop(restarts: int, python: Optional[str] = None, spares: int = 0, nodes: int = 1,
              tasks_per_node: int = 1, grace_s: int = 60, wrapper: Optional[str] = None, agent: int = 0,
              allocation: bool = False) -> list[str]:
    """The batch script's last setup lines for a training job: the parameters of the step's
    loop (:data:`STEP_LOOP`) and the line that sources it, with
    ``cluster.in_job_restarts=restarts`` (0: the step runs once) and ``python`` (as for
    :func:`task_python`) to record a failed Slurm call in run.json. ``spares``
    (``cluster.spare_nodes``) > 0: the step runs on ``nodes`` of the job's nodes with
    ``tasks_per_node`` tasks each, and a restart can drop nodes. ``grace_s``: how long a task
    may outlive the restart's request (:func:`restart_grace_s`). ``wrapper``: the task wrapper
    of the job's code (:func:`task_python`'s; a run's frozen copy, launcher/snapshot.py): the
    loop sourced is the one beside it, so a requeued job runs the loop it was submitted with.
    ``agent`` > 0: srun starts one agent a node that forks that many ranks (exported as
    STO_AGENT, which marks the task: train/harness/agent.py); 0: one srun task a rank.
    ``allocation``: the script runs inside an allocation the user holds (STO_ALLOCATION: its
    srun asks the run's ``nodes`` and tasks, nothing requeues or cancels the allocation)."""
    python = shlex.quote(sys.executable) if python is None else python
    loop = Path(wrapper).with_name(STEP_LOOP.name) if wrapper else STEP_LOOP
    head = ("# the training step (slurm/step_loop.sh): does what its tasks ask of Slurm "
            "(RUN_DIR/SLURM_REQUEST), runs it again while it leaves RUN_DIR/RESTART "
            f"(cluster.in_job_restarts={int(restarts)})")
    spare = ""
    if spares > 0:
        head += f" on {int(nodes)} of the job's nodes (cluster.spare_nodes={int(spares)})"
    if spares > 0 or allocation:
        spare = f" STO_STEP_NODES={int(nodes)} STO_STEP_NTASKS={int(nodes) * int(tasks_per_node)}"
    if allocation:
        head += "; inside an allocation the user holds (cluster.allocation=auto): no requeue"
        spare += " STO_ALLOCATION=1"
    agents = [f"export STO_AGENT={int(agent)}  # one task a node: the agent forks its {int(agent)} ranks "
              "(train/harness/agent.py)"] if agent > 0 else []
    return [head, *agents,
            f"STO_RESTARTS={int(restarts)} STO_GRACE_S={int(grace_s)} STO_PYTHON={shlex.quote(python)}",
            f"STO_REQUEST={shlex.quote(SLURM_REQUEST)} STO_RESTART={shlex.quote(RESTART)} "
            f"STO_FACTS={shlex.quote(SLURM_JOB)} STO_SPARES={int(spares)}{spare}",
            f". {shlex.quote(str(loop))} || exit 1"]


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
