"""The step's agreement (train/loop.py ``_agree``) at 4,096 ranks: one rank of the job on
the fake process group gathers into one (world, k) table kept from step to step, with no
tensor a rank; on 2 gloo ranks that table is the one the list-of-tensors all-gather gave,
and the decisions read from it are every rank's."""
from __future__ import annotations

import datetime
import json
import os
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from launcher.local import free_port
from train.harness.faults import Faults
from train.loop import StepTable, _agree
from train.steptimes import FIELDS, StepClock

from conftest import FAKE_WORLD as WORLD  # noqa: E402


def _task(world: int, code: int = 0):
    watchdog = SimpleNamespace(phase=lambda *_: None, progress=lambda *_: None)
    return SimpleNamespace(ctx=SimpleNamespace(world_size=world), flag=SimpleNamespace(code=code, agreed_requeue=False),
                           faults=Faults(), watchdog=watchdog)


def _engine(peak: int):
    return SimpleNamespace(peak_reserved_bytes=lambda: None, peak_memory_bytes=lambda: peak)


def test_one_table_kept_across_steps_at_4096_ranks(fake_world, monkeypatch):
    made = []
    for name in ("empty_like", "stack"):  # the list-based gather made W of the one, stacked them with the other
        real = getattr(torch, name)
        monkeypatch.setattr(torch, name, lambda *a, _real=real, _name=name, **k: made.append(_name) or _real(*a, **k))
    table, clock = StepTable(WORLD), StepClock(torch.device("cpu"))
    task, engine = _task(WORLD), _engine(1 << 20)
    agreed = _agree(task, engine, 0, torch.tensor(2.0), torch.tensor(1.0), False, clock, gathered=table)
    first = table.buffer
    assert first.shape == (WORLD, 7 + len(FIELDS)) and first.dtype == torch.float64
    made_in_first = made.count("empty_like")
    _agree(task, engine, 1, torch.tensor(2.0), torch.tensor(1.0), False, clock, gathered=table)
    assert table.buffer is first and table.buffer.data_ptr() == first.data_ptr()
    assert made.count("empty_like") == made_in_first == 0, made
    assert made.count("stack") <= 2  # the loss and grad norm's own stack, once a step: not one a rank
    assert len(agreed.times) == WORLD and not agreed.preempted


def test_a_new_width_or_dtype_makes_a_new_table(fake_world):
    table = StepTable(WORLD)
    a = table.gather(torch.ones(3, dtype=torch.float64))
    assert table.gather(torch.ones(3, dtype=torch.float64)) is a
    assert table.gather(torch.ones(4, dtype=torch.float64)).shape == (WORLD, 4)
    assert table.gather(torch.ones(4, dtype=torch.float32)).dtype == torch.float32


def _rank(rank: int, world: int, port: int, out: str) -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=30))
    local = torch.arange(5, dtype=torch.float64) + 10 * rank
    listed = [torch.empty_like(local) for _ in range(world)]  # the former way
    dist.all_gather(listed, local)
    table = StepTable(world)
    same = [bool(torch.equal(table.gather(local), torch.stack(listed))) for _ in range(2)]
    # Rank 1 got a signal (code 1), rank 0 asks for a save: every rank agrees on both.
    steps, clock = StepTable(world), StepClock(torch.device("cpu"))
    ptrs = []
    for step in range(2):
        agreed = _agree(_task(world, code=rank), _engine(100 * (rank + 1)), step, torch.tensor(float(rank + 1)),
                        torch.tensor(0.5), rank == 0, clock, gathered=steps)
        ptrs.append(steps.buffer.data_ptr())
    Path(out, f"rank{rank}.json").write_text(json.dumps(
        {"same": same, "reused": ptrs[0] == ptrs[1], "loss": agreed.loss, "peak": agreed.peak_mem,
         "preempted": agreed.preempted, "save_due": agreed.save_due}))
    dist.barrier()
    dist.destroy_process_group()


@pytest.mark.slow
def test_two_gloo_ranks_gather_the_list_based_table(tmp_path):
    mp.start_processes(_rank, args=(2, free_port(), str(tmp_path)), nprocs=2, start_method="spawn")
    for rank in range(2):
        got = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert got == {"same": [True, True], "reused": True, "loss": 1.5, "peak": 200, "preempted": True,
                       "save_due": True}, (rank, got)
