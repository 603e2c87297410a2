"""A compute node dies mid-run: the job is requeued by itself without it, and completes.

On the local cluster `slurm/cluster/node.sh kill NODE` SIGKILLs the node's slurmd and
every task on it, as a crash would. The surviving ranks see their peer vanish, classify
the failure from the heartbeats (`failure: node_failure`), and one of them requeues the
job with the node excluded (train/harness/badnodes.py: requeuehold, ExcNodeList,
release). The requeued job waits until Slurm declares the node DOWN (SlurmdTimeout=60
here: the dead node holds the job in COMPLETING), then runs on other nodes and resumes
from the last checkpoint.
"""
from __future__ import annotations

import json
import subprocess

import pytest

from conftest import REPO, launcher, run_dir_of, wait_until
from slurm import query
from slurm.env import expand_hostlist
from spec.config import to_run_config
from spec.rundir import read_metrics, read_run_json

pytestmark = [pytest.mark.slurm, pytest.mark.slurm_whole, pytest.mark.slow]  # resumes on the nodes left
NODE_SH = str(REPO / "slurm" / "cluster" / "node.sh")


def test_dead_node_is_excluded_by_an_automatic_requeue(tmp_path, slurm_cluster):
    proc = launcher(["+cluster=localslurm", "cluster.nodes=2", "train.steps=40", "fault.step_delay_s=0.3",
                     "checkpoint.every_steps=5"], cwd=tmp_path, env=slurm_cluster, timeout=120)
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
        assert info["suspect_nodes"] == [victim] and set(info["dead_ranks"]) == {2, 3}
        assert info["excluded_nodes"] == [victim] and info["fault_requeues"] == 1
        assert to_run_config(run_dir / "config.yaml").cluster.exclude == victim  # a later resume avoids it too
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
        subprocess.run(["bash", NODE_SH, "start", victim], env=slurm_cluster, capture_output=True)
        wait_until(lambda: subprocess.run(["sinfo", "-h", "-n", victim, "-o", "%T"], env=slurm_cluster,
                                          capture_output=True, text=True).stdout.strip() == "idle", 90,
                   f"{victim} back in service")
