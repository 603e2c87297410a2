"""Model-state memory per rank: measured against the ZeRO formula and the engine's model.

For each data-parallel strategy at 2 and 4 gloo ranks (CPU, fp32, torch.multiprocessing),
the ranks build a ~3.7M-parameter Llama with the project's builders (train.parallelize)
and take two AdamW steps (bench/planner.py's ``measure``). Printed per strategy and rank
count, for the largest rank:

- states: the distinct storages of every live tensor right after the optimizer's step
  (a gc census; DTensors by their local shard), minus what lived before the model was
  built and the logits the loop holds, in bytes per parameter;
- ZeRO: the paper's formula in fp32, 4 (param) + 4 (grad) + 8 (Adam moments) bytes per
  parameter, sharded as the stage says: DDP 16, ZeRO-1 8 + 8/N, ZeRO-2 4 + 12/N,
  ZeRO-3 / FSDP 16/N (HSDP: N = the shard group);
- engine: what the engine really holds, the model tests/test_memory.py states and checks
  (DeepSpeed ZeRO-1/2 keep the full fp32 module and two gradient partitions during the
  step: 4 + 20/N; ZeRO-3 24/N; torch engines follow the formula);
- peak RSS: the rise of the peak RSS over the RSS before the model was built
  (MALLOC_MMAP_THRESHOLD_=65536), activations and communication buffers included.

The batch is one sequence of 16 tokens, so activations are < 1 % of the states.

    .venv/bin/python bench/memory.py [--ranks 2,4] [--strategies ddp,fsdp,zero3]

Three more phases, each its own module (their docstrings say what they measure):

    .venv/bin/python bench/memory.py init [--strategies fsdp,zero3,zero2]   # bench/init_memory.py
    .venv/bin/python bench/memory.py tp-loss [--vocab 128256]               # bench/tp_loss.py
    .venv/bin/python bench/memory.py chunked-loss [--tokens 8192]           # bench/chunked_loss.py
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(REPO), str(REPO / "bench"), str(REPO / "tests")]

from planner import measure  # noqa: E402  (sets the allocator and thread environment of the ranks)

STRATEGIES = ("ddp", "fsdp", "fsdp_grad_op", "hsdp", "zero1", "zero2", "zero3")
STAGE = {"ddp": 0, "zero1": 1, "zero2": 2, "zero3": 3, "fsdp": 3, "fsdp_grad_op": 3, "hsdp": 3}
MODEL = ["model.dim=256", "model.n_layers=4", "model.n_heads=8", "model.vocab_size=2048", "model.max_seq_len=64",
         "train.seq_len=16", "train.micro_batch_size=1", "strategy.mixed_precision=fp32"]


def zero_formula(stage: int, n: int) -> float:
    """fp32 Adam bytes per parameter per rank (ZeRO paper, K = 8 in fp32)."""
    param, grad, optim = 4.0, 4.0, 8.0
    return param / (n if stage >= 3 else 1) + grad / (n if stage >= 2 else 1) + optim / (n if stage >= 1 else 1)


def main() -> None:
    from test_memory import EXPECTED  # the engine models the tests check

    from launcher.plan.cli import compose
    from spec.layout import build_layout
    from train.model import build_model

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ranks", default="2,4")
    ap.add_argument("--strategies", default=",".join(STRATEGIES))
    args = ap.parse_args()
    mib = 2**20
    print(f"{'strategy':<13}{'N':>3}{'shard':>6}{'states MiB':>11}{'B/param':>8}{'ZeRO':>7}{'ratio':>7}"
          f"{'engine':>8}{'ratio':>7}{'peak RSS MiB':>13}{'secs':>6}")
    for name in args.strategies.split(","):
        if name not in STAGE:
            ap.error(f"--strategies: {name!r} is not one of {', '.join(STRATEGIES)}")
        for world in (int(r) for r in args.ranks.split(",")):
            # HSDP: 2 "nodes", shard inside each, replicate across
            nodes = 2 if name == "hsdp" else 1
            cfg = compose(["+cluster=local", f"cluster.nodes={nodes}", f"cluster.gpus_per_node={world // nodes}",
                           f"+strategy={name}", *MODEL])
            layout = build_layout(cfg)
            shard = layout.dp_shard if cfg.strategy.engine == "torch" else layout.dp
            params = sum(p.numel() for p in build_model(cfg.model, "meta").parameters())
            t0 = time.time()
            ranks = measure(cfg, world)
            states = max(r["states"] for r in ranks)
            peak = max(r["peak"] for r in ranks)
            per_param = states / params
            formula = zero_formula(STAGE[name], shard)
            engine = EXPECTED.get(name.replace("_grad_op", "").replace("hsdp", "fsdp"), lambda n: None)(shard)
            engine_cols = f"{engine:>8.2f}{per_param / engine:>7.3f}" if engine else f"{'-':>8}{'-':>7}"
            print(f"{name:<13}{world:>3}{shard:>6}{states / mib:>11.2f}{per_param:>8.2f}{formula:>7.2f}"
                  f"{per_param / formula:>7.3f}{engine_cols}{peak / mib:>13.1f}{time.time() - t0:>6.0f}", flush=True)
    print(f"\n{params / 1e6:.2f}M parameters, fp32 AdamW; B/param = measured model-state bytes / parameters "
          "(largest rank); ratio = measured / model")


PHASES = {"init": "init_memory", "tp-loss": "tp_loss", "chunked-loss": "chunked_loss"}  # phase -> module under bench/

if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] in PHASES:
        import importlib

        phase = sys.argv.pop(1)
        importlib.import_module(PHASES[phase]).main()
    else:
        main()
