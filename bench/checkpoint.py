"""Checkpoint cost on 2 gloo ranks (CPU) against the disk, measured in one run.

For a Llama-style model with a few hundred MB of state (DDP: every rank holds model +
AdamW state; DCP writes one copy): sync save time, async save stall (time the loop is
blocked), restore time, and the disk's sequential write bandwidth (dd with fsync) and
read bandwidth of a file just written (page cache, as the restore reads a checkpoint
just written). Prints stall/sync (goal <= 0.03) and save / restore throughput over the
disk's bandwidth (goal >= 0.7).

    .venv/bin/python bench/checkpoint.py [--dim 768 --layers 8 --repeats 3]
"""
from __future__ import annotations

import argparse
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))


def dir_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def disk_bandwidth(work: Path, size_mb: int) -> tuple[float, float]:
    """(write, read) MB/s of one sequential file: dd with fsync, then reading it back."""
    target = work / "dd.bin"
    out = subprocess.run(["dd", "if=/dev/zero", f"of={target}", "bs=8M", f"count={max(1, size_mb // 8)}",
                          "conv=fsync"], capture_output=True, text=True).stderr
    t0 = time.perf_counter()
    with open(target, "rb") as f:
        while f.read(8 << 20):
            pass
    read_s = time.perf_counter() - t0
    nbytes = target.stat().st_size
    target.unlink()
    match = re.search(r"copied, ([0-9.]+) s", out)
    write_s = float(match.group(1)) if match else float("nan")
    return nbytes / write_s / 1e6, nbytes / read_s / 1e6


def worker(rank: int, world: int, port: int, work: str, dim: int, layers: int, repeats: int, out: dict) -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    import torch
    import torch.distributed as dist

    from train.checkpoint import Checkpointer
    from train.config import RunConfig
    from train.dist import init_distributed, shutdown
    from train.layout import build_layout
    from train.model import build_model
    from train.parallelize import parallelize

    torch.set_num_threads(1)
    cfg = RunConfig()
    cfg.cluster.gpus_per_node = world
    cfg.model.dim, cfg.model.n_layers, cfg.model.n_heads, cfg.model.vocab_size = dim, layers, 12, 32000
    ctx = init_distributed(600)
    engine = parallelize(build_model(cfg.model, "meta"), cfg, build_layout(cfg), ctx)
    tokens = torch.randint(0, 32000, (1, 33))
    engine.train_step([(tokens[:, :-1], tokens[:, 1:])], 1e-4)  # creates the AdamW state
    root = Path(work) / "ckpt"
    ckpt = Checkpointer(root, rank, keep=1)
    sync, stall, restore = [], [], []
    for i in range(repeats):
        ckpt.save(engine, 10 + i, {"loader": {"step": 0}})
        sync.append(ckpt.last_save_s)
        ckpt.save(engine, 100 + i, {"loader": {"step": 0}}, blocking=False)
        stall.append(ckpt.last_save_s)
        ckpt.wait()
        dist.barrier()
        t0 = time.perf_counter()
        ckpt.load_latest(engine, print)
        dist.barrier()
        restore.append(time.perf_counter() - t0)
    if rank == 0:
        latest = root / (root / "latest").read_text().strip()
        out.update(sync=statistics.median(sync), stall=statistics.median(stall),
                   restore=statistics.median(restore), nbytes=dir_bytes(latest),
                   params=sum(p.numel() for p in engine.module.parameters()))
    shutdown()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dim", type=int, default=768)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    import torch.multiprocessing as mp

    from launcher.local import free_port

    with tempfile.TemporaryDirectory(prefix="bench-ckpt-", dir=os.environ.get("BENCH_DIR")) as tmp:
        manager = mp.Manager()
        out = manager.dict()
        mp.spawn(worker, args=(2, free_port(), tmp, args.dim, args.layers, args.repeats, out), nprocs=2)
        res = dict(out)
        write_bw, read_bw = disk_bandwidth(Path(tmp), max(256, res["nbytes"] // 2**20))
        shutil.rmtree(Path(tmp) / "ckpt", ignore_errors=True)
    mb = res["nbytes"] / 1e6
    save_bw, restore_bw = mb / res["sync"], mb / res["restore"]
    print(f"model {res['params'] / 1e6:.1f} M params, checkpoint {mb:.0f} MB (model + AdamW), 2 ranks, "
          f"median of {args.repeats}")
    print(f"  sync save        {res['sync']:.3f} s   {save_bw:7.0f} MB/s")
    print(f"  async stall      {res['stall']:.3f} s   stall/sync = {res['stall'] / res['sync']:.3f} (goal <= 0.03)")
    print(f"  restore          {res['restore']:.3f} s   {restore_bw:7.0f} MB/s")
    print(f"  disk write (dd, fsync) {write_bw:7.0f} MB/s   save/disk    = {save_bw / write_bw:.2f} (goal >= 0.7)")
    print(f"  disk read (cached)     {read_bw:7.0f} MB/s   restore/disk = {restore_bw / read_bw:.2f} (goal >= 0.7)")


if __name__ == "__main__":
    main()
