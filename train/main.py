"""Run one task of a training job from its run directory (every launcher ends here)."""
from __future__ import annotations

import logging
import os
import sys
import time
import traceback
from pathlib import Path

from train.config import to_run_config, validate
from train.layout import build_layout
from train.rundir import CONFIG, read_run_json, update_run_json


def _logger(run_dir: Path, rank: int) -> logging.Logger:
    logs = run_dir / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    log = logging.getLogger(f"train.rank{rank}")
    log.setLevel(logging.INFO)
    log.propagate = False
    if not log.handlers:
        fmt = logging.Formatter("%(asctime)s rank%(rank)s %(message)s".replace("%(rank)s", str(rank)))
        handler = logging.FileHandler(logs / f"rank{rank}.log")  # append: segments accumulate
        handler.setFormatter(fmt)
        log.addHandler(handler)
        if rank == 0:
            console = logging.StreamHandler(sys.stdout)
            console.setFormatter(fmt)
            log.addHandler(console)
    return log


def run(run_dir: str | Path) -> int:
    """Join the job's process group, train, record the outcome in run.json. Returns 0."""
    import torch.distributed as dist

    from train.dist import all_hostnames, init_distributed, shutdown
    from train.loop import train

    import torch

    run_dir = Path(run_dir).resolve()
    cfg = to_run_config(run_dir / CONFIG)
    validate(cfg)
    # One intra-op thread pool per task sized to its CPUs, as torchrun does: srun tasks
    # otherwise each start one thread per core of the node and oversubscribe it.
    threads = os.environ.get("OMP_NUM_THREADS") or os.environ.get("SLURM_CPUS_PER_TASK") or cfg.cluster.cpus_per_task
    torch.set_num_threads(max(1, int(threads)))
    layout = build_layout(cfg)
    ctx = init_distributed(cfg.train.dist_timeout_s)
    log = _logger(run_dir, ctx.rank)
    if ctx.world_size != layout.world_size:
        raise RuntimeError(f"the job has {ctx.world_size} ranks but the layout needs {layout.world_size} "
                           f"({layout.describe()})")
    hostnames = all_hostnames(ctx)
    segment = 0
    if ctx.is_main:
        segment = int(read_run_json(run_dir).get("segments", 0))
        update_run_json(run_dir, status="running", job_id=ctx.job_id, hostnames=hostnames,
                        world_size=ctx.world_size, nodes=len(hostnames), segments=segment + 1,
                        strategy=cfg.strategy.name, launcher=ctx.launcher, backend=ctx.backend,
                        started_at=time.time(), restart_count=ctx.restart_count)
    obj = [segment]
    dist.broadcast_object_list(obj, src=0)
    try:
        train(cfg, layout, ctx, run_dir, obj[0], log.info)
    except BaseException as exc:
        log.error("training failed: %s\n%s", exc, traceback.format_exc())
        if ctx.is_main:
            update_run_json(run_dir, status="failed", error=f"{type(exc).__name__}: {exc}", ended_at=time.time())
        raise
    if ctx.is_main:
        update_run_json(run_dir, status="completed", ended_at=time.time())
    shutdown()
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 1 or argv[0] in ("-h", "--help"):
        print("usage: python -m train RUN_DIR   (RUN_DIR holds config.yaml, written by the launcher)\n"
              "       torchrun --nproc-per-node N -m train RUN_DIR", file=sys.stderr)
        return 2
    if not (Path(argv[0]) / CONFIG).is_file():
        print(f"error: {argv[0]}/{CONFIG} not found; create the run with `python -m launcher ... "
              f"launcher.dry_run=true` or pass a run directory", file=sys.stderr)
        return 2
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    return run(argv[0])
