"""Restarts inside the job (``cluster.in_job_restarts``): a failure costs seconds, not a
place in the queue.

1. The batch script runs the training step in a loop
   (``slurm/step_loop.sh``): the k-th srun of the job gets
   ``STO_IN_JOB_RESTART=k`` (:attr:`spec.identity.TaskIdentity.in_job_restart`; the
   rendezvous port follows it, :func:`slurm.env.rendezvous_port`).
2. A task whose workload failed records the failure first
   (:func:`train.harness.outcome.record_failure`; a hang: the watchdog's report), then
   asks :func:`request`: under run.json's lock, :func:`slurm.states.restart_refusal`
   decides from the failure that stands (a rank's own error outranks its peers' broken
   connections). A restart makes run.json's status ``restarting``, appends an entry to
   its ``in_job_restarts`` (job, segment, reason, error, step, failing rank and node,
   time) and writes ``RUN_DIR/RESTART``; a refusal is written to ``in_job_restart`` and the failure takes
   today's path (an exclusion requeue, or the run ends ``failed``). The first task to ask
   in a segment decides the restart; the others find its entry.
3. Every task of the step exits (the failing rank, its peers on their broken
   connections, all of them on a hang); srun returns; the batch script finds the file,
   removes it and starts srun again while its own count allows. The new segment resumes
   from the last committed checkpoint, same job id, ``SLURM_RESTART_COUNT`` unchanged.
   With hot spares (``cluster.spare_nodes``), a failure that blames nodes (a dead node,
   a hardware fault) is restarted too, without those nodes, while the spares cover every
   node this job dropped: the entry's ``dropped_nodes``, RESTART's ``exclude=`` line for
   the step loop's ``srun --exclude`` (which ends the old step itself: srun would wait
   for the dead node until Slurm declares it DOWN), ``excluded_nodes`` in run.json.
4. The new segment's rank 0 notes ``restarted_at`` and ``downtime_s`` (failure to the
   new segment's start: :func:`note_start`) and, at its first metrics row,
   ``seconds_lost`` (:func:`note_first_row`): how much later the run did that step than
   it would have without the failure (the work redone plus the time down).

A task that dies without a word (SIGKILL, the OOM killer, a segfault, SIGABRT) asks
nothing, and srun's ``--kill-on-bad-exit`` ends its peers at once (SIGTERM, SIGKILL after
Slurm's KillWait), before they could record it. The step loop then calls ``python -m train.harness.restart after-srun``
(:func:`after_srun`): run.json gets the failure as srun reported it (``rank_failure``:
the task, its node, the signal or exit code) and the same rules decide the restart.
"""
from __future__ import annotations

import json
import os
import signal
import socket
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Dict, List, Mapping, Optional

from slurm.env import AGENT_ENV, expand_hostlist, slurm_job_id
from slurm.request import read_from, srun_report
from slurm.states import restart_refusal
from spec.config import to_run_config
from spec.identity import TaskIdentity
from spec.rundir import (CONFIG, ENTRYPOINT, EXCLUDING_FAILURES, RESTART, Status, change_run_json, read_metrics,
                         read_run_json, status_of, update_run_json)
from train.harness.badnodes import write_exclude
from train.harness.node_facts import slurm_names


@dataclass
class Restart:
    """What a task's failure asks of the job's step loop: its run, ``cluster.in_job_restarts``,
    the task, its segment and its watchdog (the step it failed in, and whether the run
    had done a step: the built-in trainer reports every step and begins at the step it
    restored; a user's code only when it calls ``train.session.log``)."""

    run_dir: Path
    budget: int
    identity: TaskIdentity
    segment: int
    watchdog: Any  # train.harness.watchdog.Watchdog
    steps_known: bool = True  # False: a user's code (steps seen only through session.log)
    spares: Optional[int] = None  # cluster.spare_nodes (None: the run's config.yaml says)

    def ask(self, log: Callable[[str], None], rank: Optional[int] = None, node: Optional[str] = None) -> bool:
        """:func:`request` for this task's failure (``rank``/``node``: a hang's stuck rank)."""
        w = self.watchdog
        started = (w.warm or w.step > 0) if self.steps_known else (True if w.warm else None)
        return request(self.run_dir, self.budget, self.identity, self.segment, w.step + 1, started, log, rank, node,
                       self.spares)


def request(run_dir: Path, budget: int, identity: TaskIdentity, segment: int, step: int, started: Optional[bool],
            log: Callable[[str], None], rank: Optional[int] = None, node: Optional[str] = None,
            spares: Optional[int] = None, culprit: Optional[Dict[str, Any]] = None) -> bool:
    """After this task recorded a failure of segment ``segment`` at ``step``: True when the
    job restarts it (this task's request, or another task's of the segment). ``rank``,
    ``node``: the failing rank and its host when not this task's own (a hang's stuck rank).
    ``spares``: ``cluster.spare_nodes`` (None: as the run's config.yaml says); a failure
    that blames nodes (a dead node, a hardware fault: :data:`spec.rundir.EXCLUDING_FAILURES`)
    restarts without them while the job's spares cover every node its restarts dropped
    (:func:`dropped_nodes`). ``culprit``: the entry's rank, node, ... from srun (:func:`after_srun`).
    False without a step loop (a job submitted without one, torchrun, a local run)."""
    if identity.in_job_restart is None:
        return False
    job, srun = identity.job_id, identity.in_job_restart  # srun: which start of the step in this job
    decided: Dict[str, Any] = {}
    spares = _spare_nodes(run_dir) if spares is None else spares

    def change(info: Dict[str, Any]) -> Optional[Dict[str, Any]]:
        entries: List[Dict[str, Any]] = list(info.get("in_job_restarts") or [])
        if any((e.get("job_id"), e.get("segment"), e.get("srun", srun)) == (job, segment, srun) for e in entries):
            decided["restart"] = True  # another task of this segment asked first; this one's record
            return {"status": Status.RESTARTING} if status_of(info) is Status.FAILED else None  # undone
        if status_of(info) is not Status.FAILED:  # requeued without a node, or already over
            return None
        error = str(info.get("error") or "")
        drop = dropped_nodes(info, entries, job, spares, lambda hosts: slurm_names(run_dir, hosts))
        why = restart_refusal(entries, info.get("failure"), error, step, job, budget, started, spare=drop is not None)
        if why is not None:
            decided["why"] = why
            return {"in_job_restart": f"not restarted: {why}"}
        entry = {"job_id": job, "segment": segment, "srun": srun, "reason": info.get("failure") or "error",
                 "error": error, "step": step, **(culprit or _culprit(info, identity, rank, node)),
                 "failed_at": time.time(), "restarted_at": None, "seconds_lost": None}
        fields: Dict[str, Any] = {}
        if drop is not None:  # a spare takes the blamed nodes' place (the step loop's srun --exclude)
            entry.update(dropped_nodes=drop[0], excluded_in_job=drop[1], spares_left=spares - len(drop[1]))
            fields["excluded_nodes"] = sorted(set(info.get("excluded_nodes") or []) | set(drop[0]))
        decided.update(restart=True, entry=entry)
        used = sum(1 for e in entries if e.get("job_id") == job) + 1
        return {"status": Status.RESTARTING, "in_job_restarts": entries + [entry], **fields,
                "in_job_restart": f"restart {used} of {budget} in job {job}" + (
                    f" without {','.join(drop[0])} (a spare in its place)" if drop else "")}

    change_run_json(run_dir, change)
    if "entry" in decided:
        path = Path(run_dir) / RESTART
        tmp = path.with_name(f".{RESTART}.{os.getpid()}.tmp")
        entry = decided["entry"]
        # `exclude=`: every node this job's restarts dropped, for the step loop's srun --exclude
        tmp.write_text(json.dumps(entry) + "\n" + (f"exclude={','.join(entry['excluded_in_job'])}\n"
                                                    if entry.get("excluded_in_job") else ""))
        os.replace(tmp, path)
        if entry.get("dropped_nodes"):  # a later resume (a new job) avoids them too
            write_exclude(run_dir, sorted(set(entry["excluded_in_job"]) | set(
                expand_hostlist(to_run_config(Path(run_dir) / CONFIG).cluster.exclude or ""))))
        log(f"segment {segment} failed at step {step}: the job starts its ranks again "
            f"(cluster.in_job_restarts={budget}; run.json in_job_restarts)")
    elif "why" in decided:
        log(f"not restarted inside the job: {decided['why']}")
    return bool(decided.get("restart"))


def dropped_nodes(info: Mapping[str, Any], entries: List[Dict[str, Any]], job: str, spares: int,
                  names: Callable[[List[str]], List[str]]) -> Optional[tuple]:
    """(nodes this restart drops, every node this job's restarts dropped) when run.json's
    ``info`` blames nodes for its failure and ``spares`` cover them all, else None.
    ``names``: Slurm's names of the hosts the ranks saw (node_facts.slurm_names)."""
    if spares <= 0 or (info.get("failure") or "") not in EXCLUDING_FAILURES or not info.get("suspect_nodes"):
        return None
    bad = sorted(set(names(list(info["suspect_nodes"]))))
    before = {n for e in entries if e.get("job_id") == job for n in e.get("dropped_nodes") or []}
    every = sorted(before | set(bad))
    return (bad, every) if len(every) <= spares else None


def _spare_nodes(run_dir: Path) -> int:
    """``cluster.spare_nodes`` of the run's config.yaml, read only when run.json's failure
    blames nodes (0 otherwise, or without a config: a test's run directory)."""
    if read_run_json(run_dir).get("failure") not in EXCLUDING_FAILURES:
        return 0
    try:
        return to_run_config(Path(run_dir) / CONFIG).cluster.spare_nodes
    except Exception:  # noqa: BLE001 - no config: no spares; today's path takes the failure
        return 0


def requested(run_dir: str | Path) -> bool:
    """Whether this step asked the job to start its ranks again (RUN_DIR/RESTART: the batch
    script removes it before each srun)."""
    return (Path(run_dir) / RESTART).is_file()


def _culprit(info: Mapping[str, Any], identity: TaskIdentity, rank: Optional[int], node: Optional[str]
             ) -> Dict[str, Any]:
    """The failing rank and its node: as given (a hang's stuck rank), else the rank whose
    own error stands (``failed_rank``), else the first dead rank, else this task."""
    if rank is not None:
        return {"rank": rank, "node": node}
    if info.get("failed_rank") is not None:
        return {"rank": info["failed_rank"], "node": info.get("failed_node")}
    if info.get("dead_ranks"):
        return {"rank": info["dead_ranks"][0], "node": (info.get("dead_hosts") or [None])[0]}
    return {"rank": identity.rank, "node": socket.gethostname()}


def _open(info: Mapping[str, Any], job: str, key: str) -> List[int]:
    """Indices of this job's in_job_restarts entries, from the newest back, whose ``key``
    is still unset: the last restart's, and those of the starts before it that never
    began a segment (a rendezvous that failed)."""
    entries = info.get("in_job_restarts") or []
    found = []
    for i in range(len(entries) - 1, -1, -1):
        if entries[i].get("job_id") != job or entries[i].get(key) is not None:
            break
        found.append(i)
    return found


def note_start(run_dir: Path, identity: TaskIdentity) -> None:
    """Rank 0 of a segment the step loop (or the node agents) restarted: ``restarted_at`` of its entry."""
    if not identity.in_job_restart:
        return

    def change(info: Dict[str, Any]) -> Optional[Dict[str, Any]]:
        found = _open(info, identity.job_id, "restarted_at")
        if not found:
            return None
        entries, now = [dict(e) for e in info["in_job_restarts"]], time.time()
        for i in found:
            entries[i]["restarted_at"] = now
            entries[i]["downtime_s"] = round(now - float(entries[i].get("failed_at") or now), 3)
        return {"in_job_restarts": entries}

    change_run_json(run_dir, change)


def note_first_row(run_dir: Path, identity: TaskIdentity, row: Mapping[str, Any]) -> None:
    """Rank 0, the first metrics row of a restarted segment (step k+1 after restoring step
    k): ``seconds_lost`` of its entry, how much later the run did step k+1 than it would
    have without the failure: this row's time less (the earlier segments' row of step k
    plus this step's time). That is the work redone plus the time down. Without an
    earlier row of step k: the time from the failure to this row."""
    if not identity.in_job_restart or row.get("time") is None:
        return
    now, step = float(row["time"]), row.get("step")
    before = [r.get("time") for r in read_metrics(run_dir) if r.get("step") == step - 1
              and r.get("time") is not None and r.get("segment") != row.get("segment")]
    due = before[-1] + float(row.get("step_time_s") or 0.0) if before else None

    def change(info: Dict[str, Any]) -> Optional[Dict[str, Any]]:
        found = _open(info, identity.job_id, "seconds_lost")
        if not found:
            return None
        entries = [dict(e) for e in info["in_job_restarts"]]
        first = found[-1]  # the failure that began the chain: the whole loss is its (0 for the starts after it)
        since = due if due is not None else entries[first].get("failed_at")
        for i in found:
            entries[i]["seconds_lost"] = 0.0 if i != first else (round(now - float(since), 3) if since is not None
                                                                  else None)
        return {"in_job_restarts": entries}

    change_run_json(run_dir, change)


# Signals with which Slurm or the job itself ends a step's tasks: the warning signal before
# its handler (the batch script's teardown requeues that), SIGTERM (scancel, a time limit;
# also what srun's --kill-on-bad-exit sends the peers of a task that died, which srun
# reports after that task's own end), an interrupt, a hangup. Not a failure to restart.
_SLURMS = (signal.SIGUSR2, signal.SIGTERM, signal.SIGINT, signal.SIGHUP)
# run.json statuses while a step's tasks have recorded no end of theirs.
_UNRECORDED = (Status.SUBMITTED, Status.RUNNING, Status.RESTARTING)


def after_srun(run_dir: Path, code: int, srun: int, budget: int, job: str, report: Optional[Dict[str, Any]],
               log: Callable[[str], None], detected_by: str = "srun") -> bool:
    """The step loop's call once srun ended with ``code`` and no task asked anything (no
    RUN_DIR/RESTART, no request). srun's ``report`` (:func:`slurm.request.srun_report`)
    names the first task that ended badly: when it died by itself (SIGKILL, the OOM
    killer, a segfault, SIGABRT, a non-zero exit), srun's --kill-on-bad-exit ended its
    peers with SIGTERM before any recorded it, or as a cancelled job's (a user's code
    records ``interrupted``), or after it recorded its failure but before it decided.
    run.json then gets the failure as srun names it (``rank_failure``: the task, its
    node, the signal or exit code) unless a task recorded its own, and :func:`request`'s
    rules decide (never before the run's first step, nor twice for the same error at the
    same step). ``srun``: which start of the step this was; ``budget``:
    ``cluster.in_job_restarts``; ``job``: the job's id. True when RESTART was written.
    ``detected_by``: "agent" when a node's agent saw its rank end (train/harness/agent.py:
    ``report`` is its, at once), "srun" when the step loop read srun's report."""
    culprit = srun_culprit(report, code, detected_by)
    if code == 0 or culprit["signal"] in {s.name for s in _SLURMS}:
        return False  # ended from outside (scancel, the time limit, the warning signal), or not at all
    info = read_run_json(run_dir)
    status, ours = status_of(info), str(info.get("job_id")) == str(job)
    if status is Status.RESTARTING and any((e.get("job_id"), e.get("srun")) == (job, srun)
                                           for e in info.get("in_job_restarts") or []):
        return False  # this start's restart is decided: a rank ending now is one of its echoes
    # a user's code takes the SIGTERM srun sent its peers for a scancel: not one when a task died first
    echo = status is Status.INTERRUPTED and ours and info.get("last_interruption") == "terminated" and bool(report)
    undecided = status is Status.FAILED and ours and info.get("in_job_restart") is None
    if status not in _UNRECORDED and not echo and not undecided:
        return False  # a task recorded its end and decided (a refusal, a requeue, a completion)
    done = _last_step(Path(run_dir), float(info.get("started_at") or 0.0))
    user = (Path(run_dir) / ENTRYPOINT).is_file()  # a user's code: its steps seen only when it logs them
    started = True if done > 0 else (None if user else False)
    error = culprit.pop("error")
    if undecided and (info.get("failed_rank") is not None or info.get("dead_ranks")):
        culprit.update(_culprit(info, _placeholder(job, srun), None, None))  # the task's own record first
    elif not undecided:
        update_run_json(run_dir, unless=lambda now: now.get("status") != info.get("status"), status=Status.FAILED,
                        failure="rank_failure", error=error, ended_at=time.time(),
                        dead_ranks=[] if culprit["rank"] is None else [culprit["rank"]],
                        dead_hosts=[] if culprit["node"] is None else [culprit["node"]],
                        **({"last_interruption": None} if echo else {}))
    claimed = ours and status in (Status.RUNNING, Status.FAILED, Status.INTERRUPTED)  # this start's rank 0 did
    segment = int(info.get("segments", 0)) - (1 if claimed else 0)
    return request(Path(run_dir), budget, _placeholder(job, srun), max(0, segment), done + 1, started, log,
                   spares=0, culprit=culprit)


def srun_culprit(report: Optional[Dict[str, Any]], code: int, detected_by: str = "srun") -> Dict[str, Any]:
    """An in_job_restarts entry's culprit from srun's report (None: srun named no task) and
    exit status ``code``, with the run's ``error`` line for it; or from a node agent's
    (``detected_by="agent"``: its ``task`` is the rank)."""
    sig = report.get("signal") if report else (signal.Signals(code - 128).name if 128 < code < 192 and code - 128 in
                                               signal.valid_signals() else None)
    exit_code = report.get("exit_code") if report else None
    what = (f"killed by {sig}" + (" (out of memory)" if report and report.get("oom") else "")) if sig else \
        f"exited with code {exit_code if exit_code is not None else code}"
    what += f" (exit code {exit_code})" if sig and exit_code is not None else ""
    error = (f"agent: rank {report['task']} on {report['node']} {what} and recorded no failure" if report and
             detected_by == "agent" else
             f"srun: {'the node agent' if report['task'] is None else 'task ' + str(report['task'])} on "
             f"{report['node']} {what} and no task recorded a failure (srun exit "
             f"{code})" if report else f"srun: the step ended with exit {code}{f' ({sig})' if sig else ''}, naming "
             "no task, and no task recorded a failure")
    return {"rank": report["task"] if report else None, "node": report["node"] if report else None, "signal": sig,
            "exit_code": exit_code, "srun_exit": code, "srun_error": report["line"] if report else None,
            "detected_by": detected_by, "error": error}


def _placeholder(job: str, srun: int) -> TaskIdentity:
    """The step loop's stand-in for a task: the job and which start of its step (no rank)."""
    return TaskIdentity(rank=-1, world_size=0, local_rank=0, local_world_size=0, node_rank=0, master_addr="",
                        master_port=0, job_id=job, restart_count=0, launcher="srun", in_job_restart=srun)


def _last_step(run_dir: Path, since: float) -> int:
    """The last step the run did in the segment that started at ``since`` (run.json's
    ``started_at``), as the ranks' heartbeats and the metrics rows of that time say (0: none)."""
    steps = [0]
    for path in (run_dir / "heartbeat").glob("rank*.json"):
        try:
            beat = json.loads(path.read_text())
        except (OSError, ValueError):
            continue
        if isinstance(beat, dict) and float(beat.get("time") or 0) >= since - 1 and isinstance(beat.get("step"), int):
            steps.append(beat["step"])
    steps += [r["step"] for r in read_metrics(run_dir) if float(r.get("time") or 0) >= since - 1]
    return max(steps)


def main(argv: List[str]) -> int:
    """``python -m train.harness.restart after-srun RUN_DIR CODE SRUN BUDGET [LOG OFFSET]``
    (slurm/step_loop.sh): :func:`after_srun` for the step's srun that ended with CODE, its
    start SRUN of the step and ``cluster.in_job_restarts=BUDGET``; srun's report is read
    from LOG (the batch script's stderr) from byte OFFSET (where the step began)."""
    if len(argv) not in (5, 7) or argv[0] != "after-srun" or not all(a.isdigit() for a in argv[2:5]):
        print("usage: python -m train.harness.restart after-srun RUN_DIR CODE SRUN BUDGET [LOG OFFSET]",
              file=sys.stderr)
        return 2
    run_dir, (code, srun, budget) = Path(argv[1]), map(int, argv[2:5])
    report = srun_report(read_from(argv[5], int(argv[6]) if argv[6].isdigit() else 0)) if len(argv) == 7 else None
    if report and os.environ.get(AGENT_ENV):  # srun's task is a node's agent, not a rank
        report = {**report, "task": None}
    after_srun(run_dir, code, srun, budget, slurm_job_id() or "0", report,
               lambda line: print(f"step loop: {line}", file=sys.stderr))
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
