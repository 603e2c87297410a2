"""A job whose tasks have no Slurm client, as in a container image without it: restart
inside the job, exclusion and preemption still work, done by the batch script
(slurm/request.py), on the real local Slurm cluster.

The tasks' PATH (cluster.env.PATH) puts failing stand-ins of scontrol, squeue, sacct,
scancel and sinfo first, which note every call: none is made. One 1-node, 1-rank job:

1. segment 0: the rank raises at step 3: restarted inside the job (the step loop);
2. segment 1 resumes from step 2; at step 5 the rank raises CUDA's uncorrectable ECC
   error: its node is blamed, and the batch script requeues the job without it
   (requeuehold, ExcNodeList, release);
3. segment 2 resumes from step 4 on another node; the test sends USR2 (a preemption):
   checkpoint, and the batch script requeues the job;
4. segment 3 resumes and completes.

The time limit with the same hidden client: tests/test_preemption.py; the batch script's
branches without a cluster: tests/test_slurm_request.py.
"""
from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from conftest import final_states, job_gone, submit_run, wait_until
from helpers import hidden_slurm_client
from spec.rundir import read_metrics, read_run_json

pytestmark = [pytest.mark.slurm, pytest.mark.slow]


def test_restart_exclusion_and_preemption_without_a_slurm_client_in_the_tasks(tmp_path, slurm_cluster):
    path, calls = hidden_slurm_client(tmp_path)
    job, run_dir = submit_run(["+cluster=localslurm", "cluster.nodes=1", "cluster.gpus_per_node=1", "train.steps=20",
                               "train.seq_len=32", "data.num_tokens=50000", "checkpoint.every_steps=2",
                               "fault.step_delay_s=0.5", "fault.raise_at_step=3", "fault.hardware_fault_rank=0",
                               "fault.hardware_fault_at_step=5", "fault.hardware_fault_restart=1",
                               f'+cluster.env.PATH="{path}"'], tmp_path, slurm_cluster)
    wait_until(lambda: any(r["segment"] == 2 for r in read_metrics(run_dir)), 300, "a step on the node left")
    subprocess.run(["scancel", "--signal=USR2", job], env=slurm_cluster, check=True)
    wait_until(lambda: job_gone(job, slurm_cluster), 300, f"job {job} to leave the queue")
    info = read_run_json(run_dir)
    assert info["status"] == "completed", info
    assert not calls.exists(), calls.read_text()  # the tasks called no Slurm client
    assert (info["job_id"], info["segments"], info["restart_count"]) == (job, 4, 2)
    [restart] = info["in_job_restarts"]
    assert (restart["job_id"], restart["segment"], restart["reason"], restart["step"]) == (job, 0, "error", 3)
    [exclusion] = info["node_exclusions"]
    assert (exclusion["failure"], exclusion["job_id"], exclusion["segment"]) == ("hardware_fault", job, 2)
    assert info["excluded_nodes"] == exclusion["nodes"] and info["fault_requeues"] == 1
    assert not set(info["hostnames"]) & set(exclusion["nodes"])
    assert info["preemptions"] == 1 and not info.get("timeouts")
    assert {r["step"] for r in read_metrics(run_dir)} == set(range(1, 21))
    assert final_states(job, slurm_cluster)[-1] == "COMPLETED"
    batch_log = "".join(p.read_text() for p in Path(run_dir, "slurm").glob(f"{job}_0_log.err"))
    assert f"the step asks: exclude job {job} without {exclusion['nodes'][0]}" in batch_log
    assert f"the step asks: requeue job {job} (preemption)" in batch_log
