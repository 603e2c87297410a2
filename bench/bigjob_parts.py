"""The pieces of bench/bigjob_rank.py's rank (its docstring says what and why): the job's
overrides, its config and plan, the fake process group, the trainer's build, the shards
against theory, a step and its memory."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple

REPO = Path(__file__).resolve().parent.parent

JOB = ["+cluster=h100x8", "cluster.nodes=64", "+model=llama3_70b", "+strategy=fsdp_tp", "train.seq_len=8192",
       "strategy.activation_checkpointing=full"]
LAYERS, MICRO_BATCH = 80, 2
DRY_SHAPE = ["model.dim=256", "model.n_heads=8", "model.n_kv_heads=2", "model.vocab_size=1024",
             "model.multiple_of=64", "train.seq_len=64"]
DRY_LAYERS = 2
SECTIONS = ("rank", "snapshot", "save_load", "affinity")
GIB = 2**30
# TP's split of each weight (train/strategies/tp.py: column-parallel along dim 0, row-parallel
# along dim 1, the embedding by vocabulary rows); norms are replicated.
TP_DIM = {"tok_embeddings": 0, "output": 0, "wq": 0, "wk": 0, "wv": 0, "w1": 0, "w3": 0, "wo": 1, "w2": 1}


def size(n: float) -> str:
    """Bytes in GiB, MiB or KiB, whichever reads best (a 70B rank's and a tiny model's)."""
    for unit, scale in (("GiB", GIB), ("MiB", 2**20)):
        if n >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{n / 2**10:.1f} KiB"


def count(n: float) -> str:
    return f"{n / 1e6:,.1f} M" if n >= 1e6 else f"{n:,.0f}"


def job_overrides(layers: int, micro_batch: int, dry: bool) -> List[str]:
    return [*JOB, f"model.n_layers={layers}", f"train.micro_batch_size={micro_batch}", *(DRY_SHAPE if dry else [])]


def _module(args: List[str]) -> str:
    proc = subprocess.run([sys.executable, "-m", *args], cwd=REPO, capture_output=True, text=True, timeout=180)
    if proc.returncode != 0:
        raise RuntimeError(f"python -m {args[0]} exited {proc.returncode}: {(proc.stdout + proc.stderr).strip()[-600:]}")
    return proc.stdout


def prepare(out: Path, overrides: List[str]):
    """The run's config as the trainer reads it (the launcher's dry run writes config.yaml)
    and the planner's JSON for it."""
    from spec.config import to_run_config
    from spec.rundir import CONFIG

    _module(["launcher", *overrides, "launcher.dry_run=true", f"launcher.run_dir={out / 'run'}"])
    return to_run_config(out / "run" / CONFIG), planned(overrides)


def planned(overrides: List[str]) -> Dict[str, Any]:
    return json.loads(_module(["launcher.plan", *overrides, "plan.format=json", "plan.top=0"]))[0]


def join(cfg, dry: bool):
    """Rank 0 of the layout's world on the fake process group, its device and the CUDA
    allocator's settings as the harness sets them (binding ``task``: cuda:0 on a GPU)."""
    import dataclasses
    import socket

    from spec.identity import TaskIdentity
    from spec.layout import build_layout
    from train.harness.dist import DistContext, pick_device
    from train.metrics import allocator_env_defaults
    from train.torch_compat import fake_process_group, set_allocator_settings

    layout = build_layout(cfg)
    fake_process_group(0, layout.world_size)
    allocator = allocator_env_defaults(os.environ)  # as init_distributed: before CUDA, then told again
    device = pick_device("cpu" if dry else "gpu", "task", 0, layout.gpus_per_node)
    if allocator and device.type == "cuda":
        set_allocator_settings(allocator["PYTORCH_ALLOC_CONF"])
    me = TaskIdentity.placed(layout, 0, "127.0.0.1", 0, job_id="bigjob", launcher="srun")
    return layout, DistContext(**dataclasses.asdict(me), hostname=socket.gethostname(), backend="fake", device=device)


def build(cfg, layout, ctx):
    """The trainer's build (train/loop.py): the meta model, its head's loss chunk, parallelize."""
    from train.model import build_model, head_loss_chunk
    from train.parallelize import parallelize
    from train.strategies.base import matmul_precision

    matmul_precision(cfg, ctx.device)
    model = build_model(cfg.model, "meta")
    model.loss_chunk = head_loss_chunk(cfg, ctx.device)
    return parallelize(model, cfg, layout, ctx)


def expected_local(name: str, shape: Tuple[int, ...], tp: int, dp: int) -> Tuple[int, ...]:
    """Rank 0's shard of a weight by theory: TP's dim split in ``tp`` (:data:`TP_DIM`), then
    FSDP's dim 0 in ``dp`` chunks, the first rounded up (torch.chunk's, FSDP2's split)."""
    parts = name.split(".")
    leaf = parts[-2] if parts[-1] in ("weight", "bias") and len(parts) > 1 else parts[-1]
    local = list(shape)
    if leaf in TP_DIM:
        local[TP_DIM[leaf]] = -(-local[TP_DIM[leaf]] // tp)
    local[0] = -(-local[0] // dp)
    return tuple(local)


def shards(engine, layout) -> Dict[str, Any]:
    """Every parameter's local shape against :func:`expected_local`; the local count."""
    from train.model import clean_name

    shown, wrong, count = {}, [], 0
    for raw, p in engine.module.named_parameters():
        name = clean_name(raw)
        local = tuple(p.to_local().shape) if hasattr(p, "to_local") else tuple(p.shape)
        want = expected_local(name, tuple(p.shape), layout.tp, layout.dp_shard)
        count += p.to_local().numel() if hasattr(p, "to_local") else p.numel()
        if local != want:
            wrong.append(f"{name} {tuple(p.shape)}: {local}, theory {want}")
        if not name.startswith("layers.") or name.startswith("layers.0."):
            shown[name] = [list(p.shape), list(local)]
    return {"shown": shown, "wrong": wrong, "params": count}


def step_once(engine, batch, lr: float, device) -> Tuple[float, float]:
    """One training step: its seconds (the device synchronised) and its loss."""
    import torch

    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    sync()
    t0 = time.perf_counter()
    loss, _ = engine.train_step([batch], lr)
    sync()
    return time.perf_counter() - t0, float(loss)


def memory(engine, device) -> Dict[str, float]:
    """The step's peaks (the trainer's own report) and what CUDA holds beside the allocator."""
    import torch

    out = {"allocated": engine.peak_memory_bytes(), "reserved": engine.peak_reserved_bytes() or 0}
    if device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
        out["beside"] = (total - free) - torch.cuda.memory_reserved(device)
        out["device"] = out["reserved"] + out["beside"]
    return out


def memory_line(mem: Dict[str, float], plan: Dict[str, Any]) -> Tuple[str, Optional[float]]:
    """Measured against planned, and the device's peak over the planner's total."""
    total, overhead = plan["total_bytes"], plan["overhead_bytes"]
    if "device" not in mem:
        return f"memory not compared on CPU (planned {total / GIB:.2f} GiB a GPU)", None
    ratio = mem["device"] / total
    line = (f"device/planned {ratio:.2f} ({'within' if abs(ratio - 1) <= 0.10 else 'outside'} the 10% goal): peak "
            f"{mem['allocated'] / GIB:.1f} GiB allocated, {mem['reserved'] / GIB:.1f} reserved, {mem['device'] / GIB:.1f} "
            f"on the device ({mem['beside'] / GIB:.1f} beside the allocator); planned {total / GIB:.1f} GiB "
            f"({(total - overhead) / GIB:.1f} without its CUDA overhead: allocated/that "
            f"{mem['allocated'] / (total - overhead):.2f})")
    return line, ratio
