"""A training function for ``entrypoint=examples.train_fn:train`` (run from the repo root).

The toolkit calls ``train(cfg)`` in every task with the composed config; your own
settings live under ``user`` (``+user.lr=1e-2 +user.steps=20``). The torchrun
environment is set, so ``init_process_group()`` needs no arguments.
"""
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

from train import session


def train(cfg) -> None:
    steps = int(cfg.user.get("steps", 20))
    lr = float(cfg.user.get("lr", 0.05))
    dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    model = DDP(torch.nn.Linear(16, 1))
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    target = torch.arange(16, dtype=torch.float32) / 16
    for step in range(1, steps + 1):
        g = torch.Generator().manual_seed(step * 100 + rank)
        x = torch.randn(32, 16, generator=g)
        loss = F.mse_loss(model(x).squeeze(-1), x @ target)
        opt.zero_grad()
        loss.backward()
        opt.step()
        session.log(step, loss=loss.item())
    if rank == 0:
        print(f"done: {steps} steps on {world} ranks, last loss {loss.item():.4f}", flush=True)
    # torch's gloo teardown: DDP's reference to the group goes first and the barrier leaves
    # the workers idle; otherwise a rank can hang or abort at exit (train/harness/groups.py)
    del model
    dist.barrier()
    dist.destroy_process_group()
