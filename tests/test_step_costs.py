"""What a training step sends besides the gradients it must (issue 31 item 6), counted on 2
gloo ranks forked warm (tests/warm.py):

- DDP does not broadcast the RoPE buffer before every forward (``broadcast_buffers``):
  every rank computes the same table;
- HSDP all-reduces across its replicas once a step, at the last micro-batch of an
  accumulation, not at each (FSDP keeps the earlier reduce-scattered sums until then).
That the steps still train like one process is tests/test_strategies.py's (its HSDP case
accumulates)."""
from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

import warm
from helpers import compose_run
from launcher.local import free_port

pytestmark = pytest.mark.slow


def count_collectives(rank: int, world: int, port: int, cfg, out_dir: str) -> None:
    """One step of one micro-batch, then one of two: the collectives each step called."""
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    import torch
    import torch.distributed as dist

    from spec.layout import build_layout
    from train.harness.dist import init_distributed, shutdown
    from train.model import build_model
    from train.parallelize import parallelize

    ctx = init_distributed(120)
    engine = parallelize(build_model(cfg.model, "meta"), cfg, build_layout(cfg), ctx)
    calls = {"all_reduce": 0, "broadcast": 0}

    def counted(name, real):
        def call(*args, **kwargs):
            calls[name] += 1
            return real(*args, **kwargs)
        return call

    dist.all_reduce = counted("all_reduce", dist.all_reduce)
    dist._broadcast_coalesced = counted("broadcast", dist._broadcast_coalesced)
    g = torch.Generator().manual_seed(rank)
    batch = torch.randint(0, cfg.model.vocab_size, (1, 17), generator=g)
    micro = (batch[:, :-1], batch[:, 1:])
    steps = []
    for n in (1, 2):
        before = dict(calls)
        engine.train_step([micro] * n, 1e-3)
        steps.append({k: calls[k] - before[k] for k in calls})
    Path(out_dir, f"{rank}.json").write_text(json.dumps(steps))
    shutdown()


def _steps(tmp_path: Path, overrides: list) -> list:
    cfg = compose_run(["cluster.gpus_per_node=1", "cluster.nodes=2", "train.seq_len=16", *overrides])
    proc = warm.call_ranks(count_collectives, 2, (2, free_port(), cfg, str(tmp_path)), cwd=tmp_path, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return [json.loads((tmp_path / f"{r}.json").read_text()) for r in range(2)]


def test_ddp_broadcasts_no_buffer_before_its_forwards(tmp_path):
    for one, two in _steps(tmp_path, ["+strategy=ddp"]):
        assert one["broadcast"] == two["broadcast"] == 0, (one, two)


def test_hsdp_replicas_all_reduce_once_a_step_whatever_the_accumulation(tmp_path):
    for one, two in _steps(tmp_path, ["+strategy=hsdp"]):  # 2 replicas of 1 shard
        assert one["all_reduce"] > 0 and two["all_reduce"] == one["all_reduce"], (one, two)
