"""What a job's tasks ask of Slurm about their own job, done by the batch script: no task
calls a Slurm client.

Slurm's client (scontrol, squeue, sacct, scancel, sinfo) is often missing where the tasks
run (a pyxis container image), while the batch script runs outside any container, where
sbatch started it. So under Slurm every call about the job itself goes through the batch
script's step function (``slurm/step_loop.sh``, which the script sources), the one place
that acts on the job:

- A task that wants the job requeued (after a preemption's or a time limit's checkpoint:
  train/harness/outcome.py), requeued without nodes (train/harness/badnodes.py) or
  cancelled first records in run.json what it decided, then writes
  ``RUN_DIR/SLURM_REQUEST`` (:func:`ask`). The batch script looks for it every second
  while the step runs and once after it, takes it (a rename: acted on once) and runs
  ``scontrol requeue``; ``scontrol requeuehold``, ``update ExcNodeList``, ``release``;
  or ``scancel``. A Slurm call that fails is written to run.json by
  ``python -m slurm.request failed RUN_DIR CALL ERROR`` (:func:`record_failure`) where
  the batch script's host has the tasks' Python (not in a container whose Python only
  the image has: then only the job's log, ``slurm/JOB_0_log.err``, says it).
- A step that failed without a task's request (one died of a signal or exited non-zero
  and srun's ``--kill-on-bad-exit`` ended the others before they recorded it) is recorded
  from srun's own report (:func:`srun_report`, read from the batch script's stderr) by
  ``python -m train.harness.restart after-srun``, which restarts it by the tasks' rules.
- Before a segment's first srun the batch script writes ``RUN_DIR/slurm_job.txt``:
  ``scontrol show job -o`` (EndTime in epoch seconds: the time limit, which tells a
  timeout from a preemption: :func:`seconds_left`) and its partition's nodes as
  ``sinfo -N`` lists them (whether the job still fits without excluded nodes:
  :func:`job_facts`).

Local runs and torchrun have no batch script and ask nothing.
"""
from __future__ import annotations

import os
import re
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Dict, Iterable, List, Mapping, Optional

from slurm.query import parse_job_fields, parse_usable_nodes
from spec.rundir import SLURM_JOB, SLURM_REQUEST, Status, update_run_json

ACTIONS = ("requeue", "exclude", "cancel")
_NODE_LIST = re.compile(r"^[\w.\[\],-]*$")


def ask(run_dir: str | Path, action: str, reason: str, exclude: Iterable[str] = ()) -> Path:
    """Ask the batch script to ``action`` the job (``exclude``: the nodes its ExcNodeList
    gets); ``reason`` (one line) goes to the job's log. Replaces an earlier request of
    the step. The request file."""
    if action not in ACTIONS:
        raise ValueError(f"unknown request {action!r}; one of {', '.join(ACTIONS)}")
    nodes = ",".join(sorted(exclude))
    if not _NODE_LIST.match(nodes):
        raise ValueError(f"not a node list: {nodes!r}")
    path = Path(run_dir) / SLURM_REQUEST
    tmp = path.with_name(f".{SLURM_REQUEST}.{os.getpid()}.tmp")
    tmp.write_text(f"action={action}\nexclude={nodes}\nreason={' '.join(str(reason).split())}\n")
    os.replace(tmp, path)
    return path


def read_request(path: str | Path) -> Dict[str, str]:
    """A request file's fields (action, exclude, reason), as the batch script reads them."""
    fields: Dict[str, str] = {}
    for line in Path(path).read_text().splitlines():
        key, sep, value = line.partition("=")
        if sep:
            fields.setdefault(key, value)
    return fields


@dataclass
class JobFacts:
    """``RUN_DIR/slurm_job.txt``: the job's ``scontrol show job`` fields and the usable
    nodes of its partition (node -> its features), as the segment's batch script saw them."""

    fields: Dict[str, str] = field(default_factory=dict)
    usable: Dict[str, str] = field(default_factory=dict)


def job_facts(run_dir: str | Path) -> Optional[JobFacts]:
    """What the batch script wrote for this segment; None without the file (not a job of
    this project's batch script, or not under Slurm)."""
    try:
        lines = (Path(run_dir) / SLURM_JOB).read_text().splitlines()
    except OSError:
        return None
    job = next((line for line in lines if line.startswith("JobId=")), "")
    return JobFacts(parse_job_fields(job), parse_usable_nodes("\n".join(lines)))


def seconds_left(run_dir: str | Path, env: Optional[Mapping[str, str]] = None,
                 now: Optional[float] = None) -> Optional[float]:
    """Seconds before the job's time limit, or None when unknown: Slurm's
    SLURM_JOB_END_TIME where it sets it, else the EndTime the batch script wrote."""
    env = os.environ if env is None else env
    end = env.get("SLURM_JOB_END_TIME", "")
    if not end.isdigit():
        facts = job_facts(run_dir)
        end = facts.fields.get("EndTime", "") if facts else ""
    if not end.isdigit():
        return None
    return float(end) - (time.time() if now is None else now)


# run.json after a Slurm call of the batch script failed, by the call (its error text last).
_FAILED = {
    "requeue": lambda error: {"status": Status.INTERRUPTED, "requeue_error": error},
    "requeuehold": lambda error: {"status": Status.FAILED, "requeue_error": error,
                                  "auto_requeue": f"requeue failed: {error}"},
    "update": lambda error: {"requeue_error": f"requeued without the exclusion: {error}"},
    "release": lambda error: {"requeue_error": f"job left held: `scontrol release` failed: {error}"},
}


def record_failure(run_dir: str | Path, call: str, error: str) -> None:
    """run.json once the batch script's ``call`` failed with ``error``: a requeue that did
    not happen leaves the run ``interrupted`` (a preemption's) or ``failed`` (an
    exclusion's), as when a task called scontrol itself."""
    fields = _FAILED.get(call)
    if fields is not None:
        update_run_json(run_dir, **fields(" ".join(error.split()) or f"scontrol {call} failed"))


# srun's line for tasks that ended badly (srun(1) of Slurm 22.05 prints one per node and
# outcome as the exits reach it): "srun: error: node2: task 3: Killed", "... tasks 0-1:
# Exited with exit code 1", "... task 5: Segmentation fault (core dumped)", "... task 2:
# Out Of Memory". With --kill-on-bad-exit the first is the task that died; then srun
# "Terminating StepId=J.S" sends its peers SIGTERM (SIGKILL after KillWait) and reports
# them "Terminated" (seen with Slurm 22.05; srun exits 143 then).
_SRUN_TASKS = re.compile(r"^srun: error: (?P<node>[^:\s]+): tasks? (?P<tasks>\d[\d,-]*): (?P<what>.+?)\s*$")
_EXIT = re.compile(r"^Exited with exit code (\d+)$")


def srun_report(text: str) -> Optional[Dict[str, Any]]:
    """What srun's stderr ``text`` (the step's part of the batch script's log) says of the
    first task that ended badly: its ``task`` (SLURM_PROCID), ``node``, ``signal`` (a
    name: SIGKILL, SIGSEGV, ...; an OOM kill is SIGKILL with ``oom``; an exit code of
    128 + N is signal N, as a shell reports its child's) and ``exit_code``, and srun's
    ``line``; None when srun named no task."""
    import signal

    names = {signal.strsignal(s).lower(): s.name for s in signal.Signals if signal.strsignal(s)}
    for line in text.splitlines():
        found = _SRUN_TASKS.match(line.strip())
        if found is None:
            continue
        what = found["what"].removesuffix(" (core dumped)")
        report: Dict[str, Any] = {"task": int(re.split(r"[,-]", found["tasks"])[0]), "node": found["node"],
                                  "signal": None, "exit_code": None, "line": line.strip()}
        code = _EXIT.match(what)
        if code:  # 128 + N: the task wrapper's (slurm/task_wrapper.sh) Python died of signal N
            report["exit_code"] = int(code.group(1))
            if report["exit_code"] - 128 in signal.valid_signals():
                report["signal"] = signal.Signals(report["exit_code"] - 128).name
        elif what.lower() == "out of memory":
            report.update(signal="SIGKILL", oom=True)
        else:
            report["signal"] = names.get(what.lower(), what)
        return report
    return None


def read_from(path: str | Path, offset: int, limit: int = 1 << 20) -> str:
    """The text of ``path`` from byte ``offset`` on (at most ``limit`` bytes); "" when it
    cannot be read (the batch script's stderr is not a file outside sbatch)."""
    try:
        with open(path, "rb") as f:
            f.seek(max(0, int(offset)))
            return f.read(limit).decode("utf-8", "replace")
    except (OSError, ValueError):
        return ""


def main(argv: List[str]) -> int:
    """``python -m slurm.request failed RUN_DIR CALL ERROR`` (the batch script's)."""
    if len(argv) < 3 or argv[0] != "failed":
        print("usage: python -m slurm.request failed RUN_DIR CALL ERROR", file=sys.stderr)
        return 2
    record_failure(argv[1], argv[2], " ".join(argv[3:]))
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
