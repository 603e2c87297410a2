"""Vocab-parallel loss under tensor parallel: peak memory of the head and the loss per rank.

A Llama head over a 128,256-token vocabulary (Llama 3's), fed 2 x 1024 tokens of hidden
states: the trainer's own TP plan (train/strategies/tp.py ``root_plan``: sequence-parallel
norm, column-parallel head) and its loss (``loss_fn``: train/vocab_parallel.py
on sharded logits), forward and backward, on gloo ranks (CPU, fp32). Each configuration
runs in fresh processes; a thread samples the RSS every millisecond and the peak rise
over the RSS before the forward is taken, for the largest rank. Printed: TP=1, TP=2 with
the logits gathered (the plan before vocab-parallel loss), TP=2 with torch's
``loss_parallel`` over the same sharded logits, TP=2 with ours, and the ratio of ours
over TP=1 (goal <= 0.6; the logits and their gradient halved would be 0.5).

    .venv/bin/python bench/tp_loss.py [--vocab 128256] [--tokens 2048] [--dim 512]
"""
from __future__ import annotations

import argparse
import os
import sys
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


class PeakRSS:
    """``rise``: the peak of the RSS over its value at entry, a thread sampling it every
    millisecond until exit (bench/chunked_loss.py measures with it too)."""

    def __enter__(self) -> "PeakRSS":
        self.base, self.peak, self._stop = _rss(), 0, threading.Event()
        self._thread = threading.Thread(target=self._sample)
        self._thread.start()
        return self

    def _sample(self) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak, _rss())
            time.sleep(0.001)

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()
        self.rise = max(self.peak, _rss()) - self.base


def _rank(rank: int, world: int, port: int, args, mode: str, out) -> None:
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
    from torch import nn
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor
    from torch.distributed.tensor.parallel import parallelize_module

    from train.model import RMSNorm
    from torch.distributed.tensor.parallel import loss_parallel

    from train.strategies.base import loss_fn
    from train.strategies.tp import root_plan

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    torch.manual_seed(0)

    class Head(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.norm, self.output = RMSNorm(args.dim, 1e-5), nn.Linear(args.dim, args.vocab, bias=False)

        def forward(self, h):
            return self.output(self.norm(h))

    model = Head()
    h = torch.randn(2, args.tokens // 2, args.dim, requires_grad=True)
    targets = torch.randint(0, args.vocab, (2, args.tokens // 2))
    tp = world > 1
    if tp:
        mesh = init_device_mesh("cpu", (world,))
        plan = {k: v for k, v in root_plan(mode != "gathered").items() if k in ("norm", "output")}
        parallelize_module(model, mesh, plan)
        h = distribute_tensor(h.detach(), mesh, [Shard(1)]).requires_grad_()  # sequence-parallel input
    dist.barrier()
    with PeakRSS() as rss:
        if mode == "torch":  # torch's loss_parallel: F.cross_entropy over the sharded DTensor
            with loss_parallel():
                loss = F.cross_entropy(model(h).flatten(0, 1), targets.flatten(0, 1))
                loss.backward()
            loss = loss.full_tensor()
        else:
            loss = loss_fn(model(h), targets)
            loss.backward()
        value = float(loss.detach())
    peaks = [None] * world
    dist.all_gather_object(peaks, (rss.rise, value))
    if rank == 0:
        out.put(peaks)
    dist.destroy_process_group()


def measure(world: int, args, mode: str):
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    port = 29700 + os.getpid() % 500 + world * 5 + MODES.index(mode)
    procs = [ctx.Process(target=_rank, args=(r, world, port, args, mode, out)) for r in range(world)]
    for p in procs:
        p.start()
    result = out.get(timeout=600)
    for p in procs:
        p.join()
    return max(b for b, _ in result), result[0][1]


MODES = ("ours", "gathered", "torch")


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--vocab", type=int, default=128256)
    p.add_argument("--tokens", type=int, default=2048)
    p.add_argument("--dim", type=int, default=512)
    args = p.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    one, loss1 = measure(1, args, "ours")  # one rank: plain logits, F.cross_entropy
    runs = {mode: measure(2, args, mode) for mode in MODES}
    mib = 2**20
    logits = args.tokens * args.vocab * 4 / mib
    print(f"vocab {args.vocab}, {args.tokens} tokens, dim {args.dim}: full logits {logits:,.0f} MiB (fp32)")
    print(f"peak rise per rank (largest rank): TP=1 {one / mib:,.0f} MiB; TP=2 gathered logits "
          f"{runs['gathered'][0] / mib:,.0f} MiB; TP=2 torch loss_parallel {runs['torch'][0] / mib:,.0f} MiB; "
          f"TP=2 ours {runs['ours'][0] / mib:,.0f} MiB")
    print("losses: " + " ".join(f"{v:.6f}" for v in (loss1, *(runs[m][1] for m in MODES))))
    print(f"ratio TP=2 ours / TP=1: {runs['ours'][0] / one:.3f}  (goal <= 0.6); torch loss_parallel / TP=1: "
          f"{runs['torch'][0] / one:.3f}; gathered / TP=1: {runs['gathered'][0] / one:.3f}")


if __name__ == "__main__":
    main()
