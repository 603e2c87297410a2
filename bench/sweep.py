"""Sweep submission time on the local Slurm cluster: our launcher vs Hydra's submitit plugin.

For each sweep size (16 and 100 points: ``cluster.nodes=1,2`` x ``train.seed=range(...)``,
``train.steps=1``) the same command is timed twice in the same run:

- ours: ``python -m launcher ... -m``, from start to exit. It returns once every point's
  job is queued (one sbatch per point, each with its own resources).
- theirs: the same command with ``hydra/launcher=submitit_slurm`` (the
  ``hydra-submitit-launcher`` plugin, one job array with the same resources for every
  point), from start to the moment squeue lists all its array tasks. The plugin then
  blocks until the jobs end, so the process is stopped there. Its jobs are submitted held
  (``--hold``): each would run our Hydra app on a compute node and submit again.

Our jobs are cancelled right after the measurement, and everything either side submitted
is cancelled at the end, whatever happens. Prints both times and ours / theirs (goal
<= 0.5).

    make cluster-up && .venv/bin/pip install -c constraints-cpu.txt -e '.[bench]'
    .venv/bin/python bench/sweep.py [--sizes 16,100] [--repeats 1]
"""
from __future__ import annotations

import argparse
import importlib.util
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import List, Tuple

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from slurm import query  # noqa: E402  (after the path set-up, so the bench runs from a checkout)

CONF = Path(os.environ.get("LOCALSLURM_DIR", "/tmp/localslurm")) / "etc" / "slurm.conf"


def sweep_args(points: int) -> List[str]:
    return ["+cluster=localslurm", "cluster.nodes=1,2", f"train.seed=range(0,{points // 2})", "train.steps=1", "-m"]


def ours(points: int, work: Path, env: dict) -> Tuple[float, List[str]]:
    t0 = time.perf_counter()
    proc = subprocess.run([sys.executable, "-m", "launcher", *sweep_args(points)], cwd=work, env=env,
                          capture_output=True, text=True, timeout=900)
    elapsed = time.perf_counter() - t0
    jobs = [line.split()[2] for line in proc.stdout.splitlines() if line.startswith("submitted job")]
    if proc.returncode != 0 or len(jobs) != points:
        query.scancel(jobs, env)
        raise RuntimeError(f"ours submitted {len(jobs)}/{points} (exit {proc.returncode}):\n{proc.stderr[-2000:]}")
    return elapsed, jobs


def queued(name: str, env: dict) -> int:
    out = subprocess.run(["squeue", "-h", "-r", "-n", name, "-o", "%i"], env=env, capture_output=True, text=True)
    return len(out.stdout.split())


def theirs(points: int, work: Path, env: dict, name: str) -> float:
    cmd = [sys.executable, "-m", "launcher", *sweep_args(points)[:-1], "hydra/launcher=submitit_slurm",
           "hydra.launcher.partition=debug", f"hydra.launcher.name={name}", "hydra.launcher.timeout_min=5",
           "+hydra.launcher.additional_parameters.hold=true", "-m"]
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, cwd=work, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        while queued(name, env) < points:
            if proc.poll() is not None:
                raise RuntimeError(f"the plugin exited {proc.returncode}:\n{proc.stderr.read()[-2000:]}")
            if time.perf_counter() - t0 > 900:
                raise TimeoutError(f"the plugin queued {queued(name, env)}/{points} jobs in 900 s")
            time.sleep(0.05)  # the polling granularity is added to theirs, never to ours
        return time.perf_counter() - t0
    finally:
        proc.terminate()  # it blocks on results() until the (held) jobs end
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def cancel_by_name(name: str, env: dict) -> None:
    subprocess.run(["scancel", "-n", name], env=env, capture_output=True)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="16,100", help="comma-separated sweep sizes (even numbers)")
    parser.add_argument("--repeats", type=int, default=1, help="runs per size and side (medians are printed)")
    args = parser.parse_args()
    sizes = [int(s) for s in args.sizes.split(",")]
    if any(s < 2 or s % 2 for s in sizes):
        print("error: --sizes takes even numbers >= 2 (points = 2 node counts x seeds)", file=sys.stderr)
        return 2
    if importlib.util.find_spec("hydra_plugins.hydra_submitit_launcher") is None:
        print("error: the hydra-submitit-launcher plugin is not installed; run "
              "`.venv/bin/pip install -c constraints-cpu.txt -e '.[bench]'`", file=sys.stderr)
        return 2
    env = dict(os.environ, SLURM_CONF=str(CONF), PYTHONPATH=str(REPO))
    try:
        query.ping(env)
    except query.SlurmUnavailable as exc:
        print(f"error: no local Slurm cluster ({exc}); start it with `make cluster-up`", file=sys.stderr)
        return 2
    name = f"bench-sweep-{os.getpid()}"
    ours_jobs: List[str] = []
    results = []
    try:
        with tempfile.TemporaryDirectory(prefix="bench-sweep-") as tmp:
            for points in sizes:
                mine, other = [], []
                for rep in range(args.repeats):
                    # Theirs first: its held jobs put no load on this machine while ours runs.
                    work = Path(tmp) / f"{points}-{rep}"
                    (work / "theirs").mkdir(parents=True)
                    (work / "ours").mkdir()
                    other.append(theirs(points, work / "theirs", env, name))
                    cancel_by_name(name, env)
                    seconds, jobs = ours(points, work / "ours", env)
                    ours_jobs += jobs
                    query.scancel(jobs, env)  # never leave a sweep running
                    mine.append(seconds)
                    print(f"{points} points, run {rep + 1}: ours {seconds:.2f} s, theirs {other[-1]:.2f} s",
                          flush=True)
                results.append((points, statistics.median(mine), statistics.median(other)))
    finally:
        cancel_by_name(name, env)
        if ours_jobs:
            query.scancel(ours_jobs, env)
    print(f"\n{'points':>6} {'ours s':>8} {'theirs s':>9} {'ours/theirs':>12}   (goal <= 0.50)")
    for points, mine, other in results:
        print(f"{points:>6} {mine:>8.2f} {other:>9.2f} {mine / other:>12.2f}"
              f"   {'met' if mine <= 0.5 * other else 'not met'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
