"""Runs inside an allocation the user already holds (cluster.allocation=auto,
launcher/allocation.py): on the real local cluster, a 2-node run started with the id of a
`salloc --no-shell` allocation submits no job: its srun steps run in the allocation and the
run completes there; a run whose nodes the allocation cannot hold is refused in one line
before anything is written; two runs share it side by side, a node each, and when the
allocation ends under them each is left resumable (one resumed goes on to its end). Without Slurm: what the script asks of srun and leaves out."""
from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

from conftest import launcher, run_dir_of, wait_until
from helpers import compose_run
from launcher.allocation import held, in_use
from launcher.submit import render_script
from spec.layout import build_layout
from spec.rundir import read_metrics, read_run_json


def test_the_allocation_is_the_job_outside_any_step_and_its_script_never_requeues(tmp_path):
    assert held({"SLURM_JOB_ID": "7"}) == "7" and held({}) is None
    assert held({"SLURM_JOB_ID": "7", "SLURM_STEP_ID": "0"}) is None  # a task of a step: not an allocation
    cfg = compose_run(["+cluster=localslurm", "cluster.allocation=auto"])
    assert in_use(cfg, {"SLURM_JOB_ID": "7"}) == "7"
    assert in_use(compose_run(["+cluster=localslurm"]), {"SLURM_JOB_ID": "7"}) is None  # never: a job of its own
    script = render_script(cfg, build_layout(cfg), tmp_path, allocation=True)
    assert "STO_STEP_NODES=2 STO_STEP_NTASKS=2 STO_ALLOCATION=1" in script  # 2 agents, one a node
    assert "scontrol requeue" not in script  # no teardown that requeues


@pytest.mark.slurm
@pytest.mark.slow
def test_a_run_inside_an_allocation_submits_no_job(tmp_path, slurm_cluster):
    # tests/run_suite.sh confines each run to a node pair by SBATCH_CONSTRAINT, which salloc does not read
    pair = os.environ.get("SBATCH_CONSTRAINT")
    alloc = subprocess.run(["salloc", "-N", "2", "--ntasks-per-node=1", "--cpus-per-task=2", "--no-shell",
                            "--time=10", "-J", "sto-allocation-test",
                            *([f"--constraint={pair}"] if pair else [])],
                           env=slurm_cluster, capture_output=True, text=True, timeout=120)
    found = re.search(r"Granted job allocation (\d+)", alloc.stderr)
    assert found, alloc.stderr
    job = found.group(1)
    env = {**slurm_cluster, "SLURM_JOB_ID": job}
    try:
        proc = launcher(["+cluster=localslurm", "cluster.nodes=3", "cluster.allocation=auto"], cwd=tmp_path, env=env)
        out = proc.stdout + proc.stderr
        assert proc.returncode != 0 and f"cluster.nodes=3 does not fit allocation {job}, which holds 2 node(s)" in out
        assert "submitted job" not in out and not list(tmp_path.glob("runs/*")), out
        proc = launcher(["+cluster=localslurm", "cluster.cpus_per_task=2", "cluster.allocation=auto"], cwd=tmp_path,
                        env=env)  # 2 nodes x 2 ranks x 2 CPUs: 8 of the allocation's 4
        assert proc.returncode != 0 and f"= 8 CPUs do not fit allocation {job}, which holds 4" in proc.stdout + proc.stderr
        proc = launcher(["+cluster=localslurm", "cluster.nodes=2", "cluster.allocation=auto", "train.steps=6",
                         "launcher.wait=true"], cwd=tmp_path, env=env, timeout=300)
        out = proc.stdout + proc.stderr
        assert proc.returncode == 0 and f"started in allocation {job}" in out and "submitted job" not in out, out
        run_dir = run_dir_of(proc.stdout)
        info = read_run_json(run_dir)
        assert (info["status"], info["job_id"], info["allocation"], info["world_size"]) == ("completed", job, job, 4)
        # no job of its own: the one task call written is the allocation's
        assert [p.name for p in (run_dir / "slurm").glob("*_submitted.pkl")] == [f"{job}_submitted.pkl"]
        def step_ended():
            rows = subprocess.run(["sacct", "-n", "-P", "-j", job, "-o", "JobID,State"], env=slurm_cluster,
                                  capture_output=True, text=True).stdout.split()
            return rows if f"{job}.0|COMPLETED" in rows else None
        wait_until(step_ended, 60, "sacct's record of the run's step under the allocation")
        side_by_side_then_the_allocation_ends(tmp_path, env, job)
    finally:
        subprocess.run(["scancel", job], env=slurm_cluster, capture_output=True)


def side_by_side_then_the_allocation_ends(tmp_path, env, job):
    """Two 1-node runs share the 2-node allocation, a node each; the allocation ends under
    them (scancel); each is left resumable, and one resumed as a job of its own goes on
    from its last checkpoint to the end."""
    runs = []
    for seed in (1, 2):
        (tmp_path / f"side{seed}").mkdir()
        proc = launcher(["+cluster=localslurm", "cluster.nodes=1", "cluster.allocation=auto", "train.steps=60",
                         f"train.seed={seed}", "fault.step_delay_s=0.3", "checkpoint.every_steps=2"],
                        cwd=tmp_path / f"side{seed}", env=env)
        assert proc.returncode == 0 and f"started in allocation {job}" in proc.stdout + proc.stderr, proc.stderr
        runs.append(run_dir_of(proc.stdout))
    wait_until(lambda: all(len(read_metrics(r)) >= 5 for r in runs), 120, "both runs past step 4")
    hosts = [read_run_json(r)["hostnames"] for r in runs]
    assert len(hosts[0]) == len(hosts[1]) == 1 and hosts[0] != hosts[1], hosts  # side by side, a node each
    subprocess.run(["scancel", job], env=env, check=True)
    wait_until(lambda: all(read_run_json(r).get("status") not in (None, "running", "starting") for r in runs), 90,
               "both runs to stop with the allocation")
    ended = [read_metrics(r)[-1]["step"] for r in runs]
    assert all(step < 60 for step in ended), ended  # both stopped by the allocation's end
    outside = {k: v for k, v in env.items() if k != "SLURM_JOB_ID"}
    proc = launcher_resume(runs[0], outside, "fault.step_delay_s=0")
    assert proc.returncode == 0 and "submitted job" in proc.stdout, proc.stdout + proc.stderr
    wait_until(lambda: read_run_json(runs[0]).get("status") == "completed", 180, "the resumed run")
    assert read_run_json(runs[0]).get("allocation") is None  # a job of its own now
    assert read_run_json(runs[1])["status"] not in ("completed", "failed")  # the other: resumable as it is (interrupted)
    steps = [r["step"] for r in read_metrics(runs[0])]
    assert steps[-1] == 60 and sorted(set(steps)) == list(range(1, 61)), steps  # none lost, from its checkpoint


def launcher_resume(run_dir, env, *overrides):
    from conftest import REPO

    return subprocess.run([sys.executable, "-m", "launcher.resume", str(run_dir), *overrides], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=120)
