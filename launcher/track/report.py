"""``python -m launcher.report SWEEP_DIR [--wait]``: the scaling report of a sweep.

Writes ``report.md``, ``report.csv`` and ``scaling.png`` into SWEEP_DIR with one row
per point. Throughput is measured over the steady steps of the stitched metrics (all
segments of a requeued run, the newest row of a step that ran twice); queue time, wall
time and GPU-hours come from sacct's Submit/Start/End of every segment. Points of one
*series* differ only in their size (``cluster.nodes``, ``cluster.gpus_per_node``); each
point's efficiency is against the smallest completed point of its series:
throughput(N) / (throughput(N0) x N / N0) in samples/s. A series is weak scaling when
its global batch grows with the ranks, strong scaling when the global batch is fixed.
Failed points are listed with their class and do not stop the report.
"""
from __future__ import annotations

import argparse
import csv
import sys
import time
from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple

from launcher.track.progress import wait_until_finished
from launcher.track.scaling import efficiency, point_metrics, scaling_kind, series_labels, slurm_time
from launcher.track.status import Point, Sweep, UsageError, collect, console, resolve_sweep_dir
from slurm.states import Outcome
from spec import evals

COLUMNS = ("point", "series", "strategy", "nodes", "gpus", "outcome", "state", "failure_class", "failure_detail",
           "global_batch", "tokens_per_s", "samples_per_s", "tokens_per_s_per_gpu", "efficiency", "scaling",
           "baseline_point", "peak_mem_gib_per_gpu", "mfu", "step_time_s", "compute_s", "comm_s", "queue_s",
           "wall_s", "gpu_hours", "requeues", "last_step", "job_id", "run_dir", "peak_lr", "val_loss",
           "eval_step", "eval_scores")
FILES = ("report.md", "report.csv", "scaling.png")


def timing(p: Point, now: Optional[float] = None) -> Dict[str, Optional[float]]:
    """Queue and wall time summed over the job's segments (a requeued job waits and runs
    again), and the GPU-hours its allocations held."""
    if not p.acct:
        return {"queue_s": None, "wall_s": None, "gpu_hours": None}
    now = now or time.time()
    queue = wall = 0.0
    for row in p.acct:
        submit, start, end = (slurm_time(row[k]) for k in ("Submit", "Start", "End"))
        if start is None:
            queue += (now - submit) if submit else 0.0
            continue
        queue += start - submit if submit else 0.0
        wall += (end or now) - start
    return {"queue_s": queue, "wall_s": wall, "gpu_hours": wall * (p.world or 0) / 3600}


def scores(run_dir: Optional[Path]) -> Dict[str, Any]:
    """The point's newest evaluation (eval.jsonl, spec/evals.py): its step and its scores,
    ``task/metric=value`` joined by ``; `` (the validation loss is ``val/loss``)."""
    newest = evals.newest_scores(run_dir) if run_dir else {}
    if not newest:
        return {"eval_step": None, "eval_scores": ""}
    text = "; ".join(f"{k}={v:.4g}" for k, v in sorted(newest["scores"].items()))
    return {"eval_step": newest["step"], "eval_scores": text}


def report_rows(sweep: Sweep) -> List[Dict[str, Any]]:
    labels = series_labels([p.overrides for p in sweep.points], [p.strategy for p in sweep.points])
    rows = []
    for p, label in zip(sweep.points, labels):
        m = point_metrics(p.rows)
        gpus = p.world
        tps = m.get("tokens_per_s")
        peak = m.get("peak_mem_bytes")
        rows.append({
            "point": p.point, "series": label, "strategy": p.strategy, "nodes": p.nodes, "gpus": gpus,
            "outcome": p.outcome.value, "state": p.state, "failure_class": p.failure,
            "failure_detail": p.detail if p.outcome in (Outcome.FAILED, Outcome.SKIPPED) else "",
            "global_batch": m.get("global_batch_size"), "peak_lr": m.get("lr"), "val_loss": m.get("val_loss"),
            "tokens_per_s": tps, "samples_per_s": m.get("samples_per_s"),
            "tokens_per_s_per_gpu": tps / gpus if tps and gpus else None, "efficiency": None, "scaling": "",
            "baseline_point": "", "peak_mem_gib_per_gpu": peak / 2**30 if peak else None, "mfu": m.get("mfu"),
            "step_time_s": m.get("step_time_s"), "compute_s": m.get("compute_s"), "comm_s": m.get("comm_s"),
            **timing(p), "requeues": p.restarts if p.job_id else None, "last_step": m.get("last_step"),
            "job_id": p.job_id, "run_dir": str(p.run_dir or ""), **scores(p.run_dir),
        })
    for label in sorted(set(labels)):
        members = [r for r in rows if r["series"] == label and r["outcome"] == Outcome.COMPLETED and r["gpus"]
                   and (r["samples_per_s"] or r["tokens_per_s"])]
        if not members:
            continue
        # Samples/s where every point has it (the built-in trainer); tokens/s for a user's
        # code that logs only that.
        basis = "samples_per_s" if all(r["samples_per_s"] for r in members) else "tokens_per_s"
        members = [r for r in members if r[basis]]
        kind = scaling_kind((r["gpus"], r["global_batch"]) for r in members)
        base = min(members, key=lambda r: (r["gpus"], r["nodes"] or 0, len(r["point"]), r["point"]))
        for r in members:
            r["efficiency"] = efficiency(r[basis], r["gpus"], base[basis], base["gpus"])
            r["scaling"], r["baseline_point"], r["_basis"] = kind, base["point"], basis
    return rows


def _csv_value(value: Any) -> Any:
    return f"{value:.10g}" if isinstance(value, float) else ("" if value is None else value)


def write_csv(rows: List[Dict[str, Any]], path: Path) -> None:
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=COLUMNS)
        writer.writeheader()
        for row in rows:
            writer.writerow({k: _csv_value(row.get(k)) for k in COLUMNS})


def _fmt(value: Any, spec: str = ",.1f", scale: float = 1.0, suffix: str = "") -> str:
    if value is None or value == "":
        return "-"
    return f"{value * scale:{spec}}{suffix}" if isinstance(value, (int, float)) else str(value)


# (header, key, format spec, scale, suffix) of the human tables (Markdown and terminal).
SHOWN = (("point", "point", "", 1, ""), ("series", "series", "", 1, ""), ("nodes", "nodes", "", 1, ""),
         ("GPUs", "gpus", "", 1, ""), ("outcome", "outcome", "", 1, ""), ("global batch", "global_batch", "", 1, ""),
         ("peak lr", "peak_lr", ".2e", 1, ""), ("val loss", "val_loss", ".4f", 1, ""),
         ("eval (newest)", "eval_scores", "", 1, ""), ("tokens/s", "tokens_per_s", ",.0f", 1, ""), ("samples/s", "samples_per_s", ",.1f", 1, ""),
         ("tokens/s/GPU", "tokens_per_s_per_gpu", ",.0f", 1, ""), ("efficiency", "efficiency", ".1f", 100, "%"),
         ("peak mem/GPU", "peak_mem_gib_per_gpu", ".2f", 1, " GiB"), ("MFU", "mfu", ".1f", 100, "%"),
         ("step", "step_time_s", ".3f", 1, " s"), ("compute/comm", None, "", 1, ""),
         ("queue", "queue_s", ".0f", 1, " s"), ("wall", "wall_s", ".0f", 1, " s"),
         ("GPU-h", "gpu_hours", ".4f", 1, ""), ("requeues", "requeues", "", 1, ""))


def _cells(row: Dict[str, Any]) -> List[str]:
    cells = []
    for _, key, spec, scale, suffix in SHOWN:
        if key is None:  # the step split, where the strategy measures it
            split = (row["compute_s"], row["comm_s"])
            cells.append("-" if None in split else f"{split[0]:.3f} / {split[1]:.3f} s")
        elif key == "outcome" and row["failure_class"]:
            cells.append(f"failed ({row['failure_class']})")
        else:
            cells.append(_fmt(row[key], spec, scale, suffix))
    return cells


def write_markdown(rows: List[Dict[str, Any]], sweep: Sweep, path: Path) -> None:
    lines = [f"# Scaling report: {sweep.sweep_dir}", "",
             "Efficiency = throughput(N) / (throughput(N0) x N / N0) in samples/s, against the smallest "
             "completed point N0 of the same series (points that differ only in nodes / GPUs per node). "
             "Weak scaling: the global batch grows with the GPUs; strong scaling: it stays fixed. "
             "Throughput is total work / total time over the steady steps (the first quarter, and at least "
             "the first step, is warm-up). GPUs = ranks (task slots on a CPU cluster).", ""]
    for label in sorted({r["series"] for r in rows}):
        kinds = {r["scaling"] for r in rows if r["series"] == label and r["scaling"]}
        base = {r["baseline_point"] for r in rows if r["series"] == label and r["baseline_point"]}
        lines.append(f"- series `{label}`: " + (f"{kinds.pop()} scaling, baseline point {base.pop()}" if kinds
                                                else "no completed point, no efficiency"))
    lines += ["", "| " + " | ".join(h for h, *_ in SHOWN) + " |", "|" + "---|" * len(SHOWN)]
    lines += ["| " + " | ".join(c.replace("|", "\\|") for c in _cells(r)) + " |" for r in rows]
    failed = [r for r in rows if r["outcome"] in (Outcome.FAILED, Outcome.SKIPPED)]
    if failed:
        lines += ["", "## Failed and skipped points", ""]
        lines += [f"- point {r['point']} (job {r['job_id'] or '-'}, {r['state']}): "
                  f"{r['failure_class'] or r['outcome']}: {r['failure_detail'] or '-'}" for r in failed]
    if sweep.slurm_error:
        lines += ["", f"Slurm did not answer ({sweep.slurm_error}); states come from run.json."]
    path.write_text("\n".join(lines) + "\n")


def plot(rows: List[Dict[str, Any]], path: Path) -> List[str]:
    """Throughput and efficiency against GPUs, one line per series; returns the series
    plotted (also stored in the PNG's "Series" text chunk, for tools and tests)."""
    from matplotlib.figure import Figure  # no pyplot: no GUI backend, headless by construction

    fig = Figure(figsize=(11, 4.2), layout="constrained")
    thr, eff = fig.subplots(1, 2)
    series, ticks = [], set()
    for label in sorted({r["series"] for r in rows}):
        pts = sorted((r["gpus"], r[r["_basis"]], r["efficiency"]) for r in rows
                     if r["series"] == label and r["efficiency"] is not None)
        if not pts:
            continue
        series.append(label)
        gpus = [g for g, _, _ in pts]
        kind = next(r["scaling"] for r in rows if r["series"] == label and r["scaling"])
        line, = thr.plot(gpus, [s for _, s, _ in pts], marker="o", label=f"{label} ({kind})")
        base_g, base_s, _ = pts[0]
        thr.plot(gpus, [base_s * g / base_g for g in gpus], ls="--", color=line.get_color(), alpha=0.5)
        eff.plot(gpus, [e * 100 for _, _, e in pts], marker="o", label=f"{label} ({kind})", color=line.get_color())
        ticks.update(gpus)
    bases = {r["_basis"] for r in rows if r.get("_basis")}
    thr.set(xlabel="GPUs (ranks)", ylabel=" | ".join(sorted(b.replace("_per_s", "/s") for b in bases)) or "samples/s", title="throughput (dashed: linear from the smallest point)")
    eff.set(xlabel="GPUs (ranks)", ylabel="efficiency %", title="scaling efficiency")
    eff.axhline(100, color="grey", lw=0.8)
    for ax in (thr, eff):
        ax.grid(alpha=0.3)
        if ticks:  # GPU counts double from point to point: a log2 axis labelled with the real counts
            ax.set_xscale("log", base=2)
            ax.set_xticks(sorted(ticks), [str(t) for t in sorted(ticks)])
            ax.minorticks_off()
        if series:
            ax.legend(fontsize=8)
        else:
            ax.text(0.5, 0.5, "no completed point", ha="center", va="center", transform=ax.transAxes)
    fig.savefig(path, dpi=100, metadata={"Title": "scaling", "Series": "; ".join(series)})
    return series


def write_report(sweep: Sweep) -> Tuple[List[Dict[str, Any]], List[Path]]:
    rows = report_rows(sweep)
    paths = [sweep.sweep_dir / name for name in FILES]
    write_markdown(rows, sweep, paths[0])
    write_csv(rows, paths[1])
    plot(rows, paths[2])
    return rows, paths


def publish(sweep: Sweep, out) -> List[Dict[str, Any]]:
    """Write the report files and print the table and where they are."""
    rows, paths = write_report(sweep)
    out.print(table(rows, f"scaling report: {sweep.sweep_dir}"))
    out.print("wrote " + ", ".join(str(p) for p in paths))
    return rows


def table(rows: List[Dict[str, Any]], title: str = "scaling report"):
    from rich.table import Table

    t = Table(title=title)
    for header, *_ in SHOWN:
        t.add_column(header)
    for row in rows:
        t.add_row(*_cells(row))
    return t


def wait_sweep(sweep_dir: Path, poll_s: float = 2.0) -> int:
    """Wait for every point, write the report files, print the report table.

    Returns 0 only when every submitted point completed (skipped points were reported
    at submission and do not count), 1 otherwise, 2 for a sweep directory without a
    registry, 130 when interrupted (the jobs keep running).
    """
    out = console()
    try:
        sweep = wait_until_finished(Path(sweep_dir), poll_s, out)
    except UsageError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"stopped waiting; the jobs go on: python -m launcher.status {sweep_dir}", file=sys.stderr)
        return 130
    publish(sweep, out)
    ran = [p for p in sweep.points if p.outcome is not Outcome.SKIPPED]
    return 0 if ran and all(p.outcome is Outcome.COMPLETED for p in ran) else 1


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m launcher.report", description=__doc__.splitlines()[0])
    parser.add_argument("sweep_dir", nargs="?", help="sweep directory (default: newest under runs/multirun)")
    parser.add_argument("--wait", action="store_true", help="wait until every point has finished")
    parser.add_argument("--poll", type=float, default=2.0, help="seconds between Slurm queries with --wait")
    args = parser.parse_args(argv)
    try:
        sweep_dir = resolve_sweep_dir(args.sweep_dir)
        sweep = None if args.wait else collect(sweep_dir)
    except UsageError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if sweep is None:
        code = wait_sweep(sweep_dir, args.poll)
        return 0 if code == 1 else code  # 1 = some point failed: the report says which, it was written
    publish(sweep, console())
    return 0
