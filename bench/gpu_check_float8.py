"""The float8 rows of `make gpu-check` (bench/gpu_check.py): float8 training against bf16
on one GPU of compute capability 8.9 or later, FSDP and compile, 50 steps each on the
same data and seed (``strategy.float8=true``: torchao's tensorwise recipe, FSDP's
float8 all-gather, the output head left in bf16; docs/strategies.md "Float8").

- ``float8/1b``: Llama 3.2 1B (llama3_1b), seq 2048, micro-batch 4, whole logits;
- ``float8/8b_block``: Llama 3.1 8B's dimensions (dim 4096, 32 heads of which 8 K/V,
  SwiGLU 14336, vocabulary 128256) with 8 blocks instead of 32, micro-batch 2: one GPU
  holds the whole model's FSDP state at world 1 (16 bytes a parameter: 32 blocks would
  need 128 GB for the states alone, 8 need 42 GB and fit an 80 GB H100 with their
  activations), and 8 blocks keep the blocks' matmuls about 3/4 of the step's FLOPs
  beside the bf16 head, so the ratio is the block stack's.

Each row runs its bf16 reference first (``NAME:bf16``, the row's ``before``), then float8,
and passes when both complete on NCCL, run.json says what was converted, and the float8
loss is within 2% of bf16's at every step. The report: both median tokens/s over the
steps after the fifth (compile left out), float8 / bf16 (the goal on the 8B-shaped stack:
>= 1.2), both peak memories, the worst loss difference. Planned with
launcher/plan/float8.py's assumption of float8 matmuls at 2x the bf16 rate:
1.55x (1B) and 1.57x (8B-shaped) tokens/s. These rows have not run on a GPU yet. About
4 minutes for the four runs on an H100; alone: ``bench/gpu_check.py --only float8
--budget-s 600``.
"""
from __future__ import annotations

import json
import subprocess
from pathlib import Path
from statistics import median
from typing import Callable, Dict, List

from bench.gpu_check_runner import GPU, Row

LOSS_RTOL = 0.02
RUN = ["+strategy=fsdp", "strategy.compile=true", "train.seq_len=2048", "model.loss_chunk_tokens=0",
       "train.steps=50", "data.num_tokens=1000000", "train.preflight=false", "optim.lr=3e-4",
       "cluster.peak_tflops_bf16=989.0"]
SHAPES: Dict[str, List[str]] = {
    "1b": ["+model=llama3_1b", "train.micro_batch_size=4"],
    "8b_block": ["+model=llama3_8b", "model.n_layers=8", "train.micro_batch_size=2"],
}


def _run_json(run_dir: Path) -> dict:
    from bench.gpu_check import _run_json as read  # imported here: bench.gpu_check imports this module

    return read(run_dir)


def completed(row: Row, proc: subprocess.CompletedProcess) -> str:
    """The bf16 reference: a completed run on NCCL."""
    from bench.gpu_check import on_nccl

    return on_nccl(row, proc)


def worst_loss_difference(ours: Path, reference: Path) -> float:
    from bench.gpu_check import _losses

    mine, ref = _losses(ours), _losses(reference)
    if set(mine) != set(ref) or not ref:
        raise ValueError(f"steps {sorted(mine)[:3]}... vs {sorted(ref)[:3]}... ({len(mine)} vs {len(ref)})")
    return max(abs(mine[s] - ref[s]) / abs(ref[s]) for s in ref)


def against(reference: Path) -> Callable[[Row, subprocess.CompletedProcess], str]:
    """The float8 run: completed on NCCL, converted Linears in run.json, every step's loss
    within LOSS_RTOL of the bf16 run's."""
    def check(row: Row, proc: subprocess.CompletedProcess) -> str:
        why = completed(row, proc)
        if why:
            return why
        info = _run_json(row.run_dir).get("float8") or {}
        if not info.get("converted"):
            return f"run.json float8 {info!r}: nothing converted"
        worst = worst_loss_difference(row.run_dir, reference)
        return "" if worst <= LOSS_RTOL else f"worst relative loss difference {worst:.4f} > {LOSS_RTOL}"
    return check


def _steady(run_dir: Path) -> tuple:
    """(median tokens/s, peak allocated GiB) over the steps after the fifth."""
    from bench.gpu_check_speed import steady_rows

    steady = steady_rows(run_dir)
    if not steady:
        raise ValueError(f"no steps after the fifth in {run_dir.name}/metrics.jsonl")
    return median(r["tokens_per_s"] for r in steady), max(r.get("peak_mem_bytes") or 0 for r in steady) / 2**30


def report(reference: Path) -> Callable[[Row], str]:
    def text(row: Row) -> str:
        (f8, f8_mem), (bf, bf_mem) = _steady(row.run_dir), _steady(reference)
        info = _run_json(row.run_dir).get("float8") or {}
        return (f"float8 {f8:,.0f} vs bf16 {bf:,.0f} tokens/s: {f8 / bf:.3f}x; peak {f8_mem:.1f} vs {bf_mem:.1f} GiB; "
                f"worst loss difference {100 * worst_loss_difference(row.run_dir, reference):.2f}%; "
                f"{info.get('converted')} Linears converted ({info.get('recipe')}, all-gather "
                f"{'float8' if info.get('all_gather') else 'bf16'})")
    return text


def rows(scratch: Path) -> List[Row]:
    from bench.gpu_check import launcher_argv

    out: List[Row] = []
    for name, shape in SHAPES.items():
        ref_dir, run_dir = scratch / f"float8_{name}_bf16", scratch / f"float8_{name}"
        bf16 = Row(f"float8/{name}:bf16", launcher_argv(*GPU, *shape, *RUN, f"launcher.run_dir={ref_dir}"),
                   completed, run_dir=ref_dir, timeout_s=300.0)
        out.append(Row(f"float8/{name}", launcher_argv(*GPU, *shape, *RUN, "strategy.float8=true",
                                                       f"launcher.run_dir={run_dir}"),
                       against(ref_dir), before=bf16, run_dir=run_dir, timeout_s=300.0, report=report(ref_dir)))
    return out
