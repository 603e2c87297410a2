"""bench/goodput.py's fault mode: a rank crashes again and again, the job restarts it.

The same 2-node x 2-task run as the preemption mode, with ``checkpoint.every_steps=N``
(``--ckpt-every``, default 30) and ``fault.raise_every_steps=F``: rank ``--fault-rank``
(default 3, on the second node) raises at steps F, 2F, ... (each once per run), F the
steps of ``--period`` seconds at the step's time; ``cluster.in_job_restarts`` = the
number of faults, so every one is restarted inside the job (same job id, no requeue).

Per fault, on one clock (the cluster runs on this machine), from the product's records
(every rank's log, submitit's lines in each task's ``RUN_DIR/slurm/JOB_T_log.out``,
run.json's ``in_job_restarts``, metrics.jsonl, sacct's rows of the job's steps):

- detection: the raise (the failing rank's "training failed" line) -> the last rank's
  "training failed" line of that segment: every rank saw the step fail; their tasks
  exit, srun returns to the batch script's step loop (sacct's End of the step, 1 s
  resolution, is in the split).
- restart: -> the new ranks start. One srun task a rank (``cluster.gpu_binding=task``):
  the new step's task 0 starts (submitit's "Starting with JobEnvironment" line): the
  tasks' exit, the step loop, srun's launch, Python's start. With node agents
  (train/harness/agent.py, the default) there is no new srun: the agents stop the node's
  ranks (RUN_DIR/RESTART, or a rank's death) and fork fresh ones from their warm state;
  the new rank 0's first line (its CPUs, placed right after the fork: "rank 0: CPUs",
  else run.json's ``restarted_at``) marks its start. The ``how`` column says which.
- restore: -> rank 0's "resumed from step N" line: imports (none with an agent) and
  rendezvous (to run.json's ``restarted_at``), the model's build ("rank 0 coords"), the
  checkpoint's load.
- first step: -> the end of the first step after the restore (its metrics row's time).
- crash->1st step: the raise -> the start of that first step (its row's ``time`` -
  ``step_time_s``); sum: the raise -> its end (goal <= 3 s with the agents: :data:`GOAL_S`);
  lost: the steps trained since the last checkpoint (trained again), in steps and seconds.

Nothing is read from srun's steps or the batch script's "restart k of N" lines but the
split's step end / start (sacct's rows of the sruns, nan where the agents restarted the
ranks inside the same srun): each restart is an entry of run.json's ``in_job_restarts``
(``failed_at``, ``restarted_at``, ``downtime_s``, ``seconds_lost``, ``srun``: which start of
the step, ``detected_by``: "agent"/"srun" where the rank recorded nothing itself).

Goodput as in the preemption mode: the steps whose results were kept over Slurm's
Start -> End of the job (one attempt: no requeue).
"""
from __future__ import annotations

import math
import re
import subprocess
import time
from datetime import datetime
from pathlib import Path

RANK_LINE = re.compile(r"^(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3}) rank(\d+) (.*)$")
SUBMITIT = re.compile(r"^submitit \w+ \((\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3})\) - (.*)$")
FAILED = re.compile(r"^training failed: ")
BUILT = re.compile(r"^rank 0 coords")
RESUMED = re.compile(r"^resumed from step (\d+) \(segment (\d+)\)")
STARTING = re.compile(r"^Starting with JobEnvironment")
PLACED = re.compile(r"^rank 0: CPUs")  # a forked rank's first line (train/harness/forked.py: run_child)
AGENT_UP = re.compile(r"^(?:[\d-]+ [\d:]+ )?agent node 0 \([^)]*\): \d+ ranks from RANK \d+ \(imports ([0-9.]+) s\)")
GOAL_S = 3.0  # the raise -> the end of the first step after the restore, with node agents
STAMP = "%Y-%m-%d %H:%M:%S,%f"


def rank_events(run_dir: Path) -> list:
    """(time, rank, message) of every rank's log lines, in time order."""
    out = []
    for path in sorted((Path(run_dir) / "logs").glob("rank*.log")):
        for line in path.read_text(errors="replace").splitlines():
            if m := RANK_LINE.match(line):
                out.append((datetime.strptime(m.group(1), STAMP).timestamp(), int(m.group(2)), m.group(3)))
    return sorted(out)


def submitit_events(run_dir: Path, job: str) -> list:
    """(time, message) of submitit's lines in task 0's output (every step and attempt appends to it)."""
    path = Path(run_dir) / "slurm" / f"{job}_0_log.out"
    lines = path.read_text(errors="replace").splitlines() if path.exists() else []
    return [(datetime.strptime(m.group(1), STAMP).timestamp(), m.group(2)) for line in lines
            if (m := SUBMITIT.match(line))]


def agent_imports(run_dir: Path, job: str) -> list:
    """Seconds of node 0's agent's imports, one per start of an agent (its "agent node 0
    (host): N ranks from RANK 0 (imports X s)" line in its own stderr,
    ``<job>_agent0_log.err``); empty with one srun task a rank."""
    path = Path(run_dir) / "slurm" / f"{job}_agent0_log.err"
    lines = path.read_text(errors="replace").splitlines() if path.exists() else []
    return [float(m.group(1)) for line in lines if (m := AGENT_UP.match(line))]


def task0_starts(run_dir: Path, job: str) -> list:
    """Times of submitit's "Starting" lines in task 0's output (one per step of the job)."""
    return sorted(t for t, msg in submitit_events(run_dir, job) if STARTING.search(msg))


def sacct_steps(job: str, env: dict) -> list:
    """(Start, End) of the job's numbered steps (JOB.0, JOB.1, ...: the step loop's sruns), in order."""
    out = subprocess.run(["sacct", "-n", "-P", "-j", job, "-o", "JobID,Start,End"], env=env, capture_output=True,
                         text=True).stdout
    steps = []
    for line in out.splitlines():
        jid, start, end = (line.split("|") + ["", ""])[:3]
        if re.fullmatch(rf"{re.escape(job)}\.\d+", jid):
            steps.append((int(jid.split(".")[1]), _epoch(start), _epoch(end)))
    return [(s, e) for _, s, e in sorted(steps)]


def _epoch(text: str):
    try:
        return datetime.strptime(text, "%Y-%m-%dT%H:%M:%S").timestamp()
    except ValueError:  # Unknown, None
        return math.nan


def kept_spans(rows: list, resumed: dict) -> dict:
    """segment -> (start of its first kept step (its metrics row's ``time`` - ``step_time_s``),
    end of its last kept step (that row's ``time``), then the seconds and the steps trained
    after the checkpoint the next segment resumed from: lost)."""
    spans = {}
    for s in sorted({r["segment"] for r in rows}):
        seg = [r for r in rows if r["segment"] == s]
        kept = [r for r in seg if r["step"] <= resumed.get(s + 1, math.inf)]
        if kept:
            spans[s] = (kept[0]["time"] - kept[0]["step_time_s"], kept[-1]["time"], seg[-1]["time"] - kept[-1]["time"],
                        seg[-1]["step"] - kept[-1]["step"])
    return spans


def analyse(events: list, starts: list, restarts: list, rows: list, steps: list) -> list:
    """One dict per entry of run.json's ``in_job_restarts`` (None where the run ended before
    the restart trained a step): the phases above and their split, on time.time()'s clock.
    ``events``: :func:`rank_events`; ``starts``: :func:`task0_starts` (one a srun, in the
    order of ``steps``: :func:`sacct_steps`). A restart with a task 0 start between the
    last failure line and the restore was the step loop's (a new srun, ``how`` "srun"),
    else the node agents' inside the same srun (``how`` "agent"). Pure."""
    nan = (math.nan, math.nan)
    resumed = {int(m.group(2)): (t, int(m.group(1))) for t, rank, msg in events if rank == 0
               and (m := RESUMED.search(msg))}
    spans = kept_spans(rows, {s: step for s, (_, step) in resumed.items()})
    per = []
    for entry in restarts:
        seg = int(entry["segment"])
        if seg + 1 not in resumed or seg + 1 not in spans or seg not in spans:
            per.append(None)
            continue
        t_resumed, step_from = resumed[seg + 1]
        rank = entry.get("rank")
        t_restarted = float(entry.get("restarted_at") or math.nan)
        failed = [(t, r) for t, r, msg in events if FAILED.search(msg) and t <= t_resumed]
        # the raise: the failing rank's own line; a rank that died without one (SIGKILL, a
        # segfault: its agent or srun recorded it): run.json's failed_at
        t_raise = next((t for t, r in reversed(failed) if r == rank), float(entry.get("failed_at") or math.nan))
        t_all = max([t for t, r in failed if t >= t_raise] or [t_raise])
        new_srun = [i for i, t in enumerate(starts) if t_all <= t <= t_resumed]
        if new_srun:  # the step loop's new srun: its task 0 starts
            i = new_srun[0]
            t_start, how = starts[i], "srun"
            old, new = (steps[i - 1] if 0 < i <= len(steps) else nan), (steps[i] if i < len(steps) else nan)
        else:  # the agents forked fresh ranks inside the same srun: the new rank 0's first line
            t_start = next((t for t, r, msg in events if r == 0 and t_all <= t <= t_resumed and PLACED.search(msg)),
                           t_restarted)
            how, old, new = "agent", nan, nan
        since = t_all if math.isnan(t_start) else t_start
        t_built = next((t for t, r, msg in events if r == 0 and t >= since and BUILT.search(msg)), math.nan)
        first_row = next(r for r in rows if r["segment"] == seg + 1)
        t_first = first_row["time"]  # the first step's end
        per.append(dict(
            step=int(entry["step"]), rank=rank, node=entry.get("node"), resumed=step_from, how=how,
            detected_by=entry.get("detected_by") or "rank",
            detection=t_all - t_raise, restart=t_start - t_all, restore=t_resumed - t_start,
            first=t_first - t_resumed, total=t_first - t_raise,
            to_first=t_first - float(first_row.get("step_time_s") or 0.0) - t_raise,
            lost_steps=spans[seg][3], lost=spans[seg][2], cost=spans[seg + 1][0] - spans[seg][1],
            # the split
            step_end=old[1] - t_raise, step_start=new[0] - t_raise, init=t_restarted - t_start,
            build=t_built - t_restarted, load=t_resumed - t_built,
            downtime=float(entry.get("downtime_s") or math.nan), seconds_lost=float(entry.get("seconds_lost") or math.nan)))
    return per


def fault_every(args) -> int:
    """fault.raise_every_steps: the steps of ``--period`` seconds."""
    return max(1, round(args.period / (args.step_delay + args.step_overhead)))


def drive(args, env: dict, work: Path) -> dict:
    """Submit the run with its repeated fault and wait for its end."""
    from checkpoint import ENDED, submit  # bench/checkpoint.py: the same run
    from slurm import query
    from spec.rundir import read_metrics, read_run_json

    every = fault_every(args)
    steps = args.steps or (args.faults + 1) * every - 1  # ends before the next multiple of F
    extra = (f"fault.raise_every_steps={every}", f"fault.raise_rank={args.fault_rank}",
             f"checkpoint.every_steps={args.ckpt_every}", f"cluster.in_job_restarts={args.faults}",
             *getattr(args, "overrides", ()))  # the process model's (bench/goodput.py: MODELS)
    model = getattr(args, "process_model", "agent")
    job, run_dir = submit(work, f"faults-{model}", steps, args.step_delay, env, extra=extra)
    print(f"job {job}, run directory {run_dir}: rank {args.fault_rank} raises every {every} steps "
          f"(process model {model}{''.join(' ' + o for o in getattr(args, 'overrides', ()))})", flush=True)
    deadline = time.time() + (args.timeout or (args.faults + 1) * args.period * 3 + 600)
    while not (read_run_json(run_dir).get("status") in ENDED and not query.squeue([job], env)):
        if time.time() > deadline:
            raise RuntimeError(f"job {job} did not finish: {read_run_json(run_dir)}")
        time.sleep(1)
    while True:  # sacct's End of the job lands a moment after it leaves the queue
        rows = query.sacct_history([job], env).get(job) or [{}]
        if not math.isnan(_epoch(rows[-1].get("End", ""))) or time.time() > deadline:
            break
        time.sleep(1)
    info = read_run_json(run_dir)
    return dict(job=job, run_dir=run_dir, info=info, every=every, steps=steps, metrics=read_metrics(run_dir),
                events=rank_events(run_dir), starts=task0_starts(run_dir, job), sacct_steps=sacct_steps(job, env),
                wall=_epoch(rows[-1].get("End", "")) - _epoch(rows[0].get("Start", "")), attempts=len(rows))


def summary(res: dict) -> dict:
    """Wall, useful, lost, per-fault rows and goodput of a :func:`drive` result."""
    restarts = res["info"].get("in_job_restarts") or []
    per = analyse(res["events"], res["starts"], restarts, res["metrics"], res["sacct_steps"])
    resumed = {int(m.group(2)): int(m.group(1)) for _, rank, msg in res["events"] if rank == 0
               and (m := RESUMED.search(msg))}
    spans = kept_spans(res["metrics"], resumed)
    useful = sum(a[1] - a[0] for a in spans.values())
    return dict(per=per, wall=res["wall"], useful=useful, lost=sum(a[2] for a in spans.values()),
                cost=sum(p["cost"] for p in per if p), events=len(restarts), goodput=useful / res["wall"])


def table(title: str, cols: tuple, per: list, note: str = "", extra=None) -> None:
    """One row per event of ``per`` (a dict, or None: it never took effect), ``cols``:
    (heading, key); the mean of each column; ``extra(p)``: more at the end of a row."""
    print(f"\n{title}\n{'#':>2} {'step':>5} " + " ".join(f"{c:>12}" for c, _ in cols) + "   (seconds)")
    for k, p in enumerate(per):
        if p is None:
            print(f"{k + 1:>2}   (the run ended before it took effect)")
            continue
        print(f"{k + 1:>2} {p['step']:>5} " + " ".join(f"{p[key]:>12d}" if isinstance(p[key], int) else
                                                     f"{p[key]:>12.2f}" for _, key in cols) + (extra(p) if extra else ""))
    done = [p for p in per if p]
    if len(done) > 1:
        print(f"{'mean':>8} " + " ".join(f"{sum(p[key] for p in done) / len(done):>12.2f}" for _, key in cols))
    if note:
        print(note)


def report(res: dict, s: dict, args) -> None:
    info = res["info"]
    print(f"\nfaults, process model {getattr(args, 'process_model', 'agent')}: job {res['job']}, 2 nodes x 2 ranks, tiny model, DDP (gloo), fault.step_delay_s={args.step_delay}, "
          f"{res['steps']} steps, checkpoint.every_steps={args.ckpt_every}; rank {args.fault_rank} raises every "
          f"{res['every']} steps (fault.raise_every_steps: ~{args.period:g} s), cluster.in_job_restarts={args.faults}")
    print(f"run: status {info.get('status')}, segments {info.get('segments')}, in_job_restarts "
          f"{len(info.get('in_job_restarts') or [])}, SLURM_RESTART_COUNT {info.get('restart_count')}, "
          f"sacct attempts {res['attempts']}")
    table("per fault", (("detection", "detection"), ("restart", "restart"), ("restore", "restore"),
                        ("1st step", "first"), ("crash->1st", "to_first"), ("sum", "total"),
                        ("lost steps", "lost_steps"), ("lost", "lost"), ("cost", "cost")), s["per"],
          extra=lambda p: f"  {'ok' if p['total'] <= GOAL_S else 'OVER'} (goal: sum <= {GOAL_S:g} s), resumed from "
                          f"{p['resumed']}, restarted by {p['how']}, recorded by {p['detected_by']}")
    print("  detection: the raise -> every rank's 'training failed' line; restart: -> the new ranks start (a new srun: "
          "task 0's submitit 'Starting'; the agents: the forked rank 0's first line);\n  restore: -> 'resumed from "
          "step N'; 1st step: -> its end; crash->1st: the raise -> the first step's start; sum: -> its end;\n"
          "  lost: trained since the last checkpoint (again after the restore); "
          "cost: end of the last kept step -> start of the first step after (lost + sum, less a step)")
    table("split", (("step end", "step_end"), ("step start", "step_start"), ("init", "init"), ("build", "build"),
                    ("load", "load"), ("downtime", "downtime"), ("secs lost", "seconds_lost")), s["per"])
    print("  step end / start: sacct's End of the failed srun, Start of the next (after the raise, 1 s resolution; "
          "nan: the agents restarted inside the same srun);\n  init: the new ranks start -> run.json's restarted_at "
          "(imports, none with an agent; rendezvous);\n  build: -> 'rank 0 coords' "
          "(the model); load: -> 'resumed' (the checkpoint); downtime, secs lost: run.json's in_job_restarts")
    print(f"\nwall time      {s['wall']:8.1f} s   Slurm Start -> End of the job (one attempt)")
    print(f"useful time    {s['useful']:8.1f} s   steps whose results were kept (trained again: {s['lost']:.1f} s)")
    print(f"faults         {s['cost']:8.1f} s   their cost")
    print(f"goodput                       {s['goodput']:6.3f}   useful / wall")
