"""The one module that touches submitit beyond its documented API (``SlurmExecutor``).

It uses three private pieces, pinned by ``tests/test_submitit_adapter.py`` so that a
submitit upgrade fails that test, not a job:

- ``submitit.slurm.slurm._make_sbatch_string``: the batch script submitit submits, for the
  dry run and for job arrays whose folder submitit's executor refuses (``%a`` in it);
- ``submitit.slurm.slurm._convert_mem``: its ``mem`` spelling (:func:`mem_option`);
- ``submitit.core.utils.DelayedSubmission``: the pickle the job side loads, written here for
  job-array elements (``dump``) with submitit's requeue budget (``set_timeout``).

The step function of the batch script (:func:`step_loop`) also relies on the srun line's
last word being the job's folder, as submitit's executor writes it
(``_submitit_command_str``; the dry run's :func:`submitit_command` is tested equal to it).

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


# The training step. The last setup lines define `srun` as a function, so the srun line
# submitit writes after them (its last argument: the job's submitit folder, RUN_DIR/slurm,
# or SWEEP/.arrays/UID/%a for an element of a job array, a link to RUN_DIR/slurm) runs
# through it. It
# 1. writes RUN_DIR/slurm_job.txt once (the job's fields with EndTime in epoch seconds,
#    its partition's nodes: the tasks' time left and room for an exclusion);
# 2. runs the step in the background and, every second while it runs and once after it,
#    does what a task asked in RUN_DIR/SLURM_REQUEST (slurm/request.py: requeue, requeue
#    without nodes, cancel; taken by a rename, so done once): the tasks call no Slurm
#    client, and a dead node's step (srun waits for it until Slurm declares it DOWN) is
#    requeued at once. A request done ends the script: Slurm requeues or ends the job.
#    Before a requeue the step's srun is killed: one still waiting on a dead node was seen
#    to outlive the requeue and, timing out, cancel "step N.0" of the job id, by then the
#    requeued job's own first step (test_node_failure's job ended FAILED on its new nodes);
# 3. starts the step again while it left RUN_DIR/RESTART (a task's request: its failure
#    is one to restart; train/harness/restart.py) and restarts are left. srun returns
#    once every task of the step has ended, so the old step's processes are gone when the
#    next starts; STO_IN_JOB_RESTART numbers the starts (slurm.env.in_job_restart: the
#    rendezvous port follows it; unset for cluster.in_job_restarts=0: nothing restarts).
#    A task still running {grace} s (:func:`restart_grace_s`) after RESTART appeared is
#    one that cannot end by itself (a peer waiting in the rendezvous for a rank 0 that
#    failed to bind its port waits until train.dist_timeout_s): the loop ends the step
#    (scancel --signal=KILL of its newest step, in the background, and srun killed) and
#    starts the next. The teardown sees the last step's exit status.
# `wait -n` (bash >= 4.3) wakes at the step's end or after a second, whichever is first.
_STEP_LOOP = """\
sto_job=${{SLURM_ARRAY_JOB_ID:+${{SLURM_ARRAY_JOB_ID}}_${{SLURM_ARRAY_TASK_ID}}}}
sto_job=${{sto_job:-$SLURM_JOB_ID}}
sto_failed() {{
  echo "job $sto_job: scontrol $2 failed: $3" >&2
  {python} -m slurm.request failed "$@" || echo "job $sto_job: not recorded in run.json" >&2
}}
sto_kill_srun() {{  # the step's srun, $! (a subshell: srun is its child); /proc first, pkill if need be
  local kids; kids=$(cat /proc/"$1"/task/*/children 2>/dev/null) || kids=$(pgrep -P "$1" 2>/dev/null)
  kill -KILL $kids "$1" 2>/dev/null
}}
sto_end_step() {{  # $1: the step's srun ($!), $2: why
  local step
  step=$(sto_slurm squeue -h -s -j "$SLURM_JOB_ID" -o %i 2>/dev/null |
    sed -n 's/^[0-9_]*[.]\\([0-9][0-9]*\\)$/\\1/p' | sort -n | tail -n 1)  # the newest step: this srun's
  echo "$(date -u +%FT%TZ) $2: ending step ${{step:-?}} of job $sto_job" >&2
  # in the background: scancel answers after MessageTimeout when a node of the step is dead
  [ -n "$step" ] && {{ sto_slurm scancel --signal=KILL "$SLURM_JOB_ID.$step" 2>/dev/null & }}
  sto_kill_srun "$1"
}}
sto_request() {{
  local taken="$1/.{request}.taken" action nodes reason out
  [ -e "$1/{request}" ] && mv -f "$1/{request}" "$taken" 2>/dev/null || return 1
  action=$(sed -n 's/^action=//p' "$taken")
  nodes=$(sed -n 's/^exclude=//p' "$taken")
  reason=$(sed -n 's/^reason=//p' "$taken")
  echo "the step asks: $action job $sto_job${{nodes:+ without $nodes}} ($reason)" >&2
  if [ -n "$2" ] && [ "$action" != cancel ]; then  # the step's srun, still running: gone before the requeue
    sto_kill_srun "$2"; wait "$2" 2>/dev/null
  fi
  case $action in
    requeue) out=$(sto_slurm scontrol requeue "$sto_job" 2>&1) || {{ sto_failed "$1" requeue "$out"; return 1; }} ;;
    exclude)
      trap '' TERM  # the hold-requeue's SIGTERM must not end this script before the release
      out=$(sto_slurm scontrol requeuehold "$sto_job" 2>&1) || {{ sto_failed "$1" requeuehold "$out"; trap - TERM; return 1; }}
      out=$(sto_slurm scontrol update "JobId=$sto_job" "ExcNodeList=$nodes" 2>&1) || sto_failed "$1" update "$out"
      out=$(sto_slurm scontrol release "$sto_job" 2>&1) || sto_failed "$1" release "$out" ;;
    cancel) out=$(sto_slurm scancel "$sto_job" 2>&1) || {{ echo "scancel $sto_job failed: $out" >&2; return 1; }} ;;
    *) echo "job $sto_job: unknown request $action" >&2; return 1 ;;
  esac
}}
srun() {{
  local folder="${{@: -1}}" code i=0 pid waited
  local dir="${{folder//%a/$SLURM_ARRAY_TASK_ID}}/.."
  {{ SLURM_TIME_FORMAT=%s sto_slurm scontrol show job -o "$SLURM_JOB_ID"
    sto_slurm sinfo -h -N -p "$SLURM_JOB_PARTITION" -o '%N|%t|%f'; }} 2>/dev/null > "$dir/{facts}"
  while :; do
    rm -f "$dir/{restart}" "$dir/{request}"
    {restart_env}sto_slurm srun "$@" &
    pid=$! waited=0
    while kill -0 "$pid" 2>/dev/null; do
      sleep 1 & wait -n
      kill $! 2>/dev/null
      sto_request "$dir" "$pid" && exit 0
      [ -e "$dir/{restart}" ] && waited=$((waited + 1))
      [ "$waited" -ge {grace} ] &&
        {{ sto_end_step "$pid" "a task still runs {grace} s after the restart was asked"; break; }}
    done
    wait "$pid"
    code=$?
    sto_request "$dir" && exit 0
    [ "$code" -ne 0 ] && [ -e "$dir/{restart}" ] && [ "$i" -lt {restarts} ] || return "$code"
    i=$((i + 1))
    echo "$(date -u +%FT%TZ) the step failed (exit $code; $(cat "$dir/{restart}")):" \\
      "restart $i of {restarts} inside job $sto_job" >&2
  done
}}"""


# With hot spares (cluster.spare_nodes=K: sbatch --nodes=N+K --no-kill), lines added to
# the step function above (K=0 renders it unchanged). Every srun asks for the N training
# nodes (--nodes, --ntasks: srun would take the job's N+K from the batch environment) with
# --overlap, and --exclude for the nodes the job's restarts dropped: the old step's record
# holds its CPUs until Slurm hears from its dead node (seen with Slurm 22.05: without
# --overlap the next step waits for that). A restart that drops nodes (RESTART's line
# `exclude=NODES`: every node dropped in this job so far, train/harness/restart.py) ends
# the old srun itself two polls after the request (its surviving tasks have recorded and
# exit by then): srun would wait for the dead node's tasks until Slurm declares the node
# DOWN (SlurmdTimeout), and `scancel --signal=KILL` of the step ends anything left of it
# (in the background: it answers only after MessageTimeout, waiting for the dead node).
_SPARE_FUNCTIONS = """\
sto_drop=  # the nodes this job's restarts dropped (RESTART's exclude=): srun --exclude"""
_SPARE_EDITS = (
    ("srun() {{\n  local folder=\"${{@: -1}}\" code i=0 pid waited",
     "srun() {{\n  local folder=\"${{@: -1}}\" code i=0 pid waited drop"),
    ("    {restart_env}sto_slurm srun \"$@\" &",
     "    {restart_env}sto_slurm srun --nodes={nodes} --ntasks={ntasks} --overlap ${{sto_drop:+--exclude=$sto_drop}} "
     "\"$@\" &"),
    # RESTART is written whole (os.replace), its exclude= line with it: two polls that saw it
    ("      [ -e \"$dir/{restart}\" ] && waited=$((waited + 1))\n",
     "      [ -e \"$dir/{restart}\" ] && waited=$((waited + 1))\n"
     "      [ \"$waited\" -ge 2 ] && grep -q '^exclude=.' \"$dir/{restart}\" 2>/dev/null && "
     "{{ sto_end_step \"$pid\" \"the step asks for a restart without $(sed -n 's/^exclude=//p' \"$dir/{restart}\")\"; "
     "break; }}\n"),
    ("    i=$((i + 1))\n",
     "    i=$((i + 1))\n    drop=$(sed -n 's/^exclude=//p' \"$dir/{restart}\")\n    sto_drop=${{drop:-$sto_drop}}\n"),
)


def restart_grace_s(heartbeat_s: float) -> int:
    """Seconds the step loop lets a step's tasks end by themselves once a restart was
    asked: a peer of the failing rank classifies the failure first (three heartbeats,
    ``train.harness.watchdog.classify_failure``), then records it; 30 s beyond that."""
    return 30 + 3 * math.ceil(max(0.0, heartbeat_s))


def step_loop(restarts: int, python: Optional[str] = None, spares: int = 0, nodes: int = 1,
              tasks_per_node: int = 1, grace_s: int = 60) -> list[str]:
    """The batch script's last setup lines for a training job: the step function above,
    with ``cluster.in_job_restarts=restarts`` (0: the step runs once) and ``python`` (as
    for :func:`task_python`) to record a failed Slurm call in run.json. ``spares``
    (``cluster.spare_nodes``) > 0: the step runs on ``nodes`` of the job's nodes with
    ``tasks_per_node`` tasks each, and a restart can drop nodes (:data:`_SPARE_EDITS`).
    ``grace_s``: how long a task may outlive the restart's request (:func:`restart_grace_s`)."""
    python = shlex.quote(sys.executable) if python is None else python
    template = _STEP_LOOP
    if spares > 0:
        template = template.replace("\nsrun() {{", "\n" + _SPARE_FUNCTIONS + "\nsrun() {{", 1)
        for old, new in _SPARE_EDITS:
            if old not in template:
                raise AssertionError(f"step loop template changed: {old!r} not found")
            template = template.replace(old, new, 1)
    head = ("# the training step (slurm/submitit_adapter.step_loop): does what its tasks ask of Slurm "
            "(RUN_DIR/SLURM_REQUEST), runs it again while it leaves RUN_DIR/RESTART "
            f"(cluster.in_job_restarts={int(restarts)})")
    if spares > 0:
        head += f" on {int(nodes)} of the job's nodes (cluster.spare_nodes={int(spares)})"
    return [head, *template.format(restarts=int(restarts), restart=RESTART, request=SLURM_REQUEST, facts=SLURM_JOB,
                                   python=python, restart_env="STO_IN_JOB_RESTART=$i " if int(restarts) > 0 else "",
                                   nodes=int(nodes), ntasks=int(nodes) * int(tasks_per_node),
                                   grace=int(grace_s)).splitlines()]


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
