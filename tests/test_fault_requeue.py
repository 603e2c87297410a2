"""A slow node in the preflight, then a node's hardware fault: the job requeues itself
without each, on the local cluster, and completes on the nodes left.

One 2-node job on the 4-node cluster (train/harness/badnodes.py):

1. first run (segment 0): rank 2 sleeps inside its timed preflight matmuls
   (``fault.preflight_slow_rank``), so its node measures far below the median; with
   ``train.preflight_exclude=true`` rank 0 records ``failure: preflight_outlier`` and
   requeues the job without that node;
2. second run (segment 1, ``fault.hardware_fault_restart=1``): rank 2, now on another
   node, raises CUDA's error for an uncorrectable ECC error at step 5
   (``fault.hardware_fault_*``); its own error names a hardware fault of
   its node (``failure: hardware_fault``), and the job is requeued without it too;
3. third run: on the two nodes left, it resumes from the checkpoint of step 4 and completes.

The injected slowness (8 s over 8 matmuls of 512^2: 0.27 GFLOP/s) is an outlier at the
threshold used here (0.1 x the median of the two nodes, i.e. below 0.053 x the other node)
while the other node measures above 5 GFLOP/s (about 45 on an idle machine, seen); a
clean run would need one node 19x slower than the other to see a false outlier.
"""
from __future__ import annotations

import pytest

from conftest import launcher, run_dir_of, wait_until
from spec.config import to_run_config
from spec.rundir import read_metrics, read_run_json

pytestmark = [pytest.mark.slurm, pytest.mark.slurm_whole, pytest.mark.slow]  # resumes on the nodes left


def test_preflight_outlier_then_hardware_fault_are_excluded_by_automatic_requeues(tmp_path, slurm_cluster):
    # one rank a node: rank 1 is the second node's
    proc = launcher(["+cluster=localslurm", "cluster.nodes=2", "cluster.gpus_per_node=1", "train.steps=12",
                     "checkpoint.every_steps=2",
                     "train.preflight=true", "train.preflight_exclude=true", "train.preflight_outlier=0.1",
                     "fault.preflight_slow_rank=1", "fault.preflight_slow_s=8",
                     "fault.hardware_fault_rank=1", "fault.hardware_fault_at_step=5", "fault.hardware_fault_restart=1"],
                    cwd=tmp_path, env=slurm_cluster, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    run_dir = run_dir_of(proc.stdout)
    info = wait_until(lambda: (lambda i: i if i.get("status") in ("completed", "failed") and i.get("segments") == 3
                               else None)(read_run_json(run_dir)), 240, "the third run to end")
    assert info["status"] == "completed", info
    slow, faulty = (entry["nodes"] for entry in info["node_exclusions"])
    first, second = info["node_exclusions"]
    assert first["failure"] == "preflight_outlier" and first["segment"] == 1 and len(slow) == 1
    assert "gflops" in first["error"] and slow[0] in first["error"]
    assert second["failure"] == "hardware_fault" and second["segment"] == 2 and len(faulty) == 1
    assert second["detail"]["kind"] == "gpu_ecc" and second["detail"]["host"] == faulty[0]
    assert slow != faulty and info["excluded_nodes"] == sorted(slow + faulty)
    assert info["job_id"] == first["job_id"] == second["job_id"] and info["fault_requeues"] == 2
    assert not set(info["hostnames"]) & set(slow + faulty)
    assert set(to_run_config(run_dir / "config.yaml").cluster.exclude.split(",")) == set(slow + faulty)
    steps = [r["step"] for r in read_metrics(run_dir)]
    assert set(steps) == set(range(1, 13)) and steps[-1] == 12  # steps 5.. ran again from step 4's checkpoint
    log = (run_dir / "logs" / "rank0.log").read_text()
    assert "resumed from step 4" in log, log[-2000:]
