"""A dead node with and without a hot spare, on the local Slurm cluster (``make cluster-up``).

The 2-node x 2-task run of bench/checkpoint.py (``train.seq_len=32``, the tiny model,
``fault.step_delay_s``, checkpoints every ``--ckpt-every`` steps); after ``--kill-after``
steps ``slurm/cluster/node.sh kill`` SIGKILLs the second training node (its slurmd and
tasks), as a crash would, and leaves it dead until the run trains again:

- ``cluster.spare_nodes=1`` (3 nodes asked): the restart inside the job on the spare
  (train/harness/restart.py, docs/faults.md "Hot spares");
- ``--compare`` also runs it with no spare: the requeue without the node
  (train/harness/badnodes.py), whose job cannot start before Slurm declares the node DOWN
  (SlurmdTimeout: 120 s on the local cluster, slurm/cluster/templates/slurm.conf.in).

Per run, from the kill (time.time() here; the cluster runs on this machine): the
decision (run.json's restart entry ``failed_at``, or the exclusion's ``time``), the new
segment's rank 0 (``restarted_at``, or the requeued segment's ``started_at``), its first
step (metrics.jsonl), the steps trained again, and what sinfo said of the dead node when
that first step was seen. The node is started again afterwards, always.

    .venv/bin/python bench/spares.py [--compare] [--kill-after 12] [--ckpt-every 5]
"""
from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from checkpoint import CONF, ENDED, submit  # noqa: E402  (bench/checkpoint.py: the same run)
from spec.rundir import read_metrics, read_run_json  # noqa: E402

NODE_SH = str(REPO / "slurm" / "cluster" / "node.sh")


def wait(predicate, timeout: float, what: str):
    deadline = time.time() + timeout
    while time.time() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.2)
    raise RuntimeError(f"timed out after {timeout} s waiting for {what}")


def sinfo(node: str, env: dict) -> str:
    return subprocess.run(["sinfo", "-h", "-n", node, "-o", "%T"], env=env, capture_output=True,
                          text=True).stdout.split("\n")[0].strip()


def idle(node: str, env: dict) -> None:
    """Wait until sinfo says ``node`` idle (once the run ended). After a kill sinfo was seen
    saying `mixed` for minutes while `scontrol show node` said IDLE CPUAlloc=0: a DOWN and
    RESUME makes it agree (as tests/test_node_failure.py does)."""
    reset = []

    def check() -> bool:
        if sinfo(node, env) == "idle":
            return True
        shown = subprocess.run(["scontrol", "show", "node", node], env=env, capture_output=True, text=True).stdout
        if not reset and "State=IDLE " in shown and "CPUAlloc=0 " in shown:
            reset.append(1)
            for state in ("state=down reason=sinfo_out_of_date", "state=resume"):
                subprocess.run(["scontrol", "update", f"nodename={node}", *state.split(" ", 1)], env=env,
                               capture_output=True)
        return False
    wait(check, 240, f"{node} idle")


def one(work: Path, spares: int, args, env: dict) -> dict:
    extra = (f"cluster.spare_nodes={spares}", f"checkpoint.every_steps={args.ckpt_every}")
    job, run_dir = submit(work, f"spares{spares}", args.steps, args.step_delay, env, extra=extra)
    wait(lambda: len(read_metrics(run_dir)) >= args.kill_after, 300, f"{args.kill_after} steps")
    first = read_run_json(run_dir)
    victim, segment = first["hostnames"][1], first["segments"] - 1
    done = max(r["step"] for r in read_metrics(run_dir))
    try:
        subprocess.run(["bash", NODE_SH, "kill", victim], env=env, check=True, capture_output=True)
        killed = time.time()
        row = wait(lambda: next((r for r in read_metrics(run_dir) if r["segment"] > segment), None), 600,
                   "the first step after the kill")
        state = sinfo(victim, env)
    finally:
        subprocess.run(["bash", NODE_SH, "start", victim], env=env, capture_output=True, text=True)
    info = wait(lambda: (lambda i: i if i.get("status") in ENDED else None)(read_run_json(run_dir)), 600, "the end")
    idle(victim, env)
    if spares:
        entry = info["in_job_restarts"][-1]
        decided, restarted = entry["failed_at"], entry["restarted_at"]
    else:
        decided, restarted = info["node_exclusions"][-1]["time"], info["started_at"]
    return dict(spares=spares, job=job, status=info["status"], same_job=info["job_id"] == job,
                requeues=int(info.get("requeues_since_submit") or 0), decided=decided - killed,
                restarted=restarted - killed, first_step=row["time"] - killed, redone=done - row["step"] + 1,
                sinfo=state, run_dir=run_dir)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--compare", action="store_true", help="also without a spare (the exclusion requeue)")
    parser.add_argument("--kill-after", type=int, default=12, help="steps before the kill")
    parser.add_argument("--ckpt-every", type=int, default=5, help="checkpoint.every_steps")
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--step-delay", type=float, default=0.3, help="fault.step_delay_s")
    args = parser.parse_args()
    env = dict(os.environ, SLURM_CONF=str(CONF), PYTHONPATH=str(REPO))
    work = Path(tempfile.mkdtemp(prefix="bench-spares-", dir=os.environ.get("BENCH_DIR")))
    results = [one(work, 1, args, env)] + ([one(work, 0, args, env)] if args.compare else [])
    print(f"{'spares':>6} {'status':>9} {'same job':>8} {'requeues':>8} {'decided s':>9} {'rank 0 s':>8} "
          f"{'1st step s':>10} {'redone':>6}  sinfo at the first step")
    for r in results:
        print(f"{r['spares']:>6} {r['status']:>9} {str(r['same_job']):>8} {r['requeues']:>8} {r['decided']:>9.1f} "
              f"{r['restarted']:>8.1f} {r['first_step']:>10.1f} {r['redone']:>6}  {r['sinfo']}")
    print(f"(seconds from the kill; run directories under {work}; load average {os.getloadavg()[0]:.1f})")


if __name__ == "__main__":
    main()
