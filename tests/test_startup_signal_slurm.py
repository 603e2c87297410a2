"""The warning signal at the worst moment: USR2 the instant the job's first task process
exists on the real cluster, while its tasks are still starting Python (no handler of ours yet, maybe not
even submitit's). Slurm may send ``--signal``'s warning up to 60 s early, so on a busy
cluster this happens. Whichever handler the signal meets (none: the batch script's
teardown requeues the step that died of it; submitit's: TaskCall.checkpoint requeues; ours:
checkpoint, count, requeue), the job is requeued and completes: never FAILED with requeues
left, never a run directory that does not say how it ended."""
from __future__ import annotations

import subprocess
import time
from pathlib import Path

import pytest

from conftest import launcher, run_dir_of
from spec.rundir import read_metrics, read_run_json

pytestmark = [pytest.mark.slurm, pytest.mark.slow]


def _first_task_exists(job: str, env: dict, timeout: float = 120) -> None:
    """Until a task of the job's first step exists: its ``task_wrapper.sh`` process (the local
    cluster's nodes are this machine). A signal sent while the step is listed but before
    slurmstepd has forked its tasks reaches no process at all and Slurm drops it (a loaded
    suite run saw that: the job then simply completed), so the earliest moment a signal can
    hit start-up is the first task process."""
    deadline = time.time() + timeout
    marker = f"SLURM_JOB_ID={job}".encode()
    while time.time() < deadline:
        for proc in Path("/proc").iterdir():
            try:
                argv = (proc / "cmdline").read_bytes().split(b"\0")
                # the task itself (`bash .../task_wrapper.sh python ...`), not srun, whose
                # command line names the wrapper too
                if (len(argv) > 1 and argv[0].endswith(b"bash") and argv[1].endswith(b"task_wrapper.sh")
                        and marker in (proc / "environ").read_bytes().split(b"\0")):
                    return
            except OSError:  # not a process, or it ended
                continue
        time.sleep(0.02)
    raise AssertionError(f"job {job}: no task process after {timeout} s")


def _history(job: str, env: dict) -> list:
    out = subprocess.run(["sacct", "-D", "-X", "-n", "-P", "-j", job, "-o", "JobID,State"], env=env,
                         capture_output=True, text=True, check=True).stdout
    return [line.split("|")[1].split()[0] for line in out.splitlines() if line.strip()]


def _ended(job: str, env: dict, timeout: float = 300) -> list:
    deadline = time.time() + timeout
    while time.time() < deadline:
        queued = subprocess.run(["squeue", "-h", "-j", job], env=env, capture_output=True, text=True).stdout.strip()
        states = _history(job, env)
        if not queued and states and states[-1] not in ("PENDING", "RUNNING", "REQUEUED", "COMPLETING"):
            return states
        time.sleep(0.5)
    raise AssertionError(f"job {job} did not end in {timeout} s: {_history(job, env)}")


def test_usr2_as_the_step_starts_ends_in_a_requeue_and_completion(tmp_path, slurm_cluster):
    # time_min=5: submitit takes any signal of a job of 10 minutes or less for a time-out.
    proc = launcher(["+cluster=localslurm", "cluster.nodes=1", "cluster.gpus_per_node=2", "train.steps=4",
                     "train.seq_len=32", "cluster.time_min=5"], cwd=tmp_path, env=slurm_cluster, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    run_dir = run_dir_of(proc.stdout)
    job = str(read_run_json(run_dir)["job_id"])
    _first_task_exists(job, slurm_cluster)
    subprocess.run(["scancel", "--signal=USR2", job], env=slurm_cluster, check=True)
    states = _ended(job, slurm_cluster)
    info = read_run_json(run_dir)
    assert states[-1] == "COMPLETED" and "FAILED" not in states, (states, info)
    assert info["status"] == "completed" and info.get("restart_count", 0) >= 1, (states, info)
    assert [r["step"] for r in read_metrics(run_dir)][-1] == 4
