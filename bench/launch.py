"""Launch overhead on the local Slurm cluster: our launcher vs a hand-written sbatch script.

Measures, for each method, the wall time from invoking the submission command to the
end of the first training step (2 nodes x 2 tasks, tiny model, DDP, gloo). The
baseline is the least one could write by hand: an sbatch script whose srun runs
bench/minimal_step.py (same rendezvous, same model, one DDP step). A user's own script
is measured the same way: ``python -m launcher entrypoint=examples/ddp_plain.py`` against
an sbatch script whose srun runs that file with the torchrun variables set by hand.
Runs alternate between the methods; the medians and the two ratios are printed (goal
<= 1.25 each).

    make cluster-up && .venv/bin/python bench/launch.py [--repeats 5]
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
CONF = Path(os.environ.get("LOCALSLURM_DIR", "/tmp/localslurm")) / "etc" / "slurm.conf"


def wait_for(path: Path, timeout: float = 180) -> float:
    """Poll until ``path`` has a line; return the time written in its first line."""
    deadline = time.time() + timeout
    while time.time() < deadline:
        if path.exists():
            lines = [line for line in path.read_text().splitlines() if line.strip()]
            if lines:
                first = json.loads(lines[0])
                return float(first["time"])
        time.sleep(0.05)
    raise TimeoutError(f"no first step in {path} after {timeout} s")


def ours(work: Path, env: dict) -> float:
    t0 = time.time()
    proc = subprocess.run([sys.executable, "-m", "launcher", "+cluster=localslurm", "cluster.nodes=2",
                           "cluster.gpus_per_node=2", "train.steps=1", f"launcher.root={work}/ours",
                           f"launcher.run_dir={work}/ours/{t0}"], cwd=REPO, env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(proc.stdout + proc.stderr)
    return wait_for(Path(f"{work}/ours/{t0}/metrics.jsonl")) - t0


def baseline(work: Path, env: dict) -> float:
    out = work / f"base-{time.time()}"
    out.mkdir(parents=True)
    script = out / "job.sh"
    script.write_text(f"""#!/bin/bash
#SBATCH --nodes=2
#SBATCH --ntasks-per-node=2
#SBATCH --partition=debug
#SBATCH --output={out}/%j.out
srun {sys.executable} -u {REPO}/bench/minimal_step.py {out}/metrics.jsonl
""")
    t0 = time.time()
    subprocess.run(["sbatch", str(script)], env=env, check=True, capture_output=True)
    return wait_for(out / "metrics.jsonl") - t0


PLAIN = REPO / "examples" / "ddp_plain.py"


def ours_plain(work: Path, env: dict) -> float:
    t0 = time.time()
    run_dir = f"{work}/plain/{t0}"
    proc = subprocess.run([sys.executable, "-m", "launcher", "+cluster=localslurm", "cluster.nodes=2",
                           "cluster.gpus_per_node=2", f"entrypoint={PLAIN}", "entrypoint_args=[--steps,1]",
                           f"launcher.run_dir={run_dir}"], cwd=REPO, env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(proc.stdout + proc.stderr)
    return wait_for(Path(run_dir) / "metrics.jsonl") - t0


def baseline_plain(work: Path, env: dict) -> float:
    """The same script by hand: torchrun's variables from srun's, one thread per task."""
    out = work / f"plain-base-{time.time()}"
    out.mkdir(parents=True)
    script = out / "job.sh"
    script.write_text(f"""#!/bin/bash
#SBATCH --nodes=2
#SBATCH --ntasks-per-node=2
#SBATCH --partition=debug
#SBATCH --output={out}/%j.out
export MASTER_ADDR=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)
export MASTER_PORT=$((20000 + SLURM_JOB_ID % 10000)) OMP_NUM_THREADS=1 STO_RUN_DIR={out}
srun bash -c 'RANK=$SLURM_PROCID WORLD_SIZE=$SLURM_NTASKS LOCAL_RANK=$SLURM_LOCALID exec {sys.executable} -u {PLAIN} --steps 1'
""")
    t0 = time.time()
    subprocess.run(["sbatch", str(script)], env=env, check=True, capture_output=True)
    return wait_for(out / "metrics.jsonl") - t0


METHODS = (("launcher", ours), ("sbatch+srun", baseline), ("launcher script", ours_plain),
           ("sbatch+srun script", baseline_plain))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    if not CONF.is_file():
        sys.exit(f"no local Slurm cluster ({CONF} missing): run `make cluster-up` first")
    env = dict(os.environ, SLURM_CONF=str(CONF), PYTHONPATH=str(REPO))
    times: dict[str, list[float]] = {name: [] for name, _ in METHODS}
    with tempfile.TemporaryDirectory(prefix="bench-launch-") as tmp:
        work = Path(tmp)
        ours(work, env)  # warm caches (data file, page cache of torch) for both methods
        for i in range(args.repeats):
            for name, fn in METHODS:
                times[name].append(fn(work, env))
                print(f"run {i + 1} {name:18s} {times[name][-1]:.2f} s", flush=True)
    med = {k: statistics.median(v) for k, v in times.items()}
    print(f"\ninvoke -> first step, median of {args.repeats} (2 nodes x 2 tasks, DDP, gloo)")
    for name, _ in METHODS:
        print(f"  {name:18s}  {med[name]:.2f} s")
    print(f"  built-in trainer  launcher / sbatch+srun = {med['launcher'] / med['sbatch+srun']:.3f}   (goal <= 1.25)")
    print(f"  plain script      launcher / sbatch+srun = "
          f"{med['launcher script'] / med['sbatch+srun script']:.3f}   (goal <= 1.25)")


if __name__ == "__main__":
    main()
