"""Launch overhead on the local Slurm cluster: our launcher vs a hand-written sbatch script.

Measures, for each method, the wall time from invoking the submission command to the
end of the first training step (2 nodes x 2 tasks, tiny model, DDP, gloo). The
baseline is the least one could write by hand: an sbatch script whose srun runs
bench/minimal_step.py (same rendezvous, same model, one DDP step). Runs alternate
between the two methods; the medians and their ratio are printed (goal <= 1.25).

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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    if not CONF.is_file():
        sys.exit(f"no local Slurm cluster ({CONF} missing): run `make cluster-up` first")
    env = dict(os.environ, SLURM_CONF=str(CONF), PYTHONPATH=str(REPO))
    times: dict[str, list[float]] = {"launcher": [], "sbatch+srun": []}
    with tempfile.TemporaryDirectory(prefix="bench-launch-") as tmp:
        work = Path(tmp)
        ours(work, env)  # warm caches (data file, page cache of torch) for both methods
        for i in range(args.repeats):
            for name, fn in (("launcher", ours), ("sbatch+srun", baseline)):
                times[name].append(fn(work, env))
                print(f"run {i + 1} {name:12s} {times[name][-1]:.2f} s", flush=True)
    med = {k: statistics.median(v) for k, v in times.items()}
    print(f"\ninvoke -> first step, median of {args.repeats} (2 nodes x 2 tasks, tiny, DDP, gloo)")
    print(f"  launcher      {med['launcher']:.2f} s")
    print(f"  sbatch+srun   {med['sbatch+srun']:.2f} s")
    print(f"  ratio         {med['launcher'] / med['sbatch+srun']:.3f}   (goal <= 1.25)")


if __name__ == "__main__":
    main()
