"""``launcher.list`` over 1,000 run directories: the goal is under 1 s.

Makes ``--runs`` synthetic run directories in a temporary directory (``ROOT/<slug>`` single
runs and ``ROOT/multirun/<sweep>/<N>`` points of sweeps of 10 with their registry; each
with run.json written by spec.rundir, a config.yaml, logs/ and checkpoints/ to walk past;
every third with a metrics.jsonl of ``--rows`` rows, one in fifty of ``--big-mb`` MB), then
times the listing: in-process (:func:`launcher.track.catalog.main`, best of ``--repeats``,
output discarded) and one ``python -m launcher.list ROOT --no-slurm`` subprocess (wall
time, an interpreter's start and imports included). Prints the seconds and their ratio to
the goal. ``--no-slurm`` in both: the figure is the reading of the disk, not a controller's
answer (Slurm's one squeue call is the same for 10 runs or 1,000).

    .venv/bin/python bench/list_runs.py [--runs 1000] [--rows 3000] [--big-mb 20] [--repeats 5]
"""
from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

GOAL_S = 1.0
CONFIG = ("cluster:\n  nodes: {nodes}\ntrain:\n  lr: 0.001\n  warmup:\n    steps: 5\n  steps: {steps}\n  seed: 0\n"
          "checkpoint:\n  every_steps: 100\n")
STATUSES = ("completed", "failed", "running", "requeued", "submitted", "stopped")


def metrics(path: Path, rows: int, size_mb: float = 0.0) -> None:
    """``rows`` rows of metrics.jsonl (padded with an ``extra`` field to ``size_mb``)."""
    pad = "x" * max(0, int(size_mb * 2**20 / max(rows, 1)) - 200) if size_mb else ""
    with open(path, "w") as f:
        for s in range(1, rows + 1):
            row = {"step": s, "loss": 10.0 / s ** 0.3, "tokens_per_s": 41000.0 + s, "step_time_s": 0.2, "mfu": None}
            if pad:
                row["note"] = pad
            f.write(json.dumps(row) + "\n")


def make(root: Path, runs: int, rows: int, big_mb: float) -> None:
    from launcher.track import registry
    from spec.rundir import update_run_json

    for i in range(runs):
        sweep = i % 2 == 1  # half are points of sweeps of 10
        run_dir = (root / "multirun" / f"sweep{i // 20}-0123abcd" / str(i // 2 % 10)) if sweep \
            else root / f"model=tiny_train.seed={i}-{i:08x}"
        (run_dir / "logs").mkdir(parents=True)
        (run_dir / "checkpoints" / "step_00000010").mkdir(parents=True)
        (run_dir / "logs" / "rank0.log").write_text("step 10\n")
        nodes, steps = 1 + i % 4, 1000
        fields = dict(status=STATUSES[i % len(STATUSES)], strategy=("ddp", "fsdp", "zero3")[i % 3], nodes=nodes,
                      world_size=nodes * 8, job_id=str(100000 + i) if i % 5 else "local", run_dir=str(run_dir))
        if i % 4:  # run.json of an older launcher has no steps: config.yaml's are read
            fields.update(steps=steps, gpus_per_node=8)
        update_run_json(run_dir, **fields)
        (run_dir / "config.yaml").write_text(CONFIG.format(nodes=nodes, steps=steps))
        if i % 3 == 0:
            metrics(run_dir / "metrics.jsonl", rows, big_mb if i % 50 == 0 else 0.0)
        if sweep:
            registry.record(run_dir.parent, run_dir.name, "submitted", job_id=fields["job_id"], nodes=nodes,
                            gpus_per_node=8, strategy=fields["strategy"], run_dir=str(run_dir))


def in_process(root: Path, repeats: int) -> float:
    from launcher.track import catalog

    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        with contextlib.redirect_stdout(io.StringIO()):
            code = catalog.main([str(root), "--no-slurm"])
        best = min(best, time.perf_counter() - start)
        assert code == 0
    return best


def subprocess_wall(root: Path) -> tuple:
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    start = time.perf_counter()
    proc = subprocess.run([sys.executable, "-m", "launcher.list", str(root), "--no-slurm"], cwd=REPO, env=env,
                          capture_output=True, text=True)
    wall = time.perf_counter() - start
    assert proc.returncode == 0, proc.stderr
    return wall, len(proc.stdout.splitlines())


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=1000, help="run directories to make (default 1000)")
    parser.add_argument("--rows", type=int, default=3000, help="metrics.jsonl rows of every third run (default 3000)")
    parser.add_argument("--big-mb", type=float, default=20.0, help="size of one in fifty metrics.jsonl (default 20 MB)")
    parser.add_argument("--repeats", type=int, default=5, help="in-process repeats, the best counts (default 5)")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="list_runs.") as tmp:
        root = Path(tmp) / "runs"
        start = time.perf_counter()
        make(root, args.runs, args.rows, args.big_mb)
        size = sum(f.stat().st_size for f in root.rglob("metrics.jsonl")) / 2**20
        print(f"made {args.runs} run directories in {time.perf_counter() - start:.1f} s "
              f"(metrics.jsonl: {size:.0f} MB in all)")
        best = in_process(root, args.repeats)
        wall, lines = subprocess_wall(root)
    print(f"in-process, best of {args.repeats}: {best:.3f} s  ({best / GOAL_S:.2f} of the {GOAL_S:.0f} s goal)")
    print(f"python -m launcher.list ROOT --no-slurm: {wall:.3f} s wall  ({wall / GOAL_S:.2f} of the goal; "
          f"{lines} lines printed)")
    print(f"load average: {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores")
    return 0 if max(best, wall) < GOAL_S else 1


if __name__ == "__main__":
    raise SystemExit(main())
