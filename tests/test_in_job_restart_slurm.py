"""Restarts inside the job (cluster.in_job_restarts) on the real local Slurm cluster.

A rank killed without a word, a rank's error and, later in the same job, a hang are each
restarted inside the allocation: one job id, SLURM_RESTART_COUNT 0, no requeue, the per-step losses of an
uninterrupted run (bitwise: fp32 DDP on CPU). A rank that fails at the same step every
time ends the run after two tries (the crash-loop guard), not cluster.in_job_restarts.
A user's script is restarted too, and resumes by itself.
"""
from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from conftest import final_states, job_gone, launcher, run_dir_of, submit_run, wait_until
from spec.rundir import read_metrics, read_run_json

pytestmark = [pytest.mark.slurm, pytest.mark.slow]
# 2 nodes x 1 rank, checkpoints at steps 3, 6, 9 (and the last).
ARGS = ["+cluster=localslurm", "cluster.nodes=2", "cluster.gpus_per_node=1", "train.steps=12", "train.seq_len=32",
        "data.num_tokens=50000", "checkpoint.every_steps=3"]


def ended(job: str, run_dir: Path, env: dict, timeout: float = 300) -> dict:
    """run.json once the job has left the queue (a restart's moment of ``restarting``
    is not an end)."""
    wait_until(lambda: job_gone(job, env), timeout, f"job {job} to leave the queue")
    return read_run_json(run_dir)


@pytest.fixture(scope="module")
def reference(tmp_path_factory, slurm_cluster):
    """The uninterrupted losses, on the same 2 x 1 layout."""
    work = tmp_path_factory.mktemp("reference")
    proc = launcher(ARGS + ["launcher.wait=true"], cwd=work, env=slurm_cluster, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return {r["step"]: r["loss"] for r in read_metrics(run_dir_of(proc.stdout))}


def test_a_killed_rank_an_error_then_a_hang_are_restarted_inside_the_job(tmp_path, slurm_cluster, reference):
    """Rank 1 SIGKILLed at step 4 (nothing recorded by itself: its node's agent records it
    at once, long before the hang check), rank 1's error at step 7, rank 0's hang at step 10:
    three restarts inside the job, by the warm agents, and the losses of an uninterrupted run."""
    job, run_dir = submit_run(ARGS + ["fault.kill_at_step=4", "fault.raise_at_step=7", "fault.raise_rank=1",
                                      "fault.hang_rank=0", "fault.hang_at_step=10", "cluster.hang_timeout_s=10"],
                              tmp_path, slurm_cluster)
    info = ended(job, run_dir, slurm_cluster)
    assert info["status"] == "completed", info
    assert (info["job_id"], info["restart_count"], info["segments"]) == (job, 0, 4)
    killed, first, second = info["in_job_restarts"]
    hosts = info["hostnames"]  # one per node, in rank order
    assert (killed["segment"], killed["reason"], killed["step"], killed["rank"], killed["node"], killed["signal"],
            killed["detected_by"]) == (0, "rank_failure", 4, 1, hosts[1], "SIGKILL", "agent"), killed
    kill_time = json.loads((run_dir / "faults" / "kill_at_step.json").read_text())["time"]
    assert kill_time <= killed["failed_at"] < kill_time + 10  # recorded before the hang check (10 s) could fire
    assert (first["segment"], first["reason"], first["step"], first["rank"], first["node"]) == (1, "error", 7, 1,
                                                                                                hosts[1])
    assert "fault.raise_at_step=7: injected failure" in first["error"]
    assert (second["segment"], second["reason"], second["step"], second["rank"], second["node"]) == (2, "hang", 10, 0,
                                                                                                     hosts[0])
    for restart in (killed, first, second):
        assert restart["job_id"] == job and restart["downtime_s"] > 0 and restart["seconds_lost"] > 0, restart
    assert [r["srun"] for r in (killed, first, second)] == [0, 1, 2]  # the agents' starts, one srun
    rows = read_metrics(run_dir)
    assert [r["loss"] for r in rows] == [reference[r["step"]] for r in rows]  # every segment's rows, bitwise
    assert {r["step"] for r in rows} == set(reference) and {r["segment"] for r in rows} == {0, 1, 2, 3}
    assert final_states(job, slurm_cluster) == ["COMPLETED"]
    log = (run_dir / "logs" / "rank0.log").read_text()
    assert all(f"resumed from step {s} (segment {g})" in log for s, g in ((3, 1), (6, 2), (9, 3))), log[-3000:]


def test_a_taken_rendezvous_port_is_restarted_inside_the_job(tmp_path, slurm_cluster, reference):
    """Rank 0 of the first srun cannot bind the job's port (fault.port_taken_in_srun=0: it
    listens there itself, as another connection's ephemeral end could): run.json records
    the rendezvous failure and asks a restart and exits; rank 1, waiting on a socket that
    never answers, is ended at once by its node's agent, which saw the restart asked (no
    longer by the step loop after its grace: tests/test_in_job_restart.py tests that path
    with stand-ins); the agents fork the next start's ranks, whose port differs, inside
    the same srun."""
    job, run_dir = submit_run(ARGS + ["fault.port_taken_in_srun=0", "cluster.hang_timeout_s=10"], tmp_path,
                              slurm_cluster)
    info = ended(job, run_dir, slurm_cluster)
    assert info["status"] == "completed", info
    assert (info["job_id"], info["restart_count"], info["segments"]) == (job, 0, 1), info
    [restart] = info["in_job_restarts"]
    assert (restart["reason"], restart["rank"], restart["segment"], restart["srun"]) == ("rendezvous", 0, 0, 0)
    assert "EADDRINUSE" in restart["error"] and restart["downtime_s"] > 0, restart
    rows = read_metrics(run_dir)
    assert [r["loss"] for r in rows] == [reference[r["step"]] for r in rows] and {r["step"] for r in rows} == set(reference)
    assert final_states(job, slurm_cluster) == ["COMPLETED"]
    err = "".join(p.read_text() for p in (run_dir / "slurm").glob("*_agent1_log.err"))  # node 1's agent
    assert "restart asked (rendezvous, rank 0): stopping the node's ranks" in err, err[-3000:]
    assert "restarting the node's ranks from the warm agent (start 1 of the step)" in err, err[-3000:]


def test_the_same_error_at_the_same_step_ends_the_run_after_two_tries(tmp_path, slurm_cluster):
    job, run_dir = submit_run(ARGS + ["fault.raise_at_step=8", "fault.raise_rank=1", "fault.repeat=true"], tmp_path,
                              slurm_cluster)
    info = ended(job, run_dir, slurm_cluster)
    assert info["status"] == "failed" and info["segments"] == 2 and info["restart_count"] == 0, info
    assert len(info["in_job_restarts"]) == 1 and info["in_job_restart"].startswith("not restarted: crash loop")
    assert "fault.raise_at_step=8: injected failure" in info["error"] and info["failed_rank"] == 1
    assert final_states(job, slurm_cluster) == ["FAILED"]


USER_SCRIPT = """\
import os
import pathlib

tries = pathlib.Path(os.environ["STO_RUN_DIR"]) / "tries"
count = len(tries.read_text()) if tries.exists() else 0
tries.write_text("x" * (count + 1))
if count == 0:
    raise RuntimeError("the first try fails")
"""


def test_a_users_script_is_restarted_inside_the_job(tmp_path, slurm_cluster):
    script = tmp_path / "flaky.py"
    script.write_text(USER_SCRIPT)
    job, run_dir = submit_run(["+cluster=localslurm", "cluster.nodes=1", "cluster.gpus_per_node=1",
                               f"entrypoint={script}"], tmp_path, slurm_cluster)
    info = ended(job, run_dir, slurm_cluster)
    assert info["status"] == "completed" and (run_dir / "tries").read_text() == "xx", info
    [restart] = info["in_job_restarts"]
    assert (restart["job_id"], restart["reason"], restart["rank"]) == (job, "error", 0)
    assert "the first try fails" in restart["error"] and info["restart_count"] == 0


def test_a_slow_save_is_not_a_hang_and_a_stuck_writer_is_named(tmp_path, slurm_cluster, reference):
    """A save is progress, not a hang: with cluster.hang_timeout_s=10 the save of
    step 3 takes 15 s (fault.slow_save_s on every rank, after the files are written) and
    is not called a hang, since a save is bounded by checkpoint.save_timeout_s (20 s here:
    2 x the hang timeout, the filesystem being unknown); the save of step 6 never returns
    on rank 1 (fault.hang_in=save), which the watchdog names after 20 s, in the save phase,
    and the job restarts inside itself from step 3 and ends with the uninterrupted losses."""
    job, run_dir = submit_run(ARGS + ["cluster.hang_timeout_s=10", "fault.slow_save_s=15", "fault.slow_save_at_step=3",
                                      "fault.hang_in=save", "fault.hang_rank=1", "fault.hang_at_step=6"],
                              tmp_path, slurm_cluster)
    info = ended(job, run_dir, slurm_cluster)
    assert info["status"] == "completed", info
    assert (info["job_id"], info["restart_count"], info["segments"]) == (job, 0, 2), info
    [restart] = info["in_job_restarts"]
    assert (restart["reason"], restart["rank"], restart["node"]) == ("hang", 1, info["hostnames"][1]), restart
    assert "a checkpoint's save did not end" in restart["error"], restart
    hang = json.loads((run_dir / "hang.json").read_text())
    assert hang["stuck_ranks"] == [1] and hang["in_save"] and hang["timeout_s"] == 20, hang
    assert [(b["rank"], b["phase"], b["step"]) for b in hang["ranks"]] == [(0, "collective", 6), (1, "checkpoint", 6)]
    log = (run_dir / "logs" / "rank0.log").read_text()
    slow = re.search(r"checkpoint step 3 committed in ([\d.]+) s", log)
    assert slow and float(slow.group(1)) >= 15, log[-3000:]  # longer than the hang timeout, and no hang
    assert "resumed from step 3 (segment 1)" in log
    rows = read_metrics(run_dir)
    assert [r["loss"] for r in rows] == [reference[r["step"]] for r in rows]
    assert {r["step"] for r in rows} == set(reference) and {r["segment"] for r in rows} == {0, 1}
    assert final_states(job, slurm_cluster) == ["COMPLETED"]
