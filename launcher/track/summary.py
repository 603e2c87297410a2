"""The short report printed after a run: steps, loss first/last, throughput, where."""
from __future__ import annotations

from pathlib import Path
from typing import List

from spec.rundir import read_metrics, read_run_json, steady


def _mib(n: float) -> str:
    return f"{n / 2**20:.0f} MiB"


def summary_lines(run_dir: Path) -> List[str]:
    info = read_run_json(run_dir)
    rows = read_metrics(run_dir)
    lines = [f"status: {info.get('status', 'unknown')}  job: {info.get('job_id', '?')}  "
             f"strategy: {info.get('strategy', '?')}  world: {info.get('world_size', '?')} ranks on "
             f"{info.get('nodes', '?')} node(s) {','.join(info.get('hostnames', []))}"]
    if rows:
        ok = steady(rows)
        tps = sum(r.tokens_per_s for r in ok) / len(ok)
        mfu = [r.mfu for r in ok if r.mfu is not None]
        lines.append(f"steps: {rows[-1]['step']}  loss: {rows[0]['loss']:.4f} (step {rows[0]['step']}) -> "
                     f"{rows[-1]['loss']:.4f} (step {rows[-1]['step']})")
        sps = sum(r.samples_per_s for r in ok) / len(ok)
        mfu_text = f"{sum(mfu) / len(mfu) * 100:.1f}%" if mfu else "n/a (no peak FLOPs for this cluster)"
        lines.append(f"tokens/s: {tps:,.0f}  samples/s: {sps:,.1f}  peak mem/rank: "
                     f"{_mib(max(r['peak_mem_bytes'] for r in rows))}  mfu: {mfu_text}")
    if info.get("error"):
        lines.append(f"error: {info['error']}")
    lines.append(f"run_dir: {run_dir}")
    return lines
