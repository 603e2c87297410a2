"""The short report printed after a run: steps, loss first/last, throughput, where."""
from __future__ import annotations

from pathlib import Path
from typing import List, Optional

from spec.rundir import MetricsRow, read_metrics, read_run_json, steady


def _mib(n: float) -> str:
    return f"{n / 2**20:.0f} MiB"


def _mean(rows: List[MetricsRow], key: str) -> Optional[float]:
    values = [r.get(key) for r in rows if r.get(key) is not None]
    return sum(values) / len(values) if values else None


def _metric_lines(rows: List[MetricsRow]) -> List[str]:
    """Steps and loss, then throughput and memory: what the rows have (a user's code may
    log only some fields)."""
    ok = steady(rows)
    losses = [r for r in rows if r.get("loss") is not None]
    text = f"steps: {rows[-1]['step']}"
    if losses:
        text += (f"  loss: {losses[0]['loss']:.4f} (step {losses[0]['step']}) -> {losses[-1]['loss']:.4f} "
                 f"(step {losses[-1]['step']})")
    vals = [r for r in rows if r.get("val_loss") is not None]
    if vals:
        text += (f"  val loss: {vals[0]['val_loss']:.4f} (step {vals[0]['step']}) -> {vals[-1]['val_loss']:.4f} "
                 f"(step {vals[-1]['step']}, ppl {vals[-1]['val_ppl']:.1f})")
    lines = [text]
    tps, sps, mfu = _mean(ok, "tokens_per_s"), _mean(ok, "samples_per_s"), _mean(ok, "mfu")
    mem = [r["peak_mem_bytes"] for r in rows if r.get("peak_mem_bytes") is not None]
    parts = [f"tokens/s: {tps:,.0f}" if tps is not None else "", f"samples/s: {sps:,.1f}" if sps is not None else "",
             f"peak mem/rank: {_mib(max(mem))}" if mem else "",
             f"mfu: {mfu * 100:.1f}%" if mfu is not None else ("mfu: n/a (no peak FLOPs for this cluster)"
                                                               if tps is not None and sps is not None else "")]
    if any(parts):
        lines.append("  ".join(p for p in parts if p))
    return lines


def summary_lines(run_dir: Path) -> List[str]:
    info = read_run_json(run_dir)
    rows = read_metrics(run_dir)
    lines = [f"status: {info.get('status', 'unknown')}  job: {info.get('job_id', '?')}  "
             f"strategy: {info.get('strategy', '?')}  world: {info.get('world_size', '?')} ranks on "
             f"{info.get('nodes', '?')} node(s) {','.join(info.get('hostnames', []))}"]
    if rows:
        lines += _metric_lines(rows)
    if info.get("error"):
        lines.append(f"error: {info['error']}")
    lines.append(f"run_dir: {run_dir}")
    return lines
