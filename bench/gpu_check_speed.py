"""The speed rows of `make gpu-check` (bench/gpu_check.py): Llama 3.2 1B, bf16, seq 2048,
whole logits, on one GPU under ddp, ddp+compile, fsdp+compile and zero2 at the largest
micro-batch the planner fits there, each beside the planner's predicted step time and
memory (written to the row's ``speed.json`` for bench/calibrate_planner.py); torchtitan's
own trainer on the same model, batch, sequence and compile (bench/torchtitan_speed.py);
and the loss rows, ``speed/loss_128k`` and ``speed/loss_152k``: one step's loss at the
same tokens and hidden size over Llama 3's and Qwen 2.5's vocabularies, whole logits and
chunked, eager and compiled (bench/chunked_loss.py ``--gpu``)."""
from __future__ import annotations

import functools
import json
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Dict, List, Optional

from bench import gpu_check_runner as runner
from bench.gpu_check_runner import GPU, Row, exited_ok

REPO = Path(__file__).resolve().parent.parent

SPEED = {"ddp": ["+strategy=ddp"], "ddp+compile": ["+strategy=ddp", "strategy.compile=true"],
         "fsdp+compile": ["+strategy=fsdp", "strategy.compile=true"], "zero2": ["+strategy=zero2"]}
SPEED_PEAK_TFLOPS = 989.0  # H100/H200 SXM dense bf16 (the datasheet's, not a measurement)
# Whole logits (as torchtitan, whose loss is never chunked) at the largest micro-batch the
# planner fits on the GPU under every planned strategy: speed_batch().
SPEED_SEQ, SPEED_DIM = 2048, 2048  # the speed run's sequence; the 1B Llama's hidden size (the loss rows')
SPEED_RUN = ["+model=llama3_1b", f"train.seq_len={SPEED_SEQ}", "model.loss_chunk_tokens=0", "train.steps=20",
             "data.num_tokens=800000", "train.preflight=false", "optim.lr=3e-4",
             f"cluster.peak_tflops_bf16={SPEED_PEAK_TFLOPS}"]
SPEED_BATCHES = (16, 8, 4)  # tried largest first; the smallest runs when none fits
SPEED_PLANNED = ("ddp", "fsdp", "zero2")
DRY_GPU_GB = 79.2  # --dry: the planner's choice for an H100's 79.2 GiB (the speed rows' own path)
LOSS_VOCABS = {"loss_128k": 128256, "loss_152k": 151936}  # Llama 3's vocabulary, Qwen 2.5's


@dataclass
class Speed:
    """The speed rows' micro-batch (torchtitan's too) and the GPU memory it was chosen for."""

    micro_batch: int = SPEED_BATCHES[-1]
    gpu_mem_gb: Optional[float] = None
    plans: Dict[str, dict] = field(default_factory=dict)     # strategy -> the planner's JSON object

    @property
    def planned(self) -> Dict[str, float]:
        """strategy -> the planner's bytes a GPU (of the plans made so far)."""
        return {s: p["total_bytes"] for s, p in self.plans.items()}

    def overrides(self) -> List[str]:
        gpu = [f"cluster.gpu_mem_gb={self.gpu_mem_gb:.1f}"] if self.gpu_mem_gb else []
        return [f"train.micro_batch_size={self.micro_batch}", *gpu]

    def plan(self, strategy: str) -> Optional[dict]:
        """The planner's object for ``strategy`` at this micro-batch; planned here once when
        the batch was given (``--speed-batch``) rather than chosen by :func:`speed_batch`."""
        if not self.plans and self.gpu_mem_gb:
            self.plans.update(plan_speed(self.micro_batch, self.gpu_mem_gb))
        return self.plans.get(strategy)


def plan_speed(micro_batch: int, gpu_mem_gb: Optional[float]) -> Dict[str, dict]:
    """The planner's JSON (``python -m launcher.plan ... plan.format=json``) for the speed run
    at ``micro_batch`` on a GPU of ``gpu_mem_gb``: strategy -> its object (``total_bytes``,
    ``fits``, and ``step_s``, its predicted step: the run sets cluster.peak_tflops_bf16)."""
    argv = [sys.executable, "-m", "launcher.plan", *GPU, *SPEED_RUN,
            *Speed(micro_batch, gpu_mem_gb).overrides(), "plan.format=json", "plan.top=0"]
    proc = runner.execute(Row("speed:plan", argv, exited_ok, timeout_s=120.0), time.time() + 120.0)
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(argv[1:])} exited {proc.returncode}: {(proc.stdout + proc.stderr)[-600:]}")
    return {p["strategy"]: p for p in json.loads(proc.stdout)}


def speed_batch(gpu_mem_gb: float) -> Speed:
    """The largest of SPEED_BATCHES with which the planner (``python -m launcher.plan``, its
    JSON) fits the speed run, whole logits, on a GPU of ``gpu_mem_gb`` under each of
    SPEED_PLANNED (the planner's figures were above the measured peaks on an H100: 55.5 GB
    planned, 45.4 GiB measured at micro-batch 4); the smallest when none fits. With the
    planner's bytes a GPU of each, which the speed rows report beside their measured peaks
    (what calibrates its CUDA_OVERHEAD and FRAGMENTATION assumptions)."""
    plans: dict = {}
    for micro_batch in SPEED_BATCHES:
        plans = plan_speed(micro_batch, gpu_mem_gb)
        if all(plans[s]["fits"] for s in SPEED_PLANNED):
            break
    return Speed(micro_batch, gpu_mem_gb, {s: plans[s] for s in SPEED_PLANNED})


def speed_dir(scratch: Path, name: str) -> Path:
    """Where the speed row ``name`` runs."""
    return scratch / f"speed_{name.replace('+', '_')}"


def steady_rows(run_dir: Path) -> list:
    """A speed run's metrics rows of the steps after the fifth (none when it did not run)."""
    from spec.rundir import read_metrics

    return [r for r in read_metrics(run_dir) if r.get("tokens_per_s") and r["step"] > 5]


def beside_torchtitan(row: Row) -> str:
    """torchtitan's median tokens/s, MFU (our FLOP formula) and peak, and speed/ddp+compile's
    tokens/s over it (the goal: >= 1.0), when that row ran in this scratch."""
    from statistics import median

    titan = json.loads((row.run_dir / "torchtitan.json").read_text())
    text = (f"torchtitan {titan['torchtitan']}: {titan['tokens_per_s']:,.0f} tokens/s, MFU {100 * titan['mfu']:.1f}%, "
            f"step {titan['step_s']:.3f} s, peak reserved {titan['peak_reserved_gib']} GiB")
    ours = [r["tokens_per_s"] for r in steady_rows(speed_dir(row.run_dir.parent, "ddp+compile"))]
    return text + (f"; ddp+compile / torchtitan {median(ours) / titan['tokens_per_s']:.3f}" if ours else "")


def speed(row: Row, planned: Optional[float] = None) -> str:
    """Median tokens/s, MFU and the busiest rank's peak memory (allocated, and the caching
    allocator's reserved) over the steps after the fifth; ``planned``: the planner's bytes."""
    from statistics import median

    steady = steady_rows(row.run_dir)
    if not steady:
        return "no steps after the fifth in metrics.jsonl"
    tps = median(r["tokens_per_s"] for r in steady)
    mfu = median(r["mfu"] for r in steady if r.get("mfu") is not None) if steady[0].get("mfu") is not None else None
    mem = max(r.get("peak_mem_bytes") or 0 for r in steady) / 2**30
    mfu_text = f"{100 * mfu:.1f}%" if mfu is not None else "n/a"
    parts = [f"{name[:-2]} {1000 * median(r[name]['max'] for r in steady):.1f}"
             for name in ("data_s", "fwd_bwd_s", "optim_s") if all(isinstance(r.get(name), dict) for r in steady)]
    batch = f"micro-batch {steady[0]['global_batch_size']}, " if steady[0].get("global_batch_size") else ""
    reserved = max(r.get("peak_reserved_bytes") or 0 for r in steady) / 2**30
    memory = f"peak {mem:.1f} GiB" + (f", reserved {reserved:.1f} GiB" if reserved else "") + \
        (f", planned {planned / 2**30:.1f} GiB" if planned else "")
    return f"{tps:,.0f} tokens/s, MFU {mfu_text}, step {median(r['step_time_s'] for r in steady):.3f} s, " \
           f"{batch}{memory} ({len(steady)} steps)" + (f"; ms: {', '.join(parts)}" if parts else "")


def beside_plan(row: Row, plan: dict, strategy: str) -> str:
    """The planner's predicted step time and memory a GPU beside the measured ones (the
    median step after the fifth; the allocator's reserved peak, else the allocated one),
    each as measured / planned; all of it written to the row's ``speed.json``
    (bench/calibrate_planner.py turns those into the planner's constants)."""
    from statistics import median

    from bench.calibrate_planner import planner_constants

    steady = steady_rows(row.run_dir)
    if not steady:
        return ""
    measured = {"step_s": median(r["step_time_s"] for r in steady),
                "tokens_per_s": median(r["tokens_per_s"] for r in steady),
                "mfu": median(r["mfu"] for r in steady) if steady[0].get("mfu") is not None else None,
                "peak_bytes": max(r.get("peak_mem_bytes") or 0 for r in steady),
                "peak_reserved_bytes": max(r.get("peak_reserved_bytes") or 0 for r in steady),
                "micro_batch": steady[0].get("global_batch_size"), "steps": len(steady)}
    (row.run_dir / "speed.json").write_text(json.dumps(
        {"row": row.name, "strategy": strategy, "measured": measured, "plan": plan,
         "assumed": planner_constants()}, indent=1) + "\n")
    parts = []
    if plan.get("step_s"):
        parts.append(f"step {plan['step_s']:.3f} s (measured/planned {measured['step_s'] / plan['step_s']:.2f})")
    held = measured["peak_reserved_bytes"] or measured["peak_bytes"]
    if plan.get("total_bytes") and held:
        parts.append(f"{plan['total_bytes'] / 2**30:.1f} GiB (measured/planned {held / plan['total_bytes']:.2f})")
    return f"; planner: {', '.join(parts)}" if parts else ""


def speed_report(row: Row, fast: Speed, strategy: str) -> str:
    """A speed row's line (:func:`speed`) and the planner's figures beside it."""
    plan = fast.plan(strategy)
    return speed(row, planned=plan.get("total_bytes") if plan else None) + (beside_plan(row, plan, strategy)
                                                                            if plan else "")


def loss_report(row: Row) -> str:
    """A loss row's four variants (bench/chunked_loss.py --gpu's JSON): time and peak each,
    the memory outside the allocator, and the compiled chunked loss's share of
    speed/ddp+compile's step when that row ran in this scratch."""
    from statistics import median

    got = json.loads((row.run_dir / "loss.json").read_text())
    parts = [f"{name} {v['ms']:.1f} ms" + (f" {v['peak_bytes'] / 2**30:.1f} GiB" if v.get("peak_bytes") else "")
             for name, v in got["variants"].items()]
    text = f"{got['vocab']:,} x {got['tokens']:,}: " + ", ".join(parts)
    if got.get("outside_allocator_bytes"):
        text += f"; outside the allocator {got['outside_allocator_bytes'] / 2**30:.2f} GiB"
    steady = steady_rows(speed_dir(row.run_dir.parent, "ddp+compile"))
    if steady:
        step_ms = 1000 * median(r["step_time_s"] for r in steady)
        shares = ", ".join(f"{n} {100 * got['variants'][n]['ms'] / step_ms:.1f}%" for n in ("whole+compile",
                                                                                           "chunked+compile"))
        text += f"; of ddp+compile's step: {shares}"
    return text


def rows(scratch: Path, fast: Speed) -> List[Row]:
    """The speed rows, torchtitan's, then the loss rows, at ``fast``'s micro-batch."""
    from bench.gpu_check import launcher_argv, on_nccl

    out: List[Row] = []
    for name, extra in SPEED.items():
        run_dir = speed_dir(scratch, name)
        out.append(Row(f"speed/{name}", launcher_argv(*GPU, *extra, *SPEED_RUN, *fast.overrides(),
                                                      f"launcher.run_dir={run_dir}"),
                       on_nccl, run_dir=run_dir, timeout_s=300.0,
                       report=functools.partial(speed_report, fast=fast, strategy=name.split("+")[0])))
    run_dir = speed_dir(scratch, "torchtitan")  # the same model, batch, sequence and compile, torchtitan's loop
    out.append(Row("speed/torchtitan", [sys.executable, str(REPO / "bench/torchtitan_speed.py"), "--compile",
                                        "--batch", str(fast.micro_batch), "--seq-len", str(SPEED_SEQ),
                                        "--peak-tflops", str(SPEED_PEAK_TFLOPS), "--out", str(run_dir / "dump"),
                                        "--json", str(run_dir / "torchtitan.json")],
                   exited_ok, launch=False, run_dir=run_dir, timeout_s=300.0, report=beside_torchtitan))
    for name, vocab in LOSS_VOCABS.items():  # last: the figures above are the ones the goals read
        run_dir = speed_dir(scratch, name)
        out.append(Row(f"speed/{name}", [sys.executable, str(REPO / "bench/chunked_loss.py"), "--gpu",
                                          "--vocab", str(vocab), "--tokens", str(fast.micro_batch * SPEED_SEQ),
                                          "--dim", str(SPEED_DIM), "--json", str(run_dir / "loss.json")],
                       exited_ok, launch=False, run_dir=run_dir, timeout_s=240.0, report=loss_report))
    return out
