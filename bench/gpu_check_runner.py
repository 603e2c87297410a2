"""How bench/gpu_check.py runs its rows: a row (one command and its verdict), the table
written after every row, the rows sharing the GPU ``--jobs`` at a time and the speed rows
alone after them, and ``--dry``, which checks each row's command without a GPU."""
from __future__ import annotations

import json
import os
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Dict, List, Optional

REPO = Path(__file__).resolve().parent.parent
TAIL_CHARS = 4000     # a failed row's output kept in gpu_check.jsonl


# The one-GPU profile every launch row runs under (a local "cluster" of one node, one GPU).
GPU = ["+cluster=local", "cluster.accelerator=gpu", "cluster.gpus_per_node=1"]

@dataclass
class Row:
    """One line of the table: a command, where it runs, and how its outcome is judged."""

    name: str
    argv: List[str]
    check: Callable[["Row", subprocess.CompletedProcess], str]  # "" = pass, else why not
    env: Dict[str, str] = field(default_factory=dict)
    launch: bool = True          # a launcher command (its --dry check is the launcher's dry run)
    before: Optional["Row"] = None  # runs first (its failure fails this row)
    timeout_s: float = 180.0
    run_dir: Optional[Path] = None
    report: Optional[Callable[["Row"], str]] = None  # what a passed row measured, for the table


def exited_ok(row: Row, proc: subprocess.CompletedProcess) -> str:
    return "" if proc.returncode == 0 else f"exit {proc.returncode}"


class Table:
    """The rows' results so far, written after every row (a stopped run keeps them); rows
    that share the GPU add theirs from their own threads."""

    def __init__(self, out: Path) -> None:
        import threading

        out.mkdir(parents=True, exist_ok=True)
        self.jsonl, self.md, self.results = out / "gpu_check.jsonl", out / "gpu_check.md", []
        self.jsonl.write_text("")
        self.lock = threading.Lock()

    def add(self, name: str, result: str, seconds: float, detail: str = "", tail: str = "") -> None:
        with self.lock:
            self._add(name, result, seconds, detail, tail)

    def _add(self, name: str, result: str, seconds: float, detail: str, tail: str) -> None:
        entry = {"row": name, "result": result, "s": round(seconds, 1), "detail": detail}
        if tail:
            entry["output_tail"] = tail
        self.results.append(entry)
        with self.jsonl.open("a") as f:
            f.write(json.dumps(entry) + "\n")
        lines = ["| row | result | s | detail |", "|---|---|---|---|"]
        lines += [f"| {r['row']} | {r['result']} | {r['s']:.1f} | {r['detail'][:240]} |" for r in self.results]
        self.md.write_text("\n".join(lines) + "\n")
        print(f"{name:24s} {result:5s} {seconds:6.1f} s  {detail}", flush=True)


def pythonpath() -> str:
    """PYTHONPATH for a process a bench starts: the tree first, then the caller's entries
    (on a GPU machine, the wheels gpu_check.sh installed), each once."""
    return os.pathsep.join(dict.fromkeys(p for p in [str(REPO), *os.environ.get("PYTHONPATH", "").split(os.pathsep)]
                                         if p))


def execute(row: Row, deadline: float) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": pythonpath(), **row.env}
    timeout = max(1.0, min(row.timeout_s, deadline - time.time()))
    try:
        return subprocess.run(row.argv, cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired as exc:
        out = exc.stdout.decode(errors="replace") if isinstance(exc.stdout, bytes) else (exc.stdout or "")
        return subprocess.CompletedProcess(row.argv, 124, out, f"timed out after {timeout:.0f} s")


def judge(row: Row, proc: subprocess.CompletedProcess) -> str:
    try:
        return row.check(row, proc)
    except Exception as exc:  # noqa: BLE001 - a check that cannot read its files is a failed row
        return f"check failed: {type(exc).__name__}: {exc}"


def _report(row: Row) -> str:
    try:
        return row.report(row) if row.report else ""
    except Exception as exc:  # noqa: BLE001 - a report that cannot read its files says so; the row passed
        return f"report failed: {type(exc).__name__}: {exc}"


def _run_one(row: Row, table: Table, deadline: float, budget_s: float) -> bool:
    """Run a row (its ``before`` first), judge it and add it to the table; True if it failed."""
    if time.time() >= deadline:
        table.add(row.name, "skip", 0.0, f"not started: the {budget_s:.0f} s budget is spent")
        return True
    start, why = time.time(), ""
    proc = None
    for step in filter(None, [row.before, row]):
        proc = execute(step, deadline)
        why = judge(step, proc)
        if why:
            why = f"{step.name}: {why}" if step is not row else why
            break
    tail = (proc.stdout + proc.stderr)[-TAIL_CHARS:] if why and proc is not None else ""
    detail = why or _report(row)
    table.add(row.name, "FAIL" if why else "pass", time.time() - start, detail, tail)
    return bool(why)


def chains(selected: List[Row]) -> List[List[Row]]:
    """The rows that may share the GPU, as chains run one after another: a resume row after
    the engine row whose uninterrupted run it compares with; every other row alone."""
    out: Dict[str, List[Row]] = {}
    for row in selected:
        key = f"engine/{row.name.split('/')[1]}" if row.name.startswith("resume/") else row.name
        out.setdefault(key, []).append(row)
    return list(out.values())


def run_rows(selected: List[Row], table: Table, budget_s: float, jobs: int = 1) -> int:
    """The rows in table order; with ``jobs`` > 1 the small rows share the GPU, ``jobs`` at a
    time (their own processes, ports and directories), and the parity row (which compares
    the engine rows' runs), the speed, float8 and big-job rows run after them alone, so
    their timings and memory see an idle GPU."""
    deadline = time.time() + budget_s
    # parity reads the engine rows' runs; the others time, or read the memory of, an idle GPU
    later = ("parity/", "speed/", "float8/", "bigjob/")
    shared = [r for r in selected if not r.name.startswith(later)]
    alone = [r for r in selected if r.name.startswith(later)]
    if jobs <= 1:
        shared, alone = [], selected
    failed = 0
    if shared:
        from concurrent.futures import ThreadPoolExecutor

        def run_chain(chain: List[Row]) -> int:
            return sum(_run_one(row, table, deadline, budget_s) for row in chain)

        with ThreadPoolExecutor(max_workers=jobs) as pool:
            failed += sum(pool.map(run_chain, chains(shared)))
    for row in alone:
        failed += _run_one(row, table, deadline, budget_s)
    return failed


def dry_run(selected: List[Row], table: Table) -> int:
    """Check every row without a GPU: launcher commands through the launcher's dry run,
    check rows through their own ``--dry`` (gpu_check_rows.py)."""
    failed = 0
    for row in selected:
        for step in filter(None, [row.before, row]):
            start = time.time()
            argv = step.argv + (["launcher.dry_run=true"] if step.launch else ["--dry"])
            proc = execute(Row(step.name, argv, exited_ok, env=step.env, timeout_s=120), time.time() + 120)
            why = "" if proc.returncode == 0 else f"exit {proc.returncode}: " + (proc.stdout + proc.stderr)[-600:]
            table.add(step.name, "FAIL" if why else "dry", time.time() - start, why)
            failed += bool(why)
    return failed
