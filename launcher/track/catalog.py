"""``python -m launcher.list [ROOT]``: every run and sweep under ROOT at a glance, one line each.

A run is a directory with run.json (``ROOT/<slug>``, or wherever ``launcher.run_dir=`` put it
below ROOT), a sweep one with a registry (``ROOT/multirun/<slug>``): its line (points and
their tally) comes before its points, in point order; runs and sweeps newest first (the
last write of run.json or metrics.jsonl). A line costs a few small reads: run.json, the
last complete row of metrics.jsonl (read backwards from its end: the file may hold 100 MB),
and the train block's ``steps`` of config.yaml when run.json has none. Runs that run.json
does not call ended and whose job is a Slurm job are asked about in one ``squeue`` per
Slurm configuration (never sacct: too slow for a thousand runs); :func:`slurm.states.decide`
says where each run stands.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Dict, Iterator, List, Optional, Set

from launcher.track import registry
from slurm import query
from slurm.states import Outcome, decide, ended, is_job_id
from spec.rundir import (CHECKPOINTS, CONFIG, LOGS, METRICS, REGISTRY, RUN_JSON, TENSORBOARD, WANDB, Status,
                         status_of)

SKIP = {CHECKPOINTS, LOGS, "slurm", TENSORBOARD, WANDB}  # never walked into (nor dot-directories)
MAX_DEPTH = 4  # ROOT/multirun/<sweep>/<point> is 3 levels down; launcher.run_dir= may go one further
TAIL, MAX_TAIL = 8192, 8 << 20  # bytes read from metrics.jsonl's end first, and at most
UNITS = {"s": 1, "m": 60, "h": 3600, "d": 86400}
OUTCOMES = [o.value for o in Outcome]
WORDS = OUTCOMES + [s.value for s in Status if s.value not in OUTCOMES]  # --status: outcomes, then run.json's words
KEYS = ("name", "run_dir", "kind", "status", "state", "strategy", "nodes", "gpus_per_node", "world_size", "step",
        "steps", "loss", "tokens_per_s", "age_s", "updated_at", "job_id", "sweep")
# config.yaml's `train:` block, up to its own `  steps: N` line (two spaces: not a nested key's)
_STEPS = re.compile(r"^train:[ \t]*\n(?:(?:[ \t].*)?\n)*?  steps:[ \t]*(\d+)[ \t]*$", re.M)
# a sweep's status: the first outcome of this order that any of its points has
_SWEEP_ORDER = (Outcome.RUNNING, Outcome.PENDING, Outcome.UNKNOWN, Outcome.FAILED, Outcome.COMPLETED, Outcome.SKIPPED)


class UsageError(Exception):
    """A mistake of the user's (printed as one ``error:`` line, exit 2)."""


@dataclass(eq=False)
class Entry:
    """One line: a run, a sweep or a sweep's point."""

    name: str  # path relative to ROOT
    run_dir: str
    kind: str  # run | sweep | point
    info: Dict[str, Any] = field(default_factory=dict)  # run.json
    status: str = Outcome.UNKNOWN.value  # slurm.states.decide's outcome
    state: str = ""  # the state it shows: Slurm's word, else run.json's
    strategy: Optional[str] = None
    nodes: Optional[int] = None
    gpus_per_node: Optional[int] = None
    world_size: Optional[int] = None
    step: Optional[int] = None
    steps: Optional[int] = None
    loss: Optional[float] = None
    tokens_per_s: Optional[float] = None
    updated_at: Optional[float] = None
    job_id: Optional[str] = None
    sweep: Optional[str] = None  # a point's sweep (its name)
    slurm_conf: Optional[str] = None
    skipped: bool = False  # a sweep's point never submitted
    asked: bool = False  # squeue answered for it
    alive: bool = False  # a local run whose ranks wrote lately (heartbeats, metrics)
    lost: bool = False  # a Slurm job run.json calls live, not in the queue
    points: List["Entry"] = field(default_factory=list)

    def as_json(self, now: float) -> Dict[str, Any]:
        out = {k: getattr(self, k) for k in KEYS if k != "age_s"}
        out["age_s"] = round(now - self.updated_at, 1) if self.updated_at is not None else None
        return {k: out[k] for k in KEYS}


# ---- reading the disk ---------------------------------------------------------------

def _int(value: Any) -> Optional[int]:
    try:
        return int(value)
    except (TypeError, ValueError):
        return None


def last_row(path: str, size: int) -> Dict[str, Any]:
    """metrics.jsonl's last complete row with an int ``step`` (a torn last line after a
    kill is skipped), read backwards from the end in growing blocks; {} when none."""
    block = TAIL
    with open(path, "rb") as f:
        while True:
            start = max(0, size - block)
            f.seek(start)
            data = f.read(size - start)
            end = data.rfind(b"\n")
            lines = data[:end].split(b"\n") if end >= 0 else []
            for line in reversed(lines[1 if start else 0:]):  # a block's first line may be cut
                try:
                    row = json.loads(line)
                except ValueError:
                    continue
                if isinstance(row, dict) and isinstance(row.get("step"), int):
                    return row
            if start == 0 or block >= MAX_TAIL:
                return {}
            block *= 8


def config_steps(path: str) -> Optional[int]:
    """``train.steps`` of a run's config.yaml, by a regex on the train block (no YAML parse)."""
    try:
        with open(path) as f:
            match = _STEPS.search(f.read())
    except OSError:
        return None
    return int(match.group(1)) if match else None


def _listing(path: str) -> Dict[str, os.DirEntry]:
    try:
        with os.scandir(path) as it:
            return {e.name: e for e in it}
    except OSError:
        return {}


# A local run is running while its ranks write: heartbeats every 1-30 s (watchdog), metrics rows.
HEARTBEAT, ALIVE_S = "heartbeat", 120.0


def _mtimes(folder: Optional[os.DirEntry]) -> List[float]:
    """The modification times of the files in ``folder`` (a run's heartbeat/: one per rank)."""
    if folder is None:
        return []
    try:
        with os.scandir(folder.path) as it:
            return [e.stat().st_mtime for e in it if e.name.endswith(".json")]
    except OSError:
        return []


def read_run(name: str, path: str, names: Dict[str, os.DirEntry], kind: str = "run") -> Entry:
    """A run directory's line from its files (``names``: its listing)."""
    try:
        with open(names[RUN_JSON].path) as f:
            info = json.load(f)
        info = info if isinstance(info, dict) else {}
    except (OSError, ValueError):
        info = {}
    mtimes, row = [], {}
    for entry in (names.get(RUN_JSON), names.get(METRICS)):
        try:
            st = entry.stat() if entry is not None else None
        except OSError:
            st = None
        if st is not None:
            mtimes.append(st.st_mtime)
            if entry.name == METRICS and st.st_size:
                row = last_row(entry.path, st.st_size)
    nodes, world = _int(info.get("nodes")), _int(info.get("world_size"))
    gpus = _int(info.get("gpus_per_node")) or (world // nodes if world and nodes else None)
    steps = _int(info.get("steps"))
    if steps is None and CONFIG in names:
        steps = config_steps(names[CONFIG].path)
    job = info.get("job_id")
    alive = job == "local" and info.get("status") in ("starting", "running") and \
        time.time() - max(mtimes + _mtimes(names.get(HEARTBEAT)), default=0) < ALIVE_S
    return Entry(name=name, run_dir=path, kind=kind, info=info, strategy=info.get("strategy"), nodes=nodes, alive=alive,
                 gpus_per_node=gpus, world_size=world, step=row.get("step"), steps=steps, loss=row.get("loss"),
                 tokens_per_s=row.get("tokens_per_s"), updated_at=max(mtimes) if mtimes else None,
                 job_id=str(job) if job is not None else None, slurm_conf=info.get("slurm_conf"))


def read_sweep(name: str, path: str, names: Dict[str, os.DirEntry]) -> Entry:
    """A sweep's line and its points: the registry's (a skipped one has no run.json) and
    any directory of it with run.json."""
    try:
        noted = {str(e["point"]): e for e in registry.read(Path(path))}
    except (OSError, KeyError, TypeError):  # a registry line of another shape: its points' directories still count
        noted = {}
    dirs = [n for n, e in names.items() if e.is_dir(follow_symlinks=False) and not n.startswith(".")]
    points = []
    for point in sorted(set(noted) | set(dirs), key=lambda p: (len(p), p)):
        where, note = os.path.join(path, point), noted.get(point, {})
        listing = _listing(where) if point in dirs else {}
        if RUN_JSON in listing:
            p = read_run(f"{name}/{point}", where, listing, kind="point")
        elif note:
            p = Entry(name=f"{name}/{point}", run_dir=where, kind="point", updated_at=note.get("time"))
        else:
            continue  # a directory of the sweep that is no point (.code, ...)
        job = p.job_id or note.get("job_id")
        p.job_id, p.sweep, p.skipped = str(job) if job is not None else None, name, note.get("event") == "skipped"
        p.strategy = p.strategy or note.get("strategy")
        p.nodes = p.nodes or _int(note.get("nodes"))
        p.gpus_per_node = p.gpus_per_node or _int(note.get("gpus_per_node"))
        p.slurm_conf = p.slurm_conf or note.get("slurm_conf")
        points.append(p)
    times = [p.updated_at for p in points if p.updated_at is not None]
    try:
        times.append(names[REGISTRY].stat().st_mtime)
    except OSError:
        pass
    return Entry(name=name, run_dir=path, kind="sweep", strategy="sweep", updated_at=max(times) if times else None,
                 points=points)


def scan(root: Path) -> List[Entry]:
    """Every run and sweep under ``root`` (a run or a sweep is not walked into further),
    newest first."""
    found, stack = [], [(str(root), 0)]
    while stack:
        path, depth = stack.pop()
        names = _listing(path)
        rel = os.path.relpath(path, root)
        name = root.resolve().name if rel == "." else rel
        if RUN_JSON in names:
            found.append(read_run(name, path, names))
        elif REGISTRY in names:
            found.append(read_sweep(name, path, names))
        elif depth < MAX_DEPTH:
            stack += [(e.path, depth + 1) for n, e in names.items()
                      if n not in SKIP and not n.startswith(".") and e.is_dir(follow_symlinks=False)]
    found.sort(key=lambda e: (-(e.updated_at or 0), e.name))
    return found


# ---- where each run stands ----------------------------------------------------------

def leaves(entries: List[Entry]) -> Iterator[Entry]:
    """The runs and points (a sweep's line stands for its points)."""
    for e in entries:
        yield from e.points if e.kind == "sweep" else (e,)


def settle(entries: List[Entry], ask: bool = True) -> Optional[str]:
    """Decide every run's status: one ``squeue`` per Slurm configuration for the runs
    run.json does not call ended whose job is a Slurm job; the footer when Slurm was not
    asked about some of them (``ask`` False, or Slurm unreachable or absent), else None."""
    waiting = [e for e in leaves(entries)
               if not e.skipped and is_job_id(e.job_id) and not ended(status_of(e.info))]
    groups: Dict[Optional[str], List[Entry]] = {}
    for e in waiting:
        groups.setdefault(e.slurm_conf, []).append(e)
    queues: Dict[Optional[str], Dict[str, str]] = {}
    why: Dict[str, int] = {}
    for conf, group in groups.items():
        try:
            if not ask:
                raise query.SlurmUnavailable("--no-slurm")
            queues[conf] = query.squeue([e.job_id for e in group], query.slurm_env(conf))
        except query.SlurmUnavailable as exc:
            reason = str(exc).splitlines()[0][:160] if str(exc) else "no answer"
            why[reason] = why.get(reason, 0) + len(group)
            continue
        for e in group:
            e.asked = True
    for e in leaves(entries):
        queued = queues[e.slurm_conf].get(e.job_id) if e.asked else None
        d = decide(e.info, skipped=e.skipped, queued=queued, slurm_job=is_job_id(e.job_id), slurm_ok=e.asked,
                   alive=e.alive)
        e.status, e.state, e.lost = d.outcome.value, d.state, d.lost
    for e in entries:
        if e.kind == "sweep":
            present = {p.status for p in e.points}
            e.status = next((o.value for o in _SWEEP_ORDER if o.value in present), Outcome.UNKNOWN.value)
            e.state = tally(e.points)
    if not why:
        return None
    count = sum(why.values())
    runs = f"{count} unfinished run{'s' if count != 1 else ''}"
    return f"slurm: not asked ({'; '.join(why)}); {runs} show run.json's status"


def tally(points: List[Entry]) -> str:
    counts = {o: sum(p.status == o for p in points) for o in OUTCOMES}
    parts = [f"{n} {o}" for o, n in counts.items() if n]
    return f"{len(points)} point{'s' if len(points) != 1 else ''}" + (": " + ", ".join(parts) if parts else "")


# ---- options ------------------------------------------------------------------------

def parse_statuses(values: List[str]) -> Set[str]:
    words = {w.strip().lower() for v in values for w in v.split(",") if w.strip()}
    bad = sorted(words - set(WORDS))
    if bad:
        raise UsageError(f"--status {bad[0]}: not a status; use one of {', '.join(WORDS)} "
                         f"(repeat --status or separate with commas)")
    return words


def parse_since(value: Optional[str]) -> Optional[float]:
    if value is None:
        return None
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([smhd])\s*", value)
    if not match:
        raise UsageError(f"--since {value}: not an age; use a number and s, m, h or d (90s, 30m, 12h, 2d)")
    return float(match.group(1)) * UNITS[match.group(2)]


def check_root(value: str) -> Path:
    root = Path(value)
    if not root.is_dir():
        what = "not a directory" if root.exists() else "no such directory"
        raise UsageError(f"ROOT {value}: {what}; pass the runs root (the launcher's launcher.root, default runs)")
    return root


def matches(e: Entry, statuses: Set[str], since_s: Optional[float], now: float) -> bool:
    """An outcome word matches the decided status, another word run.json's own status."""
    if statuses and not (e.status in statuses or str(e.info.get("status") or "") in statuses - set(OUTCOMES)):
        return False
    return since_s is None or (e.updated_at is not None and now - e.updated_at <= since_s)


def select(entries: List[Entry], statuses: Set[str], since_s: Optional[float], now: float) -> List[Entry]:
    """The lines to show: runs and points that match, a sweep with those of its points that
    do (a sweep without a matching point is left out when a filter is given)."""
    shown = []
    for e in entries:
        if e.kind != "sweep":
            shown += [e] if matches(e, statuses, since_s, now) else []
            continue
        points = [p for p in e.points if matches(p, statuses, since_s, now)]
        if points or (not statuses and since_s is None):
            shown += [e, *points]
    return shown


# ---- output -------------------------------------------------------------------------

def age(seconds: float) -> str:
    seconds = max(0.0, seconds)
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60)):
        if seconds >= size:
            return f"{int(seconds // size)}{unit}"
    return f"{int(seconds)}s"


HEAD = ("NAME", "STATUS", "STRATEGY", "NODES", "STEP", "LOSS", "TOKENS/S", "AGE", "JOB", "")
RIGHT = {"STEP", "LOSS", "TOKENS/S", "AGE"}


def cells(e: Entry, now: float) -> List[str]:
    shown = e.state.lower()
    status = f"{e.status} (not in squeue)" if e.lost else e.status if shown in ("", e.status) or e.kind == "sweep" \
        else f"{e.status} ({shown})"
    name = f"  {e.name[len(e.sweep) + 1:]}" if e.sweep else e.name
    if e.kind == "sweep":
        return [name, status, "sweep", "", "", "", "", age(now - e.updated_at) if e.updated_at else "-", "", e.state]
    size = f"{e.nodes or '?'}x{e.gpus_per_node or '?'}" if e.nodes or e.gpus_per_node else "-"
    step = "-" if e.step is None else f"{e.step}/{e.steps}" if e.steps else str(e.step)
    return [name, status, e.strategy or "-", size, step,
            f"{e.loss:.4g}" if isinstance(e.loss, (int, float)) else "-",
            f"{e.tokens_per_s:,.0f}" if isinstance(e.tokens_per_s, (int, float)) else "-",
            age(now - e.updated_at) if e.updated_at is not None else "-", e.job_id or "-", ""]


def table(shown: List[Entry], now: float) -> List[str]:
    rows = [list(HEAD)] + [cells(e, now) for e in shown]
    widths = [max(len(r[i]) for r in rows) for i in range(len(HEAD))]
    return ["  ".join(c.rjust(w) if h in RIGHT else c.ljust(w) for c, w, h in zip(r, widths, HEAD)).rstrip()
            for r in rows]


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m launcher.list", description=__doc__.splitlines()[0])
    parser.add_argument("root", nargs="?", default="runs", metavar="ROOT",
                        help="the runs root (the launcher's launcher.root; default: runs)")
    parser.add_argument("--status", action="append", default=[], metavar="S",
                        help=f"only these statuses (repeat, or a comma list): {', '.join(WORDS)}")
    parser.add_argument("--since", metavar="AGE", help="only runs written within AGE: 90s, 30m, 12h, 2d")
    parser.add_argument("--json", action="store_true", help="one JSON list of objects (keys: " + ", ".join(KEYS) + ")")
    parser.add_argument("--no-slurm", action="store_true", help="do not ask Slurm: states are run.json's")
    args = parser.parse_args(argv)
    try:
        statuses, since_s, root = parse_statuses(args.status), parse_since(args.since), check_root(args.root)
    except UsageError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    entries = scan(root)
    footer = settle(entries, ask=not args.no_slurm)
    now = time.time()
    shown = select(entries, statuses, since_s, now)
    if args.json:
        print(json.dumps([e.as_json(now) for e in shown], indent=1))
        if footer:
            print(footer, file=sys.stderr)
        return 0
    print("\n".join(table(shown, now)) if shown else f"no runs under {root}" + (" match" if statuses or
                                                                                  since_s is not None else ""))
    if footer:
        print(footer)
    return 0
