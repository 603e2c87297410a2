"""Users' own code on the real local Slurm cluster: each entry-point form on 2 nodes with
world 4, the session-API example preempted by the high partition, a scaling report
over a sweep of the plain example, and single-run status / logs / cancel."""
from __future__ import annotations

import csv
import json
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import REPO, launcher, submit_run as submit, wait_until
from warm import pythonpath
from spec.rundir import read_metrics, read_run_json

pytestmark = [pytest.mark.slurm, pytest.mark.slow]
EXAMPLES = REPO / "examples"
TWO_NODES = ["+cluster=localslurm", "cluster.nodes=2", "cluster.gpus_per_node=2"]
FINAL = ("completed", "failed", "stopped")


def finished(run_dir: Path) -> str:
    return wait_until(lambda: read_run_json(run_dir).get("status") in FINAL and read_run_json(run_dir)["status"],
                      300, f"{run_dir} to finish")


def module(name: str, args: list, env: dict, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", f"launcher.{name}", *args], cwd=cwd, capture_output=True, text=True,
                          env=dict(env, PYTHONPATH=pythonpath()), timeout=120)


def test_each_entry_point_form_runs_on_two_nodes_with_world_4(tmp_path, slurm_cluster):
    env = slurm_cluster
    root = f"launcher.root={tmp_path}/runs"
    comment = "it's \"a\" $(test) run"
    # All go in at once; they take the node pair one after another.
    runs = {
        "script": submit(TWO_NODES + [f"entrypoint={EXAMPLES / 'ddp_plain.py'}", "entrypoint_args=[--steps,6]",
                                      f"+cluster.sbatch_extra.comment={json.dumps(comment)}", root], tmp_path, env),
        "function": submit(TWO_NODES + ["entrypoint=examples.train_fn:train", "+user.steps=4", root], REPO, env),
        # An Accelerate script: on CPU nodes every strategy is Accelerate's MULTI_CPU, so one
        # stands for all (the environment each strategy gives it: tests/test_user_entry.py).
        "zero2": submit(TWO_NODES + [f"entrypoint={EXAMPLES / 'accelerate_train.py'}", "+strategy=zero2",
                                     "entrypoint_args=[--steps,3]", root], tmp_path, env),
    }
    shown = subprocess.run(["scontrol", "show", "job", runs["script"][0]], env=env, capture_output=True, text=True)
    assert f"Comment={comment}" in shown.stdout, shown.stdout  # sbatch_extra passed through, quotes and all
    for form, (job, run_dir) in runs.items():
        assert finished(run_dir) == "completed", (form, read_run_json(run_dir), sorted(run_dir.rglob("*.err")))
        info = read_run_json(run_dir)
        assert (info["world_size"], info["nodes"], info["job_id"]) == (4, 2, job), info
        assert len(set(info["hostnames"])) == 2 and info["launcher"] == "srun", info
        assert read_metrics(run_dir), form
    seen = [json.loads((runs["zero2"][1] / f"accelerate_rank{r}.json").read_text()) for r in range(4)]
    # CPU nodes: Accelerate's MULTI_CPU over gloo with the whole world (no DeepSpeed/FSDP without CUDA).
    assert {(s["distributed_type"], s["num_processes"]) for s in seen} == {("DistributedType.MULTI_CPU", 4)}
    assert sorted(s["process_index"] for s in seen) == [0, 1, 2, 3]

    # Single runs in the CLI: status, logs (one rank, all ranks) and the sacct view.
    script_dir = runs["script"][1]
    wait_until(lambda: "COMPLETED" in subprocess.run(["sacct", "-X", "-n", "-j", runs["script"][0], "-o", "State"],
                                                     env=env, capture_output=True, text=True).stdout,
               60, "accounting to record the end")
    status = module("status", [str(script_dir)], env, tmp_path)
    assert status.returncode == 0, status.stdout + status.stderr
    assert "status: completed" in status.stdout and f"slurm: job {runs['script'][0]} COMPLETED" in status.stdout
    assert "exit 0:0" in status.stdout and "max RSS" in status.stdout, status.stdout
    logs = module("logs", [str(script_dir), "--rank", "0"], env, tmp_path)
    assert logs.returncode == 0 and "step 6 loss" in logs.stdout, logs.stdout + logs.stderr
    every = module("logs", [str(script_dir)], env, tmp_path)
    assert every.returncode == 0 and all(f"== rank {r} " in every.stdout for r in range(4)), every.stdout


def test_api_example_preempted_by_the_high_partition_ends_with_the_uninterrupted_loss(tmp_path, slurm_cluster):
    env = slurm_cluster
    script = [f"entrypoint={EXAMPLES / 'session_dcp.py'}"]
    _, reference = submit(TWO_NODES + script + ["entrypoint_args=[--steps,16]"], tmp_path, env)
    job, run_dir = submit(TWO_NODES + script + ["entrypoint_args=[--steps,16,--step-delay,0.4]"], tmp_path, env)
    wait_until(lambda: len(read_metrics(run_dir)) >= 4, 240, "4 steps of the preemptible run")
    hosts = read_run_json(run_dir)["hostnames"]
    # The high partition wants every CPU of the run's nodes: the run is preempted.
    high = subprocess.run(["sbatch", "--parsable", "-p", "high", "-w", ",".join(hosts), "-N", "2",
                           "--ntasks-per-node=4", "--output=/dev/null", "--wrap", "sleep 2"], env=env, check=True,
                          capture_output=True, text=True).stdout.strip()
    assert finished(run_dir) == "completed", read_run_json(run_dir)
    assert finished(reference) == "completed"
    info = read_run_json(run_dir)
    assert info["preemptions"] >= 1 and info["segments"] >= 2 and info["job_id"] == job, info
    final = {r["step"]: r["loss"] for r in read_metrics(run_dir)}
    expected = {r["step"]: r["loss"] for r in read_metrics(reference)}
    # Not bitwise: DDP builds its gradient buckets anew in the restarted segment (after its
    # first step, in the order gradients became ready), which moves elements within gloo's
    # ring all-reduce of 4 ranks and so the order their sums are added in (~1e-7).
    assert sorted(final) == list(range(1, 17))
    assert final == {step: pytest.approx(loss, rel=1e-5) for step, loss in expected.items()}
    assert any((run_dir / "dcp").iterdir())
    out = "".join(p.read_text() for p in (run_dir / "slurm").glob("*_0_log.out"))
    assert "signalled: saved step" in out and "resumed from step_" in out
    states = subprocess.run(["sacct", "-X", "-n", "-P", "-j", high, "-o", "State"], env=env, capture_output=True,
                            text=True).stdout.split()
    assert states and states[-1] in ("COMPLETED", "RUNNING", "COMPLETING"), states


def test_report_over_a_sweep_of_the_plain_example_and_cancel_of_a_single_run(tmp_path, slurm_cluster):
    env = slurm_cluster
    plain = f"entrypoint={EXAMPLES / 'ddp_plain.py'}"
    sweep = launcher(["+cluster=localslurm", "cluster.gpus_per_node=2", "cluster.nodes=1,2", plain,
                      "entrypoint_args=[--steps,8]", "-m"], cwd=tmp_path, env=env, timeout=120)
    assert sweep.returncode == 0, sweep.stdout + sweep.stderr
    sweep_dir = {Path(line.split(": ", 1)[1]).parent for line in sweep.stdout.splitlines()
                 if line.startswith("run_dir: ")}.pop()
    # A long single run, cancelled by its run directory while the sweep trains.
    job, doomed = submit(["+cluster=localslurm", "cluster.nodes=1", plain,
                          "entrypoint_args=[--steps,400,--step-delay,0.5]"], tmp_path, env)
    report = module("report", [str(sweep_dir), "--wait", "--poll", "1"], env, tmp_path)
    assert report.returncode == 0, report.stdout + report.stderr
    with open(sweep_dir / "report.csv") as f:
        rows = sorted(csv.DictReader(f), key=lambda r: int(r["gpus"]))
    assert [(r["outcome"], r["gpus"]) for r in rows] == [("completed", "2"), ("completed", "4")], rows
    assert all(float(r["tokens_per_s"]) > 0 for r in rows) and rows[0]["efficiency"] == "1"
    assert 0 < float(rows[1]["efficiency"]) and rows[1]["last_step"] == "8"
    assert "efficiency" in (sweep_dir / "report.md").read_text()

    wait_until(lambda: read_metrics(doomed), 240, "the long run to train")
    cancel = module("cancel", [str(doomed)], env, tmp_path)
    assert cancel.returncode == 0 and f"cancelled job {job}" in cancel.stdout, cancel.stdout + cancel.stderr
    wait_until(lambda: not subprocess.run(["squeue", "-h", "-j", job], env=env, capture_output=True,
                                          text=True).stdout.strip(), 120, "the cancelled job to leave the queue")
    status = module("status", [str(doomed)], env, tmp_path)
    assert f"slurm: job {job} CANCELLED" in status.stdout, status.stdout + status.stderr


def test_plain_script_is_requeued_on_the_warning_signal_and_restarts_from_its_checkpoint(tmp_path, slurm_cluster):
    env = slurm_cluster
    job, run_dir = submit(TWO_NODES + [f"entrypoint={EXAMPLES / 'ddp_plain.py'}",
                                       "entrypoint_args=[--steps,14,--step-delay,0.4]"], tmp_path, env)
    wait_until(lambda: len(read_metrics(run_dir)) >= 7, 240, "7 steps")
    subprocess.run(["scancel", "--signal=USR2", job], env=env, check=True)
    assert finished(run_dir) == "completed", read_run_json(run_dir)
    info = read_run_json(run_dir)
    assert (info["preemptions"], info["segments"], info["restart_count"], info["job_id"]) == (1, 2, 1, job), info
    steps = [r["step"] for r in read_metrics(run_dir)]
    assert steps[-1] == 14 and set(steps) == set(range(1, 15))  # steps after its last checkpoint are redone
    out = "".join(p.read_text() for p in sorted((run_dir / "slurm").glob("*_0_log.out")))
    assert "resumed at step 5 (SLURM_RESTART_COUNT=1)" in out or "resumed at step 10 (SLURM_RESTART_COUNT=1)" in out
    log = (run_dir / "logs" / "rank0.log").read_text()
    assert "requeue of job" in log and "the job is requeued; running on until Slurm ends this task" in log
