"""Wait for a sweep with a progress display, then report (``launcher.wait=true`` with -m).

Each poll is one ``launcher.status.collect``: one squeue and one sacct call for the
whole sweep, so a long wait on a shared cluster costs the controller two queries per
interval whatever the number of points.
"""
from __future__ import annotations

import time
from pathlib import Path

from launcher.track.status import Sweep, collect, console
from slurm.states import Outcome


def describe(sweep: Sweep) -> str:
    tally = {k: sum(p.outcome is k for p in sweep.points)
             for k in (Outcome.PENDING, Outcome.RUNNING, Outcome.COMPLETED, Outcome.FAILED)}
    text = ", ".join(f"{n} {k}" for k, n in tally.items() if n)
    return text + (f" (Slurm: {sweep.slurm_error[:60]})" if sweep.slurm_error else "")


def wait_until_finished(sweep_dir: Path, poll_s: float = 2.0, out=None, max_poll_s: float = 30.0) -> Sweep:
    """Block until every point of the sweep has finished (completed, failed or skipped);
    Slurm is asked less often as the wait grows (:func:`launcher.submit.poll_interval`)."""
    from launcher.submit import poll_interval

    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    out = out or console()
    sweep = collect(sweep_dir)
    done = sum(p.finished for p in sweep.points)
    last = ""
    start = time.monotonic()
    with Progress(TextColumn("sweep"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                  TextColumn("{task.description}"), console=out) as bar:
        task = bar.add_task(describe(sweep), total=len(sweep.points), completed=done)
        while done < len(sweep.points):
            if not out.is_terminal and describe(sweep) != last:  # logs get a line per change, not a bar
                last = describe(sweep)
                out.print(f"sweep: {done}/{len(sweep.points)} finished; {last}")
            time.sleep(poll_interval(time.monotonic() - start, poll_s, max_poll_s))
            sweep = collect(sweep_dir)
            done = sum(p.finished for p in sweep.points)
            bar.update(task, completed=done, description=describe(sweep))
    return sweep
