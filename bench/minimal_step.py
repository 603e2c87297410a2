"""The hand-written baseline of bench/launch.py: rendezvous from SLURM_*, one DDP step.

What a user would write without the toolkit: read srun's variables, init gloo on the
first host, build the same tiny model, take one optimizer step, rank 0 records the time.
"""
import json
import os
import sys
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

from slurm.env import task_identity
from spec.config import ModelConfig
from train.model import build_model


def main() -> None:
    t = task_identity()
    dist.init_process_group("gloo", init_method=f"tcp://{t.master_addr}:{t.master_port}", rank=t.rank,
                            world_size=t.world_size)
    model = build_model(ModelConfig(), "cpu")
    model.init_weights(0)
    ddp = DDP(model)
    opt = torch.optim.AdamW(ddp.parameters(), lr=1e-3)
    tokens = torch.randint(0, 256, (8, 65))
    loss = F.cross_entropy(ddp(tokens[:, :-1]).flatten(0, 1), tokens[:, 1:].flatten())
    loss.backward()
    opt.step()
    dist.all_reduce(loss.detach())
    if t.rank == 0:
        with open(sys.argv[1], "a") as f:
            f.write(json.dumps({"step": 1, "time": time.time()}) + "\n")
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
