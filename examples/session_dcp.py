"""A training script that uses the toolkit's session API and its own DCP checkpoints.

    python -m launcher +cluster=localslurm entrypoint=examples/session_dcp.py

Every step it asks :func:`train.session.should_stop` (agreed across ranks); when Slurm's
warning signal came, it saves a ``torch.distributed.checkpoint`` of the model, the
optimizer and the step under ``RUN_DIR/dcp/step_N``, calls :func:`train.session.requeue`
and returns; the requeued job finds the newest checkpoint and goes on. The data of
step N depends on N only, so an interrupted run ends with the same loss as an
uninterrupted one. Metrics go through :func:`train.session.log`.
"""
import argparse
import os
import time

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.nn.parallel import DistributedDataParallel as DDP

from train import session

VOCAB = 128


def batch(step: int, rank: int, size: int, seq: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 * step + rank)
    x = [torch.randint(0, VOCAB, (size, 1), generator=g)]
    for _ in range(seq):
        x.append((5 * x[-1] + 3) % VOCAB)
    return torch.cat(x, dim=1)


def latest(root: str):
    """The newest complete checkpoint (DCP writes .metadata last)."""
    if not os.path.isdir(root):
        return None
    done = [d for d in os.listdir(root) if os.path.exists(os.path.join(root, d, ".metadata"))]
    return max(done, key=lambda d: int(d.split("_")[1]), default=None)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--seq", type=int, default=32)
    parser.add_argument("--step-delay", type=float, default=0.0, help="sleep after each step (tests)")
    args = parser.parse_args()

    dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    model = DDP(nn.Sequential(nn.Embedding(VOCAB, 64), nn.Linear(64, 256), nn.GELU(), nn.Linear(256, VOCAB)))
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    root = os.path.join(str(session.run_dir or "."), "dcp")
    step = 0
    found = latest(root)
    if found:
        model_sd, opt_sd = get_state_dict(model, opt)
        state = {"model": model_sd, "optim": opt_sd, "step": torch.tensor(0)}
        dcp.load(state, checkpoint_id=os.path.join(root, found))
        set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
        step = int(state["step"])
        if rank == 0:
            print(f"resumed from {found} (restart {session.restart_count()})", flush=True)
    while step < args.steps:
        if session.should_stop():
            model_sd, opt_sd = get_state_dict(model, opt)
            dcp.save({"model": model_sd, "optim": opt_sd, "step": torch.tensor(step)},
                     checkpoint_id=os.path.join(root, f"step_{step}"))
            if rank == 0:
                print(f"signalled: saved step {step}, asking for a requeue", flush=True)
            session.requeue()
            return
        step += 1
        t0 = time.perf_counter()
        data = batch(step, rank, args.batch, args.seq)
        loss = F.cross_entropy(model(data[:, :-1]).reshape(-1, VOCAB), data[:, 1:].reshape(-1))
        opt.zero_grad()
        loss.backward()
        opt.step()
        # Every rank's loss, summed in rank order: the same bits whatever order the
        # all-reduce of a new process group (after a requeue) would add them in.
        gathered = [torch.zeros(()) for _ in range(world)]
        dist.all_gather(gathered, loss.detach())
        mean = sum(g.item() for g in gathered) / world
        dt = time.perf_counter() - t0
        session.log(step, loss=mean, step_time_s=dt, tokens_per_s=world * args.batch * args.seq / dt)
        if rank == 0:
            print(f"step {step} loss {mean:.4f}", flush=True)
        time.sleep(args.step_delay)
    # torch's gloo teardown: DDP's reference to the group goes first and the barrier leaves
    # the workers idle; otherwise a rank can hang or abort at exit (train/harness/groups.py)
    del model
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
