"""Hot spares (cluster.spare_nodes): a dead node's place is taken by a spare inside the job.

3 nodes for `cluster.nodes=2 cluster.spare_nodes=1` (sbatch --nodes=3 --no-kill; the
training step runs on 2). `slurm/cluster/node.sh kill` SIGKILLs a training node's slurmd
and tasks; the surviving ranks classify a node failure and ask an in-job restart without
it (train/harness/restart.py); the batch script ends the old srun itself (which would
wait for the dead node until Slurm declares it DOWN, SlurmdTimeout=120 here) and starts
the next step on the spare (slurm/step_loop.sh). The run completes in the same job
(SLURM_RESTART_COUNT 0, no requeue), and its first step after the kill is logged while
sinfo does not yet show the killed node DOWN: an order, checked by asking sinfo when that
step appears (DOWN stays until the node is started again, in `finally`).
"""
from __future__ import annotations

import subprocess
import time

import pytest

from conftest import REPO, job_gone, launcher, run_dir_of, wait_until
from slurm.env import expand_hostlist
from slurm.request import job_facts
from spec.rundir import read_metrics, read_run_json
from test_node_failure import NODE_SH, slurm, start_node

pytestmark = [pytest.mark.slurm, pytest.mark.slurm_whole, pytest.mark.slow]  # kills a node of the cluster


def test_a_spare_takes_a_dead_nodes_place_inside_the_job(tmp_path, slurm_cluster):
    proc = launcher(["+cluster=localslurm", "cluster.nodes=2", "cluster.gpus_per_node=1", "cluster.spare_nodes=1",
                     "train.steps=40",
                     "fault.step_delay_s=0.3", "checkpoint.every_steps=5"], cwd=tmp_path, env=slurm_cluster,
                    timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    run_dir = run_dir_of(proc.stdout)
    wait_until(lambda: len(read_metrics(run_dir)) >= 12, 120, "12 steps")
    first = read_run_json(run_dir)
    victim, job, training = first["hostnames"][1], first["job_id"], set(first["hostnames"])
    allocated = expand_hostlist(job_facts(run_dir).fields["NodeList"])
    [spare] = sorted(set(allocated) - training)  # the job holds 3 nodes, trains on 2
    before = {r["step"] for r in read_metrics(run_dir)}
    try:
        subprocess.run(["bash", NODE_SH, "kill", victim], env=slurm_cluster, check=True, capture_output=True)
        killed = time.time()
        seen = {}

        def first_step_on_the_spare():
            rows = [r for r in read_metrics(run_dir) if (r.get("segment") or 0) > (first.get("segments") or 1) - 1]
            if not rows:
                return None
            seen["sinfo"] = slurm(["sinfo", "-h", "-n", victim, "-o", "%T"], slurm_cluster).split()
            return rows[0]

        row = wait_until(first_step_on_the_spare, 120, "the first step after the kill")
        print(f"kill to the first step on the spare: {row['time'] - killed:.1f} s (step {row['step']}); "
              f"sinfo then said {victim}: {seen['sinfo']}")
        assert not any(s.startswith("down") for s in seen["sinfo"]), seen  # before Slurm declared it DOWN
        info = wait_until(lambda: (lambda i: i if i.get("status") in ("completed", "failed") else None)(
            read_run_json(run_dir)), 240, "the run to end")
        assert info["status"] == "completed", info
        assert info["job_id"] == job and not info.get("node_exclusions") and not info.get("fault_requeues"), info
        assert int(info.get("requeues_since_submit") or 0) == 0, info
        [entry] = info["in_job_restarts"]
        print(f"kill to the restart's decision {entry['failed_at'] - killed:.1f} s, to the new segment's rank 0 "
              f"{entry['restarted_at'] - killed:.1f} s, to its first step {row['time'] - killed:.1f} s")
        assert entry["job_id"] == job and entry["reason"] == "node_failure", entry
        assert entry["dropped_nodes"] == [victim] and entry["spares_left"] == 0, entry
        assert info["excluded_nodes"] == [victim], info
        assert set(info["hostnames"]) == training - {victim} | {spare}, info["hostnames"]
        rows = read_metrics(run_dir)
        assert {r["step"] for r in rows} == set(range(1, 41)) and max(r["step"] for r in rows) == 40
        assert row["step"] <= max(before) + 1  # resumed from a checkpoint, no step skipped
        log = (run_dir / "slurm" / f"{job}_0_log.err").read_text()
        assert f"without {victim}" in log, log[-2000:]
        # one srun held the 3 nodes: no agent started cold after the kill (one import each),
        # the survivor forked again from its warm state, the spare's warm agent took node 1's place
        ended = f"every agent has ended but on {victim} (dropped): ending step 0 of job {job}"
        wait_until(lambda: ended in (run_dir / "slurm" / f"{job}_0_log.err").read_text(), 30, "the step's end")
        agents = {p.name: p.read_text() for p in (run_dir / "slurm").glob(f"{job}_agent*_log.err")}
        assert len(agents) == 3 and all(text.count("(imports ") == 1 for text in agents.values()), agents
        warm = [text for text in agents.values() if "restarting the node's ranks from the warm agent (start 1" in text]
        assert len(warm) == 2 and sum("standing by, warm" in text for text in warm) == 1, agents
    finally:
        start_node(victim, slurm_cluster)


def test_a_spare_takes_a_dead_nodes_place_under_a_users_script(tmp_path, slurm_cluster):
    """The same with a user's entry point (examples/ddp_plain.py: its own checkpoint every 5
    steps, resumed by itself): the harness around the script classifies the node failure
    from its heartbeats, the step loop drops the dead node and the spare runs the script
    again in the same job."""
    proc = launcher(["+cluster=localslurm", "cluster.nodes=2", "cluster.gpus_per_node=1", "cluster.spare_nodes=1",
                     f"entrypoint={REPO / 'examples' / 'ddp_plain.py'}", "entrypoint_args=[--steps,30,--step-delay,0.3]"],
                    cwd=tmp_path, env=slurm_cluster, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    run_dir = run_dir_of(proc.stdout)
    wait_until(lambda: len(read_metrics(run_dir)) >= 8, 120, "8 steps")
    first = read_run_json(run_dir)
    victim, job, training = first["hostnames"][1], first["job_id"], set(first["hostnames"])
    [spare] = sorted(set(expand_hostlist(job_facts(run_dir).fields["NodeList"])) - training)
    try:
        subprocess.run(["bash", NODE_SH, "kill", victim], env=slurm_cluster, check=True, capture_output=True)
        # `completed`, or the job's end: run.json says `failed` for a moment before `restarting`
        # (the job itself leaves the queue only once Slurm hears of the dead node, SlurmdTimeout)
        wait_until(lambda: read_run_json(run_dir).get("status") == "completed" or job_gone(job, slurm_cluster), 240,
                   "the run to complete or its job to end")
        info = read_run_json(run_dir)
        assert info["status"] == "completed", info
        assert info["job_id"] == job and not info.get("node_exclusions") and not info.get("fault_requeues"), info
        [entry] = info["in_job_restarts"]
        assert (entry["job_id"], entry["reason"], entry["dropped_nodes"]) == (job, "node_failure", [victim]), entry
        assert set(info["hostnames"]) == training - {victim} | {spare}, info["hostnames"]
        steps = [r["step"] for r in read_metrics(run_dir)]
        assert set(steps) == set(range(1, 31)) and steps[-1] == 30, steps  # resumed from its own checkpoint
        log = (run_dir / "slurm" / f"{job}_0_log.err").read_text()
        assert f"without {victim}" in log, log[-2000:]
    finally:
        start_node(victim, slurm_cluster)
