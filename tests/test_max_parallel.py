"""A sweep's concurrency cap, ``launcher.max_parallel=K``: Slurm holds it
after the launcher exits (``--array=...%K`` and ``--dependency=afterany``); the dry run
shows it; the chains of launcher/sweep.py's ``capped`` never let more than K points run,
in a simulation of Slurm's rules and on the local cluster."""
from __future__ import annotations

import heapq
import random
import re
import subprocess
import time
from pathlib import Path

import pytest

from conftest import REPO, launcher
from launcher.sweep import capped
from spec.rundir import read_run_json

NAP = REPO / "tests" / "fixtures" / "nap.py"


def test_jobs_take_the_chains_in_turn_and_an_array_takes_them_all():
    assert capped([1, 1, 1, 1, 1], 2) == [([], None), ([], None), ([0], None), ([1], None), ([2], None)]
    assert capped([6], 2) == [([], 2)]
    assert capped([1, 3, 1, 1], 2) == [([], None), ([0], 2), ([1], None), ([1], None)]
    assert capped([2, 5], 3) == [([], 2), ([0], 3)]
    assert capped([1, 1, 4], 0) == [([], None)] * 3  # no cap: nothing waits


def simulate(sizes, cap, seed) -> int:
    """Slurm's rules on the jobs ``capped`` gives: a job starts when all it waits for have
    ended (afterany), an array runs at most its %K elements at once; points take random
    times. The most points running at once."""
    rng = random.Random(seed)
    plan = capped(sizes, cap)
    left = {i: list(range(s)) for i, s in enumerate(sizes)}  # elements not started yet
    running_of = {i: 0 for i in range(len(sizes))}
    ended = set()
    events = []  # (time, job)
    now, most = 0.0, 0

    def start_what_can():
        nonlocal most
        for i, (waits, parallel) in enumerate(plan):
            if all(w in ended for w in waits):
                while left[i] and running_of[i] < (parallel or sizes[i]):
                    left[i].pop()
                    running_of[i] += 1
                    heapq.heappush(events, (now + rng.uniform(0.1, 3.0), i))
        most = max(most, sum(running_of.values()))

    start_what_can()
    while events:
        now, i = heapq.heappop(events)
        running_of[i] -= 1
        if not left[i] and not running_of[i]:
            ended.add(i)
        start_what_can()
    assert len(ended) == len(sizes)  # every job ran: no chain waits for ever
    return most


@pytest.mark.parametrize("seed", range(40))
def test_no_more_than_the_cap_ever_run_at_once(seed):
    rng = random.Random(seed)
    sizes = [rng.choice([1, 1, 1, 2, 3, 7]) for _ in range(rng.randint(1, 9))]
    cap = rng.randint(1, 4)
    assert simulate(sizes, cap, seed) <= cap
    assert simulate(sizes, 0, seed) == sum(sizes)  # uncapped, every point starts at once


def test_the_dry_run_shows_the_cap(tmp_path):
    proc = launcher(["+cluster=localslurm", "train.seed=1,2", "cluster.time_min=10,11", f"entrypoint={NAP}",
                     "launcher.max_parallel=2", "launcher.dry_run=true", "-m"], cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    text = proc.stdout
    assert "launcher.max_parallel=2: at most 2 of these 4 Slurm point(s) run at once" in text, text[-2000:]
    assert "  job 0: point(s) 0,2: job array --array=0-1%2\n" in text
    assert "  job 1: point(s) 1,3: job array --array=0-1%2 --dependency=afterany:<job 0>\n" in text


def test_a_negative_cap_is_refused_in_one_line(tmp_path):
    proc = launcher(["+cluster=localslurm", "train.seed=1,2", "launcher.max_parallel=-1", "-m"], cwd=tmp_path)
    assert proc.returncode == 2
    assert "launcher.max_parallel=-1 must be >= 0" in proc.stdout + proc.stderr
    assert not (tmp_path / "runs").exists() or not any(p.name == "registry.jsonl" for p in (tmp_path / "runs").rglob("*"))


def running(jobs, env) -> set:
    """Our elements and jobs squeue shows RUNNING (one line each: -r)."""
    out = subprocess.run(["squeue", "-h", "-r", "-o", "%i %T"], env=env, capture_output=True, text=True).stdout
    return {job for job, state in (line.split() for line in out.splitlines() if len(line.split()) == 2)
            if state == "RUNNING" and (job in jobs or job.split("_")[0] in jobs)}


def watch(points, env, timeout=240) -> int:
    """Poll squeue until every point's run completed; the most of them seen running at once."""
    jobs = {job for job, _ in points} | {job.split("_")[0] for job, _ in points}
    most, deadline = 0, time.time() + timeout
    while time.time() < deadline:
        most = max(most, len(running(jobs, env)))
        if all(read_run_json(d).get("status") == "completed" for _, d in points) and not running(jobs, env):
            return most
        time.sleep(0.2)
    raise AssertionError(f"not completed after {timeout} s: {[read_run_json(d).get('status') for _, d in points]}")


def submitted(proc) -> list:
    lines = proc.stdout.splitlines()
    jobs = [line.split()[2] for line in lines if line.startswith("submitted job")]
    dirs = [Path(line.split(": ", 1)[1]) for line in lines if line.startswith("run_dir: ")]
    assert len(jobs) == len(dirs), proc.stdout
    return sorted(zip(jobs, dirs), key=lambda p: int(p[1].name))


@pytest.mark.slurm
@pytest.mark.slow
def test_a_capped_sweep_never_runs_more_points_at_once_on_slurm(tmp_path, slurm_cluster):
    env = slurm_cluster
    # six identical points: one job array; a node holds two points, the pair four: only the cap holds them to 2
    array = launcher(["+cluster=localslurm", "cluster.nodes=1", "train.seed=1,2,3,4,5,6", f"entrypoint={NAP}",
                      "entrypoint_args=[3]", "launcher.max_parallel=2", "-m"], cwd=tmp_path, env=env, timeout=120)
    assert array.returncode == 0, array.stdout + array.stderr
    points = submitted(array)
    assert len(points) == 6 and len({job.split("_")[0] for job, _ in points}) == 1, points
    assert "#SBATCH --array=0-5%2" in (points[0][1] / "sbatch.sh").read_text()
    assert watch(points, env) == 2  # the first two elements start together, never a third beside them

    # four points that differ in their sbatch script: four jobs in two chains
    (tmp_path / "b").mkdir()
    jobs = launcher(["+cluster=localslurm", "cluster.nodes=1", "cluster.time_min=10,11,12,13", f"entrypoint={NAP}",
                     "entrypoint_args=[2]", "launcher.max_parallel=2", "-m"], cwd=tmp_path / "b", env=env, timeout=120)
    assert jobs.returncode == 0, jobs.stdout + jobs.stderr
    points = submitted(jobs)
    assert len(points) == 4 and all(job.isdigit() for job, _ in points), points
    for (first, _), (_, later) in zip(points, points[2:]):
        assert re.search(rf"^#SBATCH --dependency=afterany:{first}$", (later / "sbatch.sh").read_text(), re.M)
    assert "--dependency" not in (points[0][1] / "sbatch.sh").read_text()
    assert watch(points, env) <= 2
