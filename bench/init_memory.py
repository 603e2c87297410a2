"""Host memory while the model is built: no rank materialises more than its share.

A Llama of ~1.3 GB in fp32 (dim 2048, 4 layers, vocab 32000; ``--layers`` for more) is
built by the trainer's own path (train.parallelize: the builder's ``wrap`` and
``materialise``, then ``finish``) on 4 gloo ranks (CPU). A thread samples each rank's
RSS every millisecond; printed per strategy, for the largest rank: the peak rise while
building and filling the weights (wrap + materialise) and while the engine is made
(finish: DeepSpeed's partitioned optimizer buffers, FSDP's nothing), over the rank's share
of the fp32 model (model bytes / shard degree). The ranks run with
``MALLOC_MMAP_THRESHOLD_=65536`` (bench/planner.py's spawner: freed buffers go back to the
OS), after the engine's imports and one-time set-up. Goal for the build: <= 1.25 for ZeRO-3
and FSDP (before: FSDP drew every weight whole on every rank, ZeRO-3 built the whole
model on every rank: about the shard degree, 4).

    .venv/bin/python bench/init_memory.py [--strategies fsdp,zero3] [--layers 4]
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(REPO), str(REPO / "bench")]

from planner import measure  # noqa: E402  (spawns the ranks; sets their allocator and thread environment)
MODEL = ["model.dim=2048", "model.n_heads=16", "model.vocab_size=32000", "model.max_seq_len=64",
         "model.multiple_of=256", "train.seq_len=16", "strategy.mixed_precision=fp32"]


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


class Peak:
    def __init__(self) -> None:
        self.base, self.peak, self._stop = _rss(), 0, threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak, _rss())
            time.sleep(0.001)

    def rise(self) -> int:
        self._stop.set()
        self._thread.join()
        return max(self.peak, _rss()) - self.base


def rank_main(rank: int, world: int, port: int, cfg, out_dir: str) -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), OMP_NUM_THREADS="1")
    import torch.distributed as dist

    from spec.layout import build_layout
    from train.harness.dist import init_distributed, shutdown
    from train.model import build_model
    from train.parallelize import make_builder
    from train.strategies import get_builder

    os.dup2(2, 1)
    ctx = init_distributed(300)
    layout = build_layout(cfg)
    get_builder(cfg)  # the engine's imports (DeepSpeed's) before the baseline
    builder = make_builder(cfg, layout, ctx)
    if cfg.strategy.zero_stage == 3 and cfg.strategy.engine == "deepspeed":
        # DeepSpeed's one-time set-up in a process (~40 MiB the first zero.Init makes, the
        # same for any model): before the baseline, as the imports; without it the
        # 1.25 GB model reads 1.29 instead of 1.16
        import deepspeed

        from spec.ds_config import deepspeed_config
        from train.strategies.deepspeed import partitioned_build

        deepspeed.init_distributed(dist_backend="gloo", verbose=False)
        with partitioned_build(deepspeed_config(cfg, layout.dp, "cpu")):
            pass
    dist.barrier()
    peak = Peak()
    parts = builder.wrap(build_model(cfg.model, "meta"), lambda part: None)
    builder.materialise(parts, None)
    build = peak.rise()
    peak = Peak()
    builder.finish(parts)
    engine = peak.rise()
    Path(out_dir, f"{rank}.json").write_text(json.dumps({"build": build, "engine": engine}))
    shutdown()


def main() -> None:
    from launcher.plan.cli import compose
    from spec.layout import build_layout
    from spec.model_size import count_params

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--strategies", default="fsdp,zero3")
    ap.add_argument("--ranks", type=int, default=4)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--bf16", action="store_true", help="strategy.mixed_precision=bf16 (ZeRO-1/2 then build "
                    "their full model in bf16: about half the fp32 model, not all of it)")
    args = ap.parse_args()
    for strategy in args.strategies.split(","):
        cfg = compose([f"+strategy={strategy}", f"cluster.gpus_per_node={args.ranks}", f"model.n_layers={args.layers}",
                       *MODEL, *(["strategy.mixed_precision=bf16"] if args.bf16 else [])])
        layout = build_layout(cfg)
        share = 4 * count_params(cfg.model) / layout.dp
        rows = measure(cfg, args.ranks, rank_main)
        build, engine = max(r["build"] for r in rows), max(r["engine"] for r in rows)
        print(f"{strategy}: model {4 * count_params(cfg.model) / 2**30:.2f} GiB fp32, share {share / 2**20:,.0f} MiB/rank; "
              f"build peak {build / 2**20:,.0f} MiB = {build / share:.2f} x share (goal <= 1.25); "
              f"engine {engine / 2**20:,.0f} MiB = {engine / share:.2f} x share", flush=True)


if __name__ == "__main__":
    main()
