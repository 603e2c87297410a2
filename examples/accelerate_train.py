"""A Hugging Face Accelerate script, run unchanged by the toolkit.

    accelerate launch --num_processes 4 examples/accelerate_train.py        # as usual
    python -m launcher +cluster=localslurm cluster.nodes=2 +strategy=zero2 \
        entrypoint=examples/accelerate_train.py                               # here

Under the toolkit every task gets what ``accelerate launch`` would have given it for
the strategy (DeepSpeed stage and offload with a generated DeepSpeed JSON, or FSDP's
sharding: spec/user_env.py), so ``Accelerator()`` builds that engine across nodes. On
CPU clusters Accelerate has no DeepSpeed or FSDP path: it runs as MULTI_CPU over gloo
with the whole world. The script prints the engine it got (``distributed_type``) and,
under the toolkit, logs each step to metrics.jsonl in the toolkit's format.
"""
import argparse
import json
import os

import torch
import torch.nn.functional as F
from accelerate import Accelerator
from torch.utils.data import DataLoader, TensorDataset


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=10)
    args = parser.parse_args()
    accelerator = Accelerator()
    state = accelerator.state
    info = {"distributed_type": str(state.distributed_type), "num_processes": state.num_processes,
            "process_index": state.process_index, "zero_stage": None, "fsdp": None}
    if state.deepspeed_plugin is not None:
        info["zero_stage"] = state.deepspeed_plugin.zero_stage
    if getattr(state, "fsdp_plugin", None) is not None:
        info["fsdp"] = str(state.fsdp_plugin.sharding_strategy)
    run_dir = os.environ.get("STO_RUN_DIR")
    if run_dir:
        with open(os.path.join(run_dir, f"accelerate_rank{state.process_index}.json"), "w") as f:
            json.dump(info, f)
    accelerator.print(f"accelerate: {info}")

    torch.manual_seed(0)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(64 * args.steps, 16, generator=g)
    y = x @ (torch.arange(16, dtype=torch.float32) / 16)
    loader = DataLoader(TensorDataset(x, y), batch_size=16)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 1))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model, opt, loader = accelerator.prepare(model, opt, loader)
    # DeepSpeed under bf16 holds the weights in bf16 and casts no inputs (token ids need none;
    # float features do); FSDP keeps fp32 weights and autocasts.
    dtype = next(model.parameters()).dtype
    for step, (xb, yb) in enumerate(loader, start=1):
        loss = F.mse_loss(model(xb.to(dtype)).squeeze(-1).float(), yb)
        accelerator.backward(loss)
        opt.step()
        opt.zero_grad()
        mean = accelerator.reduce(loss.detach(), reduction="mean").item()
        if accelerator.is_main_process and run_dir:
            with open(os.path.join(run_dir, "metrics.jsonl"), "a") as f:
                f.write(json.dumps({"step": step, "loss": mean}) + "\n")
        if step >= args.steps:
            break
    accelerator.print(f"done: {step} steps, loss {mean:.4f}")


if __name__ == "__main__":
    main()
