"""A compute node dies mid-run: classified as node failure, resumed elsewhere.

On the local cluster `slurm/cluster/node.sh kill NODE` SIGKILLs the node's slurmd and
every task on it, as a crash would. The surviving ranks see their peer vanish, classify
the failure from the heartbeats, record it in run.json and end the job;
`python -m launcher.resume` excludes the node and continues from the last checkpoint.
"""
from __future__ import annotations

import subprocess
import sys

import pytest

from conftest import REPO, launcher, run_dir_of, wait_until
from spec.rundir import read_metrics, read_run_json

pytestmark = [pytest.mark.slurm, pytest.mark.slurm_whole, pytest.mark.slow]  # resumes on the nodes left
NODE_SH = str(REPO / "slurm" / "cluster" / "node.sh")


def test_dead_node_is_classified_and_resume_excludes_it(tmp_path, slurm_cluster):
    proc = launcher(["+cluster=localslurm", "cluster.nodes=2", "train.steps=40", "fault.step_delay_s=0.3",
                     "checkpoint.every_steps=5"], cwd=tmp_path, env=slurm_cluster, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    run_dir = run_dir_of(proc.stdout)
    wait_until(lambda: len(read_metrics(run_dir)) >= 12, 120, "12 steps")
    victim = read_run_json(run_dir)["hostnames"][1]
    try:
        subprocess.run(["bash", NODE_SH, "kill", victim], env=slurm_cluster, check=True, capture_output=True)
        info = wait_until(lambda: (lambda i: i if i.get("failure") else None)(read_run_json(run_dir)), 120,
                          "the failure to be classified")
        assert info["status"] == "failed" and info["failure"] == "node_failure"
        assert info["suspect_nodes"] == [victim] and set(info["dead_ranks"]) == {2, 3}
        resumed = subprocess.run([sys.executable, "-m", "launcher.resume", str(run_dir), "--wait"], cwd=tmp_path,
                                 env=dict(slurm_cluster, PYTHONPATH=str(REPO)), capture_output=True, text=True,
                                 timeout=300)
        assert resumed.returncode == 0, resumed.stdout + resumed.stderr
        assert f"excluding {victim} (node failure" in resumed.stdout
        info = read_run_json(run_dir)
        assert info["status"] == "completed" and victim not in info["hostnames"]
        assert info["excluded_nodes"] == [victim]
        assert f"--exclude={victim}" in (run_dir / "sbatch.sh").read_text()
        steps = [r["step"] for r in read_metrics(run_dir)]
        assert steps[-1] == 40 and set(steps) == set(range(1, 41))  # nothing lost, resumed from a checkpoint
        assert "resumed from step 10" in (run_dir / "logs" / "rank0.log").read_text() or \
            "resumed from step 5" in (run_dir / "logs" / "rank0.log").read_text()
    finally:
        subprocess.run(["bash", NODE_SH, "start", victim], env=slurm_cluster, capture_output=True)
        wait_until(lambda: subprocess.run(["sinfo", "-h", "-n", victim, "-o", "%T"], env=slurm_cluster,
                                          capture_output=True, text=True).stdout.strip() == "idle", 90,
                   f"{victim} back in service")
