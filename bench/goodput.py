"""Goodput under repeated preemption, or a rank crashing again and again, on the local Slurm cluster (``make cluster-up``).

A 2-node x 2-task run of the tiny model (DDP, gloo; ``fault.step_delay_s`` makes each
step last a known time) is preempted every ``--period`` seconds by a job on the high
partition that asks for every CPU of the run's own nodes (``-w``, as
tests/test_preemption.py and tests/test_user_slurm.py do), ``--preemptions`` times; then
it runs to its last step. Preemption k is sent at (start of the run's first step) +
k x period, once the run trains again after the previous one. The run is
bench/checkpoint.py's (``train.seq_len=32``, cluster ``localslurm``: 15 min per attempt, so
keep the period well below 13 min or the signal counts as a timeout); ``--steps`` by
default gives it (preemptions + 1) x period of training.

Useful training time: the time of the steps whose results were kept, i.e. committed by a
later checkpoint or present at the end. A segment's steps after the step the next
segment resumed from (rank 0's "resumed from step N" line) were trained again: lost. A
segment's useful time runs from the start of its first kept step (the metrics row's
``time`` - ``step_time_s``) to the end of its last kept step (that row's ``time``), so it
includes the per-step delay, the metrics write and the step's collective, and excludes
everything between segments. Wall time: Slurm's Start of the job's first attempt to the
End of its last (``sacct -D``, 1 s resolution). goodput = useful / wall; printed beside
it, goodput with Slurm's requeue delay (every attempt's End -> the next attempt's
Start) taken out of the wall time.

Per preemption, on one clock (the cluster runs on this machine), from what the product
records (rank 0's log, submitit's lines in task 0's ``RUN_DIR/slurm/JOB_0_log.out``,
metrics.jsonl, sacct's Submit/Start/End of every attempt, 1 s resolution):

- signal->save: signal received by rank 0 (the "signal agreed at step N: received by
  rank 0 at T" line) -> save start (that line's own time: the ranks agreed to stop at
  the step boundary). The steps trained meanwhile are kept: not lost time.
- save: save start -> "checkpoint step N committed" (write, checksums, commit).
- requeue wait: Slurm's End of the attempt -> Start of the next one.
- start-up: Start -> the first step's start, less the restore.
- restore: "rank 0 coords" line (model built) -> "resumed from step" line (checkpoint
  verified and loaded).
- lost: steps trained after the checkpoint (trained again), if any.
- cost: end of the last kept step before -> start of the first step after.

and split further: slurm signal (high job submitted, this script's clock -> rank 0's
handler); requeue call (commit -> rank 0's "requeue of job" line: ``scontrol requeue``,
Slurm's End); ->py done (-> submitit's "Exiting after" line of task 0); py->requeued
(interpreter exit, or SIGKILL after KillWait, until Slurm requeues: the next attempt's
Submit); pending (Submit -> Start; "held": the high job's own run); launch (Start ->
submitit's "Starting with" line: srun, Python); init+build (-> "rank 0 coords": imports,
rendezvous, model build); 1st step ("resumed" -> the first step's start).

The first attempt's start-up and the last one's exit are paid by any run: shown apart.

``--mode fault`` runs the same job with a rank that crashes every ``--period`` seconds
(``--faults`` times), each restarted inside the job from the last checkpoint: per fault
its detection, restart, restore and first step (goal with the node agents: the raise ->
the first step's end <= 3 s) and the steps lost, then the goodput
(bench/goodput_faults.py says how each is read). ``--mode both`` runs the preemption run,
then the fault run, and prints their goodput side by side.

``--process-model``: ``agent`` (the default process model: one srun task a node, which
imports once and forks the node's ranks, and restarts them inside the same srun:
train/harness/agent.py), ``task`` (``cluster.gpu_binding=task``: one srun task a rank,
each importing torch cold; a restart is the batch script's step loop starting a new srun)
or ``both`` (the default): each mode's run once with each, the agent's first, then their
figures per event and their means side by side, with agent / task.

    flock /tmp/slurm-cluster.lock .venv/bin/python bench/goodput.py \\
        [--mode preempt|fault|both --process-model agent|task|both --period 180 --preemptions 3
         --faults 3 --ckpt-every 30 --fault-rank 3 --step-delay 0.5 --steps N --hold 2 --keep]
    (short try: --mode both --period 60 --preemptions 2 --faults 2)
"""
from __future__ import annotations

import argparse
import math
import os
import re
import subprocess
import sys
import tempfile
import time
from datetime import datetime
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

import goodput_faults  # noqa: E402  (--mode fault)
from goodput_faults import BUILT, RESUMED, STARTING, agent_imports, kept_spans, submitit_events, table  # noqa: E402  (the same reading of the logs)
from checkpoint import CONF, ENDED, log_events, submit  # noqa: E402  (bench/checkpoint.py: the same run, its log)
from slurm import query  # noqa: E402
from spec.rundir import read_metrics, read_run_json  # noqa: E402

SIGNAL = re.compile(r"^signal agreed at step (\d+): received by rank 0 at ([0-9.]+|unknown)")
COMMIT = re.compile(r"^checkpoint step (\d+) committed in ([0-9.]+) s")
REQUEUE = re.compile(r"checkpoint committed; requeue of job")
EXITING = re.compile(r"^Exiting after")
# the overrides of each process model (``--process-model``)
MODELS = {"agent": (), "task": ("cluster.gpu_binding=task",)}


def preempt(hosts: list, hold: float, env: dict) -> str:
    """A high-partition job wanting every CPU of ``hosts``: Slurm preempts the run there."""
    return subprocess.run(["sbatch", "--parsable", "-p", "high", "-w", ",".join(hosts), "-N", str(len(hosts)),
                           "--ntasks-per-node=4", "-J", "goodput-preemptor", "--output=/dev/null",
                           "--wrap", f"sleep {hold}"], env=env, check=True, capture_output=True,
                          text=True).stdout.strip()


def epoch(text: str):
    try:
        return datetime.strptime(text, "%Y-%m-%dT%H:%M:%S").timestamp()
    except ValueError:  # Unknown, None
        return None


def accounting(jobs: list, env: dict, attempts: int, timeout: float = 30) -> dict:
    """sacct's rows of every attempt (slurm.query: ``sacct -D``), once the last has an End."""
    deadline = time.time() + timeout
    while True:
        rows = query.sacct_history(jobs, env)
        mine = rows.get(jobs[0], [])
        if len(mine) >= attempts and epoch(mine[-1]["End"]) or time.time() > deadline:
            return {job: [dict(r, start=epoch(r["Start"]), end=epoch(r["End"])) for r in rows.get(job, [])]
                    for job in jobs}
        time.sleep(1)


def drive(args, env: dict, work: Path) -> dict:
    """Submit, preempt on schedule, wait for the end. Every time on time.time()'s clock."""
    job, run_dir = submit(work, f"run-{args.process_model}", args.steps, args.step_delay, env, extra=args.overrides)
    print(f"job {job}, run directory {run_dir} (process model {args.process_model}"
          f"{''.join(' ' + o for o in args.overrides)})", flush=True)
    deadline = time.time() + args.timeout
    highs = []  # (job id, submitted at)
    t_first = None
    while True:
        info = read_run_json(run_dir)
        if info.get("status") in ENDED and not query.squeue([job], env):
            break
        if time.time() > deadline:
            raise RuntimeError(f"job {job} did not finish in {args.timeout} s: {info}")
        rows = read_metrics(run_dir)
        if rows and t_first is None:
            t_first = rows[0]["time"] - rows[0]["step_time_s"]
        k = len(highs)
        if (t_first is not None and k < args.preemptions and time.time() >= t_first + (k + 1) * args.period
                and info.get("status") == "running" and rows[-1]["segment"] == k):  # training again
            t_sent = time.time()
            highs.append((preempt(info["hostnames"], args.hold, env), t_sent))
            print(f"preemption {k + 1}: high job {highs[-1][0]} at +{highs[-1][1] - t_first:.0f} s, "
                  f"after step {rows[-1]['step']}", flush=True)
        time.sleep(0.5)
    info = read_run_json(run_dir)
    acct = accounting([job] + [h for h, _ in highs], env, int(info.get("segments", 1)))
    return dict(job=job, run_dir=run_dir, info=info, highs=highs, acct=acct, rows=read_metrics(run_dir),
                events=log_events(run_dir))


def after(events: list, pattern: re.Pattern, t: float):
    """The first (time, match) of ``events`` at or after ``t``; (None, None) if none."""
    return next(((te, m) for te, msg in events if te >= t and (m := pattern.search(msg))), (None, None))


def analyse(res: dict) -> dict:
    rows, events, attempts = res["rows"], res["events"], res["acct"][res["job"]]
    sub = submitit_events(res["run_dir"], res["job"])
    imports = agent_imports(res["run_dir"], res["job"])  # one an attempt with node agents, none without
    resumed = {int(m.group(2)): int(m.group(1)) for _, msg in events if (m := RESUMED.search(msg))}
    spans = kept_spans(rows, resumed)
    per = []
    for k, (high, t_high) in enumerate(res["highs"]):
        if k + 1 >= len(attempts) or k + 1 not in spans or k not in spans:
            per.append(None)  # the run ended before this preemption took effect
            continue
        t_save, sig = after(events, SIGNAL, t_high)
        t_commit, _ = after(events, COMMIT, t_save)
        t_requeue, _ = after(events, REQUEUE, t_commit)
        end, requeued, start = attempts[k]["end"], epoch(attempts[k + 1]["Submit"]), attempts[k + 1]["start"]
        t_exited, _ = after(sub, EXITING, t_requeue)
        if t_exited is None or t_exited > requeued:  # none in this attempt: the task ended with
            t_exited = math.nan                     # os._exit after its requeue (train/job.py)
        t_python, _ = after(sub, STARTING, start - 1)
        t_built, _ = after(events, BUILT, start - 1)
        t_resumed, _ = after(events, RESUMED, t_built)
        received = None if sig.group(2) == "unknown" else float(sig.group(2))
        hj = res["acct"].get(high) or [{}]
        held = (hj[-1]["end"] - hj[-1]["start"]) if hj[-1].get("start") and hj[-1].get("end") else math.nan
        first = spans[k + 1][0]
        per.append(dict(
            step=int(sig.group(1)), slurm_signal=(received or math.nan) - t_high,
            to_save=t_save - (received or t_high), save=t_commit - t_save, requeue=start - end,
            startup=first - start - (t_resumed - t_built), restore=t_resumed - t_built, lost=spans[k][2],
            cost=first - spans[k][1],
            # the splits
            requeue_call=t_requeue - t_commit, py_done=t_exited - t_requeue,
            teardown=requeued - (t_requeue if math.isnan(t_exited) else t_exited), pending=start - requeued,
            held=held, launch=t_python - start, init=t_built - t_python, first=first - t_resumed,
            imports=imports[k + 1] if k + 1 < len(imports) else math.nan))
    wall_start, wall_end = attempts[0]["start"], attempts[-1]["end"]
    first, last = min(spans), max(spans)
    t_last_exit, _ = after(sub, EXITING, spans[last][1])
    return dict(per=per, wall=wall_end - wall_start, useful=sum(sp[1] - sp[0] for sp in spans.values()),
                lost=sum(sp[2] for sp in spans.values()), requeue=sum(p["requeue"] for p in per if p),
                pending=sum(p["pending"] for p in per if p), initial=spans[first][0] - wall_start,
                final=wall_end - spans[last][1], final_py=(t_last_exit or math.nan) - spans[last][1],
                steps=len({r["step"] for r in rows}), attempts=len(attempts))


def report(res: dict, a: dict, args) -> None:
    info = res["info"]
    print(f"\ngoodput, process model {args.process_model}: job {res['job']}, 2 nodes x 2 ranks, tiny model, DDP (gloo), "
          f"fault.step_delay_s={args.step_delay}, {args.steps} steps; a high-partition job on the run's nodes "
          f"(sleep {args.hold:g}) every {args.period:g} s, {len(res['highs'])} sent")
    print(f"run: status {info.get('status')}, segments {info.get('segments')}, preemptions "
          f"{info.get('preemptions', 0)}, timeouts {info.get('timeouts', 0)}, sacct attempts {a['attempts']}, "
          f"{a['steps']} distinct steps")
    table("per preemption", (("signal->save", "to_save"), ("save", "save"), ("requeue wait", "requeue"),
                             ("start-up", "startup"), ("restore", "restore"), ("lost", "lost"), ("cost", "cost")),
          a["per"], "  signal->save: received -> the ranks agree at a step boundary (those steps are kept); "
          "requeue wait: Slurm's End of the attempt -> Start of the next;\n  cost: end of the last kept step -> "
          "start of the first step after (save + requeue call + requeue wait + start-up + restore, +-1 s of sacct)")
    table("split", (("slurm signal", "slurm_signal"), ("requeue call", "requeue_call"), ("->py done", "py_done"),
                    ("py->requeued", "teardown"), ("pending", "pending"), ("(held)", "held"),
                    ("launch", "launch"), ("init+build", "init"), ("(imports)", "imports"), ("1st step", "first")),
          a["per"], "  slurm signal: high job submitted -> rank 0's handler; requeue call: commit -> rank 0's 'requeue "
          "of job' line (scontrol requeue: Slurm's End);\n  ->py done: submitit's 'Exiting' line of task 0 (nan: none, the task ended "
          "with os._exit after its requeue); py->requeued: from that exit (else from the requeue call), or KillWait's "
          "SIGKILL, until Slurm requeues (the next attempt's Submit);\n  pending: Submit -> Start ((held): the high "
          "job's run); launch: Start -> submitit's 'Starting' line (srun, Python);\n  init+build: -> 'rank 0 coords' "
          "(imports, rendezvous, model build; (imports): node 0's agent's own, nan without agents);\n  1st step: "
          "'resumed' -> the first step's start")
    done = [p for p in a["per"] if p]
    wall, useful, requeue = a["wall"], a["useful"], a["requeue"]
    cost = sum(p["cost"] for p in done)
    print(f"\nwall time      {wall:8.1f} s   Slurm Start of the first attempt -> End of the last")
    print(f"useful time    {useful:8.1f} s   steps whose results were kept (trained again: {a['lost']:.1f} s)")
    print(f"preemptions    {cost:8.1f} s   their cost, of which Slurm's requeue wait {requeue:.1f} s "
          f"(pending {a['pending']:.1f} s)")
    print(f"first start-up {a['initial']:8.1f} s   Start -> first step; last exit {a['final']:.1f} s (Python done "
          f"+{a['final_py']:.1f} s); any run pays them")
    print(f"load average (1 min) {args.load[0]:.1f} at the start, {os.getloadavg()[0]:.1f} at the end, "
          f"{os.cpu_count()} CPUs")
    print(f"goodput                       {useful / wall:6.3f}   useful / wall (goal >= 0.9 at one preemption "
          f"per 180 s)")
    print(f"goodput without Slurm's wait  {useful / (wall - requeue):6.3f}   useful / (wall - requeue wait)")


def side_by_side(pre: dict, fault: dict) -> None:
    """The two runs' figures in one table (``--mode both``)."""
    def mean(cost: float, n: int) -> float:
        return cost / n if n else math.nan
    done = [p for p in pre["per"] if p]
    pre_cost = sum(p["cost"] for p in done)
    lines = [("events", len(pre["per"]), fault["events"], "d"), ("wall time", pre["wall"], fault["wall"], ".1f"),
             ("useful time", pre["useful"], fault["useful"], ".1f"),
             ("trained again", pre["lost"], fault["lost"], ".1f"),
             ("cost per event", mean(pre_cost, len(done)), mean(fault["cost"], len([p for p in fault["per"] if p])),
              ".1f"), ("goodput", pre["useful"] / pre["wall"], fault["goodput"], ".3f")]
    print(f"\n{'side by side':<16} {'preemption':>11} {'fault':>11}")
    for name, a, b, fmt in lines:
        print(f"{name:<16} {a:>11{fmt}} {b:>11{fmt}}")


def compare(title: str, cols: tuple, per: dict, note: str = "") -> None:
    """Each event's figures under both process models (``per``: model -> its per-event
    dicts, None where one never took effect), their means (nan values left out) and the
    ratio of the means, agent / task."""
    n = max(len(v) for v in per.values())
    head = " ".join(f"{'#' + str(k + 1):>6}" for k in range(n)) + f" {'mean':>6}"
    print(f"\n{title}\n{'':<16} {'agent':^{len(head)}} | {'task':^{len(head)}} | agent/task")
    print(f"{'(seconds)':<16} {head} | {head} |")
    for name, key in cols:
        cells, means = [], []
        for model in ("agent", "task"):
            vals = [p[key] if p else math.nan for p in per[model]] + [math.nan] * (n - len(per[model]))
            done = [v for v in vals if not math.isnan(v)]
            means.append(sum(done) / len(done) if done else math.nan)
            cells.append(" ".join(f"{v:>6.2f}" for v in vals) + f" {means[-1]:>6.2f}")
        ratio = means[0] / means[1] if means[1] else math.nan
        print(f"{name:<16} {cells[0]} | {cells[1]} | {ratio:>10.2f}")
    if note:
        print(note)


def compare_preemptions(pre: dict) -> None:
    """``--mode preempt --process-model both``: per preemption, agent vs task."""
    compare("per preemption, process model agent vs task (cluster.gpu_binding=task)",
            (("start-up", "startup"), ("launch", "launch"), ("init+build", "init"), ("(agent imports)", "imports"),
             ("restore", "restore"), ("1st step", "first"), ("requeue wait", "requeue"), ("save", "save"),
             ("cost", "cost")),
            {m: a["per"] for m, a in pre.items()},
            "  start-up: Slurm's Start -> the first step's start, less the restore; launch: Start -> task 0's submitit "
            "'Starting' (srun; the agent or the rank);\n  init+build: -> 'rank 0 coords' (imports: once a node with the "
            "agent, once a rank without; the fork; rendezvous; the model);\n  (agent imports): node 0's agent's own, "
            "part of init+build; restore: -> 'resumed'; 1st step: -> the first step's start;\n  cost: end of the last "
            "kept step -> start of the first step after")
    for name, key, fmt in (("first start-up", "initial", ".1f"), ("wall time", "wall", ".1f"),
                           ("useful time", "useful", ".1f"), ("goodput", None, ".3f")):
        a, t = (pre[m]["useful"] / pre[m]["wall"] if key is None else pre[m][key] for m in ("agent", "task"))
        print(f"{name:<16} agent {a:>8{fmt}}   task {t:>8{fmt}}   agent/task {a / t if t else math.nan:.2f}")


def compare_faults(fault: dict) -> None:
    """``--mode fault --process-model both``: per fault, agent vs task, and the goal."""
    compare("per fault, process model agent vs task (cluster.gpu_binding=task)",
            (("detection", "detection"), ("restart", "restart"), ("init", "init"), ("build", "build"),
             ("load", "load"), ("restore", "restore"), ("1st step", "first"), ("crash->1st step", "to_first"),
             ("crash->its end", "total"), ("downtime", "downtime"), ("lost", "lost"), ("cost", "cost")),
            {m: s["per"] for m, s in fault.items()},
            "  restart: the last 'training failed' -> the new ranks start (task: a new srun's task 0; agent: the "
            "forked rank 0); init: -> run.json's restarted_at (imports, rendezvous);\n  build: -> 'rank 0 coords'; "
            "load: -> 'resumed'; crash->1st step: the raise -> the first step's start; crash->its end: -> its end;\n"
            "  downtime: run.json's failed_at -> restarted_at; cost: end of the last kept step -> start of the first "
            "step after")
    for model in fault:
        done = [p["total"] for p in fault[model]["per"] if p]
        verdict = ("met" if max(done) <= goodput_faults.GOAL_S else "not met") if done else "no fault took effect"
        print(f"crash -> first step's end, {model}: mean {sum(done) / len(done) if done else math.nan:.2f} s, max "
              f"{max(done) if done else math.nan:.2f} s: goal <= {goodput_faults.GOAL_S:g} s {verdict}; goodput "
              f"{fault[model]['goodput']:.3f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mode", choices=("preempt", "fault", "both"), default="preempt",
                        help="preemptions, a crashing rank restarted inside the job, or both runs one after the other")
    parser.add_argument("--process-model", choices=("agent", "task", "both"), default="both",
                        help="agent: one srun task a node forking its ranks (the default process model); task: "
                             "cluster.gpu_binding=task, one srun task a rank; both: each mode's run with each, compared")
    parser.add_argument("--period", type=float, default=180, help="seconds between preemptions (or faults)")
    parser.add_argument("--preemptions", type=int, default=3, help="how many, then the run finishes")
    parser.add_argument("--faults", type=int, default=3, help="fault mode: how many crashes, then the run finishes")
    parser.add_argument("--ckpt-every", type=int, default=30, help="fault mode: checkpoint.every_steps")
    parser.add_argument("--fault-rank", type=int, default=3, help="fault mode: the rank that raises (of 4)")
    parser.add_argument("--step-delay", type=float, default=0.5, help="fault.step_delay_s: seconds per step")
    parser.add_argument("--step-overhead", type=float, default=0.08,
                        help="seconds a step takes beyond the delay, to size --steps")
    parser.add_argument("--steps", type=int, default=None,
                        help="train.steps (default: enough for (events + 1) x period of training)")
    parser.add_argument("--hold", type=float, default=2, help="seconds the high job holds the nodes")
    parser.add_argument("--timeout", type=float, default=None, help="seconds to wait for a run (default: ample)")
    parser.add_argument("--keep", action="store_true", help="keep the run directories (printed)")
    args = parser.parse_args()
    if not CONF.is_file():
        sys.exit(f"no local Slurm cluster ({CONF} missing): run `make cluster-up` first")
    fault_steps, args.steps = args.steps, args.steps or math.ceil(
        (args.preemptions + 1) * args.period / (args.step_delay + args.step_overhead))
    if args.timeout is None:
        args.timeout = (args.preemptions + 1) * args.period * 3 + 600
    env = dict(os.environ, SLURM_CONF=str(CONF), PYTHONPATH=str(REPO))
    args.load = os.getloadavg()
    work = Path(tempfile.mkdtemp(prefix="bench-goodput-", dir=os.environ.get("BENCH_DIR")))
    models = ("agent", "task") if args.process_model == "both" else (args.process_model,)
    try:
        pre, fault = {}, {}
        if args.mode in ("preempt", "both"):
            for model in models:
                pargs = argparse.Namespace(**{**vars(args), "process_model": model, "overrides": MODELS[model],
                                              "load": os.getloadavg()})
                res = drive(pargs, env, work)
                pre[model] = analyse(res)
                report(res, pre[model], pargs)
        if args.mode in ("fault", "both"):
            for model in models:
                fargs = argparse.Namespace(**{**vars(args), "steps": fault_steps, "timeout": None,
                                              "process_model": model, "overrides": MODELS[model]})
                load = os.getloadavg()[0]
                res = goodput_faults.drive(fargs, env, work)
                fault[model] = goodput_faults.summary(res)
                goodput_faults.report(res, fault[model], fargs)
                print(f"load average (1 min) {load:.1f} at the start, {os.getloadavg()[0]:.1f} at the end, "
                      f"{os.cpu_count()} CPUs")
        for model in models:
            if model in pre and model in fault:
                print(f"\nprocess model {model}:", end="")
                side_by_side(pre[model], fault[model])
        if len(models) == 2 and pre:
            compare_preemptions(pre)
        if len(models) == 2 and fault:
            compare_faults(fault)
        print(f"\nload average (1 min) {args.load[0]:.1f} at the start, {os.getloadavg()[0]:.1f} at the end, "
              f"{os.cpu_count()} CPUs")
    finally:
        if not args.keep:
            subprocess.run(["rm", "-rf", str(work)])
        else:
            print(f"kept: {work}")


if __name__ == "__main__":
    main()
