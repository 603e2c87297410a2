"""Load: a 100-point sweep of trivial jobs on the real local Slurm cluster is submitted
(one job array: identical resources), tracked by ``launcher.status`` and reported by
``launcher.report`` with none lost."""
from __future__ import annotations

import csv

import pytest

from conftest import ONE_STEP, launcher
from test_sweep_slurm import module, sacct_states, sweep_dir_of

pytestmark = [pytest.mark.slurm, pytest.mark.slow]
POINTS = 100


def test_hundred_point_sweep_none_lost(tmp_path, slurm_cluster):
    env = slurm_cluster
    # trivial jobs: one task of a user's script that logs one step and imports no torch (the
    # built-in trainer's import of torch cost ~3 s of CPU a job, 5 CPU-minutes a sweep)
    proc = launcher(["+cluster=localslurm", "cluster.nodes=1", "cluster.gpus_per_node=1",
                     f"entrypoint={ONE_STEP}", f"+user.point=range({POINTS})",
                     "-m"], cwd=tmp_path, env=env, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    sweep = sweep_dir_of(proc)
    submitted = [line for line in proc.stdout.splitlines() if line.startswith("submitted job")]
    assert len(submitted) == POINTS, proc.stdout[-3000:]
    rep = module("report", [str(sweep), "--wait", "--poll", "2"], tmp_path, env, timeout=900)
    assert rep.returncode == 0, rep.stdout[-3000:] + rep.stderr[-3000:]
    with open(sweep / "report.csv") as f:
        rows = list(csv.DictReader(f))
    assert len(rows) == POINTS and {r["outcome"] for r in rows} == {"completed"}, [r["outcome"] for r in rows]
    assert {int(r["last_step"]) for r in rows} == {1}
    jobs = sorted({r["job_id"] for r in rows})
    assert len(jobs) == POINTS  # one array element per point, each its own job id
    assert set(sacct_states(jobs, env).values()) == {"COMPLETED"}
    stat = module("status", [str(sweep)], tmp_path, env)
    assert stat.returncode == 0 and f"{POINTS} points: {POINTS} completed" in stat.stdout, stat.stdout[-3000:]
