"""Preemption on the real local Slurm cluster: USR2, partition preemption, time limit.

Every interrupted run must end with the same per-step losses as an uninterrupted run
of the same config (bitwise: fp32 DDP on CPU), with the interruptions counted in
run.json and every segment's metrics kept.
"""
from __future__ import annotations

import gzip
import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import REPO, final_states, job_gone, launcher, run_dir_of, submit_run, wait_until
from warm import pythonpath
from helpers import hidden_slurm_client
from spec.rundir import read_metrics, read_run_json

pytestmark = [pytest.mark.slurm, pytest.mark.slow]
# 2 nodes x 1 rank: preemption and requeue act on the job and its nodes, not on a node's
# ranks (2 x 2 layouts: tests/test_e2e_slurm.py, test_reshard_slurm.py); half the CPU.
ARGS = ["+cluster=localslurm", "cluster.nodes=2", "cluster.gpus_per_node=1", "train.steps=24",
        "train.seq_len=32", "data.num_tokens=50000"]


def by_step(run_dir: Path) -> dict:
    return {r["step"]: r["loss"] for r in read_metrics(run_dir)}


def submit(tmp_path: Path, env: dict, extra: list) -> tuple[str, Path]:
    return submit_run(ARGS + extra, tmp_path, env)


def steps_logged(run_dir: Path) -> int:
    return len(read_metrics(run_dir))


def final_status(run_dir: Path, statuses=("completed", "stopped", "failed")):
    status = read_run_json(run_dir).get("status")
    return status if status in statuses else None


@pytest.fixture(scope="module")
def reference(tmp_path_factory, slurm_cluster):
    """The uninterrupted curve, on the same 2 x 1 layout."""
    work = tmp_path_factory.mktemp("reference")
    proc = launcher(ARGS + ["launcher.wait=true"], cwd=work, env=slurm_cluster, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return by_step(run_dir_of(proc.stdout))


def test_usr2_checkpoints_requeues_and_resumes_exactly(tmp_path, slurm_cluster, reference):
    job, run_dir = submit(tmp_path, slurm_cluster, ["fault.step_delay_s=0.4"])
    wait_until(lambda: steps_logged(run_dir) >= 4, 120, "4 steps")
    subprocess.run(["scancel", "--signal=USR2", job], env=slurm_cluster, check=True)
    assert wait_until(lambda: final_status(run_dir), 240, "the run to finish") == "completed"
    info = read_run_json(run_dir)
    assert (info["preemptions"], info.get("timeouts", 0), info["segments"]) == (1, 0, 2)
    assert info["job_id"] == job and info["restart_count"] == 1
    assert by_step(run_dir) == reference
    segments = [r["segment"] for r in read_metrics(run_dir)]
    assert segments == sorted(segments) and set(segments) == {0, 1}
    log = (run_dir / "logs" / "rank0.log").read_text()
    assert "preemption: checkpoint committed; requeue of job" in log and "resumed from step" in log


@pytest.mark.slurm_whole  # the high job takes all 4 nodes: it would preempt the other runs' jobs too
def test_partition_preemption_requeues_and_resumes(tmp_path, slurm_cluster, reference):
    job, run_dir = submit(tmp_path, slurm_cluster, ["fault.step_delay_s=0.4"])
    wait_until(lambda: steps_logged(run_dir) >= 4, 120, "4 steps")
    # A job in the high-priority partition that needs every node preempts the low one.
    high = subprocess.run(["sbatch", "--parsable", "-p", "high", "-N", "4", "--ntasks-per-node=4",
                           "--output=/dev/null", "--wrap", "sleep 3"], env=slurm_cluster, check=True,
                          capture_output=True, text=True).stdout.strip()
    wait_until(lambda: job_gone(high, slurm_cluster), 120, "the high-priority job")
    assert wait_until(lambda: final_status(run_dir), 240, "the preempted run to finish") == "completed"
    info = read_run_json(run_dir)
    assert info["preemptions"] >= 1 and info["segments"] >= 2
    assert by_step(run_dir) == reference
    acct = final_states(job, slurm_cluster)
    assert acct[-1] == "COMPLETED" and any(s in ("PREEMPTED", "REQUEUED") for s in acct[:-1]), acct


def test_time_limit_is_a_timeout_and_the_cap_stops_it(tmp_path, slurm_cluster):
    # 1 minute limit, signal 30 s before it; never finishes; one requeue allowed. The tasks
    # have no Slurm client (failing stand-ins first on their PATH): the time left and the
    # requeue come from the batch script (slurm/request.py).
    path, client_calls = hidden_slurm_client(tmp_path)
    extra = ["train.steps=100000", "fault.step_delay_s=0.2", "cluster.time_min=1", "cluster.signal_delay_s=30",
             "cluster.max_requeues=1", f'+cluster.env.PATH="{path}"']
    job, run_dir = submit(tmp_path, slurm_cluster, extra)
    assert wait_until(lambda: final_status(run_dir), 300, "two timeouts") == "stopped"
    info = read_run_json(run_dir)
    assert info["timeouts"] == 2 and info.get("preemptions", 0) == 0 and info["segments"] == 2
    assert "requeue cap" in info["stop_reason"]
    wait_until(lambda: job_gone(job, slurm_cluster), 60, "the job to leave the queue")
    rows = read_metrics(run_dir)
    first_segment_end = max(r["step"] for r in rows if r["segment"] == 0)
    assert min(r["step"] for r in rows if r["segment"] == 1) == first_segment_end + 1  # nothing lost
    # Re-running the command of a capped run resumes it rather than starting over.
    resumed = launcher(ARGS + extra, cwd=tmp_path, env=slurm_cluster, timeout=60)
    assert resumed.returncode == 0 and run_dir_of(resumed.stdout) == run_dir
    new_job = next(line.split()[2] for line in resumed.stdout.splitlines() if line.startswith("submitted job"))
    log = run_dir / "logs" / "rank0.log"
    wait_until(lambda: log.read_text().count("resumed from step") == 2, 120, "the third segment to resume")
    subprocess.run(["scancel", new_job], env=slurm_cluster)
    assert read_run_json(run_dir)["segments"] == 3
    assert not client_calls.exists(), client_calls.read_text()


def test_a_failing_run_is_not_requeued(tmp_path, slurm_cluster):
    """Without restarts inside the job (cluster.in_job_restarts=0; with them:
    tests/test_in_job_restart_slurm.py) an exception (a bug, an OOM) ends the run as
    failed, with its checkpoints kept for launcher.resume; the job is not requeued (it
    would fail again)."""
    job, run_dir = submit(tmp_path, slurm_cluster, ["fault.raise_at_step=5", "checkpoint.every_steps=2",
                                                    "cluster.in_job_restarts=0"])
    assert wait_until(lambda: final_status(run_dir), 120, "the run to end") == "failed"
    wait_until(lambda: job_gone(job, slurm_cluster), 60, "the failed job to leave the queue")
    time.sleep(8)  # longer than cred_expire: a requeued job would be back by now
    assert job_gone(job, slurm_cluster)
    assert final_states(job, slurm_cluster) == ["FAILED"]
    info = read_run_json(run_dir)
    assert "fault.raise_at_step=5: injected failure" in info["error"]
    assert info["segments"] == 1 and not info.get("preemptions") and not info.get("timeouts")
    assert (run_dir / "checkpoints" / "step_00000004").is_dir()  # committed work kept


def test_scancel_saves_but_never_requeues(tmp_path, slurm_cluster):
    """Before the cancel, on the same 2-node run: its slow rank is named (only
    rank 1 sleeps fault.step_delay_s; tests/test_stragglers.py) and both nodes' ranks show
    their stacks on demand (tests/test_stacks.py)."""
    job, run_dir = submit(tmp_path, slurm_cluster, ["fault.step_delay_s=0.4", "fault.step_delay_rank=1",
                                                    "train.steps=200"])
    flagged = wait_until(lambda: (run_dir / "stragglers.json").is_file() and json.loads(
        (run_dir / "stragglers.json").read_text()), 120, "the straggler named")
    assert [(r["rank"], r["node"], r["host"]) for r in flagged["ranks"]] == \
        [(1, 1, read_run_json(run_dir)["hostnames"][1])], flagged
    assert flagged["step"] <= 12 and "straggler: rank 1 (node 1)" in (run_dir / "logs" / "rank0.log").read_text()
    row = read_metrics(run_dir)[-1]
    assert row["fwd_bwd_s"]["max_rank"] == 0 and row["fwd_bwd_s"]["max"] > 0.3  # rank 0 waits for rank 1 in DDP
    # first, what are the two nodes' ranks doing? (tests/test_stacks.py)
    asked = subprocess.run([sys.executable, "-m", "launcher.stacks", str(run_dir), "--timeout", "30"],
                           env={**slurm_cluster, "PYTHONPATH": pythonpath()}, capture_output=True, text=True, timeout=60)
    assert asked.returncode == 0, asked.stdout + asked.stderr
    heads = [json.loads((run_dir / "stacks" / f"rank{r}.txt").read_text().splitlines()[0]) for r in (0, 1)]
    assert [h["node"] for h in heads] == [0, 1], (heads, asked.stdout)  # one rank on each node answered
    assert [h["host"] for h in heads] == read_run_json(run_dir)["hostnames"], (heads, asked.stdout)
    assert "stacks of 2/2 ranks" in asked.stdout
    print(asked.stdout)  # the seconds it took, for the record
    # and a profile of its next steps on both nodes, asked by a touch (item 3; tests/test_profiling.py)
    (run_dir / "PROFILE_NOW").touch()
    traces = wait_until(lambda: sorted((run_dir / "profile").glob("step_*/rank*.json.gz"))
                        if len(list((run_dir / "profile").glob("step_*/rank*.json.gz"))) == 2 else None,
                        60, "traces of ranks 0 and 1 (local rank 0 of each node)")
    assert [t.name for t in traces] == ["rank0.json.gz", "rank1.json.gz"] and traces[0].parent == traces[1].parent
    start = int(traces[0].parent.name.split("_")[1])
    for trace in traces:
        assert f"ProfilerStep#{start}" in gzip.decompress(trace.read_bytes()).decode(), trace
    assert not (run_dir / "PROFILE_NOW").exists()
    subprocess.run(["scancel", job], env=slurm_cluster, check=True)
    wait_until(lambda: job_gone(job, slurm_cluster), 60, "the cancelled job to leave the queue")
    time.sleep(8)  # longer than cred_expire: a requeued job would be back by now
    assert job_gone(job, slurm_cluster)
    info = read_run_json(run_dir)
    assert info["status"] == "interrupted" and info["last_interruption"] == "terminated"
    assert info["segments"] == 1 and not info.get("preemptions")
    assert (run_dir / "checkpoints" / "latest").exists()  # the work done is kept
