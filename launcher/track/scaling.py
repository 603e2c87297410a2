"""Pure functions behind status and report: stitched metrics, throughput, scaling
efficiency, sweep series, and the classification of failed points.

Nothing here talks to Slurm or the file system, so every number of a report can be
checked on fixed inputs (tests/test_report.py).
"""
from __future__ import annotations

import re
from datetime import datetime
from typing import Any, Dict, Iterable, List, Optional, Sequence, Tuple

from slurm.states import FAILURE_OF_STATE, job_state
from spec.rundir import Status, status_of, steady

# Overrides that change only the size of a point: points differing in these alone form
# one scaling series (the same run on more ranks).
WORLD_KEYS = ("cluster.nodes", "cluster.gpus_per_node")
# Overrides that change nothing a report compares.
_IGNORED = ("launcher.", "hydra.", "hydra/")

FAILURE_CLASSES = ("out of memory", "time limit", "preempted", "node failure", "communication timeout", "other")
# Checked in this order: an OOM often ends in a communication error on the other ranks,
# so the cause (memory) must win over the symptom (a peer that stopped answering).
_LOG_PATTERNS = (
    ("out of memory", r"CUDA out of memory|OutOfMemoryError|CUBLAS_STATUS_ALLOC_FAILED|oom[-_ ]kill|"
                      r"Cannot allocate memory|MemoryError|Exceeded job memory limit"),
    ("time limit", r"DUE TO TIME LIMIT"),
    ("preempted", r"DUE TO PREEMPTION"),
    ("node failure", r"DUE TO NODE FAILURE|NODE_FAIL|Node failure|node \S+ not responding"),
    ("communication timeout", r"Watchdog caught collective operation timeout|NCCL.{0,80}[Tt]imeout|"
                              r"[Tt]imed out|DistNetworkError|DistStoreError|Connection reset by peer|"
                              r"Connection closed by peer|ncclRemoteError|ncclSystemError|NCCL error"),
)


def stitch(rows: Iterable[Dict[str, Any]]) -> List[Dict[str, Any]]:
    """One row per step across requeued segments: a step logged twice (it ran again
    after a resume from an older checkpoint) keeps the newest row."""
    by_step: Dict[int, Dict[str, Any]] = {}
    for row in rows:  # file order is time order, so later rows replace earlier ones
        if isinstance(row.get("step"), int):
            by_step[row["step"]] = row
    return [by_step[s] for s in sorted(by_step)]


def _mean(values: List[float]) -> Optional[float]:
    return sum(values) / len(values) if values else None


def _rate(rows: Sequence[Dict[str, Any]], key: str) -> Optional[float]:
    """Total work / total time over ``rows`` (a mean of the rates where rows have no step
    times); None when some row lacks ``key`` (a user's code may log only some rates)."""
    if not rows or any(r.get(key) is None for r in rows):
        return None
    time_s = sum(r.get("step_time_s") or 0.0 for r in rows)
    if time_s > 0 and all(r.get("step_time_s") is not None for r in rows):
        return sum(r[key] * r["step_time_s"] for r in rows) / time_s
    return _mean([r[key] for r in rows])


def point_metrics(rows: Sequence[Dict[str, Any]]) -> Dict[str, Any]:
    """Throughput and friends of one point from its stitched metrics rows.

    Throughput is total work / total time over the steady steps (not a mean of per-step
    rates, which over-weights fast steps).
    """
    rows = stitch(rows)
    if not rows:
        return {}
    ok = steady(rows)
    tokens, samples = _rate(ok, "tokens_per_s"), _rate(ok, "samples_per_s")
    return {
        "last_step": rows[-1]["step"], "steady_steps": len(ok),
        "tokens_per_s": tokens, "samples_per_s": samples,
        "step_time_s": _mean([r["step_time_s"] for r in ok if r.get("step_time_s") is not None]),
        # Measured by the loop only where the strategy splits the step; None otherwise.
        "compute_s": _mean([r["compute_time_s"] for r in ok if r.get("compute_time_s") is not None]),
        "comm_s": _mean([r["comm_time_s"] for r in ok if r.get("comm_time_s") is not None]),
        "mfu": _mean([r["mfu"] for r in ok if r.get("mfu") is not None]),
        "peak_mem_bytes": max((r.get("peak_mem_bytes") or 0) for r in rows) or None,
        "global_batch_size": rows[-1].get("global_batch_size"),
        "world_size": rows[-1].get("world_size"),
        "segments": len({r.get("segment", 0) for r in rows}),
        "val_loss": next((r["val_loss"] for r in reversed(rows) if r.get("val_loss") is not None), None),
        "lr": rows[0].get("lr") if len(rows) == 1 else max((r.get("lr") or 0) for r in rows) or None,
    }


def efficiency(throughput: float, n: int, base_throughput: float, base_n: int) -> Optional[float]:
    """Scaling efficiency the way the seeds compute it: throughput(N) / (throughput(N0) x N / N0).

    1.0 is linear scaling. 12 samples/s per GPU on 2 GPUs (24 in all) and 46 in all on 4
    GPUs give 46 / 48 = 0.958, the 95.8% of docs/scaling.md's example.
    """
    if not throughput or not base_throughput or n <= 0 or base_n <= 0:
        return None
    return throughput / (base_throughput * n / base_n)


def scaling_kind(points: Iterable[Tuple[int, Optional[int]]]) -> str:
    """"weak" when the global batch grows with the ranks (constant per-rank batch),
    "strong" when it stays fixed, "mixed" otherwise; from (world size, global batch)."""
    pts = [(w, b) for w, b in points if w and b]
    if len({w for w, _ in pts}) < 2:
        return "single size"
    if len({b for _, b in pts}) == 1:
        return "strong"
    if len({b / w for w, b in pts}) == 1:
        return "weak"
    return "mixed"


def _kept(overrides: Iterable[str]) -> List[str]:
    return [o.lstrip("+~") for o in overrides if not o.lstrip("+~").startswith(_IGNORED)]


def series_labels(overrides: Sequence[Sequence[str]], strategies: Sequence[str]) -> List[str]:
    """A label per point naming its scaling series: the overrides that vary across the
    sweep other than the size ones, or the strategy when nothing else varies."""
    values: Dict[str, set] = {}
    for item in overrides:
        for o in _kept(item):
            key, _, value = o.partition("=")
            values.setdefault(key, set()).add(value)
    varying = [k for k, v in values.items() if len(v) > 1 and k not in WORLD_KEYS and k != "strategy"]
    labels = []
    for item, strategy in zip(overrides, strategies):
        given = dict(o.partition("=")[::2] for o in _kept(item))
        extra = [f"{k.split('.')[-1]}={given.get(k, '-')}" for k in sorted(varying)]
        labels.append(" ".join([strategy or given.get("strategy", "?"), *extra]))
    return labels


def varying_overrides(overrides: Sequence[Sequence[str]]) -> List[str]:
    """The point's overrides that differ across the sweep (for narrow tables)."""
    kept = [_kept(o) for o in overrides]
    common = set.intersection(*(set(k) for k in kept)) if kept else set()
    return [" ".join(o for o in k if o not in common) or "-" for k in kept]


def classify(state: str, exit_code: str = "", text: str = "", info: Optional[Dict[str, Any]] = None
             ) -> Tuple[str, str]:
    """(class, detail) of a failed point from sacct's state and exit code, run.json and
    the tail of its logs; class is one of FAILURE_CLASSES."""
    info = info or {}
    word = job_state(state)
    if word in FAILURE_OF_STATE:  # sacct's final state is the most direct evidence
        return FAILURE_OF_STATE[word], f"sacct state {word}"
    # A run stopped by the requeue cap says after which kind of interruption.
    stop = f"{info.get('stop_reason', '')} {info.get('last_interruption', '')}"
    if status_of(info) is Status.STOPPED and "timeout" in stop:
        return "time limit", info.get("stop_reason") or "stopped after a time limit"
    if status_of(info) is Status.STOPPED and "preempt" in stop:
        return "preempted", info.get("stop_reason") or "stopped after preemption"
    haystack = f"{info.get('error', '')}\n{text}"
    # A cancelled job's ranks die mid-collective and log connection errors; those are
    # the effect of the cancel, so only Slurm's own "DUE TO ..." lines count then.
    causes = ("time limit", "preempted", "node failure") if word == "CANCELLED" else FAILURE_CLASSES
    for klass, pattern in _LOG_PATTERNS:
        match = re.search(pattern, haystack) if klass in causes else None
        if match:
            return klass, _line_of(haystack, match.start())
    if word == "CANCELLED":
        return "other", "cancelled (scancel or an administrator)"
    if info.get("error"):
        return "other", str(info["error"])[:160]
    detail = f"sacct state {word or 'unknown'}" + (f", exit code {exit_code}" if exit_code else "")
    return "other", detail


def _line_of(text: str, pos: int) -> str:
    start = text.rfind("\n", 0, pos) + 1
    end = text.find("\n", pos)
    return text[start:end if end >= 0 else None].strip()[:160]


def slurm_time(text: Optional[str]) -> Optional[float]:
    """Epoch seconds of a sacct/squeue timestamp (controller local time); None for
    Unknown/None/empty."""
    if not text or text in ("Unknown", "None", "N/A"):
        return None
    try:
        return datetime.fromisoformat(text).timestamp()
    except ValueError:
        return None
