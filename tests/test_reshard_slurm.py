"""Resume on another shape on the real local cluster: FSDP on 2 nodes x 2 ranks is
preempted by the high partition (on its own nodes), saves, and is not requeued
(``cluster.max_requeues=0``); ``python -m launcher.resume RUN_DIR cluster.nodes=1``
continues it on 1 node x 2 ranks (the global batch kept: twice the accumulation) to
completion. Every step is logged once and every sample of the global stream was seen
exactly once across the two shapes (the ranks' sample traces)."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest

from conftest import REPO, eligible_nodes, job_gone, submit_run, wait_until
from warm import pythonpath
from spec.rundir import read_metrics, read_run_json
from test_reshard import assert_every_sample_once

pytestmark = [pytest.mark.slurm, pytest.mark.slow]
STEPS = 16
ARGS = ["+cluster=localslurm", "cluster.nodes=2", "cluster.gpus_per_node=2", "+strategy=fsdp", f"train.steps={STEPS}",
        "train.seq_len=32", "data.num_tokens=50000", "fault.trace_samples=true", "fault.step_delay_s=0.4",
        "cluster.max_requeues=0"]


def test_preempted_on_2_nodes_resumed_on_1(tmp_path, slurm_cluster):
    env = slurm_cluster
    job, run_dir = submit_run(ARGS, tmp_path, env)
    wait_until(lambda: len(read_metrics(run_dir)) >= 4, 240, "4 steps on 2 nodes")
    hosts = read_run_json(run_dir)["hostnames"]
    assert len(hosts) == 2
    subprocess.run(["sbatch", "--parsable", "-p", "high", "-w", ",".join(hosts), "-N", "2", "--ntasks-per-node=4",
                    "--output=/dev/null", "--wrap", "sleep 2"], env=env, check=True, capture_output=True, text=True)
    status = wait_until(lambda: (lambda s: s if s in ("stopped", "completed", "failed") else None)(
        read_run_json(run_dir).get("status")), 240, "the preempted run to stop")
    assert status == "stopped", read_run_json(run_dir)
    subprocess.run(["scancel", job], env=env)  # should Slurm requeue the preempted job itself
    wait_until(lambda: job_gone(job, env), 120, "the preempted job to leave the queue")
    saved = int((run_dir / "checkpoints" / "latest").read_text().strip().split("_")[1])
    assert 4 <= saved < STEPS

    proc = subprocess.run([sys.executable, "-m", "launcher.resume", str(run_dir), "cluster.nodes=1", "--wait"],
                          cwd=tmp_path, env={**env, "PYTHONPATH": pythonpath()}, capture_output=True, text=True,
                          timeout=400)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    info = read_run_json(run_dir)
    assert info["status"] == "completed" and info["nodes"] == 1 and info["world_size"] == 2, info
    (change,) = info["reshaped"]
    assert (change["from"]["nodes"], change["to"]["nodes"], change["at_step"]) == (2, 1, saved)
    assert (change["from"]["grad_accum"], change["to"]["grad_accum"]) == (1, 2)
    assert change["from"]["global_batch"] == change["to"]["global_batch"] == 32
    rows = read_metrics(run_dir)
    assert sorted(r["step"] for r in rows if r["world_size"] == 4) == list(range(1, saved + 1))
    assert sorted(r["step"] for r in rows if r["world_size"] == 2) == list(range(saved + 1, STEPS + 1))
    assert "resharded: saved by fsdp on 2 x 2 = 4 ranks" in (run_dir / "logs" / "rank0.log").read_text()
    assert_every_sample_once(run_dir, STEPS)
    assert os.path.exists(run_dir / "logs" / "samples_seg0_rank3.txt")  # the 4-rank segment traced too


def test_deepspeed_reshape_converts_in_a_cpu_job_first(tmp_path, slurm_cluster):
    """ZeRO-3 on 2 nodes fails at step 7 (checkpoint of step 4); resumed as ZeRO-2 on 1
    node, the universal conversion runs as a CPU job of its own (1 task, no GPU) and the
    training job follows it (``--dependency=afterany``), finds the conversion made and
    completes from step 5 on. A first resume while the nodes are taken is cancelled by
    ``launcher.cancel``: the waiting conversion job goes with the run's job."""
    from slurm import query

    env = slurm_cluster
    args = ["+cluster=localslurm", "cluster.nodes=2", "cluster.gpus_per_node=2", "+strategy=zero3", "train.steps=10",
            "train.seq_len=32", "data.num_tokens=50000", "checkpoint.every_steps=4", "checkpoint.save_final=false",
            "fault.raise_at_step=7", "cluster.in_job_restarts=0"]  # the failure ends the job: resumed below
    job, run_dir = submit_run(args, tmp_path, env)
    wait_until(lambda: read_run_json(run_dir).get("status") == "failed" and job_gone(job, env), 240,
               "the ZeRO-3 run to fail at step 7 and leave the queue")
    resume = [sys.executable, "-m", "launcher.resume", str(run_dir), "strategy=zero2", "cluster.nodes=1",
              "fault.raise_at_step=0"]
    py_env = {**env, "PYTHONPATH": pythonpath()}
    # With the nodes taken, both jobs wait; launcher.cancel cancels the conversion with the run's job.
    nodes = eligible_nodes(env)
    blocker = subprocess.run(["sbatch", "--parsable", "-N", str(len(nodes)), "-w", ",".join(nodes), "--exclusive",
                              "--output=/dev/null", "--wrap", "sleep 300"], env=env, check=True, capture_output=True,
                             text=True).stdout.strip()
    try:
        wait_until(lambda: subprocess.run(["squeue", "-h", "-j", blocker, "-o", "%T"], env=env, capture_output=True,
                                          text=True).stdout.strip() == "RUNNING", 60, "the blocking job to run")
        first = subprocess.run(resume, cwd=tmp_path, env=py_env, capture_output=True, text=True, timeout=120)
        assert first.returncode == 0, first.stdout + first.stderr
        pending = read_run_json(run_dir)
        cancel = subprocess.run([sys.executable, "-m", "launcher.cancel", str(run_dir)], env=py_env,
                                capture_output=True, text=True, timeout=60)
        assert f"cancelled job {pending['conversion_job']} (PENDING) (checkpoint conversion)" in cancel.stdout, cancel
        assert f"cancelled job {pending['job_id']} (PENDING)" in cancel.stdout, cancel.stdout
        wait_until(lambda: job_gone(pending["job_id"], env) and job_gone(pending["conversion_job"], env), 60,
                   "both jobs to leave the queue")
    finally:
        subprocess.run(["scancel", blocker], env=env)
    wait_until(lambda: job_gone(blocker, env), 60, "the blocking job to leave the queue")
    proc = subprocess.run([*resume, "--wait"], cwd=tmp_path, env=py_env, capture_output=True, text=True, timeout=400)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    info = read_run_json(run_dir)
    conversion = info["conversion_job"]
    assert f"submitted job {conversion}: DeepSpeed's universal conversion" in proc.stdout
    assert info["status"] == "completed" and info["job_id"] != conversion and info["world_size"] == 2, info
    rows = query.sacct_history([conversion], env=env).get(conversion)
    assert rows and rows[-1]["State"] == "COMPLETED", rows
    log = next((run_dir / "slurm").glob(f"{conversion}_0_log.out")).read_text()
    assert "universal conversion of" in log and "for ZeRO stage 2 made" in log, log[-2000:]
    assert (run_dir / "checkpoints" / "universal" / "step_00000004" / "state" / "zero").is_dir()
    rows = read_metrics(run_dir)  # steps 5-6 ran twice: before the failure and after the resume
    assert sorted(r["step"] for r in rows if r["world_size"] == 2) == list(range(5, 11))
    assert {r["step"] for r in rows} == set(range(1, 11))
    assert "resharded: saved by zero3 stage 3 on 2 x 2 = 4 ranks" in (run_dir / "logs" / "rank0.log").read_text()
