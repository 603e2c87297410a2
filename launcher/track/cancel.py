"""``python -m launcher.cancel SWEEP_DIR [POINT...]``: cancel a sweep's jobs (all, or some points);
``python -m launcher.cancel RUN_DIR``: a single run's job (:mod:`launcher.track.single`), or,
given one point's directory of a sweep (``SWEEP_DIR/1``), that point's job alone.

POINT is a point's directory name inside the sweep (Hydra's job number: 0, 1, ...).
The jobs are found as ``launcher.status`` finds them (one squeue + one sacct call) and
cancelled with one scancel call (after one ``scontrol update Requeue=0``, so the
trainer's preemption path cannot requeue a cancelled job). A job id that Slurm now gives to another job (ids are
reused) is never cancelled: only queued jobs with our job name and submission time are.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import List, Optional

from launcher.track import registry
from launcher.track.status import UsageError, collect, resolve_sweep_dir
from slurm import query


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m launcher.cancel", description=__doc__.splitlines()[0])
    parser.add_argument("sweep_dir", help="sweep directory (runs/multirun/<sweep>), or a single run's directory")
    parser.add_argument("points", nargs="*", help="points to cancel (default: every point)")
    args = parser.parse_args(argv)
    from launcher.track import single

    if single.is_single_run(Path(args.sweep_dir)):
        if args.points:
            print(f"error: {args.sweep_dir} is a single run, not a sweep: it has no points; drop "
                  f"{' '.join(args.points)}", file=sys.stderr)
            return 2
        return single.cancel_main(Path(args.sweep_dir))
    path = Path(args.sweep_dir)
    if registry.is_point(path):
        if args.points:  # SWEEP_DIR/1 names its point: the rest would be points of the sweep
            print(f"error: {path} is point {path.name} of the sweep {path.parent}; cancel it alone, or pass "
                  f"{path.parent} {' '.join(args.points)}", file=sys.stderr)
            return 2
        args.points = [path.name]  # one point's directory: that point, not its whole sweep
    try:
        sweep = collect(resolve_sweep_dir(args.sweep_dir))
        known = {p.point: p for p in sweep.points}
        unknown = [name for name in args.points if name not in known]
        if unknown:
            raise UsageError(f"{args.sweep_dir} has no point {', '.join(unknown)}; its points are "
                             f"{', '.join(known)}")
    except UsageError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if sweep.slurm_error:
        print(f"error: Slurm did not answer ({sweep.slurm_error}); check the controller (scontrol ping) "
              "and SLURM_CONF, then run the cancel again", file=sys.stderr)
        return 1
    chosen = [known[name] for name in args.points] if args.points else sweep.points
    live = [p for p in chosen if p.queue is not None]
    for p in chosen:
        if p.queue is None:
            print(f"point {p.point}: nothing to cancel ({p.outcome}{', ' + p.reused if p.reused else ''})")
    if not live:
        return 0
    try:
        query.scancel([p.job_id for p in live], query.slurm_env(sweep.slurm_conf))
    except query.SlurmUnavailable as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    for p in live:
        print(f"point {p.point}: cancelled job {p.job_id} ({p.state})")
    return 0
