"""``python -m launcher.status [SWEEP_DIR]``: where every point of a sweep stands.

The sweep's registry (``launcher.track.registry``) says what was submitted; Slurm is asked
about all the sweep's jobs at once, one ``squeue`` and one ``sacct -D`` call whatever
the sweep's size (a per-job loop would hammer the controller of a shared cluster);
each point's run.json and metrics.jsonl add restarts, last step and throughput.

Job ids are reused (they wrap on large clusters, and restart from 1 when a cluster's
state is wiped): an id is taken for ours only when Slurm's record of it has the job name
of our sbatch script and was submitted when the registry says we submitted it.
Without SWEEP_DIR the newest sweep under ``runs/multirun`` is shown.
"""
from __future__ import annotations

import argparse
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Dict, List, Optional

from launcher.track import registry, single
from launcher.track.scaling import classify, point_metrics, slurm_time, stitch, varying_overrides
from slurm import query
from slurm.states import Outcome, decide, is_job_id, job_state
from spec.rundir import read_metrics, read_run_json

# sbatch returns before the registry line is written, so a job's Submit precedes it by
# the submission latency; the slack on the other side absorbs login/controller clock skew.
EARLY_S, LATE_S = 600.0, 60.0


class UsageError(Exception):
    """A mistake of the user's (printed as one ``error:`` line, exit 2)."""


@dataclass
class Point:
    point: str
    event: str                      # submitted | skipped | unchanged (newest registry line)
    overrides: List[str]
    job_id: Optional[str] = None
    run_dir: Optional[Path] = None
    strategy: str = "?"
    nodes: Optional[int] = None
    gpus_per_node: Optional[int] = None
    submitted_at: Optional[float] = None
    job_name: Optional[str] = None  # from the point's sbatch.sh
    run: Dict[str, Any] = field(default_factory=dict)
    rows: List[Dict[str, Any]] = field(default_factory=list)   # stitched metrics
    queue: Optional[Dict[str, str]] = None                     # squeue row, when queued
    acct: List[Dict[str, str]] = field(default_factory=list)  # our sacct rows, one per segment
    reused: str = ""
    outcome: Outcome = Outcome.UNKNOWN  # slurm.states.decide
    state: str = "?"
    failure: str = ""               # one of scaling.FAILURE_CLASSES for failed points
    detail: str = ""                # skip reason, failure evidence, or a note

    @property
    def world(self) -> Optional[int]:
        if self.run.get("world_size"):
            return int(self.run["world_size"])
        return self.nodes * self.gpus_per_node if self.nodes and self.gpus_per_node else None

    @property
    def finished(self) -> bool:
        return self.outcome.finished

    @property
    def restarts(self) -> int:
        counted = int(self.run.get("preemptions", 0) or 0) + int(self.run.get("timeouts", 0) or 0)
        return max(len(self.acct) - 1, counted, int(self.run.get("segments", 1) or 1) - 1, 0)


@dataclass
class Sweep:
    sweep_dir: Path
    points: List[Point]
    slurm_conf: Optional[str] = None  # the one the sweep was submitted with (registry)
    slurm_error: Optional[str] = None


def resolve_sweep_dir(arg: Optional[str], root: str = "runs") -> Path:
    if arg:
        path = Path(arg)
        if registry.is_sweep(path):
            return path
        if registry.is_point(path):  # a point's directory: its sweep
            return path.parent
        raise UsageError(f"{arg}: no sweep registry ({registry.REGISTRY}) there; pass a sweep directory "
                         f"such as {root}/multirun/<sweep>")
    found = sorted(Path(root).glob(f"multirun/*/{registry.REGISTRY}"), key=lambda p: p.stat().st_mtime)
    if not found:
        raise UsageError(f"no sweep under {root}/multirun; pass SWEEP_DIR or start one with "
                         f"`python -m launcher ... -m`")
    return found[-1].parent


def _int(value: Any) -> Optional[int]:
    try:
        return int(value)
    except (TypeError, ValueError):
        return None


def _point(entry: Dict[str, Any]) -> Point:
    run_dir = Path(entry["run_dir"]) if entry.get("run_dir") else None
    run = read_run_json(run_dir) if run_dir and run_dir.is_dir() else {}
    job = entry.get("job_id") or run.get("job_id")
    job = str(job) if job is not None else None
    # When our submission happened: the newest "submitted" line that carries this job id.
    submitted = [h["time"] for h in entry.get("history", []) if h.get("event") == "submitted"
                 and str(h.get("job_id")) == job]
    return Point(point=entry["point"], event=entry["event"], overrides=list(entry.get("overrides", [])),
                 job_id=job, run_dir=run_dir, strategy=entry.get("strategy") or run.get("strategy") or "?",
                 nodes=_int(entry.get("nodes") or run.get("nodes")), gpus_per_node=_int(entry.get("gpus_per_node")),
                 submitted_at=submitted[-1] if submitted else None, job_name=registry.job_name_of(run_dir), run=run,
                 rows=stitch(read_metrics(run_dir)) if run_dir and run_dir.is_dir() else [],
                 detail=entry.get("reason", "") if entry["event"] != "submitted" else "")


def own_rows(point: Point, rows: List[Dict[str, str]]) -> List[Dict[str, str]]:
    """The sacct rows (oldest first) that belong to this point's job; sets ``reused``
    when the id's record is another job's."""
    if point.job_name:
        # slurmdbd records a job as "allocation" until it starts: no name to compare yet.
        named = [r for r in rows if r["JobName"] in (point.job_name, "allocation")]
        if rows and not named:
            point.reused = f"job id {point.job_id} now belongs to job {rows[-1]['JobName']!r}"
            return []
        rows = named
    if point.submitted_at is None or not rows:
        return rows
    # Rows submitted long before us are an older job with this id; ours starts with a row
    # submitted just before the registry line (requeued segments come after it).
    later = [r for r in rows if (slurm_time(r["Submit"]) or 0) >= point.submitted_at - EARLY_S]
    if not later or (slurm_time(later[0]["Submit"]) or 0) > point.submitted_at + LATE_S:
        when = later[0]["Submit"] if later else rows[-1]["Submit"]
        point.reused = f"job id {point.job_id} was reused: Slurm's job was submitted {when}, " \
                       f"ours at {time.strftime('%Y-%m-%dT%H:%M:%S', time.localtime(point.submitted_at))}"
        return []
    return later


def _log_tail(run_dir: Optional[Path], limit: int = 16384) -> str:
    """The ends of the point's logs (errors are at the end; reading all of a long run's
    logs for a sweep of many points would be slow)."""
    if not run_dir:
        return ""
    paths = sorted(run_dir.glob("logs/rank*.log"))[:64] + sorted(run_dir.glob("slurm/*_log.err"))[:64]
    parts = []
    for path in paths:
        try:
            with open(path, "rb") as f:
                f.seek(max(0, path.stat().st_size - limit))
                parts.append(f.read().decode(errors="replace"))
        except OSError:
            continue
    return "\n".join(parts)


def settle(p: Point, slurm_ok: bool) -> None:
    """Decide outcome and displayed state (:func:`slurm.states.decide`) and, for
    failures, the class."""
    last = p.acct[-1]["State"] if p.acct else None
    decision = decide(p.run, skipped=p.event == "skipped", queued=p.queue["State"] if p.queue is not None else None,
                      accounted=last, slurm_job=is_job_id(p.job_id), slurm_ok=slurm_ok, trust_slurm=not p.reused)
    p.outcome, p.state = decision.outcome, decision.state
    if decision.lost:
        p.detail = p.detail or f"job {p.job_id} is in neither squeue nor sacct"
    if p.outcome is Outcome.FAILED:
        exit_code = p.acct[-1]["ExitCode"] if p.acct else ""
        p.failure, evidence = classify(job_state(last), exit_code, _log_tail(p.run_dir), p.run)
        p.detail = "; ".join(x for x in (p.reused, evidence) if x)


def collect(sweep_dir: Path) -> Sweep:
    """Every point of the sweep with its state: two Slurm calls in all."""
    entries = registry.read(sweep_dir)
    if not entries:
        raise UsageError(f"{sweep_dir}: the sweep registry is empty; nothing was submitted there")
    points = [_point(e) for e in entries]
    ids = [p.job_id for p in points if p.event != "skipped" and is_job_id(p.job_id)]
    confs = [e.get("slurm_conf") for e in entries if e.get("slurm_conf")]
    sweep, queue, acct = Sweep(Path(sweep_dir), points, confs[0] if confs else None), {}, {}
    env = query.slurm_env(sweep.slurm_conf)
    if ids:
        try:
            queue = query.squeue_jobs(ids, env)
            acct = query.sacct_history(ids, env)
        except query.SlurmUnavailable as exc:
            sweep.slurm_error = str(exc).splitlines()[0]
    for p in points:
        if p.event == "skipped" or p.job_id not in ids:
            settle(p, sweep.slurm_error is None)
            continue
        p.acct = own_rows(p, acct.get(p.job_id, []))
        row = queue.get(p.job_id)
        if row and not p.reused and (not p.job_name or row["JobName"] == p.job_name):
            p.queue = row
        settle(p, sweep.slurm_error is None)
    return sweep


def console():
    """A rich console that does not squeeze tables to 80 columns when piped."""
    from rich.console import Console

    probe = Console()
    return probe if probe.is_terminal else Console(width=200)


def status_table(sweep: Sweep):
    from rich.table import Table

    table = Table(title=f"sweep {sweep.sweep_dir}")
    for name in ("point", "overrides", "job", "state", "nodes x ranks", "restarts", "step", "tokens/s", "note"):
        table.add_column(name, justify="right" if name in ("restarts", "tokens/s") else "left")
    labels = varying_overrides([p.overrides for p in sweep.points])
    for p, label in zip(sweep.points, labels):
        m = point_metrics(p.rows)
        size = f"{p.nodes or '?'} x {p.gpus_per_node or '?'}" if p.event != "skipped" else "-"
        note = p.failure + (f": {p.detail}" if p.detail else "") if p.failure else p.reused or p.detail
        table.add_row(p.point, label, p.job_id or "-", p.state, size, str(p.restarts) if p.job_id else "-",
                      str(m.get("last_step", "-")), f"{m['tokens_per_s']:,.0f}" if m else "-", note[:100])
    return table


def counts(sweep: Sweep) -> str:
    tally: Dict[str, int] = {}
    for p in sweep.points:
        tally[p.outcome] = tally.get(p.outcome, 0) + 1
    return f"{len(sweep.points)} points: " + ", ".join(f"{n} {k}" for k, n in sorted(tally.items()))


def node_lines(run_dir: Path) -> List[str]:
    """One line per node the run ran on (``RUN_DIR/nodes/<host>.json``, written by each
    node's local rank 0: train/harness/node_facts.py), and the nodes excluded so far."""
    import json

    lines = []
    for path in sorted((run_dir / "nodes").glob("*.json"))[:64]:
        try:
            f = json.loads(path.read_text())
        except (OSError, ValueError):
            continue
        gpus = f"{f.get('gpu_count') or 0} x {f['gpu_model']}" if f.get("gpu_model") else "no GPU"
        lines.append(f"node {f.get('host', path.stem)}: torch {f.get('torch')}, CUDA {f.get('cuda') or '-'}, "
                     f"cuDNN {f.get('cudnn') or '-'}, NCCL {f.get('nccl') or '-'}, driver {f.get('driver') or '-'}, "
                     f"{gpus}, {f.get('cpu_count')} CPUs")
    info = read_run_json(run_dir)
    for e in info.get("node_exclusions") or []:
        lines.append(f"excluded {', '.join(e.get('nodes', []))} after {e.get('reason')} (job {e.get('job_id')}, "
                     f"segment {e.get('segment')}): requeued without it")
    return lines


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m launcher.status", description=__doc__.splitlines()[0])
    parser.add_argument("sweep_dir", nargs="?", help="sweep directory (default: newest under runs/multirun), "
                        "or a single run's directory")
    args = parser.parse_args(argv)
    if args.sweep_dir and single.is_single_run(Path(args.sweep_dir)):
        code = single.status_main(Path(args.sweep_dir))
        print("\n".join(node_lines(Path(args.sweep_dir))))
        return code
    try:
        sweep = collect(resolve_sweep_dir(args.sweep_dir))
    except UsageError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    out = console()
    out.print(status_table(sweep))
    out.print(counts(sweep))
    if sweep.slurm_error:
        out.print(f"warning: Slurm did not answer ({sweep.slurm_error}); states come from run.json")
    return 0
