"""`make gpu-check`: the CUDA paths, each run for real on the GPU(s) of this machine.

    python bench/gpu_check.py [--out DIR] [--only NAME ...] [--budget-s 330] [--jobs 4] [--set KEY=VALUE ...]
    python bench/gpu_check.py --dry        # CPU/CI: build every row's command and check it

Every row is one command (a launch of the toolkit, or a short Python check) with its
verdict; each row's result is written as soon as it ends (``DIR/gpu_check.jsonl``, one
line a row, and ``DIR/gpu_check.md``, the table so far), so a run stopped by its time
slot still leaves what it did. Rows (one GPU is enough):

- ``engine/S``: every engine at world 1 on NCCL and bf16 (ddp, fsdp, zero1, zero2, zero3,
  zero3_offload; tp and pp at degree 1; ddp+compile): the run completes, run.json says
  backend nccl and matmul tf32, the loss falls;
- ``parity/bf16``: after them, every engine row's losses within 2% of engine/ddp's at every
  step (one maths for every engine, compiled or eager: tests/test_bf16_parity.py on CPU);
- ``binding/agent``: a node's agent forking its rank on the GPU (device, CPUs near it);
- ``binding/node``, ``binding/task``: a task with LOCAL_RANK 3 that sees one GPU
  (CUDA_VISIBLE_DEVICES of one device): binding ``task`` takes cuda:0 and trains under
  ZeRO-2 (DeepSpeed sets its device from LOCAL_RANK unless told); binding ``node`` is
  refused at start in one line;
- ``resume/S`` (fsdp, zero2): a run that fails after its step-3 checkpoint resumes on
  CUDA and ends with the uninterrupted run's losses (bf16 on GPU: within 2%);
- ``hf/zero3``: a Hugging Face Llama written by transformers here, imported under ZeRO-3;
- ``accelerate/S`` (zero2, fsdp): examples/accelerate_train.py gets the engine of the
  strategy from Accelerate (DeepSpeed, FSDP);
- ``profile/memory``: ``profile.steps=[2,3] profile.memory=true`` and an injected
  out-of-memory error at step 4: the trace holds steps 2-3 and the GPU's kernels, the
  window's allocator snapshot and ``oom_rank0.pickle`` are written (docs/observing.md);
- ``train/packed``: chat data packed (``data.packing=true``: flex attention, compiled
  blocks, FSDP, full activation checkpointing) completes and its loss falls;
  ``packed/equal``: per document the packed loss and gradients equal the unpacked ones,
  no attention across documents (bench/gpu_check_packed.py);
- ``health``: this machine's nvidia-smi outputs through train/harness/health.py;
- ``doctor``: ``python -m launcher.doctor`` on this machine;
- ``speed/S`` (ddp, ddp+compile, fsdp+compile, zero2): Llama 3.2 1B, bf16, seq 2048, whole
  logits, on one GPU at the largest micro-batch of 16, 8, 4 that the planner fits on it under
  ddp, fsdp and zero2 (``--speed-batch N`` sets it): the median tokens/s, MFU (against
  ``SPEED_PEAK_TFLOPS``, the H100/H200 dense bf16 figure) and peak memory of the steps after
  the first five, from metrics.jsonl;
- ``speed/torchtitan``: torchtitan's own trainer on the same model, batch, sequence and
  compile (bench/torchtitan_speed.py), its MFU by our FLOP formula, and ddp+compile's
  tokens/s over torchtitan's (the goal: >= 1.0); each speed row also shows the planner's
  step time and memory beside the measured ones (bench/calibrate_planner.py turns them
  into the planner's constants);
- ``speed/loss_128k``, ``speed/loss_152k``: one step's loss at Llama 3's and Qwen 2.5's
  vocabularies, whole logits and chunked, eager and compiled (bench/chunked_loss.py --gpu);
- ``bigjob/rank``, ``bigjob/snapshot``, ``bigjob/save_load``, ``bigjob/affinity``: rank 0 of
  a 64-node llama3_70b fsdp_tp job on torch's fake process group with real CUDA tensors:
  its shards, two steps and their peak beside the planner's, the async pinned snapshot,
  save and load GB/s with checksums, its CPUs against its GPU's (bench/gpu_check_bigjob.py;
  ``--only bigjob``);
- ``float8/1b``, ``float8/8b_block``: float8 training against bf16 (FSDP, compile, 50 steps
  each) on Llama 3.2 1B and on 8 blocks of Llama 3.1 8B's shape: both tokens/s, their ratio,
  peak memory, the loss within 2% at every step (bench/gpu_check_float8.py).

With ``--dry`` no row runs: each launch row's command is checked by the launcher's own
dry run (compose, layout, memory gate) and each check row's code is compiled, so the
rows cannot rot on machines without a GPU (tests/test_gpu_check.py runs it in CI).
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Callable, Dict, List, Optional

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from bench import gpu_check_runner as runner  # noqa: E402  (the tree on the path first)
from bench.gpu_check_runner import GPU, Row, Table, dry_run, exited_ok, pythonpath, run_rows  # noqa: E402,F401
from bench import gpu_check_bigjob, gpu_check_float8, gpu_check_speed  # noqa: E402
from bench.gpu_check_speed import (DRY_GPU_GB, SPEED, SPEED_BATCHES, SPEED_PEAK_TFLOPS, SPEED_PLANNED,  # noqa: E402,F401
                                   Speed, beside_torchtitan, speed, speed_batch, speed_dir, steady_rows)

SHORT = ["train.seq_len=128", "data.num_tokens=200000", "train.log_every=1", "train.preflight=false"]
ENGINES = {"ddp": [], "fsdp": [], "zero1": [], "zero2": [], "zero3": [], "zero3_offload": [],
           "tp": ["strategy.tensor_parallel=1"], "pp": ["strategy.pipeline_parallel=1"],
           "ddp+compile": ["strategy.compile=true"]}
RESUMED = ("fsdp", "zero2")
RESUME_RTOL = 0.02   # bf16 on GPU, reductions in another order after a restart
def launcher_argv(*args: str) -> List[str]:
    return [sys.executable, "-m", "launcher", *args]


def _run_json(run_dir: Path) -> dict:
    path = run_dir / "run.json"
    return json.loads(path.read_text()) if path.exists() else {}


def _losses(run_dir: Path) -> Dict[int, float]:
    from spec.rundir import read_metrics

    return {r["step"]: r["loss"] for r in read_metrics(run_dir) if r.get("loss") is not None}


def trained(row: Row, proc: subprocess.CompletedProcess) -> str:
    """A completed run on NCCL whose loss fell."""
    if proc.returncode != 0:
        return f"exit {proc.returncode}"
    info, losses = _run_json(row.run_dir), _losses(row.run_dir)
    if info.get("backend") != "nccl":
        return f"backend {info.get('backend')!r} in run.json, not nccl"
    if info.get("matmul") != "tf32":  # strategy.tf32's default, set on CUDA
        return f"matmul {info.get('matmul')!r} in run.json, not tf32"
    if len(losses) < 2:
        return f"{len(losses)} losses in metrics.jsonl"
    first, last = losses[min(losses)], losses[max(losses)]
    return "" if last < first else f"loss did not fall: {first:.4f} -> {last:.4f}"


def on_nccl(row: Row, proc: subprocess.CompletedProcess) -> str:
    """A completed run on NCCL (a speed row: 20 steps of a 1B model need not lower the loss)."""
    if proc.returncode != 0:
        return f"exit {proc.returncode}"
    backend = _run_json(row.run_dir).get("backend")
    return "" if backend == "nccl" else f"backend {backend!r} in run.json, not nccl"


def resumed_like(reference: Path) -> Callable[[Row, subprocess.CompletedProcess], str]:
    def check(row: Row, proc: subprocess.CompletedProcess) -> str:
        why = trained(row, proc)
        if why:
            return why
        log = (row.run_dir / "logs" / "rank0.log").read_text(errors="replace")
        if "resumed from step 3" not in log:
            return "no 'resumed from step 3' in rank0.log"
        ours, ref = _losses(row.run_dir), _losses(reference)
        worst = max(abs(ours[s] - ref[s]) / abs(ref[s]) for s in ref if s > 3) if ref else 1.0
        return "" if set(ours) == set(ref) and worst <= RESUME_RTOL else \
            f"steps {sorted(ours)} vs {sorted(ref)}, worst relative difference {worst:.3g}"
    return check


def profiled_on_cuda(row: Row, proc: subprocess.CompletedProcess) -> str:
    """Steps 2-3 traced with the GPU's kernels, the window's allocator snapshot beside the trace,
    and the injected out-of-memory error at step 4 dumped as a snapshot (the run fails)."""
    import gzip

    folder = row.run_dir / "profile"
    if proc.returncode == 0:
        return "exit 0: the injected out-of-memory error did not end the run"
    trace = folder / "step_2" / "rank0.json.gz"
    if not trace.is_file():
        return f"no {trace.relative_to(row.run_dir)}"
    events = json.loads(gzip.decompress(trace.read_bytes())).get("traceEvents", [])
    steps = {e.get("name") for e in events if str(e.get("name", "")).startswith("ProfilerStep#")}
    kernels = sum(e.get("cat") == "kernel" for e in events)
    if steps != {"ProfilerStep#2", "ProfilerStep#3"} or not kernels:
        return f"trace steps {sorted(steps)}, {kernels} GPU kernel events"
    missing = [name for name in ("step_2/rank0_memory.pickle", "oom_rank0.pickle") if not (folder / name).is_file()]
    oom = json.loads((folder / "oom_rank0.json").read_text()) if (folder / "oom_rank0.json").is_file() else {}
    if missing or oom.get("snapshot") != "oom_rank0.pickle" or oom.get("cuda") is not True:
        return f"missing {missing}, oom_rank0.json {oom}"
    return ""


def failed_run(row: Row, proc: subprocess.CompletedProcess) -> str:
    """The injected failure ended the run (after its step-3 checkpoint)."""
    status = _run_json(row.run_dir).get("status")
    return "" if proc.returncode != 0 and status == "failed" else f"exit {proc.returncode}, status {status!r}"


def rows(scratch: Path, fast: Speed = Speed()) -> List[Row]:
    """Every row, in the order they run (cheapest first where the order does not matter);
    ``fast``: the speed rows' micro-batch."""
    out: List[Row] = []
    out.append(Row("health", [sys.executable, str(REPO / "bench/gpu_check_rows.py"), "health"], exited_ok,
                   launch=False))
    for name, extra in ENGINES.items():
        run_dir = engine_dir(scratch, name)
        steps = ["train.steps=6", "checkpoint.every_steps=3"] if name in RESUMED else ["train.steps=6"]
        out.append(Row(f"engine/{name}", launcher_argv(*GPU, f"+strategy={name.split('+')[0]}", *extra, *SHORT,
                                                       *steps, f"launcher.run_dir={run_dir}"), trained,
                       run_dir=run_dir))
    for strategy in RESUMED:
        run_dir, reference = scratch / f"resume_{strategy}", engine_dir(scratch, strategy)
        args = [*GPU, f"+strategy={strategy}", *SHORT, "train.steps=6", "checkpoint.every_steps=3",
                f"launcher.run_dir={run_dir}"]
        crash = Row(f"resume/{strategy}:crash", launcher_argv(*args, "fault.raise_at_step=5"),
                    failed_run, run_dir=run_dir)
        out.append(Row(f"resume/{strategy}", launcher_argv(*args), resumed_like(reference), before=crash,
                       run_dir=run_dir))
    for binding in ("task", "node", "agent"):  # the row script judges (bench/gpu_check_binding.py)
        argv = [sys.executable, str(REPO / "bench/gpu_check_rows.py"), f"binding_{binding}", str(scratch)]
        out.append(Row(f"binding/{binding}", argv, exited_ok, launch=False,
                       env={"CUDA_VISIBLE_DEVICES": os.environ.get("STO_GPU_CHECK_DEVICE", "0")}))
    hf_dir, run_dir = scratch / "hf_llama", scratch / "hf_zero3"
    make_hf = Row("hf/zero3:write", [sys.executable, str(REPO / "bench/gpu_check_rows.py"), "write_hf", str(hf_dir)],
                  exited_ok, launch=False)
    out.append(Row("hf/zero3", launcher_argv(*GPU, "+strategy=zero3", f"model.hf_path={hf_dir}", *SHORT,
                                             "train.steps=4", f"launcher.run_dir={run_dir}"), trained,
                   before=make_hf, run_dir=run_dir))
    for strategy, engine in (("zero2", "DistributedType.DEEPSPEED"), ("fsdp", "DistributedType.FSDP")):
        run_dir = scratch / f"accelerate_{strategy}"
        out.append(Row(f"accelerate/{strategy}", launcher_argv(
            *GPU, f"entrypoint={REPO / 'examples/accelerate_train.py'}", f"+strategy={strategy}",
            "entrypoint_args=[--steps,3]", f"launcher.run_dir={run_dir}"), accelerate_engine(engine), run_dir=run_dir))
    chat, run_dir, packed = scratch / "packed_chat", scratch / "packed", str(REPO / "bench/gpu_check_packed.py")
    make_chat = Row("train/packed:data", [sys.executable, packed, "packed_data", str(chat)], exited_ok, launch=False)
    out.append(Row("train/packed", launcher_argv(
        *GPU, "+strategy=fsdp", "strategy.compile=true", "strategy.activation_checkpointing=full", "data.source=chat",
        f"data.path={chat}", "data.packing=true", "model.vocab_size=384", *SHORT[:1], "train.steps=8",
        f"launcher.run_dir={run_dir}"), trained, before=make_chat, run_dir=run_dir))
    out.append(Row("packed/equal", [sys.executable, packed, "packed_equal"], exited_ok, launch=False))
    run_dir = scratch / "profile_memory"  # the profiler's CUDA side: kernels in the trace, the allocator's snapshots
    out.append(Row("profile/memory", launcher_argv(*GPU, "+strategy=ddp", *SHORT, "train.steps=4", "profile.steps=[2,3]",
                                                   "profile.memory=true", "fault.oom_at_step=4",
                                                   f"launcher.run_dir={run_dir}"), profiled_on_cuda, run_dir=run_dir))
    out.append(Row("doctor", [sys.executable, "-m", "launcher.doctor", *GPU, f"launcher.run_dir={scratch / 'doctor'}"],
                   exited_ok, run_dir=scratch / "doctor"))
    out.append(Row("parity/bf16", [sys.executable, str(REPO / "bench/gpu_check_rows.py"), "parity", str(scratch)],
                   exited_ok, launch=False, run_dir=scratch, report=parity))
    out += gpu_check_speed.rows(scratch, fast)
    out += gpu_check_bigjob.rows(scratch)
    out += gpu_check_float8.rows(scratch)
    return out


def engine_dir(scratch: Path, name: str) -> Path:
    """Where the engine row ``name`` runs (bench/gpu_check_rows.py's parity row reads them)."""
    return scratch / f"engine_{name.replace('+', '_')}"


def parity(row: Row) -> str:
    """Each engine's worst relative loss difference from engine/ddp's over their steps."""
    worst = json.loads((row.run_dir / "parity.json").read_text())
    return ", ".join(f"{name} {100 * w:.2f}%" for name, w in worst.items())


def accelerate_engine(engine: str) -> Callable[[Row, subprocess.CompletedProcess], str]:
    def check(row: Row, proc: subprocess.CompletedProcess) -> str:
        if proc.returncode != 0:
            return f"exit {proc.returncode}"
        seen = json.loads((row.run_dir / "accelerate_rank0.json").read_text())
        return "" if seen["distributed_type"] == engine else f"Accelerate built {seen['distributed_type']}"
    return check


def select(every: List[Row], only: Optional[List[str]]) -> List[Row]:
    """The rows ``--only`` names (a row's name, else a prefix: engine/ddp is that row, not
    engine/ddp+compile too), in table order; a resume row brings its engine row, whose
    uninterrupted run it is compared with, the parity row every engine row."""
    names = {r.name for r in every}
    wanted = {r.name for r in every
              if not only or any(r.name == p or (p not in names and r.name.startswith(p)) for p in only)}
    wanted |= {f"engine/{name.split('/')[1]}" for name in wanted if name.startswith("resume/")}
    if "parity/bf16" in wanted:
        wanted |= {r.name for r in every if r.name.startswith("engine/")}
    return [r for r in every if r.name in wanted]


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=os.environ.get("GPU_CHECK_OUT", str(REPO / "runs" / "gpu-check")))
    parser.add_argument("--only", nargs="*", default=None, help="row names or prefixes (engine, resume/fsdp, ...)")
    parser.add_argument("--budget-s", type=float, default=420.0, help="rows not started by then are skipped")
    parser.add_argument("--jobs", type=int, default=6,
                        help="rows sharing the GPU at a time (the speed rows always run alone, last)")
    parser.add_argument("--dry", action="store_true", help="build and check every command, run none (no GPU)")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                        help="an override added to every launch row (e.g. strategy.tf32=false; the speed rows' "
                             "micro-batch is --speed-batch, which torchtitan's row follows too)")
    parser.add_argument("--speed-batch", type=int, default=0,
                        help="the speed rows' micro-batch (0: the largest of 16, 8, 4 the planner fits on this GPU)")
    parser.add_argument("--scratch", default=None, help="where runs go (default: a new temporary directory)")
    args = parser.parse_args(argv)
    scratch = Path(args.scratch or tempfile.mkdtemp(prefix="sto-gpu-check-"))
    selected = select(rows(scratch), args.only)
    if not args.dry and selected:
        import torch  # the rows need a GPU: say so at once rather than row by row

        if not torch.cuda.is_available():
            print(f"no CUDA here (torch {torch.__version__}, CUDA build {torch.version.cuda}): "
                  "run `make gpu-check` on a GPU machine, or `bench/gpu_check.py --dry` to check the rows")
            return 2
        print(f"torch {torch.__version__}, {torch.cuda.get_device_name(0)}, scratch {scratch}", flush=True)
    if any(r.name.startswith("speed/") for r in selected):
        gpu = DRY_GPU_GB if args.dry else torch.cuda.get_device_properties(0).total_memory / 2**30
        # --speed-batch: the planner is asked once, at that batch (the rows' planned figures)
        fast = Speed(args.speed_batch, gpu) if args.speed_batch else speed_batch(gpu)
        print(f"speed rows: micro-batch {fast.micro_batch}" + ("" if args.speed_batch else
              f" (the largest of {', '.join(map(str, SPEED_BATCHES))} the planner fits on {gpu:.1f} GB, whole logits, "
              f"under {', '.join(SPEED_PLANNED)})"), flush=True)
        selected = select(rows(scratch, fast), args.only)
    for row in selected:  # --set after the row's own overrides: Hydra takes the last one
        for step in filter(None, [row.before, row]):
            if step.launch:
                step.argv = step.argv[:-1] + args.set + step.argv[-1:]  # launcher.run_dir stays last
    if not selected:
        print(f"--only {' '.join(args.only)}: no such row; rows: {', '.join(r.name for r in rows(scratch))}")
        return 2
    table = Table(Path(args.out))
    failed = dry_run(selected, table) if args.dry else run_rows(selected, table, args.budget_s, args.jobs)
    print(f"gpu-check: {len(table.results) - failed} passed, {failed} failed; table in {table.md}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
