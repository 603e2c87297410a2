"""Wait for a sweep with a progress display, then report (``launcher.wait=true`` with -m).

Each poll is one ``launcher.status.collect``: one squeue and one sacct call for the
whole sweep, so a long wait on a shared cluster costs the controller two queries per
interval whatever the number of points.
"""
from __future__ import annotations

import sys
import time
from pathlib import Path

from launcher.track.status import Sweep, UsageError, collect, console


def describe(sweep: Sweep) -> str:
    tally = {k: sum(p.outcome == k for p in sweep.points) for k in ("pending", "running", "completed", "failed")}
    text = ", ".join(f"{n} {k}" for k, n in tally.items() if n)
    return text + (f" (Slurm: {sweep.slurm_error[:60]})" if sweep.slurm_error else "")


def wait_until_finished(sweep_dir: Path, poll_s: float = 2.0, out=None) -> Sweep:
    """Block until every point of the sweep has finished (completed, failed or skipped)."""
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    out = out or console()
    sweep = collect(sweep_dir)
    done = sum(p.finished for p in sweep.points)
    last = ""
    with Progress(TextColumn("sweep"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                  TextColumn("{task.description}"), console=out) as bar:
        task = bar.add_task(describe(sweep), total=len(sweep.points), completed=done)
        while done < len(sweep.points):
            if not out.is_terminal and describe(sweep) != last:  # logs get a line per change, not a bar
                last = describe(sweep)
                out.print(f"sweep: {done}/{len(sweep.points)} finished; {last}")
            time.sleep(poll_s)
            sweep = collect(sweep_dir)
            done = sum(p.finished for p in sweep.points)
            bar.update(task, completed=done, description=describe(sweep))
    return sweep


def wait_sweep(sweep_dir: Path, poll_s: float = 2.0) -> int:
    """Wait for every point, write the report files, print the report table.

    Returns 0 only when every submitted point completed (skipped points were reported
    at submission and do not count), 1 otherwise, 2 for a sweep directory without a
    registry, 130 when interrupted (the jobs keep running).
    """
    from launcher.track import report

    out = console()
    try:
        sweep = wait_until_finished(Path(sweep_dir), poll_s, out)
    except UsageError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"stopped waiting; the jobs go on: python -m launcher.status {sweep_dir}", file=sys.stderr)
        return 130
    report.publish(sweep, out)
    ran = [p for p in sweep.points if p.outcome != "skipped"]
    return 0 if ran and all(p.outcome == "completed" for p in ran) else 1
