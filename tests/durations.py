"""Refresh tests/durations.json (the per-test seconds ``--shard K/N`` balances the Slurm
runs on) from the output of pytest runs made with ``--durations=0``:

    make test PYTEST_ARGS=--durations=0 2>&1 | tee suite.log
    .venv/bin/python tests/durations.py suite.log

Each test's setup, call and teardown are summed (a module fixture's set-up counts to the
first test that needs it, as it does in a run); tests not in the logs keep their seconds,
and ids that no longer collect are dropped with ``--prune``.

A file ending in ``.jsonl`` is read as the rows ``STO_TEST_CPU=FILE`` writes (tests/conftest.py):
each test's CPU seconds. The tests without Slurm are weighed by their CPU (the suite is
CPU-bound: what a run of them costs the machine), the Slurm tests by wall time (their jobs'
CPU is not theirs, and they wait on Slurm):

    STO_TEST_CPU=cpu.jsonl .venv/bin/python -m pytest -m "not slurm"
    .venv/bin/python tests/durations.py cpu.jsonl
"""
from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path
from typing import Dict, Iterable

DURATIONS = Path(__file__).with_name("durations.json")
LINE = re.compile(r"^\s*(\d+(?:\.\d+)?)s (setup|call|teardown)\s+(\S+::\S.*?)\s*$")


def seconds(lines: Iterable[str]) -> Dict[str, float]:
    """Test id -> seconds, from pytest's ``slowest durations`` lines."""
    total: Dict[str, float] = {}
    for line in lines:
        match = LINE.match(line)
        if match:
            total[match[3]] = total.get(match[3], 0.0) + float(match[1])
    return {test: round(s, 2) for test, s in total.items()}


def collected() -> set:
    out = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider"],
                         cwd=DURATIONS.parent.parent, capture_output=True, text=True).stdout
    return {line for line in out.splitlines() if "::" in line}


def main(argv) -> int:
    prune = "--prune" in argv
    logs = [a for a in argv if a != "--prune"]
    if not logs and not prune:
        print(__doc__, file=sys.stderr)
        return 2
    known = json.loads(DURATIONS.read_text()) if DURATIONS.exists() else {}
    found: Dict[str, float] = {}
    for log in logs:
        text = Path(log).read_text(errors="replace")
        if log.endswith(".jsonl"):
            found.update({row["test"]: row["cpu_s"] for row in map(json.loads, text.splitlines()) if row})
        else:
            found.update(seconds(text.splitlines()))
    known.update(found)
    if prune:
        ids = collected()
        known = {test: s for test, s in known.items() if test in ids}
    DURATIONS.write_text(json.dumps(dict(sorted(known.items())), indent=1) + "\n")
    print(f"{len(found)} tests measured, {len(known)} in {DURATIONS.name}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
