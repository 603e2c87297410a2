"""``python -m launcher.stacks RUN_DIR``: what every rank of a running job is doing now.

Touches ``RUN_DIR/STACK_NOW``; every rank's watchdog thread sees it within half a second
and writes its threads' Python stacks to ``RUN_DIR/stacks/rank{R}.txt`` (on NCCL, its
flight recorder's last collectives to ``stacks/nccl_trace_rank{R}.pkl``), and the job goes
on (train/harness/watchdog.py); a rank that started after the touch (it takes an older
request for a previous segment's) is asked again: the file is touched every second while
an answer is missing. This command waits for every rank's answer, prints one
line per rank (host, step, phase, the main thread's innermost frame) and where the files
are; ranks that did not answer in ``--timeout`` seconds are named (exit 1). Nothing
running (run.json's status is not running): one line, exit 2.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import Dict, List, Optional

from spec.rundir import RUN_JSON, STACK_NOW, STACKS, Status, read_run_json, status_of


RETOUCH_S = 1.0  # the request is touched again this often while ranks have not answered


def answers(run_dir: Path, asked_ns: int, world_size: int) -> Dict[int, Dict]:
    """Rank -> the header of its stacks file, for the ranks that answered this request."""
    out = {}
    for rank in range(world_size):
        try:
            with open(run_dir / STACKS / f"rank{rank}.txt") as f:
                header = json.loads(f.readline())
        except (OSError, ValueError):
            continue
        if header.get("request_ns", 0) >= asked_ns:
            out[rank] = header
    return out


def innermost(path: Path) -> str:
    """The main thread's innermost frame ("file:line in function") of a stacks file."""
    lines = path.read_text().splitlines()
    try:
        start = next(i for i, line in enumerate(lines) if line.startswith("Thread "))
    except StopIteration:
        return "?"
    frames = []
    for line in lines[start + 1:]:
        if line.startswith("Thread ") or not line.strip():
            break
        if line.lstrip().startswith("File "):
            frames.append(line.strip())
    if not frames:
        return "?"
    parts = frames[-1].split(", ")  # File "x.py", line 12, in f
    return f"{parts[0][6:-1].rsplit('/', 1)[-1]}:{parts[1][5:]} in {parts[2][3:]}" if len(parts) == 3 else frames[-1]


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m launcher.stacks", description=__doc__.splitlines()[0])
    parser.add_argument("run_dir", help="a run's directory (runs/<run>, or a point of a sweep)")
    parser.add_argument("--timeout", type=float, default=10.0, help="seconds to wait for every rank (default 10)")
    args = parser.parse_args(argv)
    run_dir = Path(args.run_dir)
    if not (run_dir / RUN_JSON).is_file():
        print(f"error: RUN_DIR={run_dir} has no {RUN_JSON}: pass a run's directory (runs/<run>)", file=sys.stderr)
        return 2
    if args.timeout <= 0:
        print(f"error: --timeout={args.timeout} must be > 0 seconds; e.g. --timeout 10", file=sys.stderr)
        return 2
    info = read_run_json(run_dir)
    if status_of(info) is not Status.RUNNING:
        print(f"error: {run_dir} is not running (status {info.get('status', 'unknown')}): no rank to ask; "
              "its last hang's stacks, if any, are in logs/stack_rank*.txt", file=sys.stderr)
        return 2
    world = int(info.get("world_size") or 1)
    asked = time.time_ns()
    (run_dir / STACK_NOW).touch()
    os.utime(run_dir / STACK_NOW, ns=(asked, asked))  # the request's time, as the ranks compare it
    deadline = time.monotonic() + args.timeout
    retouch = time.monotonic() + RETOUCH_S
    got = answers(run_dir, asked, world)
    while len(got) < world and time.monotonic() < deadline:
        time.sleep(0.1)
        got = answers(run_dir, asked, world)
        if len(got) < world and time.monotonic() >= retouch:
            # A rank whose watchdog started after the touch takes it as older than its start
            # (train/harness/watchdog.py: a request left from a previous segment): ask again.
            now = time.time_ns()
            os.utime(run_dir / STACK_NOW, ns=(now, now))
            retouch = time.monotonic() + RETOUCH_S
    waited = (time.time_ns() - asked) / 1e9
    for rank in range(world):
        if rank in got:
            h = got[rank]
            print(f"rank {rank} ({h.get('host')}, pid {h.get('pid')}): step {h.get('step')} {h.get('phase')}: "
                  f"{innermost(run_dir / STACKS / f'rank{rank}.txt')}")
    missing = [r for r in range(world) if r not in got]
    print(f"stacks of {len(got)}/{world} ranks in {waited:.1f} s: {run_dir / STACKS}/rank<R>.txt")
    if missing:
        print(f"error: ranks {', '.join(map(str, missing))} did not answer in {args.timeout:g} s (gone, or a rank "
              "whose Python is stuck without releasing the GIL: see logs/)", file=sys.stderr)
        return 1
    return 0
