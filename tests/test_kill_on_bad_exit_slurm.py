"""A task that dies without a word, on the real local Slurm cluster: srun's
--kill-on-bad-exit=1 ends the step at once (its peers get srun's SIGTERM), the batch
script's step loop reads srun's report of the dead task and restarts the step inside the
job (train.harness.restart.after_srun), and the run completes under the same job id.
Ranks are numbered node by node while srun starts one task per rank: a cyclic
distribution is refused at launch, before any job.
"""
from __future__ import annotations

import time

import pytest

from conftest import final_states, job_gone, launcher, submit_run, wait_until
from spec.rundir import read_run_json

pytestmark = [pytest.mark.slurm, pytest.mark.slow]

# Rank 1 SIGKILLs itself on the first try, after a logged step, while rank 0 sleeps outside
# any collective (it would wait there until the job's time limit without kill-on-bad-exit);
# the second try ends at once.
SCRIPT = """
import os, signal, time
from pathlib import Path
from train import session

rank = int(os.environ["RANK"])
marker = Path(session.run_dir) / "killed"
if marker.exists():
    session.log(2, loss=0.5)
else:
    session.log(1, loss=1.0)
    time.sleep(2)  # heartbeats carry the step
    if rank == 1:
        marker.write_text("x")
        os.kill(os.getpid(), signal.SIGKILL)
    time.sleep(120)
"""


def test_a_users_rank_killed_outside_any_collective_is_restarted_inside_the_job(tmp_path, slurm_cluster):
    script = tmp_path / "killed.py"
    script.write_text(SCRIPT)
    start = time.monotonic()
    job, run_dir = submit_run(["+cluster=localslurm", "cluster.nodes=2", "cluster.gpus_per_node=1",
                               "cluster.hang_timeout_s=60", f"entrypoint={script}"], tmp_path, slurm_cluster)
    wait_until(lambda: job_gone(job, slurm_cluster), 90, f"job {job} to leave the queue")
    info = read_run_json(run_dir)
    assert info["status"] == "completed", info
    assert (info["job_id"], info["restart_count"], info["segments"]) == (job, 0, 2)
    [restart] = info["in_job_restarts"]
    assert (restart["job_id"], restart["reason"], restart["rank"], restart["signal"]) == (
        job, "rank_failure", 1, "SIGKILL"), restart
    assert restart["node"] == info["hostnames"][1] and restart["step"] == 2 and restart["downtime_s"] > 0
    # srun's line: the task wrapper's status, 128 + 9 (slurm/task_wrapper.sh starts Python)
    assert restart["srun_error"].endswith(": task 1: Exited with exit code 137") and restart["exit_code"] == 137
    assert final_states(job, slurm_cluster) == ["COMPLETED"]
    assert time.monotonic() - start < 60  # no wait for the sleeping peer: srun ended the step at once


def test_a_cyclic_distribution_is_refused_at_launch_without_a_job(tmp_path, slurm_cluster):
    proc = launcher(["+cluster=localslurm", "cluster.nodes=2", "cluster.srun_args=['--distribution=cyclic']"],
                    cwd=tmp_path, env=slurm_cluster, timeout=120)
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0 and "submitted job" not in out, out
    assert "cluster.srun_args[0]='--distribution=cyclic': cyclic distribution numbers ranks across nodes" in out
    assert "--distribution=block" in out and not list(tmp_path.glob("runs/*/slurm/*_submitted.pkl"))
