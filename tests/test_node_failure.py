"""A compute node dies mid-run: the job is requeued by itself without it, and completes.

On the local cluster `slurm/cluster/node.sh kill NODE` SIGKILLs the node's slurmd and
every task on it, as a crash would. The surviving ranks see their peer vanish, classify
the failure from the heartbeats (`failure: node_failure`), and one of them requeues the
job with the node excluded (train/harness/badnodes.py: requeuehold, ExcNodeList,
release). The node is then started again, idle, yet the requeued job runs on other
nodes and resumes from the last checkpoint.

Seen here (Slurm 22.05): left dead, the node holds the requeued job in COMPLETING until
Slurm declares it DOWN (SlurmdTimeout, 120 s here): starting it again while the job waits ends
that at once (the whole test then takes about 45 s).
"""
from __future__ import annotations

import json
import subprocess
import time

import pytest

from conftest import REPO, launcher, run_dir_of, wait_until
from slurm import query
from slurm.env import expand_hostlist
from spec.config import to_run_config
from spec.rundir import read_metrics, read_run_json

pytestmark = [pytest.mark.slurm, pytest.mark.slurm_whole, pytest.mark.slow]  # resumes on the nodes left
NODE_SH = str(REPO / "slurm" / "cluster" / "node.sh")


def test_dead_node_is_excluded_by_an_automatic_requeue(tmp_path, slurm_cluster):
    # one rank a node (what a node failure is does not depend on it: every rank of a node silent)
    proc = launcher(["+cluster=localslurm", "cluster.nodes=2", "cluster.gpus_per_node=1", "train.steps=40",
                     "fault.step_delay_s=0.3", "checkpoint.every_steps=5"], cwd=tmp_path, env=slurm_cluster,
                    timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    run_dir = run_dir_of(proc.stdout)
    wait_until(lambda: len(read_metrics(run_dir)) >= 12, 120, "12 steps")
    first = read_run_json(run_dir)
    victim, job = first["hostnames"][1], first["job_id"]
    try:
        subprocess.run(["bash", NODE_SH, "kill", victim], env=slurm_cluster, check=True, capture_output=True)
        info = wait_until(lambda: (lambda i: i if i.get("node_exclusions") else None)(read_run_json(run_dir)), 120,
                          "the automatic requeue")
        [entry] = info["node_exclusions"]
        assert entry["nodes"] == [victim] and entry["failure"] == "node_failure" and entry["job_id"] == job
        assert info["suspect_nodes"] == [victim] and set(info["dead_ranks"]) == {1}
        assert info["excluded_nodes"] == [victim] and info["fault_requeues"] == 1
        assert to_run_config(run_dir / "config.yaml").cluster.exclude == victim  # a later resume avoids it too
        # The node comes back (a reboot) before the job runs again: only the exclusion keeps
        # the job off it (and its return ends the old segment's COMPLETING before SlurmdTimeout).
        start_node(victim, slurm_cluster)
        info = wait_until(lambda: (lambda i: i if i.get("status") in ("completed", "failed") else None)(
            read_run_json(run_dir)), 240, "the requeued job to end")
        assert info["status"] == "completed", info
        assert info["job_id"] == job and info["segments"] == 2 and victim not in info["hostnames"]
        # accounting: the job's newest row (it reaches slurmdbd after run.json says completed)
        last = wait_until(lambda: (lambda rows: rows[-1] if rows and rows[-1]["State"] == "COMPLETED" else None)(
            query.sacct_history([job], env=slurm_cluster).get(job)), 60, "sacct to show the job completed")
        assert victim not in expand_hostlist(last["NodeList"]), last
        for host in info["hostnames"]:  # each node wrote its own facts, Slurm's name for it included
            facts = json.loads((run_dir / "nodes" / f"{host}.json").read_text())
            assert facts["slurm_node"] == host and facts["slurm_restart_count"] == 1 and facts["torch"]
        steps = [r["step"] for r in read_metrics(run_dir)]
        assert steps[-1] == 40 and set(steps) == set(range(1, 41))  # nothing lost, resumed from a checkpoint
        log = (run_dir / "logs" / "rank0.log").read_text()
        assert "resumed from step 10" in log or "resumed from step 15" in log, log[-2000:]
    finally:
        start_node(victim, slurm_cluster)


def start_node(node: str, env: dict) -> None:
    """`node.sh start NODE` (nothing when it runs), then wait until sinfo says idle.

    After the kill and the requeue, sinfo was seen saying `mixed` for minutes while
    `scontrol show node` said State=IDLE CPUAlloc=0; a DOWN and RESUME of the node made
    sinfo agree at once, so that is done when it happens (other tests wait on sinfo)."""
    started = subprocess.run(["bash", NODE_SH, "start", node], env=env, capture_output=True, text=True)
    t0, seen, reset = time.time(), [], []

    def idle() -> bool:
        seen.append(set(slurm(["sinfo", "-h", "-n", node, "-o", "%T"], env).split()))
        if seen[-1] == {"idle"}:
            return True
        shown = slurm(["scontrol", "show", "node", node], env)
        if not reset and time.time() - t0 > 10 and "State=IDLE " in shown and "CPUAlloc=0 " in shown:
            reset.append(f"sinfo {seen[-1]}, scontrol IDLE CPUAlloc=0 after {time.time() - t0:.0f} s")
            slurm(["scontrol", "update", f"nodename={node}", "state=down", "reason=sinfo_out_of_date"], env)
            slurm(["scontrol", "update", f"nodename={node}", "state=resume"], env)
        return False
    try:
        wait_until(idle, 240, f"{node} back in service")
    except AssertionError as exc:
        raise AssertionError(f"{exc}: sinfo said {seen[-1:]}; reset: {reset}; node.sh start: "
                             f"{started.stdout.strip()} {started.stderr.strip()}") from None
    print(f"{node} idle after {time.time() - t0:.0f} s; reset: {reset}")


def slurm(cmd: list, env: dict) -> str:
    return subprocess.run(cmd, env=env, capture_output=True, text=True).stdout
