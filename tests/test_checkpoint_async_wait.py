"""Async checkpoint saves on 2 gloo ranks whose poll() saw the write finish at different
steps: the next save's wait() must still enter its barrier on both ranks (it hung the
loop when one rank had already taken the finished save off its pending slot)."""
from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp

from launcher.local import free_port


def _rank(rank: int, world: int, port: int, root: str) -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    import datetime

    import torch.distributed as dist

    from train.checkpoint import Checkpointer
    from train.strategies.base import DCPState

    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=30))
    module = torch.nn.Linear(8, 8)
    optimizer = torch.optim.AdamW(module.parameters())
    module(torch.ones(2, 8)).sum().backward()
    optimizer.step()
    engine = DCPState()  # the engine protocol's DCP side: model + optimizer state
    engine.module, engine.optimizer = module, optimizer
    ckpt = Checkpointer(Path(root), rank, keep=3)
    ckpt.save(engine, 1, {"loader": {}}, blocking=False)
    if rank == 1:  # this rank's loop polled after the write finished; rank 0's had not yet
        ckpt._pending[0].result()
        ckpt.poll()
        assert ckpt._pending is None
    ckpt.save(engine, 2, {"loader": {}})  # waits for the async one first (collective)
    ckpt.close()
    Path(root, f"done{rank}").write_text("ok")
    from train.harness.dist import shutdown

    shutdown()  # barrier first: a gloo group torn down with work in flight can abort the process


@pytest.mark.slow
def test_wait_is_collective_whatever_each_rank_polled(tmp_path):
    ctx = mp.start_processes(_rank, args=(2, free_port(), str(tmp_path)), nprocs=2, start_method="spawn",
                             join=False)
    for _ in range(120):
        if ctx.join(timeout=1):
            break
    else:
        for proc in ctx.processes:
            proc.kill()
        pytest.fail("the ranks did not finish in 120 s (wait() entered its barrier on one rank only)")
    assert [(tmp_path / f"done{r}").read_text() for r in range(2)] == ["ok", "ok"]
    assert sorted(p.name for p in tmp_path.glob("step_*")) == ["step_00000001", "step_00000002"]
