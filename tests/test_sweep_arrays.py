"""Tier 4: sweep points with identical sbatch parameters go into one job array, on the
real local Slurm cluster; points of other sizes stay separate jobs; invalid points are
skipped with their reason while the rest is submitted."""
from __future__ import annotations

import json
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import ONE_STEP, REPO, launcher
from warm import pythonpath
from spec.rundir import read_metrics, read_run_json

pytestmark = [pytest.mark.slurm, pytest.mark.slow]


def submitted(proc) -> list[tuple[str, Path]]:
    """(job id, run dir) of every point the launcher submitted, in its output order."""
    lines = proc.stdout.splitlines()
    jobs = [line.split()[2] for line in lines if line.startswith("submitted job")]
    dirs = [Path(line.split(": ", 1)[1]) for line in lines if line.startswith("run_dir: ")]
    assert len(jobs) == len(dirs), proc.stdout
    return list(zip(jobs, dirs))


def wait_finished(points, env, timeout=300) -> dict:
    """Wait until every run has its final status and Slurm has ended every job; sacct rows."""
    deadline = time.time() + timeout
    while time.time() < deadline:
        runs = [read_run_json(d).get("status") for _, d in points]
        rows = sacct([job for job, _ in points], env)
        if all(s in ("completed", "failed", "stopped") for s in runs) and len(rows) == len(points) and all(
                r[1].split()[0] not in ("PENDING", "RUNNING", "REQUEUED", "COMPLETING") for r in rows.values()):
            return rows
        time.sleep(0.5)
    raise AssertionError(f"not finished after {timeout} s: {runs} {rows}")


def sacct(jobs, env) -> dict:
    out = subprocess.run(["sacct", "-X", "-n", "-P", "-j", ",".join(jobs), "-o", "JobID,State,NNodes"], env=env,
                         capture_output=True, text=True, check=True).stdout
    return {p[0]: p for p in (line.split("|") for line in out.splitlines()) if len(p) == 3}


def raw_ids(array: str, env) -> dict:
    """Element id ("A_i") -> its own SLURM_JOB_ID, for the queued elements of an array."""
    out = subprocess.run(["squeue", "-h", "-r", "-j", array, "-o", "%i %A"], env=env, capture_output=True,
                         text=True).stdout
    return dict(line.split() for line in out.splitlines() if len(line.split()) == 2)


def test_identical_points_are_one_array_and_requeueing_one_element_leaves_the_others(tmp_path, slurm_cluster):
    env = slurm_cluster
    proc = launcher(["+cluster=localslurm", "cluster.nodes=1", "train.seed=1,2,3", "train.steps=12",
                     "fault.step_delay_s=0.3", "-m"], cwd=tmp_path, env=env, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    points = submitted(proc)
    arrays = {job.split("_")[0] for job, _ in points}
    assert len(points) == 3 and len(arrays) == 1, points
    array = arrays.pop()
    assert [job for job, _ in points] == [f"{array}_{i}" for i in range(3)]
    assert [d.name for _, d in points] == ["0", "1", "2"]

    # One element's own SLURM_JOB_ID is the array's id: `scontrol requeue <that id>` would
    # requeue every element. The trainer must requeue "ARRAY_TASK" (train.harness.preempt).
    deadline = time.time() + 120
    while time.time() < deadline and not (len(raw_ids(array, env)) == 3 and all(
            len(read_metrics(d)) >= 3 for _, d in points)):
        time.sleep(0.3)
    ids = raw_ids(array, env)
    assert array in ids.values(), ids  # Slurm 22.05 gives the array's id to one running element
    victim = next(job for job, raw in ids.items() if raw == array)
    subprocess.run(["scancel", "--signal=USR2", victim], env=env, check=True)
    acct = wait_finished(points, env)
    first_losses = set()
    for job, run_dir in points:
        info = read_run_json(run_dir)
        assert info["status"] == "completed" and info["job_id"] == job, info
        assert info["world_size"] == 2 and info["nodes"] == 1 and acct[job][1:] == ["COMPLETED", "1"]
        interrupted = job == victim
        assert (info.get("preemptions", 0), info["segments"]) == ((1, 2) if interrupted else (0, 1)), (job, info)
        rows = read_metrics(run_dir)
        assert {r["step"] for r in rows} == set(range(1, 13))
        first_losses.add(rows[0]["loss"])
        assert (run_dir / "slurm" / f"{job}_0_log.out").is_file() and (run_dir / "slurm" / f"{job}_1_log.err").is_file()
        assert "#SBATCH --array=0-2%3" in (run_dir / "sbatch.sh").read_text()
        assert f"seed: {int(run_dir.name) + 1}" in (run_dir / "config.yaml").read_text()
    assert len(first_losses) == 3  # three seeds, three runs

    registry = [json.loads(line) for line in (points[0][1].parent / "registry.jsonl").read_text().splitlines()]
    assert [(r["point"], r["event"], r["job_id"]) for r in registry] == \
        [(d.name, "submitted", job) for job, d in points]
    status = subprocess.run([sys.executable, "-m", "launcher.status", str(points[0][1].parent)], cwd=tmp_path,
                            env=dict(env, PYTHONPATH=pythonpath()), capture_output=True, text=True, timeout=60)
    assert "3 points: 3 completed" in status.stdout and all(job in status.stdout for job, _ in points), status.stdout


def test_points_of_other_sizes_are_other_jobs(tmp_path, slurm_cluster):
    env = slurm_cluster
    # a trivial user script (no torch): what is under test is how points become jobs
    grid = launcher(["+cluster=localslurm", "cluster.nodes=1,2", "train.seed=1,2", f"entrypoint={ONE_STEP}", "-m"],
                    cwd=tmp_path, env=env, timeout=120)
    plain = launcher(["+cluster=localslurm", "cluster.nodes=1,2", f"entrypoint={ONE_STEP}", "-m"], cwd=tmp_path,
                     env=env, timeout=120)
    for proc in (grid, plain):
        assert proc.returncode == 0, proc.stdout + proc.stderr
    grid_points, plain_points = submitted(grid), submitted(plain)
    acct = wait_finished(grid_points + plain_points, env)

    by_nodes: dict = {}
    for job, run_dir in grid_points:  # points 0, 1: one node; 2, 3: two nodes
        nodes = 1 if int(run_dir.name) < 2 else 2
        by_nodes.setdefault(nodes, set()).add(job.split("_")[0])
        assert re.fullmatch(r"\d+_[01]", job) and acct[job][1:] == ["COMPLETED", str(nodes)], (job, acct)
        assert read_run_json(run_dir)["world_size"] == 2 * nodes
    assert len(by_nodes[1]) == len(by_nodes[2]) == 1 and by_nodes[1] != by_nodes[2]  # one array per size

    assert len(plain_points) == 2 and all(job.isdigit() for job, _ in plain_points)  # alone: a plain job
    assert sorted(acct[job][2] for job, _ in plain_points) == ["1", "2"]
    assert all(acct[job][1] == "COMPLETED" for job, _ in plain_points), acct


def test_invalid_points_are_skipped_with_their_reason_and_the_rest_submitted(tmp_path, slurm_cluster):
    env = slurm_cluster
    # Points (nodes, seed): (1,1) (1,2) valid; (1,oops) does not compose; (9,*) exceeds the
    # 4 nodes of partition debug.
    proc = launcher(["+cluster=localslurm", "cluster.nodes=1,9", "train.seed=1,2,oops", f"entrypoint={ONE_STEP}",
                     "-m"], cwd=tmp_path, env=env, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    points = submitted(proc)
    assert [d.name for _, d in points] == ["0", "1"] and len({job.split("_")[0] for job, _ in points}) == 1
    skipped = [line for line in proc.stderr.splitlines() if line.startswith("skipped point")]
    assert len(skipped) == 4, proc.stderr
    assert "#2 " in skipped[0] and "train.seed" in skipped[0] and "oops" in skipped[0]
    assert all("exceeds the 4 nodes of partition debug" in line for line in skipped[1:3]), skipped
    assert "2 submitted, 4 skipped" in proc.stderr

    sweep = points[0][1].parent
    registry = {r["point"]: r for r in map(json.loads, (sweep / "registry.jsonl").read_text().splitlines())}
    assert {k: r["event"] for k, r in registry.items()} == {"0": "submitted", "1": "submitted", "2": "skipped",
                                                             "3": "skipped", "4": "skipped", "5": "skipped"}
    assert "exceeds" in registry["3"]["reason"] and "oops" in registry["2"]["reason"]
    acct = wait_finished(points, env)
    assert all(read_run_json(d)["status"] == "completed" and acct[job][1] == "COMPLETED" for job, d in points)
    status = subprocess.run([sys.executable, "-m", "launcher.status", str(sweep)], cwd=tmp_path,
                            env=dict(env, PYTHONPATH=pythonpath()), capture_output=True, text=True, timeout=60)
    assert "6 points: 2 completed, 4 skipped" in status.stdout, status.stdout
