"""A plain torchrun DDP training script: it imports nothing of this toolkit.

    torchrun --nproc-per-node 2 examples/ddp_plain.py --steps 30
    python -m launcher entrypoint=examples/ddp_plain.py 'entrypoint_args=[--steps,30]'

The same file runs either way: it reads the torchrun environment (RANK, WORLD_SIZE,
MASTER_ADDR, ...). Under the toolkit ``STO_RUN_DIR`` names the run directory: the script
keeps its checkpoint there (``plain_ckpt.pt``, resumed after a requeue) and writes one
``metrics.jsonl`` row per step in the toolkit's format (``step``, ``loss``,
``tokens_per_s``), so ``launcher.status`` and ``launcher.report`` read it.
"""
import argparse
import json
import os
import time

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

VOCAB = 128


def batch(step: int, rank: int, size: int, seq: int) -> torch.Tensor:
    """Deterministic token sequences: x[t+1] = (5 x[t] + 3) mod VOCAB, with a random start."""
    g = torch.Generator().manual_seed(1000 * step + rank)
    start = torch.randint(0, VOCAB, (size, 1), generator=g)
    steps = torch.arange(seq + 1)
    seqs = [start]
    for _ in steps[1:]:
        seqs.append((5 * seqs[-1] + 3) % VOCAB)
    return torch.cat(seqs, dim=1)


class TinyLM(nn.Module):
    def __init__(self, dim: int = 64) -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, VOCAB))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.mlp(self.emb(x))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--seq", type=int, default=32)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--step-delay", type=float, default=0.0, help="sleep after each step (tests)")
    args = parser.parse_args()

    backend = "nccl" if torch.cuda.is_available() else "gloo"
    dist.init_process_group(backend)
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if backend == "nccl" else torch.device("cpu")
    torch.manual_seed(0)
    model = DDP(TinyLM().to(device))
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr)
    run_dir = os.environ.get("STO_RUN_DIR")
    ckpt = os.path.join(run_dir, "plain_ckpt.pt") if run_dir else None
    start = 0
    if ckpt and os.path.exists(ckpt):
        state = torch.load(ckpt, map_location=device, weights_only=True)
        model.module.load_state_dict(state["model"])
        opt.load_state_dict(state["opt"])
        start = state["step"]
        if rank == 0:
            print(f"resumed at step {start} (SLURM_RESTART_COUNT={os.environ.get('SLURM_RESTART_COUNT', 0)})")
    for step in range(start + 1, args.steps + 1):
        t0 = time.perf_counter()
        data = batch(step, rank, args.batch, args.seq).to(device)
        logits = model(data[:, :-1])
        loss = F.cross_entropy(logits.reshape(-1, VOCAB), data[:, 1:].reshape(-1))
        opt.zero_grad()
        loss.backward()
        opt.step()
        mean = loss.detach().clone()
        dist.all_reduce(mean)
        mean = mean.item() / world
        dt = time.perf_counter() - t0
        if rank == 0:
            print(f"step {step} loss {mean:.4f}", flush=True)
            if run_dir:
                row = {"step": step, "loss": mean, "step_time_s": dt,
                       "tokens_per_s": world * args.batch * args.seq / dt, "world_size": world, "time": time.time()}
                with open(os.path.join(run_dir, "metrics.jsonl"), "a") as f:
                    f.write(json.dumps(row) + "\n")
        if ckpt and rank == 0 and step % 5 == 0:
            torch.save({"model": model.module.state_dict(), "opt": opt.state_dict(), "step": step}, ckpt + ".tmp")
            os.replace(ckpt + ".tmp", ckpt)
        time.sleep(args.step_delay)
    # torch's gloo teardown: DDP's reference to the group goes first and the barrier leaves
    # the workers idle; otherwise a rank can hang or abort at exit (train/harness/groups.py)
    del model
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
